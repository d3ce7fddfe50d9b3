"""The float64 numpy reference of a DeepSeek-V3 / Kimi-K2 model (MLA + sigmoid MoE).

The math is docs/model.md. One function, `Model.forward`,
serves prefill, autoregressive decode and tree verify: it takes the new tokens,
their positions, a visibility mask over every cache slot up to the last new
token, and the cache slot where the first new token goes.

Everything runs in float64 from the stored weights (float32, or the bf16 / float16 /
float32 a checkpoint holds; widening is exact): `Float64Weights` widens tensors
once within a memory budget and the rest (a K2-sized embedding and head) where
they are used, a block of rows at a time on every thread `set_threads` allows, so
memory stays bounded (the numbers: those of widening up front, to BLAS rounding).
Shapes: n new tokens,
S = start + n keys, D hidden, H heads, R = kv_lora_rank, dn / dr / dv the nope /
rope / value head dims, E routed experts, k experts per token, V vocab.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import ml_dtypes
import numpy as np

from kdtr_format import ModelConfig

from .weights import weight_shapes

Attention = Literal["absorbed", "naive"]


# ---------------------------------------------------------------------------- pieces

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d], w [d] -> [..., d] float64: x / sqrt(mean(x^2) + eps) * w."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def yarn_get_m(factor: float, mscale: float) -> float:
    """get_m(f, s) = 0.1 s ln f + 1, or 1 when f <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """-> [dr/2]: theta^(-2i/dr), with YaRN's ramp between theta^(-2i/dr)/factor (low
    frequencies) and theta^(-2i/dr) (high frequencies) when rope_scaling is set."""
    d, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    yarn = cfg.rope_scaling
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (d * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    # Clamped as DeepSeek-V3's inference/model.py and HF do: low from below, high from above, only.
    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / yarn.factor * ramp + inv_freq * (1.0 - ramp)


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [n] -> cos, sin [n, dr/2], scaled by get_m(factor, mscale) /
    get_m(factor, mscale_all_dim) under YaRN."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    yarn = cfg.rope_scaling
    gain = 1.0 if yarn is None else (yarn_get_m(yarn.factor, yarn.mscale)
                                     / yarn_get_m(yarn.factor, yarn.mscale_all_dim))
    return np.cos(angles) * gain, np.sin(angles) * gain


def apply_rope(x: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x [..., n, dr], positions [n] -> [..., n, dr], rotated pairwise.

    `interleave` pairs (x[2i], x[2i+1]) (the official layout); `neox` pairs
    (x[i], x[i + dr/2]). Pair i turns by positions * inv_freq[i].
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim < 2 or x.shape[-2:] != (len(positions), cfg.qk_rope_head_dim):
        raise ValueError(f"apply_rope: x has shape {x.shape}, expected [..., {len(positions)} "
                         f"positions, qk_rope_head_dim {cfg.qk_rope_head_dim}]")
    cos, sin = rope_cos_sin(cfg, positions)
    if cfg.rope_style == "interleave":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if cfg.rope_style == "interleave":
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def softmax_scale(cfg: ModelConfig) -> float:
    """(dn + dr)^-0.5 * m^2, m = get_m(factor, mscale_all_dim) under YaRN, else 1."""
    yarn = cfg.rope_scaling
    m = 1.0 if yarn is None else yarn_get_m(yarn.factor, yarn.mscale_all_dim)
    return cfg.qk_head_dim ** -0.5 * m * m


def _masked_softmax(scores: np.ndarray, visibility: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores [n, H, S], visibility [n, S] -> probabilities [n, H, S], lse [n, H]."""
    masked = np.where(visibility[:, None, :], scores, -np.inf)
    peak = masked.max(axis=-1, keepdims=True)
    e = np.exp(masked - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, (peak + np.log(total))[..., 0]


def absorbed_attention(q_lat: np.ndarray, q_pe: np.ndarray, c_kv: np.ndarray, k_pe: np.ndarray,
                       visibility: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """MLA attention in the absorbed form: the tree-verify kernel's reference.

    q_lat [n, H, R], q_pe [n, H, dr], c_kv [S, R], k_pe [S, dr], visibility [n, S] bool
    -> o_lat [n, H, R], lse [n, H] (natural log of sum_s exp(score), over visible s).
    score(t, h, s) = (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s]) * scale.
    Inputs are widened to float64. Every query must see at least one key.
    """
    q_lat, q_pe, c_kv, k_pe = (np.asarray(a, dtype=np.float64) for a in (q_lat, q_pe, c_kv, k_pe))
    if (q_lat.ndim, q_pe.ndim, c_kv.ndim, k_pe.ndim) != (3, 3, 2, 2):
        raise ValueError(f"absorbed_attention: expected q_lat [n, H, R], q_pe [n, H, dr], c_kv "
                         f"[S, R], k_pe [S, dr], got ndim {q_lat.ndim}, {q_pe.ndim}, {c_kv.ndim}, "
                         f"{k_pe.ndim}")
    n, H, R = q_lat.shape
    S = c_kv.shape[0]
    if q_pe.shape[:2] != (n, H) or c_kv.shape != (S, R) or k_pe.shape != (S, q_pe.shape[2]):
        raise ValueError(f"absorbed_attention: shapes do not fit: q_lat {q_lat.shape}, "
                         f"q_pe {q_pe.shape}, c_kv {c_kv.shape}, k_pe {k_pe.shape}")
    _check_visibility(visibility, (n, S))
    scores = ((q_lat.reshape(n * H, R) @ c_kv.T + q_pe.reshape(n * H, -1) @ k_pe.T)
              .reshape(n, H, S) * scale)
    p, lse = _masked_softmax(scores, visibility)
    return (p.reshape(n * H, S) @ c_kv).reshape(n, H, R), lse


def _check_visibility(visibility: np.ndarray, shape: tuple[int, int]) -> None:
    if not isinstance(visibility, np.ndarray) or visibility.dtype != np.bool_:
        raise ValueError(f"visibility: must be a bool numpy array, got "
                         f"{getattr(visibility, 'dtype', type(visibility).__name__)}")
    if visibility.shape != shape:
        raise ValueError(f"visibility: shape {visibility.shape}, expected {shape} "
                         "(new tokens, start + new tokens)")
    blind = np.flatnonzero(~visibility.any(axis=1))
    if blind.size:
        raise ValueError(f"visibility: row {blind[0]} sees no key")


def _selection(cfg: ModelConfig, x: np.ndarray, gate: np.ndarray,
               bias: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """-> scores s [n, E], the selection scores [n, E] (s + bias, dropped groups -inf) and the
    group scores [n, G] (None without groups); see `route`."""
    x, gate, bias = (np.asarray(a, dtype=np.float64) for a in (x, gate, bias))
    n = x.shape[0]
    E, G = cfg.n_routed_experts, cfg.n_group
    s = np.exp(-np.logaddexp(0.0, -(x @ gate.T)))
    s_sel = s + bias
    if G == 1:
        return s, s_sel, None
    grouped = s_sel.reshape(n, G, E // G)
    group_score = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :cfg.topk_group]
    keep = np.zeros((n, G), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=-1)
    return s, np.where(keep[:, :, None], grouped, -np.inf).reshape(n, E), group_score


def route(cfg: ModelConfig, x: np.ndarray, gate: np.ndarray,
          bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid noaux_tc routing. x [n, D], gate [E, D], bias [E] -> idx [n, k] int64,
    weight [n, k] float64.

    s = sigmoid(x @ gate.T); the bias is added for selection only. With n_group > 1,
    a group scores the sum of its two best biased scores, the topk_group best groups
    stay and the others' entries become -inf. idx = the k best biased scores (ties:
    the lower index; groups likewise), in descending order. weight = s[idx],
    divided by its sum when norm_topk_prob, times routed_scaling_factor.
    """
    s, s_sel, _ = _selection(cfg, x, gate, bias)
    idx = np.argsort(-s_sel, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]
    weight = np.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob:
        weight = weight / weight.sum(axis=-1, keepdims=True)
    return idx.astype(np.int64), weight * cfg.routed_scaling_factor


def router_margins(cfg: ModelConfig, x: np.ndarray, gate: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x [n, D] -> [n] float64: how far each token's routing is from changing, the smallest
    of the gap between the k-th and (k+1)-th selection score among the kept groups and, with
    n_group > 1, the gap between the topk_group-th and next group score (inf when no
    such pair exists). A rounding error below half of it cannot change the chosen experts."""
    _, s_sel, group_score = _selection(cfg, x, gate, bias)
    k = cfg.num_experts_per_tok
    margins = _boundary_gap(s_sel, k)
    if group_score is not None:
        margins = np.minimum(margins, _boundary_gap(group_score, cfg.topk_group))
    return margins


def _boundary_gap(values: np.ndarray, k: int) -> np.ndarray:
    """[n, m] -> [n]: the k-th largest minus the (k+1)-th (inf when there is no finite (k+1)-th)."""
    if values.shape[1] <= k:
        return np.full(len(values), np.inf)
    top = -np.sort(-values, axis=-1)
    gap = top[:, k - 1] - top[:, k]
    return np.where(np.isfinite(top[:, k]), gap, np.inf)


def swiglu(x: np.ndarray, project: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
    """x [n, D] -> [n, D]: W_down (silu(W_gate x) * W_up x), w_gate / w_up [I, D], w_down [D, I],
    where project(v, "w_gate") = v @ w_gate.T (and so for "w_up", "w_down")."""
    g = project(x, "w_gate")
    return project(g / (1.0 + np.exp(-g)) * project(x, "w_up"), "w_down")


def causal_visibility(n: int, start: int) -> np.ndarray:
    """-> [n, start + n] bool: new token i (at slot start + i) sees slots 0 .. start + i."""
    return np.arange(start + n)[None, :] <= start + np.arange(n)[:, None]


# ---------------------------------------------------------------------------- cache

@dataclass
class KVCache:
    """The MLA cache: per layer, the latent c_kv [max_len, R] and the rotary key
    k_pe [max_len, dr], float64. Slot t holds the token written there last."""

    c_kv: list[np.ndarray]
    k_pe: list[np.ndarray]

    @classmethod
    def new(cls, cfg: ModelConfig, max_len: int) -> "KVCache":
        if not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool) or max_len < 1:
            raise ValueError(f"max_len: must be a positive integer, got {max_len!r}")
        layers = range(cfg.num_hidden_layers)
        return cls(c_kv=[np.zeros((max_len, cfg.kv_lora_rank)) for _ in layers],
                   k_pe=[np.zeros((max_len, cfg.qk_rope_head_dim)) for _ in layers])

    @property
    def max_len(self) -> int:
        return self.c_kv[0].shape[0]


# ---------------------------------------------------------------------------- weights

# Float64 bytes of weights widened once, smallest first (a third of the machine's memory): at K2's dims
# every tensor but the embedding and the head, whose float64 forms would take 9.4 GB each.
WIDEN_BUDGET = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3 if hasattr(os, "sysconf") else 1 << 33
BLOCK_ELEMENTS = 1 << 18        # `project` widens a larger one a block of about this many at a time (2 MiB)
NARROW = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16))
BF16 = np.dtype(ml_dtypes.bfloat16)
_threads = 1                    # workers of `project`'s blocks (set_threads)
_pool: ThreadPoolExecutor | None = None


def set_threads(threads: int) -> None:
    """How many threads widen and multiply the blocks of `Float64Weights.project` (1: the caller's
    alone). The numbers do not depend on it: every block is the same product on any thread."""
    global _threads, _pool
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads: must be a positive integer, got {threads!r}")
    if threads != _threads and _pool is not None:
        _pool.shutdown()
        _pool = None
    _threads = threads


def _blocks_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads, thread_name_prefix="refgen-blocks")
    return _pool


class _Scratch(threading.local):
    """Each thread's block: float64 [BLOCK_ELEMENTS] and, for bf16, the float32 words whose high
    halves take the bf16 bits (the low halves stay zero: widening bf16 to float32 exactly)."""

    def __init__(self) -> None:
        self.block = np.empty(0)
        self.words = np.zeros(0, dtype=np.uint16)

    def get(self, size: int, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
        if self.block.size < size:
            self.block = np.empty(size)
        if bf16 and self.words.size < 2 * size:
            self.words = np.zeros(2 * size, dtype=np.uint16)
        return self.block, self.words


_SCRATCH = _Scratch()


def _widen(block: np.ndarray, narrow: np.ndarray, words: np.ndarray) -> None:
    """block[...] = narrow widened exactly to float64 (bf16 through its float32 bits: numpy's own
    loops, several times faster than a bf16 cast)."""
    if narrow.dtype == BF16 and sys.byteorder == "little":
        halves = words[:2 * narrow.size]
        halves[1::2] = narrow.reshape(-1).view(np.uint16)
        np.copyto(block.reshape(-1), halves.view(np.float32))
    else:
        np.copyto(block, narrow, casting="unsafe")


def _project_blocks(x: np.ndarray, w: np.ndarray, out: np.ndarray, starts: range, step: int) -> None:
    """out[:, r:r + step] = x @ widened(w[r:r + step]).T for each r of `starts`."""
    d = w.shape[1]
    block, words = _SCRATCH.get(step * d, w.dtype == BF16)
    for r in starts:
        rows = w[r:r + step]
        wide = block[:rows.size].reshape(rows.shape)
        _widen(wide, rows, words)
        out[:, r:r + len(rows)] = x @ wide.T


class Float64Weights:
    """Weights as the reference reads them, always float64. Tensors are widened once, the
    smallest first, while their float64 forms fit in `budget` bytes; a larger one of a narrow
    float dtype stays as given (a memory map, say) and is widened where it is used: by rows
    (`rows`, an embedding row or an expert), or a block of rows at a time (`project`, every
    matrix product with it): blocks of about BLOCK_ELEMENTS, small enough to stay in the CPU's
    cache between widening and the product, shared among `set_threads` threads. Widening is
    exact, so `rows` and `w[name]` give the numbers of widening up front bit for bit; a product
    by blocks differs from the whole product only as BLAS rounds blocks of other shapes (about
    1e-15 relative, inside a regeneration's tolerance), and not with the number of threads. The
    committed presets' weights are a few MB, widened once, so their fixtures are unchanged."""

    def __init__(self, weights: Mapping[str, np.ndarray], budget: int = WIDEN_BUDGET) -> None:
        self._stored = {}
        arrays = {name: np.asarray(value) for name, value in weights.items()}
        left = budget
        for name in sorted(arrays, key=lambda n: arrays[n].size):
            value = arrays[name]
            if value.dtype in NARROW and value.size * 8 > left:
                self._stored[name] = value
                continue
            left -= value.size * 8 if value.dtype != np.float64 else 0
            self._stored[name] = np.asarray(value, dtype=np.float64)
        self._stored = {name: self._stored[name] for name in arrays}

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self._stored[name], dtype=np.float64)

    def rows(self, name: str, index) -> np.ndarray:
        """w[name][index] in float64 (an embedding row, one expert of a stacked tensor)."""
        return np.asarray(self._stored[name][index], dtype=np.float64)

    def project(self, x: np.ndarray, name: str, index: int | None = None) -> np.ndarray:
        """x [n, d], W = w[name] (or w[name][index]) [m, d] -> x @ W.T [n, m]."""
        w = self._stored[name] if index is None else self._stored[name][index]
        if w.dtype == np.float64:
            return x @ w.T
        m, d = w.shape
        step = max(1, min(m, BLOCK_ELEMENTS // d))
        out = np.empty((x.shape[0], m))
        blocks = range(0, m, step)
        workers = min(_threads, len(blocks))
        if workers == 1:
            _project_blocks(x, w, out, blocks, step)
            return out
        share = -(-len(blocks) // workers)          # contiguous runs of blocks, one per worker
        runs = [blocks[k * share:(k + 1) * share] for k in range(workers)]
        for done in [_blocks_pool().submit(_project_blocks, x, w, out, run, step) for run in runs]:
            done.result()
        return out


# ---------------------------------------------------------------------------- model

class Model:
    """The reference model. `attention` picks the MLA form: "absorbed" (what engines
    run: queries folded into the latent space) or "naive" (keys and values expanded
    per head); the two agree to rounding. `capture`, None by default, is called as
    capture("ffn_in", layer, y) with every layer's FFN input y [n, D] (the normed
    residual; bf16 fixtures take the router margins from it)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray],
                 attention: Attention = "absorbed", widen_budget: int = WIDEN_BUDGET,
                 capture: Callable[[str, int, np.ndarray], None] | None = None) -> None:
        if attention not in ("absorbed", "naive"):
            raise ValueError(f"attention: must be 'absorbed' or 'naive', got {attention!r}")
        shapes = weight_shapes(cfg)
        missing = [name for name in shapes if name not in weights]
        if missing:
            raise ValueError(f"weights: missing {missing[0]!r} ({len(missing)} missing)")
        extra = sorted(set(weights) - set(shapes))
        if extra:
            raise ValueError(f"weights: unexpected {extra[0]!r} for this config")
        for name, shape in shapes.items():
            if tuple(np.shape(weights[name])) != shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(np.shape(weights[name]))}, "
                                 f"expected {shape}")
        self.cfg = cfg
        self.attention = attention
        self.capture = capture
        self.w = Float64Weights({name: weights[name] for name in shapes}, widen_budget)
        self.scale = softmax_scale(cfg)
        H, dn, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
        # W_kvb per head (views): W_UK [H, dn, R] (first dn rows), then W_UV [H, dv, R].
        wkv_b = [self.w[f"layers.{i}.attn.wkv_b"].reshape(H, dn + dv, R)
                 for i in range(cfg.num_hidden_layers)]
        self.w_uk = [w[:, :dn] for w in wkv_b]
        self.w_uv = [w[:, dn:] for w in wkv_b]

    # -------------------------------------------------------------- entry points

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                cache: KVCache, start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start + n] bool -> logits [n, V] float64.

        Writes token i's c_kv / k_pe at slot start + i of every layer, then query i
        attends to slot s iff visibility[i, s]. Prefill (causal, start 0), decode
        (one token, all slots visible) and tree verify (ancestors only) are all this.
        """
        hidden = self.hidden_states(tokens, positions, visibility, cache, start)[-1]
        return self.w.project(rms_norm(hidden, self.w["norm"], self.cfg.rms_norm_eps), "lm_head")

    def prefill(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """tokens [m] -> logits [m, V]: causal, positions 0 .. m-1, cache slots 0 .. m-1."""
        m = len(tokens)
        return self.forward(tokens, np.arange(m), causal_visibility(m, 0), cache, 0)

    def hidden_states(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                      cache: KVCache, start: int) -> list[np.ndarray]:
        """Same inputs and cache writes as `forward` -> the residual stream [n, D] after
        the embedding and after each layer (num_hidden_layers + 1 arrays)."""
        tokens, positions = self._check_inputs(tokens, positions, visibility, cache, start)
        return self.residual_stream(self.w.rows("embed_tokens", tokens), positions, visibility, cache, start)

    def residual_stream(self, x: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                        cache: KVCache, start: int) -> list[np.ndarray]:
        """The layers from their input x [n, D] (the embedding, or an MTP module's eh_proj output;
        positions and visibility as `forward`, not checked again) -> [x, the stream after each layer]."""
        stream = [x]
        for i in range(self.cfg.num_hidden_layers):
            x = self._layer(i, x, positions, visibility, cache, start)
            stream.append(x)
        return stream

    # -------------------------------------------------------------- layers

    def _layer(self, i: int, x: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
               cache: KVCache, start: int) -> np.ndarray:
        """x [n, D] -> [n, D]: pre-norm attention, then pre-norm dense MLP or MoE."""
        eps, p = self.cfg.rms_norm_eps, f"layers.{i}."
        h = x + self._attention(i, rms_norm(x, self.w[p + "input_layernorm"], eps),
                                positions, visibility, cache, start)
        y = rms_norm(h, self.w[p + "post_attention_layernorm"], eps)
        if self.capture is not None:
            self.capture("ffn_in", i, y)
        if self.cfg.is_dense_layer(i):
            return h + swiglu(y, lambda v, name: self.w.project(v, p + "mlp." + name))
        return h + self._moe(i, y)

    def _attention(self, i: int, x: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                   cache: KVCache, start: int) -> np.ndarray:
        """x [n, D] (normed) -> [n, D]. Writes this layer's cache slots start .. start+n-1."""
        cfg, w, p = self.cfg, self.w, f"layers.{i}.attn."
        n, H, dn, R = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = w.project(x, p + "wq")
        else:
            q = w.project(rms_norm(w.project(x, p + "wq_a"), w[p + "q_a_norm"], cfg.latent_norm_eps),
                          p + "wq_b")
        q = q.reshape(n, H, cfg.qk_head_dim)
        q_nope = q[..., :dn]                                                   # [n, H, dn]
        q_pe = apply_rope(q[..., dn:].transpose(1, 0, 2), positions, cfg).transpose(1, 0, 2)
        kv_a = w.project(x, p + "wkv_a")                                       # [n, R + dr]
        cache.c_kv[i][start:start + n] = rms_norm(kv_a[:, :R], w[p + "kv_a_norm"],
                                                  cfg.latent_norm_eps)
        cache.k_pe[i][start:start + n] = apply_rope(kv_a[:, R:], positions, cfg)
        c_kv, k_pe = cache.c_kv[i][:start + n], cache.k_pe[i][:start + n]    # [S, R], [S, dr]
        w_uk, w_uv = self.w_uk[i], self.w_uv[i]                                # [H, dn|dv, R]
        if self.attention == "absorbed":
            q_lat = (q_nope.transpose(1, 0, 2) @ w_uk).transpose(1, 0, 2)     # [n, H, R]
            o_lat, _ = absorbed_attention(q_lat, q_pe, c_kv, k_pe, visibility, self.scale)
            o = (o_lat.transpose(1, 0, 2) @ w_uv.transpose(0, 2, 1)).transpose(1, 0, 2)
        else:
            k_nope = w_uk @ c_kv.T                                             # [H, dn, S]
            v = (w_uv @ c_kv.T).transpose(0, 2, 1)                             # [H, S, dv]
            scores = (q_nope.transpose(1, 0, 2) @ k_nope).transpose(1, 0, 2) + q_pe @ k_pe.T
            probs, _ = _masked_softmax(scores * self.scale, visibility)        # [n, H, S]
            o = (probs.transpose(1, 0, 2) @ v).transpose(1, 0, 2)              # [n, H, dv]
        return w.project(o.reshape(n, -1), p + "wo")

    def _moe(self, i: int, x: np.ndarray) -> np.ndarray:
        """x [n, D] (normed) -> [n, D]: sum_k weight_k Expert_idx_k(x) + SharedExpert(x)."""
        w, p = self.w, f"layers.{i}.moe."
        idx, weight = route(self.cfg, x, w[p + "gate"], w[p + "e_score_correction_bias"])
        out = np.zeros_like(x)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)          # each expert at most once per token
            out[rows] += weight[rows, slot, None] * swiglu(
                x[rows], lambda v, name: w.project(v, p + "experts." + name, e))
        if self.cfg.n_shared_experts > 0:
            out += swiglu(x, lambda v, name: w.project(v, p + "shared." + name))
        return out

    # -------------------------------------------------------------- input checks

    def _check_inputs(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                      cache: KVCache, start: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens: must be a non-empty 1-D integer array, got "
                             f"shape {tokens.shape} dtype {tokens.dtype}")
        n, V = tokens.shape[0], self.cfg.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise ValueError(f"tokens: ids must lie in [0, {V}), got {tokens.min()} .. {tokens.max()}")
        if positions.shape != (n,) or positions.dtype.kind not in "iu":
            raise ValueError(f"positions: must be a 1-D integer array of length {n} (one per "
                             f"token), got shape {positions.shape} dtype {positions.dtype}")
        if positions.min() < 0:
            raise ValueError(f"positions: must be >= 0, got {positions.min()}")
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or start < 0:
            raise ValueError(f"start: must be a non-negative integer, got {start!r}")
        cfg = self.cfg
        if len(cache.c_kv) != cfg.num_hidden_layers or len(cache.k_pe) != cfg.num_hidden_layers:
            raise ValueError(f"cache: has {len(cache.c_kv)} layers, the model {cfg.num_hidden_layers}")
        widths = (cache.c_kv[0].shape[1:], cache.k_pe[0].shape[1:])
        if widths != ((cfg.kv_lora_rank,), (cfg.qk_rope_head_dim,)):
            raise ValueError(f"cache: c_kv / k_pe widths {widths} do not match the config's "
                             f"kv_lora_rank {cfg.kv_lora_rank} / qk_rope_head_dim {cfg.qk_rope_head_dim}")
        if start + n > cache.max_len:
            raise ValueError(f"start: {start} + {n} new tokens exceeds the cache's max_len "
                             f"{cache.max_len}")
        _check_visibility(visibility, (n, start + n))
        return tokens.astype(np.int64), positions.astype(np.int64)
