"""Protocol v2 (engine/validate/door/protocol_v2.py): the checked v2 proxy, the v1 view of a v2
adapter, the batched checks and their timing. The worked example passes; a broken v2
adapter per class of bug that a batch of one hides (a leak between the requests of a batch,
wrong ragged offsets, compaction that leaves rejected KV visible or moves nothing) fails
the batched row that names it while every per-request row passes; the built-in engine
goes through v2 and is timed per stage. (test_rows.py: a plant per batched row, wrong only in
a later request.)"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kdtr_format
from engine.adapter import TorchAdapter
from engine.validate.rows import batched_model
from engine.validate import REPO_ROOT, AdapterFault, Status, ValidateError, validate, write_json
from engine.validate.rows.batched import Request, build_rows
from engine.validate.rows.batched_model import STAGES
from engine.validate.door.checked import CheckedV2
from engine.validate.door.protocol_v2 import PerRequest, offsets_of, sizes, to_padded, to_ragged
from refgen.ddtree import build_tree as refgen_build, topk_logprobs as refgen_topk

EXAMPLE = REPO_ROOT / "docs" / "examples" / "torch_v2_adapter.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("torch_v2_adapter", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


def fixtures(golden: Path, tmp_path: Path, *names: str) -> Path:
    """A directory of links to golden fixtures."""
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(golden / name)
    return tmp_path


def failing(report) -> set[str]:
    return {c.name for c in report.checks if c.status is Status.FAIL}


def the(report, name: str):
    (check,) = [c for c in report.checks if c.name == name]
    return check


# ---- the worked example and the built-in engine ----

def test_the_example_passes_every_fixture_with_its_batched_rows_timed(golden, tmp_path):
    report = validate(example.PagedAdapter(), golden)
    assert not report.failed, report.summary()
    ran = {c.name for c in report.checks if c.name.startswith("batched") and c.status is not Status.SKIPPED}
    assert ran == {"batched prefill logits", "batched top-k log-probs", "batched verify logits", "batched accept",
                   "batched cache compaction", "batched DDTree tokens", "batched KV compaction"}
    write_json(report, tmp_path / "report.json")
    rows = [c for c in json.loads((tmp_path / "report.json").read_text())["checks"]
            if c["name"] == "batched DDTree tokens"]
    for row in rows:
        seconds = row["tables"]["stage_seconds"]
        assert seconds.pop("device") == "cpu"
        assert set(seconds) == {"prefill", "topk", "verify", "accept", "compact"}    # no tree, no compile
        assert all(s > 0 for s in seconds.values())
        assert row["tables"]["acceptance"]["rounds"] > 0 and "stage ms on cpu" in row["detail"]


def test_the_builtin_engine_goes_through_v2_and_is_timed_per_stage(golden, tmp_path, small_model_fixture,
                                                                   builtin_decode_only):
    builtin_decode_only()
    directory = fixtures(golden, tmp_path, "kernels/tree_build.kdtr", "kernels/accept_compact.kdtr",
                         "kernels/verify_attention.kdtr")
    (directory / "tiny2.kdtr").symlink_to(small_model_fixture)
    report = validate(None, directory)
    assert not report.failed, report.summary()
    batched = [c for c in report.checks if c.name.startswith("batched")]
    assert len(batched) == 9 + 3 + 2 + 1
    assert all(c.status in (Status.EXACT, Status.WITHIN) for c in batched), [(c.name, c.detail) for c in batched]
    tokens = the(report, "batched DDTree tokens")
    seconds = dict(tokens.tables["stage_seconds"])
    assert seconds.pop("device") == "cpu" and tuple(seconds) == STAGES and all(s > 0 for s in seconds.values())
    assert re.search(r"stage ms on cpu \(5 requests, \d+ rounds\): prefill [\d.]+, topk", tokens.detail)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA variant: no CUDA GPU is visible "
                                                          "(torch.cuda.is_available() is False)")
@pytest.mark.parametrize("make", [lambda: TorchAdapter("cuda"), lambda: example.PagedAdapter("cuda")],
                         ids=["engine", "example"])
def test_on_cuda_the_batched_rows_pass_and_name_the_gpu(golden, tmp_path, make):
    adapter = make()
    directory = fixtures(golden, tmp_path, "tiny.kdtr", "tiny2.kdtr", "kernels/tree_build.kdtr",
                         "kernels/accept_compact.kdtr", "kernels/verify_attention.kdtr")
    report = validate(adapter, directory, device="cuda", require="none")
    assert not report.failed, [(c.section, c.name, c.detail) for c in report.checks if c.status is Status.FAIL]
    if isinstance(adapter, TorchAdapter):
        assert adapter.backends == {"stages": "cuda", "attention": "cuda"}, adapter.backends
    for row in (c for c in report.checks if c.name == "batched DDTree tokens"):
        device = row.tables["stage_seconds"]["device"]
        assert device.startswith("cuda:") and torch.cuda.get_device_name() in device


# ---- broken v2 adapters: each class of bug a batch of one hides ----

class SharedPages(example.PagedAdapter):
    """A leak between requests: pages looked up in the block table without the request, so
    every request writes its KV into request 0's pages (a batch of one has only request 0)."""

    def _pages(self, request, slots):
        return self.table.flatten()[slots // example.PAGE], slots % example.PAGE


class PathIndexAsFlat(example.PagedAdapter):
    """Wrong ragged offsets: a compaction target's index along its request's path taken as its
    row in the batch's flat list of accepted nodes (the same in a batch of one)."""

    def _moves(self, starts, accepted, accept_offsets):
        request, source, _ = super()._moves(starts, accepted, accept_offsets)
        return request, source, starts[request] + torch.arange(len(accepted), device=self.device)


class AppendsAfterRejected(example.PagedAdapter):
    """Compaction that leaves the rejected KV visible: the engine keeps its own KV length and
    appends each forward at it, and compaction moves the path without cutting the length
    back to the committed one, so the next forward sees the rejected nodes as context."""

    def reset(self, batch, max_len):
        super().reset(batch, max_len)
        self.kv_length = torch.zeros(batch, dtype=torch.int64, device=self.device)

    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        logits = super().forward(tokens, positions, offsets, self.kv_length, visibility_bits)
        self.kv_length = self.kv_length + sizes(offsets)
        return logits


class PathIgnored(example.PagedAdapter):
    """Compaction that assumes the accepted path is a prefix of tree order: it moves nothing."""

    def compact_cache(self, starts, accepted, accept_offsets):
        return None


@pytest.mark.parametrize("broken, caught", [
    (SharedPages, {"batched verify logits", "batched cache compaction", "batched DDTree tokens"}),
    (PathIndexAsFlat, {"batched cache compaction"}),
    (PathIgnored, {"batched cache compaction"}),
], ids=["leak", "ragged offsets", "path ignored"])
def test_bugs_a_batch_of_one_hides_fail_only_batched_rows(small_model_fixture, broken, caught):
    report = validate(broken(), small_model_fixture, require="none")
    assert failing(report) == caught, [(c.name, c.detail) for c in report.checks if c.status is Status.FAIL]
    for name in caught:
        assert re.search(r"request \d+ of a batch of 5", the(report, name).detail), the(report, name).detail


def test_compaction_that_leaves_rejected_kv_visible_fails_the_next_round(small_model_fixture):
    """Round 0 reads only the prefill's KV and passes; every later round reads what compaction
    left and fails, naming the round it read from (v1's restated path catches it too)."""
    report = validate(AppendsAfterRejected(), small_model_fixture, require="none")
    assert the(report, "batched verify logits").status is Status.WITHIN
    compaction = the(report, "batched cache compaction")
    assert compaction.status is Status.FAIL
    assert re.search(r"round (\d+); request \d+ of a batch of 5; reads the KV compact_cache left after round \d+",
                     compaction.detail), compaction.detail
    assert "accepted path restated causally" in the(report, "verify logits").detail


def test_poison_catches_stale_kv_where_no_round_rejects_a_node(small_model_fixture, monkeypatch):
    """Trace t4's trees are the root alone (block size 1), so no round of it rejects a node:
    only the poison its even rounds carry leaves stale slots for AppendsAfterRejected to see."""
    found = {}
    monkeypatch.setattr(batched_model._Run, "rows", lambda run: found.update(run.found) or [])
    with kdtr_format.open(small_model_fixture) as reader:
        assert reader.metadata["traces"][4]["ddtree"]["block_size"] == 1
        batched_model.batched_model_checks(CheckedV2(AppendsAfterRejected()), {"model"}, reader, "tiny2.kdtr")
    stale = [c.detail for c in found["batched cache compaction"] if c.status is Status.FAIL and "trace t4 " in c.detail]
    assert stale and "trace t4 round 1; request 4 of a batch of 5; reads the KV compact_cache left after round 0, " \
                     "its rejected slots poisoned" in stale[0], stale


class DirtyWords(TorchAdapter):
    """Compile that leaves junk in the visibility words past a request's own tree (a batch of
    one has no such words: its widest tree is its own)."""

    def compile_trees(self, parents, depths, node_offsets, starts):
        positions, bits, first_child, next_sibling = super().compile_trees(parents, depths, node_offsets, starts)
        counts = sizes(node_offsets)
        own = torch.repeat_interleave((counts + 31) // 32, counts)                      # [N] words per row
        junk = torch.arange(bits.shape[1])[None, :] >= own[:, None]
        return positions, torch.where(junk, 1, bits).to(bits.dtype), first_child, next_sibling


class SharedUniforms(TorchAdapter):
    """Sampling that reads every request's uniforms from request 0's rows."""

    def sample_accept(self, parents, tokens, logits, node_offsets, temperature, uniforms):
        request = torch.repeat_interleave(torch.arange(len(node_offsets) - 1), sizes(node_offsets))
        index = (torch.arange(len(parents)) - node_offsets[request]).clamp(max=int(node_offsets[1]) - 1)
        return super().sample_accept(parents, tokens, logits, node_offsets, temperature, uniforms[index])


@pytest.mark.parametrize("broken, fixture, caught", [
    (DirtyWords, "kernels/tree_build.kdtr", {"batched tree compile"}),
    (SharedUniforms, "model", {"batched sample accept", "batched DDTree tokens"}),
], ids=["words past a tree", "shared uniforms"])
def test_stage_bugs_a_batch_of_one_hides_fail_their_batched_row(golden, tmp_path, small_model_fixture, broken, fixture,
                                                                caught):
    source = small_model_fixture if fixture == "model" else fixtures(golden, tmp_path, fixture)
    report = validate(broken(), source, require="none")
    assert failing(report) == caught, [(c.name, c.detail) for c in report.checks if c.status is Status.FAIL]


def test_a_tree_beyond_its_possible_nodes_gets_a_build_call_of_its_own():
    """Padding a request's top-k with -inf columns cannot change its tree unless its budget
    exceeds the nodes its own columns make; then the padded nodes would be popped."""
    rng = np.random.default_rng(3)
    reader, requests = {}, []
    for name, (k, budget) in {"x": (2, 100), "y": (4, 5)}.items():          # x: budget > 2 + 4 possible nodes
        logits = rng.normal(size=(2, 16))
        lp, ids = refgen_topk(logits, k)
        tree = refgen_build(lp, ids, budget).with_root(3)
        reader.update({f"{name}/topk_lp": lp, f"{name}/topk_id": ids, **{f"{name}/{w}": getattr(tree, w)
                                                                           for w in ("parents", "tokens", "depths", "scores")}})
        requests.append(Request(f"case {name}", reader, f"{name}/", budget, 3))
    rows = []
    build_rows(CheckedV2(TorchAdapter()), "s", requests, rows)
    assert len(rows) == 8 and all(c.status is Status.EXACT for c in rows), [c.detail for c in rows]
    assert len(reader["x/parents"]) == 7


def test_compaction_kernel_offsets_fail_the_batched_kernel_row(golden, tmp_path):
    report = validate(PathIndexAsFlat(), fixtures(golden, tmp_path, "kernels/accept_compact.kdtr"), require="none")
    assert failing(report) == {"batched KV compaction"}
    assert the(report, "KV compaction").status is Status.EXACT


# ---- the checked v2 proxy ----

class Returns:
    """A v2 adapter whose every method returns what it was built with."""

    protocol, device = 2, "cpu"

    def __init__(self, value):
        self.value = value

    def __getattr__(self, name):
        if name == "value":
            raise AttributeError(name)
        return lambda *args: self.value


def ints(*values):
    return torch.tensor(values, dtype=torch.int64)


TREE = (ints(-1, 0, 0, -1, 0), ints(5, 6, 7, 1, 2), ints(7, 1, 2, 3, 4), ints(0, 3, 5))       # two trees: 3 + 2
FORWARD = (ints(1, 2), ints(0, 1), ints(0, 2), ints(0), torch.ones(2, 1, dtype=torch.int32))
POOLS = (torch.zeros(3, 4, 8), torch.zeros(3, 4, 2))                   # paged: 3 pages of 4 slots
TABLE = torch.tensor([[0, 2]], dtype=torch.int32)


@pytest.mark.parametrize("method, args, value, message", [
    ("forward", FORWARD, np.zeros((2, 4), np.float32),
     "forward() output logits is a numpy.ndarray, expected a torch.Tensor on cpu"),
    ("forward", FORWARD, torch.zeros(2, 4, device="meta"), "output logits is on meta, expected the adapter's device cpu"),
    ("forward", FORWARD, torch.tensor([[0.0, float("nan")]] * 2), "forward() output logits holds 2 NaN values"),
    ("forward", FORWARD, torch.zeros(3, 4), "output logits has shape [3, 4], expected [2, 4]"),
    ("accept", TREE, (ints(0, 2, 0).double(), ints(0, 2, 3), ints(1, 2)),
     "accept() output accepted has dtype torch.float64, expected an integer dtype"),
    ("accept", TREE, (ints(0, 2, 0), ints(1, 2, 3), ints(1, 2)), "output accept_offsets starts at 1, expected 0"),
    ("accept", TREE, (ints(0, 2, 0), ints(0, 2, 1), ints(1, 2)), "accept_offsets decreases at request 1 (2, then 1)"),
    ("accept", TREE, (ints(0, 2, 0), ints(0, 2, 2), ints(1, 2)), "accept_offsets ends at 2, expected A = 3"),
    ("accept", TREE, (ints(0, 2, 0), ints(0, 3), ints(1, 2)), "accept_offsets has shape [2], expected [3] (B1 = 3)"),
    ("accept", TREE, (ints(0, 2, 0), ints(0, 2, 3)), "accept() returned 2 outputs, expected 3"),
    ("build_trees", (torch.zeros(2, 1, 1), torch.zeros(2, 1, 1, dtype=torch.int64), ints(1, 0), ints(4, 5)),
     (ints(0, 2, 3), ints(-1, 0, -1), ints(4, 9, 5), ints(0, 1)), "output depths has shape [2], expected [3] (N = 3)"),
    ("compile_trees", (TREE[0], ints(0, 1, 1, 0, 1), TREE[3], ints(4, 9)),
     (ints(4, 5, 5, 9, 10), torch.zeros(5, 2, dtype=torch.int32), ints(1, -1, -1, 1, -1), ints(-1, 2, -1, -1, -1)),
     "visibility_bits has shape [5, 2], expected [5, 1] (N = 5, W = 1)"),
    ("compile_trees", (TREE[0], ints(0, 1, 1, 0, 1), TREE[3], ints(4, 9)),
     (ints(4, 5, 5, 9, 10), torch.zeros(5, 1, dtype=torch.int64), ints(1, -1, -1, 1, -1), ints(-1, 2, -1, -1, -1)),
     "visibility_bits has dtype torch.int64, expected uint32 or int32 words"),
    ("paged_attention", (torch.zeros(2, 1, 8), torch.zeros(2, 1, 2), *POOLS, TABLE, ints(0, 2), ints(3),
                         torch.ones(2, 1, dtype=torch.int32), 1.0),
     torch.zeros(2, 1, 2), "paged_attention() output o_lat has shape [2, 1, 2], expected [2, 1, 8]"),
    ("paged_compact", (*POOLS, TABLE, ints(3), ints(0, 2), ints(0, 2)), (POOLS[0][:2], POOLS[1]),
     "paged_compact() output c_kv_pages has shape [2, 4, 8], expected [3, 4, 8]"),
    ("paged_compact", (*POOLS, TABLE, ints(3), ints(0, 2), ints(0, 2)), (POOLS[0], POOLS[1][..., :1]),
     "output k_pe_pages has shape [3, 4, 1], expected [3, 4, 2]"),
])
def test_the_v2_proxy_holds_every_output_to_its_declaration(method, args, value, message):
    with pytest.raises(AdapterFault, match=re.escape(message)):
        getattr(CheckedV2(Returns(value)), method)(*args)


class AcceptOnly:
    """The built-in engine's accept alone, as a v2 adapter (`host` True: its accepted path on the host)."""

    name, protocol, device = "accept only (v2)", 2, "cpu"

    def __init__(self, host: bool = False) -> None:
        self.engine, self.host = TorchAdapter(), host

    def accept(self, parents, tokens, choices, node_offsets):
        accepted, bounds, next_roots = self.engine.accept(parents, tokens, choices, node_offsets)
        return (accepted.numpy() if self.host else accepted), bounds, next_roots


def test_a_v2_output_is_checked_on_the_per_request_rows_too(golden, tmp_path):
    directory = fixtures(golden, tmp_path, "kernels/accept_compact.kdtr")
    report = validate(AcceptOnly(), directory)
    assert not report.failed and the(report, "batched accept").status is Status.EXACT
    assert the(report, "KV compaction").status is Status.SKIPPED
    report = validate(AcceptOnly(host=True), directory)
    assert failing(report) == {"accept", "batched accept"}
    assert the(report, "accept").detail.startswith(
        "accept() output accepted is a numpy.ndarray, expected a torch.Tensor on cpu (case ")


class NoDevice(AcceptOnly):
    device = None


class Protocol3(AcceptOnly):
    protocol = 3


class NoCompactCache:
    protocol, device = 2, "cpu"
    load_weights = reset = forward = AcceptOnly.accept


@pytest.mark.parametrize("make, message", [
    (NoDevice, "a protocol 2 adapter names its device in a `device` attribute"),
    (Protocol3, "`protocol` must be 1 or 2, got 3"),
    (NoCompactCache, r"implements load_weights\(\), reset\(\), forward\(\) of capability 'model' but not "
                     r"compact_cache\(\)"),
])
def test_v2_adapters_that_cannot_be_checked_are_errors(golden, make, message):
    with pytest.raises(ValidateError, match=message):
        validate(make(), golden / "kernels" / "accept_compact.kdtr")


def test_per_request_presents_only_what_the_v2_adapter_implements():
    view = PerRequest(AcceptOnly())
    assert view.protocol == 1 and callable(view.accept)
    assert view.forward is None and view.build_tree is None and view.compact is None
    accepted, next_root = view.accept(np.array([-1, 0, 0]), np.array([5, 6, 7]), np.array([7, 1, 2]))
    assert accepted.tolist() == [0, 2] and int(next_root) == 2


def test_v1_adapters_have_no_batched_rows(golden, tmp_path):
    report = validate(PerRequest(TorchAdapter()), fixtures(golden, tmp_path, "kernels/accept_compact.kdtr"),
                      require="accept,compact")
    assert not report.failed and not [c for c in report.checks if c.name.startswith("batched")]


# ---- ragged helpers ----

@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 3))
def test_padded_and_ragged_are_inverse(counts, extra):
    counts = torch.tensor(counts)
    offsets = offsets_of(counts)
    values = torch.arange(int(counts.sum()) * 2).view(-1, 2)
    width = int(counts.max()) + extra
    padded = to_padded(values, offsets, width, fill=-7)
    assert torch.equal(sizes(offsets), counts) and torch.equal(to_ragged(padded, counts), values)
    for b, n in enumerate(counts.tolist()):
        assert torch.equal(padded[b, :n], values[offsets[b]:offsets[b + 1]]) and bool((padded[b, n:] == -7).all())


def test_in_bf16_the_batched_model_rows_are_skipped_saying_why(golden):
    """The routing watch that tells a bf16 routing flip from a bug follows one request at a time:
    in bf16 every batched model row is a skipped row naming that, none is judged."""
    path = golden / "tiny2.kdtr"
    adapter = CheckedV2(TorchAdapter())
    with kdtr_format.open(path) as reader:
        rows = batched_model.batched_model_checks(adapter, set(TorchAdapter.capabilities), reader, path.name,
                                                  "bfloat16")
    assert [c.name for c in rows] == list(batched_model.ROWS)
    assert all(c.status is Status.SKIPPED and "judged in float32 only" in c.detail for c in rows)
