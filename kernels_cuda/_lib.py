"""Load the kernels shared library with ctypes and call its C launch API.

Every exported launcher is `extern "C" int name(..., cudaStream_t stream)`:
0 on success, a positive cudaError_t from the launch, or a negative kdtree
status (an argument the kernel cannot take); `kdtree_status_string(code)`
names either. Launches go on torch's current stream, so they are captured by
CUDA graphs like any torch op.

The library comes from `$KDTREE_KERNELS_LIB` when set (a prebuilt file), else
from `kernels_cuda.build.build()` (compiled once, then cached).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Sequence

import torch

from .build import build


class KernelError(RuntimeError):
    """The library could not be loaded, or a launch reported an error."""


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (built on first use unless $KDTREE_KERNELS_LIB names one)."""
    path = Path(os.environ["KDTREE_KERNELS_LIB"]) if os.environ.get("KDTREE_KERNELS_LIB") else build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelError(f"cannot load kernels library {path}: {exc}") from exc
    lib.kdtree_status_string.restype = ctypes.c_char_p
    lib.kdtree_status_string.argtypes = [ctypes.c_int]
    return lib


@functools.cache
def function(name: str, argtypes: Sequence[type]) -> ctypes._CFuncPtr:
    """The launcher `name` with its ctypes signature (the trailing stream included); returns int."""
    try:
        fn = getattr(library(), name)
    except AttributeError as exc:
        raise KernelError(f"kernels library has no symbol {name!r} (stale build?)") from exc
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def check(status: int, what: str) -> None:
    """Raise KernelError naming `what` when a launcher returned non-zero."""
    if status != 0:
        message = library().kdtree_status_string(status).decode()
        raise KernelError(f"{what} failed: {message} (status {status})")


def stream(device: torch.device) -> ctypes.c_void_p:
    """torch's current CUDA stream on `device`, as the launchers take it."""
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
