"""The weights a model config needs: their names and shapes (docs/fixtures.md "Weights",
torch layout [out, in]) and their size.

Both the implementations (engine) and the oracle's command line (`refgen generate
--config-file`, which refuses configs whose weights it cannot hold) size a model from here,
so the memory a command states is one estimate. refgen builds its own weights from its own
table (refgen/weights.py); tests check that the two agree.
"""

from __future__ import annotations

import math

from .schema import ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the config needs, with its shape (docs/fixtures.md)."""
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    q_out = heads * cfg.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm"] = (d,)
        if cfg.q_lora_rank is None:
            shapes[p + "attn.wq"] = (q_out, d)
        else:
            shapes[p + "attn.wq_a"] = (cfg.q_lora_rank, d)
            shapes[p + "attn.q_a_norm"] = (cfg.q_lora_rank,)
            shapes[p + "attn.wq_b"] = (q_out, cfg.q_lora_rank)
        shapes[p + "attn.wkv_a"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        shapes[p + "attn.kv_a_norm"] = (cfg.kv_lora_rank,)
        shapes[p + "attn.wkv_b"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[p + "attn.wo"] = (d, heads * cfg.v_head_dim)
        shapes[p + "post_attention_layernorm"] = (d,)
        if cfg.is_dense_layer(i):
            shapes[p + "mlp.w_gate"] = (cfg.intermediate_size, d)
            shapes[p + "mlp.w_up"] = (cfg.intermediate_size, d)
            shapes[p + "mlp.w_down"] = (d, cfg.intermediate_size)
            continue
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        shapes[p + "moe.gate"] = (e, d)
        shapes[p + "moe.e_score_correction_bias"] = (e,)
        shapes[p + "moe.experts.w_gate"] = (e, inter, d)
        shapes[p + "moe.experts.w_up"] = (e, inter, d)
        shapes[p + "moe.experts.w_down"] = (e, d, inter)
        if cfg.n_shared_experts:
            shared = cfg.n_shared_experts * inter
            shapes[p + "moe.shared.w_gate"] = (shared, d)
            shapes[p + "moe.shared.w_up"] = (shared, d)
            shapes[p + "moe.shared.w_down"] = (d, shared)
    shapes["norm"] = (d,)
    shapes["lm_head"] = (cfg.vocab_size, d)
    return shapes


def weight_bytes(cfg: ModelConfig, itemsize: int = 4) -> int:
    """The bytes of every weight of `cfg` at `itemsize` bytes a value (4: float32, 2: bf16)."""
    return itemsize * sum(math.prod(shape) for shape in weight_shapes(cfg).values())
