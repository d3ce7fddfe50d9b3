"""CRC32C (Castagnoli) over any buffer, without copying it.

google-crc32c's Python API only takes `bytes`, which would force a copy of
every tensor. Its wheel ships the C library (`libcrc32c`, SSE4.2 / ARM CRC
accelerated), so the fast path calls `crc32c_extend` on that library through
ctypes, straight on the buffer's memory and with the GIL released. Buffers of
at most 4 KiB are copied and handed to google-crc32c instead: a copy that
small costs less than a ctypes call (files of a million tiny tensors). Where the
library cannot be found, every buffer goes that way in 8 MiB copies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Callable

import google_crc32c
import numpy as np

_CHUNK = 8 << 20
_SMALL = 4096


def _load_library() -> Callable[[int, int, int], int] | None:
    package_dir = os.path.dirname(google_crc32c.__file__)
    candidates = sorted(glob.glob(os.path.join(package_dir + ".libs", "libcrc32c*.so*")))
    candidates += sorted(glob.glob(os.path.join(package_dir, "*.libs", "libcrc32c*.so*")))
    system = ctypes.util.find_library("crc32c")
    if system:
        candidates.append(system)
    for path in candidates:
        try:
            extend = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        extend.restype = ctypes.c_uint32
        return extend
    return None


_extend = _load_library()


def crc32c(data: np.ndarray | bytes | memoryview, crc: int = 0) -> int:
    """CRC32C of `data`'s bytes (C-contiguous), continuing from `crc`."""
    array = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if not array.flags.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    nbytes = array.nbytes
    if nbytes == 0:
        return crc
    if nbytes <= _SMALL:
        return google_crc32c.extend(crc, array.tobytes())
    if _extend is not None:
        return _extend(crc, array.ctypes.data, nbytes)
    flat = array.reshape(-1).view(np.uint8)
    for start in range(0, nbytes, _CHUNK):
        crc = google_crc32c.extend(crc, flat[start : start + _CHUNK].tobytes())
    return crc
