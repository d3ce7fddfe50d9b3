"""Streaming KDTR writer: tensors go to disk one at a time, the index follows at commit.

The file is built under a temporary name in the destination's directory and
renamed over the final name only after everything is written and fsynced, so
a crash, an exception or a kill never leaves a partial file under that name
(a killed process may leave its `.<name>.*.tmp` behind; an exception removes it).

`durable=False` skips the fsyncs: the commit stays atomic against a crash of
the process, not against a power loss (for scratch files and tests). Durable
writers on Linux start the disk writeback of every 32 MiB as they go
(sync_file_range), so the final fsync waits for less.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from typing import Any, Mapping

import numpy as np

from . import format as fmt
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


def to_raw(array: Any) -> tuple[fmt.DType, tuple[int, ...], np.ndarray]:
    """(dtype, shape, stored bytes as a contiguous uint8 [nbytes]) of a numpy array or torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        name = str(array.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPE_NAMES:
            raise WriterError(f"unsupported torch dtype {array.dtype}; KDTR stores {', '.join(fmt.DTYPE_BY_NAME)}")
        tensor = array.detach().to("cpu").contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        return fmt.DTYPE_BY_NAME[name], tuple(tensor.shape), raw
    if not isinstance(array, np.ndarray):
        if isinstance(array, (np.generic, int, float, bool)):
            array = np.asarray(array)
        else:
            raise WriterError(f"expected a numpy array or torch tensor, got {type(array).__name__}")
    dtype = fmt.dtype_of_numpy(array.dtype)
    if dtype.name == "int4":
        return dtype, array.shape, fmt.pack_int4(np.ascontiguousarray(array))
    contiguous = np.ascontiguousarray(array, dtype=dtype.numpy)
    return dtype, array.shape, contiguous.reshape(-1).view(np.uint8)


class Writer:
    """Writes a KDTR file tensor by tensor; commits atomically.

        with Writer("fixture.kdtr", alignment=64) as w:
            w.add("weights/embed_tokens", embed)      # [V, D] float32, written now
            w.metadata = {"preset": "tiny"}
        # committed here; on an exception nothing appears under "fixture.kdtr"
    """

    def __init__(self, path: str | os.PathLike, alignment: int = fmt.DEFAULT_ALIGNMENT, metadata: Mapping | None = None,
                 durable: bool = True):
        fmt.check_alignment(alignment)
        self.path = os.fspath(path)
        self.alignment = alignment
        self.durable = durable
        self._metadata: dict = {}
        self.set_metadata(metadata)
        directory, base = os.path.split(os.path.abspath(self.path))
        fd, self._tmp_path = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
        self._file = os.fdopen(fd, "wb")
        self._header = fmt.pack_header(alignment)
        self._file.write(self._header)
        self._position = len(self._header)
        self._written_back = 0
        self._records: list[tuple[int, int, int, fmt.DType, tuple[int, ...], bytes]] = []
        self._names: set[str] = set()
        self._done = False

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
        fmt.encode_metadata(metadata)
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
        dtype, shape, raw = to_raw(array)
        if len(shape) > fmt.MAX_NDIM:
            raise WriterError(f"tensor {name!r} has {len(shape)} dimensions; KDTR allows at most {fmt.MAX_NDIM}")
        if len(self._records) >= fmt.MAX_TENSORS:
            raise WriterError(f"more than {fmt.MAX_TENSORS} tensors")
        self._write_padding(fmt.align_up(self._position, self.alignment))
        offset = self._position
        self._file.write(memoryview(raw))
        self._position += raw.nbytes
        self._records.append((offset, raw.nbytes, crc32c(raw), dtype, tuple(int(d) for d in shape), name_raw))
        self._names.add(name)
        if self.durable and _sync_file_range is not None and self._position - self._written_back >= _WRITEBACK_EVERY:
            self._file.flush()
            _sync_file_range(self._file.fileno(), self._written_back, self._position - self._written_back, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self._position

    def _index(self) -> tuple[bytes, bytes]:
        records = np.zeros(len(self._records), fmt.RECORD)
        name_offset = 0
        for i, (offset, nbytes, crc, dtype, shape, name_raw) in enumerate(self._records):
            record = records[i]
            record["offset"], record["nbytes"], record["crc32c"] = offset, nbytes, crc
            record["name_offset"], record["name_len"] = name_offset, len(name_raw)
            record["dtype"], record["ndim"] = dtype.code, len(shape)
            record["shape"][: len(shape)] = shape
            name_offset += len(name_raw) + 1
        names = b"".join(name_raw + b"\0" for *_, name_raw in self._records)
        return records.tobytes(), names

    def commit(self) -> None:
        """Write index, metadata and trailer, fsync, and rename onto the final path."""
        if self._done:
            raise WriterError(f"writer for {self.path} is already closed")
        try:
            metadata = fmt.encode_metadata(self._metadata)
            records, names = self._index()
            if len(records) + len(names) > fmt.MAX_INDEX_BYTES:
                raise WriterError(f"index is {len(records) + len(names)} bytes, over the {fmt.MAX_INDEX_BYTES}-byte cap")
            self._write_padding(fmt.align_up(self._position, self.alignment))
            index_offset = self._position
            trailer = fmt.pack_trailer(
                self._header, index_offset, len(self._records), len(names), len(metadata),
                crc32c(records + names), crc32c(metadata), crc32c,
            )
            self._file.write(records + names + metadata + trailer)
            self._file.flush()
            os.fchmod(self._file.fileno(), 0o666 & ~_umask())
            if self.durable:
                os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp_path, self.path)
            self._done = True
        except BaseException:
            self.abort()
            raise
        if self.durable:
            _fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Drop everything written so far; the final path is left untouched."""
        self._done = True
        self._file.close()
        if os.path.exists(self._tmp_path):
            os.unlink(self._tmp_path)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
