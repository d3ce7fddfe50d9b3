"""KDTR reader: mmap, validate the whole layout at open, hand out zero-copy views.

Opening reads only the header, trailer, index and metadata (vectorized checks,
so 10k tensors cost a few milliseconds). Tensor bytes are checksummed on
first access to each tensor, and all at once by `verify()`.

The file is mapped copy-on-write: numpy views are read-only, torch tensors
share the mapping and may be written, which never reaches the file (but is
seen by other views of the same tensor from this reader).
"""

from __future__ import annotations

import builtins
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from . import format as fmt
from ._crc32c import crc32c
from .errors import ChecksumError, FormatError, TensorNotFoundError

_VERIFY_CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where and what one tensor is: `nbytes` is the stored length (int4: packed)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int


_ITEMSIZE = np.array([fmt.DTYPE_BY_CODE[c].itemsize if c in fmt.DTYPE_BY_CODE else 1 for c in range(256)], np.uint64)
_INT4 = fmt.DTYPE_BY_NAME["int4"].code


@dataclass(frozen=True)
class _Columns:
    """The index records as contiguous per-field arrays."""

    offset: np.ndarray  # [n] uint64
    nbytes: np.ndarray  # [n] uint64
    crc32c: np.ndarray  # [n] uint32
    dtype: np.ndarray  # [n] uint8
    ndim: np.ndarray  # [n] uint8
    reserved: np.ndarray  # [n] uint64, the 6 reserved bytes of each record
    shape: np.ndarray  # [n, 8] uint64

    @classmethod
    def of(cls, records: np.ndarray) -> "_Columns":
        reserved = np.zeros((len(records), 8), np.uint8)
        reserved[:, :6] = records["reserved"]
        return cls(*(np.ascontiguousarray(records[f]) for f in ("offset", "nbytes", "crc32c", "dtype", "ndim")),
                   reserved.view("<u8").reshape(-1), np.ascontiguousarray(records["shape"]))


def _check_size(size: int) -> None:
    minimum = fmt.HEADER_SIZE + fmt.TRAILER_SIZE
    if size < minimum:
        raise FormatError(f"file is {size} bytes, smaller than header plus trailer ({minimum})", offset=size)


def _first(mask: np.ndarray) -> int | None:
    """Index of the first True in a boolean array, or None."""
    return int(mask.argmax()) if mask.any() else None


class Reader:
    """A validated, memory-mapped KDTR file. Use `kdtr_format.open(path)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with builtins.open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _check_size(size)
            self._attach(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), size)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, name: str = "<memory>") -> "Reader":
        """Validate a KDTR image held in memory (copied into a private buffer)."""
        _check_size(len(data))
        reader = cls.__new__(cls)
        reader.path = name
        reader._attach(bytearray(data), len(data))
        return reader

    def _attach(self, buffer: mmap.mmap | bytearray, size: int) -> None:
        if sys.byteorder != "little":
            raise FormatError("the KDTR Python reader needs a little-endian host")
        self._mm = buffer
        self._bytes = np.frombuffer(buffer, np.uint8)
        try:
            self._parse(size)
        except BaseException:
            self.close()
            raise
        self._checked = np.zeros(len(self._names), bool)

    def _span(self, start: int, length: int) -> bytes:
        return self._mm[start : start + length]

    def _parse(self, size: int) -> None:
        header_raw = self._span(0, fmt.HEADER_SIZE)
        header = fmt.parse_header(header_raw)
        trailer_at = size - fmt.TRAILER_SIZE
        trailer_raw = self._span(trailer_at, fmt.TRAILER_SIZE)
        t = fmt.parse_trailer(trailer_raw)
        if t.end_magic != fmt.END_MAGIC:
            raise FormatError(f"end magic {t.end_magic!r}, expected {fmt.END_MAGIC!r} (truncated file?)", offset=size - 8)
        actual = crc32c(header_raw + trailer_raw[: fmt.TRAILER_CRC_SPAN])
        if actual != t.trailer_crc32c:
            raise ChecksumError("trailer", trailer_at + fmt.TRAILER_CRC_SPAN, t.trailer_crc32c, actual)
        alignment = header.alignment
        if alignment < fmt.MIN_ALIGNMENT or alignment > fmt.MAX_ALIGNMENT or alignment & (alignment - 1):
            raise FormatError(f"alignment {alignment} is not a power of two from {fmt.MIN_ALIGNMENT} to {fmt.MAX_ALIGNMENT}", offset=16)
        if header.minor <= fmt.VERSION_MINOR and (any(header.reserved) or any(t.reserved)):
            raise FormatError("reserved header or trailer bytes are not zero", offset=20 if any(header.reserved) else trailer_at + 40)
        self.alignment = alignment
        self.version = (fmt.VERSION_MAJOR, header.minor)

        count = t.tensor_count
        if count > fmt.MAX_TENSORS:
            raise FormatError(f"tensor count {count} exceeds the cap of {fmt.MAX_TENSORS}", offset=trailer_at + 8)
        index_size = count * fmt.RECORD_SIZE + t.names_size
        if index_size > fmt.MAX_INDEX_BYTES:
            raise FormatError(f"index of {index_size} bytes exceeds the cap of {fmt.MAX_INDEX_BYTES}", offset=trailer_at)
        if t.metadata_size > fmt.MAX_METADATA_BYTES:
            raise FormatError(f"metadata of {t.metadata_size} bytes exceeds the cap of {fmt.MAX_METADATA_BYTES}", offset=trailer_at + 24)
        if t.index_offset % alignment or t.index_offset < fmt.align_up(fmt.HEADER_SIZE, alignment):
            raise FormatError(f"index offset {t.index_offset} is not a multiple of {alignment} past the header", offset=trailer_at)
        if t.index_offset + index_size + t.metadata_size != trailer_at:
            raise FormatError(
                f"index ({index_size} bytes at {t.index_offset}) and metadata ({t.metadata_size} bytes) "
                f"do not end where the trailer starts ({trailer_at})", offset=trailer_at)
        index_raw = self._bytes[t.index_offset : t.index_offset + index_size]
        actual = crc32c(index_raw)
        if actual != t.index_crc32c:
            raise ChecksumError("index", t.index_offset, t.index_crc32c, actual)
        records = index_raw[: count * fmt.RECORD_SIZE].view(fmt.RECORD)
        names_at = t.index_offset + count * fmt.RECORD_SIZE
        self._names = self._parse_names(records, index_raw[count * fmt.RECORD_SIZE :], t.index_offset, names_at)
        self._index = dict(zip(self._names, range(count)))
        if len(self._index) != count:
            seen: set[str] = set()
            duplicate = next(n for n in self._names if n in seen or seen.add(n))
            raise FormatError("duplicate tensor name", offset=t.index_offset, tensor=duplicate)
        self._columns = self._check_records(records, t.index_offset)

        metadata_at = names_at + t.names_size
        metadata_raw = self._span(metadata_at, t.metadata_size)
        actual = crc32c(metadata_raw)
        if actual != t.metadata_crc32c:
            raise ChecksumError("metadata", metadata_at, t.metadata_crc32c, actual)
        self._metadata = fmt.decode_metadata(metadata_raw, metadata_at)

    def _parse_names(self, records: np.ndarray, blob: np.ndarray, index_at: int, names_at: int) -> list[str]:
        count = len(records)
        lengths = records["name_len"].astype(np.uint64)
        bad = _first((lengths == 0) | (lengths > fmt.MAX_NAME_BYTES))
        if bad is not None:
            raise FormatError(f"name length {int(lengths[bad])} of record {bad} is not 1..{fmt.MAX_NAME_BYTES}",
                              offset=index_at + bad * fmt.RECORD_SIZE + 24)
        ends = np.cumsum(lengths + 1, dtype=np.uint64)
        starts = ends - lengths - 1
        bad = _first(records["name_offset"] != starts)
        if bad is not None:
            raise FormatError(f"name offset {int(records['name_offset'][bad])} of record {bad}, expected {int(starts[bad])}",
                              offset=index_at + bad * fmt.RECORD_SIZE + 16)
        names_size = int(ends[-1]) if count else 0
        if names_size != blob.size:
            raise FormatError(f"names take {blob.size} bytes, the records say {names_size}", offset=names_at)
        nul_at = np.flatnonzero(blob == 0)
        shared = min(nul_at.size, count)
        bad = _first(nul_at[:shared] != ends[:shared] - 1)
        if bad is None and nul_at.size != count:
            bad = min(shared, count - 1)
        if bad is not None:
            raise FormatError(f"name of record {bad} is not NUL-terminated where its length says, or holds a NUL",
                              offset=names_at + int(starts[bad]))
        try:
            text = blob.tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            record = int(np.searchsorted(ends, e.start, side="right"))
            raise FormatError(f"name of record {record} is not valid UTF-8", offset=names_at + e.start) from None
        return text.split("\0")[:-1]

    def _check_records(self, records: np.ndarray, index_offset: int) -> "_Columns":
        """Vectorized checks of every record; returns the records as contiguous columns."""
        c = _Columns.of(records)
        if len(records) == 0:
            if index_offset != fmt.align_up(fmt.HEADER_SIZE, self.alignment):
                raise FormatError(f"index offset {index_offset} with no tensors, expected {self.alignment}", offset=index_offset)
            return c

        def record_at(i: int, field: int) -> int:
            return index_offset + i * fmt.RECORD_SIZE + field

        known = np.zeros(256, bool)
        known[list(fmt.DTYPE_BY_CODE)] = True
        bad = _first(~known[c.dtype])
        if bad is not None:
            raise FormatError(f"unknown dtype code {int(c.dtype[bad])}", offset=record_at(bad, 32), tensor=self._names[bad])
        bad = _first(c.ndim > fmt.MAX_NDIM)
        if bad is not None:
            raise FormatError(f"ndim {int(c.ndim[bad])} exceeds {fmt.MAX_NDIM}", offset=record_at(bad, 33), tensor=self._names[bad])
        # dimensions past the largest ndim are checked at once; the loops below stop there
        top = int(c.ndim.max())
        unused_nonzero = np.any(c.shape[:, top:] != 0, axis=1)
        for d in range(top):
            unused_nonzero |= (c.ndim <= d) & (c.shape[:, d] != 0)
        bad = _first(unused_nonzero)
        if bad is not None:
            raise FormatError("shape slots past ndim are not zero", offset=record_at(bad, 40), tensor=self._names[bad])
        if self.version[1] <= fmt.VERSION_MINOR:
            bad = _first(c.reserved != 0)
            if bad is not None:
                raise FormatError("reserved record bytes are not zero", offset=record_at(bad, 34), tensor=self._names[bad])

        # Element bytes, ignoring zero dims, must stay under 2**62: bound with float64 first so
        # that the exact uint64 product below cannot overflow.
        itemsize = _ITEMSIZE[c.dtype]
        estimate = itemsize.astype(np.float64)
        exact = itemsize.copy()
        elements = np.ones(len(records), np.uint64)
        for d in range(top):
            dim = c.shape[:, d]
            estimate *= np.maximum(dim, 1).astype(np.float64)
            elements *= np.where(c.ndim > d, dim, np.uint64(1))
        bad = _first(estimate > 2.0**63)
        if bad is None:
            for d in range(top):
                exact *= np.maximum(c.shape[:, d], np.uint64(1))
            bad = _first(exact > fmt.MAX_ELEMENT_BYTES)
        if bad is not None:
            raise FormatError(f"shape {self._shape_of(c, bad)} is too large (over 2**62 bytes)",
                              offset=record_at(bad, 40), tensor=self._names[bad])
        expected = np.where(c.dtype == _INT4, (elements + np.uint64(1)) // np.uint64(2), elements * itemsize)
        bad = _first(c.nbytes != expected)
        if bad is not None:
            raise FormatError(f"byte length {int(c.nbytes[bad])} does not match shape and dtype (expected {int(expected[bad])})",
                              offset=record_at(bad, 8), tensor=self._names[bad])

        bad = _first((c.offset > index_offset) | (c.nbytes > index_offset))
        if bad is None:
            alignment = np.uint64(self.alignment)
            ends = c.offset + c.nbytes
            previous_end = np.concatenate([np.array([fmt.HEADER_SIZE], np.uint64), ends[:-1]])
            canonical = (previous_end + alignment - np.uint64(1)) & ~(alignment - np.uint64(1))
            bad = _first((c.offset != canonical) | (ends > index_offset))
            if bad is None:
                last = fmt.align_up(int(ends[-1]), self.alignment)
                if last != index_offset:
                    raise FormatError(f"index offset {index_offset} does not follow the last tensor (expected {last})",
                                      offset=index_offset)
                return c
        self._raise_layout(bad, c, index_offset, record_at(bad, 0))

    def _raise_layout(self, i: int, c: "_Columns", index_offset: int, at: int) -> None:
        offset, nbytes = int(c.offset[i]), int(c.nbytes[i])
        previous_end = fmt.HEADER_SIZE if i == 0 else int(c.offset[i - 1]) + int(c.nbytes[i - 1])
        name = self._names[i]
        if offset + nbytes > index_offset:
            problem = f"data [{offset}, {offset + nbytes}) runs past the tensor region, which ends at {index_offset}"
        elif offset % self.alignment:
            problem = f"data offset {offset} is not a multiple of the alignment {self.alignment}"
        elif offset < previous_end:
            problem = f"data offset {offset} overlaps the previous tensor, which ends at {previous_end}"
        else:
            problem = f"data offset {offset} leaves a gap after the previous tensor (expected {fmt.align_up(previous_end, self.alignment)})"
        raise FormatError(problem, offset=at, tensor=name)

    # ---- access --------------------------------------------------------------------------

    def _position(self, name: str) -> int:
        try:
            return self._index[name]
        except (KeyError, TypeError):
            raise TensorNotFoundError(str(name), self.path) from None

    def _raw_checked(self, i: int) -> np.ndarray:
        c = self._columns
        offset, nbytes = int(c.offset[i]), int(c.nbytes[i])
        raw = self._bytes[offset : offset + nbytes]
        if not self._checked[i]:
            expected = int(c.crc32c[i])
            actual = crc32c(raw)
            if actual != expected:
                raise ChecksumError("data", offset, expected, actual, tensor=self._names[i])
            self._checked[i] = True
        return raw

    @staticmethod
    def _shape_of(c: "_Columns", i: int) -> tuple[int, ...]:
        return tuple(c.shape[i, : c.ndim[i]].tolist())

    def _shape(self, i: int) -> tuple[int, ...]:
        return self._shape_of(self._columns, i)

    def __getitem__(self, name: str) -> np.ndarray:
        """Read-only numpy array of a tensor, zero-copy over the mapping (int4: an unpacked copy)."""
        i = self._position(name)
        raw = self._raw_checked(i)
        dtype = fmt.DTYPE_BY_CODE[int(self._columns.dtype[i])]
        shape = self._shape(i)
        if dtype.name == "int4":
            array = fmt.unpack_int4(raw, int(np.prod(shape, dtype=np.int64))).reshape(shape)
        else:
            array = raw.view(dtype.numpy).reshape(shape)
        array.flags.writeable = False
        return array

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as a read-only uint8 [nbytes] view (int4 stays packed)."""
        raw = self._raw_checked(self._position(name))[:]
        raw.flags.writeable = False
        return raw

    def torch(self, name: str) -> Any:
        """A torch tensor sharing the copy-on-write mapping (int4: an int8 copy; torch has no int4)."""
        import torch

        i = self._position(name)
        raw = self._raw_checked(i)
        dtype = fmt.DTYPE_BY_CODE[int(self._columns.dtype[i])]
        shape = self._shape(i)
        if dtype.name == "int4":
            return torch.from_numpy(self[name].astype(np.int8))
        return torch.from_numpy(raw).view(getattr(torch, dtype.name)).reshape(shape)

    def info(self, name: str) -> TensorInfo:
        i = self._position(name)
        c = self._columns
        return TensorInfo(name, fmt.DTYPE_BY_CODE[int(c.dtype[i])].name, self._shape(i), int(c.offset[i]),
                          int(c.nbytes[i]), int(c.crc32c[i]))

    def names(self, prefix: str | None = None) -> list[str]:
        """Tensor names in file order; with `prefix`, those that start with it (plain string prefix)."""
        if prefix is None:
            return list(self._names)
        return [n for n in self._names if n.startswith(prefix)]

    @property
    def metadata(self) -> dict:
        """The metadata JSON object as Python objects (parsed and checked at open)."""
        return self._metadata

    def verify(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Check every tensor's CRC32C; ChecksumError names the first bad tensor.

        `progress(done_bytes, total_bytes)` is called as the check advances."""
        c = self._columns
        total = int(c.nbytes.sum(dtype=np.uint64))
        done = 0
        for i in range(len(self._names)):
            offset, size = int(c.offset[i]), int(c.nbytes[i])
            crc = 0
            for start in range(offset, offset + size, _VERIFY_CHUNK):
                stop = min(start + _VERIFY_CHUNK, offset + size)
                crc = crc32c(self._bytes[start:stop], crc)
                done += stop - start
                if progress is not None:
                    progress(done, total)
            expected = int(c.crc32c[i])
            if crc != expected:
                raise ChecksumError("data", offset, expected, crc, tensor=self._names[i])
            self._checked[i] = True
        if progress is not None:
            progress(done, total)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._index

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def close(self) -> None:
        """Drop the mapping; arrays handed out keep it alive until they are gone."""
        mm = getattr(self, "_mm", None)
        if mm is None:
            return
        self._bytes = None
        self._mm = None
        if isinstance(mm, mmap.mmap):
            try:
                mm.close()
            except BufferError:
                pass

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kdtr_format.Reader {self.path!r}: {len(self)} tensors>"


def open(path: str | os.PathLike) -> Reader:
    """Open and validate a KDTR file (see `Reader`)."""
    return Reader(path)
