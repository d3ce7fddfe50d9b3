"""The torch DeepSeek-V3 / Kimi-K2 target model: MLA + sigmoid noaux_tc MoE.

The math is docs/model.md: pre-norm layers, Multi-head
Latent Attention run in the absorbed form over a latent KV cache, rotary
embeddings in either pairing (``interleave`` / ``neox``) with YaRN and both
mscale factors, group-limited sigmoid routing with a selection-only bias,
shared experts and dense first layers.

One `Transformer.forward` serves prefill, AR decode and tree verify for a
ragged batch: request b brings n_new[b] new tokens written at cache slots
starts[b] + i, and a visibility mask over those new tokens (causal, or
ancestor-only for a tree). Padding rows (i >= n_new[b]) read and write
nothing that a real row sees.

Compute dtype is float32 (default) or bfloat16; norms, rotary embeddings,
router scores, softmax and the MoE sum run in float32 whatever the dtype.

The forward reads nothing back to the host: types, shapes and devices are checked
on the host every call, values (ranges, the cache's room, self-visibility) only with
``check=True``, the default; the decoding loops and CUDA graphs (engine/graphs.py)
pass ``check=False``. The new tokens' KV goes into the cache by a scatter whose
padding rows write back what their slot held, and the MoE dispatch keeps its
offsets on the device (engine/moe.py), so a forward can be captured in a CUDA graph.

Each layer is per-row stages (the attention inputs, the attention output
projection, the FFN; the head after the last layer) around the one cross-row
step, attention. With ``invariant=True`` every per-row stage runs on tiles of
exactly `tile` rows (1 on the CPU, 64 elsewhere; the last tile zero-padded), so the
same kernels with the same shapes compute every row whatever the number of rows in
the call; the MoE takes the dense dispatch and attention its backend's invariant
form. A token's logits are then bitwise the same in a 1-token decode, a tree verify
or a prefill chunk, alone or batched (docs/precision.md, section 3).

``capture(name, layer, tensor)``, when given, sees the intermediates [B, N, ...] at
the points CAPTURE_POINTS (layer -1 for the logits), for the divergence finder.

With ``world`` (engine/parallel), the model is this rank's shard: its heads, its experts, its
columns of the dense and shared FFNs and its rows of the lm_head. The attention output and the
FFN output are summed over the ranks (``world.sum``; in invariant mode
``world.sum_in_rank_order``, the same for any number of rows), once per stage on all M rows
(outside the invariant tiles), and the logits gathered in rank order, so every rank holds the
same full activations and logits (docs/tensor-parallel.md). The capture hook then sees this
rank's heads in q_lat and o_lat.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from kdtr_format import ModelConfig

from .attention import AttentionBackend, bind_attention, invariant_form, torch_attention
from .cache import KVCache
from .moe import DISPATCHES, RoutedExperts, moe_dispatch, swiglu
from .parallel import World, first_expert, shard_weights
from .weights import ROUTER_WEIGHTS, as_tensor, check_weights, load_fixture_weights

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
INVARIANT_TILE = {"cpu": 1}          # rows per tile in invariant mode; other devices: 64
CAPTURE_POINTS = ("attn_input", "q_lat", "c_kv", "k_pe", "o_lat", "attn_output", "attn_residual",
                  "router_scores", "experts", "ffn_output", "layer_output", "logits")
Capture = Callable[[str, int, torch.Tensor], None]


# ---- rotary embedding and softmax scale (docs/model.md, "Rotary embedding") ----

def yarn_get_m(factor: float, mscale: float) -> float:
    """get_m(f, s) = 0.1 s ln f + 1, and 1 when f <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """-> float64 [d_rope / 2]: theta^(-2i/d), blended towards freq/factor by the YaRN ramp."""
    d = cfg.qk_rope_head_dim
    i = torch.arange(d // 2, dtype=torch.float64)
    freq = cfg.rope_theta ** (-2.0 * i / d)
    yarn = cfg.rope_scaling
    if yarn is None:
        return freq

    def correction_dim(rotations: float) -> float:
        return d * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    return freq / yarn.factor * ramp + freq * (1.0 - ramp)


def rope_mscale(cfg: ModelConfig) -> float:
    """The factor on cos and sin: get_m(factor, mscale) / get_m(factor, mscale_all_dim)."""
    yarn = cfg.rope_scaling
    if yarn is None:
        return 1.0
    return yarn_get_m(yarn.factor, yarn.mscale) / yarn_get_m(yarn.factor, yarn.mscale_all_dim)


def softmax_scale(cfg: ModelConfig) -> float:
    """(d_nope + d_rope)^-0.5 * m^2 with m = get_m(factor, mscale_all_dim) under YaRN."""
    scale = cfg.qk_head_dim ** -0.5
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_get_m(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int64 -> cos, sin float32 [..., d_rope / 2] (angles in float64)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    m = rope_mscale(cfg)
    return (angles.cos() * m).float(), (angles.sin() * m).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [..., d_rope] rotated pairwise; cos/sin broadcast to [..., d_rope / 2]. Float32 math.

    interleave pairs (x[2i], x[2i+1]) (one complex product: (x1 + i x2)(cos + i sin));
    neox pairs (x[i], x[i + d/2]). Output keeps x's layout.
    """
    xf = x.float()
    if style == "interleave":
        pairs = torch.view_as_complex(xf.reshape(*xf.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


# ---- small pieces ----

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / sqrt(mean(x^2) + eps) * weight, in float32; returns x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., E] -> int64 [..., k]: the k largest along the last dim; ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(cfg: ModelConfig, x: torch.Tensor, gate: torch.Tensor,
          bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid noaux_tc routing. x [T, D] -> (idx int64 [T, k], weight float32 [T, k]).

    The correction bias steers selection only; dropped groups become -inf.
    """
    scores = torch.sigmoid(x.float() @ gate.float().T)                     # [T, E]
    selection = scores + bias.float()
    if cfg.n_group > 1:
        tokens, experts = selection.shape
        grouped = selection.view(tokens, cfg.n_group, experts // cfg.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)               # [T, G]
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, top_indices(group_score, cfg.topk_group), True)
        selection = grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)
    idx = top_indices(selection, cfg.num_experts_per_tok)                  # [T, k]
    weight = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        weight = weight / weight.sum(-1, keepdim=True)
    return idx, weight * cfg.routed_scaling_factor


# ---- layers ----

class MLA:
    """Multi-head Latent Attention of one layer, absorbed form over the latent cache."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], prefix: str):
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.wq = w[prefix + "wq"]
        else:
            self.wq_a, self.q_a_norm, self.wq_b = (w[prefix + n] for n in ("wq_a", "q_a_norm", "wq_b"))
        self.wkv_a, self.kv_a_norm, self.wo = (w[prefix + n] for n in ("wkv_a", "kv_a_norm", "wo"))
        wkv_b = w[prefix + "wkv_b"].view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        self.heads = wkv_b.shape[0]                                         # H, or this rank's heads
        self.w_uk = wkv_b[:, :cfg.qk_nope_head_dim].contiguous()          # [H, d_nope, R]
        self.w_uv = wkv_b[:, cfg.qk_nope_head_dim:].contiguous()          # [H, d_v, R]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, D] (normed), cos/sin [M, dr/2] -> q_lat [M, H, R], q_pe [M, H, dr], c_kv [M, R], k_pe [M, dr]."""
        cfg = self.cfg
        rows = x.shape[0]
        if cfg.q_lora_rank is None:
            q = x @ self.wq.T
        else:
            q = rms_norm(x @ self.wq_a.T, self.q_a_norm, cfg.latent_norm_eps) @ self.wq_b.T
        q = q.view(rows, self.heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], cfg.rope_style)           # [M, H, dr]
        kv_a = x @ self.wkv_a.T
        c_kv = rms_norm(kv_a[..., :cfg.kv_lora_rank], self.kv_a_norm, cfg.latent_norm_eps)  # [M, R]
        k_pe = apply_rope(kv_a[..., cfg.kv_lora_rank:], cos, sin, cfg.rope_style)      # [M, dr]
        q_lat = torch.einsum("mhd,hdr->mhr", q_nope, self.w_uk)                     # [M, H, R]
        return q_lat, q_pe, c_kv, k_pe

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [M, H, R] -> [M, D] (under TP: this rank's heads' share, to be summed)."""
        o = torch.einsum("mhr,hvr->mhv", o_lat, self.w_uv)                           # [M, H, d_v]
        return o.reshape(o.shape[0], self.heads * self.cfg.v_head_dim) @ self.wo.T


class DenseMLP:
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str):
        self.w_gate, self.w_up, self.w_down = (w[prefix + n] for n in ("w_gate", "w_up", "w_down"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        return swiglu(x, self.w_gate, self.w_up, self.w_down)


class MoE:
    """Sigmoid noaux_tc routing, the routed experts (engine/moe.py), plus shared experts.

    Under expert parallelism the routed experts are this rank's, from global id `first`."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], prefix: str, first: int = 0):
        self.cfg = cfg
        self.gate, self.bias = w[prefix + "gate"], w[prefix + "e_score_correction_bias"]
        self.experts = RoutedExperts(*(w[prefix + "experts." + n] for n in ("w_gate", "w_up", "w_down")),
                                     first=first)
        self.shared = DenseMLP(w, prefix + "shared.") if cfg.n_shared_experts else None

    def __call__(self, x: torch.Tensor, real: torch.Tensor, dispatch: str) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], real bool [T] -> (out float32 [T, D], the chosen experts int64 [T, k])."""
        idx, weight = route(self.cfg, x, self.gate, self.bias)                     # [T, k]
        out = self.experts(x, idx, weight, real, dispatch)                          # float32
        if self.shared is not None:
            out = out + self.shared(x).float()
        return out, idx


class Block:
    """One pre-norm layer as per-row stages around attention (module docstring)."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], layer: int, first_expert: int = 0):
        p = f"layers.{layer}."
        self.eps = cfg.rms_norm_eps
        self.input_norm, self.post_norm = w[p + "input_layernorm"], w[p + "post_attention_layernorm"]
        self.attn = MLA(cfg, w, p + "attn.")
        self.ffn = (DenseMLP(w, p + "mlp.") if cfg.is_dense_layer(layer)
                    else MoE(cfg, w, p + "moe.", first_expert))

    def attention_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [M, D] -> (normed [M, D], q_lat [M, H, R], q_pe [M, H, dr], c_kv [M, R], k_pe [M, dr])."""
        h = rms_norm(x, self.input_norm, self.eps)
        return (h, *self.attn.project(h, cos, sin))

    def ffn_rows(self, x: torch.Tensor, real: torch.Tensor, dispatch: str,
                 scores: bool) -> tuple[torch.Tensor, ...]:
        """x [M, D], real bool [M] -> (router scores float32 [M, E] (or [M, 0]: dense layer,
        or `scores` False), experts int64 [M, k] ([M, 0] dense), FFN output [M, D] (float32
        from a MoE, x's dtype from a dense layer; under TP this rank's share))."""
        h = rms_norm(x, self.post_norm, self.eps)
        if isinstance(self.ffn, DenseMLP):
            out, experts = self.ffn(h), h.new_zeros(h.shape[0], 0, dtype=torch.int64)
        else:
            out, experts = self.ffn(h, real, dispatch)
        router = (torch.sigmoid(h.float() @ self.ffn.gate.float().T) if scores and isinstance(self.ffn, MoE)
                  else h.new_zeros(h.shape[0], 0, dtype=torch.float32))
        return router, experts, out


def _stored(name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight as the forward keeps it: routing in float32 in any dtype; norm weights rounded
    to the dtype and kept in float32 (their math is float32); the rest in the dtype."""
    if name.endswith(ROUTER_WEIGHTS):
        return value.float()
    if name == "norm" or name.endswith(("layernorm", "q_a_norm", "kv_a_norm")):
        return value.to(dtype).float()
    return value.to(dtype)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [m, ...] -> [rows, ...], zero rows appended."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


# ---- the model ----

class Transformer:
    """The target model. Weights are named as docs/fixtures.md (no ``weights/`` prefix).

    moe: the routed experts' dispatch, "grouped" or "dense" (engine/moe.py; default: the
    one for the device and dtype). invariant: batch-invariant mode (module docstring).
    capture: the divergence finder's hook (module docstring). world: this rank's place in
    the tensor-parallel group (module docstring); `weights` are the full weights.
    page_size: `new_cache` hands out paged caches of this page size (engine/cache.py);
    None, contiguous ones. `forward` takes either layout. fused: the layers as the fused
    Triton launches (engine/fused; a forward with a capture hook takes the unfused layers);
    None: in bf16 on a CUDA device on one device, with no `moe` named (either mode).
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor | np.ndarray],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention: AttentionBackend | None = None, *, invariant: bool = False,
                 moe: str | None = None, capture: Capture | None = None, world: World | None = None,
                 page_size: int | None = None, fused: bool | None = None):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Transformer: dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Transformer: device {str(device)!r} requested but CUDA is not available")
        if moe is not None and moe not in DISPATCHES:
            raise ValueError(f"Transformer: moe must be one of {DISPATCHES}, got {moe!r}")
        check_weights(cfg, weights)
        self.cfg = cfg
        self.device = torch.empty(0, device=device).device      # "cuda" -> "cuda:0", comparable with tensors
        if world is not None and world.device != self.device:
            raise ValueError(f"Transformer: rank {world.rank} computes on {world.device}, not on {self.device}")
        self.world = world
        self.dtype = dtype
        self.invariant = invariant
        attention = attention if attention is not None else torch_attention
        self.attention: AttentionBackend = invariant_form(attention) if invariant else attention
        self.tile = INVARIANT_TILE.get(self.device.type, 64) if invariant else None
        self.moe = "dense" if invariant else (moe or moe_dispatch(self.device, dtype))
        self.capture = capture
        self.page_size = page_size
        first = 0
        if world is not None:
            weights, first = shard_weights(cfg, weights, world), first_expert(cfg, world)
        w = {name: _stored(name, as_tensor(value).to(self.device), dtype) for name, value in weights.items()}
        self.embed, self.norm, self.lm_head = w["embed_tokens"], w["norm"], w["lm_head"]
        self.layers = [Block(cfg, w, i, first) for i in range(cfg.num_hidden_layers)]
        self.fused_forward = None
        if _use_fused(fused, self.device, dtype, invariant, world, moe):
            from .fused import FusedForward
            self.fused_forward = FusedForward(cfg, self.layers, self.norm, self.lm_head, invariant=invariant)
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.scale = softmax_scale(cfg)

    @classmethod
    def from_fixture(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, attention: AttentionBackend | None = None,
                     **options) -> "Transformer":
        cfg, weights = load_fixture_weights(path, dtype)
        return cls(cfg, weights, device=device, dtype=dtype, attention=attention, **options)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.allocate(self.cfg, batch, max_len, self.device, self.dtype, self.page_size)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache, *, check: bool = True) -> torch.Tensor:
        """tokens [B, N] int64, positions [B, N] int64, new_visibility [B, N, N] bool,
        n_new [B] int64, starts [B] int64 -> logits [B, N, V] float32.

        Token i < n_new[b] of request b is written to slot starts[b] + i of every layer and
        sees every slot < starts[b] plus new token j iff new_visibility[b, i, j]. Rows
        i >= n_new[b] are padding: their values are ignored and their logits are garbage.
        check: also check the values (module docstring); without it, inputs out of range
        give garbage but no error and no out-of-bounds access.
        """
        self._check_inputs(tokens, positions, new_visibility, n_new, starts, cache)
        if check:
            self._check_values(tokens, positions, new_visibility, n_new, starts, cache)
        cfg = self.cfg
        batch, n = tokens.shape
        rows = batch * n
        if rows == 0:
            return torch.zeros(batch, n, cfg.vocab_size, device=self.device)
        column = torch.arange(n, device=self.device)
        real = column[None, :] < n_new[:, None]                                     # [B, N]
        flat_real = real.reshape(rows)
        token_ids = tokens.where(real, 0).clamp(0, cfg.vocab_size - 1).reshape(rows)
        slots = (starts[:, None] + column[None, :]).remainder(cache.max_len)         # [B, N], distinct
        fused = self.fused_forward is not None and self.capture is None
        attend = bind_attention(self.attention, starts, n_new, new_visibility, cache.max_len, cache.block_table,
                                reuse_out=fused)
        keep = self._keeper(batch, n)
        cos, sin = self._rows(self._rope, positions.where(real, 0).clamp(min=0).reshape(rows))

        x = self.embed[token_ids]                                                    # [M, D]
        if fused:
            logits = self.fused_forward(x, cos, sin, cache.slot_rows(slots).reshape(rows),
                                        flat_real.view(torch.uint8), cache, attend, self.scale, batch)
            return logits.view(batch, n, -1)
        for layer, block in enumerate(self.layers):
            h, q_lat, q_pe, c_kv, k_pe = self._rows(block.attention_in, x, cos, sin)
            cache.write(layer, slots, real, c_kv.view(batch, n, -1), k_pe.view(batch, n, -1))
            o_lat = attend(q_lat.view(batch, n, *q_lat.shape[1:]), q_pe.view(batch, n, *q_pe.shape[1:]),
                           *cache.layer(layer), self.scale).reshape(q_lat.shape)   # [M, H, R]
            a = self._sum(self._rows(block.attn.output, o_lat.to(x.dtype)))           # [M, D]
            x_attn = x + a
            router, experts, f = self._rows(
                lambda x_, real_: block.ffn_rows(x_, real_, self.moe, self.capture is not None), x_attn, flat_real)
            f = self._sum(f).to(x.dtype)
            x = x_attn + f
            for name, t in (("attn_input", h), ("q_lat", q_lat), ("c_kv", c_kv), ("k_pe", k_pe),
                            ("o_lat", o_lat), ("attn_output", a), ("attn_residual", x_attn),
                            ("router_scores", router), ("experts", experts), ("ffn_output", f),
                            ("layer_output", x)):
                keep(name, layer, t)
        logits = self._rows(self._head, x)                                           # [M, V] float32
        if self.world is not None:                                                  # [M, V_r] -> [M, V]
            logits = self.world.gather(logits, cfg.vocab_size)
        keep("logits", -1, logits)
        return logits.view(batch, n, -1)

    __call__ = forward

    def _keeper(self, batch: int, n: int) -> Capture:
        """keep(name, layer, rows [M, ...]): the capture hook's call with [B, N, ...] (a no-op without one)."""
        capture = self.capture
        if capture is None:
            return lambda name, layer, t: None

        def keep(name: str, layer: int, t: torch.Tensor) -> None:
            if t.dim() != 2 or t.shape[1] > 0:                      # dense layers have no router
                capture(name, layer, t.reshape(batch, n, *t.shape[1:]))
        return keep

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A per-row stage's output [M, D]: itself on one device; under TP the sum of the ranks'
        shares (invariant mode: added in rank order, the same whatever M)."""
        if self.world is None:
            return partial
        return self.world.sum_in_rank_order(partial) if self.invariant else self.world.sum(partial)

    def _rows(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *rows: torch.Tensor):
        """fn over row-aligned tensors [M, ...] -> its outputs [M, ...]. In invariant mode fn sees
        tiles of exactly `self.tile` rows (the last zero-padded), so its kernels have one shape."""
        if self.tile is None:
            return fn(*rows)
        total, tile = rows[0].shape[0], self.tile
        pieces = []
        for begin in range(0, total, tile):
            out = fn(*(_pad_rows(r[begin:begin + tile], tile) for r in rows))
            pieces.append(out if isinstance(out, tuple) else (out,))
        outs = tuple(torch.cat(parts)[:total] for parts in zip(*pieces))
        return outs if len(outs) > 1 else outs[0]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [M] -> cos, sin float32 [M, dr / 2]."""
        return rope_cos_sin(self.cfg, positions, self.inv_freq)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, D] -> logits float32 [M, V]."""
        return (rms_norm(x, self.norm, self.cfg.rms_norm_eps) @ self.lm_head.T).float()

    def _check_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                      n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache) -> None:
        """Raise ValueError naming the first input of the wrong type, shape, dtype or device
        (host-side: reads no tensor values)."""
        named = {"tokens": tokens, "positions": positions, "new_visibility": new_visibility,
                 "n_new": n_new, "starts": starts}
        for name, t in named.items():
            _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
            _need(t.device == self.device, f"{name} is on {t.device}, the model on {self.device}")
            want = torch.bool if name == "new_visibility" else torch.int64
            _need(t.dtype == want, f"{name} must be {want}, got {t.dtype}")
        _need(tokens.dim() == 2, f"tokens must be [B, N], got shape {list(tokens.shape)}")
        batch, n = tokens.shape
        _need(positions.shape == (batch, n), f"positions shape {list(positions.shape)} != tokens {[batch, n]}")
        _need(new_visibility.shape == (batch, n, n),
              f"new_visibility shape {list(new_visibility.shape)} != {[batch, n, n]}")
        _need(n_new.shape == (batch,), f"n_new shape {list(n_new.shape)} != {[batch]}")
        _need(starts.shape == (batch,), f"starts shape {list(starts.shape)} != {[batch]}")
        _need(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache).__name__}")
        _need(cache.device == self.device, f"cache is on {cache.device}, the model on {self.device}")
        _need(cache.dtype == self.dtype, f"cache dtype {cache.dtype} != model dtype {self.dtype}")
        _need(cache.batch == batch, f"cache holds {cache.batch} requests, the inputs {batch}")
        _need(cache.num_layers == self.cfg.num_hidden_layers,
              f"cache has {cache.num_layers} layers, the model {self.cfg.num_hidden_layers}")
        _need(batch == 0 or n <= cache.max_len,
              f"{n} new-token columns do not fit the cache's {cache.max_len} slots (prompt or tree "
              f"longer than the cache)")

    def _check_values(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                      n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache) -> None:
        """Raise ValueError naming the first input value out of range (reads the inputs back)."""
        batch, n = tokens.shape
        if batch == 0:
            return
        _need(bool(((n_new >= 0) & (n_new <= n)).all()), f"n_new must lie in [0, {n}], got {n_new.tolist()}")
        _need(bool((starts >= 0).all()), f"starts must be >= 0, got {starts.tolist()}")
        ends = starts + n_new
        over = (ends > cache.max_len).nonzero().flatten()
        if over.numel():
            b = int(over[0])
            _need(False, f"request {b} needs cache slots up to {int(ends[b])} but the cache holds "
                         f"{cache.max_len} (prompt or tree longer than the cache)")
        real = torch.arange(n, device=self.device)[None, :] < n_new[:, None]
        _need(bool(((tokens >= 0) & (tokens < self.cfg.vocab_size) | ~real).all()),
              f"tokens must lie in [0, {self.cfg.vocab_size}) on real rows")
        _need(bool(((positions >= 0) | ~real).all()), "positions must be >= 0 on real rows")
        _need(bool((new_visibility.diagonal(dim1=1, dim2=2) | ~real).all()),
              "new_visibility must let every real token see itself (new_visibility[b, i, i])")


def _use_fused(fused: bool | None, device: torch.device, dtype: torch.dtype, invariant: bool,
               world: World | None, moe: str | None) -> bool:
    """Whether the forward takes the fused layers (engine/fused): asked for, or by default in
    bf16 on a CUDA device on one device with no MoE dispatch named, where Triton is, in either
    mode (invariant mode: their batch-invariant form). float32 keeps the unfused layers by
    default: its fused experts (exact float32 Triton tiles) are slower than cuBLAS
    (docs/engine-fused.md), and invariant mode's tiled forward (docs/precision.md, section 3)."""
    if fused is None:
        return (device.type == "cuda" and dtype == torch.bfloat16 and world is None
                and moe is None and importlib.util.find_spec("triton") is not None)
    if not fused:
        return False
    for ok, why in ((world is None, "the fused layers run on one device"),
                    (moe is None, f"the fused layers have their own MoE dispatch, not moe={moe!r}"),
                    (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
                     f"the fused layers are Triton kernels: a CUDA device, or TRITON_INTERPRET=1 on {device}"),
                    (importlib.util.find_spec("triton") is not None, "Triton is not installed")):
        if not ok:
            raise ValueError(f"Transformer: fused=True, but {why}")
    return True


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"Transformer.forward: {message}")
