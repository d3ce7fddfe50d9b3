"""A kdtree config and fixture weights in the terms of HF transformers' DeepseekV3 (5.6 and later).

    hf_cfg = transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg))
    state = hf_state_dict(cfg, weights)          # docs/fixtures.md weight names -> HF's

Plain data, no transformers import: the HF adapter (engine/adapters/hf.py) and the
tests that hold the reference against HF share it. `deepseek_v3_kwargs` writes one
``rope_parameters`` dict, ``rope_interleave`` and ``num_key_value_heads``; kdtree's
`latent_norm_eps` is left out, since HF hard-codes the reference's 1e-6 (the adapter
declares the difference where a config's eps is another).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from kdtr_format import ModelConfig

# The oldest transformers whose DeepseekV3 is DeepSeek-V3's model: before 5.6 its grouped routing
# filled the dropped groups' scores with 0, not -inf, so an expert of a dropped group won wherever
# the kept experts' biased scores were negative. pyproject.toml's test extra declares the same floor.
TRANSFORMERS_MIN = "5.6"

NOT_HF = {"rope_theta", "rope_scaling", "rope_style", "scoring_func", "topk_method", "latent_norm_eps"}

# fixture name suffix (layers.{i}.<suffix>) -> HF name suffix (model.layers.{i}.<suffix>.weight)
HF_NAMES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
            "attn.wq": "self_attn.q_proj", "attn.wq_a": "self_attn.q_a_proj",
            "attn.q_a_norm": "self_attn.q_a_layernorm", "attn.wq_b": "self_attn.q_b_proj",
            "attn.wkv_a": "self_attn.kv_a_proj_with_mqa", "attn.kv_a_norm": "self_attn.kv_a_layernorm",
            "attn.wkv_b": "self_attn.kv_b_proj", "attn.wo": "self_attn.o_proj",
            "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
            "moe.gate": "mlp.gate", "moe.shared.w_gate": "mlp.shared_experts.gate_proj",
            "moe.shared.w_up": "mlp.shared_experts.up_proj",
            "moe.shared.w_down": "mlp.shared_experts.down_proj"}


def deepseek_v3_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as keyword arguments of transformers' `DeepseekV3Config` (v5 API)."""
    y = cfg.rope_scaling
    rope = ({"rope_type": "default", "rope_theta": cfg.rope_theta} if y is None else
            {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **dataclasses.asdict(y)})
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - NOT_HF
    return {**{name: getattr(cfg, name) for name in fields}, "num_key_value_heads": cfg.num_attention_heads,
            "rope_parameters": rope, "rope_interleave": cfg.rope_style == "interleave"}


def hf_state_dict(cfg: ModelConfig, w: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fixture weights (docs/fixtures.md names) -> `DeepseekV3ForCausalLM` state-dict entries
    (rotary buffers excluded). Routed experts: HF stacks gate and up as gate_up_proj
    [E, 2 I, D]; everything else is renamed, not changed."""
    state = {"model.embed_tokens.weight": w["embed_tokens"], "model.norm.weight": w["norm"],
             "lm_head.weight": w["lm_head"]}
    for i in range(cfg.num_hidden_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        state.update({f"{q}{hf}.weight": w[p + ours] for ours, hf in HF_NAMES.items() if p + ours in w})
        if not cfg.is_dense_layer(i):
            state[q + "mlp.gate.e_score_correction_bias"] = w[p + "moe.e_score_correction_bias"]
            state[q + "mlp.experts.gate_up_proj"] = np.concatenate(
                [w[p + "moe.experts.w_gate"], w[p + "moe.experts.w_up"]], axis=1)
            state[q + "mlp.experts.down_proj"] = w[p + "moe.experts.w_down"]
    return state
