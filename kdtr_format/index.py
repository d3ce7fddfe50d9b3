"""Validating a KDTR file's layout at open: header, trailer, index records, names, metadata framing.

`parse_layout(buffer, size)` checks every rule of SPEC.md §1-§5 that does not need the tensor bytes
or a JSON parser, in the order §4 gives, and returns the tensor table. The checks on the records are
vectorized over numpy columns, so 10k tensors cost a few milliseconds and a million well under a
second. Tensor checksums (and bool values) are the reader's job, on first access and in `verify()`;
the JSON grammar is `metadata.parse`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import format as fmt
from . import metadata
from ._crc32c import crc32c
from .errors import ChecksumError, FormatError

_ITEMSIZE = np.array([fmt.DTYPE_BY_CODE[c].itemsize if c in fmt.DTYPE_BY_CODE else 1 for c in range(256)], np.uint64)
_INT4 = fmt.DTYPE_BY_NAME["int4"].code
_KNOWN = np.zeros(256, bool)
_KNOWN[list(fmt.DTYPE_BY_CODE)] = True


@dataclass(frozen=True)
class Columns:
    """The index records as contiguous per-field arrays."""

    offset: np.ndarray  # [n] uint64
    nbytes: np.ndarray  # [n] uint64
    crc32c: np.ndarray  # [n] uint32
    dtype: np.ndarray  # [n] uint8
    ndim: np.ndarray  # [n] uint8
    reserved: np.ndarray  # [n] uint64, the 6 reserved bytes of each record
    shape: np.ndarray  # [n, 8] uint64

    @classmethod
    def of(cls, records: np.ndarray) -> "Columns":
        reserved = np.zeros((len(records), 8), np.uint8)
        reserved[:, :6] = records["reserved"]
        return cls(*(np.ascontiguousarray(records[f]) for f in ("offset", "nbytes", "crc32c", "dtype", "ndim")),
                   reserved.view("<u8").reshape(-1), np.ascontiguousarray(records["shape"]))


@dataclass(frozen=True)
class Layout:
    """What opening found: the version, alignment, tensor table and where the metadata text is."""

    version: tuple[int, int]
    alignment: int
    names: list[str]
    positions: dict[str, int]  # name -> index in the file
    columns: Columns
    metadata: bytes  # the metadata text, checked by metadata.check_text
    metadata_at: int


def check_size(size: int) -> None:
    minimum = fmt.HEADER_SIZE + fmt.TRAILER_SIZE
    if size < minimum:
        raise FormatError(f"file is {size} bytes, smaller than header plus trailer ({minimum})", offset=size)


def _first(mask: np.ndarray) -> int | None:
    """Index of the first True in a boolean array, or None."""
    return int(mask.argmax()) if mask.any() else None


def parse_layout(buffer, size: int) -> Layout:
    """Validate the file image `buffer` (mmap or bytearray, `size` bytes, at least 128)."""
    header_raw = bytes(buffer[: fmt.HEADER_SIZE])
    header = fmt.parse_header(header_raw)
    trailer_at = size - fmt.TRAILER_SIZE
    trailer_raw = bytes(buffer[trailer_at:size])
    t = fmt.parse_trailer(trailer_raw)
    if t.end_magic != fmt.END_MAGIC:
        raise FormatError(f"end magic {t.end_magic!r}, expected {fmt.END_MAGIC!r} (truncated file?)", offset=size - 8)
    actual = crc32c(header_raw + trailer_raw[: fmt.TRAILER_CRC_SPAN])
    if actual != t.trailer_crc32c:
        raise ChecksumError("trailer", trailer_at + fmt.TRAILER_CRC_SPAN, t.trailer_crc32c, actual)
    alignment = header.alignment
    if alignment < fmt.MIN_ALIGNMENT or alignment > fmt.MAX_ALIGNMENT or alignment & (alignment - 1):
        raise FormatError(f"alignment {alignment} is not a power of two from {fmt.MIN_ALIGNMENT} to {fmt.MAX_ALIGNMENT}", offset=16)
    known_minor = header.minor <= fmt.VERSION_MINOR
    if known_minor and (any(header.reserved) or any(t.reserved)):
        raise FormatError("reserved header or trailer bytes are not zero", offset=20 if any(header.reserved) else trailer_at + 40)

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
    index_raw = np.frombuffer(buffer, np.uint8, index_size, t.index_offset)
    actual = crc32c(index_raw)
    if actual != t.index_crc32c:
        raise ChecksumError("index", t.index_offset, t.index_crc32c, actual)
    records = index_raw[: count * fmt.RECORD_SIZE].view(fmt.RECORD)
    names_at = t.index_offset + count * fmt.RECORD_SIZE
    names = _parse_names(records, index_raw[count * fmt.RECORD_SIZE :], t.index_offset, names_at)
    positions = dict(zip(names, range(count)))
    if len(positions) != count:
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))
        raise FormatError("duplicate tensor name", offset=t.index_offset, tensor=duplicate)
    columns = _check_records(Columns.of(records), names, t.index_offset, alignment, known_minor)

    metadata_at = names_at + t.names_size
    metadata_raw = bytes(buffer[metadata_at : metadata_at + t.metadata_size])
    actual = crc32c(metadata_raw)
    if actual != t.metadata_crc32c:
        raise ChecksumError("metadata", metadata_at, t.metadata_crc32c, actual)
    metadata.check_text(metadata_raw, metadata_at)
    return Layout((fmt.VERSION_MAJOR, header.minor), alignment, names, positions, columns, metadata_raw, metadata_at)


def _parse_names(records: np.ndarray, blob: np.ndarray, index_at: int, names_at: int) -> list[str]:
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


def _check_records(c: Columns, names: list[str], index_offset: int, alignment: int, known_minor: bool) -> Columns:
    """Vectorized checks of every record (SPEC.md §3 and the layout rule of §1)."""
    if len(names) == 0:
        if index_offset != fmt.align_up(fmt.HEADER_SIZE, alignment):
            raise FormatError(f"index offset {index_offset} with no tensors, expected {alignment}", offset=index_offset)
        return c

    def fail(problem: str, i: int, field: int) -> FormatError:
        return FormatError(problem, offset=index_offset + i * fmt.RECORD_SIZE + field, tensor=names[i])

    bad = _first(~_KNOWN[c.dtype])
    if bad is not None:
        raise fail(f"unknown dtype code {int(c.dtype[bad])}", bad, 32)
    bad = _first(c.ndim > fmt.MAX_NDIM)
    if bad is not None:
        raise fail(f"ndim {int(c.ndim[bad])} exceeds {fmt.MAX_NDIM}", bad, 33)
    # dimensions past the largest ndim are checked at once; the loops below stop there
    top = int(c.ndim.max())
    unused_nonzero = np.any(c.shape[:, top:] != 0, axis=1)
    for d in range(top):
        unused_nonzero |= (c.ndim <= d) & (c.shape[:, d] != 0)
    bad = _first(unused_nonzero)
    if bad is not None:
        raise fail("shape slots past ndim are not zero", bad, 40)
    if known_minor:
        bad = _first(c.reserved != 0)
        if bad is not None:
            raise fail("reserved record bytes are not zero", bad, 34)

    # Element bytes, ignoring zero dims, must stay under 2**62: bound with float64 first so
    # that the exact uint64 product below cannot overflow.
    itemsize = _ITEMSIZE[c.dtype]
    estimate = itemsize.astype(np.float64)
    exact = itemsize.copy()
    elements = np.ones(len(names), np.uint64)
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
        raise fail(f"shape {tuple(c.shape[bad, : c.ndim[bad]].tolist())} is too large (over 2**62 bytes)", bad, 40)
    expected = np.where(c.dtype == _INT4, (elements + np.uint64(1)) // np.uint64(2), elements * itemsize)
    bad = _first(c.nbytes != expected)
    if bad is not None:
        raise fail(f"byte length {int(c.nbytes[bad])} does not match shape and dtype (expected {int(expected[bad])})", bad, 8)

    bad = _first((c.offset > index_offset) | (c.nbytes > index_offset))
    if bad is None:
        step = np.uint64(alignment)
        ends = c.offset + c.nbytes
        previous_end = np.concatenate([np.array([fmt.HEADER_SIZE], np.uint64), ends[:-1]])
        canonical = (previous_end + step - np.uint64(1)) & ~(step - np.uint64(1))
        bad = _first((c.offset != canonical) | (ends > index_offset))
        if bad is None:
            last = fmt.align_up(int(ends[-1]), alignment)
            if last != index_offset:
                raise FormatError(f"index offset {index_offset} does not follow the last tensor (expected {last})",
                                  offset=index_offset)
            return c
    raise fail(_layout_problem(bad, c, index_offset, alignment), bad, 0)


def _layout_problem(i: int, c: Columns, index_offset: int, alignment: int) -> str:
    """Which layout rule record i breaks (the first that applies)."""
    offset, nbytes = int(c.offset[i]), int(c.nbytes[i])
    previous_end = fmt.HEADER_SIZE if i == 0 else int(c.offset[i - 1]) + int(c.nbytes[i - 1])
    if offset + nbytes > index_offset:
        return f"data [{offset}, {offset + nbytes}) runs past the tensor region, which ends at {index_offset}"
    if offset % alignment:
        return f"data offset {offset} is not a multiple of the alignment {alignment}"
    if offset < previous_end:
        what = "the header" if i == 0 else "the previous tensor"
        return f"data offset {offset} overlaps {what}, which ends at {previous_end}"
    return f"data offset {offset} leaves a gap after the previous tensor (expected {fmt.align_up(previous_end, alignment)})"
