"""What bf16 cases need from the reference: bf16-rounded weights and routing margins.

A bf16 engine loads weights rounded to bfloat16 (round to nearest, ties to even:
`ml_dtypes`), so bf16 cases are computed, in float64 as always, from exactly
those weights (`bf16_weights`). Then the engine's error is its arithmetic's
alone, which the bf16 error model (kdtr_format.precision) bounds.

Routing is a discrete decision that bf16 rounding can flip: when the gap
between the k-th and (k+1)-th selection score (or between the kept and the
first dropped group) is below the bf16 routing bound, the engine may route the
token to another expert, which changes its output far beyond any rounding
tolerance, and, through attention, the output of every token that sees it at a
later layer. Such gaps cannot be drawn away (with random routing about one
decision in ten lies within the bound), so the cases record the reference's
routing of every row the validator compares, experts and margins per MoE layer
(`routing_tensors`): the validator tells a flip at a near-tie (rounding) from
one at a wide margin (a bug), and judges the rows a flip reaches apart
(engine/validate/judging/regime.py).
"""

from __future__ import annotations

from typing import Mapping

import ml_dtypes
import numpy as np

from kdtr_format import ModelConfig

from .ddtree import Tree, compile_tree, visibility_over_cache
from .model import KVCache, Model, causal_visibility, route, router_margins

BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 weights rounded to bfloat16 (nearest, ties to even), stored as ml_dtypes.bfloat16
    (a bf16 weight, a checkpoint's memory-mapped one, is its own rounding and stays as it is)."""
    return {name: w if w.dtype == BF16 else np.asarray(w, dtype=np.float32).astype(BF16)
            for name, w in weights.items()}


class RoutingRecorder:
    """A refgen `Target` (the Model's forward contract) that records each forward's routing:
    after forward(...), `experts` int64 [n, Lm, k] (each MoE layer's chosen experts, ascending)
    and `margins` float64 [n, Lm] (router_margins), Lm the MoE layers."""

    def __init__(self, model: Model) -> None:
        self.model, self.cfg = model, model.cfg
        self.moe_layers = [i for i in range(self.cfg.num_hidden_layers) if not self.cfg.is_dense_layer(i)]
        k = self.cfg.num_experts_per_tok
        self.experts = np.zeros((0, len(self.moe_layers), k), dtype=np.int64)
        self.margins = np.zeros((0, len(self.moe_layers)))
        self.inputs: dict[int, np.ndarray] = {}
        model.capture = lambda name, layer, y: self.inputs.__setitem__(layer, y)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray, cache: KVCache,
                start: int) -> np.ndarray:
        self.inputs.clear()
        logits = self.model.forward(tokens, positions, visibility, cache, start)
        n, k = len(tokens), self.cfg.num_experts_per_tok
        self.experts = np.zeros((n, len(self.moe_layers), k), dtype=np.int64)
        self.margins = np.zeros((n, len(self.moe_layers)))
        for j, i in enumerate(self.moe_layers):
            gate, bias = (self.model.w[f"layers.{i}.moe.{name}"] for name in ("gate", "e_score_correction_bias"))
            self.experts[:, j] = np.sort(route(self.cfg, self.inputs[i], gate, bias)[0], axis=1)
            self.margins[:, j] = router_margins(self.cfg, self.inputs[i], gate, bias)
        return logits


def routing_tensors(model: Model, tensors: Mapping[str, np.ndarray], prompt: str,
                    traces: list[Mapping]) -> dict[str, np.ndarray]:
    """The routing of every row the validator compares (docs/fixtures.md "bf16 cases"), from one
    prompt's tensors: `router_experts` [rows, Lm, k] and `router_margins` [rows, Lm] under
    prompts/{p}/ (its prefill rows), prompts/{p}/ar/ (the row behind each AR decision) and
    traces/{t}/rounds/{r}/ (each verified node). AR rows are those of one causal prefill of the
    prompt and its AR tokens (the same values); a round's cache holds the prompt and the tokens
    committed before it, the rows of that prefill (a causal row depends on the rows before it
    alone: the numbers of prefilling the prefix again, to BLAS's rounding)."""
    recorder = RoutingRecorder(model)
    tokens, ar_tokens = tensors[f"prompts/{prompt}/tokens"], tensors[f"prompts/{prompt}/ar/tokens"]
    m = len(tokens)
    sequence = np.concatenate([tokens, ar_tokens[:-1]])
    causal = KVCache.new(model.cfg, len(sequence))          # row s: token s of the one causal prefill
    recorder.forward(sequence, np.arange(len(sequence)), causal_visibility(len(sequence), 0), causal, 0)
    out = {}
    for where, rows in ((f"prompts/{prompt}", slice(0, m)), (f"prompts/{prompt}/ar", slice(m - 1, m - 1 + len(ar_tokens)))):
        out[f"{where}/router_experts"], out[f"{where}/router_margins"] = recorder.experts[rows], recorder.margins[rows]
    for trace in traces:
        for r in range(trace["rounds"]):
            rp = f"traces/{trace['name']}/rounds/{r}"
            start = int(tensors[f"{rp}/start"])
            tree = Tree(*(tensors[f"{rp}/{name}"] for name in ("parents", "tokens", "depths", "ranks", "scores")))
            cache = KVCache.new(model.cfg, start + len(tree.parents))
            for layer, (c_kv, k_pe) in enumerate(zip(causal.c_kv, causal.k_pe)):    # the prefix: that prefill's
                cache.c_kv[layer][:start], cache.k_pe[layer][:start] = c_kv[:start], k_pe[:start]
            compiled = compile_tree(tree, start)
            recorder.forward(tree.tokens, compiled.positions, visibility_over_cache(compiled, start), cache, start)
            out[f"{rp}/router_experts"], out[f"{rp}/router_margins"] = recorder.experts, recorder.margins
    return out
