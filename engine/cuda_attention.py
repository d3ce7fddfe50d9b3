"""The engine's AttentionBackend on the CUDA tree-verify kernel (kernels_cuda.mla_ops).

Same contract as `engine.attention.torch_attention`: query i of request b sees every cached
slot s < starts[b] and new token j (slot starts[b] + j, j < n_new[b]) iff
new_visibility[b, i, j]; padding rows i >= n_new[b] get o_lat = 0.

The padded batch maps onto the kernel's ragged form without copying the cache: request b's
queries are rows b * N .. b * N + n_new[b] of q_lat viewed as [B * N, H, R], and its keys are
rows b * T' .. of the cache viewed as rows of R (T' = the cache's slot stride), context =
starts[b], tree size = n_new[b]. The key splits are sized from the shapes alone (the longest
tree is N, the longest key range the cache's T slots), so a call reads nothing back from the
device and can be captured in a CUDA graph. `bind` packs the visibility and the index arrays
once per forward for every layer.

Paged caches (`bind_paged`): the kernel reads the pools [pages, page_size, w] through the
block table itself (`mla_verify_paged`), with the same split plan, so a paged forward gives
the bits of the contiguous one over the same keys.

invariant=True: the kernel's invariant plan (kernels_cuda.mla_ops): the CUDA-core path with each
query row's key list in splits sized from its length alone, folded one key at a time in list
order; a row's output is then a function of that key sequence alone, whatever the tree size, the
batch and the cache size (docs/precision.md, section 3).
`invariant_form()` gives `InvariantCudaAttention`: bf16 on the tensor-core invariant kernel
(engine/fused/attention.py, the same promise at tensor-core speed), float32 on this plan (and
this plan alone where Triton is missing).
"""

from __future__ import annotations

import importlib.util

import torch

from kernels_cuda.mla_ops import mla_verify, mla_verify_paged, pack_visibility

from .attention import AttentionBackend, LayerAttention


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

    reuses_out = True           # bind(..., reuse_out=True): engine.attention.bind_attention

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant

    def invariant_form(self) -> AttentionBackend:
        """Invariant mode's attention on a GPU: `InvariantCudaAttention` where Triton is, else this
        kernel's invariant plan."""
        if importlib.util.find_spec("triton") is not None:
            return InvariantCudaAttention()
        return CudaAttention(invariant=True)

    def bind(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
             num_slots: int, reuse_out: bool = False) -> LayerAttention:
        kv_offsets: dict[int, torch.Tensor] = {}        # per slot stride: every layer's is the same

        def kernel(q_lat, q_pe, c_kv, k_pe, context, tree, q_offsets, bits, scale, n, out):
            c_rows, stride = _key_rows(c_kv)
            k_rows, k_stride = _key_rows(k_pe)
            if k_stride != stride:
                (c_rows, stride), (k_rows, _) = _key_rows(c_kv.contiguous()), _key_rows(k_pe.contiguous())
            if stride not in kv_offsets:
                kv_offsets[stride] = torch.arange(len(context), device=context.device, dtype=torch.int32) * stride
            mla_verify(q_lat, q_pe, c_rows, k_rows, context, tree, q_offsets, kv_offsets[stride], bits, scale,
                       max_tree=n, max_kv=max(c_kv.shape[1], 1), invariant=self.invariant, out=out)
        return self._bound(starts, n_new, new_visibility, kernel, reuse_out)

    def bind_paged(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                   block_table: torch.Tensor, reuse_out: bool = False) -> LayerAttention:
        """The per-layer call over the pools c_kv [pages, page_size, R], k_pe [pages, page_size, dr]."""
        table = block_table.to(torch.int32).contiguous()

        def kernel(q_lat, q_pe, c_kv, k_pe, context, tree, q_offsets, bits, scale, n, out):
            mla_verify_paged(q_lat, q_pe, c_kv, k_pe, context, tree, q_offsets, table, bits, scale, max_tree=n,
                             max_kv=max(table.shape[1] * c_kv.shape[1], 1), invariant=self.invariant, out=out)
        return self._bound(starts, n_new, new_visibility, kernel, reuse_out)

    def _bound(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
               kernel, reuse_out: bool) -> LayerAttention:
        """The per-layer call around `kernel`: the padded batch as the kernel's ragged one
        (module docstring), visibility packed once. reuse_out: every call writes into (and
        returns) the same o_lat, zeroed once (the kernel never writes padding rows)."""
        batch, n = new_visibility.shape[:2]
        bits = pack_visibility(new_visibility).view(batch * n, -1)                # [B N, W]
        context, tree = starts.to(torch.int32), n_new.to(torch.int32)
        q_offsets = torch.arange(batch + 1, device=new_visibility.device, dtype=torch.int32) * n
        kept: list[torch.Tensor] = []

        def attend(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   scale: float) -> torch.Tensor:
            heads, kv_lora = q_lat.shape[2:]
            if kept:                                          # reuse_out: every layer's shapes are the first's
                o_lat, lse = kept
            else:
                o_lat = torch.zeros(batch, n, heads, kv_lora, dtype=q_lat.dtype, device=q_lat.device)
                lse = torch.empty((batch * n, heads), dtype=torch.float32, device=q_lat.device)
                if reuse_out:
                    kept[:] = [o_lat, lse]
            if batch == 0 or n == 0 or heads == 0:            # heads 0: a tensor-parallel rank holding none
                return o_lat
            kernel(q_lat.reshape(batch * n, heads, kv_lora).contiguous(),
                   q_pe.reshape(batch * n, heads, q_pe.shape[3]).contiguous(), c_kv, k_pe, context, tree,
                   q_offsets, bits, scale, n, (o_lat.view(batch * n, heads, kv_lora), lse))
            return o_lat
        return attend

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                 new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
        return self.bind(starts, n_new, new_visibility, c_kv.shape[1])(q_lat, q_pe, c_kv, k_pe, scale)


class InvariantCudaAttention:
    """Invariant mode's attention on a GPU, by the dtype of the call: bf16 on the tensor-core
    invariant kernel (engine/fused/attention.py), float32 on this kernel's invariant CUDA-core
    plan (the tensor-core kernel's exact float32 tiles are FMA loops: 2x slower there, measured on
    an H100 on 2026-12-06). Both make a row's output a function of its keys in order alone."""

    reuses_out = True

    def __init__(self) -> None:
        from .fused.attention import invariant_attention
        self.by_dtype: dict[torch.dtype, AttentionBackend] = {torch.bfloat16: invariant_attention,
                                                              torch.float32: CudaAttention(invariant=True)}

    def invariant_form(self) -> "InvariantCudaAttention":
        return self

    def bind(self, *args, **options) -> LayerAttention:
        return self._bound("bind", args, options)

    def bind_paged(self, *args, **options) -> LayerAttention:
        return self._bound("bind_paged", args, options)

    def _bound(self, method: str, args: tuple, options: dict) -> LayerAttention:
        """The per-layer call; the first call in a dtype binds that dtype's backend (every layer of
        a forward has one)."""
        bound: dict[torch.dtype, LayerAttention] = {}

        def attend(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   scale: float) -> torch.Tensor:
            if q_lat.dtype not in bound:
                bound[q_lat.dtype] = getattr(self.by_dtype[q_lat.dtype], method)(*args, **options)
            return bound[q_lat.dtype](q_lat, q_pe, c_kv, k_pe, scale)
        return attend

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                 new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
        return self.bind(starts, n_new, new_visibility, c_kv.shape[1])(q_lat, q_pe, c_kv, k_pe, scale)
