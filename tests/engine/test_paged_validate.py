"""Paged KV in `kdtree validate` (engine/validate/rows/paged.py): the built-in engine's
paged_attention and paged_compact pass the committed paged_kv cases in float32 and
bfloat16; an adapter per paging bug fails the row that names it; a v1 adapter sees the
rows skipped, saying why; a required paged capability no fixture checks is a FAIL."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kdtr_format
from engine.adapter import TorchAdapter
from engine.attention import bind_attention, torch_attention
from engine.stages import TorchStages
from engine.validate import Status, ValidateError, validate
from engine.validate.door.checked import CheckedV2
from engine.validate.rows.paged import ATTENTION, COMPACTION, NEEDS_V2, PAGED_ROWS, paged_checks
from engine.validate.door.protocol_v2 import PerRequest, offsets_of, sizes

CAPS = {cap for needs in PAGED_ROWS.values() for cap in needs}


@pytest.fixture(scope="module")
def paged(golden) -> Path:
    return golden / "kernels" / "paged_kv.kdtr"


@pytest.fixture(scope="module")
def reader(paged):
    with kdtr_format.open(paged) as opened:
        yield opened


def rows(adapter, reader, caps=CAPS, dtype="float32") -> dict[str, object]:
    return {c.name: c for c in paged_checks(CheckedV2(adapter), caps, reader, "paged_kv.kdtr", dtype)}


def one_dir(golden: Path, tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / Path(name).name).symlink_to(golden / name)
    return tmp_path


# ---- the built-in engine ----

class RoundsItsOutput:
    """A bf16 attention kernel as accurate as one can be: the engine's float32 attention on the bf16
    inputs, its output rounded once to bf16. Its error grows with |o_lat| (half a bf16 ulp), so its
    worst element against atol + rtol |x| lies among the largest |x|, as a GPU kernel's may."""

    def bind(self, starts, n_new, new_visibility, num_slots):
        attend = torch_attention.bind(starts, n_new, new_visibility, num_slots)
        return lambda q_lat, *rest: attend(q_lat, *rest).to(torch.bfloat16).to(q_lat.dtype)


@pytest.mark.parametrize("dtype, attention", [("float32", None), ("bfloat16", None), ("bfloat16", RoundsItsOutput())],
                         ids=["float32", "bfloat16", "bfloat16-output rounded"])
def test_the_builtin_engine_passes_every_paged_row(paged, reader, dtype, attention):
    """Judged by the regime's rule, atol + rtol |x| at the worst element, whichever element that is:
    the tolerance reported lies between atol and the rule at the largest |expected| the cases hold."""
    adapter = None
    if attention is not None:
        adapter = TorchAdapter()
        adapter.attention_backend = attention
    report = validate(adapter, paged, dtype=dtype)                # one file: no presets' invariant sections
    found = {c.name: c for c in report.checks if c.section == "paged_kv.kdtr"}
    assert list(found) == list(PAGED_ROWS)
    assert found[ATTENTION].status in (Status.EXACT, Status.WITHIN), found[ATTENTION].text()
    assert found[COMPACTION].status is Status.EXACT, found[COMPACTION].text()
    rule = reader.metadata["tolerances" if dtype == "float32" else "tolerances_bf16"]["o_lat"]
    expected = "o_lat" if dtype == "float32" else "o_lat_bf16"
    largest = max(float(np.abs(reader[f"cases/{case['name']}/{expected}"]).max())
                  for case in reader.metadata["cases"] if case["op"] == "attention")
    assert rule["atol"] <= found[ATTENTION].tolerance <= rule["atol"] + rule["rtol"] * largest, found[ATTENTION].text()
    assert ("tolerances_bf16" in found[ATTENTION].regime) == (dtype == "bfloat16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA variant: no CUDA GPU is visible "
                                                          "(torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_paged_kernels_pass_every_paged_row(reader, dtype):
    """kernels_cuda's mla_verify_paged and compact_kv(block_table=), through the engine's CUDA backends."""
    adapter = TorchAdapter("cuda")
    assert adapter.backends == {"stages": "cuda", "attention": "cuda"}, adapter.backends
    found = rows(adapter, reader, dtype=dtype)
    assert found[ATTENTION].status in (Status.EXACT, Status.WITHIN), found[ATTENTION].text()
    assert found[COMPACTION].status is Status.EXACT, found[COMPACTION].text()


class PagedSeams:
    """The attention backend and stages the engine's paged cache uses, recording what TorchAdapter's
    paged methods hand them: the CUDA backend and stages take the same calls (`bind_paged`,
    compact_kv of a paged cache), so these are what runs on a GPU."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stages = TorchStages()

    def bind_paged(self, starts, n_new, new_visibility, block_table):
        self.calls.append("bind_paged")
        assert block_table.dtype == torch.int32 and block_table.dim() == 2

        def attend(q_lat, q_pe, c_kv, k_pe, scale):          # the pools [P, page, w]: gathered by the torch path
            slots = block_table.shape[1] * c_kv.shape[1]
            return bind_attention(torch_attention, starts, n_new, new_visibility, slots, block_table)(
                q_lat, q_pe, c_kv, k_pe, scale)
        return attend

    def compact_kv(self, cache, starts, accepted, accept_len):
        self.calls.append("compact_kv")
        assert cache.paged and cache.c_kv.dim() == 4
        moved = torch.arange(accepted.shape[1])[None, :] < accept_len[:, None]
        for slots in (starts[:, None] + accepted, starts[:, None] + torch.arange(accepted.shape[1])):
            entries = cache.block_table.long().gather(1, slots // cache.page_size)
            assert bool((entries[moved] >= 0).all()), "the stages are handed a slot on a -1 entry"
        self.stages.compact_kv(cache, starts, accepted, accept_len)


def test_the_paged_methods_go_through_the_engines_paged_seams(reader):
    adapter, seams = TorchAdapter(), PagedSeams()
    adapter.attention_backend, adapter.stages = seams, seams
    found = rows(adapter, reader)
    assert found[ATTENTION].status in (Status.EXACT, Status.WITHIN), found[ATTENTION].text()
    assert found[COMPACTION].status is Status.EXACT, found[COMPACTION].text()
    assert set(seams.calls) == {"bind_paged", "compact_kv"}


def test_a_request_with_an_empty_path_is_untouched_and_hands_no_minus_one_entry():
    """Request 0 sits the round out, its start past its only page; request 1's path [0, 2] moves its
    slot 3 to slot 2."""
    adapter, seams = TorchAdapter(), PagedSeams()
    adapter.stages = seams
    c_kv, k_pe = torch.arange(12.0).view(3, 2, 2), torch.arange(6.0).view(3, 2, 1)       # 3 pages of 2 slots
    table = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32)
    c_after, k_after = adapter.paged_compact(c_kv, k_pe, table, torch.tensor([2, 1]), torch.tensor([0, 2]),
                                             torch.tensor([0, 0, 2]))
    want_c, want_k = c_kv.clone(), k_pe.clone()
    want_c[1, 0], want_k[1, 0] = c_kv[1, 1], k_pe[1, 1]            # request 1: slot 2 (page 1 row 0) <- slot 3
    assert torch.equal(c_after, want_c) and torch.equal(k_after, want_k) and seams.calls == ["compact_kv"]


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
            for pool in (c_kv, k_pe):
                pool[table[b, 0], slots % page] = pool[table[b, slots // page].long(), slots % page]
        return c_kv, k_pe


class OtherRequestsTable(TorchAdapter):
    """Compaction through the previous request's block-table row, its -1 entries read as page -1
    (the pool's last, as an unchecked index reads it)."""

    def paged_compact(self, c_kv, k_pe, table, *rest):
        other = table.roll(1, 0)
        return super().paged_compact(c_kv, k_pe, torch.where(other < 0, len(c_kv) - 1, other).to(table.dtype), *rest)


class WritesSparePage(TorchAdapter):
    """Compaction that also writes each request's first moved row into a page no request holds."""

    def paged_compact(self, c_kv, k_pe, table, starts, accepted, accept_offsets):
        c_kv, k_pe = super().paged_compact(c_kv, k_pe, table, starts, accepted, accept_offsets)
        spare = sorted(set(range(len(c_kv))) - set(table.flatten().tolist()))[0]
        c_kv[spare, 0] = c_kv[table[0, int(starts[0]) // c_kv.shape[1]], int(starts[0]) % c_kv.shape[1]]
        return c_kv, k_pe


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
    (WritesSparePage, {COMPACTION}, "which no request holds"),
], ids=["ignores the table", "reads a -1 entry", "writes a shared page", "another request's table", "k_pe unmoved",
        "writes an unheld page"])
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

def test_a_v1_adapter_sees_the_paged_rows_skipped_saying_why(golden, tmp_path):
    report = validate(PerRequest(TorchAdapter()), one_dir(golden, tmp_path, "kernels/paged_kv.kdtr"), require="none")
    found = [c for c in report.checks if c.section == "paged_kv.kdtr"]
    assert [c.name for c in found] == list(PAGED_ROWS)
    assert all(c.status is Status.SKIPPED and c.detail == NEEDS_V2 for c in found), [c.text() for c in found]
    assert "paged KV needs protocol 2" in NEEDS_V2


def test_a_v1_adapter_cannot_declare_a_paged_capability(golden):
    class DeclaresPaged:
        capabilities = ("accept", "paged_attention")
        accept = staticmethod(lambda parents, tokens, choices: None)

    with pytest.raises(ValidateError, match="declares capability 'paged_attention', which needs protocol 2"):
        validate(DeclaresPaged(), golden / "kernels" / "accept_compact.kdtr")


def test_a_required_paged_capability_no_fixture_checks_fails(golden, tmp_path):
    directory = one_dir(golden, tmp_path, "kernels/accept_compact.kdtr")
    report = validate(TorchAdapter(), directory)                      # declared: shown, not failed
    (row,) = [c for c in report.checks if c.name == "capability paged_attention"]
    assert row.status is Status.SKIPPED and "no fixture in" in row.detail and not report.failed
    report = validate(TorchAdapter(), directory, require="accept,paged_attention")
    (row,) = [c for c in report.checks if c.name == "capability paged_attention"]
    assert row.status is Status.FAIL and "no check of" in row.detail and report.failed

