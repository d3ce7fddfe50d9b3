"""engine.validate: the comparisons, the report, the checking proxy and the capability
requirements; planted bugs in an adapter fail the check that names them, the false passes
of an adapter that implements nothing (or half of something) are errors, and a run in
which no check ran fails."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import engine.decode
import engine.validate.rows.engine
import kdtr_format
from kdtr_format import PRESETS
from engine.adapter import TorchAdapter
from engine.decode import ddtree_decode
from engine.stages import TorchStages
from engine.cli import main
from engine.validate import (CAPABILITIES, METHODS, SKIPPED_DETAIL, AdapterFault, Check,
                             CheckedAdapter, Status, ValidateError, capabilities, compare_close, compare_exact,
                             compare_tokens, find_fixtures, load_impl, merge, replayed_round,
                             resolve_capabilities, unpack_bits, validate)
from engine.validate.door.protocol_v2 import PerRequest


class Engine(PerRequest):
    """The built-in engine through protocol v1 (one request at a time, numpy), for the adapters
    below that plant a bug in one v1 method."""

    def __init__(self) -> None:
        super().__init__(TorchAdapter())


def fixture_dir(golden: Path, tmp_path: Path, *names: str) -> Path:
    """A fixture directory holding links to some golden fixtures."""
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(golden / name)
    return tmp_path


def rows(report, name: str) -> list[Check]:
    found = [c for c in report.checks if c.name == name]
    assert found, f"no {name!r} row in {[c.name for c in report.checks]}"
    return found


# ---- comparisons ----

def test_compare_close_reports_the_worst_element():
    expected = np.array([[1.0, 100.0], [-3.0, 0.0]])
    within = compare_close("s", "x", expected + [[1e-6, 6e-5], [0, 0]], expected, rtol=1e-6, atol=1e-6)
    assert within.status is Status.WITHIN
    assert within.error == pytest.approx(6e-5) and within.tolerance == pytest.approx(1e-6 + 1e-4)
    bad = compare_close("s", "x", expected + [[0, 0], [1e-3, 0]], expected, rtol=1e-6, atol=1e-6)
    assert bad.status is Status.FAIL and "[1, 0]" in bad.detail and bad.error == pytest.approx(1e-3)
    assert compare_close("s", "x", expected, expected, 0.0, 0.0).status is Status.EXACT
    assert compare_close("s", "x", expected * np.nan, expected, 1.0, 1.0).status is Status.FAIL
    assert "shape" in compare_close("s", "x", expected[0], expected, 1.0, 1.0).detail


def test_compare_exact_names_the_first_difference():
    assert compare_exact("s", "x", [1, 2, 3], np.array([1, 2, 3])).status is Status.EXACT
    check = compare_exact("s", "x", [1, 5, 3, 0], [1, 2, 3, 4], "case c")
    assert check.status is Status.FAIL and "2 differ; first at [1]: got 5, expected 2 (case c)" == check.detail
    assert compare_exact("s", "x", 3, 4).detail == "got 3, expected 4"


def test_a_path_of_the_wrong_length_shows_both_paths_and_where_they_part():
    longer = compare_exact("s", "accepted", [0, 1, 3, 4, 7], [0, 1, 3, 4], "case c")
    assert longer.status is Status.FAIL and longer.detail == (
        "5 values, expected 4: got [0, 1, 3, 4, 7], expected [0, 1, 3, 4]; first difference at [4]: got 7, "
        "expected none (past its end) (case c)")
    assert compare_exact("s", "accepted", [0, 2], [0, 1, 3, 4]).detail == (
        "2 values, expected 4: got [0, 2], expected [0, 1, 3, 4]; first difference at [1]: got 2, expected 1")
    long = compare_exact("s", "parents", np.arange(20), np.arange(21)).detail
    assert long.startswith("20 values, expected 21: got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ...]")
    assert long.endswith("first difference at [20]: got none (past its end), expected 20")
    assert compare_exact("s", "c_kv", np.zeros((2, 3)), np.zeros((3, 3))).detail == "shape [2, 3] != expected [3, 3]"


def test_merge_keeps_the_worst():
    checks = [Check("s", "a", Status.EXACT), Check("s", "a", Status.WITHIN, 1e-6, 1e-5),
              Check("s", "a", Status.FAIL, 3e-5, 1e-5, detail="round 3"), Check("s", "a", Status.WITHIN, 5e-6, 1e-5),
              Check("s", "a", Status.FAIL, 9e-5, 1e-5, detail="round 4")]
    merged = merge("s", "a", checks)
    assert (merged.status, merged.detail, merged.error) == (Status.FAIL, "round 3", 3e-5)   # all from one row
    within = merge("s", "a", checks[:2] + checks[3:4])
    assert within.status is Status.WITHIN and within.error == 5e-6 and within.detail == ""
    assert merge("s", "a", []).status is Status.SKIPPED


def test_a_rows_margin_is_reported_in_one_place():
    """The margin column and the detail speak of the same decision (the one deciding the
    status), and the detail never restates a margin."""
    near = compare_tokens("s", "t", [4, 9, 6], [4, 5, 6], [2.0, 1e-6, 3.0], 1e-4, "trace a")
    bug = compare_tokens("s", "t", [4, 5, 1], [4, 5, 6], [2.0, 1e-6, 0.442], 1e-4, "trace b")
    merged = merge("s", "t", [near, bug])
    assert merged.status is Status.FAIL and merged.margin == 0.442 and "trace b" in merged.detail
    assert "0.442" not in merged.detail and "margin" not in merged.detail
    assert merge("s", "t", [near]).margin == 1e-6


def test_token_sequences_compare_whole():
    assert compare_tokens("s", "t", [1, 2, 3, 4], [1, 2, 3], [1.0] * 3, 1e-4).status is Status.FAIL
    assert compare_tokens("s", "t", [1, 2], [1, 2, 3], [1.0] * 3, 1e-4).status is Status.FAIL
    assert compare_tokens("s", "t", [1, 2, 3], [1, 2, 3], [1.0] * 3, 1e-4).status is Status.EXACT


def test_unpack_bits():
    words = np.array([[0b101, 0], [0, 1], [-1, 1]], dtype=np.int64).astype(np.uint32).astype(np.int32)
    bits = unpack_bits(words, 33)
    assert bits[0].nonzero()[0].tolist() == [0, 2]
    assert bits[1].nonzero()[0].tolist() == [32]
    assert bits[2].all()


# ---- adapters: capabilities, declarations, requirements ----

class StagesOnly:
    """Accept and compaction through the built-in engine, nothing else."""

    name = "stages only"

    def __init__(self) -> None:
        self.engine = Engine()

    def accept(self, parents, tokens, choices):
        return self.engine.accept(parents, tokens, choices)

    def compact(self, c_kv, k_pe, start, accepted):
        return self.engine.compact(c_kv, k_pe, start, accepted)


class Nothing:
    name = "nothing"


def test_capabilities():
    assert capabilities(StagesOnly()) == {"accept", "compact"}
    assert capabilities(TorchAdapter()) == set(CAPABILITIES)
    assert set(TorchAdapter.capabilities) == set(CAPABILITIES)      # the built-in engine declares them all
    assert set(METHODS) == {m for methods in CAPABILITIES.values() for m in methods}
    assert resolve_capabilities(StagesOnly()) == ({"accept", "compact"}, {"accept", "compact"})
    assert resolve_capabilities(StagesOnly(), "none") == ({"accept", "compact"}, set())
    assert resolve_capabilities(StagesOnly(), "accept, tree") == ({"accept", "compact"}, {"accept", "tree"})


class NoReset(Engine):
    capabilities = None                  # undeclared: what it implements is what is checked
    reset = None


class DeclaresAttention(StagesOnly):
    capabilities = ("accept", "attention")


class DeclaresNonsense(StagesOnly):
    capabilities = ("accept", "warp_drive")


@pytest.mark.parametrize("make, message", [
    (Nothing, "adapter 'nothing' implements no capability"),
    (lambda: load_impl("os:getcwd"), "adapter str implements no capability"),
    (NoReset, r"implements load_weights\(\), forward\(\) of capability 'model' but not reset\(\)"),
    (DeclaresAttention, r"declares capability 'attention' but has no attention\(\)"),
    (DeclaresNonsense, "unknown capability warp_drive"),
])
def test_adapters_that_would_pass_by_accident_are_errors(golden, make, message):
    with pytest.raises(ValidateError, match=message):
        validate(make(), golden)


def test_unknown_required_capability_is_an_error(golden):
    with pytest.raises(ValidateError, match="--require names unknown capability warp"):
        validate(StagesOnly(), golden, require="accept,warp")


def test_missing_methods_are_skipped_not_failed_when_not_required(golden, tmp_path):
    directory = fixture_dir(golden, tmp_path, "tiny.kdtr", "kernels/accept_compact.kdtr", "kernels/tree_build.kdtr")
    report = validate(StagesOnly(), directory)
    assert not report.failed, report.summary()
    for name in ("prefill logits", "AR tokens", "tree build", "tree compile", "verify logits", "top-k log-probs"):
        assert all(c.status is Status.SKIPPED and c.detail == SKIPPED_DETAIL for c in rows(report, name))
    assert all(c.status is Status.EXACT for c in rows(report, "accept"))
    assert all(c.status is Status.EXACT for c in rows(report, "KV compaction"))


def test_a_required_capability_that_is_skipped_fails(golden, tmp_path):
    directory = fixture_dir(golden, tmp_path, "kernels/accept_compact.kdtr", "kernels/tree_build.kdtr")
    report = validate(StagesOnly(), directory, require="accept,compact,tree,attention")
    assert report.failed
    (tree,) = rows(report, "tree build")
    assert tree.status is Status.FAIL and "required capability tree is not implemented" in tree.detail
    (attention,) = rows(report, "capability attention")                   # no row of these fixtures needs it
    assert attention.status is Status.FAIL and "has no attention()" in attention.detail
    assert rows(report, "tree compile")[0].status is Status.SKIPPED        # not required


def test_a_declared_capability_no_fixture_checks_is_shown_and_fails_when_required(golden, tmp_path):
    class DeclaresCompact(StagesOnly):
        capabilities = ("accept", "compact")

    directory = fixture_dir(golden, tmp_path, "tiny2.kdtr")          # no compaction case in a model fixture
    report = validate(DeclaresCompact(), directory)           # a user's own fixture set: shown, not failed
    (row,) = rows(report, "capability compact")
    assert row.status is Status.SKIPPED and "no fixture in" in row.detail and not report.failed
    report = validate(DeclaresCompact(), directory, require="accept,compact")
    (row,) = rows(report, "capability compact")
    assert row.status is Status.FAIL and "no check of" in row.detail and report.failed


def test_a_run_in_which_no_check_ran_fails(golden, tmp_path, capsys):
    class AttentionOnly:
        def attention(self, q_lat, q_pe, c_kv, k_pe, visibility, scale):
            return Engine().attention(q_lat, q_pe, c_kv, k_pe, visibility, scale)

    directory = fixture_dir(golden, tmp_path, "kernels/accept_compact.kdtr")
    report = validate(AttentionOnly(), directory, require="none")
    assert report.executed == 0 and report.failed and "no check ran" in report.summary()
    impl = tmp_path / "attention_only.py"
    impl.write_text("from engine.adapter import TorchAdapter\n"
                    "from engine.validate.protocol_v2 import PerRequest\n"
                    "class AttentionOnly:\n"
                    "    def attention(self, *args):\n"
                    "        return PerRequest(TorchAdapter()).attention(*args)\n")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["validate", "--impl", f"{impl}:AttentionOnly", "--fixtures", str(directory), "--require", "none"])
    finally:
        torch.set_num_threads(threads)
    assert exit_info.value.code == 1 and "no check ran" in capsys.readouterr().out


# ---- the checking proxy ----

class Returns:
    """An adapter whose every method returns what it was built with."""

    def __init__(self, value):
        self.value = value

    def __getattr__(self, name):
        if name in METHODS:
            return lambda *args: self.value
        raise AttributeError(name)


TREE_INPUTS = (np.array([-1, 0, 0]), np.array([5, 6, 7]), np.array([7, 1, 2]))
GOOD_ACCEPT = (np.array([0, 2]), 1)


@pytest.mark.parametrize("method, args, value, message", [
    ("accept", TREE_INPUTS, (np.array([0.0, 2.0]), 1), "accept() output accepted has dtype float64, expected an integer"),
    ("accept", TREE_INPUTS, (np.array([0, 2]), 1.0), "accept() output next_root has dtype float64"),
    ("accept", TREE_INPUTS, (np.array([[0, 2]]), 1), "output accepted has shape [1, 2], expected [a]"),
    ("accept", TREE_INPUTS, np.array([0, 2]), "accept() returned ndarray, expected a tuple"),
    ("build_tree", (np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64), 3, 5), (np.array([-1, 0]),),
     "build_tree() returned 1 output, expected 3 or 4 (parents, tokens, depths[, scores])"),
    ("build_tree", (np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64), 3, 5),
     (np.array([-1, 0]), np.array([5, 1]), np.array([0, 1, 2])), "depths has shape [3], expected [2] (N = 2)"),
    ("build_tree", (np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64), 3, 5),
     (np.array([-1, 0]), np.array([5, 1]), np.array([0, 1]), np.array([0.0, -1.0], np.float32)),
     "scores has dtype float32, expected float64"),
    ("compile_tree", (np.array([-1, 0, 0]), np.array([0, 1, 1]), 4), (np.array([4, 5, 5]),),
     "compile_tree() returned 1 output, expected 4"),
    ("compile_tree", (np.array([-1, 0, 0]), np.array([0, 1, 1]), 4),
     (np.array([4, 5, 5]), np.ones((3, 2), np.uint32), np.zeros(3, int), np.zeros(3, int)),
     "visibility_bits has shape [3, 2], expected [3, 1] (N = 3, W = 1)"),
    ("compile_tree", (np.array([-1, 0, 0]), np.array([0, 1, 1]), 4),
     (np.array([4, 5, 5]), np.ones((3, 1), np.int64), np.zeros(3, int), np.zeros(3, int)),
     "visibility_bits has dtype int64, expected uint32 or int32 words"),
    ("topk_logprobs", (np.zeros((3, 8), np.float32), 4), (np.zeros((3, 4), np.float64), np.zeros((3, 4), int)),
     "topk_lp has dtype float64, expected float32"),
    ("topk_logprobs", (np.zeros((3, 8), np.float32), 20), (np.zeros((3, 20), np.float32), np.zeros((3, 20), int)),
     "topk_lp has shape [3, 20], expected [3, 8] (L = 3, K = 8)"),
    ("forward", (np.array([1, 2]), np.array([0, 1]), np.ones((2, 2), bool), 0), np.array([[0.0, np.nan], [0.0, 1.0]]),
     "forward() output logits holds 1 NaN value"),
    ("forward", (np.array([1, 2]), np.array([0, 1]), np.ones((2, 2), bool), 0), np.array([[0.0, np.inf]] * 2),
     "forward() output logits holds 2 infinite values"),
    ("forward", (np.array([1, 2]), np.array([0, 1]), np.ones((2, 2), bool), 0), (np.zeros((2, 4)),),
     "forward() returned a tuple of 1, expected one array"),
    ("sample_accept", (*TREE_INPUTS[:2], np.zeros((3, 4)), 1.0, np.zeros(3)), (np.array([1, 1]), np.array([0]), 1),
     "choices has shape [2], expected [3] (N = 3)"),
])
def test_the_proxy_holds_every_output_to_its_declaration(method, args, value, message):
    with pytest.raises(AdapterFault, match=re.escape(message)):
        getattr(CheckedAdapter(Returns(value)), method)(*args)


def test_the_proxy_normalizes_what_passes():
    accepted, next_root = CheckedAdapter(Returns((np.array([0, 2], np.int32), np.int64(1)))).accept(*TREE_INPUTS)
    assert accepted.tolist() == [0, 2] and type(next_root) is int
    lp = np.array([-np.inf, -1.0], np.float32)[None]                   # -inf is a valid log-prob
    out = CheckedAdapter(Returns((lp, np.array([[0, 1]])))).topk_logprobs(np.zeros((1, 2), np.float32), 2)
    assert out[0] is not None


def test_a_method_that_raises_is_one_row_naming_it(golden, tmp_path):
    class Crashes(StagesOnly):
        def accept(self, parents, tokens, choices):
            raise RuntimeError("engine\nexploded")

    report = validate(Crashes(), fixture_dir(golden, tmp_path, "kernels/accept_compact.kdtr"))
    (row,) = rows(report, "accept")
    assert row.status is Status.FAIL and row.section == "kernels/accept_compact.kdtr"
    assert row.detail.startswith("accept() raised RuntimeError: engine exploded (case ") and "\n" not in row.detail
    assert rows(report, "KV compaction")[0].status is Status.EXACT             # the other checks still ran


class OnlyParents(Engine):
    def build_tree(self, topk_lp, topk_id, budget, root):
        return super().build_tree(topk_lp, topk_id, budget, root)[:1]


class OnlyPositions(Engine):
    def compile_tree(self, parents, depths, start):
        return super().compile_tree(parents, depths, start)[:1]


class FloatAccept(Engine):
    def accept(self, parents, tokens, choices):
        accepted, next_root = super().accept(parents, tokens, choices)
        return accepted.astype(np.float64), next_root


@pytest.mark.parametrize("adapter, failing, text", [
    (OnlyParents, "tree build", "build_tree() returned 1 output"),
    (OnlyPositions, "tree compile", "compile_tree() returned 1 output"),
    (FloatAccept, "accept", "accept() output accepted has dtype float64"),
])
def test_short_tuples_and_float_ids_fail_their_check(golden, tmp_path, adapter, failing, text):
    directory = fixture_dir(golden, tmp_path, "kernels/tree_build.kdtr", "kernels/accept_compact.kdtr")
    report = validate(adapter(), directory, require="none")
    failed = [c for c in report.checks if c.status is Status.FAIL]
    assert [c.name for c in failed] == [failing] and text in failed[0].detail


# ---- planted bugs read as what they are (test_rows.py: every row has a planted bug) ----

class NoisyLogits(Engine):
    """The built-in engine with an error 3x the fixture's logits tolerance."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + 1e-3 * np.abs(logits).max()


def test_planted_forward_error_fails_logits_with_its_size(small_model_fixture):
    report = validate(NoisyLogits(), small_model_fixture, require="none")
    for name in ("prefill logits", "verify logits"):
        (check,) = rows(report, name)
        assert check.status is Status.FAIL and check.error > check.tolerance
    assert rows(report, "tree build")[0].status is Status.EXACT


class NodeIndexPositions(Engine):
    """Tree tokens at positions start + node index instead of start + depth."""

    def forward(self, tokens, positions, visibility, start):
        return super().forward(tokens, start + np.arange(len(tokens)), visibility, start)


def test_a_positions_bug_reads_as_one(small_model_fixture):
    """The verify-logits and target-choices rows name the first wrong node, its depth and its
    position; prefill (positions 0 .. m-1 either way) passes."""
    report = validate(NodeIndexPositions(), small_model_fixture, require="none")
    assert rows(report, "prefill logits")[0].status is Status.WITHIN
    (logits,) = rows(report, "verify logits")
    assert logits.status is Status.FAIL
    node = re.search(r"first wrong node (\d+) \(depth (\d+), position (\d+)\); worst at \[(\d+), \d+\] "
                     r"\(trace (t\d) round (\d+)\); `kdtree diverge`", logits.detail)
    assert node, logits.detail
    index, depth = int(node[1]), int(node[2])
    assert index != depth                            # the first node whose index is not its depth
    with kdtr_format.open(small_model_fixture) as f:
        rp = f"traces/{node[5]}/rounds/{node[6]}"
        assert int(f[f"{rp}/depths"][index]) == depth and int(f[f"{rp}/positions"][index]) == int(node[3])
        assert (f[f"{rp}/depths"][:index] == np.arange(index)).all()
    (choices,) = rows(report, "target choices")
    assert choices.status is Status.FAIL and re.search(r"first divergence at node \d+ \(depth \d+, position \d+\)",
                                                       choices.detail) and "kdtree diverge" in choices.detail


# ---- fixtures: discovery and bad input ----

def test_find_fixtures_errors(tmp_path):
    with pytest.raises(ValidateError, match="does not exist"):
        find_fixtures(tmp_path / "missing")
    with pytest.raises(ValidateError, match="no .kdtr fixtures"):
        find_fixtures(tmp_path)


def test_fixture_from_another_config_is_refused(tmp_path):
    kdtr_format.write(tmp_path / "tiny2.kdtr", {"prompts/p0/tokens": np.arange(3)},
                      metadata={"kdtree_fixture": 1, "kind": "model", "preset": "tiny2",
                                "config": PRESETS["tiny"].to_dict(), "tolerances": {}, "margin_threshold": 0.1,
                                "prompts": [], "traces": []})
    with pytest.raises(ValidateError, match="differs from preset 'tiny2'"):
        validate(StagesOnly(), tmp_path)


def test_load_impl_errors(tmp_path):
    with pytest.raises(ValueError, match="expected 'module:factory'"):
        load_impl("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_impl("no_such_module_xyz:make")
    with pytest.raises(ValueError, match="no file"):
        load_impl(str(tmp_path / "missing.py") + ":make")
    with pytest.raises(ValueError, match="no callable 'missing'"):
        load_impl("engine.validate:missing")


def test_missing_fixtures_are_generated_into_the_cache(tmp_path, monkeypatch):
    """No committed fixtures: `refgen generate --all --full` fills the cache once, all or nothing."""
    import engine.validate.fixtures as runner

    monkeypatch.setattr(runner, "GOLDEN_DIR", tmp_path / "no-golden")
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(runner.REPO_ROOT))
    directory = find_fixtures(None)
    assert directory == tmp_path / "cache" / "fixtures"
    assert (directory / "tiny.kdtr").is_file() and (directory / "kernels" / "tree_build.kdtr").is_file()
    assert find_fixtures(None) == directory                       # found, not generated again


def test_failed_generation_leaves_nothing(tmp_path, monkeypatch):
    import engine.validate.fixtures as runner

    def generate_half_then_fail(command, **kwargs):
        out = Path(command[command.index("--out") + 1])
        (out / "tiny.kdtr").write_bytes(b"half a fixture")
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="refgen: error: disk full")

    monkeypatch.setattr(runner, "GOLDEN_DIR", tmp_path / "no-golden")
    monkeypatch.setattr(subprocess, "run", generate_half_then_fail)
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValidateError, match="refgen generate` failed: refgen: error: disk full"):
        find_fixtures(None)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".lock"]      # the cache's lock file alone


def test_replayed_round_tree_difference_is_a_near_tie_only_when_the_topk_differs():
    tree_fail = Check("replay", "parents", Status.FAIL, detail="1 differ")
    choices_fail = Check("replay", "choices", Status.FAIL, detail="2 differ")
    fine = Check("replay", "depths", Status.EXACT)
    rows = [tree_fail, fine, fine, choices_fail]

    relaxed = replayed_round(rows, tree_rows=3, same_topk=False)
    assert [r.status for r in relaxed] == [Status.NEAR_TIE, Status.EXACT, Status.EXACT, Status.NEAR_TIE]
    assert "near-tie" in relaxed[0].detail
    assert replayed_round(rows, tree_rows=3, same_topk=True) == rows          # same top-k: a bug
    no_tree_change = [fine, fine, fine, choices_fail]
    assert replayed_round(no_tree_change, tree_rows=3, same_topk=False) == no_tree_change


# ---- the built-in engine's own decode loops ----

class LeakyStages(TorchStages):
    """KV compaction that takes request 0's start for every request: invisible to a batch of one."""

    def compact_kv(self, cache, starts, accepted, accept_len):
        super().compact_kv(cache, torch.full_like(starts, int(starts[0])), accepted, accept_len)


def test_the_engine_replay_batches_requests_that_a_leak_reaches(small_model_fixture, monkeypatch,
                                                               builtin_decode_only):
    """Every replay batch holds several prompts (traces of one block size beside the fixture's
    prompts as companions), so a leak between requests fails the replay."""
    batches = []

    def spy(model, drafter, prompts, *args, **kwargs):
        batches.append({len(p) for p in prompts})
        return ddtree_decode(model, drafter, prompts, *args, **kwargs)

    monkeypatch.setattr(engine.validate.rows.engine, "ddtree_decode", spy)
    builtin_decode_only(LeakyStages())
    report = validate(None, small_model_fixture, require="none")
    assert batches and all(len(lengths) >= 2 for lengths in batches), batches
    (replay,) = rows(report, "engine DDTree replay (batched)")
    assert replay.status is Status.FAIL
    assert rows(report, "accept")[0].status is Status.EXACT            # one request at a time: no leak


def test_the_engine_replay_compares_whole_sequences(small_model_fixture, monkeypatch, builtin_decode_only):
    """An engine that commits a token past max_new_tokens fails the replay."""
    result = engine.decode._Batch.result

    def one_more(batch):
        for request in batch.requests:
            request.tokens.append(request.tokens[-1])
        return result(batch)

    monkeypatch.setattr(engine.decode._Batch, "result", one_more)
    builtin_decode_only()
    report = validate(None, small_model_fixture, require="none")
    (replay,) = rows(report, "engine DDTree replay (batched)")
    assert replay.status is Status.FAIL and re.search(r"tokens, expected \d+ \(trace t\d\)", replay.detail)


def test_a_fixture_set_requires_only_what_it_can_check(golden, tmp_path):
    """A model fixture has no compaction checks: alone, as a file or in a directory, it does not
    fail the declared compact capability; the report shows it as a skipped row instead."""
    class Declares(StagesOnly):
        capabilities = ("accept", "compact")

    for fixtures in (golden / "tiny2.kdtr", fixture_dir(golden, tmp_path, "tiny2.kdtr")):
        report = validate(Declares(), fixtures)
        assert not report.failed, report.summary()
        assert [(c.name, c.status) for c in report.checks if c.name.startswith("capability")] == \
            [("capability compact", Status.SKIPPED)]
