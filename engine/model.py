"""The torch DeepSeek-V3 / Kimi-K2 target model: MLA + sigmoid noaux_tc MoE.

The math is MODEL.md (restated in docs/model.md): pre-norm layers, Multi-head
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

`Transformer.capture`, None by default, is called as capture(name, layer, tensor)
at the points named in CAPTURE_POINTS (listed in compute order; docs/precision.md):
the divergence finder (engine/diverge.py) reads every layer's intermediates
through it. Points up to the attention output and `layer_out` / `logits` pass
[B, N, ...] tensors (padding rows included); the FFN points (`ffn_in`,
`router_scores`, `experts`, `ffn_out`) pass [M, ...], the M real rows in
request-major order. `logits` comes with layer = num_hidden_layers.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from kdtr_format import ModelConfig

from .attention import AttentionBackend, torch_attention
from .cache import KVCache
from .weights import as_tensor, check_weights, load_fixture_weights

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)

Capture = Callable[[str, int, torch.Tensor], None]      # capture(name, layer, tensor)
Tap = Callable[..., None]                               # one layer's capture: tap(name=tensor, ...)
CAPTURE_POINTS = ("attn_in", "q_lat", "q_pe", "c_kv", "k_pe", "o_lat", "attn_out", "residual",
                  "ffn_in", "router_scores", "experts", "ffn_out", "layer_out", "logits")


# ---- rotary embedding and softmax scale (MODEL.md "Rotary embedding") ----

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

    interleave pairs (x[2i], x[2i+1]); neox pairs (x[i], x[i + d/2]). Output keeps x's layout.
    """
    xf = x.float()
    if style == "interleave":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


# ---- small pieces ----

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / sqrt(mean(x^2) + eps) * weight, in float32; returns x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]: W_down (silu(W_gate x) * (W_up x))."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., E] -> int64 [..., k]: the k largest along the last dim; ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(cfg: ModelConfig, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
          tap: Tap | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid noaux_tc routing. x [T, D] -> (idx int64 [T, k], weight float32 [T, k]).

    The correction bias steers selection only; dropped groups become -inf.
    """
    scores = torch.sigmoid(x.float() @ gate.float().T)                     # [T, E]
    if tap: tap(router_scores=scores)
    selection = scores + bias.float()
    if cfg.n_group > 1:
        tokens, experts = selection.shape
        grouped = selection.view(tokens, cfg.n_group, experts // cfg.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)               # [T, G]
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, top_indices(group_score, cfg.topk_group), True)
        selection = grouped.masked_fill(~kept[..., None], float("-inf")).view(tokens, experts)
    idx = top_indices(selection, cfg.num_experts_per_tok)                  # [T, k]
    if tap: tap(experts=idx)
    weight = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        weight = weight / weight.sum(-1, keepdim=True)
    return idx, weight * cfg.routed_scaling_factor


def _layer_tap(capture: Capture | None, layer: int) -> Tap | None:
    """capture bound to one layer as tap(name=tensor, ...), or None (the hot path tests `if tap:`)."""
    if capture is None:
        return None

    def tap(**tensors: torch.Tensor) -> None:
        for name, tensor in tensors.items():
            capture(name, layer, tensor)
    return tap


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
        wkv_b = w[prefix + "wkv_b"].view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                        cfg.kv_lora_rank)
        self.w_uk = wkv_b[:, :cfg.qk_nope_head_dim].contiguous()          # [H, d_nope, R]
        self.w_uv = wkv_b[:, cfg.qk_nope_head_dim:].contiguous()          # [H, d_v, R]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                 layer: int, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                 attention: AttentionBackend, scale: float, tap: Tap | None = None) -> torch.Tensor:
        """x [B, N, D] -> [B, N, D]; writes the real tokens' c_kv / k_pe into `cache` first."""
        cfg = self.cfg
        batch, n, _ = x.shape
        if cfg.q_lora_rank is None:
            q = x @ self.wq.T
        else:
            q = rms_norm(x @ self.wq_a.T, self.q_a_norm, cfg.latent_norm_eps) @ self.wq_b.T
        q = q.view(batch, n, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], cfg.rope_style)   # [B, N, H, dr]
        kv_a = x @ self.wkv_a.T
        c_kv = rms_norm(kv_a[..., :cfg.kv_lora_rank], self.kv_a_norm, cfg.latent_norm_eps)  # [B, N, R]
        k_pe = apply_rope(kv_a[..., cfg.kv_lora_rank:], cos, sin, cfg.rope_style)      # [B, N, dr]
        if tap: tap(c_kv=c_kv, k_pe=k_pe)

        rows, cols, slots = write
        cache.c_kv[layer, rows, slots] = c_kv[rows, cols]
        cache.k_pe[layer, rows, slots] = k_pe[rows, cols]

        q_lat = torch.einsum("bnhd,hdr->bnhr", q_nope, self.w_uk)                   # [B, N, H, R]
        if tap: tap(q_lat=q_lat, q_pe=q_pe)
        o_lat = attention(q_lat, q_pe, cache.c_kv[layer], cache.k_pe[layer], starts, n_new,
                          new_visibility, scale)
        if tap: tap(o_lat=o_lat)
        o = torch.einsum("bnhr,hvr->bnhv", o_lat.to(x.dtype), self.w_uv)             # [B, N, H, d_v]
        return o.reshape(batch, n, -1) @ self.wo.T


class DenseMLP:
    def __init__(self, w: Mapping[str, torch.Tensor], prefix: str):
        self.w_gate, self.w_up, self.w_down = (w[prefix + n] for n in ("w_gate", "w_up", "w_down"))

    def __call__(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        return swiglu(x, self.w_gate, self.w_up, self.w_down)


class MoE:
    """Routed experts dispatched by expert (tokens sorted by expert id), plus shared experts."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], prefix: str):
        self.cfg = cfg
        self.gate, self.bias = w[prefix + "gate"], w[prefix + "e_score_correction_bias"]
        self.w_gate, self.w_up, self.w_down = (w[prefix + "experts." + n] for n in ("w_gate", "w_up", "w_down"))
        self.shared = DenseMLP(w, prefix + "shared.") if cfg.n_shared_experts else None

    def __call__(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        k = self.cfg.num_experts_per_tok
        idx, weight = route(self.cfg, x, self.gate, self.bias, tap)                # [T, k]
        flat_expert = idx.flatten()                                                 # [T * k]
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.cfg.n_routed_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[begin:begin + count]                                      # token * k + slot
            begin += count
            tokens = pairs // k
            y = swiglu(x[tokens], self.w_gate[expert], self.w_up[expert], self.w_down[expert])
            out.index_add_(0, tokens, y.float() * weight.flatten()[pairs, None])
        if self.shared is not None:
            out += self.shared(x).float()
        return out.to(x.dtype)


class Block:
    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], layer: int):
        p = f"layers.{layer}."
        self.eps = cfg.rms_norm_eps
        self.input_norm, self.post_norm = w[p + "input_layernorm"], w[p + "post_attention_layernorm"]
        self.attn = MLA(cfg, w, p + "attn.")
        self.ffn = DenseMLP(w, p + "mlp.") if cfg.is_dense_layer(layer) else MoE(cfg, w, p + "moe.")


# ---- the model ----

class Transformer:
    """The target model. Weights are named as docs/fixtures.md (no ``weights/`` prefix)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor | np.ndarray],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention: AttentionBackend | None = None, capture: Capture | None = None):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Transformer: dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Transformer: device {str(device)!r} requested but CUDA is not available")
        check_weights(cfg, weights)
        self.cfg = cfg
        self.device = torch.empty(0, device=device).device      # "cuda" -> "cuda:0", comparable with tensors
        self.dtype = dtype
        self.attention: AttentionBackend = attention if attention is not None else torch_attention
        self.capture = capture
        router = ("moe.gate", "moe.e_score_correction_bias")    # routing stays float32 in any dtype
        w = {name: as_tensor(value).to(device=self.device,
                                       dtype=torch.float32 if name.endswith(router) else dtype)
             for name, value in weights.items()}
        self.embed, self.norm, self.lm_head = w["embed_tokens"], w["norm"], w["lm_head"]
        self.layers = [Block(cfg, w, i) for i in range(cfg.num_hidden_layers)]
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.scale = softmax_scale(cfg)

    @classmethod
    def from_fixture(cls, path: str | os.PathLike, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32,
                     attention: AttentionBackend | None = None) -> "Transformer":
        cfg, weights = load_fixture_weights(path)
        return cls(cfg, weights, device=device, dtype=dtype, attention=attention)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.allocate(self.cfg, batch, max_len, self.device, self.dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, N] int64, positions [B, N] int64, new_visibility [B, N, N] bool,
        n_new [B] int64, starts [B] int64 -> logits [B, N, V] float32.

        Token i < n_new[b] of request b is written to slot starts[b] + i of every layer and
        sees every slot < starts[b] plus new token j iff new_visibility[b, i, j]. Rows
        i >= n_new[b] are padding: their values are ignored and their logits are garbage.
        """
        self._check_inputs(tokens, positions, new_visibility, n_new, starts, cache)
        cfg = self.cfg
        batch, n = tokens.shape
        real = torch.arange(n, device=self.device)[None, :] < n_new[:, None]       # [B, N]
        tokens = tokens.where(real, 0)
        positions = positions.where(real, 0)
        rows, cols = real.nonzero(as_tuple=True)
        write = (rows, cols, starts[rows] + cols)
        cos, sin = rope_cos_sin(cfg, positions, self.inv_freq)                      # [B, N, dr/2]

        x = self.embed[tokens]                                                       # [B, N, D]
        for layer, block in enumerate(self.layers):
            tap = _layer_tap(self.capture, layer)
            attn_in = rms_norm(x, block.input_norm, block.eps)
            attn_out = block.attn(attn_in, cos, sin, cache, layer, write, starts, n_new, new_visibility,
                                  self.attention, self.scale, tap)
            x = x + attn_out
            h = rms_norm(x[real], block.post_norm, block.eps)                        # [M, D] real rows
            if tap: tap(attn_in=attn_in, attn_out=attn_out, residual=x, ffn_in=h)
            ffn_out = block.ffn(h, tap)
            x = x.index_put((rows, cols), ffn_out, accumulate=True)
            if tap: tap(ffn_out=ffn_out, layer_out=x)
        logits = rms_norm(x, self.norm, cfg.rms_norm_eps) @ self.lm_head.T
        if self.capture: self.capture("logits", cfg.num_hidden_layers, logits)
        return logits.float()

    __call__ = forward

    def _check_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                      n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache) -> None:
        """Raise ValueError naming the first malformed input (shape, dtype, device, range)."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"Transformer.forward: {message}")

        named = {"tokens": tokens, "positions": positions, "new_visibility": new_visibility,
                 "n_new": n_new, "starts": starts}
        for name, t in named.items():
            need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
            need(t.device == self.device, f"{name} is on {t.device}, the model on {self.device}")
            want = torch.bool if name == "new_visibility" else torch.int64
            need(t.dtype == want, f"{name} must be {want}, got {t.dtype}")
        need(tokens.dim() == 2, f"tokens must be [B, N], got shape {list(tokens.shape)}")
        batch, n = tokens.shape
        need(positions.shape == (batch, n), f"positions shape {list(positions.shape)} != tokens {[batch, n]}")
        need(new_visibility.shape == (batch, n, n),
             f"new_visibility shape {list(new_visibility.shape)} != {[batch, n, n]}")
        need(n_new.shape == (batch,), f"n_new shape {list(n_new.shape)} != {[batch]}")
        need(starts.shape == (batch,), f"starts shape {list(starts.shape)} != {[batch]}")
        need(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache).__name__}")
        need(cache.device == self.device, f"cache is on {cache.device}, the model on {self.device}")
        need(cache.dtype == self.dtype, f"cache dtype {cache.dtype} != model dtype {self.dtype}")
        need(cache.batch == batch, f"cache holds {cache.batch} requests, the inputs {batch}")
        need(cache.num_layers == self.cfg.num_hidden_layers,
             f"cache has {cache.num_layers} layers, the model {self.cfg.num_hidden_layers}")
        if batch == 0:
            return
        need(bool(((n_new >= 0) & (n_new <= n)).all()), f"n_new must lie in [0, {n}], got {n_new.tolist()}")
        need(bool((starts >= 0).all()), f"starts must be >= 0, got {starts.tolist()}")
        ends = starts + n_new
        over = (ends > cache.max_len).nonzero().flatten()
        if over.numel():
            b = int(over[0])
            need(False, f"request {b} needs cache slots up to {int(ends[b])} but the cache holds "
                        f"{cache.max_len} (prompt or tree longer than the cache)")
        real = torch.arange(n, device=self.device)[None, :] < n_new[:, None]
        need(bool(((tokens >= 0) & (tokens < self.cfg.vocab_size) | ~real).all()),
             f"tokens must lie in [0, {self.cfg.vocab_size}) on real rows")
        need(bool(((positions >= 0) | ~real).all()), "positions must be >= 0 on real rows")
        need(bool((new_visibility.diagonal(dim1=1, dim2=2) | ~real).all()),
             "new_visibility must let every real token see itself (new_visibility[b, i, i])")
