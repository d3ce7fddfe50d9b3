"""The float64 model reference (refgen.model, refgen.weights) against independent
transcriptions of docs/model.md: hand-computed rotations, the YaRN formula written out,
brute-force routing, a per-query attention loop, and full causal forwards."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest

from kdtr_format import PRESETS, ModelConfig, YarnScaling
from engine.adapters.hf_mapping import TRANSFORMERS_MIN, deepseek_v3_kwargs, hf_state_dict
from refgen.model import (KVCache, Model, absorbed_attention, apply_rope, causal_visibility, rms_norm,
                          rope_inv_freq, route, softmax_scale, yarn_get_m)
from refgen.weights import GROUPED_BIAS_MEAN, init_weights

PRESET_NAMES = sorted(PRESETS)


@functools.lru_cache(maxsize=None)
def preset_weights(name: str) -> dict[str, np.ndarray]:
    return init_weights(PRESETS[name], seed=0)


@functools.lru_cache(maxsize=None)
def preset_model(name: str, attention: str = "absorbed") -> Model:
    return Model(PRESETS[name], preset_weights(name), attention)


def ancestor_visibility(parents: list[int], start: int) -> np.ndarray:
    """[n+1, start+n+1]: every cached slot, plus node i itself and its ancestors."""
    n1 = len(parents)
    vis = np.zeros((n1, start + n1), dtype=bool)
    vis[:, :start] = True
    for i in range(n1):
        j = i
        while j != -1:
            vis[i, start + j] = True
            j = parents[j]
    return vis


def path_to(parents: list[int], i: int) -> list[int]:
    """Node indices from the root down to node i."""
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-12) -> None:
    """Max abs error within rtol of the largest expected magnitude."""
    err = np.abs(actual - expected).max()
    assert err <= rtol * np.abs(expected).max(), f"max abs err {err:.3e}"


# ---------------------------------------------------------------------------- weights

def test_weight_names_and_shapes_follow_docs_fixtures_table() -> None:
    # Written out from docs/fixtures.md for tiny (q_lora, layer 0 dense) and tiny2 (plain wq,
    # two shared experts): D 256 / 192, H 4 / 3, heads (dn + dr) 48 / 32, (dn + dv) 64 / 40.
    w = init_weights(PRESETS["tiny"], seed=1)
    expected = {
        "embed_tokens": (1024, 256), "norm": (256,), "lm_head": (1024, 256),
        "layers.0.input_layernorm": (256,), "layers.0.attn.wq_a": (96, 256),
        "layers.0.attn.q_a_norm": (96,), "layers.0.attn.wq_b": (4 * 48, 96),
        "layers.0.attn.wkv_a": (64 + 16, 256), "layers.0.attn.kv_a_norm": (64,),
        "layers.0.attn.wkv_b": (4 * 64, 64), "layers.0.attn.wo": (256, 4 * 32),
        "layers.0.post_attention_layernorm": (256,), "layers.0.mlp.w_gate": (384, 256),
        "layers.0.mlp.w_up": (384, 256), "layers.0.mlp.w_down": (256, 384),
        "layers.1.moe.gate": (8, 256), "layers.1.moe.e_score_correction_bias": (8,),
        "layers.1.moe.experts.w_gate": (8, 64, 256), "layers.1.moe.experts.w_up": (8, 64, 256),
        "layers.1.moe.experts.w_down": (8, 256, 64), "layers.1.moe.shared.w_gate": (64, 256),
        "layers.1.moe.shared.w_up": (64, 256), "layers.1.moe.shared.w_down": (256, 64),
    }
    for name, shape in expected.items():
        assert w[name].shape == shape, name
    assert "layers.0.moe.gate" not in w and "layers.1.mlp.w_gate" not in w
    assert len([k for k in w if k.startswith("layers.3.")]) == 9 + 2 + 3 + 3
    assert all(v.dtype == np.float32 for v in w.values())

    w2 = init_weights(PRESETS["tiny2"], seed=1)
    assert w2["layers.0.attn.wq"].shape == (3 * 32, 192)
    assert "layers.0.attn.wq_a" not in w2 and "layers.0.mlp.w_gate" not in w2
    assert w2["layers.2.moe.shared.w_gate"].shape == (2 * 48, 192)
    assert w2["layers.2.moe.shared.w_down"].shape == (192, 2 * 48)


def test_weights_are_seeded() -> None:
    cfg = PRESETS["tiny2"]
    a, b, c = init_weights(cfg, 5), init_weights(cfg, 5), init_weights(cfg, 6)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert not np.array_equal(a["lm_head"], c["lm_head"])
    with pytest.raises(ValueError, match="seed"):
        init_weights(cfg, -1)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_activations_stay_order_one(name: str) -> None:
    cfg = PRESETS[name]
    model = preset_model(name)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 32)
    stream = model.hidden_states(tokens, np.arange(32), causal_visibility(32, 0),
                                 KVCache.new(cfg, 32), 0)
    assert len(stream) == cfg.num_hidden_layers + 1
    for layer, x in enumerate(stream):
        rms = np.sqrt(np.mean(x * x, axis=-1))
        assert 0.3 <= rms.min() and rms.max() <= 3.0, (layer, rms.min(), rms.max())
    logits = model.prefill(tokens, KVCache.new(cfg, 32))
    spread = logits.std(axis=-1)
    assert 1.0 <= spread.min() and spread.max() <= 10.0
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.1


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES
                                  if PRESETS[n].first_k_dense_replace < PRESETS[n].num_hidden_layers])
def test_correction_bias_changes_selection(name: str) -> None:
    cfg, w = PRESETS[name], preset_weights(name)
    i = cfg.first_k_dense_replace
    x = np.random.default_rng(3).standard_normal((256, cfg.hidden_size))
    gate = w[f"layers.{i}.moe.gate"].astype(np.float64)
    bias = w[f"layers.{i}.moe.e_score_correction_bias"].astype(np.float64)
    with_bias, _ = route(cfg, x, gate, bias)
    without, _ = route(cfg, x, gate, np.zeros_like(bias))
    changed = np.mean([set(a) != set(b) for a, b in zip(with_bias, without)])
    assert 0.05 < changed < 0.95


# ---------------------------------------------------------------------------- norms

def test_rms_norm_keeps_eps_inside_the_square_root() -> None:
    """Rows whose mean square is near eps, where x / sqrt(ms + eps) and x / (sqrt(ms) + eps)
    part: a constant row c gives c / sqrt(c^2 + eps) * w (w / sqrt(2) at c^2 = eps)."""
    w = np.random.default_rng(17).uniform(0.8, 1.2, 16)
    for eps in (1e-6, 1e-5):
        for ms in (0.25 * eps, eps, 4 * eps):
            c = math.sqrt(ms)
            expected = np.tile(c / math.sqrt(ms + eps) * w, (2, 1))
            np.testing.assert_allclose(rms_norm(np.full((2, 16), c), w, eps), expected, rtol=1e-14)


# ---------------------------------------------------------------------------- rope

def rope_cfg(style: str, rope_scaling: YarnScaling | None = None, d_rope: int = 4,
             theta: float = 100.0) -> ModelConfig:
    return dataclasses.replace(PRESETS["tiny2"], rope_style=style, qk_rope_head_dim=d_rope,
                               rope_theta=theta, rope_scaling=rope_scaling)


def rotate(a: float, b: float, angle: float) -> tuple[float, float]:
    return a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle)


def test_rope_styles_match_hand_rotations() -> None:
    # d_rope 4, theta 100: inv_freq = [1, 0.1]; position 3 turns pair 0 by 3 rad, pair 1 by 0.3.
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    inter = apply_rope(x, np.array([3]), rope_cfg("interleave"))[0]
    neox = apply_rope(x, np.array([3]), rope_cfg("neox"))[0]
    (i0, i1), (i2, i3) = rotate(1, 2, 3.0), rotate(3, 4, 0.3)
    np.testing.assert_allclose(inter, [i0, i1, i2, i3], rtol=1e-14)
    (n0, n2), (n1, n3) = rotate(1, 3, 3.0), rotate(2, 4, 0.3)
    np.testing.assert_allclose(neox, [n0, n1, n2, n3], rtol=1e-14)
    assert not np.allclose(inter, neox)
    np.testing.assert_array_equal(apply_rope(x, np.array([0]), rope_cfg("neox")), x)


@pytest.mark.parametrize("style", ["interleave", "neox"])
def test_rope_is_relative_and_broadcasts(style: str) -> None:
    cfg = rope_cfg(style, d_rope=16, theta=10000.0)
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 5, 16))
    pq, pk = np.array([0, 3, 7, 9, 20]), np.array([1, 1, 4, 8, 2])
    dot = np.sum(apply_rope(q, pq, cfg) * apply_rope(k, pk, cfg), axis=-1)
    shifted = np.sum(apply_rope(q, pq + 37, cfg) * apply_rope(k, pk + 37, cfg), axis=-1)
    np.testing.assert_allclose(dot, shifted, rtol=1e-10)
    stacked = apply_rope(np.stack([q, k]), pq, cfg)
    np.testing.assert_array_equal(stacked[1], apply_rope(k, pq, cfg))


def yarn_inv_freq_formula(i: int, d: int, theta: float, y: YarnScaling) -> float:
    """docs/model.md's YaRN inv_freq, one index at a time (low clamped from below only, high
    from above only, as DeepSeek-V3's inference/model.py)."""
    def corr(n: float) -> float:
        return d * math.log(y.original_max_position_embeddings / (n * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(corr(y.beta_fast)), 0)
    high = min(math.ceil(corr(y.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    base = theta ** (-2 * i / d)
    return base / y.factor * ramp + base * (1 - ramp)


@pytest.mark.parametrize("name", ["tiny", "kimi-k2"])
def test_yarn_inv_freq_matches_formula(name: str) -> None:
    cfg = PRESETS[name]
    d = cfg.qk_rope_head_dim
    inv_freq = rope_inv_freq(cfg)
    assert inv_freq.shape == (d // 2,)
    for i in range(d // 2):
        assert inv_freq[i] == pytest.approx(
            yarn_inv_freq_formula(i, d, cfg.rope_theta, cfg.rope_scaling), rel=1e-14)
    plain = cfg.rope_theta ** (-np.arange(0, d, 2) / d)
    assert inv_freq[0] == pytest.approx(plain[0])                 # high frequency: untouched
    assert inv_freq[-1] == pytest.approx(plain[-1] / cfg.rope_scaling.factor)   # low: divided


# YaRN correction ranges outside [0, d_rope - 1] (d_rope 8, theta 100, factor 4): the reference
# code clamps low from below and high from above only, so the ramp decides.
YARN_CLAMP_CASES = {
    # floor(c(beta_fast)) = 8 > d - 1: low 8, high 7, every ramp 1: every frequency divided.
    "low_beyond_d": (YarnScaling(factor=4.0, original_max_position_embeddings=100000, beta_fast=1.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0), "all"),
    # ceil(c(beta_slow)) = -2 < 0: low 0, high -2, every ramp 0: no frequency divided.
    "high_below_0": (YarnScaling(factor=4.0, original_max_position_embeddings=4, beta_fast=10.0,
                                 beta_slow=10.0, mscale=1.0, mscale_all_dim=1.0), "none"),
    # floor(c(beta_fast)) = -1 is raised to low 0, high 3: pair 0 kept, pair 3 divided, 1 and 2 ramped.
    "inside": (YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                           beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707), "some"),
}


def yarn_clamp_cfg(case: str) -> ModelConfig:
    return rope_cfg("interleave", YARN_CLAMP_CASES[case][0], d_rope=8, theta=100.0)


@pytest.mark.parametrize("case", sorted(YARN_CLAMP_CASES))
def test_yarn_correction_range_clamps_like_the_reference_code(case: str) -> None:
    cfg, divided = yarn_clamp_cfg(case), YARN_CLAMP_CASES[case][1]
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)
    inv_freq = rope_inv_freq(cfg)
    for i in range(4):
        assert inv_freq[i] == pytest.approx(yarn_inv_freq_formula(i, 8, 100.0, cfg.rope_scaling), rel=1e-14)
    expected = {"all": plain / 4, "none": plain}.get(divided)
    if expected is None:
        assert inv_freq[0] == plain[0] and inv_freq[-1] == pytest.approx(plain[-1] / 4, rel=1e-14)
    else:
        np.testing.assert_allclose(inv_freq, expected, rtol=1e-14)


@pytest.mark.parametrize("case", sorted(YARN_CLAMP_CASES))
def test_yarn_rope_matches_hf_rotary_code(case: str) -> None:
    """HF transformers' DeepseekV3RotaryEmbedding (float32): the same inverse frequencies
    and the same cos/sin gain, clamped cases included."""
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN,
                                       reason=f"transformers >= {TRANSFORMERS_MIN} is an optional outside reference")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = yarn_clamp_cfg(case)
    rotary = DeepseekV3RotaryEmbedding(transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg)))
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), rope_inv_freq(cfg), rtol=1e-6)
    y = cfg.rope_scaling
    assert rotary.attention_scaling == pytest.approx(
        yarn_get_m(y.factor, y.mscale) / yarn_get_m(y.factor, y.mscale_all_dim), rel=1e-12)


@pytest.mark.parametrize("case", sorted(YARN_CLAMP_CASES))
def test_yarn_rope_engine_matches_refgen(case: str) -> None:
    from engine.model import rope_inv_freq as engine_inv_freq

    cfg = yarn_clamp_cfg(case)
    np.testing.assert_allclose(engine_inv_freq(cfg).numpy(), rope_inv_freq(cfg), rtol=1e-15, atol=0)


def test_yarn_factor_one_is_plain_rope() -> None:
    yarn = YarnScaling(factor=1.0, original_max_position_embeddings=64, beta_fast=32.0,
                       beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0)
    scaled, plain = rope_cfg("interleave", yarn, 16, 1e4), rope_cfg("interleave", None, 16, 1e4)
    np.testing.assert_array_equal(rope_inv_freq(scaled), rope_inv_freq(plain))
    x, pos = np.random.default_rng(5).standard_normal((3, 16)), np.array([0, 5, 900])
    np.testing.assert_allclose(apply_rope(x, pos, scaled), apply_rope(x, pos, plain), rtol=1e-15)
    assert softmax_scale(scaled) == softmax_scale(plain)


def test_yarn_mscale_effects() -> None:
    tiny = PRESETS["tiny"]                       # factor 4, dn + dr = 48
    base = dataclasses.replace(tiny, rope_scaling=dataclasses.replace(tiny.rope_scaling, mscale=1.0,
                                                                      mscale_all_dim=1.0))
    m = 0.1 * math.log(4.0) + 1
    assert softmax_scale(base) == pytest.approx(48 ** -0.5 * m * m, rel=1e-14)
    no_all_dim = dataclasses.replace(
        base, rope_scaling=dataclasses.replace(base.rope_scaling, mscale_all_dim=0.0))
    assert softmax_scale(no_all_dim) == pytest.approx(48 ** -0.5, rel=1e-14)
    assert softmax_scale(dataclasses.replace(base, rope_scaling=None)) == pytest.approx(48 ** -0.5)
    # cos and sin carry get_m(f, mscale) / get_m(f, mscale_all_dim): vector norms scale by it.
    x = np.random.default_rng(6).standard_normal((4, base.qk_rope_head_dim))
    pos = np.array([0, 1, 50, 300])
    norms = np.linalg.norm(apply_rope(x, pos, base), axis=-1)
    np.testing.assert_allclose(norms, np.linalg.norm(x, axis=-1), rtol=1e-13)
    gained = dataclasses.replace(base, rope_scaling=dataclasses.replace(base.rope_scaling, mscale=2.0))
    ratio = (0.2 * math.log(4.0) + 1) / m
    np.testing.assert_allclose(np.linalg.norm(apply_rope(x, pos, gained), axis=-1),
                               ratio * np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_wrong_rope_style_changes_logits() -> None:
    cfg = PRESETS["tiny"]
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, 8)
    right = preset_model("tiny").prefill(tokens, KVCache.new(cfg, 8))
    neox = dataclasses.replace(cfg, rope_style="neox")
    wrong = Model(neox, preset_weights("tiny")).prefill(tokens, KVCache.new(neox, 8))
    assert_close(wrong[0], right[0])                                # position 0: no rotation
    assert np.abs(right[1:] - wrong[1:]).max() > 1e-2


# ---------------------------------------------------------------------------- routing

def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def brute_force_selection(cfg: ModelConfig, s_sel: np.ndarray) -> set[int]:
    """One token: the best topk_group groups by top-2 sum, then the best k experts in them."""
    E, G = cfg.n_routed_experts, cfg.n_group
    size = E // G
    group_score = [sum(sorted(s_sel[g * size:(g + 1) * size])[-2:]) for g in range(G)]
    groups = max(itertools.combinations(range(G), cfg.topk_group),
                 key=lambda gs: sum(group_score[g] for g in gs))
    allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    return set(max(itertools.combinations(allowed, cfg.num_experts_per_tok),
                   key=lambda es: sum(s_sel[e] for e in es)))


@pytest.mark.parametrize("topk_group,k,bias_mean", [(2, 3, 0.0), (2, 3, -1.5), (1, 4, -2.0),
                                                     (3, 5, 0.3)])
def test_group_routing_matches_brute_force(topk_group: int, k: int, bias_mean: float) -> None:
    # bias_mean < 0 drives biased scores negative: masking dropped groups with 0.0 (HF) instead
    # of -inf would then pick experts from dropped groups.
    cfg = dataclasses.replace(PRESETS["tiny2"], n_routed_experts=16, n_group=4,
                              topk_group=topk_group, num_experts_per_tok=k)
    rng = np.random.default_rng(8)
    D = cfg.hidden_size
    x = rng.standard_normal((48, D))
    gate = rng.standard_normal((16, D)) / math.sqrt(D)
    bias = bias_mean + 0.2 * rng.standard_normal(16)
    idx, weight = route(cfg, x, gate, bias)
    assert idx.dtype == np.int64 and idx.shape == weight.shape == (48, k)
    s = sigmoid(x @ gate.T)
    for t in range(48):
        assert set(idx[t]) == brute_force_selection(cfg, s[t] + bias), t
        chosen = s[t, idx[t]]
        np.testing.assert_allclose(weight[t], chosen / chosen.sum() * cfg.routed_scaling_factor,
                                   rtol=1e-13)


def zero_masked_selection(cfg: ModelConfig, s_sel: np.ndarray) -> np.ndarray:
    """The old-HF mistake, for measuring the weights: dropped groups' s_sel set to 0.0 rather
    than -inf. s_sel [n, E] -> the selected experts [n, k], as sets sorted."""
    n, E = s_sel.shape
    grouped = s_sel.reshape(n, cfg.n_group, E // cfg.n_group)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    dropped = np.argsort(-group_score, axis=-1, kind="stable")[:, cfg.topk_group:]
    masked = grouped.copy()
    np.put_along_axis(masked, dropped[..., None], 0.0, axis=1)
    return np.sort(np.argsort(-masked.reshape(n, E), axis=-1, kind="stable")[:, :cfg.num_experts_per_tok], -1)


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if PRESETS[n].n_group > 1])
def test_grouped_presets_make_dropped_groups_matter(name: str) -> None:
    """With grouped routing the seeded bias has mean GROUPED_BIAS_MEAN < 0, so biased scores
    go negative and masking dropped groups with 0.0 instead of -inf picks other experts: the
    committed fixture then fails an engine that makes that mistake."""
    cfg, w = PRESETS[name], preset_weights(name)
    x = np.random.default_rng(3).standard_normal((256, cfg.hidden_size))
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        gate = w[f"layers.{i}.moe.gate"].astype(np.float64)
        bias = w[f"layers.{i}.moe.e_score_correction_bias"].astype(np.float64)
        assert bias.mean() == pytest.approx(GROUPED_BIAS_MEAN, abs=0.1)
        idx, _ = route(cfg, x, gate, bias)
        wrong = zero_masked_selection(cfg, sigmoid(x @ gate.T) + bias)
        assert np.mean(np.any(np.sort(idx, -1) != wrong, axis=-1)) > 0.5, i


def test_routing_bias_selects_but_does_not_weigh() -> None:
    cfg = PRESETS["tiny2"]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, cfg.hidden_size))
    gate = rng.standard_normal((16, cfg.hidden_size)) / math.sqrt(cfg.hidden_size)
    bias = 0.15 * rng.standard_normal(16)
    idx_b, w_b = route(cfg, x, gate, bias)
    idx_0, w_0 = route(cfg, x, gate, np.zeros(16))
    same = np.all(idx_b == idx_0, axis=1)
    assert 0 < same.sum() < 64
    np.testing.assert_array_equal(w_b[same], w_0[same])
    raw = dataclasses.replace(cfg, norm_topk_prob=False)
    idx_r, w_r = route(raw, x, gate, bias)
    np.testing.assert_array_equal(idx_r, idx_b)
    np.testing.assert_allclose(w_r, np.take_along_axis(sigmoid(x @ gate.T), idx_r, 1) * 1.5,
                               rtol=1e-13)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_routing_ties_go_to_lower_index(n_group: int, topk_group: int) -> None:
    cfg = dataclasses.replace(PRESETS["tiny2"], n_group=n_group, topk_group=topk_group)
    D = cfg.hidden_size
    x = np.random.default_rng(10).standard_normal((5, D))
    gate = np.tile(np.random.default_rng(11).standard_normal(D) / math.sqrt(D), (16, 1))
    idx, weight = route(cfg, x, gate, np.zeros(16))
    np.testing.assert_array_equal(idx, np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(weight, cfg.routed_scaling_factor / 3, rtol=1e-14)


# ---------------------------------------------------------------------------- attention

def attention_loop(q_lat, q_pe, c_kv, k_pe, visibility, scale):
    """absorbed_attention written one query and one head at a time with math.exp."""
    n, H, R = q_lat.shape
    o_lat, lse = np.zeros((n, H, R)), np.zeros((n, H))
    for t in range(n):
        keys = [s for s in range(c_kv.shape[0]) if visibility[t, s]]
        for h in range(H):
            score = [(q_lat[t, h] @ c_kv[s] + q_pe[t, h] @ k_pe[s]) * scale for s in keys]
            peak = max(score)
            e = [math.exp(v - peak) for v in score]
            lse[t, h] = peak + math.log(sum(e))
            o_lat[t, h] = sum(ei / sum(e) * c_kv[s] for ei, s in zip(e, keys))
    return o_lat, lse


@pytest.mark.parametrize("n,H,R,dr,S", [(1, 1, 8, 4, 1), (3, 2, 16, 8, 9), (6, 4, 32, 8, 21)])
def test_absorbed_attention_matches_loop(n: int, H: int, R: int, dr: int, S: int) -> None:
    rng = np.random.default_rng(n * 100 + S)
    q_lat, q_pe = 2 * rng.standard_normal((n, H, R)), rng.standard_normal((n, H, dr))
    c_kv, k_pe = rng.standard_normal((S, R)), rng.standard_normal((S, dr))
    visibility = rng.random((n, S)) < 0.5
    visibility[np.arange(n), rng.integers(0, S, n)] = True
    o_lat, lse = absorbed_attention(q_lat, q_pe, c_kv, k_pe, visibility, 0.3)
    ref_o, ref_lse = attention_loop(q_lat, q_pe, c_kv, k_pe, visibility, 0.3)
    np.testing.assert_allclose(o_lat, ref_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_absorbed_attention_widens_and_checks_inputs() -> None:
    rng = np.random.default_rng(15)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 8), (2, 3, 4), (5, 8), (5, 4))]
    visibility = np.ones((2, 5), dtype=bool)
    o_lat, lse = absorbed_attention(*args, visibility, 0.5)
    assert o_lat.dtype == lse.dtype == np.float64
    ref_o, ref_lse = absorbed_attention(*[a.astype(np.float64) for a in args], visibility, 0.5)
    np.testing.assert_array_equal(o_lat, ref_o)
    with pytest.raises(ValueError, match="ndim"):
        absorbed_attention(args[0][0], *args[1:], visibility, 0.5)
    with pytest.raises(ValueError, match="shapes do not fit"):
        absorbed_attention(args[0], args[1], args[2][:, :6], args[3], visibility, 0.5)
    with pytest.raises(ValueError, match="visibility"):
        absorbed_attention(*args, visibility[:, :4], 0.5)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(np.zeros((3, 4)), np.arange(2), rope_cfg("neox"))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_absorbed_equals_naive(name: str) -> None:
    cfg = PRESETS[name]
    rng = np.random.default_rng(12)
    prompt, tree = rng.integers(0, cfg.vocab_size, 10), rng.integers(0, cfg.vocab_size, 6)
    parents = [-1, 0, 0, 1, 3, 2]
    depths = np.array([len(path_to(parents, i)) - 1 for i in range(6)])
    results = []
    for attention in ("absorbed", "naive"):
        model, cache = preset_model(name, attention), KVCache.new(cfg, 16)
        prefill = model.prefill(prompt, cache)
        verify = model.forward(tree, 10 + depths, ancestor_visibility(parents, 10), cache, 10)
        results.append((prefill, verify, cache))
    (pa, va, ca), (pn, vn, cn) = results
    assert_close(pa, pn)
    assert_close(va, vn)
    for i in range(cfg.num_hidden_layers):
        assert_close(ca.c_kv[i], cn.c_kv[i])
        assert_close(ca.k_pe[i], cn.k_pe[i])


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_cache_and_visibility_equal_full_causal_forward(name: str) -> None:
    """Prefill a prefix, decode four tokens one at a time, then verify a tree whose
    nodes come out of tree order: every row equals a causal forward over its history."""
    cfg = PRESETS[name]
    model = preset_model(name)
    rng = np.random.default_rng(13)
    m, d = 9, 4
    seq = rng.integers(0, cfg.vocab_size, m + d)
    parents = [-1, 0, 0, 1, 2, 2, 4]
    tree = rng.integers(0, cfg.vocab_size, len(parents))
    depths = np.array([len(path_to(parents, i)) - 1 for i in range(len(parents))])
    T = m + d
    cache = KVCache.new(cfg, T + len(parents) + 3)

    rows = [model.prefill(seq[:m], cache)]
    for j in range(m, T):
        rows.append(model.forward(seq[j:j + 1], np.array([j]), np.ones((1, j + 1), bool), cache, j))
    full_cache = KVCache.new(cfg, T)
    assert_close(np.concatenate(rows), model.prefill(seq, full_cache))
    for i in range(cfg.num_hidden_layers):
        assert_close(cache.c_kv[i][:T], full_cache.c_kv[i])
        assert_close(cache.k_pe[i][:T], full_cache.k_pe[i])

    verify = model.forward(tree, T + depths, ancestor_visibility(parents, T), cache, T)
    for node in range(len(parents)):
        history = np.concatenate([seq, tree[path_to(parents, node)]])
        ref_cache = KVCache.new(cfg, len(history))
        assert_close(verify[node], model.prefill(history, ref_cache)[-1])
        for i in range(cfg.num_hidden_layers):
            assert_close(cache.c_kv[i][T + node], ref_cache.c_kv[i][-1])
            assert_close(cache.k_pe[i][T + node], ref_cache.k_pe[i][-1])


# ---------------------------------------------------------------------------- whole model

def transcribed_forward(cfg: ModelConfig, weights: dict[str, np.ndarray],
                        tokens: np.ndarray) -> np.ndarray:
    """docs/model.md written out plainly, sharing no code with refgen.model: causal prefill with
    keys expanded per head and the rotary key concatenated to each, rope as complex
    multiplication, routing and experts one token at a time. tokens [m] -> logits [m, V]."""
    W = {k: v.astype(np.float64) for k, v in weights.items()}
    m, H, R = len(tokens), cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def norm(x: np.ndarray, g: np.ndarray, eps: float = cfg.rms_norm_eps) -> np.ndarray:
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g

    y = cfg.rope_scaling
    inv = np.array([yarn_inv_freq_formula(i, dr, cfg.rope_theta, y) if y else
                    cfg.rope_theta ** (-2 * i / dr) for i in range(dr // 2)])
    get_m = (lambda s: 0.1 * s * math.log(y.factor) + 1 if y.factor > 1 else 1.0) if y else None
    gain = get_m(y.mscale) / get_m(y.mscale_all_dim) if y else 1.0
    scale = (dn + dr) ** -0.5 * (get_m(y.mscale_all_dim) ** 2 if y else 1.0)
    turn = gain * np.exp(1j * np.arange(m)[:, None] * inv)                    # [m, dr/2]

    def rope(x: np.ndarray) -> np.ndarray:                                   # [m, ..., dr]
        t = turn.reshape(m, *([1] * (x.ndim - 2)), dr // 2)
        if cfg.rope_style == "interleave":
            z = (x[..., 0::2] + 1j * x[..., 1::2]) * t
            return np.stack([z.real, z.imag], -1).reshape(x.shape)
        z = (x[..., :dr // 2] + 1j * x[..., dr // 2:]) * t
        return np.concatenate([z.real, z.imag], -1)

    def mlp(x: np.ndarray, p: str) -> np.ndarray:
        g = W[p + "w_gate"] @ x
        return W[p + "w_down"] @ (g * sigmoid(g) * (W[p + "w_up"] @ x))

    x = W["embed_tokens"][tokens]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = norm(x, W[p + "input_layernorm"])
        if cfg.q_lora_rank is None:
            q = a @ W[p + "attn.wq"].T
        else:
            q = norm(a @ W[p + "attn.wq_a"].T, W[p + "attn.q_a_norm"], cfg.latent_norm_eps) @ W[p + "attn.wq_b"].T
        q = q.reshape(m, H, dn + dr)
        q = np.concatenate([q[..., :dn], rope(q[..., dn:])], -1)
        kv_a = a @ W[p + "attn.wkv_a"].T
        c_kv = norm(kv_a[:, :R], W[p + "attn.kv_a_norm"], cfg.latent_norm_eps)
        kv = (c_kv @ W[p + "attn.wkv_b"].T).reshape(m, H, dn + dv)
        k = np.concatenate([kv[..., :dn], np.repeat(rope(kv_a[:, R:])[:, None], H, 1)], -1)
        o = np.zeros((m, H, dv))
        for t in range(m):
            for h in range(H):
                score = k[:t + 1, h] @ q[t, h] * scale
                prob = np.exp(score - score.max())
                o[t, h] = prob / prob.sum() @ kv[:t + 1, h, dn:]
        x = x + o.reshape(m, H * dv) @ W[p + "attn.wo"].T
        b = norm(x, W[p + "post_attention_layernorm"])
        ffn = np.zeros_like(x)
        for t in range(m):
            if cfg.is_dense_layer(i):
                ffn[t] = mlp(b[t], p + "mlp.")
                continue
            s = sigmoid(W[p + "moe.gate"] @ b[t])
            sel = s + W[p + "moe.e_score_correction_bias"]
            chosen = sorted(brute_force_selection(cfg, sel))
            weight = s[chosen] / (s[chosen].sum() if cfg.norm_topk_prob else 1.0)
            for e, we in zip(chosen, weight * cfg.routed_scaling_factor):
                ffn[t] += we * mlp(b[t], f"{p}moe.experts.{e}.")
            if cfg.n_shared_experts:
                ffn[t] += mlp(b[t], p + "moe.shared.")
        x = x + ffn
    return norm(x, W["norm"]) @ W["lm_head"].T


def per_expert(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Unstack routed experts to `...experts.{e}.w_gate` names for the transcription."""
    out = dict(weights)
    for name, w in weights.items():
        if ".experts." in name:
            head, leaf = name.rsplit(".", 1)
            out.update({f"{head}.{e}.{leaf}": w[e] for e in range(w.shape[0])})
    return out


TRANSCRIPTION_CASES = {
    **{name: (PRESETS[name], name) for name in PRESET_NAMES},
    # Raw router weights; latent norms with an eps far from rms_norm_eps (a norm given the
    # wrong one is visible), on q_a and kv_a (tiny) and on kv_a alone (tiny2, no q_lora).
    "tiny-raw-latent-eps": (dataclasses.replace(PRESETS["tiny"], norm_topk_prob=False,
                                                latent_norm_eps=0.05), "tiny"),
    "tiny2-latent-eps": (dataclasses.replace(PRESETS["tiny2"], latent_norm_eps=0.05), "tiny2"),
}


@pytest.mark.parametrize("case", sorted(TRANSCRIPTION_CASES))
def test_model_matches_transcription_of_model_md(case: str) -> None:
    cfg, weights_of = TRANSCRIPTION_CASES[case]
    weights = preset_weights(weights_of)
    tokens = np.random.default_rng(14).integers(0, cfg.vocab_size, 12)
    model = preset_model(case) if case in PRESETS else Model(cfg, weights)
    logits = model.prefill(tokens, KVCache.new(cfg, 12))
    assert_close(logits, transcribed_forward(cfg, per_expert(weights), tokens), rtol=1e-11)


# HF agrees to about 2e-7 (HF's float32 islands); latent norms given tiny2's rms_norm_eps 1e-5
# instead of the reference's 1e-6 miss it by 4e-6.
HF_RTOL = 1e-6


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "kimi-k2" else n
                                  for n in PRESET_NAMES])
def test_model_matches_hf_transformers(name: str) -> None:
    """The outside reference docs/model.md names: HF transformers' DeepseekV3ForCausalLM (v5 API),
    run in float64. HF keeps float32 islands (router, rope angles, softmax, RMSNorm), hence
    the HF_RTOL tolerance (float64 HF with those lifted agrees to 1e-15; docs/model.md)."""
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN,
                                       reason=f"transformers >= {TRANSFORMERS_MIN} is an optional outside reference")
    torch = pytest.importorskip("torch")
    cfg, w = PRESETS[name], preset_weights(name)
    hf_cfg = transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg))
    hf_cfg._attn_implementation = hf_cfg._experts_implementation = "eager"
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).to(torch.float64).eval()
    missing, unexpected = hf.load_state_dict(
        {k: torch.from_numpy(v.astype(np.float64)) for k, v in hf_state_dict(cfg, w).items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = np.random.default_rng(16).integers(0, cfg.vocab_size, 24)
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)[None]).logits[0].numpy()
    logits = preset_model(name).prefill(tokens, KVCache.new(cfg, 24))
    assert_close(logits, expected, rtol=HF_RTOL)
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------------- bad input

def test_bad_forward_inputs_name_the_problem() -> None:
    tiny_model = preset_model("tiny")
    cfg = tiny_model.cfg
    cache = KVCache.new(cfg, 8)
    tokens, pos = np.array([1, 2, 3]), np.arange(3)
    vis = causal_visibility(3, 2)
    blind_row_1 = vis.copy()
    blind_row_1[1] = False
    cases = [
        ("visibility", (tokens, pos, causal_visibility(3, 0), 2)),
        ("visibility", (tokens, pos, vis.astype(np.int64), 2)),
        ("visibility: row 1", (tokens, pos, blind_row_1, 2)),
        ("positions", (tokens, np.arange(4), vis, 2)),
        ("positions", (tokens, np.array([0.0, 1.0, 2.0]), vis, 2)),
        ("start", (tokens, pos, causal_visibility(3, 6), 6)),
        ("start", (tokens, pos, vis, -1)),
        ("tokens", (np.array([1, 2, cfg.vocab_size]), pos, vis, 2)),
        ("tokens", (np.array([], dtype=np.int64), np.arange(0), np.zeros((0, 2), bool), 2)),
    ]
    for match, (t, p, v, start) in cases:
        with pytest.raises(ValueError, match=match):
            tiny_model.forward(t, p, v, cache, start)
    with pytest.raises(ValueError, match="cache"):
        tiny_model.forward(tokens, pos, vis, KVCache.new(PRESETS["tiny2"], 8), 2)


def test_bad_model_construction() -> None:
    cfg, w = PRESETS["tiny2"], dict(preset_weights("tiny2"))
    with pytest.raises(ValueError, match="attention"):
        Model(cfg, w, attention="flash")
    with pytest.raises(ValueError, match="layers.1.attn.wkv_b"):
        Model(cfg, {**w, "layers.1.attn.wkv_b": w["layers.1.attn.wkv_b"].T})
    del w["layers.2.moe.e_score_correction_bias"]
    with pytest.raises(ValueError, match="missing 'layers.2.moe.e_score_correction_bias'"):
        Model(cfg, w)
    with pytest.raises(ValueError, match="unexpected 'layers.0.attn.wq_a'"):
        Model(cfg, {**preset_weights("tiny2"), "layers.0.attn.wq_a": np.zeros(3)})
    with pytest.raises(ValueError, match="max_len"):
        KVCache.new(cfg, 0)
