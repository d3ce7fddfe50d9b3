"""Streaming KDTR writer: tensors go to disk one at a time, the index follows at commit.

The file is built under a temporary name beside the destination and renamed over it only after
everything is written and fsynced (`atomic`: name within NAME_MAX, the user's umask, symbolic links
written through), so a crash, an exception or a kill never leaves a partial file under that name
(a killed process may leave its `.<name>.*.tmp` behind; an exception, a failing flush included,
removes it).

The writer writes only what both readers accept: every problem with a tensor or the metadata is a
WriterError naming the tensor or the metadata field (a name that is not UTF-8, a dtype KDTR lacks, a
torch tensor that is not a dense tensor in memory, a shape over the 2**62-byte cap even when empty,
bool bytes other than 0 and 1, metadata a reader would refuse or not give back unchanged).

`durable=False` skips the fsyncs: the commit stays atomic against a crash of
the process, not against a power loss (for scratch files and tests). Durable
writers on Linux start the disk writeback of every 32 MiB as they go
(sync_file_range), so the final fsync waits for less.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import Any, Mapping

import numpy as np

from . import atomic
from . import format as fmt
from . import metadata as md
from ._crc32c import crc32c
from .errors import WriterError

_WRITEBACK_EVERY = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _load_sync_file_range()

_TORCH_DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
)


def check_name(name: object) -> bytes:
    """The UTF-8 bytes of a valid tensor name; WriterError otherwise."""
    if not isinstance(name, str):
        raise WriterError(f"tensor name must be a str, got {type(name).__name__}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise WriterError(f"tensor name {name!r} is not encodable as UTF-8") from None
    if not raw or len(raw) > fmt.MAX_NAME_BYTES or b"\0" in raw:
        raise WriterError(f"tensor name {name!r} must be 1 to {fmt.MAX_NAME_BYTES} UTF-8 bytes without NUL")
    return raw


def to_raw(array: Any, name: str) -> tuple[fmt.DType, tuple[int, ...], np.ndarray]:
    """(dtype, shape, stored bytes as a contiguous uint8 [nbytes]) of a numpy array or torch tensor
    to be stored as tensor `name`; WriterError naming it when KDTR cannot hold it exactly."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        dtype, shape, raw = _torch_raw(torch, array, name)
    else:
        if isinstance(array, (np.generic, int, float, bool)):
            array = np.asarray(array)
        if not isinstance(array, np.ndarray):
            raise WriterError(f"tensor {name!r}: expected a numpy array or torch tensor, got {type(array).__name__}")
        try:
            dtype = fmt.dtype_of_numpy(array.dtype)
        except WriterError as e:
            raise WriterError(f"tensor {name!r}: {e}") from None
        shape = tuple(int(d) for d in array.shape)
        if dtype.name == "int4":
            raw = fmt.pack_int4(np.ascontiguousarray(array))
        else:
            raw = np.ascontiguousarray(array, dtype=dtype.numpy).reshape(-1).view(np.uint8)
    if len(shape) > fmt.MAX_NDIM:
        raise WriterError(f"tensor {name!r} has {len(shape)} dimensions; KDTR allows at most {fmt.MAX_NDIM}")
    if math.prod(d for d in shape if d) * dtype.itemsize > fmt.MAX_ELEMENT_BYTES:
        raise WriterError(f"tensor {name!r}: shape {list(shape)} is over the 2**62-byte cap (zero dimensions aside)")
    if dtype.name == "bool" and raw.size and raw.max() > 1:
        raise WriterError(f"tensor {name!r}: a bool byte is {int(raw.max())}; KDTR bools are bytes 0 and 1")
    return dtype, shape, raw


def _torch_raw(torch: Any, tensor: Any, name: str) -> tuple[fmt.DType, tuple[int, ...], np.ndarray]:
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name not in _TORCH_DTYPE_NAMES:
        raise WriterError(f"tensor {name!r}: unsupported torch dtype {tensor.dtype}; KDTR stores {', '.join(fmt.DTYPE_BY_NAME)}")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        kind = "quantized" if tensor.is_quantized else "nested" if tensor.is_nested else str(tensor.layout)
        raise WriterError(f"tensor {name!r}: a {kind} torch tensor; store a dense one (.to_dense())")
    if tensor.device.type == "meta":
        raise WriterError(f"tensor {name!r}: a meta-device torch tensor has no data")
    try:
        dense = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    except (RuntimeError, NotImplementedError) as e:
        raise WriterError(f"tensor {name!r}: cannot copy a {tensor.device} tensor to the CPU: {e}") from None
    return fmt.DTYPE_BY_NAME[dtype_name], tuple(dense.shape), dense.reshape(-1).view(torch.uint8).numpy()


class Writer:
    """Writes a KDTR file tensor by tensor; commits atomically.

        with Writer("fixture.kdtr", alignment=64) as w:
            w.add("weights/embed_tokens", embed)      # [V, D] float32, written now
            w.metadata = {"preset": "tiny"}
        # committed here; on an exception nothing appears under "fixture.kdtr"

    Used without `with`, call `commit()` or `abort()`; either removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike, alignment: int = fmt.DEFAULT_ALIGNMENT, metadata: Mapping | None = None,
                 durable: bool = True):
        fmt.check_alignment(alignment)
        self.path = os.fspath(path)
        self.alignment = alignment
        self.durable = durable
        self._metadata: dict = {}
        self.set_metadata(metadata)
        self._header = fmt.pack_header(alignment)
        fd, self._tmp_path = atomic.create_beside(self.path)
        self._file = os.fdopen(fd, "wb")
        self._done = False
        try:
            self._file.write(self._header)
        except BaseException:
            self.abort()
            raise
        self._position = len(self._header)
        self._written_back = 0
        self._offsets: list[int] = []
        self._nbytes: list[int] = []
        self._crcs: list[int] = []
        self._dtypes: list[int] = []
        self._shapes: list[tuple[int, ...]] = []
        self._name_bytes: list[bytes] = []
        self._names: set[str] = set()
        self._index_size = 0

    @property
    def metadata(self) -> dict:
        return self._metadata

    @metadata.setter
    def metadata(self, value: Mapping | None) -> None:
        self.set_metadata(value)

    def set_metadata(self, value: Mapping | None) -> None:
        """Replace the metadata (a JSON-representable dict); checked now and again at commit."""
        if value is not None and not isinstance(value, Mapping):
            raise WriterError(f"metadata must be a dict (a JSON object), got {type(value).__name__}")
        metadata = dict(value) if value is not None else {}
        md.encode(metadata)
        self._metadata = metadata

    def _write_padding(self, target: int) -> None:
        self._file.write(bytes(target - self._position))
        self._position = target

    def add(self, name: str, array: Any) -> None:
        """Append one tensor (numpy array, ml_dtypes array or torch tensor); its bytes are written now."""
        if self._done:
            raise WriterError(f"writer for {self.path} is already closed")
        name_raw = check_name(name)
        if name in self._names:
            raise WriterError(f"duplicate tensor name {name!r}")
        if len(self._offsets) >= fmt.MAX_TENSORS:
            raise WriterError(f"tensor {name!r}: more than {fmt.MAX_TENSORS} tensors")
        index_size = self._index_size + fmt.RECORD_SIZE + len(name_raw) + 1
        if index_size > fmt.MAX_INDEX_BYTES:
            raise WriterError(f"tensor {name!r}: the index would pass its {fmt.MAX_INDEX_BYTES}-byte cap")
        dtype, shape, raw = to_raw(array, name)
        self._write_padding(fmt.align_up(self._position, self.alignment))
        self._offsets.append(self._position)
        self._file.write(memoryview(raw))
        self._position += raw.nbytes
        self._nbytes.append(raw.nbytes)
        self._crcs.append(crc32c(raw))
        self._dtypes.append(dtype.code)
        self._shapes.append(shape)
        self._name_bytes.append(name_raw)
        self._names.add(name)
        self._index_size = index_size
        if self.durable and _sync_file_range is not None and self._position - self._written_back >= _WRITEBACK_EVERY:
            self._file.flush()
            _sync_file_range(self._file.fileno(), self._written_back, self._position - self._written_back, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self._position

    def _index(self) -> bytes:
        """The index records followed by the names block."""
        records = np.zeros(len(self._offsets), fmt.RECORD)
        lengths = np.array([len(n) for n in self._name_bytes], np.uint64)
        records["offset"], records["nbytes"], records["crc32c"] = self._offsets, self._nbytes, self._crcs
        records["name_offset"] = np.cumsum(lengths + 1, dtype=np.uint64) - lengths - 1
        records["name_len"], records["dtype"] = lengths, self._dtypes
        records["ndim"] = [len(shape) for shape in self._shapes]
        shapes = np.zeros((len(self._shapes), fmt.MAX_NDIM), np.uint64)
        for i, shape in enumerate(self._shapes):
            shapes[i, : len(shape)] = shape
        records["shape"] = shapes
        return records.tobytes() + b"".join(name + b"\0" for name in self._name_bytes)

    def commit(self) -> None:
        """Write index, metadata and trailer, fsync, and rename onto the final path."""
        if self._done:
            raise WriterError(f"writer for {self.path} is already closed")
        try:
            metadata = md.encode(self._metadata)
            index = self._index()
            self._write_padding(fmt.align_up(self._position, self.alignment))
            index_offset = self._position
            names_size = self._index_size - fmt.RECORD_SIZE * len(self._offsets)
            trailer = fmt.pack_trailer(self._header, index_offset, len(self._offsets), names_size, len(metadata),
                                       crc32c(index), crc32c(metadata), crc32c)
            self._file.write(index + metadata + trailer)
            self._file.flush()
            if self.durable:
                os.fsync(self._file.fileno())
            self._file.close()
            atomic.rename_over(self._tmp_path, self.path)
            self._done = True
        except BaseException:
            self.abort()
            raise
        if self.durable:
            _fsync_directory(os.path.dirname(atomic.target_of(self.path)))

    def abort(self) -> None:
        """Drop everything written so far; the final path is left untouched. Never raises."""
        self._done = True
        try:
            self._file.close()
        except Exception:        # a flush that fails again (a full disk): the descriptor is closed all the same
            pass
        finally:
            atomic.remove(self._tmp_path)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping | None = None,
          alignment: int = fmt.DEFAULT_ALIGNMENT, durable: bool = True) -> None:
    """Write `tensors` (name -> numpy array or torch tensor, in mapping order) and `metadata` atomically."""
    with Writer(path, alignment=alignment, metadata=metadata, durable=durable) as writer:
        for name, array in tensors.items():
            writer.add(name, array)
