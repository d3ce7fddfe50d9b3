"""Row kernels of the fused layer: the residual add with its RMSNorm, and the latent step.

`add_rms_norm`: the residual stream's update and the next pre-norm in one pass over a row,

    x' = x + round(delta)            delta: the attention output [M, D], or the FFN's slot
                                     outputs y [M, S, D] float32 summed over s in slot order
    h  = round(x' / sqrt(mean(x'^2) + eps) * w)

in float32 with each rounding to the compute dtype where the unfused forward rounds (the
sum to the dtype, then x + sum in the dtype), so the residual stream keeps its bits' meaning.
Padding rows (real 0) add no FFN output.

`latent`: after the joint down-projection kv = h [W_q_a; W_kv_a]^T, per row: the q_a RMSNorm,
the c_kv RMSNorm and the rotary embedding of k_pe, with c_kv and k_pe written straight into
the cache row `rows[m]` of the layer (real rows only: padding rows write nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import cast, rope_pair


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, real_ptr, w_ptr, x_out_ptr, h_ptr, h32_ptr, D, eps,
                         SLOTS: tl.constexpr, ADD: tl.constexpr, WRITE_X: tl.constexpr,
                         WRITE_H32: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    dtype = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        if SLOTS == 0:
            delta = tl.load(delta_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            delta = tl.zeros([BLOCK], dtype=tl.float32)
            for s in tl.static_range(SLOTS):
                delta += tl.load(delta_ptr + (row * SLOTS + s) * D + cols, mask=inside, other=0.0)
            delta = tl.where(tl.load(real_ptr + row) != 0, delta, 0.0)
        x = cast(x + cast(delta, dtype).to(tl.float32), dtype).to(tl.float32)
    if WRITE_X:
        tl.store(x_out_ptr + row * D + cols, cast(x, dtype), mask=inside)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    h = cast(x * r * tl.load(w_ptr + cols, mask=inside, other=0.0), dtype)
    tl.store(h_ptr + row * D + cols, h, mask=inside)
    if WRITE_H32:
        tl.store(h32_ptr + row * D + cols, h.to(tl.float32), mask=inside)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
                 real: torch.Tensor | None = None, float32_copy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, D], weight float32 [D], delta None | [M, D] (x's dtype) | float32 [M, S, D] (slot
    outputs; then real uint8 [M]) -> (x' [M, D], h [M, D] in x's dtype, h float32 [M, D] or None).

    Without delta x' is x itself (module docstring)."""
    rows, width = x.shape
    slots = 0 if delta is None or delta.dim() == 2 else delta.shape[1]
    add = delta is not None
    x_out = torch.empty_like(x) if add else x
    h = torch.empty_like(x)
    h32 = torch.empty(rows, width, device=x.device, dtype=torch.float32) if float32_copy else None
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, delta if add else x, real if slots else x, weight, x_out, h, h32 if float32_copy else h,
            width, eps, SLOTS=slots, ADD=add, WRITE_X=add, WRITE_H32=float32_copy,
            BLOCK=triton.next_power_of_2(width), num_warps=8 if width > 4096 else 4)
    return x_out, h, h32


@triton.jit
def _latent_kernel(kv_ptr, q_a_norm_ptr, kv_a_norm_ptr, cos_ptr, sin_ptr, rows_ptr, real_ptr,
                   q_a_ptr, c_kv_ptr, k_pe_ptr, Q, R, eps,
                   HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    width = Q + R + 2 * HALF
    base = kv_ptr + row * width
    dtype = c_kv_ptr.dtype.element_ty
    if BLOCK_Q > 0:
        q_idx = tl.arange(0, BLOCK_Q)
        q_in = q_idx < Q
        q_a = tl.load(base + q_idx, mask=q_in, other=0.0).to(tl.float32)
        q_a = q_a * tl.rsqrt(tl.sum(q_a * q_a, axis=0) / Q + eps) * tl.load(q_a_norm_ptr + q_idx, mask=q_in, other=0.0)
        tl.store(q_a_ptr + row * Q + q_idx, cast(q_a, dtype), mask=q_in)
    if tl.load(real_ptr + row) != 0:
        slot = tl.load(rows_ptr + row)
        r_idx = tl.arange(0, BLOCK_R)
        r_in = r_idx < R
        c = tl.load(base + Q + r_idx, mask=r_in, other=0.0).to(tl.float32)
        c = c * tl.rsqrt(tl.sum(c * c, axis=0) / R + eps) * tl.load(kv_a_norm_ptr + r_idx, mask=r_in, other=0.0)
        tl.store(c_kv_ptr + slot * R + r_idx, cast(c, dtype), mask=r_in)
        half_idx = tl.arange(0, BLOCK_HALF)
        half_in = half_idx < HALF
        cos = tl.load(cos_ptr + row * HALF + half_idx, mask=half_in, other=0.0)
        sin = tl.load(sin_ptr + row * HALF + half_idx, mask=half_in, other=0.0)
        first, a, second, b = rope_pair(base + Q + R, half_idx, half_in, cos, sin, HALF, INTERLEAVE)
        tl.store(k_pe_ptr + slot * 2 * HALF + first, cast(a, dtype), mask=half_in)
        tl.store(k_pe_ptr + slot * 2 * HALF + second, cast(b, dtype), mask=half_in)


def latent(kv: torch.Tensor, q_cols: int, q_a_norm: torch.Tensor | None, kv_a_norm: torch.Tensor, eps: float,
           cos: torch.Tensor, sin: torch.Tensor, style: str, rows: torch.Tensor, real: torch.Tensor,
           c_kv_rows: torch.Tensor, k_pe_rows: torch.Tensor) -> torch.Tensor | None:
    """kv [M, Q + R + dr] (Q = q_cols: q_a, or q itself without q_lora), norms float32,
    cos/sin float32 [M, dr/2], rows int64 [M] (cache rows), real uint8 [M], the layer's cache
    rows c_kv [S, R], k_pe [S, dr] -> q_a [M, Q] normed with q_a_norm (None without one: the
    q columns are left as they are); c_kv and k_pe written into the cache (module docstring)."""
    m = kv.shape[0]
    r, dr = c_kv_rows.shape[1], k_pe_rows.shape[1]
    q_a = torch.empty(m, q_cols, device=kv.device, dtype=kv.dtype) if q_a_norm is not None else None
    if m:
        _latent_kernel[(m,)](
            kv, q_a_norm if q_a_norm is not None else kv_a_norm, kv_a_norm, cos, sin, rows, real,
            q_a if q_a is not None else kv, c_kv_rows, k_pe_rows, q_cols, r, eps, HALF=dr // 2,
            INTERLEAVE=style == "interleave",
            BLOCK_Q=triton.next_power_of_2(q_cols) if q_a_norm is not None else 0,
            BLOCK_R=triton.next_power_of_2(r), BLOCK_HALF=triton.next_power_of_2(dr // 2), num_warps=4)
    return q_a
