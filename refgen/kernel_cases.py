"""Kernel-case fixtures: tree build, tree-verify attention, accept and KV compaction.

One file per kind (docs/fixtures.md, "Kernel-case fixtures"): `kernels/<kind>.kdtr`
holds small committed cases that cover the edge cases; `large=True` gives
`kernels/<kind>_large.kdtr` with cases at the benchmarks' sizes (V = 163840,
L = 15, budgets up to 512; K2 dims with contexts of thousands and trees of up
to 128 nodes), generated on demand and never committed.

Near ties. Random draft logits are quantized to multiples of 2^-10, so two
log-probs in a row are either exactly equal (the tie rule orders them, and
every implementation computes equal values from equal logits) or at least
~1e-3 apart; no float32 rounding can reorder a top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kdtr_format import PRESETS

from .case_inputs import JUNK, SCORE_STD, bf16_rounded, random_walk, tree_shape
from .corpus import CORPUS_CASES, corpus_case
from .ddtree import Tree, accept, build_tree, compact, compile_tree, topk_logprobs
from .fixtures import (FIXTURE_FORMAT, Fixture, FixtureError, Progress, generator_info, sub_seed,
                       topk_gaps)
from .model import absorbed_attention, softmax_scale
from .paged_cases import PAGED_CASES, paged_case

KERNEL_KINDS = ("tree_build", "verify_attention", "accept_compact", "paged_kv", "corpus")
LOGIT_QUANTUM = 2.0 ** -10   # random draft logits are multiples of this
KV_GAP_ROWS = 3              # junk rows between two requests' keys in a verify batch
_TREE, _ATTENTION, _ACCEPT = 10, 11, 12   # sub-seed streams (refgen.fixtures uses 0..2)

TOLERANCES = {"o_lat": {"rtol": 1e-5, "atol": 1e-5}, "lse": {"rtol": 1e-5, "atol": 1e-5},
              "scores": {"rtol": 0.0, "atol": 0.0}, "cache": {"rtol": 0.0, "atol": 0.0}}
TOLERANCES_BF16 = {"o_lat": {"rtol": 1e-2, "atol": 1e-2}, "lse": {"rtol": 1e-2, "atol": 1e-2},
                   "scores": {"rtol": 0.0, "atol": 0.0}, "cache": {"rtol": 0.0, "atol": 0.0}}


def kernel_path(kind: str, large: bool) -> str:
    """The fixture's path relative to the golden directory."""
    return f"kernels/{kind}{'_large' if large else ''}.kdtr"


# ---------------------------------------------------------------------------- tree build

# Found by search: top-k rows where one sibling's score, parent + lp[r + 1] in float64,
# differs from both incremental updates from the previous sibling, s + (lp[r + 1] - lp[r])
# and (s - lp[r]) + lp[r + 1]. float32 [L, K], int64 [L, K]; every node within budget 39.
SIBLING_ROUNDING_TOPK = (
    np.array([[-3.2388949161576974e-11, -2.301265622506321e-09, -6.279906749725342],
              [-0.0001791048707673326, -0.018219418823719025, -0.15931688249111176],
              [-0.002343644853681326, -0.6858245134353638, -1.9527453184127808]], dtype=np.float32),
    np.array([[4, 2, 0], [1, 3, 5], [0, 1, 2]], dtype=np.int64))


@dataclass(frozen=True)
class TreeCase:
    """A tree-build case. logits: "normal" (quantized N(0, 4)), "integer" (values
    0..3: many exact ties) or "hand" (hand-made top-k rows, no draft logits:
    "equal" every lp -1, "halves" lp -0.5 * (rank + 1), whose path sums tie,
    "sibling_rounding" SIBLING_ROUNDING_TOPK)."""

    name: str
    vocab: int
    depth: int
    budget: int
    start: int
    logits: str
    hand: str = ""


TREE_CASES = (
    TreeCase("budget0", 64, 4, 0, 10, "normal"),
    TreeCase("budget1", 64, 4, 1, 10, "normal"),
    TreeCase("beyond_possible", 3, 3, 100, 0, "normal"),     # every 3 + 9 + 27 nodes
    TreeCase("k_capped", 5, 4, 24, 7, "normal"),             # K = V = 5
    TreeCase("depth0", 40, 0, 12, 3, "normal"),              # L = 0: the root alone
    TreeCase("depth1", 40, 1, 12, 3, "normal"),              # L = 1: a star
    TreeCase("tied_logits", 12, 5, 40, 0, "integer"),
    TreeCase("tied_equal", 50, 4, 30, 0, "hand", "equal"),
    TreeCase("tied_halves", 50, 5, 40, 5, "hand", "halves"),
    TreeCase("random", 1000, 7, 48, 100, "normal"),
    TreeCase("random_l15", 2048, 15, 100, 321, "normal"),    # 101 nodes: 4 visibility words
    TreeCase("sibling_rounding", 6, 3, 39, 17, "hand", "sibling_rounding"),
)
TREE_CASES_LARGE = tuple(TreeCase(f"k2_b{b}", 163840, 15, b, 4096, "normal")
                         for b in (16, 64, 256, 512))


def _draft_logits(case: TreeCase, rng: np.random.Generator) -> np.ndarray:
    """-> float32 [L, V]."""
    shape = (case.depth, case.vocab)
    if case.logits == "integer":
        return rng.integers(0, 4, size=shape).astype(np.float32)
    return (np.round(2.0 * rng.standard_normal(shape) / LOGIT_QUANTUM) * LOGIT_QUANTUM).astype(np.float32)


def _hand_topk(case: TreeCase, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """-> (topk_lp float32 [L, K], topk_id int64 [L, K]), K = 3, valid top-k rows."""
    K = 3
    if case.hand == "sibling_rounding":
        lp, ids = SIBLING_ROUNDING_TOPK
        return lp.copy(), ids.copy()
    if case.hand == "equal":
        lp = np.full((case.depth, K), -1.0, dtype=np.float32)
        ids = np.sort(np.stack([rng.choice(case.vocab, K, replace=False) for _ in range(case.depth)]), axis=1)
    else:
        lp = np.tile(-0.5 * np.arange(1, K + 1, dtype=np.float32), (case.depth, 1))
        ids = np.stack([rng.choice(case.vocab, K, replace=False) for _ in range(case.depth)])
    return lp, ids.astype(np.int64)


def _tree_case(case: TreeCase, seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    rng = np.random.default_rng(sub_seed(seed, _TREE, index, 0))
    tensors: dict[str, np.ndarray] = {}
    if case.logits == "hand":
        topk_lp, topk_id = _hand_topk(case, rng)
        gaps: tuple[float | None, float | None] = (None, None)
    else:
        draft = _draft_logits(case, rng)
        topk_lp, topk_id = topk_logprobs(draft, case.budget)
        gaps = topk_gaps(draft, case.budget)
        tensors["draft_logits"] = draft
    tree = build_tree(topk_lp, topk_id, case.budget)
    compiled = compile_tree(tree, case.start)
    tensors.update(topk_lp=topk_lp, topk_id=topk_id, parents=tree.parents, tokens=tree.tokens,
                   depths=tree.depths, ranks=tree.ranks, scores=tree.scores,
                   positions=compiled.positions, visibility_bits=compiled.visibility_bits,
                   first_child=compiled.first_child, next_sibling=compiled.next_sibling)
    meta = {"name": case.name, "vocab": case.vocab, "depth": case.depth, "budget": case.budget,
            "start": case.start, "k": int(topk_lp.shape[1]), "nodes": tree.n + 1,
            "logits": case.logits, "min_topk_gap": gaps[0], "min_topk_boundary_gap": gaps[1]}
    return tensors, meta


# ---------------------------------------------------------------------------- verify attention

@dataclass(frozen=True)
class AttentionCase:
    """A ragged verify batch at a preset's attention dims: per request a cached
    context length and a tree (shape, non-root nodes): "root" (AR decode),
    "chain" (causal), "star" (every node a child of the root), "random" (a DDTree
    build over random top-k)."""

    name: str
    preset: str
    contexts: tuple[int, ...]
    trees: tuple[tuple[str, int], ...]


ATTENTION_CASES = (
    AttentionCase("k2_decode", "kimi-k2", (64,), (("root", 0),)),
    AttentionCase("k2_ragged", "kimi-k2", (1, 90, 130), (("random", 5), ("chain", 2), ("root", 0))),
    AttentionCase("tiny_ragged", "tiny", (0, 33, 64, 250),
                  (("random", 39), ("chain", 16), ("root", 0), ("star", 12))),
    AttentionCase("tiny2_words", "tiny2", (5, 70), (("star", 31), ("random", 32))),
)
ATTENTION_CASES_LARGE = (
    AttentionCase("k2_large", "kimi-k2", (1024, 4096, 2000, 1),
                  (("random", 127), ("random", 63), ("chain", 15), ("root", 0))),
)




def _attention_case(case: AttentionCase, seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    cfg = PRESETS[case.preset]
    H, R, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = softmax_scale(cfg)
    rng = np.random.default_rng(sub_seed(seed, _ATTENTION, index, 0))
    q_std = SCORE_STD / (scale * np.sqrt(R + dr))
    trees = [tree_shape(shape, nodes, rng) for shape, nodes in case.trees]
    sizes = np.array([t.n + 1 for t in trees], dtype=np.int64)
    contexts = np.array(case.contexts, dtype=np.int64)
    q_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    kv_offsets = np.concatenate([[0], np.cumsum(contexts + sizes + KV_GAP_ROWS)[:-1]]).astype(np.int64)
    T, S = int(q_offsets[-1]), int(kv_offsets[-1] + contexts[-1] + sizes[-1])
    words = int(-(-sizes.max() // 32))

    q_lat = (q_std * rng.standard_normal((T, H, R))).astype(np.float32)
    q_pe = (q_std * rng.standard_normal((T, H, dr))).astype(np.float32)
    c_kv = np.full((S, R), JUNK, dtype=np.float32)
    k_pe = np.full((S, dr), JUNK, dtype=np.float32)
    visibility_bits = np.zeros((T, words), dtype=np.uint32)
    expected = {name: np.zeros((T, H, R), dtype=np.float32) if name.startswith("o_lat") else np.zeros((T, H))
                for name in ("o_lat", "lse", "o_lat_bf16", "lse_bf16")}
    for b, tree in enumerate(trees):
        keys = slice(kv_offsets[b], kv_offsets[b] + contexts[b] + sizes[b])
        queries = slice(q_offsets[b], q_offsets[b + 1])
        rows = keys.stop - keys.start
        c_kv[keys] = rng.standard_normal((rows, R))
        k_pe[keys] = rng.standard_normal((rows, dr))
        compiled = compile_tree(tree, int(contexts[b]))
        visibility_bits[queries, :compiled.visibility_bits.shape[1]] = compiled.visibility_bits
        visibility = np.concatenate([np.ones((sizes[b], contexts[b]), dtype=bool),
                                     compiled.visibility], axis=1)
        inputs = (q_lat[queries], q_pe[queries], c_kv[keys], k_pe[keys])
        for suffix, rounding in (("", np.asarray), ("_bf16", bf16_rounded)):
            o, l = absorbed_attention(*(rounding(x) for x in inputs), visibility, scale)
            expected["o_lat" + suffix][queries], expected["lse" + suffix][queries] = o, l
    tensors = {"q_lat": q_lat, "q_pe": q_pe, "c_kv": c_kv, "k_pe": k_pe, "context": contexts,
               "tree_sizes": sizes, "q_offsets": q_offsets, "kv_offsets": kv_offsets,
               "visibility_bits": visibility_bits, **expected}
    meta = {"name": case.name, "preset": case.preset, "heads": H, "kv_lora_rank": R,
            "qk_rope_head_dim": dr, "scale": scale, "batch": len(trees), "tokens": T, "keys": S,
            "trees": [shape for shape, _ in case.trees]}
    return tensors, meta


# ---------------------------------------------------------------------------- accept + compaction

@dataclass(frozen=True)
class AcceptCase:
    """An accept walk and the KV compaction it implies, on a cache of the preset's
    dims. Hand-made: parents, tokens and choices given. Random (parents empty): a
    DDTree of `nodes` nodes over vocab `vocab`, a random path followed."""

    name: str
    preset: str
    start: int
    parents: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    choices: tuple[int, ...] = ()
    nodes: int = 0
    vocab: int = 0


ACCEPT_CASES = (
    # The contract's non-prefix example: path 0 -> 2 -> 5, next root 42.
    AcceptCase("non_prefix", "tiny", 6, (-1, 0, 0, 1, 1, 2, 2, 5), (9, 11, 12, 13, 14, 15, 16, 17),
               (12, 3, 15, 4, 4, 42, 4, 4)),
    AcceptCase("root_only", "tiny", 3, (-1,), (5,), (8,)),
    AcceptCase("no_match", "tiny", 0, (-1, 0, 0), (5, 1, 2), (3, 1, 2)),
    AcceptCase("full_chain", "tiny", 11, (-1, 0, 1, 2, 3), (4, 7, 7, 7, 7), (7, 7, 7, 7, 0)),
    AcceptCase("token_zero", "tiny2", 2, (-1, 0, 0, 2), (3, 1, 0, 0), (0, 5, 0, 6)),
    AcceptCase("random_b16", "tiny", 40, nodes=16, vocab=50),
    AcceptCase("random_k2_b40", "kimi-k2", 77, nodes=40, vocab=20),
)
ACCEPT_CASES_LARGE = (
    AcceptCase("random_k2_b512", "kimi-k2", 4096, nodes=512, vocab=163840),
)
TRAILING_ROWS = 4   # cache rows past the tree: compaction must leave them alone




def _accept_case(case: AcceptCase, seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    cfg = PRESETS[case.preset]
    rng = np.random.default_rng(sub_seed(seed, _ACCEPT, index, 0))
    if case.parents:
        tree = Tree.from_parents(np.array(case.parents), np.array(case.tokens))
        choices = np.array(case.choices, dtype=np.int64)
    else:
        logits = rng.standard_normal((15, case.vocab))
        tree = build_tree(*topk_logprobs(logits, case.nodes), case.nodes)
        tree = tree.with_root(int(rng.integers(case.vocab)))
        choices = random_walk(tree, case.vocab, rng)
    accepted, next_root = accept(tree, choices)
    rows = case.start + tree.n + 1 + TRAILING_ROWS
    c_kv = rng.standard_normal((rows, cfg.kv_lora_rank)).astype(np.float32)
    k_pe = rng.standard_normal((rows, cfg.qk_rope_head_dim)).astype(np.float32)
    c_kv_after, k_pe_after = c_kv.copy(), k_pe.copy()
    compact(c_kv_after, case.start, accepted)
    compact(k_pe_after, case.start, accepted)
    tensors = {"parents": tree.parents, "tokens": tree.tokens, "choices": choices, "c_kv": c_kv,
               "k_pe": k_pe, "accepted": accepted, "next_root": np.array(next_root, dtype=np.int64),
               "c_kv_after": c_kv_after, "k_pe_after": k_pe_after}
    meta = {"name": case.name, "preset": case.preset, "start": case.start, "nodes": tree.n + 1,
            "accepted": len(accepted),
            "prefix": bool(np.array_equal(accepted, np.arange(len(accepted))))}
    return tensors, meta


# ---------------------------------------------------------------------------- files

_KINDS = {
    "tree_build": (_tree_case, TREE_CASES, TREE_CASES_LARGE),
    "verify_attention": (_attention_case, ATTENTION_CASES, ATTENTION_CASES_LARGE),
    "accept_compact": (_accept_case, ACCEPT_CASES, ACCEPT_CASES_LARGE),
    "paged_kv": (paged_case, PAGED_CASES, ()),            # refgen/paged_cases.py: small cases only
    "corpus": (corpus_case, CORPUS_CASES, ()),          # refgen/corpus.py: small cases only
}


def kernel_cases(kind: str, large: bool) -> tuple[Any, ...]:
    """The case specs of one kernel fixture."""
    if kind not in _KINDS:
        raise FixtureError(f"unknown kernel-case kind {kind!r} ({', '.join(KERNEL_KINDS)})")
    _, small, big = _KINDS[kind]
    return big if large else small


def kernel_fixture(kind: str, seed: int = 0, large: bool = False,
                   progress: Progress | None = None) -> Fixture:
    """The kernel-case fixture of `kind` (small committed cases, or the large ones)."""
    cases = kernel_cases(kind, large)
    make = _KINDS[kind][0]
    tensors: dict[str, np.ndarray] = {}
    metas = []
    for index, case in enumerate(cases):
        case_tensors, meta = make(case, seed, index)
        tensors.update({f"cases/{case.name}/{name}": array for name, array in case_tensors.items()})
        metas.append(meta)
        if progress:
            progress(1)
    metadata = {"kdtree_fixture": FIXTURE_FORMAT, "kind": kind, "large": large,
                "generator": generator_info(seed), "tolerances": TOLERANCES,
                "tolerances_bf16": TOLERANCES_BF16, "cases": metas}
    return Fixture(tensors, metadata)
