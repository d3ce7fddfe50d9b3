"""The adapter protocol, version 2: batched, on torch tensors on the adapter's device.

This docstring is the normative description; docs/adapter.md is the user's guide and
docs/examples/torch_v2_adapter.py a worked example. Protocol v1 (protocol.py) hands an
adapter one request at a time in numpy; v2 hands it what a serving engine sees: a ragged
batch of requests with different contexts and tree sizes, bit-packed visibility, and a
KV cache that is the adapter's own (paged or contiguous, on its device), compacted by
the adapter itself.

An adapter speaks v2 when it has ``protocol = 2`` and a ``device`` attribute (a
torch.device or its name). Every tensor the runner passes is on that device, and every
tensor the adapter returns must be there too: a numpy array, a tensor elsewhere, a wrong
dtype class, shape or ragged offsets, a NaN, is a FAIL naming the method and the output
(checked.CheckedV2, from the declarations in `METHODS_V2`). Nothing in the protocol
needs a host copy: sizes are known from the inputs' shapes and offsets.

Ragged layout. A batch of B requests keeps its rows flat and finds request b's rows
with offsets, int64 [B+1], offsets[0] = 0, non-decreasing: request b owns rows
offsets[b] .. offsets[b+1]. Indices inside a request's rows (parents, accepted nodes,
first_child, ...) count from that request's first row. Visibility rows are bit-packed
uint32 words (int32 holds the same bits): bit j % 32 of word j // 32 of a row is set
when the row sees its own request's token j; W = ceil(widest request / 32) words,
those past a request's size zero.

Capabilities and their methods (T new tokens, N tree nodes, A accepted nodes, V vocab,
L depths, K = min(k, V), S cache rows, P pages of `page` slots, H heads, R kv_lora,
dr d_rope):

- model: ``load_weights(config: ModelConfig, weights: dict[str, Tensor])`` (names as
  docs/fixtures.md, float32 on the device, layout [out, in]);
  ``reset(batch: int, max_len: int)`` (an empty cache of `batch` requests of max_len
  slots each); ``forward(tokens [T] int64, positions [T] int64, offsets [B+1],
  starts [B] int64, visibility_bits int32 [T, W]) -> logits float [T, V]``: request b's
  new tokens are rows offsets[b] .. offsets[b+1] (none: it sits this call out); its i-th
  writes its KV at the request's slot starts[b] + i and sees every slot below starts[b]
  and its request's new token j where its row's bit j is set. ``starts[b]`` is the
  request's committed length: what its slots at or past it held is stale, to overwrite
  or ignore, never to read. ``compact_cache(starts [B], accepted [A] int64,
  accept_offsets [B+1])``: request b's path p (its rows of accepted: node indices of
  the tree its last forward wrote at starts[b], p[0] = 0, increasing) moves in the
  adapter's own cache, every layer: slot starts[b] + k <- slot starts[b] + p[k];
  afterwards the request holds starts[b] + len(p) committed tokens and the rejected
  nodes' KV must never be seen again. A request with an empty path is untouched.
- topk: ``topk_logprobs(draft_logits [B, L, V] float32, k: int) -> (topk_lp float32
  [B, L, K], topk_id int [B, L, K])`` (one L and one k for the batch, as a serving
  engine's block size and width).
- tree: ``build_trees(topk_lp float32 [B, L, K], topk_id int64 [B, L, K], budgets [B],
  roots [B]) -> (node_offsets [B+1], parents [N], tokens [N], depths [N][, scores
  float64 [N]])``: request b's tree in pop order, parents[first] = -1, tokens[first] =
  roots[b]; scores, when returned, are compared bit for bit.
- compile: ``compile_trees(parents [N], depths [N], node_offsets [B+1], starts [B])
  -> (positions [N], visibility_bits [N, W], first_child [N], next_sibling [N])``.
- accept: ``accept(parents [N], tokens [N], choices [N], node_offsets [B+1]) ->
  (accepted [A], accept_offsets [B+1], next_roots [B])``.
- sample_accept: ``sample_accept(parents [N], tokens [N], logits float64 [N, V],
  node_offsets [B+1], temperature: float, uniforms float64 [N]) -> (choices [N],
  accepted [A], accept_offsets [B+1], next_roots [B])``: v1's inverse-CDF rule per node.
- compact: ``compact(c_kv [B, S, R], k_pe [B, S, dr], starts [B], accepted [A],
  accept_offsets [B+1]) -> (c_kv, k_pe)``: the compaction kernel on one layer's tensors
  the runner gives (in place or on copies), as compact_cache moves the adapter's own.
- attention: ``attention(q_lat [T, H, R], q_pe [T, H, dr], c_kv [S, R], k_pe [S, dr],
  q_offsets [B+1], kv_offsets [B], contexts [B], visibility_bits int32 [T, W], scale:
  float) -> o_lat [T, H, R]``: request b's queries are rows q_offsets[b] ..
  q_offsets[b+1], its keys rows kv_offsets[b] .. kv_offsets[b] + contexts[b] + n_b (its
  context, then its n_b tree tokens); a query sees every context key and the tree keys
  its bits name.
- paged_attention: ``paged_attention(q_lat [T, H, R], q_pe [T, H, dr], c_kv_pages [P, page,
  R], k_pe_pages [P, page, dr], block_table int32 [B, W], q_offsets [B+1], contexts [B],
  visibility_bits int32 [T, W'], scale: float) -> o_lat [T, H, R]``: attention's keys kept
  in pages, as vLLM, SGLang and FlashMLA keep them. Request b's key slot s is row s % page
  of page block_table[b, s // page]; its keys are its contexts[b] cached slots, then its
  n_b tree tokens at slots contexts[b] .. contexts[b] + n_b - 1; entries past its last page
  are -1 (never to be read). Requests may share pages (a common prompt prefix).
- paged_compact: ``paged_compact(c_kv_pages [P, page, R], k_pe_pages [P, page, dr],
  block_table int32 [B, W], starts [B], accepted [A], accept_offsets [B+1]) ->
  (c_kv_pages, k_pe_pages)``: compact's move through the table (in place or on copies):
  request b's slot starts[b] + k <- its slot starts[b] + p[k]. Nothing else of either pool
  may change: not a page another request holds (a shared page holds context only, below
  every sharer's start), not a page no request holds.
- known deviations (optional): ``deviations() -> list[Deviation]``, as v1.

Declarations (``capabilities``, ``--require``) and names are v1's (protocol.py); the
paged capabilities are protocol 2's alone.

How the runner takes both versions through one set of checks. A v1 adapter holds one
request's cache, so it cannot be batched by looping; a v2 adapter can run any request
alone as a batch of one. So the checks of every stage, every kernel case and every
replayed trace round are written once, per request, against v1 (rows/model.py,
rows/kernel.py, rows/corpus.py), and a v2 adapter reaches them through `PerRequest`,
which turns each v1 call into a v2 call on a batch of one. Each call is checked twice,
once per boundary: the v2 outputs against `METHODS_V2` (device, dtype, shape, offsets,
finiteness) before `PerRequest` copies them to numpy, then the numpy results against
v1's declarations as for any adapter. What a batch of one cannot show (a request
leaking into another, ragged offsets, the adapter's compaction of its own cache, time
per stage) is rows/batched.py: the fixture's requests in one batch through the checked v2
adapter, compared by the same comparisons (judging/compare.py), timed per stage. Paged KV has no
v1 form at all: its rows (rows/paged.py) call the v2 adapter alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import numpy as np
import torch

from kdtr_format import ModelConfig

from ...ragged import (forward_of_one, offsets_of, pack_visibility, sizes, to_padded, to_ragged, tree_bits,
                      unpack_visibility, widest)
from ...weights import on_device
from ..reports.report import ValidateError
from .guard import attribute
from .protocol import CAPABILITIES, Method, Output, implemented, protocol_version

__all__ = ["CAPABILITIES_V2", "METHODS_V2", "STAGE_OF", "Offsets", "PerRequest", "adapter_device", "offsets_of",
           "pack_visibility", "sizes", "to_padded", "to_ragged", "unpack_visibility", "widest"]

CAPABILITIES_V2: dict[str, tuple[str, ...]] = {
    "model": ("load_weights", "reset", "forward", "compact_cache"),
    "topk": ("topk_logprobs",),
    "tree": ("build_trees",),
    "compile": ("compile_trees",),
    "accept": ("accept",),
    "sample_accept": ("sample_accept",),
    "compact": ("compact",),
    "attention": ("attention",),
    "paged_attention": ("paged_attention",),
    "paged_compact": ("paged_compact",),
}

# The stage of a DDTree round each method is timed as (rows/batched.py; forward: "prefill" or "verify").
STAGE_OF = {"topk_logprobs": "topk", "build_trees": "build", "compile_trees": "compile", "accept": "accept",
            "sample_accept": "accept", "compact_cache": "compact"}


@dataclass(frozen=True)
class Offsets(Output):
    """Ragged offsets [B+1]: integers, offsets[0] = 0, non-decreasing, and the last one the
    length `total` of the ragged outputs (bound here when no input fixes it)."""

    total: str = ""


def _ragged(offsets: torch.Tensor) -> dict[str, int]:
    return {"B": len(offsets) - 1, "B1": len(offsets)}


def _words(offsets: torch.Tensor) -> int:
    return math.ceil(widest(sizes(offsets)) / 32)


METHODS_V2: dict[str, Method] = {
    "load_weights": Method("model", (), lambda *args: {}),
    "reset": Method("model", (), lambda *args: {}),
    "forward": Method("model", (Output("logits", "float", ("T", "V")),),
                      lambda tokens, positions, offsets, starts, bits: {"T": len(tokens)}),
    "compact_cache": Method("model", (), lambda *args: {}),
    "topk_logprobs": Method("topk", (Output("topk_lp", "float32", ("B", "L", "K"), finite=False),
                                     Output("topk_id", "int", ("B", "L", "K"))),
                            lambda draft_logits, k: {"B": draft_logits.shape[0], "L": draft_logits.shape[1],
                                                     "K": min(int(k), draft_logits.shape[2])}),
    "build_trees": Method("tree", (Offsets("node_offsets", "int", ("B1",), total="N"),
                                   Output("parents", "int", ("N",)), Output("tokens", "int", ("N",)),
                                   Output("depths", "int", ("N",)),
                                   Output("scores", "float64", ("N",), finite=False)),
                          lambda topk_lp, topk_id, budgets, roots: {"B1": len(budgets) + 1}, optional=1),
    "compile_trees": Method("compile", (Output("positions", "int", ("N",)),
                                        Output("visibility_bits", "words", ("N", "W")),
                                        Output("first_child", "int", ("N",)), Output("next_sibling", "int", ("N",))),
                            lambda parents, depths, node_offsets, starts: {"N": len(parents),
                                                                           "W": _words(node_offsets)}),
    "accept": Method("accept", (Output("accepted", "int", ("A",)), Offsets("accept_offsets", "int", ("B1",), total="A"),
                                Output("next_roots", "int", ("B",))),
                     lambda parents, tokens, choices, node_offsets: _ragged(node_offsets)),
    "sample_accept": Method("sample_accept", (Output("choices", "int", ("N",)), Output("accepted", "int", ("A",)),
                                              Offsets("accept_offsets", "int", ("B1",), total="A"),
                                              Output("next_roots", "int", ("B",))),
                            lambda parents, tokens, logits, node_offsets, temperature, uniforms:
                            {"N": len(parents), **_ragged(node_offsets)}),
    "compact": Method("compact", (Output("c_kv", "float", ("B", "S", "R")), Output("k_pe", "float", ("B", "S", "dr"))),
                      lambda c_kv, k_pe, *rest: {"B": c_kv.shape[0], "S": c_kv.shape[1], "R": c_kv.shape[2],
                                                 "dr": k_pe.shape[2]}),
    "attention": Method("attention", (Output("o_lat", "float", ("T", "H", "R")),),
                        lambda q_lat, *rest: dict(zip(("T", "H", "R"), q_lat.shape))),
    "paged_attention": Method("paged_attention", (Output("o_lat", "float", ("T", "H", "R")),),
                              lambda q_lat, *rest: dict(zip(("T", "H", "R"), q_lat.shape))),
    "paged_compact": Method("paged_compact", (Output("c_kv_pages", "float", ("P", "page", "R")),
                                              Output("k_pe_pages", "float", ("P", "page", "dr"))),
                            lambda c_kv, k_pe, *rest: {"P": c_kv.shape[0], "page": c_kv.shape[1], "R": c_kv.shape[2],
                                                       "dr": k_pe.shape[2]}),
}


def adapter_device(adapter: Any) -> torch.device:
    """The v2 adapter's `device` as a torch.device (a CUDA device with its index).
    ValidateError when it has none, or names no device this machine has."""
    device = attribute(adapter, "device")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValidateError(f"a protocol 2 adapter names its device in a `device` attribute (a torch.device or "
                            f"its name), got {device!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValidateError(f"the adapter's device is {device}, but no CUDA device is visible")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device


# ---- a v2 adapter seen through v1 ----

class PerRequest:
    """A v2 adapter as a v1 adapter (module docstring): each v1 call a batch of one request,
    numpy arrays in and out. The v1 methods of a capability the v2 adapter lacks are None,
    so v1's capability rules see what it implements; every other attribute is the adapter's."""

    protocol = 1

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.device = adapter_device(adapter)
        has = implemented(adapter, CAPABILITIES_V2)
        for cap, methods in CAPABILITIES.items():
            if cap not in has:
                for method in methods:
                    setattr(self, method, None)

    def __getattr__(self, name: str) -> Any:
        if name == "adapter":
            raise AttributeError(name)
        return getattr(self.adapter, name)

    @property
    def capabilities(self) -> Any:
        """The v2 adapter's declaration, less the capabilities v1 has no methods for (paged KV)."""
        declared = attribute(self.adapter, "capabilities")
        if isinstance(declared, str) or not isinstance(declared, Collection):
            return declared
        return [cap for cap in declared if CAPABILITIES.get(cap, True)]     # unknown names stay, to be refused

    def _put(self, array: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.tensor(np.asarray(array), dtype=dtype, device=self.device)

    def _one(self, count: int) -> torch.Tensor:
        """The offsets [0, count] of a batch of one."""
        return torch.tensor([0, count], device=self.device)

    def load_weights(self, config: ModelConfig, weights: Mapping[str, Any]) -> None:
        self.adapter.load_weights(config, {name: on_device(w, self.device) for name, w in weights.items()})

    def reset(self, max_len: int) -> None:
        self.adapter.reset(1, max_len)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray, start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start+n] -> logits [n, V]."""
        return _numpy(self.adapter.forward(*forward_of_one(tokens, positions, visibility, start, self.device)))

    def topk_logprobs(self, draft_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return tuple(_numpy(t[0]) for t in self.adapter.topk_logprobs(self._put(draft_logits)[None], k))

    def build_tree(self, topk_lp: np.ndarray, topk_id: np.ndarray, budget: int, root: int) -> tuple[np.ndarray, ...]:
        _, *tree = self.adapter.build_trees(self._put(topk_lp)[None], self._put(topk_id, torch.int64)[None],
                                            self._put([budget], torch.int64), self._put([root], torch.int64))
        return tuple(_numpy(t) for t in tree)

    def compile_tree(self, parents: np.ndarray, depths: np.ndarray, start: int) -> tuple[np.ndarray, ...]:
        compiled = self.adapter.compile_trees(self._put(parents, torch.int64), self._put(depths, torch.int64),
                                              self._one(len(parents)), self._put([start], torch.int64))
        return tuple(_numpy(t) for t in compiled)

    def accept(self, parents: np.ndarray, tokens: np.ndarray, choices: np.ndarray) -> tuple[np.ndarray, int]:
        accepted, _, next_roots = self.adapter.accept(*(self._put(a, torch.int64) for a in (parents, tokens, choices)),
                                                      self._one(len(parents)))
        return _numpy(accepted), _numpy(next_roots[0])

    def sample_accept(self, parents: np.ndarray, tokens: np.ndarray, logits: np.ndarray, temperature: float,
                      uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        choices, accepted, _, next_roots = self.adapter.sample_accept(
            self._put(parents, torch.int64), self._put(tokens, torch.int64), self._put(logits, torch.float64),
            self._one(len(parents)), temperature, self._put(uniforms, torch.float64))
        return _numpy(choices), _numpy(accepted), _numpy(next_roots[0])

    def compact(self, c_kv: np.ndarray, k_pe: np.ndarray, start: int,
                accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c_kv, k_pe = self.adapter.compact(self._put(c_kv)[None], self._put(k_pe)[None], self._put([start], torch.int64),
                                          self._put(accepted, torch.int64), self._one(len(accepted)))
        return _numpy(c_kv[0]), _numpy(k_pe[0])

    def attention(self, q_lat: np.ndarray, q_pe: np.ndarray, c_kv: np.ndarray, k_pe: np.ndarray,
                  visibility: np.ndarray, scale: float) -> np.ndarray:
        n, slots = np.asarray(visibility).shape
        o_lat = self.adapter.attention(self._put(q_lat), self._put(q_pe), self._put(c_kv), self._put(k_pe),
                                       self._one(n), self._put([0], torch.int64), self._put([slots - n], torch.int64),
                                       tree_bits(visibility, slots - n, self.device, "attention"), scale)
        return _numpy(o_lat)


def per_request(adapter: Any) -> Any:
    """Any adapter as protocol v1's per-request calls see it (a v2 adapter through PerRequest)."""
    return PerRequest(adapter) if protocol_version(adapter) == 2 else adapter


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A checked output on the host (bfloat16 widened to float32: numpy has no bfloat16)."""
    return (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
