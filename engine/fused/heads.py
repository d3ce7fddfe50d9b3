"""The per-head products of absorbed MLA, read and written in the row-major layouts around them.

    out[m, h, n] = sum_k x[m, h, k] w[h, k, n]

with x and w taken through their strides, so the absorption q_lat = q_nope W_uk reads q_nope
straight out of the q projection [M, H, d_nope + d_rope], and the value up-projection
o = o_lat W_uv^T reads W_uv [H, d_v, R] as it is stored; out is [M, H, N] contiguous, the layout
the attention kernel and the output projection take. With `rope`, the same launch rotates q_pe
(the last d_rope columns of q) into q_pe [M, H, d_rope].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import cast, dot, invariant_block_m, rope_pair


@triton.jit(do_not_specialize=["M"])      # one compiled kernel for every M (no M == 1 or M % 16 variant)
def _head_bmm_kernel(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, q_pe_ptr, M, H, N, K,
                     sxm, sxh, swh, swk, swn, q_pe_offset,
                     ROPE: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid_m, head, pid_n = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + head * sxh + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + head * swh + k[:, None] * swk + cols[None, :] * swn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = dot(a, b, acc, IEEE)
    tl.store(out_ptr + (rows[:, None].to(tl.int64) * H + head) * N + cols[None, :], cast(acc, out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    if ROPE:
        if pid_n == 0:
            half_idx = tl.arange(0, BLOCK_HALF)
            inside = (rows[:, None] < M) & (half_idx[None, :] < HALF)
            cos = tl.load(cos_ptr + rows[:, None] * HALF + half_idx[None, :], mask=inside, other=0.0)
            sin = tl.load(sin_ptr + rows[:, None] * HALF + half_idx[None, :], mask=inside, other=0.0)
            src = x_ptr + rows[:, None].to(tl.int64) * sxm + head * sxh + q_pe_offset
            first, a, second, b = rope_pair(src, half_idx[None, :], inside, cos, sin, HALF, INTERLEAVE)
            dst = q_pe_ptr + (rows[:, None].to(tl.int64) * H + head) * 2 * HALF
            tl.store(dst + first, cast(a, q_pe_ptr.dtype.element_ty), mask=inside)
            tl.store(dst + second, cast(b, q_pe_ptr.dtype.element_ty), mask=inside)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def head_bmm(x: torch.Tensor, w: torch.Tensor, w_transposed: bool,
             rope: tuple[torch.Tensor, torch.Tensor, str] | None = None, invariant: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, H, >= K] (last dim contiguous; the first K columns are the product's), w [H, K, N]
    or, w_transposed, [H, N, K] -> (out [M, H, N] in x's dtype, q_pe [M, H, dr] or None).

    rope (cos, sin float32 [M, dr/2], style): also rotate q_pe, the columns K .. K + dr of x
    (dr = x.shape[2] - K). float32 products are exact float32 (no TF32). invariant: tiles of
    `invariant_block_m` rows, so a row's bits do not depend on the rows beside it."""
    m, heads = x.shape[:2]
    if x.stride(2) != 1:
        raise ValueError(f"head_bmm: x's last dim must be contiguous, got strides {x.stride()}")
    if w_transposed:
        n, k = w.shape[1:]
        swk, swn = w.stride(2), w.stride(1)
    else:
        k, n = w.shape[1:]
        swk, swn = w.stride(1), w.stride(2)
    out = torch.empty(m, heads, n, device=x.device, dtype=x.dtype)
    q_pe = None
    if rope is not None:
        q_pe = torch.empty(m, heads, x.shape[2] - k, device=x.device, dtype=x.dtype)
    if m == 0 or heads == 0:
        return out, q_pe
    block_m, block_n = invariant_block_m(m, x.dtype) if invariant else _block_m(m), 64
    half = q_pe.shape[2] // 2 if rope is not None else 1
    _head_bmm_kernel[(triton.cdiv(m, block_m), heads, triton.cdiv(n, block_n))](
        x, w, out, rope[0] if rope else x, rope[1] if rope else x, q_pe if rope else out,
        m, heads, n, k, x.stride(0), x.stride(1), w.stride(0), swk, swn, k,
        ROPE=rope is not None, HALF=half, INTERLEAVE=rope is not None and rope[2] == "interleave",
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return out, q_pe
