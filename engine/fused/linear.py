"""The dense products of the fused layer, out = x W^T, and their batch-invariant form.

Default mode: cuBLAS (`x @ w.T`), which picks its algorithm, tiling and split-K by the shape, M
included, so a row's bits may change with the number of rows beside it.

Invariant mode (`linear(x, w, invariant=True)`): one Triton tile product whose every choice that
can change a bit is made from (N, K, dtype) alone, never from M:

    out[m, n] = sum over splits s in order of  P_s[m, n],
    P_s[m, n] = sum over K-blocks k of split s, in order, of  tile_dot(x[m, k], W[n, k])

with tiles of BLOCK_N x BLOCK_K fixed per dtype and `invariant_block_m` rows (bf16: fixed; float32:
following M, as each output element of an exact float32 tile is one FMA chain whatever the tile's
rows), the K range cut into `splits(N, K)` equal runs of whole K-blocks (enough programs to stream
the weight when M is small), the partial sums P_s kept in float32 and added in split order. Where
the row and column blocks alone give PROGRAMS programs, one program computes every P_s of its
tile in turn and adds them in registers; else each split is a program and a second kernel adds
their float32 partials. Both add the same values in the same order. A row's output element is
computed by the same additions in the same order whatever M is (M sizes the grid, masks rows and
picks where the splits are added, and float32's tile rows), so it is bitwise the same in a 1-row
decode, a 65-row verify or a batched call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import INTERPRETED, cast, dot, invariant_block_m

BLOCK_N = 64
BLOCK_K = {torch.bfloat16: 128, torch.float32: 32}
# programs for one row block to stream a weight (two per SM of an H100 / H200); the interpreter
# runs programs one by one: one split (the tests force more)
PROGRAMS = 1 if INTERPRETED else 264
MAX_SPLITS = 8


@triton.jit(do_not_specialize=["M"])      # one compiled kernel for every M (no M == 1 or M % 16 variant)
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, sxm, swn,
                   PARTIAL: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Splits program_id(2) x SPLITS ... + SPLITS - 1 of the tile, each summed from zero and the
    sums added in order. PARTIAL (SPLITS 1): out float32 [splits, M, N] gets the split's sum; else
    out [M, N] the whole product in out's dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        k_begin = (tl.program_id(2) * SPLITS + s) * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + ks
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + k[None, :],
                        mask=(rows[:, None] < M) & (k[None, :] < k_end), other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * swn + k[:, None],
                        mask=(k[:, None] < k_end) & (cols[None, :] < N), other=0.0)
            acc = dot(a, b, acc, IEEE)
        if s == 0:
            total = acc
        else:
            total += acc
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:
        at = (tl.program_id(2) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(out_ptr + at, total, mask=inside)
    else:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], cast(total, out_ptr.dtype.element_ty),
                 mask=inside)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < size
    total = tl.load(partial_ptr + at, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(partial_ptr + s * size + at, mask=inside, other=0.0)
    tl.store(out_ptr + at, cast(total, out_ptr.dtype.element_ty), mask=inside)


def splits(n: int, k: int, dtype: torch.dtype) -> int:
    """The number of K runs for a weight [n, k]: the fewest of 1, 2, 4, 8 that give one row
    block PROGRAMS programs, no more than the K-blocks there are (from the weight alone)."""
    column_blocks, k_blocks = triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K[dtype])
    count = 1
    while count < MAX_SPLITS and column_blocks * count < PROGRAMS and 2 * count <= k_blocks:
        count *= 2
    return count


def linear(x: torch.Tensor, w: torch.Tensor, invariant: bool = False, split_count: int | None = None,
           in_program: bool | None = None) -> torch.Tensor:
    """x [M, K] (last dim contiguous), w [N, K] (last dim contiguous), both of one dtype -> x w^T
    [M, N] in that dtype, float32 accumulation (float32 exact: no TF32). invariant: the
    batch-invariant product (module docstring); split_count: its number of K runs instead of
    `splits`', in_program: whether one program adds them instead of the tiles' count deciding
    (the tests)."""
    if not invariant:
        return x @ w.T
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"linear: the last dims must be contiguous, got strides {x.stride()} and {w.stride()}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    block_k = BLOCK_K[x.dtype]
    count = split_count or splits(n, k, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, count), block_k) * block_k
    block_m = invariant_block_m(m, x.dtype)
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    if in_program is None:
        in_program = tiles[0] * tiles[1] >= PROGRAMS
    apart = count > 1 and not in_program          # a program a run, their partials added by a second kernel
    partial = torch.empty(count, m, n, device=x.device, dtype=torch.float32) if apart else out
    _linear_kernel[tiles + (count if apart else 1,)](
        x, w, partial, m, n, k, k_per_split, x.stride(0), w.stride(0), PARTIAL=apart,
        SPLITS=1 if apart else count, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k, num_warps=4)
    if apart:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, m * n, SPLITS=count, BLOCK=block,
                                                         num_warps=4)
    return out
