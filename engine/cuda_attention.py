"""The engine's AttentionBackend on the CUDA tree-verify kernel (kernels_cuda.mla_ops).

Same contract as `engine.attention.torch_attention`: query i of request b sees every cached
slot s < starts[b] and new token j (slot starts[b] + j, j < n_new[b]) iff
new_visibility[b, i, j]; padding rows i >= n_new[b] get o_lat = 0.

The padded batch maps onto the kernel's ragged form without copying the cache: request b's
queries are rows b * N .. b * N + n_new[b] of q_lat viewed as [B * N, H, R], and its keys are
rows b * T' .. of the cache viewed as rows of R (T' = the cache's slot stride), context =
starts[b], tree size = n_new[b]. Each call reads max(starts + n_new) and min(n_new) back
from the device once, to size the key splits.
"""

from __future__ import annotations

import torch

from kernels_cuda.mla_ops import mla_verify, pack_visibility


def _key_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cache [B, T, width] -> (rows [S, width] over the same memory, slot stride per request)."""
    batch, slots, width = cache.shape
    if cache.stride(2) != 1 or cache.stride(1) != width or cache.stride(0) % width != 0:
        cache = cache.contiguous()
    stride = cache.stride(0) // width if batch > 1 else slots
    rows = (batch - 1) * stride + slots
    return cache.as_strided((rows, width), (width, 1)), stride


class CudaAttention:
    """AttentionBackend: q_lat [B, N, H, R], q_pe [B, N, H, dr], c_kv [B, T, R],
    k_pe [B, T, dr], starts [B], n_new [B], new_visibility [B, N, N] bool -> o_lat [B, N, H, R]
    in q_lat's dtype. Inputs float32 or bfloat16, all on one CUDA device."""

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                 new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
        batch, n, heads, kv_lora = q_lat.shape
        o_lat = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
        if batch == 0 or n == 0:
            return o_lat
        c_rows, stride = _key_rows(c_kv)
        k_rows, k_stride = _key_rows(k_pe)
        if k_stride != stride:
            (c_rows, stride), (k_rows, _) = _key_rows(c_kv.contiguous()), _key_rows(k_pe.contiguous())
        max_kv, min_new = torch.stack([(starts + n_new).max(), n_new.min()]).tolist()
        if min_new < n:
            o_lat.zero_()
        index = torch.arange(batch + 1, device=q_lat.device, dtype=torch.int32)
        mla_verify(q_lat.reshape(batch * n, heads, kv_lora).contiguous(),
                   q_pe.reshape(batch * n, heads, q_pe.shape[3]).contiguous(),
                   c_rows, k_rows, starts, n_new, index * n, index[:batch] * stride,
                   pack_visibility(new_visibility).view(batch * n, -1), scale,
                   max_tree=n, max_kv=max(max_kv, 1),
                   out=(o_lat.view(batch * n, heads, kv_lora),
                        torch.empty((batch * n, heads), dtype=torch.float32, device=q_lat.device)))
        return o_lat
