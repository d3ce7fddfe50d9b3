"""The fused FFN: the router in one kernel, the token-to-expert sort in one (or three), the experts in two.

Every FFN of the fused layer is a set of ET stacked experts (`fuse` in engine/fused/layer.py): a MoE
layer's E routed experts and then its shared experts, split into n_shared experts of the routed
width; a dense layer's MLP as one expert. Row m of the layer's input gets S slots, each an
(expert, weight) pair: its k routed choices, then one slot per shared expert at weight 1 (a
dense layer: one slot, expert 0, weight 1). Then

    y[m, s] = weight[m, s] * W_down_e (silu(W_gate_e h[m]) * (W_up_e h[m]))      float32 [M, S, D]

and the next `add_rms_norm` sums y over s in slot order, so the combine has one fixed order and
no atomics. The launches:

- `route`: per row, from the router logits (h W_router^T, float32): sigmoid scores, the
  selection-only bias, group-limited top-k (a group scores the sum of its two best), the k
  best experts (ties to the lower index, as `engine.model.route`), their scores normalized
  and scaled, and the shared slots appended.
- `align`: the (row, slot) pairs of real rows sorted by expert (stable: each expert's pairs in
  pair order), each expert's run padded to whole blocks of BLOCK_M (pair -1 in the padding),
  with the expert of every block and the number of blocks, reading nothing back to the host: a
  few pairs in one program; many in three launches (spans of pairs counted per expert in
  parallel, one program's scan of the counts into each span's starts, the spans placed in
  parallel).
- `gate_up` / `down`: per block of BLOCK_M sorted pairs, one expert's tile products, SiLU-and-mul
  in the first's epilogue, the routing weight in the second's. Their grids are sized from the
  shapes alone (the most blocks any routing can need); blocks past the count return at once,
  so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtr_format import ModelConfig

from .tiles import INTERPRETED, cast, dot, invariant_block_m


@triton.jit
def _route_kernel(logits_ptr, h_ptr, gate_ptr, bias_ptr, idx_ptr, weight_ptr, E, D, scaling,
                  EG: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                  SHARED: tl.constexpr, NORM: tl.constexpr, FROM_H: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_EG: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    e = tl.arange(0, BLOCK_EG)[None, :]
    expert = g * EG + e                                                   # [BG, BEG]
    inside = (g < G) & (e < EG)
    if FROM_H:                                                            # logits = h W_router^T here
        logits = tl.zeros([BLOCK_G, BLOCK_EG], dtype=tl.float32)
        d = tl.arange(0, BLOCK_D)[None, None, :]
        for d0 in range(0, D, BLOCK_D):
            h = tl.load(h_ptr + row * D + d0 + d, mask=d0 + d < D, other=0.0).to(tl.float32)
            w = tl.load(gate_ptr + expert[:, :, None].to(tl.int64) * D + d0 + d,
                        mask=inside[:, :, None] & (d0 + d < D), other=0.0)
            logits += tl.sum(h * w, axis=2)
    else:
        logits = tl.load(logits_ptr + row * E + expert, mask=inside, other=0.0)
    scores = tl.sigmoid(logits)
    selection = tl.where(inside, scores + tl.load(bias_ptr + expert, mask=inside, other=0.0), float("-inf"))
    big = BLOCK_G * BLOCK_EG
    if G > 1:
        best = tl.max(selection, axis=1)                                  # [BG]
        first = tl.min(tl.where(selection == best[:, None], expert, big), axis=1)
        second = tl.max(tl.where(expert == first[:, None], float("-inf"), selection), axis=1)
        group_score = tl.where(tl.arange(0, BLOCK_G) < G, best + second, float("-inf"))
        kept = tl.zeros([BLOCK_G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=0)
            chosen = tl.min(tl.where(group_score == top, tl.arange(0, BLOCK_G), BLOCK_G), axis=0)
            kept = kept | (tl.arange(0, BLOCK_G) == chosen)
            group_score = tl.where(tl.arange(0, BLOCK_G) == chosen, float("-inf"), group_score)
        selection = tl.where(kept[:, None], selection, float("-inf"))
    total = 0.0
    for j in tl.static_range(K):
        top = tl.max(tl.max(selection, axis=1), axis=0)
        chosen = tl.min(tl.min(tl.where(selection == top, expert, big), axis=1), axis=0)
        score = tl.sum(tl.sum(tl.where(expert == chosen, scores, 0.0), axis=1), axis=0)
        tl.store(idx_ptr + row * (K + SHARED) + j, chosen.to(tl.int32))
        tl.store(weight_ptr + row * (K + SHARED) + j, score)
        total += score
        selection = tl.where(expert == chosen, float("-inf"), selection)
    for j in tl.static_range(K):
        w = tl.load(weight_ptr + row * (K + SHARED) + j)
        if NORM:
            w = w / total
        tl.store(weight_ptr + row * (K + SHARED) + j, w * scaling)
    for j in tl.static_range(SHARED):
        tl.store(idx_ptr + row * (K + SHARED) + K + j, (E + j).to(tl.int32))
        tl.store(weight_ptr + row * (K + SHARED) + K + j, 1.0)


ROUTER_ROWS = 16     # up to this many rows `route` computes the logits itself; past it, one GEMM


def route(cfg: ModelConfig, h: torch.Tensor, h32: torch.Tensor | None, gate: torch.Tensor,
          bias: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, D] (normed), h32 its float32 copy (needed past ROUTER_ROWS rows outside invariant
    mode), gate float32 [E, D], bias float32 [E] -> (experts int32 [M, S], weights float32
    [M, S]), S = k + n_shared (module docstring). The logits h W_router^T are float32;
    invariant: computed per row by the kernel whatever M (no GEMM chosen by M)."""
    m = h.shape[0]
    experts, width = gate.shape
    k, shared = cfg.num_experts_per_tok, cfg.n_shared_experts
    idx = torch.empty(m, k + shared, device=h.device, dtype=torch.int32)
    weight = torch.empty(m, k + shared, device=h.device, dtype=torch.float32)
    if m:
        from_h = invariant or m <= ROUTER_ROWS
        logits = weight if from_h else h32 @ gate.T                       # [M, E]
        per_group = experts // cfg.n_group
        block_g, block_eg = triton.next_power_of_2(cfg.n_group), triton.next_power_of_2(per_group)
        _route_kernel[(m,)](logits, h, gate, bias, idx, weight, experts, width, float(cfg.routed_scaling_factor),
                            EG=per_group, G=cfg.n_group, TOPK_GROUP=cfg.topk_group, K=k, SHARED=shared,
                            NORM=bool(cfg.norm_topk_prob), FROM_H=from_h, BLOCK_G=block_g, BLOCK_EG=block_eg,
                            BLOCK_D=max(16, min(1024, 16384 // (block_g * block_eg))), num_warps=8)
    return idx, weight


@triton.jit
def _span_counts(idx_ptr, real_ptr, lo, hi, S, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """-> int32 [BLOCK_E]: the real pairs of [lo, hi) that chose each expert."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(lo, hi, CHUNK):
        p = c + tl.arange(0, CHUNK)
        ids = tl.where(tl.load(real_ptr + p // S, mask=p < hi, other=0) != 0, tl.load(idx_ptr + p, mask=p < hi), -1)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    return counts


@triton.jit
def _place_span(idx_ptr, real_ptr, sorted_ptr, lo, hi, S, taken, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """The real pairs of [lo, hi) into sorted_ptr in pair order, expert e's from taken[e] on."""
    experts = tl.arange(0, BLOCK_E)
    for c in range(lo, hi, CHUNK):
        p = c + tl.arange(0, CHUNK)
        ids = tl.where(tl.load(real_ptr + p // S, mask=p < hi, other=0) != 0, tl.load(idx_ptr + p, mask=p < hi), -1)
        match = (ids[None, :] == experts[:, None]).to(tl.int32)                 # [BE, CHUNK]
        position = taken[:, None] + tl.cumsum(match, axis=1) - 1
        target = tl.sum(match * position, axis=0)
        tl.store(sorted_ptr + target, p.to(tl.int32), mask=tl.sum(match, axis=0) > 0)
        taken += tl.sum(match, axis=1)


@triton.jit
def _fill_padding(sorted_ptr, lo, hi, CHUNK: tl.constexpr):
    for s0 in range(lo, hi, CHUNK):
        slot = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slot, tl.full([CHUNK], -1, tl.int32), mask=slot < hi)


@triton.jit
def _runs(total, block_expert_ptr, blocks_ptr, max_blocks, ET, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
          CHUNK: tl.constexpr):
    """Each expert's run of total[e] pairs padded to whole blocks, runs in expert order: stores
    the expert of every block and their count; -> the runs' starts [BLOCK_E]."""
    experts = tl.arange(0, BLOCK_E)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offsets = tl.cumsum(padded, axis=0) - padded
    blocks = tl.sum(padded, axis=0) // BLOCK_M
    tl.store(blocks_ptr, blocks)
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.max(tl.where(((offsets // BLOCK_M)[:, None] <= b[None, :]) & (padded[:, None] > 0)
                                & (experts[:, None] < ET), experts[:, None], -1), axis=0)
        tl.store(block_expert_ptr + b, tl.where(b < blocks, owner, -1), mask=b < max_blocks)
    return offsets


@triton.jit
def _align_kernel(idx_ptr, real_ptr, sorted_ptr, block_expert_ptr, blocks_ptr, pairs, S, capacity,
                  max_blocks, ET, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """The whole sort in one program (a call of few pairs: one launch)."""
    total = _span_counts(idx_ptr, real_ptr, 0, pairs, S, BLOCK_E, CHUNK)
    offsets = _runs(total, block_expert_ptr, blocks_ptr, max_blocks, ET, BLOCK_M, BLOCK_E, CHUNK)
    _fill_padding(sorted_ptr, 0, capacity, CHUNK)
    tl.debug_barrier()
    _place_span(idx_ptr, real_ptr, sorted_ptr, 0, pairs, S, offsets, BLOCK_E, CHUNK)


@triton.jit
def _align_count_kernel(idx_ptr, real_ptr, sorted_ptr, counts_ptr, pairs, S, span, capacity,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Program i: counts_ptr[i] = _span_counts of its span [i * span, (i + 1) * span), and its
    share of the padding, set before any pair is placed."""
    i = tl.program_id(0)
    counts = _span_counts(idx_ptr, real_ptr, i * span, tl.minimum((i + 1) * span, pairs), S, BLOCK_E, CHUNK)
    tl.store(counts_ptr + i * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    share = tl.cdiv(capacity, tl.num_programs(0))
    _fill_padding(sorted_ptr, i * share, tl.minimum((i + 1) * share, capacity), CHUNK)


@triton.jit
def _align_scan_kernel(counts_ptr, starts_ptr, block_expert_ptr, blocks_ptr, programs, max_blocks, ET,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                       CHUNK: tl.constexpr):
    """From counts [programs, BLOCK_E]: the runs (`_runs`), and starts_ptr[i, e] = where span i's
    first pair of expert e goes (its run's start plus the pairs of e in the spans before i)."""
    at = tl.arange(0, BLOCK_P)[:, None] * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
    inside = tl.arange(0, BLOCK_P)[:, None] < programs
    counts = tl.load(counts_ptr + at, mask=inside, other=0)                     # [BP, BE]
    offsets = _runs(tl.sum(counts, axis=0), block_expert_ptr, blocks_ptr, max_blocks, ET, BLOCK_M, BLOCK_E, CHUNK)
    tl.store(starts_ptr + at, offsets[None, :] + tl.cumsum(counts, axis=0) - counts, mask=inside)


@triton.jit
def _align_place_kernel(idx_ptr, real_ptr, sorted_ptr, starts_ptr, pairs, S, span,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Program i places the pairs of its span from its starts."""
    i = tl.program_id(0)
    taken = tl.load(starts_ptr + i * BLOCK_E + tl.arange(0, BLOCK_E))
    _place_span(idx_ptr, real_ptr, sorted_ptr, i * span, tl.minimum((i + 1) * span, pairs), S, taken, BLOCK_E,
                CHUNK)


ALIGN_PROGRAMS = 32  # the most programs of the sort's count and place launches (`align`)
GEMV_BLOCK_M = 4     # float32 blocks of a few pairs: CUDA-core products (below the tile product's 16 rows)


def block_m(pairs: int, experts: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows per expert block: the smallest of 16, 32, 64 that the mean run fills; in float32,
    GEMV_BLOCK_M where the mean run is that short (decode: an exact float32 tile product
    costs its 16 rows whatever the pairs in it)."""
    per_expert = pairs / max(experts, 1)
    if dtype == torch.float32 and per_expert <= GEMV_BLOCK_M:
        return GEMV_BLOCK_M
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def align(idx: torch.Tensor, real: torch.Tensor, experts: int, rows_per_block: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx int32 [M, S] in [0, experts), real uint8 [M] -> (sorted pairs int32 [blocks * BM]
    (pair m * S + s, -1 in padding), block_expert int32 [blocks] (-1 past the count),
    count int32 [1]), blocks the most any routing needs (module docstring)."""
    pairs = idx.numel()
    max_blocks = (pairs + min(pairs, experts) * (rows_per_block - 1)) // rows_per_block
    sorted_pairs = torch.empty(max_blocks * rows_per_block, device=idx.device, dtype=torch.int32)
    block_expert = torch.empty(max_blocks, device=idx.device, dtype=torch.int32)
    count = torch.empty(1, device=idx.device, dtype=torch.int32)
    if pairs:
        # programs take spans of pairs in chunks: a chunk as many pairs as an [experts, chunk]
        # match matrix of at most 8192 entries allows, a span whole chunks; a call of one chunk
        # (a decode's few pairs) is one program and one launch, a verify's thousands of pairs
        # spans of a few chunks in up to ALIGN_PROGRAMS programs (three launches)
        block_e = triton.next_power_of_2(experts)
        chunk = max(16, min(1024, 8192 // block_e, triton.next_power_of_2(pairs)))
        span = triton.cdiv(triton.cdiv(pairs, min(ALIGN_PROGRAMS, triton.cdiv(pairs, chunk))), chunk) * chunk
        programs = triton.cdiv(pairs, span)
        shape = dict(BLOCK_E=block_e, CHUNK=chunk, num_warps=8 if block_e * chunk >= 4096 else 4)
        if programs == 1:
            _align_kernel[(1,)](idx, real, sorted_pairs, block_expert, count, pairs, idx.shape[1],
                                sorted_pairs.numel(), max_blocks, experts, BLOCK_M=rows_per_block, **shape)
        else:
            counts = torch.empty(programs, block_e, device=idx.device, dtype=torch.int32)
            starts = torch.empty_like(counts)
            _align_count_kernel[(programs,)](idx, real, sorted_pairs, counts, pairs, idx.shape[1], span,
                                             sorted_pairs.numel(), **shape)
            _align_scan_kernel[(1,)](counts, starts, block_expert, count, programs, max_blocks, experts,
                                     BLOCK_M=rows_per_block, BLOCK_P=triton.next_power_of_2(programs), **shape)
            _align_place_kernel[(programs,)](idx, real, sorted_pairs, starts, pairs, idx.shape[1], span, **shape)
    return sorted_pairs, block_expert, count


@triton.jit
def _product(a, b, acc, IEEE: tl.constexpr, CUDA_CORES: tl.constexpr):
    """acc + a b: on the CUDA cores (blocks of fewer than 16 rows), else the tile product."""
    if CUDA_CORES:
        acc = acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        acc = dot(a, b, acc, IEEE)
    return acc


@triton.jit
def _expert_matmul_kernel(a_ptr, w_ptr, w2_ptr, out_ptr, sorted_ptr, block_expert_ptr, blocks_ptr,
                          weight_ptr, N, K, S, sw_e, sw_n,
                          GATED: tl.constexpr, IEEE: tl.constexpr, CUDA_CORES: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GATED: out[sorted row] = silu(a W^T) * (a W2^T), a = h[pair // S] (the gate-up pass);
    else out[pair] = weight[pair] * (a W^T), a = the block's rows of the first pass (down).
    CUDA_CORES: blocks of fewer than 16 rows multiply as a sum of products (float32 outside
    invariant mode: `block_m`), else as the tile product."""
    block = tl.program_id(0)
    if block >= tl.load(blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair >= 0
    if GATED:
        source = (tl.where(valid, pair, 0) // S).to(tl.int64)
    else:
        source = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = expert * sw_e + cols[None, :].to(tl.int64) * sw_n
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + source[:, None] * K + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w_mask = (k[:, None] < K) & (cols[None, :] < N)
        b = tl.load(w_ptr + w_base + k[:, None], mask=w_mask, other=0.0)
        acc = _product(a, b, acc, IEEE, CUDA_CORES)
        if GATED:
            b2 = tl.load(w2_ptr + w_base + k[:, None], mask=w_mask, other=0.0)
            acc2 = _product(a, b2, acc2, IEEE, CUDA_CORES)
    out_mask = valid[:, None] & (cols[None, :] < N)
    if GATED:
        h = acc / (1.0 + tl.exp(-acc)) * acc2
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], cast(h, out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        w = tl.load(weight_ptr + tl.where(valid, pair, 0))
        tl.store(out_ptr + tl.where(valid, pair, 0)[:, None].to(tl.int64) * N + cols[None, :],
                 acc * w[:, None], mask=out_mask)


PROGRAMS = 264       # enough programs in flight to stream the weights (two per SM of an H100 / H200)


def tiles(blocks: int, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of an expert product with `blocks` row blocks and n output columns:
    the widest BLOCK_N of 64, 32, 16 that still gives PROGRAMS programs (16 if none does);
    BLOCK_K 128 in bf16, 32 in float32 (exact float32 tiles are FMA loops: small ones)."""
    if INTERPRETED:              # the interpreter runs programs one by one: the fewest (any tiling is exact)
        return 64, 64
    block_n = next((b for b in (64, 32) if blocks * triton.cdiv(n, b) >= PROGRAMS), 16)
    return block_n, 128 if dtype == torch.bfloat16 else 32


def invariant_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of both expert products in invariant mode: from the dtype alone."""
    return 32, 128 if dtype == torch.bfloat16 else 32


def experts(h: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, real: torch.Tensor,
            w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            tiling: tuple[int, int] | None = None, invariant: bool = False) -> torch.Tensor:
    """h [M, D], idx int32 [M, S], weight float32 [M, S], real uint8 [M], stacked experts
    w_gate, w_up [ET, I, D], w_down [ET, D, I] -> y float32 [M, S, D] (module docstring; the
    pairs of padding rows are left unwritten). tiling: (BLOCK_N, BLOCK_K) for both products
    instead of `tiles`' (the tiling benchmark). invariant: blocks of `invariant_block_m` pairs (bf16:
    64 whatever the call) and `invariant_tiles`, multiplied as tile products, so a pair's output
    does not depend on the pairs beside it in its block."""
    m, slots = idx.shape
    stacked, inner, width = w_gate.shape
    y = torch.empty(m, slots, width, device=h.device, dtype=torch.float32)
    if m == 0 or slots == 0:
        return y
    if invariant:
        tiling = invariant_tiles(h.dtype)
    if invariant:
        bm = invariant_block_m(m * slots / stacked, h.dtype)
    else:
        bm = block_m(m * slots, stacked, h.dtype)
    sorted_pairs, block_expert, count = align(idx, real, stacked, bm)
    blocks = block_expert.shape[0]
    ieee = h.dtype == torch.float32
    hidden = torch.empty(sorted_pairs.shape[0], inner, device=h.device, dtype=h.dtype)
    for a, w, w2, out, n, k, gated in ((h, w_gate, w_up, hidden, inner, width, True),
                                       (hidden, w_down, w_down, y, width, inner, False)):
        block_n, block_k = tiling or tiles(blocks, n, h.dtype)
        _expert_matmul_kernel[(blocks, triton.cdiv(n, block_n))](
            a, w, w2, out, sorted_pairs, block_expert, count, weight, n, k, slots, w.stride(0), w.stride(1),
            GATED=gated, IEEE=ieee, CUDA_CORES=bm < 16 and not invariant, BLOCK_M=bm, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4)
    return y
