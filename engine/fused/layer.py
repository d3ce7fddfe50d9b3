"""The fused decode / verify forward: the layers of `engine.model.Transformer` in ~16 launches each.

Per layer (docs/model.md's math, default mode):

    x, h      = add_rms_norm(x, previous FFN slots)            1 kernel (the previous layer's combine)
    kv        = h [W_q_a; W_kv_a]^T                            1 GEMM   (no q_lora: [W_q; W_kv_a])
    q_a       = latent(kv) -> c_kv, rope(k_pe) into the cache  1 kernel
    q         = q_a W_q_b^T                                    1 GEMM
    q_lat, q_pe = head_bmm(q_nope, W_uk), rope(q_pe)           1 kernel
    o_lat     = attention over the cache                       the attention backend's launches
    o         = head_bmm(o_lat, W_uv^T)                        1 kernel
    a         = o W_o^T                                        1 GEMM
    x, h, h32 = add_rms_norm(x, a)                             1 kernel
    experts, weights = route(h W_router^T)                     1 kernel (MoE layers; past 16 rows + 1 GEMM)
    y         = experts(h)                                     3 kernels (sort, gate-up, down)

and after the last layer add_rms_norm with the final norm and the lm_head GEMM. The shared
experts are stacked after the routed ones and a dense layer's MLP is one expert
(engine/fused/moe.py), so every FFN is the same three launches. `fuse` gives the unfused
forward views of the same storage (no weight is held twice but a shared W_down split in more
than one expert).

Numerics: float32 norms, rotary embeddings, router and accumulations; the residual stream
rounded to the compute dtype where the unfused forward rounds it; the experts' hidden
activations rounded once (after SiLU-and-mul) and their outputs kept in float32 to the combine.
The fused forward meets the same tolerances as the unfused one (docs/engine-fused.md) and is
deterministic: a CUDA-graph replay gives the bits of the eager call.

Invariant mode (`FusedForward(..., invariant=True)`): the same launches with every choice that
could depend on the number of rows M fixed, so a row's logits are bitwise the same whatever
rows or requests share its call: the dense products are `linear`'s fixed-tile form (no cuBLAS,
split-K from the weight's shape alone, the splits added in order), the per-head products take
64-row tiles (float32: 16), the router computes its logits per row, the experts take 64-pair
blocks (float32: 16) and fixed tiles, and attention is the backend's invariant form (bound by
the model). The norms, the latent step and the slot combine are per row already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtr_format import ModelConfig

from . import heads, linear, moe, norms


@dataclass
class FusedLayer:
    input_norm: torch.Tensor          # float32 [D]
    post_norm: torch.Tensor           # float32 [D]
    w_joint: torch.Tensor             # [Q + R + dr, D]: W_q_a (or W_q), then W_kv_a
    q_a_norm: torch.Tensor | None     # float32 [q_lora], None without q_lora
    kv_a_norm: torch.Tensor           # float32 [R]
    wq_b: torch.Tensor | None         # [H (d_nope + d_rope), q_lora], None without q_lora
    w_uk: torch.Tensor                # [H, d_nope, R]
    w_uv: torch.Tensor                # [H, d_v, R]
    wo: torch.Tensor                  # [D, H d_v]
    gate: torch.Tensor | None         # float32 [E, D]; None: a dense layer
    bias: torch.Tensor | None         # float32 [E]
    w_gate: torch.Tensor              # [ET, I, D]: routed experts, then shared ones (dense: [1, I, D])
    w_up: torch.Tensor                # [ET, I, D]
    w_down: torch.Tensor              # [ET, D, I]


def fuse(cfg: ModelConfig, block) -> FusedLayer:
    """One `engine.model.Block`'s weights in the fused forms, the block's own weights made
    views of them (module docstring)."""
    attn, ffn = block.attn, block.ffn
    if cfg.q_lora_rank is None:
        w_joint = torch.cat([attn.wq, attn.wkv_a])
        attn.wq, attn.wkv_a = w_joint[:attn.wq.shape[0]], w_joint[attn.wq.shape[0]:]
        q_a_norm = wq_b = None
    else:
        w_joint = torch.cat([attn.wq_a, attn.wkv_a])
        attn.wq_a, attn.wkv_a = w_joint[:cfg.q_lora_rank], w_joint[cfg.q_lora_rank:]
        q_a_norm, wq_b = attn.q_a_norm, attn.wq_b
    if hasattr(ffn, "experts"):
        routed, shared = ffn.experts, ffn.shared
        gate, bias = ffn.gate, ffn.bias
        e, inner, width = routed.w_gate.shape
        parts = [(routed.w_gate, routed.w_up, routed.w_down)]
        if shared is not None:
            ns = cfg.n_shared_experts
            parts.append((shared.w_gate.view(ns, inner, width), shared.w_up.view(ns, inner, width),
                          shared.w_down.view(width, ns, inner).permute(1, 0, 2)))
        w_gate, w_up, w_down = (torch.cat(ws) for ws in zip(*parts))
        ffn.experts = type(routed)(w_gate[:e], w_up[:e], w_down[:e], first=routed.first)
        if shared is not None:
            shared.w_gate, shared.w_up = w_gate[e:].reshape(-1, width), w_up[e:].reshape(-1, width)
            if cfg.n_shared_experts == 1:
                shared.w_down = w_down[e]
    else:
        gate = bias = None
        w_gate, w_up, w_down = ffn.w_gate[None], ffn.w_up[None], ffn.w_down[None]
    return FusedLayer(block.input_norm, block.post_norm, w_joint, q_a_norm, attn.kv_a_norm, wq_b,
                      attn.w_uk, attn.w_uv, attn.wo, gate, bias, w_gate, w_up, w_down)


class FusedForward:
    """The fused layers and head of one model (module docstring). invariant: the batch-invariant
    forward (module docstring)."""

    def __init__(self, cfg: ModelConfig, blocks, norm: torch.Tensor, lm_head: torch.Tensor,
                 invariant: bool = False) -> None:
        self.cfg = cfg
        self.invariant = invariant
        self.layers = [fuse(cfg, block) for block in blocks]
        self.norm, self.lm_head = norm, lm_head
        self._dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _dense_slots(self, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense layer's routing of m rows: expert 0 at weight 1 (made once per m: held, so a
        CUDA graph may read them)."""
        if m not in self._dense:
            self._dense[m] = (torch.zeros(m, 1, device=device, dtype=torch.int32),
                              torch.ones(m, 1, device=device, dtype=torch.float32))
        return self._dense[m]

    def _project(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K], w [N, K] -> a w^T [M, N]: cuBLAS, or in invariant mode the fixed-tile product."""
        return linear.linear(a, w, self.invariant)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 real: torch.Tensor, cache, attend, scale: float, batch: int) -> torch.Tensor:
        """x [M, D] (embedded tokens), cos/sin float32 [M, dr/2], rows int64 [M] (the new tokens'
        cache rows), real uint8 [M], attend: the bound per-layer attention -> logits float32 [M, V]."""
        cfg = self.cfg
        m = x.shape[0]
        n = m // batch
        q_cols = cfg.q_lora_rank or cfg.num_attention_heads * cfg.qk_head_dim
        eps, latent_eps = cfg.rms_norm_eps, cfg.latent_norm_eps
        y = None
        invariant, project = self.invariant, self._project
        for layer, f in enumerate(self.layers):
            x, h, _ = norms.add_rms_norm(x, f.input_norm, eps, delta=y, real=real)
            kv = project(h, f.w_joint)                                                   # [M, Q + R + dr]
            c_kv_rows, k_pe_rows = cache.rows(layer)
            q_a = norms.latent(kv, q_cols, f.q_a_norm, f.kv_a_norm, latent_eps, cos, sin, cfg.rope_style,
                               rows, real, c_kv_rows, k_pe_rows)
            q = (project(q_a, f.wq_b) if q_a is not None else kv[:, :q_cols]).view(m, -1, cfg.qk_head_dim)
            q_lat, q_pe = heads.head_bmm(q, f.w_uk, w_transposed=False, rope=(cos, sin, cfg.rope_style),
                                         invariant=invariant)
            o_lat = attend(q_lat.view(batch, n, *q_lat.shape[1:]), q_pe.view(batch, n, *q_pe.shape[1:]),
                           *cache.layer(layer), scale).view(q_lat.shape)          # [M, H, R]
            o, _ = heads.head_bmm(o_lat, f.w_uv, w_transposed=True, invariant=invariant)   # [M, H, d_v]
            a = project(o.view(m, -1), f.wo)                                        # [M, D]
            x, h, h32 = norms.add_rms_norm(x, f.post_norm, eps, delta=a,
                                           float32_copy=f.gate is not None and m > moe.ROUTER_ROWS and not invariant)
            if f.gate is None:
                idx, weight = self._dense_slots(m, x.device)
            else:
                idx, weight = moe.route(cfg, h, h32, f.gate, f.bias, invariant)
            y = moe.experts(h, idx, weight, real, f.w_gate, f.w_up, f.w_down,
                            invariant=invariant)                          # [M, S, D] float32
        _, h, _ = norms.add_rms_norm(x, self.norm, eps, delta=y, real=real)
        return project(h, self.lm_head).float()
