"""Paged KV in `kdtree validate` (engine/validate/paged_checks.py): the built-in engine's
paged_attention and paged_compact pass the committed paged_kv cases in float32 and
bfloat16; an adapter per paging bug fails the row that names it; a v1 adapter sees the
rows skipped, saying why; a required paged capability no fixture checks is a FAIL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kdtr_format
from engine.adapter import PagedKernels, TorchAdapter, page_rows
from engine.validate import GOLDEN_DIR, Status, ValidateError, validate
from engine.validate.checked import CheckedV2
from engine.validate.paged_checks import ATTENTION, COMPACTION, NEEDS_V2, PAGED_ROWS, paged_checks
from engine.validate.protocol_v2 import PerRequest, offsets_of, sizes

PAGED = GOLDEN_DIR / "kernels" / "paged_kv.kdtr"
CAPS = {cap for needs in PAGED_ROWS.values() for cap in needs}


@pytest.fixture(scope="module")
def reader():
    if not PAGED.exists():
        pytest.skip(f"golden fixture {PAGED} is absent (generate it with `refgen generate --all`)")
    with kdtr_format.open(PAGED) as opened:
        yield opened


def rows(adapter, reader, caps=CAPS, dtype="float32") -> dict[str, object]:
    return {c.name: c for c in paged_checks(CheckedV2(adapter), caps, reader, "paged_kv.kdtr", dtype)}


def one_dir(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / Path(name).name).symlink_to(GOLDEN_DIR / name)
    return tmp_path


# ---- the built-in engine ----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_builtin_engine_passes_every_paged_row(reader, dtype):
    report = validate(None, PAGED, dtype=dtype)                   # one file: no presets' invariant sections
    found = {c.name: c for c in report.checks if c.section == "paged_kv.kdtr"}
    assert list(found) == list(PAGED_ROWS)
    assert found[ATTENTION].status in (Status.EXACT, Status.WITHIN), found[ATTENTION].text()
    assert found[COMPACTION].status is Status.EXACT, found[COMPACTION].text()
    rule = reader.metadata["tolerances" if dtype == "float32" else "tolerances_bf16"]["o_lat"]
    assert rule["atol"] <= found[ATTENTION].tolerance <= rule["atol"] * 1.5        # judged by this regime's rule
    assert ("tolerances_bf16" in found[ATTENTION].regime) == (dtype == "bfloat16")


class FakeKernels:
    """kernels_cuda's paged kernels as their signatures promise (branch pkern), in plain torch on the
    CPU: TorchAdapter's CUDA branch hands them its arguments, they answer as the kernels would."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def verify(self, q_lat, q_pe, c_kv, k_pe, context, tree_sizes, q_offsets, block_table, visibility, scale):
        assert block_table.dtype == torch.int32 and visibility.dtype == torch.int32
        assert torch.equal(tree_sizes, sizes(q_offsets))
        self.calls.append("verify")
        o_lat = TorchAdapter().paged_attention(q_lat, q_pe, c_kv, k_pe, block_table, q_offsets, context, visibility,
                                               scale)
        return o_lat, torch.zeros(o_lat.shape[:2])

    def compact(self, c_kv, k_pe, starts, accepted, accept_len, block_table=None):
        """c_kv [layers, P, page, R] in place: slot starts[b] + k <- starts[b] + accepted[b, k], k < accept_len[b]."""
        assert c_kv.dim() == 4 and accepted.dtype == torch.int64 and block_table is not None
        self.calls.append("compact")
        page = c_kv.shape[2]
        for b in range(len(starts)):
            for k in range(int(accept_len[b])):
                src, dst = int(starts[b] + accepted[b, k]), int(starts[b]) + k
                for pool in (c_kv, k_pe):
                    pool[:, block_table[b, dst // page], dst % page] = pool[:, block_table[b, src // page], src % page]


def test_the_cuda_branch_hands_the_paged_kernels_their_signatures(reader):
    adapter, fake = TorchAdapter(), FakeKernels()
    adapter.paged = PagedKernels(fake.verify, fake.compact)
    found = rows(adapter, reader)
    assert found[ATTENTION].status in (Status.EXACT, Status.WITHIN), found[ATTENTION].text()
    assert found[COMPACTION].status is Status.EXACT, found[COMPACTION].text()
    assert set(fake.calls) == {"verify", "compact"}


def test_page_rows_finds_slots_through_the_table_and_refuses_minus_one_entries():
    table = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32)                   # page size 2, pool of 3 pages
    page, row = page_rows(table, torch.tensor([0, 3]), torch.tensor([2, 1]), 2, 3)
    assert page.tolist() == [2, 2, 1] and row.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="not one of the pool's 3 pages"):
        page_rows(table, torch.tensor([0, 3]), torch.tensor([3, 1]), 2, 3)           # request 0's slot 2: entry -1
    with pytest.raises(ValueError, match="past its 2 entries"):
        page_rows(table, torch.tensor([0, 3]), torch.tensor([2, 2]), 2, 3)           # request 1's slot 4


# ---- one adapter per paging bug, each failing its row ----

def _pages_held(table: torch.Tensor) -> torch.Tensor:
    return (table >= 0).sum(1)


class IgnoresTable(TorchAdapter):
    """Pages read in order, as if the pool held each request's pages one after the other:
    request b's j-th page taken as page (pages of requests before b) + j."""

    def _in_order(self, table):
        held = _pages_held(table)
        first = offsets_of(held)[:-1]
        return torch.where(table >= 0, first[:, None] + torch.arange(table.shape[1]), -1).to(table.dtype)

    def paged_attention(self, q_lat, q_pe, c_kv, k_pe, table, *rest):
        return super().paged_attention(q_lat, q_pe, c_kv, k_pe, self._in_order(table), *rest)

    def paged_compact(self, c_kv, k_pe, table, *rest):
        return super().paged_compact(c_kv, k_pe, self._in_order(table), *rest)


class ReadsPastLastPage(TorchAdapter):
    """Attention that also reads the table entry after a request's last page, a -1, as a page
    (page -1: the pool's last, as an unchecked index reads it), its slots taken as context."""

    def paged_attention(self, q_lat, q_pe, c_kv, k_pe, table, q_offsets, contexts, bits, scale):
        n, page = sizes(q_offsets), c_kv.shape[1]
        keys = contexts + n
        past = torch.nn.functional.pad(table, (0, 1), value=-1)[torch.arange(len(table)), -(-keys // page)].long()
        c_rows, k_rows = [], []
        for b in range(len(table)):                        # the page past the last first, then the request's keys
            slots = torch.arange(int(keys[b]))
            pages, rows_ = table[b, slots // page].long(), slots % page
            c_rows += [c_kv[past[b]], c_kv[pages, rows_]]
            k_rows += [k_pe[past[b]], k_pe[pages, rows_]]
        return self.attention(q_lat, q_pe, torch.cat(c_rows), torch.cat(k_rows), q_offsets,
                              offsets_of(keys + page)[:-1], contexts + page, bits, scale)


class WritesFirstPage(TorchAdapter):
    """Compaction that also writes each moved row at its slot's row of the request's first page
    (requests 0 and 1 share theirs: a prompt's page)."""

    def paged_compact(self, c_kv, k_pe, table, starts, accepted, accept_offsets):
        c_kv, k_pe = super().paged_compact(c_kv, k_pe, table, starts, accepted, accept_offsets)
        page = c_kv.shape[1]
        for b, length in enumerate(sizes(accept_offsets).tolist()):
            slots = starts[b] + torch.arange(length)
            own, first = page_rows(table, starts[b:b + 1].clone(), torch.tensor([length]), page, len(c_kv)), \
                int(table[b, 0])
            for pool in (c_kv, k_pe):
                pool[first, slots % page] = pool[own[0], own[1]]
        return c_kv, k_pe


class OtherRequestsTable(TorchAdapter):
    """Compaction through the previous request's block-table row, its -1 entries read as page -1
    (the pool's last, as an unchecked index reads it)."""

    def paged_compact(self, c_kv, k_pe, table, *rest):
        other = table.roll(1, 0)
        return super().paged_compact(c_kv, k_pe, torch.where(other < 0, len(c_kv) - 1, other).to(table.dtype), *rest)


class MovesLatentOnly(TorchAdapter):
    """Compaction that moves c_kv and leaves the rotary pool as it was."""

    def paged_compact(self, c_kv, k_pe, *rest):
        return super().paged_compact(c_kv, k_pe, *rest)[0], k_pe


SAYS = {ATTENTION: r"\(case attention_\w+ request \d+\)$", COMPACTION: r"pages differ; .* \(case compact_\w+\)$"}


@pytest.mark.parametrize("broken, caught, says", [
    (IgnoresTable, {ATTENTION, COMPACTION}, ""),
    (ReadsPastLastPage, {ATTENTION}, ""),
    (WritesFirstPage, {COMPACTION}, "compaction wrote page"),
    (OtherRequestsTable, {COMPACTION}, "compaction wrote page"),
    (MovesLatentOnly, {COMPACTION}, "holds the wrong row"),
], ids=["ignores the table", "reads a -1 entry", "writes a shared page", "another request's table", "k_pe unmoved"])
def test_each_paging_bug_fails_its_row(reader, broken, caught, says):
    found = rows(broken(), reader)
    failed = {name for name, c in found.items() if c.status is Status.FAIL}
    assert failed == caught, {name: c.text() for name, c in found.items()}
    for name in caught:
        assert re.search(SAYS[name], found[name].detail) and says in found[name].detail, found[name].detail


def test_a_write_into_a_shared_page_names_the_page_and_its_readers(reader):
    detail = rows(WritesFirstPage(), reader, {"paged_compact"})[COMPACTION].detail
    shared = {case["name"]: case["shared_pages"] for case in reader.metadata["cases"]}
    case = detail.rsplit("(case ", 1)[1].rstrip(")")
    page = int(detail.split("compaction wrote page ", 1)[1].split(",")[0])
    assert page in shared[case] and "which request 0 reads (a page requests 0, 1 share)" in detail, detail


# ---- protocol 1 and requirements ----

def test_a_v1_adapter_sees_the_paged_rows_skipped_saying_why(tmp_path):
    report = validate(PerRequest(TorchAdapter()), one_dir(tmp_path, "kernels/paged_kv.kdtr"), require="none")
    found = [c for c in report.checks if c.section == "paged_kv.kdtr"]
    assert [c.name for c in found] == list(PAGED_ROWS)
    assert all(c.status is Status.SKIPPED and c.detail == NEEDS_V2 for c in found), [c.text() for c in found]
    assert "paged KV needs protocol 2" in NEEDS_V2


def test_a_v1_adapter_cannot_declare_a_paged_capability():
    class DeclaresPaged:
        capabilities = ("accept", "paged_attention")
        accept = staticmethod(lambda parents, tokens, choices: None)

    with pytest.raises(ValidateError, match="declares capability 'paged_attention', which needs protocol 2"):
        validate(DeclaresPaged(), GOLDEN_DIR / "kernels" / "accept_compact.kdtr")


def test_a_required_paged_capability_no_fixture_checks_fails(tmp_path):
    directory = one_dir(tmp_path, "kernels/accept_compact.kdtr")
    report = validate(TorchAdapter(), directory)                      # declared: shown, not failed
    (row,) = [c for c in report.checks if c.name == "capability paged_attention"]
    assert row.status is Status.SKIPPED and "no fixture in" in row.detail and not report.failed
    report = validate(TorchAdapter(), directory, require="accept,paged_attention")
    (row,) = [c for c in report.checks if c.name == "capability paged_attention"]
    assert row.status is Status.FAIL and "no check of" in row.detail and report.failed

