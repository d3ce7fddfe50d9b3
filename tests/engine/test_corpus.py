"""engine.validate's corpus rows (kernels/corpus.kdtr): every broken example adapter of
docs/examples/corpus fails exactly the case made for its bug, saying which stage and what
differs; a bug of another kind fails every case of its stage; the correct implementations
pass every case, and a row says what it skipped or what crashed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.adapter import TorchAdapter
from engine.validate.door.protocol_v2 import PerRequest
from engine.validate import Status, load_impl, validate
from engine.validate.rows.corpus import tree_problems

BROKEN_MODULE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "corpus" / "broken_adapters.py"
# What the failing row must say, per case: the stage and what differs there.
SYMPTOM = {
    "token_zero": "tree build parents: 6 values, expected 11: got [-1, 0, 1, 2, 0, 0], expected [-1, 0, 1, 2, 0, 0, "
                  "1, 4, 0, 1, 5]; first difference at [6]: got none (past its end), expected 1 (case token_zero)",
    "nan_draft_logits": "top-k refuses NaN: returned a top-k for draft logits holding NaN; the contract requires",
    "neg_inf_draft_logits": "top-k topk_lp: -inf at [0, 4]: got -3.4028234663852886e+38, expected -inf",
    "duplicate_siblings": "a valid tree from its own top-k: the tree from the adapter's own top-k is invalid: "
                          "siblings with the same token: nodes 1 and 2",
    "star": "tree compile positions: 5 differ",
    "budget_beyond_possible": "tree build parents: 101 values, expected 40:",
    "budget_zero": "tree build parents: 2 values, expected 1: got [-1, 0], expected [-1]; first difference at [1]: "
                   "got 0, expected none (past its end)",
    "tree_below_chain": "accept: accepted 2 tokens, fewer than the 5 the tree's own rank-0 chain accepts",
    "compaction_non_prefix": "KV compaction c_kv_after: 192 differ",
}


@pytest.fixture(scope="module")
def corpus_dir(golden, tmp_path_factory) -> Path:
    source = golden / "kernels" / "corpus.kdtr"
    directory = tmp_path_factory.mktemp("corpus")
    (directory / "kernels").mkdir()
    (directory / "kernels" / "corpus.kdtr").symlink_to(source)
    return directory


@pytest.fixture(scope="module")
def broken():
    """docs/examples/corpus/broken_adapters.py, loaded as `--impl` loads it."""
    load_impl(f"{BROKEN_MODULE}:NumpyAdapter")
    return sys.modules["kdtree_impl_broken_adapters"]


# Each case's row names what it checks: its stages.
CASES = [("token_zero", "top-k, tree build, accept"),
         ("nan_draft_logits", "top-k refuses NaN"),
         ("neg_inf_draft_logits", "top-k, a valid tree from its own top-k"),
         ("duplicate_siblings", "top-k, a valid tree from its own top-k"),
         ("star", "tree build, tree compile"),
         ("budget_beyond_possible", "tree build"),
         ("budget_zero", "tree build"),
         ("tree_below_chain", "tree build, accept"),
         ("compaction_non_prefix", "KV compaction")]


def row_of(case: str) -> str:
    return next(f"corpus {case}: {checks}" for name, checks in CASES if name == case)


@pytest.mark.parametrize("case", [name for name, _ in CASES])
def test_each_broken_adapter_fails_exactly_its_case(corpus_dir, broken, case):
    report = validate(broken.BROKEN[case](), corpus_dir, require="none")
    failed = [c for c in report.checks if c.status is Status.FAIL]
    assert [c.name for c in failed] == [row_of(case)], [(c.name, c.detail) for c in failed]
    assert SYMPTOM[case] in failed[0].detail, failed[0].detail


def test_every_case_has_a_broken_adapter_and_a_row(corpus_dir, broken):
    report = validate(broken.NumpyAdapter(), corpus_dir, require="none")
    assert [c.name for c in report.checks] == [row_of(name) for name, _ in CASES]
    assert set(broken.BROKEN) == {name for name, _ in CASES}


@pytest.mark.parametrize("adapter", ["torch", "numpy"])
def test_correct_implementations_pass_every_case(corpus_dir, broken, adapter):
    report = validate(TorchAdapter() if adapter == "torch" else broken.NumpyAdapter(), corpus_dir,
                      require="none")
    assert [c.status for c in report.checks] == [Status.EXACT] * len(CASES), report.summary()
    if adapter == "numpy":      # the example has no compile_tree: the star case names what it skipped
        (star,) = [c for c in report.checks if c.name == row_of("star")]
        assert star.detail == "compile skipped (not implemented by adapter)"


def test_a_bug_fails_every_case_of_its_stage_saying_what_differs(corpus_dir, broken):
    """A case is made for one bug, but its row checks its stages: an accept walk that takes one
    node too many fails both cases with an accept stage, each showing both paths."""
    class OneNodeTooMany(broken.NumpyAdapter):
        def accept(self, parents, tokens, choices):
            accepted, next_root = super().accept(parents, tokens, choices)
            return np.append(accepted, len(parents) - 1), next_root

    report = validate(OneNodeTooMany(), corpus_dir, require="none")
    failed = {c.name: c.detail for c in report.checks if c.status is Status.FAIL}
    assert set(failed) == {row_of("token_zero"), row_of("tree_below_chain")}, failed
    assert "accept accepted: 5 values, expected 4: got [0, 1, 2, 3, 10], expected [0, 1, 2, 3]; first difference " \
           "at [4]: got 10, expected none (past its end) (case token_zero)" in failed[row_of("token_zero")]


class AcceptOnly:
    name = "accept only"

    def __init__(self, crash: bool = False) -> None:
        self.engine, self.crash = PerRequest(TorchAdapter()), crash

    def accept(self, parents, tokens, choices):
        if self.crash and len(parents) == 11 and tokens[1] == 0:
            raise RuntimeError("engine exploded")
        return self.engine.accept(parents, tokens, choices)


def test_rows_skip_what_the_adapter_lacks_and_a_crash_fails_only_its_case(corpus_dir):
    rows = {c.name: c for c in validate(AcceptOnly(), corpus_dir, require="none").checks}
    assert rows[row_of("token_zero")].status is Status.EXACT
    assert rows[row_of("token_zero")].detail == "topk, tree skipped (not implemented by adapter)"
    assert rows[row_of("budget_zero")].status is Status.SKIPPED
    assert rows[row_of("budget_zero")].detail == "tree skipped (not implemented by adapter)"
    crashed = validate(AcceptOnly(crash=True), corpus_dir, require="none")
    failed = [c for c in crashed.checks if c.status is Status.FAIL]
    assert [c.name for c in failed] == [row_of("token_zero")]
    assert failed[0].detail.startswith("accept: accept() raised RuntimeError: engine exploded")


def test_tree_problems_names_each_way_a_tree_is_invalid():
    parents, tokens, depths = np.array([-1, 0, 0, 1]), np.array([-1, 4, 5, 4]), np.array([0, 1, 1, 2])
    assert tree_problems(parents, tokens, depths, budget=3, depth=2, k=2, vocab=8) == []
    assert tree_problems(parents, tokens, depths, 3, 2, 2, 5) == ["a token outside [0, 5)"]
    assert tree_problems(parents, [-1, 4, 4, 1], depths, 3, 2, 2, 8) == [
        "siblings with the same token: nodes 1 and 2 (token 4)"]
    assert tree_problems([-1, 0, 3, 1], tokens, depths, 3, 2, 2, 8) == ["node 2's parent does not come first"]
    assert tree_problems(parents, tokens, [0, 1, 1, 3], 3, 2, 2, 8) == [
        "depths are not one more than the parent's, within L"]
    assert tree_problems(parents, tokens, depths, 5, 2, 2, 8) == ["3 nodes, expected min(budget 5, 6 possible)"]
    assert tree_problems([0], [-1], [0], 0, 2, 2, 8) == ["node 0 is not a root (parent 0, depth 0)"]
    assert tree_problems(parents[:2], tokens, depths, 3, 2, 2, 8)[0].startswith("parents, tokens, depths have shapes")
