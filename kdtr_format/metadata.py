"""KDTR metadata (SPEC.md §5): one JSON object as UTF-8 text, written, checked at open, parsed on demand.

- `encode(metadata)`: the writer's side. Refuses, with a WriterError naming the field, whatever a
  reader would reject or could not give back unchanged.
- `check_text(raw, offset)`: what every reader checks when it opens a file (the C header checks the
  same): strict UTF-8, no NUL, no byte-order mark, a leading `{`, containers nested at most 64 deep,
  every integer in [-2**63, 2**64 - 1]. Vectorized over 4 MiB chunks, so metadata at the 64 MiB cap
  is checked in well under a second in a few times its size of memory, whatever its shape.
- `parse(raw, offset)`: the JSON value, with what only a JSON parser can check: the grammar, no
  repeated key, no NaN / Infinity, no number that overflows binary64 (`1e400`).

Opening does not parse: Python objects for 64 MiB of `[[],[],...]` take seconds and gigabytes, so the
reader parses when `metadata` is first read (and in `verify()`).

Outside strings (found by unescaped quotes; a byte is escaped when an odd run of backslashes precedes
it), an *integer* is a maximal run of digits not preceded by `.`, `e`, `E`, `+` or an exponent's `-`,
and not followed by `.`, `e` or `E`; a `-` just before it makes it negative. For valid JSON this is
exactly the grammar's integer; on any text both readers apply the same rule.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from .errors import FormatError, WriterError

MAX_BYTES = 64 << 20
MAX_DEPTH = 64
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1

_CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_LEADING_SPACE = re.compile(rb"[ \t\r\n]*")
_INT_MAX_DIGITS = np.frombuffer(str(INT_MAX).encode(), np.uint8)        # 20 digits
_INT_MIN_DIGITS = np.frombuffer(str(-INT_MIN).encode(), np.uint8)       # 19 digits
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


# ---- writing ------------------------------------------------------------------------------------

def _where(trail: tuple) -> str:
    """'metadata["a"][3]' from the (parent trail, key) chain of a value."""
    keys = []
    while trail:
        trail, key = trail
        keys.append(key)
    return "metadata" + "".join(f"[{k!r}]" for k in reversed(keys))


def _problem(value: object, depth: int) -> str | None:
    """What makes one value unstorable, or None (containers: only their depth)."""
    if isinstance(value, (dict, list, tuple)):
        return f"nests deeper than {MAX_DEPTH} levels (or contains itself)" if depth > MAX_DEPTH else None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if INT_MIN <= value <= INT_MAX else "an integer outside [-2**63, 2**64 - 1]"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not representable in JSON"
    if isinstance(value, str):
        return None if _encodable(value) else "a string not encodable as UTF-8 (a lone surrogate)"
    return f"{type(value).__name__} is not a JSON type (dict, list, str, int, float, bool, None)"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode(metadata: object) -> bytes:
    """UTF-8 JSON text of a metadata dict; WriterError naming the field a reader would not give back."""
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise WriterError(f"metadata must be a dict (a JSON object), got {type(metadata).__name__}")
    stack: list[tuple[object, int, tuple]] = [(metadata, 1, ())]
    while stack:
        value, depth, trail = stack.pop()
        problem = _problem(value, depth)
        if problem is not None:
            raise WriterError(f"{_where(trail)}: {problem}")
        if isinstance(value, dict):
            for key, child in value.items():
                if not isinstance(key, str):
                    raise WriterError(f"{_where(trail)}: key {key!r} is not a string")
                if not _encodable(key):
                    raise WriterError(f"{_where(trail)}: key {key!r} is not encodable as UTF-8 (a lone surrogate)")
                stack.append((child, depth + 1, (trail, key)))
        elif isinstance(value, (list, tuple)):
            stack.extend((child, depth + 1, (trail, i)) for i, child in enumerate(value))
    raw = json.dumps(metadata, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    if len(raw) > MAX_BYTES:
        raise WriterError(f"metadata is {len(raw)} bytes, over the {MAX_BYTES}-byte cap")
    return raw


# ---- checking at open -----------------------------------------------------------------------------

def check_text(raw: bytes, offset: int) -> None:
    """The open-time rules on the metadata bytes found at file offset `offset` (FormatError otherwise)."""
    bad = _utf8_error(raw)
    if bad is not None:
        raise FormatError("metadata is not valid UTF-8", offset=offset + bad)
    nul = raw.find(b"\0")
    if nul >= 0 or raw.startswith(_BOM):
        raise FormatError("metadata contains a NUL or a byte-order mark", offset=offset + max(nul, 0))
    first = _LEADING_SPACE.match(raw).end()
    if raw[first : first + 1] != b"{":
        raise FormatError("metadata must be a JSON object (text starting with '{')", offset=offset + first)
    _Scanner(np.frombuffer(raw, np.uint8), offset).run()


def _utf8_error(raw: bytes) -> int | None:
    """Offset of the first byte of the first invalid UTF-8 sequence, or None; decodes 4 MiB at a time."""
    view, start = memoryview(raw), 0
    while start < len(raw):
        stop = min(start + _CHUNK, len(raw))
        for _ in range(3):               # end the chunk after a character, not inside one
            if stop < len(raw) and raw[stop] & 0xC0 == 0x80:
                stop += 1
        try:
            str(view[start:stop], "utf-8")
        except UnicodeDecodeError as e:
            return start + e.start
        start = stop
    return None


def _bits(mask: np.ndarray) -> int:
    """[n] bool -> a Python int whose bit i is mask[i]."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


def _mask(bits: int, n: int) -> np.ndarray:
    """Bits 0..n-1 of a non-negative or negative Python int -> [n] bool."""
    raw = (bits & ((1 << n) - 1)).to_bytes(n // 8 + 1, "little")
    return np.unpackbits(np.frombuffer(raw, np.uint8), count=n, bitorder="little").view(bool)


def _prefix_xor(bits: int, n: int) -> int:
    """Bit i of the result is the XOR of bits 0..i (log2(n) shifts of Python ints)."""
    shift = 1
    while shift < n:
        bits ^= bits << shift
        shift <<= 1
    return bits & ((1 << n) - 1)


class _Scanner:
    """One pass over the text in chunks, carrying escape, string and depth state between them."""

    def __init__(self, text: np.ndarray, offset: int):
        self.text, self.offset = text, offset   # [n] uint8
        self.escaped_next = False               # the next chunk's first byte is escaped
        self.in_string = 0                      # 1 while inside a string
        self.depth = 0

    def run(self) -> None:
        start, n = 0, self.text.size
        while start < n:
            stop = self._cut(min(start + _CHUNK, n))
            self._chunk(start, self.text[start:stop])
            start = stop

    def _cut(self, nominal: int) -> int:
        """The first position at or after `nominal` that is not a digit, so no number spans two chunks."""
        rest = self.text[nominal:]
        non_digit = np.flatnonzero((rest[:4096] - 48) >= 10)
        if non_digit.size == 0:
            non_digit = np.flatnonzero((rest - 48) >= 10)
        return nominal + int(non_digit[0]) if non_digit.size else self.text.size

    def _chunk(self, start: int, chunk: np.ndarray) -> None:
        n = chunk.size
        quote = _bits(chunk == _QUOTE)
        if self.escaped_next or (chunk == _BACKSLASH).any():
            quote &= ~self._escaped(_bits(chunk == _BACKSLASH), n)
        if quote:
            inside = _prefix_xor(quote, n) ^ (((1 << n) - 1) * self.in_string)   # opening quote and contents
            self.in_string = inside >> (n - 1) & 1
            structural = _mask(~(inside | quote), n)                             # outside strings, not a quote
        elif self.in_string:
            return                                                               # all inside one string
        else:
            structural = np.ones(n, bool)
        self._depth(start, chunk, structural)
        self._integers(start, structural & ((chunk - 48) < 10))

    def _escaped(self, backslash: int, n: int) -> int:
        """Bits of the bytes right after an odd run of backslashes, runs carried in from the last chunk.

        Adding a run's lowest bit to the run carries into the byte after it; the run is odd when that
        byte's position and the run's start differ in parity (simdjson's escape trick)."""
        even = int.from_bytes(b"\x55" * (n // 8 + 2), "little")
        starts = backslash & ~(backslash << 1)
        even_starts, odd_starts = starts & even, starts & ~even
        if self.escaped_next and backslash & 1:      # this run began in the last chunk, at an odd length
            even_starts, odd_starts = even_starts ^ 1, odd_starts | 1
        escaped = ((backslash + even_starts) & ~backslash & ~even) | ((backslash + odd_starts) & ~backslash & even)
        if self.escaped_next and not backslash & 1:
            escaped |= 1
        self.escaped_next = bool(escaped >> n & 1)
        return escaped

    def _depth(self, start: int, chunk: np.ndarray, structural: np.ndarray) -> None:
        opens = structural & ((chunk == ord("{")) | (chunk == ord("[")))
        closes = structural & ((chunk == ord("}")) | (chunk == ord("]")))
        levels = np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int32)   # [n], from self.depth
        over = levels > MAX_DEPTH - self.depth
        if over.any():
            raise FormatError(f"metadata nests deeper than {MAX_DEPTH} levels", offset=self.offset + start + int(over.argmax()))
        self.depth += int(levels[-1])

    def _integers(self, start: int, digit: np.ndarray) -> None:
        """Refuse integers outside [-2**63, 2**64 - 1]; only runs of 19+ digits can be."""
        long = digit
        for shift in (1, 2, 4, 8, 3):           # True where 2, 4, 8, 16, then 19 digits start
            long = long[:-shift] & long[shift:]
        if not long.any():
            return
        before, after = np.zeros_like(digit), np.zeros_like(digit)
        before[1:], after[:-1] = digit[:-1], digit[1:]
        first = np.flatnonzero(digit & ~before)
        last = np.flatnonzero(digit & ~after)
        long = (last - first) >= 18
        if not long.any():
            return
        text = self.text
        first, last = first[long] + start, last[long] + start
        lengths = last - first + 1
        prev, prev2 = text[first - 1], text[np.maximum(first - 2, 0)]
        nxt = text[np.minimum(last + 1, text.size - 1)] * (last + 1 < text.size)
        negative = prev == ord("-")
        not_integer = (np.isin(prev, list(b".eE+")) | (negative & np.isin(prev2, list(b"eE")))
                       | np.isin(nxt, list(b".eE")))
        integer = ~not_integer
        bad = integer & ((lengths > 20) | ((lengths == 20) & negative))
        for size, sign, limit in [(20, False, _INT_MAX_DIGITS), (19, True, _INT_MIN_DIGITS)]:
            rows = np.flatnonzero(integer & (lengths == size) & (negative == sign))
            if rows.size:
                digits = text[first[rows, None] + np.arange(size)]          # [m, size] uint8
                differs = digits != limit
                at = differs.argmax(axis=1)
                above = differs.any(axis=1) & (digits[np.arange(rows.size), at] > limit[at])
                bad[rows[above]] = True
        if bad.any():
            i = int(np.argmax(bad))
            begin = int(first[i]) - int(negative[i])
            shown = bytes(text[begin : min(int(last[i]) + 1, begin + 40)]).decode()
            raise FormatError(f"metadata integer {shown}{'...' if int(last[i]) + 1 > begin + 40 else ''} "
                              f"is outside [-2**63, 2**64 - 1]", offset=self.offset + begin)


# ---- parsing --------------------------------------------------------------------------------------

def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} overflows binary64")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key {duplicate!r}")
    return result


def parse(raw: bytes, offset: int) -> dict:
    """The metadata object of text that passed `check_text` (so a valid JSON text is an object);
    FormatError on what JSON parsing finds."""
    text = raw.decode("utf-8")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        at = offset + len(text[: e.pos].encode("utf-8"))
        raise FormatError(f"metadata is not valid JSON: {e.msg}", offset=at) from None
    except ValueError as e:
        raise FormatError(f"metadata is not valid JSON: {e}", offset=offset) from None
    return value
