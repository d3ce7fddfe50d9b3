"""engine.validate's corpus rows (kernels/corpus.kdtr): every broken example adapter of
docs/examples/corpus fails exactly the case named for its bug, the correct implementations
pass every case, and a row says what it skipped or what crashed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.adapter import TorchAdapter
from engine.validate.protocol_v2 import PerRequest
from engine.validate import Status, load_impl, validate
from engine.validate.corpus_checks import tree_problems

BROKEN_MODULE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "corpus" / "broken_adapters.py"
# What the failing row must say, per case: the symptom of its bug.
SYMPTOM = {
    "token_zero": "shape [6] != expected [11]",
    "nan_draft_logits": "the contract requires an explicit error",
    "neg_inf_draft_logits": "expected -inf",
    "duplicate_siblings": "siblings with the same token: nodes 1 and 2",
    "star": "positions: 5 differ",
    "budget_beyond_possible": "shape [101] != expected [40]",
    "budget_zero": "shape [2] != expected [1]",
    "tree_below_chain": "accepted 2 tokens, fewer than the 5 the tree's own rank-0 chain accepts",
    "compaction_non_prefix": "c_kv_after: 192 differ",
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


CASES = [("token_zero", "token id 0 treated as padding"),
         ("nan_draft_logits", "NaN in draft logits printed and carried on"),
         ("neg_inf_draft_logits", "-inf in draft logits"),
         ("duplicate_siblings", "siblings with the same token"),
         ("star", "a tree with every node at depth 1 (star)"),
         ("budget_beyond_possible", "budget larger than the number of possible nodes"),
         ("budget_zero", "budget 0"),
         ("tree_below_chain", "a greedy tree that accepts fewer tokens than its own rank-0 chain"),
         ("compaction_non_prefix", "KV compaction that assumes the accepted path is a prefix of tree order")]


def row_of(case: str) -> str:
    return next(f"corpus {case}: {bug}" for name, bug in CASES if name == case)


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
