"""Seeded random weights for a `ModelConfig`, named as in docs/fixtures.md.

Weights are float32 (what fixtures store); the reference widens them to
float64. Linear weights use the torch layout [out, in]: y = x @ W.T.

Scaling keeps activations O(1) through every layer, so the reference is a
fair test at any depth of a preset:

- the embedding is N(0, 1), so the residual stream starts at RMS 1;
- every input-side projection is N(0, 1/fan_in), so its outputs have RMS ~1;
- every output-side projection (attention `wo`, every `w_down`) is
  N(0, 1/fan_in) * `OUT_GAIN`, so each layer adds a branch of RMS ~0.5 and the
  stream grows slowly (per-token RMS within about [0.85, 2] on the presets);
- RMSNorm weights are U(0.8, 1.2), so a norm that ignores its weight is wrong;
- `lm_head` is N(0, LOGIT_STD^2 / D): logits spread a few units, so greedy
  top-1/top-2 margins are mostly well above float32 rounding;
- the router's correction bias is N(0, BIAS_STD^2): comparable to the spread of
  the sigmoid scores, so it changes which experts are selected. With grouped
  routing (n_group > 1) its mean is GROUPED_BIAS_MEAN: every biased score is
  then negative, so a router that masks dropped groups with 0.0 instead of
  -inf picks experts of dropped groups.
"""

from __future__ import annotations

import numpy as np

from kdtr_format import ModelConfig

OUT_GAIN = 0.5
LOGIT_STD = 3.0
BIAS_STD = 0.1
GROUPED_BIAS_MEAN = -1.0
NORM_RANGE = (0.8, 1.2)

# How each weight is drawn: a normal with std = gain / sqrt(fan_in), fan_in the last axis
# ("linear", "output"); a normal with a fixed std ("embedding", "logits", "bias", the last
# shifted by GROUPED_BIAS_MEAN under grouped routing); or uniform in NORM_RANGE ("norm").
_LINEAR, _OUTPUT, _NORM, _EMBEDDING, _LOGITS, _BIAS = (
    "linear", "output", "norm", "embedding", "logits", "bias")


def _layer_specs(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    q_out = H * cfg.qk_head_dim
    p = f"layers.{i}."
    specs: dict[str, tuple[tuple[int, ...], str]] = {p + "input_layernorm": ((D,), _NORM)}
    if cfg.q_lora_rank is None:
        specs[p + "attn.wq"] = ((q_out, D), _LINEAR)
    else:
        specs[p + "attn.wq_a"] = ((cfg.q_lora_rank, D), _LINEAR)
        specs[p + "attn.q_a_norm"] = ((cfg.q_lora_rank,), _NORM)
        specs[p + "attn.wq_b"] = ((q_out, cfg.q_lora_rank), _LINEAR)
    specs[p + "attn.wkv_a"] = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, D), _LINEAR)
    specs[p + "attn.kv_a_norm"] = ((cfg.kv_lora_rank,), _NORM)
    specs[p + "attn.wkv_b"] = ((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                               _LINEAR)
    specs[p + "attn.wo"] = ((D, H * cfg.v_head_dim), _OUTPUT)
    specs[p + "post_attention_layernorm"] = ((D,), _NORM)
    if cfg.is_dense_layer(i):
        I = cfg.intermediate_size
        specs[p + "mlp.w_gate"] = ((I, D), _LINEAR)
        specs[p + "mlp.w_up"] = ((I, D), _LINEAR)
        specs[p + "mlp.w_down"] = ((D, I), _OUTPUT)
        return specs
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    specs[p + "moe.gate"] = ((E, D), _LINEAR)
    specs[p + "moe.e_score_correction_bias"] = ((E,), _BIAS)
    specs[p + "moe.experts.w_gate"] = ((E, I, D), _LINEAR)
    specs[p + "moe.experts.w_up"] = ((E, I, D), _LINEAR)
    specs[p + "moe.experts.w_down"] = ((E, D, I), _OUTPUT)
    if cfg.n_shared_experts > 0:
        S = cfg.n_shared_experts * I
        specs[p + "moe.shared.w_gate"] = ((S, D), _LINEAR)
        specs[p + "moe.shared.w_up"] = ((S, D), _LINEAR)
        specs[p + "moe.shared.w_down"] = ((D, S), _OUTPUT)
    return specs


def _specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    V, D = cfg.vocab_size, cfg.hidden_size
    specs: dict[str, tuple[tuple[int, ...], str]] = {"embed_tokens": ((V, D), _EMBEDDING)}
    for i in range(cfg.num_hidden_layers):
        specs.update(_layer_specs(cfg, i))
    specs["norm"] = ((D,), _NORM)
    specs["lm_head"] = ((V, D), _LOGITS)
    return specs


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name of `cfg` (docs/fixtures.md, no "weights/" prefix) and its shape,
    in a fixed order: embedding, layers 0.., final norm, lm_head."""
    return {name: shape for name, (shape, _) in _specs(cfg).items()}


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights for `cfg`, named and shaped as `weight_shapes(cfg)`.

    One `np.random.default_rng(seed)` draws every tensor in `weight_shapes` order,
    so the same (cfg, seed) gives byte-identical weights on every machine.
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed: must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, (shape, kind) in _specs(cfg).items():
        if kind == _NORM:
            w = rng.uniform(*NORM_RANGE, size=shape)
        else:
            std = {_LINEAR: 1.0 / np.sqrt(shape[-1]),
                   _OUTPUT: OUT_GAIN / np.sqrt(shape[-1]),
                   _EMBEDDING: 1.0,
                   _LOGITS: LOGIT_STD / np.sqrt(shape[-1]),
                   _BIAS: BIAS_STD}[kind]
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            if kind == _BIAS and cfg.n_group > 1:
                w += np.float32(GROUPED_BIAS_MEAN)
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)
    return weights
