"""refgen.corpus: each committed case holds the property that makes it a regression case
for its bug, re-derived here from the file's tensors; the properties that keep the
cases apart hold (token 0, -inf, NaN, log-prob ties, non-consecutive paths, budget 0,
budgets beyond the tree, compile stages each in one case only); and a case that
loses its property is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kdtr_format
import refgen.corpus as corpus
from refgen.ddtree import Tree, accept, build_tree, max_nodes, topk_logprobs
from refgen.fixtures import FixtureError
from refgen.kernel_cases import kernel_fixture

ONLY_IN = {  # a property -> the one case that may have it
    "token 0 in a tree": "token_zero", "-inf in draft logits": "neg_inf_draft_logits",
    "NaN in draft logits": "nan_draft_logits", "tied log-probs in a top-k": "duplicate_siblings",
    "a non-consecutive accepted path": {"tree_below_chain", "compaction_non_prefix"},
    "budget 0": "budget_zero", "a budget beyond the tree": "budget_beyond_possible", "a compile stage": "star",
}


@pytest.fixture(scope="module")
def cases(golden) -> dict[str, tuple[dict, dict]]:
    """name -> (tensors, metadata) of the golden kernels/corpus.kdtr."""
    with kdtr_format.open(golden / "kernels/corpus.kdtr") as reader:
        return {m["name"]: ({k.split("/")[-1]: np.array(reader[k]) for k in reader.names(f"cases/{m['name']}/")}, m)
                for m in reader.metadata["cases"]}


def reference_tree(t: dict, m: dict) -> Tree:
    """The tree the case's stages build: from its own top-k, or from its draft logits' top-k."""
    topk = (t["topk_lp"], t["topk_id"]) if "topk_lp" in t else topk_logprobs(t["draft_logits"], m["k"])
    return build_tree(*topk, m["budget"])


def properties(t: dict, m: dict) -> set[str]:
    found = set()
    if "budget" in m and m.get("stages") != ["topk_error"]:
        tree = reference_tree(t, m)
        found |= {"token 0 in a tree"} if (tree.tokens[1:] == 0).any() else set()
        found |= {"budget 0"} if m["budget"] == 0 else set()
        found |= {"a budget beyond the tree"} if m["budget"] > tree.n else set()
    if "draft_logits" in t:
        found |= {"-inf in draft logits"} if np.isneginf(t["draft_logits"]).any() else set()
        found |= {"NaN in draft logits"} if np.isnan(t["draft_logits"]).any() else set()
    if "topk_lp" in t and (np.diff(t["topk_lp"][np.isfinite(t["topk_lp"]).all(axis=1)], axis=1) == 0).any():
        found.add("tied log-probs in a top-k")
    if "accepted" in t and not np.array_equal(t["accepted"], np.arange(len(t["accepted"]))):
        found.add("a non-consecutive accepted path")
    if "compile" in m["stages"]:
        found.add("a compile stage")
    return found


def test_the_properties_that_keep_the_cases_apart_each_hold_in_one_case(cases):
    for name, (t, m) in cases.items():
        for prop in properties(t, m):
            allowed = ONLY_IN[prop]
            assert name in ({allowed} if isinstance(allowed, str) else allowed), (name, prop)
    found = {prop for t, m in cases.values() for prop in properties(t, m)}
    assert found == set(ONLY_IN)


def test_each_case_holds_its_regression_property(cases):
    t, m = cases["token_zero"]
    assert list(t["accepted"]) == [0, 1, 2, 3] and (t["tokens"][t["accepted"][1:]] == 0).all()
    assert int(t["next_root"]) == 0 and (t["topk_id"][:, 0] == 0).all()
    t, m = cases["nan_draft_logits"]
    with pytest.raises(ValueError, match="NaN"):
        topk_logprobs(t["draft_logits"], m["k"])
    t, m = cases["neg_inf_draft_logits"]
    assert np.isneginf(t["topk_lp"][:, -1]).all() and (t["topk_id"][:, -1] == 0).all()
    assert (np.isfinite(t["draft_logits"]).sum(axis=1) == m["k"] - 1).all()
    t, m = cases["duplicate_siblings"]
    assert (t["topk_lp"][:, 0] == t["topk_lp"][:, 1]).all() and (t["topk_lp"][:, 2] == t["topk_lp"][:, 3]).all()
    t, m = cases["star"]
    assert (t["depths"][1:] == 1).all() and len(t["depths"]) == 7 and (t["positions"][1:] == m["start"] + 1).all()
    t, m = cases["budget_beyond_possible"]
    assert len(t["parents"]) - 1 == max_nodes(3, 3) == 39 < m["budget"]
    assert list(cases["budget_zero"][0]["parents"]) == [-1]
    t, m = cases["tree_below_chain"]
    chain = [0]
    while (children := np.flatnonzero(t["parents"] == chain[-1])).size:
        chain.append(int(children[0]))
    assert list(t["accepted"]) == chain == [0, 1, 3, 5, 7] and m["chain"] == 5
    t, m = cases["compaction_non_prefix"]
    start, path = m["start"], t["accepted"]
    reverse = t["c_kv"].copy()
    for k in reversed(range(len(path))):
        reverse[start + k] = reverse[start + path[k]]
    assert not np.array_equal(reverse, t["c_kv_after"])
    assert np.array_equal(t["c_kv_after"][start:start + len(path)], t["c_kv"][start + path])


def test_the_committed_corpus_regenerates_bit_for_bit(cases):
    fresh = kernel_fixture("corpus")
    for name, (t, m) in cases.items():
        for tensor, value in t.items():
            np.testing.assert_array_equal(fresh.tensors[f"cases/{name}/{tensor}"], value)
    assert [c["name"] for c in fresh.metadata["cases"]] == list(cases)


def test_chain_acceptance():
    tree = Tree.from_parents(np.array([-1, 0, 0, 1, 2]), np.array([9, 5, 6, 7, 7]))
    assert corpus.rank0_chain(tree) == [0, 1, 3]
    assert corpus.chain_acceptance(tree, np.array([5, 7, 0, 0, 0])) == 3
    assert corpus.chain_acceptance(tree, np.array([6, 7, 7, 0, 0])) == 1       # the tree takes node 2; the chain stops
    assert len(accept(tree, np.array([6, 7, 7, 0, 0]))[0]) == 3


def test_a_case_that_loses_its_property_is_refused(monkeypatch):
    token_zero = corpus.CORPUS_CASES[0]

    def shifted(rng):            # token 0 no longer on top: the accepted path holds no token 0
        inputs = token_zero.inputs(rng)
        inputs["draft_logits"][:, 0] = -10.0
        return inputs

    monkeypatch.setattr(corpus, "CORPUS_CASES", (dataclasses.replace(token_zero, inputs=shifted),))
    with pytest.raises(FixtureError, match="token_zero: its inputs lost the property"):
        corpus.corpus_case(corpus.CORPUS_CASES[0], 0, 0)
    finite = dataclasses.replace(corpus.CORPUS_CASES[0], stages=("topk_error",))
    with pytest.raises(FixtureError, match="the reference accepts these draft logits"):
        corpus.corpus_case(finite, 0, 0)
    with pytest.raises(FixtureError, match="unknown stages"):
        corpus.corpus_case(dataclasses.replace(token_zero, stages=("verify",)), 0, 0)
