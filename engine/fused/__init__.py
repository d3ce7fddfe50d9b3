"""The fused layers of the default mode on a GPU: Triton kernels around cuBLAS products and the
attention backend (engine/fused/layer.py lists them; docs/engine-fused.md says what each fuses and
measures it). `engine.model.Transformer` takes them by default on CUDA outside invariant mode."""

from .layer import FusedForward, FusedLayer, fuse

__all__ = ["FusedForward", "FusedLayer", "fuse"]
