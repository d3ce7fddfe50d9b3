"""The corpus: the bugs other DDTree integrations shipped, one named regression case each.

`kernels/corpus.kdtr` (docs/fixtures.md, "Corpus") holds one case per bug. A case
is a DDTree round in miniature that keeps only the stages its bug lives in, with
inputs built so that the bug changes the output and every other corpus case's
bug does not: a broken implementation fails exactly its own case
(docs/examples/corpus/broken_adapters.py has one per case). Expected outputs come
from refgen.ddtree, the oracle; each case also asserts the property that makes it
a regression case (token 0 on the accepted path, a path that is not a prefix of
tree order, ...) and refuses to be written without it (FixtureError).

Stages (the case's `stages`; tensors under cases/{name}/):

- ``topk``: draft_logits float32 [L, V], width k -> topk_lp, topk_id, exact
  (lp to one float32 ulp; -inf entries exactly where the reference has them);
- ``topk_error``: draft_logits holding NaN -> the implementation raises (the
  contract: an explicit error, never a tree built from NaN);
- ``own_tree``: the tree built from the implementation's own top-k of
  draft_logits under `budget` is a valid tree (docs/adapter.md, "The corpus");
- ``tree``: topk_lp, topk_id, budget -> parents, tokens, depths, scores, exact;
- ``compile``: parents, depths, start -> positions, visibility_bits, first_child,
  next_sibling, exact;
- ``accept``: parents, tokens, choices -> accepted, next_root, exact, and never
  shorter than `chain`, what the tree's own rank-0 chain accepts;
- ``compact``: c_kv, k_pe, start, accepted -> c_kv_after, k_pe_after, exact.

Token 0 appears only in `token_zero`'s trees and accepted paths, -inf only in
`neg_inf_draft_logits`, exact log-prob ties only in `duplicate_siblings`, and a
non-consecutive accepted path only in `tree_below_chain` and
`compaction_non_prefix`, which is what keeps the cases apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kdtr_format import PRESETS

from .ddtree import Tree, accept, build_tree, compact, compile_tree, max_nodes, topk_logprobs
from .fixtures import FixtureError, sub_seed

_CORPUS = 13                 # sub-seed stream (refgen.fixtures uses 0..2, kernel_cases 10..12)
STAGES = ("topk", "topk_error", "own_tree", "tree", "compile", "accept", "compact")


Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class CorpusCase:
    """One shipped bug: `bug` is how the report names it; `stages` the checks it runs
    (module docstring); `inputs(rng)` draws its inputs; `regression(tensors, meta)` is
    the property of the generated case that makes the bug show."""

    name: str
    bug: str
    stages: tuple[str, ...]
    inputs: Callable[[np.random.Generator], dict[str, Any]]
    regression: Callable[[Tensors, dict[str, Any]], bool]


def _distinct_logits(rng: np.random.Generator, depth: int, vocab: int) -> np.ndarray:
    """float32 [L, V]: each row a permutation of 0, 0.25, 0.5, ...: no two log-probs tie."""
    return np.stack([rng.permutation(vocab) * 0.25 for _ in range(depth)]).astype(np.float32)


def _hand_topk(rng: np.random.Generator, lp: list[list[float]], vocab: int) -> dict[str, np.ndarray]:
    """Hand-made top-k rows (lp descending) over token ids 1 .. vocab-1, distinct in a row."""
    topk_lp = np.array(lp, dtype=np.float32)
    ids = np.stack([rng.choice(np.arange(1, vocab), topk_lp.shape[1], replace=False) for _ in lp])
    return {"topk_lp": topk_lp, "topk_id": ids.astype(np.int64)}


def _token_zero(rng: np.random.Generator) -> dict[str, Any]:
    """Token 0 is every depth's top-1: the chain, the accepted path and the next root are 0."""
    draft = _distinct_logits(rng, 3, 16)
    draft[:, 0] = draft.max(axis=1) + 2.0
    return {"draft_logits": draft, "k": 4, "budget": 10, "choices_of": lambda tree: np.zeros(tree.n + 1, np.int64)}


def _nan_draft_logits(rng: np.random.Generator) -> dict[str, Any]:
    draft = _distinct_logits(rng, 3, 16)
    draft[1, 5] = np.nan
    return {"draft_logits": draft, "k": 4}


def _neg_inf_draft_logits(rng: np.random.Generator) -> dict[str, Any]:
    """Masked tokens (-inf), token 0 among them: each row's top-5 is its 4 finite tokens,
    then token 0 at lp -inf."""
    draft = np.full((3, 12), -np.inf, dtype=np.float32)
    for row in draft:
        row[rng.choice(np.arange(1, 12), 4, replace=False)] = rng.permutation(4) * 0.5
    return {"draft_logits": draft, "k": 5, "budget": 8}


def _duplicate_siblings(rng: np.random.Generator) -> dict[str, Any]:
    """Exactly tied logits inside every top-4: pairs 2.0, 2.0, 1.5, 1.5 over ids 1..15."""
    draft = np.full((3, 16), 0.0, dtype=np.float32)
    draft[:, 0] = -1.0
    for row in draft:
        row[rng.choice(np.arange(1, 16), 4, replace=False)] = [2.0, 2.0, 1.5, 1.5]
    return {"draft_logits": draft, "k": 4, "budget": 9}


def _star(rng: np.random.Generator) -> dict[str, Any]:
    """L = 1, budget = K: six children of the root, nothing deeper."""
    return {**_hand_topk(rng, [[-0.1, -0.3, -0.6, -1.0, -1.5, -2.1]], 40), "budget": 6, "start": 9}


def _budget_beyond_possible(rng: np.random.Generator) -> dict[str, Any]:
    """L = 3, K = 3: 39 nodes exist, the budget asks for 100."""
    return {**_hand_topk(rng, [[-0.2, -0.9, -1.7], [-0.4, -1.1, -2.0], [-0.3, -1.4, -2.2]], 30), "budget": 100}


def _budget_zero(rng: np.random.Generator) -> dict[str, Any]:
    return {**_hand_topk(rng, [[-0.1, -1.0, -2.0]] * 4, 30), "budget": 0}


def _tree_below_chain(rng: np.random.Generator) -> dict[str, Any]:
    """A depth-1 sibling (-0.15) pops between the chain's nodes, so the rank-0 chain is not
    consecutive in tree order; the target follows the chain to its end in the tree."""
    return {**_hand_topk(rng, [[-0.1, -0.15, -3.0], [-0.2, -1.0, -3.0], [-0.2, -1.0, -3.0], [-0.2, -1.0, -3.0]],
                         30),
            "budget": 10, "choices_of": lambda tree: _follow_chain(tree, rng)}


def _compaction_non_prefix(rng: np.random.Generator) -> dict[str, Any]:
    """Path [0, 2, 3, 6] at start 7 on tiny's cache dims: not a prefix of tree order, and a copy
    in decreasing k would read slot start + 3 after overwriting it."""
    cfg = PRESETS["tiny"]
    rows = 7 + 9 + 4
    return {"start": 7, "accepted": np.array([0, 2, 3, 6], dtype=np.int64),
            "c_kv": rng.standard_normal((rows, cfg.kv_lora_rank)).astype(np.float32),
            "k_pe": rng.standard_normal((rows, cfg.qk_rope_head_dim)).astype(np.float32)}


def _consecutive(t: Tensors) -> bool:
    return bool(np.array_equal(t["accepted"], np.arange(len(t["accepted"]))))


def _reverse_copy_differs(t: Tensors, start: int) -> bool:
    """Whether compaction in decreasing k (reading slots it already overwrote) gets this case wrong."""
    reverse = t["c_kv"].copy()
    for k in reversed(range(len(t["accepted"]))):
        reverse[start + k] = reverse[start + t["accepted"][k]]
    return not np.array_equal(reverse, t["c_kv_after"])


CORPUS_CASES = (
    CorpusCase("token_zero", "token id 0 treated as padding", ("topk", "tree", "accept"), _token_zero,
               lambda t, m: (_consecutive(t) and len(t["accepted"]) == 4 and int(t["next_root"]) == 0
                             and bool((t["tokens"][t["accepted"][1:]] == 0).all()))),
    CorpusCase("nan_draft_logits", "NaN in draft logits printed and carried on", ("topk_error",),
               _nan_draft_logits, lambda t, m: bool(np.isnan(t["draft_logits"]).any())),
    CorpusCase("neg_inf_draft_logits", "-inf in draft logits", ("topk", "own_tree"), _neg_inf_draft_logits,
               lambda t, m: bool(np.isneginf(t["topk_lp"][:, -1]).all() and np.isfinite(t["topk_lp"][:, :-1]).all())),
    CorpusCase("duplicate_siblings", "siblings with the same token", ("topk", "own_tree"), _duplicate_siblings,
               lambda t, m: bool((np.diff(t["topk_lp"], axis=1) == 0).all(axis=0)[[0, 2]].all())),
    CorpusCase("star", "a tree with every node at depth 1 (star)", ("tree", "compile"), _star,
               lambda t, m: m["nodes"] == 7 and bool((t["depths"][1:] == 1).all())),
    CorpusCase("budget_beyond_possible", "budget larger than the number of possible nodes", ("tree",),
               _budget_beyond_possible, lambda t, m: m["nodes"] - 1 == max_nodes(3, 3) < m["budget"]),
    CorpusCase("budget_zero", "budget 0", ("tree",), _budget_zero, lambda t, m: m["nodes"] == 1),
    CorpusCase("tree_below_chain", "a greedy tree that accepts fewer tokens than its own rank-0 chain",
               ("tree", "accept"), _tree_below_chain,
               lambda t, m: not _consecutive(t) and m["chain"] == len(t["accepted"]) == 5),
    CorpusCase("compaction_non_prefix", "KV compaction that assumes the accepted path is a prefix of tree order",
               ("compact",), _compaction_non_prefix,
               lambda t, m: not _consecutive(t) and _reverse_copy_differs(t, m["start"])),
)


# ---------------------------------------------------------------------------- the rank-0 chain

def rank0_chain(tree: Tree) -> list[int]:
    """The tree's rank-0 chain: from the root, each node's first child (its smallest index,
    the drafter's top-1 under it), down to a leaf. -> node indices, root first."""
    chain = [0]
    while (children := np.flatnonzero(tree.parents == chain[-1])).size:
        chain.append(int(children[0]))
    return chain


def chain_acceptance(tree: Tree, choices: np.ndarray) -> int:
    """How many tokens (root included) the rank-0 chain alone accepts under these choices."""
    chain = rank0_chain(tree)
    a = 1
    while a < len(chain) and tree.tokens[chain[a]] == choices[chain[a - 1]]:
        a += 1
    return a


def _follow_chain(tree: Tree, rng: np.random.Generator) -> np.ndarray:
    """Choices [n+1] that follow the rank-0 chain to its last node, then a token no child has;
    off the chain, random tokens."""
    chain = rank0_chain(tree)
    choices = rng.integers(1, 30, size=tree.n + 1)
    for parent, child in zip(chain, chain[1:]):
        choices[parent] = tree.tokens[child]
    choices[chain[-1]] = 31
    return choices.astype(np.int64)


# ---------------------------------------------------------------------------- one case

def corpus_case(case: CorpusCase, seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """-> (tensors under cases/{name}/, metadata) of one case, expected outputs from refgen.ddtree."""
    if not set(case.stages) <= set(STAGES):
        raise FixtureError(f"corpus case {case.name}: unknown stages {sorted(set(case.stages) - set(STAGES))}")
    x = case.inputs(np.random.default_rng(sub_seed(seed, _CORPUS, index, 0)))
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"name": case.name, "bug": case.bug, "stages": list(case.stages)}
    if "draft_logits" in x:
        tensors["draft_logits"] = x["draft_logits"]
        meta.update(k=x["k"], depth=x["draft_logits"].shape[0], vocab=x["draft_logits"].shape[1])
    if "topk_error" in case.stages:
        try:
            topk_logprobs(x["draft_logits"], x["k"])
        except ValueError:
            pass
        else:
            raise FixtureError(f"corpus case {case.name}: the reference accepts these draft logits")
    topk = x.get("topk_lp"), x.get("topk_id")
    if "topk" in case.stages:
        topk = topk_logprobs(x["draft_logits"], x["k"])
        tensors.update(topk_lp=topk[0], topk_id=topk[1])
    if "budget" in x:
        meta["budget"] = x["budget"]
    if "own_tree" in case.stages and x["budget"] > max_nodes(*topk[0].shape):
        raise FixtureError(f"corpus case {case.name}: the budget must fit in the tree (a full tree is valid)")
    tree = None
    if {"tree", "compile", "accept"} & set(case.stages):
        tree = build_tree(*topk, x["budget"])
        tensors.update(topk_lp=topk[0], topk_id=topk[1], parents=tree.parents, tokens=tree.tokens,
                       depths=tree.depths, scores=tree.scores)
        meta["nodes"] = tree.n + 1
    if "compile" in case.stages:
        compiled = compile_tree(tree, x["start"])
        tensors.update(positions=compiled.positions, visibility_bits=compiled.visibility_bits,
                       first_child=compiled.first_child, next_sibling=compiled.next_sibling)
        meta["start"] = x["start"]
    if "accept" in case.stages:
        choices = x["choices_of"](tree)
        accepted, next_root = accept(tree, choices)
        tensors.update(choices=choices, accepted=accepted, next_root=np.array(next_root, dtype=np.int64))
        meta["chain"] = chain_acceptance(tree, choices)
    if "compact" in case.stages:
        after = {name: x[name].copy() for name in ("c_kv", "k_pe")}
        for array in after.values():
            compact(array, x["start"], x["accepted"])
        tensors.update(c_kv=x["c_kv"], k_pe=x["k_pe"], accepted=x["accepted"],
                       c_kv_after=after["c_kv"], k_pe_after=after["k_pe"])
        meta["start"] = x["start"]
    if not case.regression(tensors, meta):
        raise FixtureError(f"corpus case {case.name}: its inputs lost the property that makes it a regression case")
    return tensors, meta
