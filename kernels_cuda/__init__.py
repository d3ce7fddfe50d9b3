"""kernels_cuda: CUDA kernels for the hot DDTree stages, with a plain C launch API.

All `csrc/*.cu` build into one shared library (`kernels_cuda.build`), loaded
with ctypes (`kernels_cuda._lib`) and exposed as torch custom ops
(`kernels_cuda.tree_ops`, `kernels_cuda.mla_ops`). Nothing here falls back to
another backend: the engine decides, with `available()`.
"""

from __future__ import annotations


def available() -> tuple[bool, str]:
    """(True, "") when a CUDA device is visible and the library loads; else (False, the reason)."""
    import torch

    from ._lib import KernelError, library
    from .build import BuildError

    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    try:
        library()
    except (BuildError, KernelError, OSError) as exc:
        return False, str(exc)
    return True, ""
