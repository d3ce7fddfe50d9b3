"""The divergence finder (`kdtree diverge`): the first op at which two ways of computing the
same tokens stop agreeing bit for bit.

In exact arithmetic a token's logits depend only on the token, its position
and the keys it sees, so DDTree greedy equals AR greedy. An engine computes the
same token in different calls: in an AR decode step it is the only row
(M = 1); in a tree verify it is one of n + 1 rows beside nodes it cannot see;
in a batch it shares every matrix product with other requests. Where a
kernel's reduction order (a matmul's split, an attention's key blocking, an
expert's batch) depends on those surroundings, the results differ in the last
bits, and near a tie a greedy choice or an expert selection flips.

The ways, each teacher-forced on the same tokens after the same prompt:

- decode: the prompt's prefill, then one forward per token (M = 1): AR.
- chunk: the prompt's prefill, then every token in one causal forward
  (M = n): the verify of an accepted path, or a prefill chunk.
- tree: the prompt's prefill, then a whole tree in one forward (M = n + 1,
  ancestor-only mask); the compared rows are one root-to-node path, whose
  decode counterpart is the path's tokens one at a time.
- batch (built-in engine only): decode alone against decode in a ragged batch
  with other requests (prefill included).

How the first divergence is found. The capture points (engine/model.py
CAPTURE_POINTS: attn_input, q_lat, c_kv, k_pe, o_lat, attn_output,
attn_residual, router_scores, experts, ffn_output, layer_output per layer, then
logits) are compared in that order, layer by layer, every token at once. A
point's inputs come earlier in this order: its own token's earlier points, and
the c_kv / k_pe of the keys it sees, which precede o_lat. So at the first point where any token
differs, every input is bitwise equal in both ways: the op producing it
returned different bits for the same inputs. That op is the cause, everything
after it may be a consequence. The finder names it, the token, the ulps (in the
captured dtype), the rows (M) of both calls, the keys (attention) or the
experts and their batch sizes (MoE) involved, the expert selections that flip
downstream, and each decision's greedy choice and top-1/top-2 margin in both
ways.

Why invariance removes the divergence: the same order is an induction. If
every op returns the same bits for the same inputs whatever M, the masked
slots and the batch (batch-invariant kernels), the first point cannot differ,
hence no point does: the logits and the greedy choices are equal bit for bit,
and DDTree greedy == AR greedy by construction. On such an engine the finder
reports no divergence; on any other it names the first op that is not
invariant.

Implementations come through the validation protocol: `model` plus the
optional `intermediates` capability (engine/validate/protocol.py), one request at
a time (a protocol 2 adapter through its per-request view); the built-in engine is
`TorchAdapter`, whose `intermediates` reads `Transformer.capture`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
import torch

from .capture import capturing
from .model import CAPTURE_POINTS, Transformer
from .validate.protocol_v2 import per_request

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

# ---------------------------------------------------------------------------- ulps

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


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(x: np.ndarray) -> np.ndarray:
    """The raw bits of a float or integer array (so NaNs and signed zeros compare exactly)."""
    return np.ascontiguousarray(x).view(_BITS[x.dtype.itemsize])


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == ml_dtypes.bfloat16 else str(dtype)


# ---------------------------------------------------------------------------- ways

@dataclass
class Way:
    """One way of computing the compared tokens. Per compared token, in order (prompt first):
    its position, the rows (M) of the forward that computed it, the requests in that forward,
    the keys it sees and the cache slots its forward spans; values[key] [T, ...] holds every
    captured point (protocol keys), expert_counts[layer] [T, E] the rows each expert computed
    in the token's forward (when the implementation says)."""

    label: str
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    expert_counts: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, out: Mapping[str, np.ndarray], select: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
            visibility: np.ndarray, slots: int, batch: int = 1) -> None:
        """One forward's intermediates `out` (rows = its new tokens); keep rows `select`."""
        self.tokens += [int(t) for t in tokens[select]]
        self.positions += [int(p) for p in positions[select]]
        self.rows += [len(tokens)] * len(select)
        self.batch += [batch] * len(select)
        self.keys += [int(k) for k in visibility[select].sum(1)]
        self.slots += [slots] * len(select)
        for key, value in out.items():
            if key.endswith(".expert_counts"):
                layer = int(key.split(".")[1])
                counts = np.repeat(np.asarray(value)[None], len(select), axis=0)
                self.expert_counts[layer] = _append(self.expert_counts.get(layer), counts)
            else:
                self.values[key] = _append(self.values.get(key), np.asarray(value)[select])


def _append(old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    return new if old is None else np.concatenate([old, new])


def _prefill(adapter: Any, way: Way, prompt: np.ndarray) -> np.ndarray:
    m = len(prompt)
    causal = np.tri(m, dtype=bool)
    out = adapter.intermediates(prompt, np.arange(m), causal, 0)
    way.add(out, np.arange(m), prompt, np.arange(m), causal, m)
    return out["logits"]


def decode_way(adapter: Any, prompt: Sequence[int], tokens: Sequence[int] | None, count: int = 0,
               max_len: int | None = None) -> Way:
    """The prompt's prefill, then one forward per token: `tokens` teacher-forced, or (tokens None)
    `count` greedy tokens, the first being the prefill's argmax."""
    prompt = np.asarray(prompt, dtype=np.int64)
    m = len(prompt)
    count = len(tokens) if tokens is not None else count
    adapter = per_request(adapter)
    adapter.reset(max_len or m + count)
    way = Way("AR decode", m)
    logits = _prefill(adapter, way, prompt)
    for k in range(count):
        token = int(tokens[k]) if tokens is not None else int(np.argmax(np.asarray(logits[-1], dtype=np.float64)))
        start = m + k
        step = np.array([token]), np.array([start]), np.ones((1, start + 1), dtype=bool)
        out = adapter.intermediates(*step, start)
        way.add(out, np.arange(1), *step, start + 1)
        logits = out["logits"]
    return way


def chunk_way(adapter: Any, prompt: Sequence[int], tokens: Sequence[int], max_len: int | None = None) -> Way:
    """The prompt's prefill, then every token in one causal forward (M = len(tokens)): a tree that
    is one chain, every row compared."""
    n = len(tokens)
    return _tree_forward(adapter, prompt, tokens, np.arange(n) - 1, np.arange(n), f"chunk of {n} rows", max_len)


def tree_visibility(parents: Sequence[int]) -> np.ndarray:
    """parents [n+1] (parents[0] = -1, parents before children) -> bool [n+1, n+1]: j is i or its ancestor."""
    size = len(parents)
    visibility = np.eye(size, dtype=bool)
    for i in range(1, size):
        visibility[i] |= visibility[parents[i]]
    return visibility


def tree_way(adapter: Any, prompt: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
             path: Sequence[int], max_len: int | None = None) -> Way:
    """The prompt's prefill, then the whole tree in one forward; the rows of `path` (node indices,
    root first) are compared. Its decode counterpart: decode_way(prompt, tree_tokens[path])."""
    return _tree_forward(adapter, prompt, tree_tokens, parents, path, f"tree verify of {len(tree_tokens)} rows",
                         max_len)


def _tree_forward(adapter: Any, prompt: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
                  rows: Sequence[int], label: str, max_len: int | None) -> Way:
    """The prompt's prefill, then the tree (parents [n], -1 for a root) in one forward, at
    positions prompt length + depth; `rows` compared."""
    prompt, tree_tokens = np.asarray(prompt, dtype=np.int64), np.asarray(tree_tokens, dtype=np.int64)
    m, size = len(prompt), len(tree_tokens)
    adapter = per_request(adapter)
    adapter.reset(max_len or m + size)
    way = Way(label, m)
    _prefill(adapter, way, prompt)
    tree = tree_visibility(parents)
    positions = m + tree.sum(1) - 1
    visibility = np.concatenate([np.ones((size, m), dtype=bool), tree], axis=1)
    out = adapter.intermediates(tree_tokens, positions, visibility, m)
    way.add(out, np.asarray(rows), tree_tokens, positions, visibility, m + size)
    return way


def batch_way(model: Transformer, prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]],
              request: int = 0) -> Way:
    """Every request's prompt prefilled in one ragged forward, then one batched decode step per
    token (each request teacher-forced on its own tokens; one that has none left sits out);
    request `request`'s rows are kept. The built-in engine only (it batches the model itself)."""
    device = model.device
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    steps = max(len(t) for t in tokens)
    cache = model.new_cache(batch, max(lengths) + steps)
    width = max(lengths)
    grid = torch.zeros(batch, width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        grid[b, :len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(batch, width, width)
    way = Way(f"batch of {batch} requests", lengths[request])
    calls = [(grid, torch.arange(width).expand(batch, width), causal, torch.tensor(lengths),
              torch.zeros(batch, dtype=torch.int64))]
    for k in range(steps):
        alive = [k < len(t) for t in tokens]
        step = torch.tensor([[int(t[k]) if a else 0] for t, a in zip(tokens, alive)])
        starts = torch.tensor([m + k for m in lengths])
        calls.append((step, starts[:, None], torch.ones(batch, 1, 1, dtype=torch.bool),
                      torch.tensor([int(a) for a in alive]), starts))
    for call_tokens, positions, visibility, n_new, starts in calls:
        with capturing(model, n_new.tolist(), request) as captured:
            model.forward(*(t.to(device) for t in (call_tokens, positions, visibility.contiguous(), n_new, starts)),
                          cache)
        n, start = int(n_new[request]), int(starts[request])
        counts = {f"layers.{layer}.expert_counts": c for layer, c in captured.expert_counts.items()}
        mine = visibility[request, :n, :n].numpy()
        seen = np.concatenate([np.ones((n, start), dtype=bool), mine], axis=1)
        way.add({**captured.values, **counts}, np.arange(n), call_tokens[request, :n].numpy(),
                positions[request, :n].numpy(), seen, int((starts + n_new).max()), batch=int((n_new > 0).sum()))
    return way


# ---------------------------------------------------------------------------- comparison

@dataclass
class PointDiff:
    """One capture point compared across the two ways: the compared tokens that differ, how
    many values differ of how many, the largest difference in ulps at its row's scale (floats;
    None for integers), and whether every input point agrees (then this op is a cause)."""

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
    points: list[PointDiff]          # every point both ways captured, in compute order
    first: PointDiff | None
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


def compare_ways(a: Way, b: Way, router_bias: Mapping[int, np.ndarray] | None = None) -> Divergence:
    """The first divergence between two ways of computing the same tokens (module docstring).
    router_bias[layer] [E], when given, measures how close each expert flip was in way A."""
    if (a.tokens, a.positions) != (b.tokens, b.positions):
        raise ValueError(f"{a.label} and {b.label} computed different tokens or positions")
    keys = sorted((k for k in a.values if k in b.values), key=point_order)
    if not keys:
        raise ValueError("the two ways share no captured point (does the implementation report intermediates?)")
    points = [compare_point(k, a.values[k], b.values[k]) for k in keys]
    _mark_causes(points, num_layers=1 + max((p.layer for p in points if p.layer is not None), default=-1))
    first = next((p for p in points if p.tokens), None)
    flips = _flips(a, b, router_bias or {})
    decisions = []
    if "logits" in a.values:
        for t in range(a.prompt_length - 1, len(a.tokens)):
            choice_a, margin_a = _margin(a.values["logits"][t])
            choice_b, margin_b = _margin(b.values["logits"][t])
            decisions.append(Decision(t, a.positions[t], choice_a, choice_b, margin_a, margin_b))
    divergence = Divergence(a.label, b.label, points, first, flips, decisions, [])
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
    """The finding in sentences: the first op and why it is the cause, its token, ulps, rows,
    keys or experts; the flips downstream; the decisions."""
    total = sum(p.size for p in d.points)
    if d.first is None:
        return [f"no divergence: all {len(d.points)} captured points ({total} values) are bitwise equal in "
                f"{a.label} and {b.label}"]
    p = d.first
    t = p.worst_token
    where = f"layer {p.layer} {p.point}" if p.layer is not None else "logits"
    lines = [f"first divergence: {where} ({OPS.get(p.point, 'an implementation-defined point')})"]
    same_call = (a.rows[t], a.batch[t], a.slots[t]) == (b.rows[t], b.batch[t], b.slots[t])
    if same_call:
        lines.append(f"token {t} was computed by the same call in both ways (M = {a.rows[t]}, batch {a.batch[t]}, "
                     f"{a.slots[t]} slots): the implementation is not deterministic run to run")
    else:
        lines.append(f"every earlier point is bitwise equal, so this op returned different bits for the same "
                     f"inputs: {a.label} ran it with M = {a.rows[t]} (batch {a.batch[t]}), "
                     f"{b.label} with M = {b.rows[t]} (batch {b.batch[t]})")
    ulps = f", up to {p.max_ulps:.3g} ulp ({p.dtype}, at the row's scale)" if p.max_ulps is not None else ""
    lines.append(f"{len(p.tokens)} token(s) differ, first token {p.tokens[0]} (position {a.positions[p.tokens[0]]}); "
                 f"{p.values} of {p.size} values{ulps}, worst at token {t} (position {a.positions[t]})")
    others = [q for q in d.points if q.tokens and q.inputs_agree and q is not p]
    if others:
        lines.append("also differing with equal inputs (further causes): " +
                     ", ".join(f"layer {q.layer} {q.point}" if q.layer is not None else "logits" for q in others[:8]) +
                     (f" and {len(others) - 8} more" if len(others) > 8 else ""))
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
