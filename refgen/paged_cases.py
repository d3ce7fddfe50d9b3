"""Paged-KV kernel cases: tree-verify attention and KV compaction through a block table.

The latent and rotary caches live in pages, as vLLM, SGLang and FlashMLA keep them:

    c_kv_pages [P, page_size, kv_lora], k_pe_pages [P, page_size, d_rope]
    block_table int32 [B, W]    request b's slot s is row s % page_size of page
                                block_table[b, s // page_size]; entries past the
                                request's last page are -1 (never to be read)

Pages are handed out in a shuffled order, so a request's pages are neither contiguous
nor increasing. Requests 0 and 1 share their first `shared` pages: their contexts begin
with the same tokens (one prompt, as prefix caching keeps it), so those pages hold the
same keys for both. A shared page holds only context slots (below each sharer's start),
so a correct compaction, which writes slots start .. start + a - 1, never writes one.
Pages no request holds and the slots of a request's last page past its keys hold junk:
a kernel that reads them is visibly wrong.

Attention cases give the queries of each request's tree and expect `o_lat`, `lse` from
the float64 reference over the request's logical keys (context, then tree tokens), built
before any paging, so the expected values do not depend on the block table at all; and
`o_lat_bf16`, `lse_bf16`, the same from the inputs rounded to bf16 (what a bf16 kernel loads).
Compaction cases give a tree written at each request's slots start .. start + n and an
accepted path per request (a random walk down the tree; non-prefix paths included), and
expect the whole pools after the move (contract section 7): every other slot, every
shared page and every unused page unchanged, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kdtr_format import PRESETS

from .case_inputs import JUNK, SCORE_STD, bf16_rounded, random_walk, tree_shape
from .ddtree import accept, compact, compile_tree
from .fixtures import FixtureError, sub_seed
from .model import absorbed_attention, softmax_scale

_PAGED = 14              # sub-seed stream (refgen.fixtures 0..2, kernel_cases 10..12, corpus 13)
SPARE_PAGES = 2          # pages no request holds, full of junk


@dataclass(frozen=True)
class PagedCase:
    """A paged batch: per request a cached context (the compaction's start) and a tree
    (kernel_cases._tree_shape: root, chain, star, random); `op` is "attention" or
    "compact"; requests 0 and 1 share their first `shared` pages."""

    name: str
    op: str
    preset: str
    page_size: int
    contexts: tuple[int, ...]
    trees: tuple[tuple[str, int], ...]
    shared: int = 0


PAGED_CASES = (
    PagedCase("attention_k2_page64", "attention", "kimi-k2", 64, (130, 150, 20),
              (("random", 3), ("chain", 1), ("root", 0)), shared=2),
    PagedCase("attention_k2_page16", "attention", "kimi-k2", 16, (40, 77), (("random", 3), ("root", 0)), shared=2),
    PagedCase("attention_k2_page1", "attention", "kimi-k2", 1, (9, 12), (("chain", 2), ("root", 0)), shared=5),
    PagedCase("attention_tiny_page16", "attention", "tiny", 16, (33, 250, 0, 64),
              (("random", 39), ("chain", 16), ("root", 0), ("star", 12)), shared=2),
    PagedCase("compact_tiny_page16", "compact", "tiny", 16, (40, 33, 16),
              (("random", 16), ("random", 16), ("random", 16)), shared=1),
    PagedCase("compact_k2_page64", "compact", "kimi-k2", 64, (130, 70), (("random", 40), ("random", 12)), shared=1),
    PagedCase("compact_k2_page1", "compact", "kimi-k2", 1, (10, 12), (("random", 8), ("random", 8)), shared=8),
    # A page of 3 slots: an in-page offset taken as `slot & (page - 1)` holds only for powers of two.
    PagedCase("attention_tiny2_page3", "attention", "tiny2", 3, (10, 7, 20),
              (("random", 6), ("chain", 3), ("star", 5)), shared=2),
    PagedCase("compact_tiny2_page3", "compact", "tiny2", 3, (9, 7, 13),
              (("random", 8), ("random", 6), ("random", 5)), shared=2),
)


def _pages_of(length: int, page_size: int) -> int:
    return -(-length // page_size)


def block_tables(case: PagedCase, lengths: list[int], rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """-> (block_table int32 [B, W], P pages in the pool): request b holds
    ceil(lengths[b] / page_size) pages, drawn from a shuffled pool; requests 0 and 1
    share their first `case.shared`; SPARE_PAGES pages belong to no request."""
    need = [_pages_of(n, case.page_size) for n in lengths]
    if case.shared and (len(need) < 2 or case.shared * case.page_size > min(case.contexts[:2])):
        raise FixtureError(f"{case.name}: {case.shared} shared pages do not fit inside requests 0 and 1's contexts")
    pool = sum(need) - case.shared + SPARE_PAGES
    order = iter(rng.permutation(pool).tolist())
    table = np.full((len(need), max(need)), -1, dtype=np.int32)
    for b, count in enumerate(need):
        for j in range(count):
            table[b, j] = table[0, j] if b == 1 and j < case.shared else next(order)
    return table, pool


def _page_in(pool: np.ndarray, table_row: np.ndarray, logical: np.ndarray) -> None:
    """pool [P, page, w] <- logical [n, w] at the slots of one request's block-table row."""
    page = pool.shape[1]
    for s in range(len(logical)):
        pool[table_row[s // page], s % page] = logical[s]


def _pools(table: np.ndarray, pages: int, page: int,
           logical: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """-> (c_kv_pages [P, page, R], k_pe_pages [P, page, dr]) float32 holding each request's
    logical (c_kv [n, R], k_pe [n, dr]) rows, junk elsewhere."""
    c_pool = np.full((pages, page, logical[0][0].shape[1]), JUNK, dtype=np.float32)
    k_pool = np.full((pages, page, logical[0][1].shape[1]), JUNK, dtype=np.float32)
    for b, (c, k) in enumerate(logical):
        _page_in(c_pool, table[b], c)
        _page_in(k_pool, table[b], k)
    return c_pool, k_pool


def _shared_pages(table: np.ndarray) -> list[int]:
    held = table[table >= 0]
    ids, counts = np.unique(held, return_counts=True)
    return ids[counts > 1].tolist()


def _logical_keys(case: PagedCase, lengths: list[int], widths: tuple[int, int],
                  rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each request's keys before paging: (c_kv [n, R], k_pe [n, dr]) float32, standard
    normal; request 1's first shared * page_size rows are request 0's (one prompt)."""
    keys = [tuple(rng.standard_normal((n, w)).astype(np.float32) for w in widths) for n in lengths]
    prefix = case.shared * case.page_size
    for which in range(2 if case.shared else 0):
        keys[1][which][:prefix] = keys[0][which][:prefix]
    return keys


def _attention_case(case: PagedCase, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    cfg = PRESETS[case.preset]
    H, R, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = softmax_scale(cfg)
    trees = [tree_shape(shape, nodes, rng) for shape, nodes in case.trees]
    sizes = np.array([t.n + 1 for t in trees], dtype=np.int64)
    contexts = np.array(case.contexts, dtype=np.int64)
    lengths = (contexts + sizes).tolist()
    table, pages = block_tables(case, lengths, rng)
    keys = _logical_keys(case, lengths, (R, dr), rng)
    q_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    T, words = int(q_offsets[-1]), int(-(-sizes.max() // 32))
    q_std = SCORE_STD / (scale * np.sqrt(R + dr))
    q_lat = (q_std * rng.standard_normal((T, H, R))).astype(np.float32)
    q_pe = (q_std * rng.standard_normal((T, H, dr))).astype(np.float32)
    visibility_bits = np.zeros((T, words), dtype=np.uint32)
    expected = {name: np.zeros((T, H, R), dtype=np.float32) if name.startswith("o_lat") else np.zeros((T, H))
                for name in ("o_lat", "lse", "o_lat_bf16", "lse_bf16")}
    for b, tree in enumerate(trees):
        queries = slice(q_offsets[b], q_offsets[b + 1])
        compiled = compile_tree(tree, int(contexts[b]))
        visibility_bits[queries, :compiled.visibility_bits.shape[1]] = compiled.visibility_bits
        visibility = np.concatenate([np.ones((sizes[b], contexts[b]), dtype=bool), compiled.visibility], axis=1)
        for suffix, rounding in (("", np.asarray), ("_bf16", bf16_rounded)):
            o, l = absorbed_attention(*(rounding(x) for x in (q_lat[queries], q_pe[queries], *keys[b])), visibility,
                                      scale)
            expected["o_lat" + suffix][queries], expected["lse" + suffix][queries] = o, l
    c_pool, k_pool = _pools(table, pages, case.page_size, keys)
    tensors = {"q_lat": q_lat, "q_pe": q_pe, "c_kv_pages": c_pool, "k_pe_pages": k_pool, "block_table": table,
               "context": contexts, "tree_sizes": sizes, "q_offsets": q_offsets,
               "visibility_bits": visibility_bits, **expected}
    meta = {"scale": scale, "heads": H, "kv_lora_rank": R, "qk_rope_head_dim": dr, "tokens": T,
            "trees": [shape for shape, _ in case.trees]}
    return tensors, meta


def _compact_case(case: PagedCase, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    cfg = PRESETS[case.preset]
    vocab = 8                                          # _tree_shape's random trees draw tokens below 8
    trees = [tree_shape(shape, nodes, rng).with_root(int(rng.integers(vocab))) for shape, nodes in case.trees]
    paths = [accept(tree, random_walk(tree, vocab, rng))[0] for tree in trees]
    starts = np.array(case.contexts, dtype=np.int64)
    lengths = [int(s) + tree.n + 1 for s, tree in zip(starts, trees)]
    table, pages = block_tables(case, lengths, rng)
    keys = _logical_keys(case, lengths, (cfg.kv_lora_rank, cfg.qk_rope_head_dim), rng)
    c_pool, k_pool = _pools(table, pages, case.page_size, keys)
    for b, path in enumerate(paths):
        for array in keys[b]:
            compact(array, int(starts[b]), path)
    c_after, k_after = c_pool.copy(), k_pool.copy()
    for b, (c, k) in enumerate(keys):
        _page_in(c_after, table[b], c)
        _page_in(k_after, table[b], k)
    accepted = np.concatenate(paths).astype(np.int64)
    accept_offsets = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
    tensors = {"c_kv_pages": c_pool, "k_pe_pages": k_pool, "block_table": table, "starts": starts,
               "accepted": accepted, "accept_offsets": accept_offsets, "c_kv_after": c_after, "k_pe_after": k_after}
    meta = {"nodes": [t.n + 1 for t in trees], "accepted": [len(p) for p in paths],
            "prefix": [bool(np.array_equal(p, np.arange(len(p)))) for p in paths]}
    return tensors, meta


def paged_case(case: PagedCase, seed: int, index: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One case's tensors and metadata (module docstring)."""
    if case.op not in ("attention", "compact"):
        raise FixtureError(f"{case.name}: unknown paged op {case.op!r} (attention, compact)")
    rng = np.random.default_rng(sub_seed(seed, _PAGED, index, 0))
    if case.op == "attention":
        tensors, meta = _attention_case(case, rng)
    else:
        tensors, meta = _compact_case(case, rng)
    meta = {"name": case.name, "op": case.op, "preset": case.preset, "page_size": case.page_size,
            "batch": len(case.contexts), "pages": int(tensors["c_kv_pages"].shape[0]),
            "shared_pages": _shared_pages(tensors["block_table"]), **meta}
    return tensors, meta
