"""The adapter protocol (v1): how `kdtree validate` drives an implementation under test.

An adapter wraps one engine (the built-in torch engine, a C++ or vendor engine
behind Python bindings, ...) in a few plain methods on numpy arrays, one
request at a time, grouped in capabilities. docs/adapter.md is the user's
guide; docs/examples/numpy_adapter.py a worked example.

Capabilities and their methods (shapes: n tree or new tokens, N = n + 1 tree
tokens, V vocab, L depths, K = min(k, V) top-k width, S cache rows, H heads,
R kv_lora, dr d_rope, a accepted nodes):

- model: ``load_weights(config: ModelConfig, weights: dict[str, np.ndarray])``
  (names as docs/fixtures.md, float32, torch layout [out, in]);
  ``reset(max_len: int)`` (an empty cache of max_len slots);
  ``forward(tokens [n] int64, positions [n] int64, visibility [n, start+n] bool, start: int)
  -> logits [n, V] float``. Token i writes its KV at the adapter's own cache slot
  start + i and sees slot s iff visibility[i, s]. The harness always makes every
  cached slot (s < start) visible and restates the committed path with a causal
  forward after each verify, so an adapter needs no compaction of its own cache.
- topk: ``topk_logprobs(draft_logits [L, V] float32, k: int) -> (topk_lp float32 [L, K], topk_id int [L, K])``.
- tree: ``build_tree(topk_lp [L, K] float32, topk_id [L, K] int64, budget: int, root: int)
  -> (parents [N], tokens [N], depths [N])`` int, pop order, parents[0] = -1,
  tokens[0] = root; optionally a fourth item, scores float64 [N], compared bit for bit.
- compile: ``compile_tree(parents [N], depths [N], start: int) -> (positions [N],
  visibility_bits uint32 [N, ceil(N/32)], first_child [N], next_sibling [N])``.
- accept: ``accept(parents [N], tokens [N], choices [N]) -> (accepted [a] int, next_root: int)``.
- sample_accept: ``sample_accept(parents [N], tokens [N], logits [N, V] float64, temperature: float,
  uniforms [N] float64) -> (choices [N] int, accepted [a] int, next_root: int)``: node i's choice
  is the smallest token id whose cumulative probability under softmax(logits[i] / temperature),
  summed over ids in increasing order in float64, exceeds uniforms[i] (capped at the largest id of
  nonzero probability), then the accept walk over those choices. A token of probability 0 is never
  chosen. Checked token for token against the fixtures' sampled traces and adversarial cases.
- compact: ``compact(c_kv [S, R], k_pe [S, dr], start: int, accepted [a]) -> (c_kv, k_pe)``:
  row start + k <- row start + accepted[k]; other rows unchanged.
- attention: ``attention(q_lat [n, H, R], q_pe [n, H, dr], c_kv [S, R], k_pe [S, dr],
  visibility [n, S] bool, scale: float) -> o_lat [n, H, R]`` (the tree-verify kernel;
  the last n rows of c_kv / k_pe are the tree tokens, every earlier row is visible).
- paged_attention, paged_compact: protocol 2 only (protocol_v2.py; verify attention and
  compaction through a block table). A v1 adapter is handed one request's numpy arrays
  and has no pages: it cannot declare them, and their rows are skipped for it.
- known deviations (optional, any adapter): ``deviations() -> list[Deviation]``, where the
  engine differs from the reference on purpose; noted on the rows named, never changing a
  verdict (judging/deviations.py).
- intermediates (optional, any adapter with a model): ``intermediates(tokens, positions,
  visibility, start) -> dict[str, array]``: everything `forward` does (the same cache
  writes), returning per new token the values at the capture points (engine/model.py
  CAPTURE_POINTS), keyed ``"layers.{i}.{point}"`` ([n, ...], one row per token: attn_input,
  q_lat, c_kv, k_pe, o_lat, attn_output, attn_residual, router_scores, experts (int, [n, k]),
  ffn_output, layer_output) and ``"logits"`` [n, V], in the compute dtype (bfloat16 as
  ml_dtypes.bfloat16); optionally ``"layers.{i}.expert_counts"`` [E] (rows each expert
  computed in this call). Any subset of points may be given; ``logits`` is required.
  `kdtree diverge` compares them point by point; `kdtree validate --dtype bfloat16` reads
  ``logits`` and ``layers.{i}.experts`` to tell routing flips at a near-tie from routing
  bugs (docs/precision.md).
- precision (optional): ``set_dtype(dtype: str)`` with "float32" or "bfloat16", called once
  before `load_weights` whenever the adapter defines it: the adapter computes in that dtype
  from then on (weights still arrive as float32 arrays; for the bf16 cases they hold bf16
  values exactly). `kdtree validate --dtype bfloat16` needs it; an adapter that cannot
  compute in the dtype raises ValueError (reported as one line). Without it an adapter is
  validated in float32.

Declaring capabilities. An adapter may say what it implements with a
``capabilities`` attribute (a collection of the names above); validate then
requires each of them: a declared capability with a missing method is an error,
and one that no fixture exercised is a FAIL. Without a declaration, what the
adapter implements (every method of a capability defined) is what is required.
A capability with some of its methods but not all is an error unless the
adapter declares capabilities and leaves it out; an adapter that implements no
capability is an error. ``kdtree validate --require CAPS`` replaces the
requirement (`resolve_capabilities`).

Outputs. `METHODS` declares every method's outputs: how many, each one's dtype
class, shape (dims named from the call's inputs, or bound by the first output
that uses them) and whether it must be finite. `checked.CheckedAdapter` holds
every call to that declaration before any comparison sees the result, so the
model, stage and kernel checks, and any check added later, compare only
well-formed outputs; a call that raises or returns something else is one FAIL
row naming the method and the output.

Protocol v2 (protocol_v2.py: batched, torch tensors on the adapter's device, the
adapter's own cache and compaction) is chosen by an adapter's ``protocol = 2``; its
adapters reach the same checks through `protocol_v2.PerRequest`, so the runner takes
one code path for every adapter. The built-in engine (`engine.adapter.TorchAdapter`)
speaks v2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Protocol

import numpy as np

from kdtr_format import ModelConfig

from ..reports.report import ValidateError
from .guard import adapter_name, attribute

CAPABILITIES: dict[str, tuple[str, ...]] = {
    "model": ("load_weights", "reset", "forward"),
    "topk": ("topk_logprobs",),
    "tree": ("build_tree",),
    "compile": ("compile_tree",),
    "accept": ("accept",),
    "sample_accept": ("sample_accept",),
    "compact": ("compact",),
    "attention": ("attention",),
    "paged_attention": (),           # protocol 2 only: no v1 methods
    "paged_compact": (),
}


@dataclass(frozen=True)
class Output:
    """One declared output. kind: "int" (any integer dtype, not bool), "float" (any floating
    dtype, bfloat16 included), "float32", "float64", "words" (uint32 or int32 bit words);
    shape: dims, each an int or a name (from the call's inputs, else bound by the first
    output that uses it; () for a scalar); finite: NaN is always refused, +-inf too when set."""

    name: str
    kind: str
    shape: tuple[int | str, ...]
    finite: bool = True


@dataclass(frozen=True)
class Method:
    """A protocol method: its capability, its outputs (a bare value when there is one, a tuple
    otherwise; the last `optional` may be left out), and the dims its inputs fix."""

    capability: str
    outputs: tuple[Output, ...]
    dims: Callable[..., dict[str, int]]
    optional: int = 0


def _tree_tokens(parents, *rest) -> dict[str, int]:
    return {"N": len(parents)}


METHODS: dict[str, Method] = {
    "load_weights": Method("model", (), lambda *args: {}),
    "reset": Method("model", (), lambda *args: {}),
    "forward": Method("model", (Output("logits", "float", ("n", "V")),),
                      lambda tokens, positions, visibility, start: {"n": len(tokens)}),
    "topk_logprobs": Method("topk", (Output("topk_lp", "float32", ("L", "K"), finite=False),
                                     Output("topk_id", "int", ("L", "K"))),
                            lambda draft_logits, k: {"L": draft_logits.shape[0],
                                                     "K": min(int(k), draft_logits.shape[1])}),
    "build_tree": Method("tree", (Output("parents", "int", ("N",)), Output("tokens", "int", ("N",)),
                                  Output("depths", "int", ("N",)),
                                  Output("scores", "float64", ("N",), finite=False)),
                         lambda *args: {}, optional=1),
    "compile_tree": Method("compile", (Output("positions", "int", ("N",)),
                                       Output("visibility_bits", "words", ("N", "W")),
                                       Output("first_child", "int", ("N",)),
                                       Output("next_sibling", "int", ("N",))),
                           lambda parents, depths, start: {"N": len(parents), "W": math.ceil(len(parents) / 32)}),
    "accept": Method("accept", (Output("accepted", "int", ("a",)), Output("next_root", "int", ())),
                     _tree_tokens),
    "sample_accept": Method("sample_accept", (Output("choices", "int", ("N",)), Output("accepted", "int", ("a",)),
                                              Output("next_root", "int", ())),
                            _tree_tokens),
    "compact": Method("compact", (Output("c_kv", "float", ("S", "R")), Output("k_pe", "float", ("S", "dr"))),
                      lambda c_kv, k_pe, start, accepted: {"S": c_kv.shape[0], "R": c_kv.shape[1],
                                                           "dr": k_pe.shape[1]}),
    "attention": Method("attention", (Output("o_lat", "float", ("n", "H", "R")),),
                        lambda q_lat, *rest: dict(zip(("n", "H", "R"), q_lat.shape))),
}


class EngineAdapter(Protocol):
    """The full protocol (module docstring); an adapter may implement any subset of capabilities."""

    name: str
    capabilities: Collection[str]

    def load_weights(self, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None: ...

    def reset(self, max_len: int) -> None: ...

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                start: int) -> np.ndarray: ...

    def topk_logprobs(self, draft_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def build_tree(self, topk_lp: np.ndarray, topk_id: np.ndarray, budget: int,
                   root: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def compile_tree(self, parents: np.ndarray, depths: np.ndarray,
                     start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...

    def accept(self, parents: np.ndarray, tokens: np.ndarray,
               choices: np.ndarray) -> tuple[np.ndarray, int]: ...

    def sample_accept(self, parents: np.ndarray, tokens: np.ndarray, logits: np.ndarray, temperature: float,
                      uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]: ...

    def compact(self, c_kv: np.ndarray, k_pe: np.ndarray, start: int,
                accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def attention(self, q_lat: np.ndarray, q_pe: np.ndarray, c_kv: np.ndarray, k_pe: np.ndarray,
                  visibility: np.ndarray, scale: float) -> np.ndarray: ...

    def intermediates(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                      start: int) -> dict[str, np.ndarray]: ...

    def set_dtype(self, dtype: str) -> None: ...


def protocol_version(adapter: Any) -> int:
    """The adapter's `protocol` attribute: 1 (this module, the default) or 2 (protocol_v2.py)."""
    version = attribute(adapter, "protocol", 1)
    if isinstance(version, bool) or version not in (1, 2):
        raise ValidateError(f"adapter {adapter_name(adapter)}: `protocol` must be 1 or 2, got {version!r}")
    return version


def implemented(adapter: Any, table: Mapping[str, tuple[str, ...]]) -> set[str]:
    """The capabilities of `table` whose every method the adapter defines (one with no methods: none)."""
    return {cap for cap in table if table[cap] and not missing_methods(adapter, cap, table)}


def missing_methods(adapter: Any, capability: str, table: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The methods of `capability` in `table` that the adapter does not define."""
    return [m for m in table[capability] if not callable(attribute(adapter, m))]
