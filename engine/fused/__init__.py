"""The fused layers on a GPU: Triton kernels around cuBLAS products and the attention backend
(engine/fused/layer.py lists them; docs/engine-fused.md says what each fuses and measures it),
and their batch-invariant form with invariant mode's tensor-core attention (attention.py).
`engine.model.Transformer` takes them by default in bf16 on CUDA, in either mode."""

from .layer import FusedForward, FusedLayer, fuse

__all__ = ["FusedForward", "FusedLayer", "fuse"]
