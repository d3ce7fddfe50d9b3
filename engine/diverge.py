"""The divergence finder (`kdtree diverge`): where two ways of computing the same tokens
(engine/diverge_ways.py) stop agreeing, bit for bit and beyond the noise of the compute dtype.

In exact arithmetic a token's logits depend only on the token, its position
and the keys it sees, so DDTree greedy equals AR greedy. An engine computes the
same token in different calls: in an AR decode step it is the only row
(M = 1); in a tree verify it is one of n + 1 rows beside nodes it cannot see;
in a batch it shares every matrix product with other requests. Where a
kernel's reduction order (a matmul's split, an attention's key blocking, an
expert's batch) depends on those surroundings, the results differ in the last
bits, and near a tie a greedy choice or an expert selection flips.

How the first divergence is found. The capture points (engine/model.py
CAPTURE_POINTS: attn_input, q_lat, c_kv, k_pe, o_lat, attn_output,
attn_residual, router_scores, experts, ffn_output, layer_output per layer, then
logits) are compared in that order, layer by layer, every token at once. A
point's inputs come earlier in this order: its own token's earlier points, and
the c_kv / k_pe of the keys it sees, which precede o_lat. So at the first point where any token
differs, every input is bitwise equal in both ways: the op producing it
returned different bits for the same inputs. That op is the first that is not
invariant; everything after it may be a consequence.

Rounding or a bug. A row-count-dependent reduction moves a value by an ulp or so, a bug
(a wrong mask, a lost partial sum) by a fraction of the value itself. Every float point is
judged against the noise the compute dtype allows (`Noise`): two ways that each err by up
to the dtype's logits tolerance (docs/precision.md: bf16's from the measured error model,
float32's the model fixtures') differ by up to twice it, per row
`max |a - b| <= 2 (atol rms(row) sqrt(depth) + rtol max|row|)`, depth being the layer's
number (1 for layer 0; the layer count for the logits: the error model's growth with
depth). An expert-selection flip is a near-tie of that rounding when its token's router
scores differ between the ways; it moves its token's FFN output, and from the next layer
on every later token's values, far beyond rounding, so those rows are judged apart
(reached by the flip). A flip whose scores are bitwise equal is beyond noise (the
selection itself differs), as is any other integer point that differs. The headline is
the first point with a token beyond noise: all its inputs agree up to rounding, so that
op computes something else in the two ways. The rounding before it is shown as such,
and a report with no point beyond noise says so and names the first op that is not
invariant.

The finder names the op, the token, the ulps (in the captured dtype) and the multiple
of the noise, the rows (M) of both calls, the keys (attention) or the experts and their
batch sizes (MoE) involved, the expert selections that flip downstream, and each
decision's greedy choice and top-1/top-2 margin in both ways.

Why invariance removes the divergence: the same order is an induction. If
every op returns the same bits for the same inputs whatever M, the masked
slots and the batch (batch-invariant kernels), the first point cannot differ,
hence no point does: the logits and the greedy choices are equal bit for bit,
and DDTree greedy == AR greedy by construction. On such an engine the finder
reports no divergence; on any other it names the first op that is not
invariant.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from kdtr_format.precision import FLOAT32_LOGIT_ATOL, FLOAT32_LOGIT_RTOL, bf16_bounds

from .diverge_ways import Way
from .model import CAPTURE_POINTS

LAYER_POINTS = CAPTURE_POINTS[:-1]

OPS = {
    "attn_input": "RMSNorm_in of the layer input",
    "q_lat": "the query projection (W_q, or W_qa, RMSNorm_qa, W_qb), its RoPE part and the absorption by W_UK",
    "c_kv": "W_kva and RMSNorm_kva (the cached latent)",
    "k_pe": "RoPE of the rotary key",
    "o_lat": "attention: scores over the visible keys, mask, softmax, weighted sum of c_kv",
    "attn_output": "W_UV and W_o",
    "attn_residual": "the residual add after attention",
    "router_scores": "RMSNorm_post and the router, sigmoid(x W_g^T)",
    "experts": "top-k expert selection (correction bias, groups)",
    "ffn_output": "RMSNorm_post, the experts' SwiGLU, their weighted sum and the shared expert (or the dense MLP)",
    "layer_output": "the residual add after the FFN",
    "logits": "the final RMSNorm and lm_head",
}

# Each point's inputs among the points ("layer input": the previous layer's layer_output, or
# the embedding of the tokens, which both ways share).
INPUTS = {
    "attn_input": ("layer input",),
    "q_lat": ("attn_input",), "c_kv": ("attn_input",), "k_pe": ("attn_input",),
    "o_lat": ("q_lat", "c_kv", "k_pe"),
    "attn_output": ("o_lat",),
    "attn_residual": ("layer input", "attn_output"),
    "router_scores": ("attn_residual",),
    "experts": ("router_scores",),
    "ffn_output": ("attn_residual", "router_scores", "experts"),
    "layer_output": ("attn_residual", "ffn_output"),
    "logits": ("layer input",),
}

# ---------------------------------------------------------------------------- ulps and noise

def ulps_at_scale(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a, b [T, ...] of one float dtype -> float64 [T]: per row, max |a - b| in ulps (of that dtype)
    of the row's largest magnitude. A reordered reduction errs by about an ulp of the magnitudes
    it accumulates, so this is its natural unit (an element near zero would count millions of its
    own ulps). bfloat16 arrays are ml_dtypes.bfloat16."""
    rows = len(a)
    a64 = np.asarray(a, dtype=np.float64).reshape(rows, -1)
    b64 = np.asarray(b, dtype=np.float64).reshape(rows, -1)
    scale = np.maximum(np.abs(a64), np.abs(b64)).max(1, initial=0.0)
    nmant = ml_dtypes.finfo(a.dtype).nmant
    ulp = np.exp2(np.floor(np.log2(np.maximum(scale, np.finfo(np.float64).tiny))) - nmant)
    return np.abs(a64 - b64).max(1, initial=0.0) / ulp


@dataclass(frozen=True)
class Noise:
    """How far rounding alone lets two ways of computing one value differ in a compute dtype
    (module docstring): twice the dtype's logits tolerance, atol relative to a row's rms at
    depth 1, rtol relative to its largest magnitude."""

    dtype: str
    atol: float
    rtol: float

    @classmethod
    def of(cls, dtype: str) -> "Noise":
        """The noise of "float32" or "bfloat16" (kdtr_format.precision)."""
        if dtype == "bfloat16":
            bounds = bf16_bounds(logit_scale=1.0, layers=1, largest_logit=0.0)
            return cls(dtype, bounds.logits_atol, bounds.logits_rtol)
        if dtype == "float32":
            return cls(dtype, FLOAT32_LOGIT_ATOL, FLOAT32_LOGIT_RTOL)
        raise ValueError(f"no noise model for compute dtype {dtype!r} (float32, bfloat16)")

    def ratios(self, a: np.ndarray, b: np.ndarray, depth: int) -> np.ndarray:
        """a, b [T, ...] -> float64 [T]: each row's largest difference over its bound at `depth`;
        above 1 it is beyond noise (a row with a non-finite difference is infinitely so)."""
        rows = len(a)
        a64 = np.asarray(a, dtype=np.float64).reshape(rows, -1)
        b64 = np.asarray(b, dtype=np.float64).reshape(rows, -1)
        magnitude = np.maximum(np.abs(a64), np.abs(b64))
        rms = np.sqrt(np.mean(magnitude ** 2, axis=1)) if magnitude.shape[1] else np.zeros(rows)
        bound = 2 * (self.atol * rms * math.sqrt(depth) + self.rtol * magnitude.max(1, initial=0.0))
        with np.errstate(invalid="ignore", over="ignore"):
            difference = np.where(a64 == b64, 0.0, np.abs(a64 - b64))          # equal infinities: no difference
            ratio = difference.max(1, initial=0.0) / np.maximum(bound, np.finfo(np.float64).tiny)
        return np.where(np.isfinite(ratio), ratio, np.inf)


def compute_dtype(way: Way) -> str:
    """The dtype a way computed in: bfloat16 when any captured value is (the protocol reports
    values in the compute dtype; the router's float32 scores aside), else float32."""
    return "bfloat16" if any(v.dtype == ml_dtypes.bfloat16 for v in way.values.values()) else "float32"


# ---------------------------------------------------------------------------- comparison

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(x: np.ndarray) -> np.ndarray:
    """The raw bits of a float or integer array (so NaNs and signed zeros compare exactly)."""
    return np.ascontiguousarray(x).view(_BITS[x.dtype.itemsize])


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == ml_dtypes.bfloat16 else str(dtype)


@dataclass
class PointDiff:
    """One capture point compared across the two ways: the compared tokens that differ, how
    many values differ of how many, the largest difference in ulps at its row's scale (floats;
    None for integers) and its token, and whether every input point agrees (then this op is a
    cause). Judged against the noise (module docstring): the differing tokens an expert flip
    reached, those beyond noise among the others (then worst_token is the one furthest beyond),
    their largest difference over the noise bound (floats; None when every differing token was
    reached), and the verdict."""

    key: str
    layer: int | None
    point: str
    dtype: str
    tokens: list[int]
    values: int
    size: int
    max_ulps: float | None
    worst_token: int | None
    inputs_agree: bool = True
    reached: list[int] = field(default_factory=list)
    beyond: list[int] = field(default_factory=list)
    noise_ratio: float | None = None
    verdict: str = ""          # beyond noise, rounding, routing near-tie, reached by a flip ("": equal)

    @property
    def where(self) -> str:
        return "logits" if self.layer is None else f"layer {self.layer} {self.point}"


@dataclass
class ExpertFlip:
    layer: int
    token: int
    experts_a: list[int]
    experts_b: list[int]
    gap: float | None      # way A's selection-score gap between the experts it took and B took instead


@dataclass
class Decision:
    """A greedy decision (the last prompt row and every new token) in both ways."""

    token: int
    position: int
    choice_a: int
    choice_b: int
    margin_a: float
    margin_b: float


@dataclass
class Divergence:
    a: str
    b: str
    dtype: str                       # the compute dtype whose noise judged the points
    points: list[PointDiff]          # every point both ways captured, in compute order
    first: PointDiff | None          # the first that differs bit for bit
    headline: PointDiff | None       # the first beyond noise
    flips: list[ExpertFlip]
    decisions: list[Decision]
    explanation: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def point_order(key: str) -> tuple[float, int, str]:
    """Compute order of a protocol key: layer, then the point's place in CAPTURE_POINTS."""
    if key == "logits":
        return float("inf"), 0, ""
    _, layer, point = key.split(".", 2)
    rank = LAYER_POINTS.index(point) if point in LAYER_POINTS else len(LAYER_POINTS)
    return float(layer), rank, point


def _split(key: str) -> tuple[int | None, str]:
    if key == "logits":
        return None, "logits"
    _, layer, point = key.split(".", 2)
    return int(layer), point


def compare_point(key: str, a: np.ndarray, b: np.ndarray) -> PointDiff:
    """a, b [T, ...] -> which tokens differ, bit for bit, and by how many ulps."""
    layer, point = _split(key)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{key}: the two ways captured {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    rows = len(a)
    differ = (_bits(a) != _bits(b)).reshape(rows, -1)
    tokens = np.flatnonzero(differ.any(1))
    max_ulps = worst = None
    if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
        ulps = ulps_at_scale(a, b)
        worst = int(np.argmax(ulps)) if tokens.size else None
        max_ulps = float(ulps.max(initial=0.0))
    elif tokens.size:
        worst = int(tokens[0])
    return PointDiff(key, layer, point, dtype_name(a.dtype), [int(t) for t in tokens], int(differ.sum()),
                     int(a.size), max_ulps, worst)


def _margin(row: np.ndarray) -> tuple[int, float]:
    """logits [V] -> (argmax, ties to the lower id; top-1 minus top-2)."""
    row = np.asarray(row, dtype=np.float64)
    choice = int(np.argmax(row))
    top2 = np.partition(row, -2)[-2:] if row.size > 1 else np.array([row[0], -np.inf])
    return choice, float(top2[1] - top2[0])


def compare_ways(a: Way, b: Way, router_bias: Mapping[int, np.ndarray] | None = None,
                 dtype: str | None = None) -> Divergence:
    """The first divergence, bitwise and beyond noise, between two ways of computing the same
    tokens (module docstring). router_bias[layer] [E], when given, measures how close each expert
    flip was in way A. dtype: the compute dtype whose noise judges (default: compute_dtype(a))."""
    if (a.tokens, a.positions) != (b.tokens, b.positions):
        raise ValueError(f"{a.label} and {b.label} computed different tokens or positions")
    keys = sorted((k for k in a.values if k in b.values), key=point_order)
    if not keys:
        raise ValueError("the two ways share no captured point (does the implementation report intermediates?)")
    points = [compare_point(k, a.values[k], b.values[k]) for k in keys]
    num_layers = 1 + max((p.layer for p in points if p.layer is not None), default=-1)
    _mark_causes(points, num_layers)
    noise = Noise.of(dtype or compute_dtype(a))
    _judge(points, a, b, noise, num_layers)
    first = next((p for p in points if p.tokens), None)
    headline = next((p for p in points if p.beyond), None)
    flips = _flips(a, b, router_bias or {})
    decisions = []
    if "logits" in a.values:
        for t in range(a.prompt_length - 1, len(a.tokens)):
            choice_a, margin_a = _margin(a.values["logits"][t])
            choice_b, margin_b = _margin(b.values["logits"][t])
            decisions.append(Decision(t, a.positions[t], choice_a, choice_b, margin_a, margin_b))
    divergence = Divergence(a.label, b.label, noise.dtype, points, first, headline, flips, decisions, [])
    divergence.explanation = explain(divergence, a, b)
    return divergence


def _mark_causes(points: list[PointDiff], num_layers: int) -> None:
    """Set inputs_agree on every differing point: all its INPUTS points agree (when one of them
    was not captured, or the point is not a known one: every earlier point agrees)."""
    by_key = {p.key: p for p in points}
    earlier_agree = True
    for p in points:
        if p.tokens:
            layer = num_layers if p.layer is None else p.layer
            inputs = [f"layers.{layer - 1}.layer_output" if name == "layer input" else f"layers.{layer}.{name}"
                      for name in INPUTS.get(p.point, ())]
            inputs = [k for k in inputs if not k.startswith("layers.-1.")]
            known = p.point in INPUTS and all(k in by_key for k in inputs)
            p.inputs_agree = all(not by_key[k].tokens for k in inputs) if known else earlier_agree
        earlier_agree = earlier_agree and not p.tokens


def _judge(points: list[PointDiff], a: Way, b: Way, noise: Noise, num_layers: int) -> None:
    """Set reached, beyond, noise_ratio and verdict on every differing point, in compute order
    (module docstring). A flip (other experts, not another order of the same) of token t at
    layer l reaches t's later points of layer l, and from layer l + 1 on every compared token at
    t's position or after (the compared tokens of every way are one causal sequence)."""
    positions = np.asarray(a.positions)
    flips: list[tuple[int, int]] = []                   # (layer, token) of every flip so far
    differed: set[int] = set()                          # tokens that differ at an earlier point
    scores = {p.layer: set(p.tokens) for p in points if p.point == "router_scores"}
    for p in points:
        if not p.tokens:
            continue
        layer = num_layers if p.layer is None else p.layer
        reached = np.zeros(len(positions), dtype=bool)
        for flip_layer, token in flips:
            if layer > flip_layer:
                reached |= positions >= positions[token]
            else:
                reached[token] = True
        p.reached = [t for t in p.tokens if reached[t]]
        free = [t for t in p.tokens if not reached[t]]
        near_tie = False
        if p.max_ulps is not None:
            if free:
                depth = p.layer + 1 if p.layer is not None else max(num_layers, 1)
                ratios = noise.ratios(a.values[p.key][free], b.values[p.key][free], depth)
                p.noise_ratio = float(ratios.max())
                p.beyond = [t for t, r in zip(free, ratios) if r > 1]
                p.worst_token = free[int(np.argmax(ratios))] if p.beyond else p.worst_token
        elif p.point == "experts":
            flipped = [t for t in p.tokens if set(a.values[p.key][t].tolist()) != set(b.values[p.key][t].tolist())]
            inputs = scores.get(p.layer, differed)
            p.beyond = [t for t in flipped if not reached[t] and t not in inputs]
            near_tie = len(flipped) > len(p.beyond)
            flips += [(layer, t) for t in flipped]
        else:
            p.beyond = free
        if p.beyond and p.max_ulps is None:
            p.worst_token = p.beyond[0]
        p.verdict = ("beyond noise" if p.beyond else "reached by a flip" if not free else
                     "routing near-tie" if near_tie else "rounding")
        differed |= set(p.tokens)


def _flips(a: Way, b: Way, router_bias: Mapping[int, np.ndarray]) -> list[ExpertFlip]:
    flips = []
    for key in sorted((k for k in a.values if k.endswith(".experts") and k in b.values), key=point_order):
        layer = int(key.split(".")[1])
        for t in range(len(a.tokens)):
            ea, eb = sorted(a.values[key][t].tolist()), sorted(b.values[key][t].tolist())
            if ea == eb:
                continue
            gap = None
            scores = a.values.get(f"layers.{layer}.router_scores")
            if scores is not None and layer in router_bias:
                selection = np.asarray(scores[t], dtype=np.float64) + np.asarray(router_bias[layer], dtype=np.float64)
                only_a, only_b = set(ea) - set(eb), set(eb) - set(ea)
                gap = float(min(selection[list(only_a)]) - max(selection[list(only_b)]))
            flips.append(ExpertFlip(layer, t, ea, eb, gap))
    return flips


# ---------------------------------------------------------------------------- explanation

def explain(d: Divergence, a: Way, b: Way) -> list[str]:
    """The finding in sentences: the headline (the first op beyond noise) or, without one, the
    first op that is not invariant, why it is the cause, its token, ulps, rows, keys or experts;
    the rounding before the headline; the flips downstream; the decisions."""
    total = sum(p.size for p in d.points)
    if d.first is None:
        return [f"no divergence: all {len(d.points)} captured points ({total} values) are bitwise equal in "
                f"{a.label} and {b.label}"]
    p = d.headline or d.first
    if d.headline is not None:
        lines = [f"first divergence beyond {d.dtype} noise: {p.where} ({_op(p)})"]
        before = [q for q in d.points[:d.points.index(p)] if q.tokens and q.inputs_agree]
    else:
        reached = " or on rows an expert-selection near-tie reached" if any(q.reached for q in d.points) else ""
        lines = [f"no divergence beyond {d.dtype} noise: every difference is rounding (within twice the {d.dtype} "
                 f"tolerance{reached})",
                 f"first bitwise divergence: {p.where} ({_op(p)})"]
        before = []
    t = p.worst_token
    lines.append(_cause(p, p is d.first, t, d.dtype, a, b))
    differing = f"{len(p.beyond)} token(s) beyond noise, first token {p.beyond[0]}" if p.beyond else \
        f"{len(p.tokens)} token(s) differ, first token {p.tokens[0]}"
    first_token = p.beyond[0] if p.beyond else p.tokens[0]
    ulps = f", up to {p.max_ulps:.3g} ulp ({p.dtype}, at the row's scale)" if p.max_ulps is not None else ""
    multiple = f", {p.noise_ratio:.2g} x the noise" if p.noise_ratio is not None else ""
    lines.append(f"{differing} (position {a.positions[first_token]}); {p.values} of {p.size} values{ulps}{multiple}, "
                 f"worst at token {t} (position {a.positions[t]})")
    if before:
        lines.append("within noise before it: " + _list(before, lambda q: f"{q.where} ({_size(q)})") +
                     ": rounding, ops that are not row-count invariant")
    others = [q for q in d.points if q.tokens and q.inputs_agree and q is not p and q not in before]
    if others:
        lines.append("also differing with equal inputs (further causes): " + _list(others, lambda q: q.where))
    if p.point == "o_lat":
        lines.append(f"keys: token {t} sees {a.keys[t]} keys; its attention call spans {a.slots[t]} slots with "
                     f"{a.rows[t]} query rows in {a.label}, {b.slots[t]} slots with {b.rows[t]} in {b.label}")
    if p.point == "ffn_output" and f"layers.{p.layer}.experts" in a.values:
        experts = sorted(a.values[f"layers.{p.layer}.experts"][t].tolist())
        load = ""
        if p.layer in a.expert_counts and p.layer in b.expert_counts:
            load = "; rows each computed: " + ", ".join(
                f"expert {e}: {int(a.expert_counts[p.layer][t][e])} vs {int(b.expert_counts[p.layer][t][e])}"
                for e in experts)
        lines.append(f"experts of token {t}: {experts} and the shared expert{load}")
    if d.flips:
        f = d.flips[0]
        gap = f" (way A's selection gap {f.gap:.3g})" if f.gap is not None else ""
        lines.append(f"{len(d.flips)} expert selection(s) flip downstream; first at layer {f.layer} token {f.token}: "
                     f"{f.experts_a} vs {f.experts_b}{gap}")
    logits = next((q for q in d.points if q.key == "logits"), None)
    if logits is not None and logits.tokens:
        lines.append(f"logits differ at {len(logits.tokens)} of {len(a.tokens)} tokens, up to {logits.max_ulps:.3g} "
                     f"ulp ({logits.dtype})")
    flipped = [c for c in d.decisions if c.choice_a != c.choice_b]
    if flipped:
        c = flipped[0]
        lines.append(f"{len(flipped)} greedy choice(s) differ; first at token {c.token} (position {c.position}): "
                     f"{a.label} chose {c.choice_a} (margin {c.margin_a:.3g}), {b.label} {c.choice_b} "
                     f"(margin {c.margin_b:.3g})")
    elif d.decisions:
        c = min(d.decisions, key=lambda c: c.margin_a)
        lines.append(f"every greedy choice agrees; the smallest margin is {c.margin_a:.3g} at token {c.token}")
    return lines


def _cause(p: PointDiff, bitwise: bool, t: int, dtype: str, a: Way, b: Way) -> str:
    """Why the op at `p` is the cause, and the calls that ran it for token t."""
    if (a.rows[t], a.batch[t], a.slots[t]) == (b.rows[t], b.batch[t], b.slots[t]):
        return (f"token {t} was computed by the same call in both ways (M = {a.rows[t]}, batch {a.batch[t]}, "
                f"{a.slots[t]} slots): the implementation is not deterministic run to run")
    calls = f"{a.label} ran it with M = {a.rows[t]} (batch {a.batch[t]}), {b.label} with M = {b.rows[t]} " \
            f"(batch {b.batch[t]})"
    if bitwise:
        return f"every earlier point is bitwise equal, so this op returned different bits for the same inputs: {calls}"
    return f"every earlier point agrees within {dtype} noise, so this op, not the rounding before it, computes " \
           f"something else: {calls}"


def _op(p: PointDiff) -> str:
    return OPS.get(p.point, "an implementation-defined point")


def _size(p: PointDiff) -> str:
    multiple = f", {p.noise_ratio:.2g} x noise" if p.noise_ratio is not None else ""
    return f"{p.max_ulps:.3g} ulp{multiple}" if p.max_ulps is not None else f"{len(p.tokens)} token(s)"


def _list(points: list[PointDiff], name: Any, shown: int = 8) -> str:
    more = f" and {len(points) - shown} more" if len(points) > shown else ""
    return ", ".join(name(q) for q in points[:shown]) + more
