"""The KDTR byte layout, version 1.0 (normative text: kdtr_format/SPEC.md).

A KDTR file is, in order, with every integer little-endian:

    header     64 bytes   magic "\\x89KDTR\\r\\n\\x1a", major u16 = 1, minor u16 = 0,
                          byte-order mark u32 0x01020304 (bytes 04 03 02 01),
                          alignment u32 (power of two, 64..4096), 44 reserved zero bytes
    tensors               each tensor's raw bytes, row-major, at the next multiple of
                          `alignment`; the gaps are zero bytes
    index                 at the next multiple of `alignment` after the last tensor
                          (or at `alignment` when there is none):
                          one 104-byte record per tensor, in file order:
                            offset u64, nbytes u64, name_offset u64, name_len u32, crc32c u32,
                            dtype u8, ndim u8, 6 reserved zero bytes, shape u64[8] (unused = 0)
                          then the names: each name's UTF-8 bytes followed by one NUL
    metadata              a JSON object as UTF-8 text (no NUL, no BOM)
    trailer    64 bytes   index_offset u64, tensor_count u64, names_size u64, metadata_size u64,
                          index_crc32c u32 (records + names), metadata_crc32c u32,
                          12 reserved zero bytes,
                          trailer_crc32c u32 (over header[0:64] + trailer[0:52]),
                          end magic "KDTR_END"

Every field is fixed by the ones before it, so a valid file has exactly one
layout: no holes, no overlaps, nothing after the trailer. Packed int4 stores
element 2k in the low nibble and element 2k+1 in the high nibble of byte k
(two's complement; a final odd element leaves a zero high nibble). In numpy an
int4 tensor is an `ml_dtypes.int4` array (one byte per element, unpacked on
read); `Reader.raw(name)` gives the packed bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import metadata
from .errors import FormatError, VersionError, WriterError

MAGIC = b"\x89KDTR\r\n\x1a"
END_MAGIC = b"KDTR_END"
VERSION_MAJOR = 1
VERSION_MINOR = 0
BYTE_ORDER_MARK = 0x01020304
HEADER_SIZE = 64
TRAILER_SIZE = 64
RECORD_SIZE = 104
DEFAULT_ALIGNMENT = 64
MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 4096

MAX_NDIM = 8
MAX_NAME_BYTES = 1024
MAX_TENSORS = 1_000_000
MAX_INDEX_BYTES = 256 << 20
MAX_METADATA_BYTES = metadata.MAX_BYTES
MAX_JSON_DEPTH = metadata.MAX_DEPTH
MAX_ELEMENT_BYTES = 1 << 62

HEADER = struct.Struct("<8sHHII44s")
TRAILER = struct.Struct("<QQQQII12sI8s")
TRAILER_CRC_SPAN = 52

RECORD = np.dtype(
    [
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("name_offset", "<u8"),
        ("name_len", "<u4"),
        ("crc32c", "<u4"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("reserved", "u1", (6,)),
        ("shape", "<u8", (MAX_NDIM,)),
    ]
)
assert RECORD.itemsize == RECORD_SIZE


@dataclass(frozen=True)
class DType:
    """One stored element type: its code in the index, name, numpy dtype, bytes per element."""

    code: int
    name: str
    numpy: np.dtype
    itemsize: int  # bytes per element; int4 is packed two per byte on disk, one per byte in numpy


DTYPES: tuple[DType, ...] = tuple(
    DType(code, name, np.dtype(numpy_type).newbyteorder("<"), size)
    for code, name, numpy_type, size in [
        (1, "bool", np.bool_, 1),
        (2, "int8", np.int8, 1),
        (3, "int16", np.int16, 2),
        (4, "int32", np.int32, 4),
        (5, "int64", np.int64, 8),
        (6, "uint8", np.uint8, 1),
        (7, "uint16", np.uint16, 2),
        (8, "uint32", np.uint32, 4),
        (9, "uint64", np.uint64, 8),
        (10, "float16", np.float16, 2),
        (11, "bfloat16", ml_dtypes.bfloat16, 2),
        (12, "float32", np.float32, 4),
        (13, "float64", np.float64, 8),
        (14, "float8_e4m3fn", ml_dtypes.float8_e4m3fn, 1),
        (15, "float8_e5m2", ml_dtypes.float8_e5m2, 1),
        (16, "int4", ml_dtypes.int4, 1),
    ]
)
DTYPE_BY_CODE: dict[int, DType] = {d.code: d for d in DTYPES}
DTYPE_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
_DTYPE_BY_TYPE: dict[type, DType] = {d.numpy.type: d for d in DTYPES}


def dtype_of_numpy(dtype: np.dtype) -> DType:
    """The KDTR dtype of a numpy dtype (any byte order); WriterError when there is none."""
    found = _DTYPE_BY_TYPE.get(dtype.type)
    if found is not None:
        return found
    raise WriterError(f"unsupported dtype {dtype}; KDTR stores {', '.join(DTYPE_BY_NAME)}")


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) & ~(alignment - 1)


def check_alignment(alignment: int) -> None:
    """Raise WriterError unless alignment is a power of two in [64, 4096]."""
    if not isinstance(alignment, int) or alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
        raise WriterError(f"alignment must be a power of two from {MIN_ALIGNMENT} to {MAX_ALIGNMENT}, got {alignment!r}")


def pack_header(alignment: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION_MAJOR, VERSION_MINOR, BYTE_ORDER_MARK, alignment, bytes(44))


@dataclass(frozen=True)
class Header:
    minor: int
    alignment: int
    reserved: bytes


def parse_header(raw: bytes) -> Header:
    """Check magic, version and byte order of the first 64 bytes."""
    magic, major, minor, mark, alignment, reserved = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FormatError(f"not a KDTR file: magic {magic!r}, expected {MAGIC!r}", offset=0)
    if major != VERSION_MAJOR:
        raise VersionError(f"unsupported KDTR major version {major}.{minor}; this reader knows {VERSION_MAJOR}.x", offset=8)
    if mark != BYTE_ORDER_MARK:
        raise FormatError(f"byte-order mark {mark:#010x}, expected {BYTE_ORDER_MARK:#010x} (little-endian)", offset=12)
    return Header(minor, alignment, reserved)


@dataclass(frozen=True)
class Trailer:
    index_offset: int
    tensor_count: int
    names_size: int
    metadata_size: int
    index_crc32c: int
    metadata_crc32c: int
    reserved: bytes
    trailer_crc32c: int
    end_magic: bytes


def pack_trailer(header: bytes, index_offset: int, tensor_count: int, names_size: int, metadata_size: int,
                 index_crc32c: int, metadata_crc32c: int, crc32c) -> bytes:
    """The 64-byte trailer; `crc32c(bytes) -> int` computes its own checksum."""
    body = TRAILER.pack(index_offset, tensor_count, names_size, metadata_size, index_crc32c, metadata_crc32c,
                        bytes(12), 0, END_MAGIC)
    trailer_crc = crc32c(header + body[:TRAILER_CRC_SPAN])
    return body[:TRAILER_CRC_SPAN] + struct.pack("<I", trailer_crc) + END_MAGIC


def parse_trailer(raw: bytes) -> Trailer:
    return Trailer(*TRAILER.unpack(raw))


def pack_int4(values: np.ndarray) -> np.ndarray:
    """[n] int4 values -> [ceil(n/2)] uint8, element 2k in the low nibble of byte k."""
    nibbles = values.reshape(-1).view(np.int8).astype(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """[ceil(count/2)] uint8 -> [count] ml_dtypes.int4 (a new array; ml_dtypes keeps one nibble per byte)."""
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    return nibbles[:count].view(ml_dtypes.int4)
