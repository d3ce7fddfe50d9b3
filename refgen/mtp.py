"""DeepSeek-V3's multi-token-prediction (MTP) module: weights that agree with the target, and the
float64 reference of its draft logits (docs/model.md, "Multi-token prediction").

    weights = agreeing_weights(cfg, target_weights, seed)          # "mtp.*" -> float32
    reference = draft_reference(cfg, target_weights, weights, tokens)

The module is one layer, index L = num_hidden_layers, served as the draft of speculative
decoding. For target position i, with h_i the target's hidden state after its final norm and
t_{i+1} the next token of the sequence:

    e    = Emb(t_{i+1}), 0 where i = 0
    x    = eh_proj(concat(RMSNorm_enorm(e), RMSNorm_hnorm(h_i)))      embedding first
    y    = block(x) at rope position i, over the module's own KV cache  (a decoder layer, residuals in)
    draft logits of t_{i+2} = shared_head.head(RMSNorm_shared_head.norm(y))

as vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py compute it. Weight names ("mtp." + ...):
embed_tokens [V, D], enorm [D], hnorm [D], eh_proj [D, 2D], block.<a layer's names, as layer L of
docs/fixtures.md: MoE when L >= first_k_dense_replace>, shared_head.norm [D], shared_head.head [V, D].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from kdtr_format import ModelConfig, weight_shapes

from .model import KVCache, Model, causal_visibility, rms_norm
from .weights import init_weights

PREFIX = "mtp."
BLOCK = PREFIX + "block."
OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
BLOCK_GAIN = 0.1          # a drawn block's output projections, scaled: it perturbs the embedding, not replaces it
HIDDEN_GAIN = 0.1         # eh_proj's weight on the target's hidden state (the embedding's is the identity)
SHARED = {"embed_tokens": "embed_tokens", "shared_head.norm": "norm", "shared_head.head": "lm_head"}
OUTPUTS = ("attn.wo", "mlp.w_down", "moe.experts.w_down", "moe.shared.w_down")


def block_config(cfg: ModelConfig) -> ModelConfig:
    """A one-layer model whose layer 0 is the MTP block (layer L's kind: MoE when L >=
    first_k_dense_replace)."""
    dense = cfg.is_dense_layer(cfg.num_hidden_layers)
    return dataclasses.replace(cfg, num_hidden_layers=1, first_k_dense_replace=1 if dense else 0)


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every MTP weight name and its shape."""
    V, D = cfg.vocab_size, cfg.hidden_size
    block = {BLOCK + name.removeprefix("layers.0."): shape
             for name, shape in weight_shapes(block_config(cfg)).items() if name.startswith("layers.0.")}
    return {PREFIX + "embed_tokens": (V, D), PREFIX + "enorm": (D,), PREFIX + "hnorm": (D,),
            PREFIX + "eh_proj": (D, 2 * D), **block, PREFIX + "shared_head.norm": (D,),
            PREFIX + "shared_head.head": (V, D)}


def agreeing_weights(cfg: ModelConfig, target: Callable[[str], np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """float32 MTP weights under which the draft often predicts what the target will: the target's
    embedding, final norm and lm_head as its own; eh_proj = [I, HIDDEN_GAIN R] (the normed next
    embedding passed through, plus a little of the target's hidden state, R ~ N(0, 1/D)); as block,
    the target's last layer when it is of the block's kind (an MoE layer), so that the module runs
    that layer over the sequence shifted by one token, else a layer drawn as init_weights draws layer
    L of a model one layer deeper (seed + 1), its output projections scaled by BLOCK_GAIN. enorm is
    drawn from U(0.9, 1.1) and hnorm as norms are (U(0.8, 1.2)): an engine that ignores either, or
    feeds another hidden state, computes other logits."""
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    block_names = [name.removeprefix(BLOCK) for name in mtp_shapes(cfg) if name.startswith(BLOCK)]
    if cfg.is_dense_layer(L - 1) == cfg.is_dense_layer(L):
        weights = {BLOCK + name: np.asarray(target(f"layers.{L - 1}.{name}"), np.float32) for name in block_names}
    else:
        drawn = init_weights(dataclasses.replace(cfg, num_hidden_layers=L + 1), seed + 1)
        weights = {BLOCK + name: drawn[f"layers.{L}.{name}"] * np.float32(BLOCK_GAIN if name in OUTPUTS else 1.0)
                   for name in block_names}
    rng = np.random.default_rng([seed, 1])
    eh_proj = np.zeros((D, 2 * D), np.float32)
    eh_proj[:, :D] = np.eye(D, dtype=np.float32)
    eh_proj[:, D:] = rng.standard_normal((D, D), dtype=np.float32) * np.float32(HIDDEN_GAIN / np.sqrt(D))
    weights[PREFIX + "eh_proj"] = eh_proj
    weights[PREFIX + "enorm"] = rng.uniform(0.9, 1.1, D).astype(np.float32)
    weights[PREFIX + "hnorm"] = rng.uniform(0.8, 1.2, D).astype(np.float32)
    for own, name in SHARED.items():
        weights[PREFIX + own] = np.asarray(target(name), np.float32)
    return {name: np.ascontiguousarray(weights[name]) for name in mtp_shapes(cfg)}


class Mtp:
    """The float64 MTP module of `cfg` with `weights` ("mtp.*", as `mtp_shapes`)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.cfg = cfg
        own = {name: np.asarray(weights[PREFIX + name], np.float64) for name in OWN}
        self.embed, self.enorm, self.hnorm = own["embed_tokens"], own["enorm"], own["hnorm"]
        self.eh_proj, self.norm, self.head = own["eh_proj"], own["shared_head.norm"], own["shared_head.head"]
        block = {"layers.0." + name.removeprefix(BLOCK): w for name, w in weights.items() if name.startswith(BLOCK)}
        self.block = Model(block_config(cfg), {**block, "embed_tokens": self.embed, "norm": self.norm,
                                               "lm_head": self.head})

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.new(self.block.cfg, max_len)

    def step(self, next_tokens: np.ndarray, hidden: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
             cache: KVCache, start: int) -> tuple[np.ndarray, np.ndarray]:
        """next_tokens [n] (t_{i+1}), hidden [n, D] (the target's h_i after its final norm), positions [n]
        (i), visibility [n, start + n] over the module's cache -> (draft logits [n, V] of t_{i+2}, the
        normed output [n, D] that a chained draft step takes as its hidden state)."""
        eps = self.cfg.rms_norm_eps
        e = np.where((positions == 0)[:, None], 0.0, self.embed[next_tokens])
        x = np.concatenate([rms_norm(e, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)], axis=-1) @ self.eh_proj.T
        y = self.block.residual_stream(x, positions, visibility, cache, start)[-1]
        normed = rms_norm(y, self.norm, eps)
        return normed @ self.head.T, normed


@dataclasses.dataclass(frozen=True)
class DraftReference:
    """One sequence's MTP reference: tokens [n]; the target's hidden states after its final norm
    [n, D] and logits [n, V]; the first draft step's logits at positions 0 .. n-2 [n - 1, V]
    (draft_logits[i] predicts tokens[i + 2], from tokens[i + 1] and hidden[i])."""

    tokens: np.ndarray
    target_hidden: np.ndarray
    target_logits: np.ndarray
    draft_logits: np.ndarray

    def agreement(self, start: int) -> tuple[int, int]:
        """(agreeing, judged): positions i >= start where the draft's argmax is the target's argmax
        at i + 1 (what a greedy verify accepts)."""
        draft = self.draft_logits[start:].argmax(axis=-1)
        target = self.target_logits[start + 1:].argmax(axis=-1)
        return int((draft == target).sum()), len(draft)


def draft_reference(cfg: ModelConfig, target: Mapping[str, np.ndarray], mtp: Mapping[str, np.ndarray],
                    tokens: np.ndarray) -> DraftReference:
    """The target (weights `target`) on `tokens` [n] (causal, positions 0 .. n-1), then one MTP
    draft step at every position but the last (vLLM's proposer after a prefill: the tokens shifted
    by one, the target's positions)."""
    tokens = np.asarray(tokens, np.int64)
    n = len(tokens)
    model = Model(cfg, target)
    stream = model.hidden_states(tokens, np.arange(n), causal_visibility(n, 0), KVCache.new(cfg, n), 0)
    hidden = rms_norm(stream[-1], np.asarray(target["norm"], np.float64), cfg.rms_norm_eps)
    module = Mtp(cfg, mtp)
    draft, _ = module.step(tokens[1:], hidden[:-1], np.arange(n - 1), causal_visibility(n - 1, 0),
                           module.new_cache(n - 1), 0)
    return DraftReference(tokens, hidden, hidden @ np.asarray(target["lm_head"], np.float64).T, draft)
