"""engine.validate: the comparisons, the report, and that planted bugs in an adapter
fail the check that names them while missing methods are reported as skipped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
from kdtr_format import PRESETS
from engine.adapter import TorchAdapter
from engine.validate import capabilities, load_impl
from engine.validate import (GOLDEN_DIR, SKIPPED_DETAIL, Check, Status, ValidateError, compare_close,
                             compare_exact, find_fixtures, merge, replayed_round, unpack_bits, validate)


def fixture_dir(tmp_path: Path, *names: str) -> Path:
    """A fixture directory holding links to some committed fixtures (skip when absent)."""
    for name in names:
        source = GOLDEN_DIR / name
        if not source.exists():
            pytest.skip(f"golden fixture {source} is absent (generate it with `refgen generate`)")
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(source)
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
    assert compare_exact("s", "x", [1], [1, 2]).status is Status.FAIL


def test_merge_keeps_the_worst():
    checks = [Check("s", "a", Status.EXACT), Check("s", "a", Status.WITHIN, 1e-6, 1e-5),
              Check("s", "a", Status.FAIL, detail="round 3"), Check("s", "a", Status.WITHIN, 5e-6, 1e-5)]
    merged = merge("s", "a", checks)
    assert merged.status is Status.FAIL and merged.detail == "round 3" and merged.error == 5e-6
    assert merge("s", "a", checks[:2]).status is Status.WITHIN
    assert merge("s", "a", []).status is Status.SKIPPED


def test_unpack_bits():
    words = np.array([[0b101, 0], [0, 1], [-1, 1]], dtype=np.int64).astype(np.uint32).astype(np.int32)
    bits = unpack_bits(words, 33)
    assert bits[0].nonzero()[0].tolist() == [0, 2]
    assert bits[1].nonzero()[0].tolist() == [32]
    assert bits[2].all()


# ---- adapters: capabilities, skipped checks, planted bugs ----

class StagesOnly:
    """Accept and compaction through the built-in engine, nothing else."""

    name = "stages only"

    def __init__(self) -> None:
        self.engine = TorchAdapter()

    def accept(self, parents, tokens, choices):
        return self.engine.accept(parents, tokens, choices)

    def compact(self, c_kv, k_pe, start, accepted):
        return self.engine.compact(c_kv, k_pe, start, accepted)


class WrongNextRoot(StagesOnly):
    def accept(self, parents, tokens, choices):
        accepted, _ = self.engine.accept(parents, tokens, choices)
        return accepted, int(choices[0])          # the root's choice, not the last accepted node's


class NoCompaction(StagesOnly):
    def compact(self, c_kv, k_pe, start, accepted):
        return c_kv, k_pe


def test_capabilities():
    assert capabilities(StagesOnly()) == {"accept", "compact"}
    assert capabilities(TorchAdapter()) == {"model", "topk", "tree", "compile", "accept", "compact", "attention",
                                            "intermediates"}


def test_missing_methods_are_skipped_not_failed(tmp_path):
    directory = fixture_dir(tmp_path, "tiny.kdtr", "kernels/accept_compact.kdtr", "kernels/tree_build.kdtr")
    report = validate(StagesOnly(), directory)
    assert not report.failed, report.summary()
    for name in ("prefill logits", "AR tokens", "tree build", "tree compile", "verify logits", "top-k log-probs"):
        assert all(c.status is Status.SKIPPED and c.detail == SKIPPED_DETAIL for c in rows(report, name))
    assert all(c.status is Status.EXACT for c in rows(report, "accept"))
    assert all(c.status is Status.EXACT for c in rows(report, "KV compaction"))


@pytest.mark.parametrize("adapter, failing", [(WrongNextRoot, "accept"), (NoCompaction, "KV compaction")])
def test_planted_stage_bugs_fail_their_check(tmp_path, adapter, failing):
    directory = fixture_dir(tmp_path, "tiny.kdtr", "kernels/accept_compact.kdtr")
    report = validate(adapter(), directory)
    assert report.failed
    assert {c.name for c in report.checks if c.status is Status.FAIL} == {failing}


class NoisyLogits(TorchAdapter):
    """The built-in engine with an error 3x the fixture's logits tolerance."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + 1e-3 * np.abs(logits).max()


class WrongScale(TorchAdapter):
    def attention(self, q_lat, q_pe, c_kv, k_pe, visibility, scale):
        return super().attention(q_lat, q_pe, c_kv, k_pe, visibility, scale * 1.001)


def test_planted_forward_error_fails_logits_with_its_size(tmp_path):
    directory = fixture_dir(tmp_path, "tiny2.kdtr")
    report = validate(NoisyLogits(), directory)
    for name in ("prefill logits", "verify logits"):
        (check,) = rows(report, name)
        assert check.status is Status.FAIL and check.error > check.tolerance
    assert rows(report, "tree build")[0].status is Status.EXACT


class NoSiblings(TorchAdapter):
    def compile_tree(self, parents, depths, start):
        positions, bits, first_child, next_sibling = super().compile_tree(parents, depths, start)
        return positions, bits, first_child, np.full_like(next_sibling, -1)


class ScoresOffByOneUlp(TorchAdapter):
    def build_tree(self, topk_lp, topk_id, budget, root):
        parents, tokens, depths, scores = super().build_tree(topk_lp, topk_id, budget, root)
        return parents, tokens, depths, np.nextafter(scores, -np.inf)


@pytest.mark.parametrize("adapter, failing", [(NoSiblings, "tree compile"), (ScoresOffByOneUlp, "tree build")])
def test_planted_tree_bugs_fail_their_check(tmp_path, adapter, failing):
    directory = fixture_dir(tmp_path, "kernels/tree_build.kdtr")
    assert not validate(TorchAdapter(), directory).failed
    report = validate(adapter(), directory)
    assert [c.name for c in report.checks if c.status is Status.FAIL] == [failing]


def test_planted_attention_error_fails_verify_attention(tmp_path):
    directory = fixture_dir(tmp_path, "kernels/verify_attention.kdtr")
    assert not validate(TorchAdapter(), directory).failed
    report = validate(WrongScale(), directory)
    (check,) = rows(report, "verify attention (o_lat)")
    assert check.status is Status.FAIL and "case" in check.detail


def test_crashing_adapter_fails_its_fixture(tmp_path):
    class Crashes(StagesOnly):
        def accept(self, parents, tokens, choices):
            raise RuntimeError("engine exploded")

    report = validate(Crashes(), fixture_dir(tmp_path, "kernels/accept_compact.kdtr"))
    assert report.failed and "engine exploded" in " ".join(c.detail for c in report.checks)


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
    """No committed fixtures: `refgen generate --all` fills the cache once, all or nothing."""
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
    monkeypatch.setattr(runner.subprocess, "run", generate_half_then_fail)
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValidateError, match="refgen generate` failed: refgen: error: disk full"):
        find_fixtures(None)
    assert list((tmp_path / "cache").iterdir()) == []


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
