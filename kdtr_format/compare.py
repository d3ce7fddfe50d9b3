"""Tensor and metadata comparison behind `kdtr diff`.

Values are compared in float64 (integers exactly when they fit); `close` means
|a - b| <= atol + rtol * |b| elementwise (numpy.isclose), NaN matching NaN at
the same position. ULP distance counts representable values of the stored
float format between a and b (same-dtype float tensors only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass(frozen=True)
class TensorDiff:
    """How two tensors of one name compare. status: equal, close, different, dtype, shape."""

    status: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int | None = None
    first_index: tuple[int, ...] | None = None
    count: int = 0  # elements outside tolerance

    @property
    def same(self) -> bool:
        return self.status in ("equal", "close")


def _ordered(values: np.ndarray) -> np.ndarray:
    """Float bits mapped to integers that increase with the value (one step = one ulp), as float64."""
    bits = values.view(_INT_OF_WIDTH[values.dtype.itemsize]).astype(np.int64)
    magnitude = bits & ~(np.int64(-1) << np.int64(8 * values.dtype.itemsize - 1))
    return np.where(bits < 0, -magnitude, magnitude).astype(np.float64)


def _integer_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| of two integer (or bool) arrays, exact in uint64, returned as float64."""
    def biased(values: np.ndarray) -> np.ndarray:
        if values.dtype.kind == "i":
            return values.astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63)
        return values.astype(np.uint64)
    x, y = biased(a), biased(b)
    return np.where(x > y, x - y, y - x).astype(np.float64)


def _nanmax(values: np.ndarray) -> float:
    kept = values[~np.isnan(values)]
    return float(kept.max()) if kept.size else float("nan")


def compare_arrays(a: np.ndarray, b: np.ndarray, rtol: float = 0.0, atol: float = 0.0) -> TensorDiff:
    """Compare tensor a [shape] against reference b [shape]."""
    if a.dtype != b.dtype:
        return TensorDiff("dtype")
    if a.shape != b.shape:
        return TensorDiff("shape")
    is_float = a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    x, y = a.astype(np.float64), b.astype(np.float64)
    # integers compare exactly (64-bit ones may not survive float64); floats by value, NaN == NaN
    equal = (x == y) | (np.isnan(x) & np.isnan(y)) if is_float else a == b
    if equal.all():
        return TensorDiff("equal", max_ulp=0 if is_float else None)
    tolerance = atol + rtol * np.abs(y)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        delta = np.where(equal, 0.0, np.abs(x - y) if is_float else _integer_distance(a, b))
        rel = np.where(equal, 0.0, delta / np.abs(y))
    outside = ~(equal | ((delta <= tolerance) & (tolerance > 0)))
    max_ulp = None
    if is_float:
        comparable = ~np.isnan(x) & ~np.isnan(y)
        ulp = np.abs(_ordered(a) - _ordered(b))[comparable]
        max_ulp = int(ulp.max()) if ulp.size else None
    first = int(np.argmax(outside)) if outside.any() else int(np.argmax(~equal))
    return TensorDiff(
        "different" if outside.any() else "close",
        max_abs=_nanmax(delta),
        max_rel=_nanmax(rel),
        max_ulp=max_ulp,
        first_index=tuple(int(i) for i in np.unravel_index(first, a.shape)),
        count=int(outside.sum()),
    )


def diff_metadata(a: object, b: object, path: str = "metadata") -> list[str]:
    """Human-readable differences between two JSON values, one line each."""
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{path}.{key}"
            if key not in b:
                lines.append(f"{where}: only in A")
            elif key not in a:
                lines.append(f"{where}: only in B")
            else:
                lines.extend(diff_metadata(a[key], b[key], where))
        return lines
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in diff_metadata(x, y, f"{path}[{i}]")]
    if type(a) is not type(b) or a != b:
        return [f"{path}: {a!r} != {b!r}"]
    return []
