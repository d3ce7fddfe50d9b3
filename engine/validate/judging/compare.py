"""Comparisons: each turns an implementation's output and the fixture's expected
output into one `Check` row (exact, within tolerance, near-tie or FAIL)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from ..reports.report import SEVERITY, Check, Status

SKIPPED_DETAIL = "skipped (not implemented by adapter)"


def classify_divergence(margin: float, threshold: float) -> Status:
    """A token that differs from the reference at a decision with this margin:
    a near-tie below the threshold (no float32 implementation can be blamed), else a FAIL."""
    return Status.NEAR_TIE if margin < threshold else Status.FAIL


SHOWN = 16                      # values a FAIL's detail lists before eliding the rest


def compare_exact(section: str, name: str, actual: Any, expected: Any, where: str = "") -> Check:
    """Integer (or bit-exact float) outputs: shape, the kind of value (bool, integer, float:
    True is not 1, nor 1 1.0) and every value equal. A FAIL names the first index that
    differs; for a 1-D output of the wrong length (an accepted path one token long or short)
    it also lists both outputs' values."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    at = f" ({where})" if where else ""
    if actual.shape != expected.shape:
        return Check(section, name, Status.FAIL, detail=f"{_lengths(actual, expected)}{at}")
    if actual.size and _kind(actual) != _kind(expected):
        return Check(section, name, Status.FAIL,
                     detail=f"got {_kind(actual)} values ({actual.dtype}), expected {_kind(expected)} "
                            f"({expected.dtype}){at}")
    differ = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
    if differ.size and not expected.ndim:
        return Check(section, name, Status.FAIL, detail=f"got {actual}, expected {expected}{at}")
    if differ.size:
        i = int(differ[0])
        index = list(map(int, np.unravel_index(i, expected.shape)))
        return Check(section, name, Status.FAIL,
                     detail=f"{differ.size} differ; first at {index}: got "
                            f"{actual.reshape(-1)[i]}, expected {expected.reshape(-1)[i]}{at}")
    return Check(section, name, Status.EXACT)


def _kind(a: np.ndarray) -> str:
    """The kind of value an array holds: bool, integer, float (bfloat16 among them), else its dtype."""
    if a.dtype == np.bool_:
        return "bool"
    if a.dtype.kind in "iu":
        return "integer"
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        return "float"
    return str(a.dtype)


def _lengths(actual: np.ndarray, expected: np.ndarray) -> str:
    """Why outputs of different shapes differ: for 1-D ones their values and the first index
    that differs (where the shorter one ends, when it is a prefix of the longer one)."""
    if actual.ndim > 1 or expected.ndim != 1:
        return f"shape {list(actual.shape)} != expected {list(expected.shape)}"
    actual = actual.reshape(-1)
    common = min(len(actual), len(expected))
    differ = np.flatnonzero(actual[:common] != expected[:common])
    i = int(differ[0]) if differ.size else common
    got, want = (_value(a, i) for a in (actual, expected))
    return (f"{_count(len(actual))}, expected {len(expected)}: got {_values(actual)}, expected "
            f"{_values(expected)}; first difference at [{i}]: got {got}, expected {want}")


def _values(a: np.ndarray) -> str:
    shown = ", ".join(str(v) for v in a[:SHOWN].tolist())
    return f"[{shown}{', ...' if len(a) > SHOWN else ''}]"


def _value(a: np.ndarray, i: int) -> str:
    return str(a[i].item()) if i < len(a) else "none (past its end)"


def _count(n: int) -> str:
    return f"{n} value{'s' * (n != 1)}"


Locate = Callable[[int], str]    # a row index (a tree node, a token) -> where it is, in words


def compare_close(section: str, name: str, actual: Any, expected: Any, rtol: float,
                  atol: float | np.ndarray, where: str = "", locate: Locate | None = None) -> Check:
    """|actual - expected| <= atol + rtol |expected| everywhere; reports the worst element,
    and on a failure `locate(first row beyond tolerance)` when given."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    at = f" ({where})" if where else ""
    if actual.shape != expected.shape:
        return Check(section, name, Status.FAIL,
                     detail=f"shape {list(actual.shape)} != expected {list(expected.shape)}{at}")
    if expected.size == 0:
        return Check(section, name, Status.EXACT)
    if not np.isfinite(actual).all():
        return Check(section, name, Status.FAIL, detail=f"non-finite values in the output{at}")
    error = np.abs(actual - expected)
    tolerance = np.broadcast_to(atol + rtol * np.abs(expected), error.shape)
    worst = int(np.argmax(error / np.maximum(tolerance, np.finfo(np.float64).tiny)))
    err, tol = float(error.reshape(-1)[worst]), float(tolerance.reshape(-1)[worst])
    if err > tol:
        index = list(map(int, np.unravel_index(worst, expected.shape)))
        first = f"{locate(int(np.argmax((error > tolerance).reshape(len(error), -1).any(axis=1))))}; " \
            if locate else ""
        return Check(section, name, Status.FAIL, err, tol, detail=f"{first}worst at {index}{at}")
    status = Status.EXACT if not error.any() else Status.WITHIN
    return Check(section, name, status, float(error.max()) if status is Status.EXACT else err, tol)


def compare_tokens(section: str, name: str, actual: Any, expected: Any, margins: Any,
                   threshold: float, where: str = "", locate: Locate | None = None, tied: Any = None,
                   sequence: bool = False) -> Check:
    """Token decisions, whole sequences: equal, or the divergence that decides the status
    (the worst by the reference's margin there), its margin in the margin column; the first
    divergence described by `locate` when given. tied [decisions] bool: near-ties whatever
    their margin (rows a routing flip reaches, in bf16). sequence: the tokens follow each
    other, so only the first divergence is judged (the later ones follow another prefix)."""
    actual, expected = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    at = f" ({where})" if where else ""
    n = min(len(actual), len(expected))
    differ = np.flatnonzero(actual[:n] != expected[:n])
    if differ.size == 0:
        if len(actual) != len(expected):
            return Check(section, name, Status.FAIL,
                         detail=f"{len(actual)} tokens, expected {len(expected)}{at}")
        return Check(section, name, Status.EXACT)
    margins = np.asarray(margins, dtype=np.float64).reshape(-1)
    tied = np.zeros(len(margins), dtype=bool) if tied is None else np.asarray(tied, dtype=bool).reshape(-1)
    judged = differ[:1] if sequence else differ
    statuses = [Status.NEAR_TIE if tied[i] else classify_divergence(float(margins[i]), threshold) for i in judged]
    worst = max(range(len(judged)), key=lambda k: SEVERITY[statuses[k]])
    i = int(judged[worst])
    first = locate(int(differ[0])) if locate else f"at {int(differ[0])}"
    routing = ", reached by a routing flip" if tied[i] else ""
    return Check(section, name, statuses[worst], margin=float(margins[i]), tolerance=threshold,
                 detail=f"first divergence {first}; at {i}: got {actual[i]}, expected {expected[i]}{routing}{at}")


def merge(section: str, name: str, checks: Iterable[Check], needs: Iterable[str] = ()) -> Check:
    """One row for many comparisons of a kind, its numbers, detail and tables all from one of
    them: the first with the worst status (a failure or near-tie), else the largest error ratio."""
    checks, needs = list(checks), tuple(sorted(needs))
    if not checks:
        return Check(section, name, Status.SKIPPED, detail="nothing to compare", needs=needs)
    status = max((c.status for c in checks), key=SEVERITY.get)
    if status in (Status.FAIL, Status.NEAR_TIE):
        telling = next(c for c in checks if c.status is status)
    else:
        telling = max(checks, key=lambda c: c.ratio)
    regime = " | ".join(dict.fromkeys(c.regime for c in checks if c.regime))
    return Check(section, name, status, telling.error, telling.tolerance, telling.margin,
                 telling.detail if status is not Status.EXACT else "", needs, dict(telling.tables), regime=regime)


def skipped(section: str, name: str, needs: Iterable[str] = ()) -> Check:
    return Check(section, name, Status.SKIPPED, detail=SKIPPED_DETAIL, needs=tuple(sorted(needs)))


def row(section: str, name: str, needs: set[str], caps: set[str], checks: Iterable[Check]) -> Check:
    """The report row `name`: the merged checks when the adapter has every capability it
    needs, else skipped (not implemented by adapter)."""
    return merge(section, name, checks, needs) if needs <= caps else skipped(section, name, needs)


def compare_tree(section: str, built: tuple, expected: tuple, where: str) -> list[Check]:
    """An adapter's (parents, tokens, depths[, scores]) against the fixture's, all bit-exact."""
    names = ("parents", "tokens", "depths", "scores")
    return [compare_exact(section, what, got, want, where) for what, got, want in zip(names, built, expected)]


def as_words(bits: Any) -> np.ndarray:
    """Visibility words as unsigned 32-bit values, whether stored as int32 or uint32."""
    return np.asarray(bits).astype(np.int64) & 0xFFFFFFFF


def unpack_bits(words: np.ndarray, width: int) -> np.ndarray:
    """visibility_bits [rows, W] (uint32 / int32 words, bit b of word w = column 32w + b) -> bool [rows, width]."""
    as_bytes = np.ascontiguousarray(words).astype("<u4").view(np.uint8).reshape(len(words), -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width].astype(bool)


def as_int(x: Any) -> int:
    """A 0-d or one-element array (or a scalar) as a Python int."""
    return int(np.asarray(x).reshape(()))
