"""When a regenerated fixture is the committed one (`refgen verify`, docs/fixtures.md
"Regeneration").

Another machine runs refgen's float64 arithmetic in another order (OpenBLAS picks its
kernels by CPU, numpy its SIMD loops), so a computed float may move by some float64
roundings of the quantity it belongs to; nothing else may move. The rule, in one place:

- integer and bool tensors (tokens, trees, choices, accepted paths), every float that is
  drawn, copied or made by hand (weights, kernel-case inputs and compaction results,
  uniforms, the sampling cases) and every metadata value but the floats below: identical;
- the seeded tensors a slim file omits: their dtype, shape and sha256 (refgen.files);
- a computed float: |regenerated - committed| <= REGEN_REL x the scale of its quantity
  (`Quantity`), plus one unit in the last place of its stored dtype (a float32 result
  rounded once from float64 flips by one ulp when the float64 value lies that close to a
  rounding boundary); non-finite values identical.

The scale of a quantity is never the value itself: a margin (the difference of two
logits) carries the rounding of the logits, so it is judged on the logit scale.
`TENSOR_RULES` and `METADATA_RULES` give every float of a fixture its quantity; a float
with none is reported, so that a new tensor or key is classified before it is committed.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import numpy as np

from .files import SEEDED_KEY, recorded_seeded, seeded_problems

REGEN_REL = 1e-11                    # docs/fixtures.md "Regeneration": 1000x the spread measured across CPUs
PROVENANCE = ("version", "numpy")    # generator keys that may differ between regenerations
NOT_COMPARED = ("content_hash", SEEDED_KEY)   # top-level keys compare() checks its own way


@dataclass(frozen=True)
class Quantity:
    """A kind of fixture float and the scale its regeneration is judged on: "exact" (no
    tolerance), "logit_scale" (the committed metadata's logit_scale), "tensor" (the
    committed tensor's largest finite |value|), "unit" (1), "self" (the value: for scales
    and thresholds, products of a measured scale and constants, never differences)."""

    name: str
    scale: str


EXACT = Quantity("drawn, copied or given", "exact")
LOGITS = Quantity("logits", "logit_scale")
MARGINS = Quantity("margins", "logit_scale")          # top1 - top2 logits; sampled: 4 T x a CDF distance
GAPS = Quantity("top-k gaps", "logit_scale")          # differences of draft logits
ROUTING = Quantity("routing margins", "unit")         # differences of selection scores: sigmoids plus a bias
LOGPROBS = Quantity("log-probs", "tensor")
SCORES = Quantity("tree scores", "tensor")
ATTENTION = Quantity("attention outputs", "tensor")
LSE = Quantity("log-sum-exp", "tensor")
DERIVED = Quantity("scales and thresholds", "self")

# Tensor names (a bf16/ prefix removed) -> quantity; the first pattern that matches wins.
TENSOR_RULES: tuple[tuple[str, Quantity], ...] = (
    ("weights/*", EXACT), ("checkpoint/*", EXACT), ("sample_cases/*", EXACT),
    ("prompts/*/prefill_logits", LOGITS), ("traces/*/verify_logits", LOGITS), ("traces/*/draft_logits", LOGITS),
    ("*/router_margins", ROUTING),
    ("prompts/*/margins", MARGINS), ("traces/*/margins", MARGINS),
    ("traces/*/uniforms", EXACT), ("traces/*/prefill_uniform", EXACT),
    ("*/topk_lp", LOGPROBS), ("*/scores", SCORES),
    ("cases/*/o_lat", ATTENTION), ("cases/*/o_lat_bf16", ATTENTION),
    ("cases/*/lse", LSE), ("cases/*/lse_bf16", LSE),
    ("cases/*", EXACT),               # kernel-case inputs (drawn) and compaction results (copies)
)

# Metadata keys (a leading bf16. removed, list indices dropped: traces[3].min_margin is
# traces.min_margin) -> quantity.
METADATA_RULES: tuple[tuple[str, Quantity], ...] = (
    ("config.*", EXACT), ("checkpoint.*", EXACT), ("sample_cases.temperature", EXACT),
    ("traces.ddtree.*", EXACT), ("traces.drafter.accuracy", EXACT), ("topk_gap_threshold", EXACT),
    ("cases.min_topk_gap", EXACT), ("cases.min_topk_boundary_gap", EXACT),   # of quantized drawn logits
    ("min_margin", MARGINS), ("traces.min_margin", MARGINS),
    ("min_topk_gap", GAPS), ("traces.min_topk_gap", GAPS), ("traces.min_topk_boundary_gap", GAPS),
    ("logit_scale", DERIVED), ("margin_threshold", DERIVED), ("bf16_margin_threshold", DERIVED),
    ("routing_threshold", DERIVED), ("tolerances.*", DERIVED), ("tolerances_bf16.*", DERIVED),
    ("cases.scale", DERIVED),
)


def tensor_quantity(name: str) -> Quantity | None:
    return _match(name.removeprefix("bf16/"), TENSOR_RULES)


def metadata_quantity(key: str) -> Quantity | None:
    return _match(key.removeprefix("bf16."), METADATA_RULES)


def _match(name: str, rules: tuple[tuple[str, Quantity], ...]) -> Quantity | None:
    return next((quantity for pattern, quantity in rules if fnmatch.fnmatchcase(name, pattern)), None)


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


def tolerance_of(quantity: Quantity, expected: np.ndarray, logit_scale: float | None) -> float | None:
    """The absolute tolerance of a tensor of `quantity` (None: exact); ValueError when the
    fixture lacks the scale."""
    if quantity.scale == "exact":
        return None
    if quantity.scale == "logit_scale":
        if not isinstance(logit_scale, (int, float)) or not logit_scale > 0:
            raise ValueError(f"{quantity.name} are judged on the logit scale, and metadata.logit_scale is "
                             f"{logit_scale!r}")
        return REGEN_REL * logit_scale
    if quantity.scale == "unit":
        return REGEN_REL
    values = np.asarray(expected, dtype=np.float64)
    return REGEN_REL * float(np.abs(values[np.isfinite(values)]).max(initial=0.0))


# ---------------------------------------------------------------------------- fixtures

def compare(expected: Any, actual: Any) -> list[str]:
    """Problems of a regenerated fixture `actual` against the committed `expected` (both
    KDTR readers, each full or slim): one line per drifting tensor or metadata key, []
    when none."""
    logit_scale = expected.metadata.get("logit_scale")
    problems = metadata_drift(expected.metadata, actual.metadata, "metadata", logit_scale)
    problems += _seeded_drift(expected.metadata, actual.metadata)
    problems += [f"committed {line}" for line in seeded_problems(expected)]
    problems += [f"regenerated {line}" for line in seeded_problems(actual)]
    seeded = set(recorded_seeded(expected.metadata)) | set(recorded_seeded(actual.metadata))
    expected_names, actual_names = set(expected.names()) - seeded, set(actual.names()) - seeded
    problems += [f"{name}: missing from the regenerated fixture"
                 for name in sorted(expected_names - actual_names)]
    problems += [f"{name}: regenerated but not in the committed fixture"
                 for name in sorted(actual_names - expected_names)]
    for name in sorted(expected_names & actual_names):
        e, a = np.asarray(expected[name]), np.asarray(actual[name])
        quantity = tensor_quantity(name) if _is_float(e) else EXACT
        if quantity is None:
            problems.append(f"{name}: a {e.dtype} tensor with no regeneration rule (refgen/regen.py TENSOR_RULES)")
            continue
        try:
            drift = tensor_drift(e, a, tolerance_of(quantity, e, logit_scale))
        except ValueError as exc:
            drift = str(exc)
        if drift:
            problems.append(f"{name}: {drift}")
    return problems


def _seeded_drift(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """The seeded tensors whose recorded dtype, shape or sha256 differs between the two."""
    committed, regenerated = recorded_seeded(expected), recorded_seeded(actual)
    problems = []
    for name in sorted(set(committed) | set(regenerated)):
        if name not in regenerated or name not in committed:
            side = "regenerated" if name not in committed else "committed"
            problems.append(f"{name}: seeded only in the {side} fixture")
        elif committed[name] != regenerated[name]:
            problems.append(f"{name}: the seeded tensor regenerates as {_record(regenerated[name])}, the "
                            f"committed fixture records {_record(committed[name])} (the draw from the seed "
                            "changed: numpy's random stream or refgen's drawing code)")
    return problems


def _record(record: Any) -> str:
    if not isinstance(record, dict):
        return repr(record)
    return f"{record.get('dtype')}{record.get('shape')} sha256 {str(record.get('sha256'))[:16]}..."


def tensor_drift(expected: np.ndarray, actual: np.ndarray, tolerance: float | None) -> str | None:
    """None when `actual` regenerates `expected`: same dtype and shape, then identical bytes
    (`tolerance` None) or every finite value within `tolerance` plus one unit in the last
    place of the stored dtype, non-finite values identical."""
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return (f"{actual.dtype}{list(actual.shape)} regenerated, "
                f"{expected.dtype}{list(expected.shape)} committed")
    if tolerance is None:
        if expected.tobytes() == actual.tobytes():
            return None
        differ = _differing(expected, actual)
        first = np.unravel_index(int(differ[0]), expected.shape)
        return (f"{len(differ)} of {expected.size} values differ, first at {[int(i) for i in first]}: "
                f"committed {expected[first]}, regenerated {actual[first]}")
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)) or \
            not np.array_equal(e[~finite], a[~finite], equal_nan=True):
        return "non-finite values differ"
    ulp = np.zeros_like(e)
    ulp[finite] = np.spacing(np.abs(expected[finite])).astype(np.float64)
    diff = np.zeros_like(e)
    diff[finite] = np.abs(e[finite] - a[finite])
    bad = diff > tolerance + ulp
    if not bad.any():
        return None
    worst = np.unravel_index(np.argmax(np.where(bad, diff, -1.0)), e.shape)
    return (f"{int(bad.sum())} of {e.size} values drift beyond {tolerance:.3g} (+1 ulp of {expected.dtype}); "
            f"worst at {[int(i) for i in worst]}: committed {float(e[worst])!r}, regenerated {float(a[worst])!r}")


def _differing(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Flat indices of the elements whose bytes differ (arrays of one dtype and shape)."""
    def rows(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(x.size, -1)
    return np.flatnonzero((rows(expected) != rows(actual)).any(axis=1))


def metadata_drift(expected: Any, actual: Any, path: str, logit_scale: float | None = None,
                   key: str = "") -> list[str]:
    """Differences between two metadata trees at `path`: floats by METADATA_RULES (`key`,
    the path without its indices), everything else equal and of the same type (True is not
    1, nor 1 1.0); the provenance keys (generator version, numpy) and NOT_COMPARED are skipped."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        problems = []
        for name in sorted(set(expected) | set(actual)):
            if (not key and name in NOT_COMPARED) or (key == "generator" and name in PROVENANCE):
                continue
            if name not in actual or name not in expected:
                side = "regenerated" if name not in expected else "committed"
                problems.append(f"{path}.{name}: only in the {side} fixture")
            else:
                problems += metadata_drift(expected[name], actual[name], f"{path}.{name}", logit_scale,
                                           f"{key}.{name}" if key else name)
        return problems
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [p for i, (e, a) in enumerate(zip(expected, actual))
                for p in metadata_drift(e, a, f"{path}[{i}]", logit_scale, key)]
    if isinstance(expected, float) and isinstance(actual, float):
        return _float_drift(expected, actual, path, key, logit_scale)
    if expected == actual and type(expected) is type(actual):
        return []
    return [f"{path}: committed {expected!r}, regenerated {actual!r}"]


def _float_drift(expected: float, actual: float, path: str, key: str, logit_scale: float | None) -> list[str]:
    quantity = metadata_quantity(key)
    if quantity is None:
        return [f"{path}: a float with no regeneration rule (refgen/regen.py METADATA_RULES)"]
    if quantity.scale == "self":
        limit = REGEN_REL * max(abs(expected), abs(actual))
    else:
        try:
            limit = tolerance_of(quantity, np.array(expected), logit_scale)
        except ValueError as exc:
            return [f"{path}: {exc}"]
    if expected == actual or (limit is not None and abs(expected - actual) <= limit):
        return []
    return [f"{path}: committed {expected!r}, regenerated {actual!r}"]
