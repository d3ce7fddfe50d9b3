"""Which part of every weight a rank holds (TP = EP = the whole group).

Weights are cut into contiguous blocks of whole units, rank r taking `World.part(units)`
of them in rank order (docs/tensor-parallel.md):

| weight | cut along | unit | partial output summed by |
|---|---|---|---|
| attn.wq, attn.wq_b [H (dn + dr), .] | rows | a head | (column parallel) |
| attn.wkv_b [H (dn + dv), R] | rows | a head (its W_UK and W_UV) | (column parallel) |
| attn.wo [D, H dv] | columns | a head | the attention all-reduce |
| mlp.w_gate, mlp.w_up [I, D]; mlp.w_down [D, I] | rows; columns | a column of I | the FFN all-reduce |
| moe.shared.* | as mlp.* | a column of the shared width | the MoE all-reduce |
| moe.experts.* [E, ., .] | experts | an expert | the MoE all-reduce |
| lm_head [V, D] | rows | a token id | (gathered in rank order) |

Everything else is replicated: the embedding, every norm, wq_a, wkv_a (the latent c_kv and
k_pe are per token, shared by the heads: every rank computes and caches all of them), the
router's gate and bias (every rank routes every token the same way).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from kdtr_format import ModelConfig

from ..weights import as_tensor
from .world import World


def weight_split(cfg: ModelConfig, name: str) -> tuple[int, int, int] | None:
    """(dim, units, width): weight `name` is cut along `dim` into `units` blocks of `width`
    (the table above); None: replicated."""
    heads = cfg.num_attention_heads
    shared = cfg.n_shared_experts * cfg.moe_intermediate_size
    if name.endswith(("attn.wq", "attn.wq_b")):
        return 0, heads, cfg.qk_head_dim
    if name.endswith("attn.wkv_b"):
        return 0, heads, cfg.qk_nope_head_dim + cfg.v_head_dim
    if name.endswith("attn.wo"):
        return 1, heads, cfg.v_head_dim
    if ".moe.experts." in name:
        return 0, cfg.n_routed_experts, 1
    for prefix, width in ((".mlp.", cfg.intermediate_size), (".moe.shared.", shared)):
        if prefix in name:
            return (1 if name.endswith("w_down") else 0), width, 1
    if name == "lm_head":
        return 0, cfg.vocab_size, 1
    return None


def shard_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor | np.ndarray],
                  world: World) -> dict[str, torch.Tensor]:
    """This rank's part of every weight (copies: the full weights can be dropped afterwards)."""
    out = {}
    for name, value in weights.items():
        tensor, split = as_tensor(value), weight_split(cfg, name)
        if split is None:
            out[name] = tensor
            continue
        dim, units, width = split
        lo, hi = world.part(units)
        out[name] = tensor.narrow(dim, lo * width, (hi - lo) * width).clone()
    return out


def first_expert(cfg: ModelConfig, world: World) -> int:
    """The global id of this rank's first routed expert."""
    return world.part(cfg.n_routed_experts)[0]
