"""Shared KDTR test material (imported by the tests as `kdtr_testlib`): tensors of every
dtype, a file forger, the corruption corpus.

`Parts` splits a valid file into header, tensor region, index records, names,
metadata and trailer fields; `Parts.assemble()` rebuilds a file with every
checksum recomputed, so a corruption case exercises the structural check it
targets rather than a checksum. `CORRUPTIONS` is the corpus both the Python
and the C reader must reject.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

import kdtr_format
from kdtr_format import format as fmt
from kdtr_format._crc32c import crc32c


def every_dtype_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """One tensor per KDTR dtype, plus shape edge cases (0-d, empty dims, 8 dims, odd int4)."""
    rng = np.random.default_rng(seed)
    floats = rng.standard_normal((3, 5)) * 10
    tensors = {
        "bool": rng.random((4, 3)) > 0.5,
        "int8": rng.integers(-128, 128, (7,), dtype=np.int8),
        "int16": rng.integers(-(2**15), 2**15, (2, 3), dtype=np.int16),
        "int32": rng.integers(-(2**31), 2**31, (5,), dtype=np.int32),
        "int64": rng.integers(-(2**63), 2**63 - 1, (2, 2), dtype=np.int64),
        "uint8": rng.integers(0, 256, (9,), dtype=np.uint8),
        "uint16": rng.integers(0, 2**16, (3,), dtype=np.uint16),
        "uint32": rng.integers(0, 2**32, (3, 1), dtype=np.uint32),
        "uint64": rng.integers(0, 2**64 - 1, (4,), dtype=np.uint64),
        "float16": floats.astype(np.float16),
        "bfloat16": floats.astype(ml_dtypes.bfloat16),
        "float32": floats.astype(np.float32),
        "float64": floats,
        "float8_e4m3fn": (floats / 10).astype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": floats.astype(ml_dtypes.float8_e5m2),
        "int4": rng.integers(-8, 8, (3, 3)).astype(ml_dtypes.int4),
        "shapes/scalar": np.array(2.5, np.float32),
        "shapes/empty": np.zeros((3, 0, 2), np.float64),
        "shapes/eight_dims": np.arange(2**8, dtype=np.int32).reshape((2,) * 8),
        "shapes/int4_even": np.array([-8, 7, 0, -1], ml_dtypes.int4),
        "shapes/int4_scalar": np.array(-3, ml_dtypes.int4),
        "names/ünïcode/κλειδί": np.array([1], np.uint8),
    }
    return tensors


SMALL_METADATA = {"kind": "test", "nested": {"list": [1, 2.5, None, True, "ü"]}, "n": 3}


def small_file(path: Path, alignment: int = 64, last: str = "e") -> Path:
    """A few tensors (with padding between them) and some metadata; `last` is the tensor written last:
    "e" (empty, the corpus's base) or "q" (2 bytes of int4, so the last tensor has data)."""
    tensors = {
        "a": np.arange(5, dtype=np.float32),
        "b/c": np.array([[1, 2], [3, 4]], np.int16),
        "q": np.array([-8, 7, 3], ml_dtypes.int4),
        "e": np.zeros((0, 4), np.float64),
    }
    tensors[last] = tensors.pop(last)
    kdtr_format.write(path, tensors, metadata=SMALL_METADATA, alignment=alignment)
    return path


@dataclass
class Parts:
    """A KDTR file taken apart; `assemble()` puts it back with fresh checksums."""

    header: bytearray
    data: bytearray  # bytes from the end of the header to the index
    records: np.ndarray  # structured, fmt.RECORD
    names: bytearray
    metadata: bytearray
    trailer: dict  # the Trailer fields by name

    @classmethod
    def of(cls, blob: bytes) -> "Parts":
        header = bytearray(blob[: fmt.HEADER_SIZE])
        t = fmt.parse_trailer(blob[-fmt.TRAILER_SIZE :])
        records_end = t.index_offset + t.tensor_count * fmt.RECORD_SIZE
        names_end = records_end + t.names_size
        return cls(
            header,
            bytearray(blob[fmt.HEADER_SIZE : t.index_offset]),
            np.frombuffer(blob[t.index_offset : records_end], fmt.RECORD).copy(),
            bytearray(blob[records_end:names_end]),
            bytearray(blob[names_end : names_end + t.metadata_size]),
            dataclasses.asdict(t),
        )

    def assemble(self, fix_counts: bool = True) -> bytes:
        index = self.records.tobytes() + bytes(self.names)
        t = dict(self.trailer)
        if fix_counts:
            t.update(index_offset=fmt.HEADER_SIZE + len(self.data), tensor_count=len(self.records),
                     names_size=len(self.names), metadata_size=len(self.metadata))
        t.update(index_crc32c=crc32c(index), metadata_crc32c=crc32c(bytes(self.metadata)))
        body = fmt.TRAILER.pack(t["index_offset"], t["tensor_count"], t["names_size"], t["metadata_size"],
                                t["index_crc32c"], t["metadata_crc32c"], t["reserved"], 0, t["end_magic"])
        trailer_crc = crc32c(bytes(self.header) + body[: fmt.TRAILER_CRC_SPAN])
        trailer = body[: fmt.TRAILER_CRC_SPAN] + struct.pack("<I", trailer_crc) + body[56:]
        return bytes(self.header) + bytes(self.data) + index + bytes(self.metadata) + trailer


def _set_header(offset: int, fmt_code: str, value: int) -> Callable[[Parts], None]:
    def apply(p: Parts) -> None:
        struct.pack_into(fmt_code, p.header, offset, value)
    return apply


def _set_record(i: int, field: str, value, slot: int | None = None) -> Callable[[Parts], None]:
    def apply(p: Parts) -> None:
        if slot is None:
            p.records[i][field] = value
        else:
            p.records[i][field][slot] = value
    return apply


def _move(i: int, offset: int) -> Callable[[Parts], None]:
    """Point tensor i at `offset`, with a checksum that matches the bytes there (so only layout rules catch it)."""
    def apply(p: Parts) -> None:
        record = p.records[i]
        record["offset"] = offset
        start, stop = offset - fmt.HEADER_SIZE, offset - fmt.HEADER_SIZE + int(record["nbytes"])
        if 0 <= start and stop <= len(p.data):
            record["crc32c"] = crc32c(bytes(p.data[start:stop]))
    return apply


def _rename(old: bytes, new: bytes) -> Callable[[Parts], None]:
    def apply(p: Parts) -> None:
        assert len(old) == len(new)
        p.names[:] = p.names.replace(old + b"\0", new + b"\0")
    return apply


def _metadata(text: bytes) -> Callable[[Parts], None]:
    def apply(p: Parts) -> None:
        p.metadata[:] = text
    return apply


def _trailer(fix_counts: bool = False, **fields) -> Callable[[Parts], None]:
    def apply(p: Parts) -> None:
        p.trailer.update(fields)
        p.trailer["_fix_counts"] = fix_counts
    return apply


def _grow_last_into_index(p: Parts) -> None:
    """The last tensor (empty, ending at the index) gets a row of data: its bytes would be the index's."""
    record = p.records[-1]
    record["shape"][0] = 1
    record["nbytes"] = 4 * 8


def _first_tensor_in_header(p: Parts) -> None:
    """Tensor 0 at offset 0 (its bytes, and checksum, the header's); every later tensor and the index
    re-packed canonically after it, so only the rule that data starts past the header is broken."""
    records, first = p.records, int(p.records[0]["nbytes"])
    payloads = [bytes(p.data[int(r["offset"]) - fmt.HEADER_SIZE :][: int(r["nbytes"])]) for r in records]
    records[0]["offset"], records[0]["crc32c"] = 0, crc32c(bytes(p.header[:first]))
    data, end = bytearray(), first
    for record, payload in zip(records[1:], payloads[1:]):
        offset = fmt.align_up(end, 64)
        data += bytes(offset - fmt.HEADER_SIZE - len(data)) + payload
        record["offset"], end = offset, offset + len(payload)
    p.data[:] = data + bytes(fmt.align_up(end, 64) - fmt.HEADER_SIZE - len(data))


def _bool_byte_2(p: Parts) -> None:
    """Tensor "b/c" (int16 [[1, 2], [3, 4]]) relabelled bool [8]: same bytes and checksum, a byte 2 in them."""
    record = p.records[1]
    record["dtype"], record["ndim"], record["shape"][:2] = fmt.DTYPE_BY_NAME["bool"].code, 1, (8, 0)


def _huge_shape(p: Parts) -> None:
    p.records[0]["ndim"] = 3
    p.records[0]["shape"][:3] = 2**40


def _flip_data_byte(p: Parts) -> None:
    p.data[0] ^= 0x01


@dataclass(frozen=True)
class Corruption:
    """One malformed file: `match` must appear in the Python error; `c` says the C reader must reject it too."""

    name: str
    mutate: Callable[[Parts], None]
    match: str
    c: bool = True


CORRUPTIONS: list[Corruption] = [
    Corruption("bad_magic", _set_header(0, "<B", 0x88), "not a KDTR file"),
    Corruption("unknown_major", _set_header(8, "<H", 2), "unsupported KDTR major version 2"),
    Corruption("big_endian_mark", _set_header(12, ">I", fmt.BYTE_ORDER_MARK), "byte-order mark"),
    Corruption("alignment_not_power_of_two", _set_header(16, "<I", 96), "alignment 96"),
    Corruption("alignment_too_large", _set_header(16, "<I", 8192), "alignment 8192"),
    Corruption("reserved_header_byte", _set_header(40, "<B", 1), "reserved header"),
    Corruption("overlapping_offsets", _move(1, 64), "overlaps"),
    Corruption("misaligned_offset", _move(1, 136), "not a multiple of the alignment"),
    Corruption("gap_between_tensors", _move(1, 192), "gap"),
    Corruption("offset_out_of_bounds", _move(2, 2**63), "runs past the tensor region"),
    Corruption("offset_into_index", _move(2, 256), "runs past the tensor region"),
    Corruption("nbytes_mismatch", _set_record(0, "nbytes", 16), "does not match shape"),
    Corruption("nbytes_huge", _set_record(0, "nbytes", 2**64 - 1), "does not match shape"),
    Corruption("shape_overflow", _huge_shape, "too large"),
    Corruption("shape_slot_past_ndim", _set_record(0, "shape", 7, slot=5), "past ndim"),
    Corruption("ndim_over_cap", _set_record(0, "ndim", 9), "ndim 9"),
    Corruption("unknown_dtype", _set_record(0, "dtype", 99), "unknown dtype code 99"),
    Corruption("reserved_record_byte", _set_record(0, "reserved", 1, slot=2), "reserved record"),
    Corruption("name_length_zero", _set_record(0, "name_len", 0), "name length 0"),
    Corruption("name_length_over_cap", _set_record(0, "name_len", 5000), "name length 5000"),
    Corruption("name_offset_wrong", _set_record(1, "name_offset", 1), "name offset"),
    Corruption("name_with_nul", _rename(b"b/c", b"b\0c"), "NUL"),
    Corruption("duplicate_names", _rename(b"q", b"a"), "duplicate tensor name"),
    Corruption("invalid_utf8_name", _rename(b"b/c", b"b\xffc"), "not valid UTF-8"),
    Corruption("metadata_invalid_utf8", _metadata(b'{"a": "\xc3\x28"}'), "metadata is not valid UTF-8"),
    Corruption("metadata_deep", _metadata(b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}"), "nests deeper"),
    Corruption("metadata_just_too_deep", _metadata(b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}"), "nests deeper"),
    Corruption("metadata_not_object", _metadata(b"[1, 2]"), "must be a JSON object"),
    Corruption("metadata_nul", _metadata(b'{"a": 1}\0'), "NUL"),
    Corruption("metadata_bad_json", _metadata(b'{"a": }'), "not valid JSON", c=False),
    Corruption("metadata_nan", _metadata(b'{"a": NaN}'), "not valid JSON", c=False),
    Corruption("metadata_duplicate_key", _metadata(b'{"a": 1, "a": 2}'), "duplicate key", c=False),
    Corruption("metadata_bom", _metadata(b'\xef\xbb\xbf{"a": 1}'), "byte-order mark"),
    Corruption("metadata_int_over_u64", _metadata(b'{"a": [0, 18446744073709551616]}'), "is outside [-2**63, 2**64 - 1]"),
    Corruption("metadata_int_under_i64", _metadata(b'{"a": -9223372036854775809}'), "is outside [-2**63, 2**64 - 1]"),
    Corruption("metadata_int_5000_digits", _metadata(b'{"a": ' + b"7" * 5000 + b"}"), "is outside [-2**63, 2**64 - 1]"),
    Corruption("metadata_float_overflow", _metadata(b'{"a": 1e400}'), "overflows binary64", c=False),
    Corruption("last_tensor_into_index", _grow_last_into_index, "runs past the tensor region"),
    Corruption("first_tensor_in_header", _first_tensor_in_header, "overlaps the header"),
    Corruption("bool_byte_2", _bool_byte_2, "bool byte 2 is not 0 or 1"),
    Corruption("huge_tensor_count", _trailer(tensor_count=2**62), "tensor count"),
    Corruption("huge_names_size", _trailer(names_size=2**63), "exceeds the cap"),
    Corruption("huge_metadata_size", _trailer(metadata_size=2**64 - 1), "exceeds the cap"),
    Corruption("count_disagrees_with_size", _trailer(tensor_count=3), "do not end where the trailer starts"),
    Corruption("index_offset_misaligned", _trailer(index_offset=100), "not a multiple"),
    Corruption("reserved_trailer_byte", _trailer(reserved=b"\x01" + bytes(11)), "reserved"),
    Corruption("bad_end_magic", _trailer(end_magic=b"KDTR_EN\0"), "end magic"),
    Corruption("data_checksum", _flip_data_byte, "tensor 'a'"),
]


def corrupt(valid: bytes, case: Corruption) -> bytes:
    parts = Parts.of(valid)
    case.mutate(parts)
    fix_counts = parts.trailer.pop("_fix_counts", True)
    return parts.assemble(fix_counts=fix_counts)


def read_everything(source: Path | bytes) -> tuple[dict, dict[str, bytes]]:
    """Open (a path, or an image in memory), verify, and return metadata and every tensor's bytes."""
    reader = kdtr_format.Reader.from_bytes(source) if isinstance(source, (bytes, bytearray)) else kdtr_format.open(source)
    with reader as f:
        f.verify()
        return f.metadata, {name: f.raw(name).tobytes() for name in f.names()}


# ---- metadata texts: a generator and a byte-at-a-time reference of the open-time rules -----------

METADATA_TOKENS = [b"{", b"}", b"[", b"]", b'"', b"\\", b"\\\\", b'\\"', b",", b":", b" ", b"\n", b"-", b"+", b".", b"e",
                   b"E", b"0", b"7", b"42", b"1e5", b"-0.5", b"true", b"null", b"x", "ü".encode(), "🌲".encode(),
                   b"18446744073709551615", b"18446744073709551616", b"9223372036854775808", b"-9223372036854775808",
                   b"-9223372036854775809", b"00000000000000000000001", b"-0000000000000000001", b"1" * 25]


def metadata_text(rng: np.random.Generator, size: int = 40) -> bytes:
    """A random byte string made of JSON-ish tokens, most of them starting with '{'."""
    tokens = [METADATA_TOKENS[k] for k in rng.integers(0, len(METADATA_TOKENS), rng.integers(0, size))]
    return (b"{" if rng.random() < 0.9 else b"") + b"".join(tokens)


def _integer_beyond_64_bits(text: bytes, start: int, end: int) -> bool:
    prev, prev2 = text[start - 1 : start], text[start - 2 : start - 1] if start >= 2 else b""
    after = text[end : end + 1]
    negative = prev == b"-"
    if prev in (b".", b"e", b"E", b"+") or (negative and prev2 in (b"e", b"E")) or after in (b".", b"e", b"E"):
        return False
    digits = end - start
    value = -int(text[start:end]) if negative else int(text[start:end])
    return digits > (19 if negative else 20) or not -(2**63) <= value <= 2**64 - 1


def reference_metadata_rule(text: bytes) -> str | None:
    """The rule of SPEC §5 a reader checks at open that `text` breaks ("utf8", "nul", "object", "depth",
    "integer"), or None; computed one byte at a time, as the C header does, independently of the
    vectorized Python scanner."""
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return "utf8"
    if b"\0" in text or text.startswith(b"\xef\xbb\xbf"):
        return "nul"
    if not text.lstrip(b" \t\r\n").startswith(b"{"):
        return "object"
    depth, in_string, odd_backslashes, run = 0, False, False, None
    for i, c in enumerate(text):
        quote = c == ord('"') and not odd_backslashes
        structural = not in_string and not quote
        digit = structural and ord("0") <= c <= ord("9")
        odd_backslashes = (not odd_backslashes) if c == ord("\\") else False
        if run is not None and not digit:
            if _integer_beyond_64_bits(text, run, i):
                return "integer"
            run = None
        if digit and run is None:
            run = i
        in_string ^= quote
        if structural and c in b"{[":
            depth += 1
            if depth > fmt.MAX_JSON_DEPTH:
                return "depth"
        elif structural and c in b"}]":
            depth -= 1
    return "integer" if run is not None and _integer_beyond_64_bits(text, run, len(text)) else None


RULE_MESSAGES = {"utf8": "not valid UTF-8", "nul": "NUL or a byte-order mark", "object": "must be a JSON object",
                 "depth": "nests deeper", "integer": "is outside [-2**63, 2**64 - 1]"}


def with_metadata(valid: bytes, text: bytes) -> bytes:
    """A copy of the KDTR image `valid` whose metadata is `text` (checksums recomputed)."""
    parts = Parts.of(valid)
    parts.metadata[:] = text
    return parts.assemble()
