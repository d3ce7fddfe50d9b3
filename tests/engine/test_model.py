"""engine.model / engine.attention / engine.cache against the float64 reference (refgen).

Every check compares the torch engine with `refgen.model.Model` run on the same
weights: prefill, AR decode steps and tree verify for every model of the zoo
(both rope styles, YaRN with differing mscale factors, q_lora or not, grouped
routing), ragged batches against each request run alone, padding that must
not reach real rows, the golden fixtures (kimi-k2's when generated), and bad input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.attention import torch_attention
from engine.cache import KVCache
from engine.model import (CAPTURE_POINTS, Transformer, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, route,
                          softmax_scale)
from engine.stages import TorchStages
from engine.weights import load_fixture_weights
from kdtr_format import PRESETS
from refgen import ddtree
from refgen import model as ref

RTOL_F32 = 1e-5     # max |engine - reference| / max |reference|, float32 engine
RTOL_BF16 = 2e-2    # the same for a bf16 engine (about 0.8e-2 seen on every preset)
ROUTER_TIE = 2e-3   # a selection-score gap bf16 activations may reverse (scores in (0, 1), bf16 keeps 2^-8 of them)


def assert_close_to_scale(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """max |actual - expected| <= rtol * max |expected| (logits: errors scale with the spread)."""
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= rtol, f"relative error {err:.3g} exceeds {rtol:.1g}"


@dataclass
class Request:
    """New tokens of one request: tokens/positions [n], visibility over them [n, n], cache start."""

    tokens: np.ndarray
    positions: np.ndarray
    visibility: np.ndarray
    start: int


def causal_request(tokens: np.ndarray, start: int) -> Request:
    n = len(tokens)
    return Request(np.asarray(tokens), start + np.arange(n), np.tril(np.ones((n, n), dtype=bool)), start)


def tree_request(rng: np.random.Generator, vocab: int, start: int, budget: int, depth: int = 4) -> Request:
    """A DDTree verify step: a best-first tree from random draft logits (refgen builds it)."""
    topk_lp, topk_id = ddtree.topk_logprobs(rng.normal(size=(depth, vocab)) * 3, 8)
    tree = ddtree.build_tree(topk_lp, topk_id, budget).with_root(int(rng.integers(vocab)))
    compiled = ddtree.compile_tree(tree, start)
    return Request(tree.tokens, compiled.positions, compiled.visibility, start)


def reference_forward(model: ref.Model, cache: ref.KVCache, request: Request) -> np.ndarray:
    n, s = len(request.tokens), request.start
    visibility = np.concatenate([np.ones((n, s), dtype=bool), request.visibility], axis=1)
    return model.forward(request.tokens, request.positions, visibility, cache, s)


def engine_forward(engine: Transformer, cache: KVCache, requests: list[Request],
                   garbage: np.random.Generator | None = None) -> list[np.ndarray]:
    """One batched forward -> logits [n_b, V] per request. Padding rows hold random garbage
    (tokens, positions, visibility) drawn from `garbage` (default: seed 0)."""
    rng = garbage if garbage is not None else np.random.default_rng(0)
    batch, width = len(requests), max(len(r.tokens) for r in requests)
    tokens = rng.integers(0, engine.cfg.vocab_size, (batch, width))
    positions = rng.integers(0, 1000, (batch, width))
    visibility = rng.random((batch, width, width)) < 0.5
    for b, r in enumerate(requests):
        n = len(r.tokens)
        tokens[b, :n], positions[b, :n], visibility[b, :n, :n] = r.tokens, r.positions, r.visibility
    device = engine.device
    logits = engine.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                            torch.tensor(visibility, device=device),
                            torch.tensor([len(r.tokens) for r in requests], device=device),
                            torch.tensor([r.start for r in requests], device=device), cache)
    return [logits[b, :len(r.tokens)].cpu().numpy() for b, r in enumerate(requests)]


# ---- one request against the reference ----

def test_prefill_matches_reference(model_zoo, model_name, device):
    case = model_zoo.get(model_name)
    tokens = np.random.default_rng(1).integers(0, case.cfg.vocab_size, 13)
    expected = case.reference.prefill(tokens, ref.KVCache.new(case.cfg, 16))
    engine = case.engine(device)
    (actual,) = engine_forward(engine, engine.new_cache(1, 16), [causal_request(tokens, 0)])
    assert_close_to_scale(actual, expected, RTOL_F32)


def test_decode_steps_match_one_prefill(model_zoo, model_name):
    """Prefill 7 tokens, then 5 single-token steps through the cache == one causal prefill of 12."""
    case = model_zoo.get(model_name)
    tokens = np.random.default_rng(2).integers(0, case.cfg.vocab_size, 12)
    expected = case.reference.prefill(tokens, ref.KVCache.new(case.cfg, 12))
    engine = case.engine()
    cache = engine.new_cache(1, 12)
    actual = engine_forward(engine, cache, [causal_request(tokens[:7], 0)])
    for t in range(7, 12):
        actual += engine_forward(engine, cache, [causal_request(tokens[t:t + 1], t)])
    assert_close_to_scale(np.concatenate(actual), expected, RTOL_F32)


def test_tree_verify_matches_reference(model_zoo, model_name, device):
    case = model_zoo.get(model_name)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, case.cfg.vocab_size, 9)
    tree = tree_request(rng, case.cfg.vocab_size, start=9, budget=14)
    ref_cache = ref.KVCache.new(case.cfg, 32)
    case.reference.prefill(prompt, ref_cache)
    expected = reference_forward(case.reference, ref_cache, tree)
    engine = case.engine(device)
    cache = engine.new_cache(1, 32)
    engine_forward(engine, cache, [causal_request(prompt, 0)])
    (actual,) = engine_forward(engine, cache, [tree])
    assert_close_to_scale(actual, expected, RTOL_F32)


# ---- ragged batches ----

def ragged_rounds(vocab: int, seed: int) -> tuple[list[Request], list[Request]]:
    """Three requests: prompts of 5, 11 and 1 tokens, then trees of budgets 0, 6 and 15."""
    rng = np.random.default_rng(seed)
    prompts = [causal_request(rng.integers(0, vocab, m), 0) for m in (5, 11, 1)]
    trees = [tree_request(rng, vocab, start=len(p.tokens), budget=b) for p, b in zip(prompts, (0, 6, 15))]
    return prompts, trees


def test_ragged_batch_matches_reference_per_request(model_zoo, model_name):
    case = model_zoo.get(model_name)
    prompts, trees = ragged_rounds(case.cfg.vocab_size, seed=4)
    engine = case.engine()
    cache = engine.new_cache(3, 40)
    garbage = np.random.default_rng(5)
    actual = engine_forward(engine, cache, prompts, garbage) + engine_forward(engine, cache, trees, garbage)
    for b in range(3):
        ref_cache = ref.KVCache.new(case.cfg, 40)
        assert_close_to_scale(actual[b], reference_forward(case.reference, ref_cache, prompts[b]), RTOL_F32)
        assert_close_to_scale(actual[3 + b], reference_forward(case.reference, ref_cache, trees[b]), RTOL_F32)


def test_ragged_batch_matches_each_request_alone(model_zoo):
    case = model_zoo.get("tiny2")
    prompts, trees = ragged_rounds(case.cfg.vocab_size, seed=6)
    engine = case.engine()
    cache = engine.new_cache(3, 40)
    together = engine_forward(engine, cache, prompts) + engine_forward(engine, cache, trees)
    for b in range(3):
        alone_cache = engine.new_cache(1, 40)
        alone = engine_forward(engine, alone_cache, [prompts[b]]) + engine_forward(engine, alone_cache, [trees[b]])
        np.testing.assert_allclose(together[b], alone[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(together[3 + b], alone[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.c_kv[:, b], alone_cache.c_kv[:, 0], rtol=0, atol=1e-5)


def test_padding_rows_never_change_real_rows_or_the_cache(model_zoo):
    """Two different garbages in the padding rows: real logits bit-identical, and no slot
    past starts + n_new is written (it keeps a sentinel)."""
    case = model_zoo.get("tiny")
    prompts, trees = ragged_rounds(case.cfg.vocab_size, seed=7)
    engine = case.engine()
    results, caches = [], []
    for seed in (8, 9):
        cache = engine.new_cache(3, 40)
        cache.c_kv.fill_(7.0)
        cache.k_pe.fill_(7.0)
        garbage = np.random.default_rng(seed)
        results.append(engine_forward(engine, cache, prompts, garbage) + engine_forward(engine, cache, trees, garbage))
        caches.append(cache)
    for first, second in zip(*results):
        np.testing.assert_array_equal(first, second)
    for cache in caches:
        for b, (p, t) in enumerate(zip(prompts, trees)):
            end = len(p.tokens) + len(t.tokens)
            assert (cache.c_kv[:, b, end:] == 7.0).all() and (cache.k_pe[:, b, end:] == 7.0).all()
            assert not (cache.c_kv[:, b, :end] == 7.0).any()


# ---- the pieces ----

def test_rope_and_scale_match_reference(model_zoo, model_name):
    cfg = model_zoo.get(model_name).cfg
    np.testing.assert_allclose(rope_inv_freq(cfg).numpy(), ref.rope_inv_freq(cfg), rtol=1e-15, atol=0)
    assert softmax_scale(cfg) == pytest.approx(ref.softmax_scale(cfg), rel=1e-15)
    positions = np.array([0, 1, 37, 511])
    x = np.random.default_rng(9).normal(size=(len(positions), cfg.qk_rope_head_dim))
    cos, sin = rope_cos_sin(cfg, torch.tensor(positions), rope_inv_freq(cfg))
    rotated = apply_rope(torch.tensor(x, dtype=torch.float32), cos, sin, cfg.rope_style)
    np.testing.assert_allclose(rotated.numpy(), ref.apply_rope(x, positions, cfg), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
def test_route_matches_reference(model_zoo, preset):
    """Group-limited sigmoid routing: the same experts, weights within float32 rounding."""
    case = model_zoo.get(preset)
    layer = case.cfg.first_k_dense_replace
    gate = case.weights[f"layers.{layer}.moe.gate"]
    bias = case.weights[f"layers.{layer}.moe.e_score_correction_bias"]
    x = np.random.default_rng(10).normal(size=(200, case.cfg.hidden_size)).astype(np.float32)
    idx, weight = route(case.cfg, torch.tensor(x), torch.tensor(gate), torch.tensor(bias))
    ref_idx, ref_weight = ref.route(case.cfg, x.astype(np.float64), gate.astype(np.float64), bias.astype(np.float64))
    np.testing.assert_array_equal(idx.numpy(), ref_idx)
    np.testing.assert_allclose(weight.numpy(), ref_weight, rtol=1e-5)


@pytest.mark.parametrize("topk_group,k,bias_mean", [(2, 3, 0.0), (2, 3, -1.5), (1, 4, -2.0), (3, 5, -0.5)])
def test_route_matches_reference_with_negative_biased_scores(topk_group, k, bias_mean):
    """Grouped routing where the bias drives biased scores negative: dropped groups must be
    -inf (a 0.0 mask would then select experts of dropped groups)."""
    cfg = dataclasses.replace(PRESETS["tiny2"], topk_group=topk_group, num_experts_per_tok=k)
    rng = np.random.default_rng(13)
    x = rng.normal(size=(300, cfg.hidden_size)).astype(np.float32)
    gate = (rng.normal(size=(cfg.n_routed_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(np.float32)
    bias = (bias_mean + 0.2 * rng.normal(size=cfg.n_routed_experts)).astype(np.float32)
    idx, weight = route(cfg, torch.tensor(x), torch.tensor(gate), torch.tensor(bias))
    ref_idx, ref_weight = ref.route(cfg, x.astype(np.float64), gate.astype(np.float64), bias.astype(np.float64))
    np.testing.assert_array_equal(idx.numpy(), ref_idx)
    np.testing.assert_allclose(weight.numpy(), ref_weight, rtol=1e-5)


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_matches_reference_near_eps(eps):
    """Rows whose mean square is 0.1 .. 10 eps: there eps under the square root and eps
    outside it differ by tens of percent (at RMS 1 only by about eps)."""
    rng = np.random.default_rng(14)
    x = rng.normal(size=(40, 64))
    x *= np.sqrt(eps * np.logspace(-1, 1, 40) / np.mean(x * x, axis=-1))[:, None]
    w = rng.uniform(0.8, 1.2, 64)
    actual = rms_norm(torch.tensor(x, dtype=torch.float32), torch.tensor(w, dtype=torch.float32), eps)
    np.testing.assert_allclose(actual.numpy(), ref.rms_norm(x.astype(np.float32), w.astype(np.float32), eps),
                               rtol=2e-6, atol=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
def test_latent_norms_use_latent_norm_eps(model_zoo, preset):
    """latent_norm_eps far from rms_norm_eps: the q_a / kv_a norms (tiny: both, tiny2: kv_a
    only) must take it, and every other norm rms_norm_eps."""
    case = model_zoo.get(preset)
    cfg = dataclasses.replace(case.cfg, latent_norm_eps=0.05)
    tokens = np.random.default_rng(15).integers(0, cfg.vocab_size, 9)
    expected = ref.Model(cfg, case.weights).prefill(tokens, ref.KVCache.new(cfg, 9))
    engine = Transformer(cfg, case.weights)
    (actual,) = engine_forward(engine, engine.new_cache(1, 9), [causal_request(tokens, 0)])
    assert_close_to_scale(actual, expected, RTOL_F32)


def test_torch_attention_matches_reference(device):
    """The AttentionBackend on a ragged batch at Kimi K2 head dims against absorbed_attention."""
    rng = np.random.default_rng(11)
    heads, rank, rope_dim, width, slots = 8, 512, 64, 6, 40
    starts, n_new = np.array([0, 17, 30]), np.array([6, 3, 1])
    q_lat = rng.normal(size=(3, width, heads, rank))
    q_pe = rng.normal(size=(3, width, heads, rope_dim))
    c_kv, k_pe = rng.normal(size=(3, slots, rank)), rng.normal(size=(3, slots, rope_dim))
    new_visibility = rng.random((3, width, width)) < 0.5
    new_visibility |= np.eye(width, dtype=bool)
    scale = 0.07
    t = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    o_lat = torch_attention(t(q_lat), t(q_pe), t(c_kv), t(k_pe), torch.tensor(starts, device=device),
                            torch.tensor(n_new, device=device), torch.tensor(new_visibility, device=device),
                            scale).cpu().numpy()
    for b in range(3):
        s, n = starts[b], n_new[b]
        visibility = np.concatenate([np.ones((n, s), dtype=bool), new_visibility[b, :n, :n]], axis=1)
        expected, _ = ref.absorbed_attention(q_lat[b, :n], q_pe[b, :n], c_kv[b, :s + n], k_pe[b, :s + n],
                                             visibility, scale)
        np.testing.assert_allclose(o_lat[b, :n], expected, rtol=1e-4, atol=1e-5)
        assert (o_lat[b, n:] == 0).all()


def test_attention_backend_is_the_seam(model_zoo):
    """A backend passed to the Transformer gets every layer's attention call, with the cache
    already holding the new tokens, and its output is what the model uses."""
    case = model_zoo.get("tiny")
    calls = []

    def recording(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
        calls.append((tuple(q_lat.shape), tuple(c_kv.shape), scale))
        return torch_attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale)

    tokens = np.arange(6)
    expected = engine_forward(case.engine(), case.engine().new_cache(1, 8), [causal_request(tokens, 0)])
    engine = Transformer(case.cfg, case.weights, attention=recording)
    actual = engine_forward(engine, engine.new_cache(1, 8), [causal_request(tokens, 0)])
    np.testing.assert_array_equal(actual[0], expected[0])
    heads, rank = case.cfg.num_attention_heads, case.cfg.kv_lora_rank
    assert calls == [((1, 6, heads, rank), (1, 8, rank), softmax_scale(case.cfg))] * case.cfg.num_hidden_layers

    zeros = Transformer(case.cfg, case.weights, attention=lambda q_lat, *rest: torch.zeros_like(q_lat))
    changed = engine_forward(zeros, zeros.new_cache(1, 8), [causal_request(tokens, 0)])
    assert not np.allclose(changed[0], expected[0])


def unpack_bits(bits: np.ndarray) -> np.ndarray:
    """uint32 [rows, W] -> bool [rows, 32 W]: bit b of word w is column 32 w + b."""
    shifts = np.arange(32, dtype=np.uint64)
    return ((bits.astype(np.uint64)[..., None] >> shifts) & 1).astype(bool).reshape(len(bits), -1)


def padded_from_ragged(case: dict, get) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """A ragged verify_attention case -> ([q_lat, q_pe, c_kv, k_pe] padded per request,
    starts, n_new, new_visibility [B, N, N])."""
    context, sizes = get("context"), get("tree_sizes")
    q_offsets, kv_offsets, seen = get("q_offsets"), get("kv_offsets"), unpack_bits(get("visibility_bits"))
    batch, width, slots = len(sizes), int(sizes.max()), int((context + sizes).max())
    ragged = {name: get(name) for name in ("q_lat", "q_pe", "c_kv", "k_pe")}
    padded = {name: np.zeros((batch, width if name.startswith("q") else slots) + a.shape[1:])
              for name, a in ragged.items()}
    new_visibility = np.zeros((batch, width, width), dtype=bool)
    for b in range(batch):
        queries = slice(q_offsets[b], q_offsets[b + 1])
        keys = slice(kv_offsets[b], kv_offsets[b] + context[b] + sizes[b])
        for name in ("q_lat", "q_pe"):
            padded[name][b, :sizes[b]] = ragged[name][queries]
        for name in ("c_kv", "k_pe"):
            padded[name][b, :context[b] + sizes[b]] = ragged[name][keys]
        new_visibility[b, :sizes[b], :sizes[b]] = seen[queries, :sizes[b]]
    return [padded[name] for name in ("q_lat", "q_pe", "c_kv", "k_pe")], context, sizes, new_visibility


def test_torch_attention_on_golden_verify_cases(golden):
    """Each ragged case of tests/golden/kernels/verify_attention.kdtr, regrouped as a padded batch."""
    import kdtr_format

    with kdtr_format.open(golden / "kernels/verify_attention.kdtr") as fixture:
        tol = fixture.metadata["tolerances"]["o_lat"]
        for case in fixture.metadata["cases"]:
            get = lambda name: np.array(fixture[f"cases/{case['name']}/{name}"])  # noqa: E731
            inputs, starts, n_new, new_visibility = padded_from_ragged(case, get)
            o_lat = torch_attention(*(torch.tensor(a, dtype=torch.float32) for a in inputs),
                                    torch.tensor(starts), torch.tensor(n_new), torch.tensor(new_visibility),
                                    case["scale"]).numpy()
            actual = np.concatenate([o_lat[b, :n] for b, n in enumerate(n_new)])
            np.testing.assert_allclose(actual, get("o_lat"), rtol=tol["rtol"], atol=tol["atol"],
                                       err_msg=case["name"])


def test_bf16_engine_is_close_to_reference(model_zoo, model_name, device):
    """Rows with a router near-tie (a selection margin below ROUTER_TIE at some MoE layer: bf16's
    rounding of the scores may pick another expert there, rightly) are left out."""
    case = model_zoo.get(model_name)
    tokens = np.random.default_rng(12).integers(0, case.cfg.vocab_size, 10)
    ffn_in = {}
    reference = ref.Model(case.cfg, case.weights, capture=lambda point, i, y: ffn_in.setdefault(i, y))
    expected = reference.prefill(tokens, ref.KVCache.new(case.cfg, 10))
    clear = np.ones(len(tokens), bool)
    for i, y in ffn_in.items():
        if not case.cfg.is_dense_layer(i):
            p = f"layers.{i}.moe."
            clear &= ref.router_margins(case.cfg, y, case.weights[p + "gate"],
                                        case.weights[p + "e_score_correction_bias"]) > ROUTER_TIE
    assert clear.sum() >= len(tokens) // 2, "too few rows without a router near-tie to judge"
    engine = case.engine(device, torch.bfloat16)
    (actual,) = engine_forward(engine, engine.new_cache(1, 10), [causal_request(tokens, 0)])
    assert_close_to_scale(actual[clear], expected[clear], RTOL_BF16)


def test_allocate_shapes_and_zero_lengths():
    cfg = dataclasses.replace(PRESETS["tiny2"], num_hidden_layers=2)
    cache = KVCache.allocate(cfg, batch=3, max_len=20)
    assert cache.c_kv.shape == (2, 3, 20, cfg.kv_lora_rank)
    assert cache.k_pe.shape == (2, 3, 20, cfg.qk_rope_head_dim)
    assert cache.lengths.tolist() == [0, 0, 0] and cache.lengths.dtype == torch.int64
    with pytest.raises(ValueError, match="max_len"):
        KVCache.allocate(cfg, batch=1, max_len=-1)


# ---- fixtures: loading and golden checks ----

def test_from_fixture_round_trips_config_and_weights(model_zoo, tmp_path):
    kdtr_format = pytest.importorskip("kdtr_format")
    if not hasattr(kdtr_format, "write"):
        pytest.skip("kdtr_format.write is not available yet")
    case = model_zoo.get("tiny2")
    path = tmp_path / "tiny2.kdtr"
    kdtr_format.write(path, {f"weights/{k}": v for k, v in case.weights.items()},
                      metadata={"config": case.cfg.to_dict()})
    cfg, weights = load_fixture_weights(path)
    assert cfg == case.cfg and set(weights) == set(case.weights)
    engine = Transformer.from_fixture(path)
    tokens = np.arange(5)
    expected = engine_forward(case.engine(), case.engine().new_cache(1, 5), [causal_request(tokens, 0)])
    actual = engine_forward(engine, engine.new_cache(1, 5), [causal_request(tokens, 0)])
    np.testing.assert_array_equal(actual[0], expected[0])

    kdtr_format.write(tmp_path / "bare.kdtr", {"weights/norm": np.ones(3, np.float32)}, metadata={})
    with pytest.raises(ValueError, match="config"):
        load_fixture_weights(tmp_path / "bare.kdtr")


@pytest.mark.parametrize("preset", ["tiny", "tiny2", "kimi-k2"])
def test_golden_fixture_replays(golden, preset):
    """Prefill logits and every round's verify logits within the fixture's tolerance; top-k,
    trees, compile, choices, accept and compaction exact, replaying the fixture's drafts."""
    import kdtr_format

    path = golden / f"{preset}.kdtr"
    if not path.exists():
        pytest.skip(f"golden fixture {preset}.kdtr is generated on demand: `refgen generate --preset {preset}`")
    stages = TorchStages()
    with kdtr_format.open(path) as fixture:
        meta = fixture.metadata
        engine = Transformer.from_fixture(path)
        tol = meta["tolerances"]["logits"]
        for prompt in meta["prompts"]:
            tokens = np.asarray(fixture[f"prompts/{prompt['name']}/tokens"])
            (actual,) = engine_forward(engine, engine.new_cache(1, len(tokens)), [causal_request(tokens, 0)])
            np.testing.assert_allclose(actual, fixture[f"prompts/{prompt['name']}/prefill_logits"],
                                       rtol=tol["rtol"], atol=tol["atol"])
        for trace in meta["traces"]:
            replay_trace(engine, stages, fixture, trace, tol)


def replay_trace(engine: Transformer, stages: TorchStages, fixture, trace: dict, tol: dict) -> None:
    prompt = np.asarray(fixture[f"prompts/{trace['prompt']}/tokens"])
    block = trace["ddtree"]["block_size"]
    budget = trace["ddtree"]["budget"]
    cache = engine.new_cache(1, len(prompt) + trace["max_new_tokens"] + block + budget + 1)
    engine_forward(engine, cache, [causal_request(prompt, 0)])
    for r in range(trace["rounds"]):
        get = lambda name: torch.as_tensor(np.array(fixture[f"traces/{trace['name']}/rounds/{r}/{name}"]))  # noqa: E731
        start = int(get("start"))
        topk_lp, topk_id = stages.topk_logprobs(get("draft_logits")[None], get("topk_lp").shape[-1])
        torch.testing.assert_close(topk_lp[0], get("topk_lp"), rtol=0, atol=0)
        torch.testing.assert_close(topk_id[0], get("topk_id"), rtol=0, atol=0)
        trees = stages.build_trees(topk_lp, topk_id, torch.tensor([budget]), get("root").reshape(1))
        for name in ("parents", "tokens", "depths", "scores"):
            torch.testing.assert_close(getattr(trees, name)[0], get(name), rtol=0, atol=0)
        compiled = stages.compile_trees(trees, torch.tensor([start]))
        torch.testing.assert_close(compiled.positions[0], get("positions"), rtol=0, atol=0)
        bits = get("visibility_bits")
        assert (compiled.visibility_bits[0].numpy().view(np.uint32) == bits.numpy()).all()
        n_new = trees.n + 1
        logits = engine.forward(trees.tokens, compiled.positions, compiled.visibility, n_new,
                                torch.tensor([start]), cache)
        np.testing.assert_allclose(logits[0].numpy(), get("verify_logits").numpy(), rtol=tol["rtol"], atol=tol["atol"])
        temperature = trace["ddtree"]["temperature"]          # sampled traces: with their recorded uniforms
        choices = (stages.sample_choices(logits, temperature, get("uniforms")[None]) if temperature > 0
                   else stages.greedy_choices(logits))
        torch.testing.assert_close(choices[0], get("choices"), rtol=0, atol=0)
        accepted, accept_len, next_root = stages.accept(trees, choices)
        torch.testing.assert_close(accepted[0, :int(accept_len[0])], get("accepted"), rtol=0, atol=0)
        assert int(next_root[0]) == int(get("next_root"))
        stages.compact_kv(cache, torch.tensor([start]), accepted, accept_len)


# ---- bad input ----

def valid_call(engine: Transformer) -> dict:
    n = 4
    return dict(tokens=torch.arange(n)[None], positions=torch.arange(n)[None],
                new_visibility=torch.ones(n, n, dtype=torch.bool).tril()[None], n_new=torch.tensor([n]),
                starts=torch.tensor([0]), cache=engine.new_cache(1, 8))


BAD_CALLS = {
    "tokens int32": (lambda c, e: c.update(tokens=c["tokens"].int()), "tokens must be torch.int64"),
    "tokens 1-D": (lambda c, e: c.update(tokens=c["tokens"][0]), "tokens must be"),
    "tokens on meta": (lambda c, e: c.update(tokens=c["tokens"].to("meta")), "tokens is on meta"),
    "token out of vocab": (lambda c, e: c["tokens"].__setitem__((0, 1), e.cfg.vocab_size), r"tokens must lie"),
    "positions shape": (lambda c, e: c.update(positions=c["positions"][:, :3]), "positions shape"),
    "visibility not bool": (lambda c, e: c.update(new_visibility=c["new_visibility"].int()), "new_visibility must"),
    "visibility shape": (lambda c, e: c.update(new_visibility=c["new_visibility"][:, :3]), "new_visibility shape"),
    "token blind to itself": (lambda c, e: c["new_visibility"].__setitem__((0, 2, 2), False), "see itself"),
    "n_new too large": (lambda c, e: c.update(n_new=torch.tensor([5])), r"n_new must lie"),
    "negative start": (lambda c, e: c.update(starts=torch.tensor([-1])), "starts must be >= 0"),
    "prompt longer than the cache": (lambda c, e: c.update(starts=torch.tensor([6])), "longer than the cache"),
    "cache batch": (lambda c, e: c.update(cache=e.new_cache(2, 8)), "cache holds 2 requests"),
    "cache dtype": (lambda c, e: c.update(cache=KVCache.allocate(e.cfg, 1, 8, dtype=torch.float64)), "cache dtype"),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_forward_rejects_bad_input(model_zoo, bad):
    engine = model_zoo.get("tiny2").engine()
    call = valid_call(engine)
    engine.forward(**call)                       # the unmodified call is fine
    mutate, message = BAD_CALLS[bad]
    call = valid_call(engine)
    mutate(call, engine)
    with pytest.raises(ValueError, match=message):
        engine.forward(**call)


def test_constructor_rejects_bad_weights_and_dtype(model_zoo):
    case = model_zoo.get("tiny2")
    missing = {k: v for k, v in case.weights.items() if k != "layers.1.attn.wkv_b"}
    with pytest.raises(ValueError, match=r"'layers.1.attn.wkv_b' is missing"):
        Transformer(case.cfg, missing)
    misshapen = {**case.weights, "norm": np.ones(7, np.float32)}
    with pytest.raises(ValueError, match=r"'norm' has shape \[7\]"):
        Transformer(case.cfg, misshapen)
    with pytest.raises(ValueError, match="not part of this config"):
        Transformer(case.cfg, {**case.weights, "layers.9.attn.wo": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="dtype must be one of"):
        Transformer(case.cfg, case.weights, dtype=torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Transformer(case.cfg, case.weights, device="cuda")


# ---- the forward reads nothing back to the host ----

class MetaAttention:
    """torch_attention, also as the 'invariant form' (the tiles' test needs a backend that
    reads nothing back; the invariant torch backend does)."""

    def __call__(self, *args):
        return torch_attention(*args)

    def invariant_form(self):
        return self


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("moe, dtype", [("grouped", torch.bfloat16), ("dense", torch.float32)])
def test_forward_runs_on_the_meta_device(model_zoo, moe, dtype, invariant):
    """Meta tensors have no values: any .item(), .tolist(), nonzero, boolean-mask indexing or
    Python branch on a tensor raises. A forward that runs there cannot synchronize with the
    host, so it can be captured in a CUDA graph (the MoE's grouped dispatch needs bf16 there,
    as on CUDA)."""
    case = model_zoo.get("tiny2")
    meta = {name: torch.from_numpy(w).to("meta") for name, w in case.weights.items()}
    engine = Transformer(case.cfg, meta, device="meta", dtype=dtype, attention=MetaAttention(), moe=moe,
                         invariant=invariant)
    assert engine.moe == ("dense" if invariant else moe) and engine.tile == (64 if invariant else None)
    batch, n = 3, 70                                          # two tiles in invariant mode
    tokens = torch.zeros(batch, n, dtype=torch.int64, device="meta")
    logits = engine.forward(tokens, tokens, torch.ones(batch, n, n, dtype=torch.bool, device="meta"),
                            torch.zeros(batch, dtype=torch.int64, device="meta"),
                            torch.zeros(batch, dtype=torch.int64, device="meta"), engine.new_cache(batch, 80),
                            check=False)
    assert logits.shape == (batch, n, case.cfg.vocab_size) and logits.dtype == torch.float32


def test_moe_dispatches_agree(model_zoo):
    """grouped (sorted pairs, grouped products) and dense (every expert on every row) give the
    same logits, padding rows included in the call."""
    case = model_zoo.get("tiny2")
    rng = np.random.default_rng(13)
    prompts, trees = ragged_rounds(case.cfg.vocab_size, seed=14)
    results = []
    for moe in ("grouped", "dense"):
        engine = Transformer(case.cfg, case.weights, moe=moe)
        cache = engine.new_cache(3, 40)
        results.append(engine_forward(engine, cache, prompts, rng) + engine_forward(engine, cache, trees, rng))
    for grouped, dense in zip(*results):
        np.testing.assert_allclose(grouped, dense, rtol=0, atol=1e-5)


def test_unchecked_forward_takes_bad_values_without_error(model_zoo):
    """check=False reads no values: out-of-range tokens and slots give garbage logits, never an
    error or an out-of-bounds access; the default check still names the problem."""
    engine = model_zoo.get("tiny2").engine()
    call = valid_call(engine)
    call["tokens"][0, 1] = engine.cfg.vocab_size + 5
    call["starts"] = torch.tensor([7])                      # slots 7 .. 10 of 8
    logits = engine.forward(**call, check=False)
    assert logits.shape == (1, 4, engine.cfg.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="tokens must lie|longer than the cache"):
        engine.forward(**call)


def test_forward_rejects_more_columns_than_cache_slots(model_zoo):
    engine = model_zoo.get("tiny2").engine()
    call = valid_call(engine)
    call["cache"] = engine.new_cache(1, 3)
    with pytest.raises(ValueError, match="4 new-token columns do not fit the cache's 3 slots"):
        engine.forward(**call, check=False)


# ---- the capture hook ----

def test_capture_hook_sees_every_point_with_batch_layout(model_zoo):
    """capture(name, layer, tensor [B, N, ...]) at every point of every layer (no router on a
    dense layer), the logits last and equal to the forward's; the hook changes nothing."""
    case = model_zoo.get("tiny")
    seen = []
    engine = Transformer(case.cfg, case.weights, capture=lambda name, layer, t: seen.append((name, layer, t.clone())))
    prompts, _ = ragged_rounds(case.cfg.vocab_size, seed=15)
    actual = engine_forward(engine, engine.new_cache(3, 40), prompts)
    expected = engine_forward(case.engine(), case.engine().new_cache(3, 40), prompts)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)
    cfg, width = case.cfg, 11
    points = [(name, layer) for layer in range(cfg.num_hidden_layers) for name in CAPTURE_POINTS[:-1]
              if not (cfg.is_dense_layer(layer) and name in ("router_scores", "experts"))]
    assert [(name, layer) for name, layer, _ in seen] == points + [("logits", -1)]
    shapes = {name: t.shape for name, layer, t in seen if layer == cfg.num_hidden_layers - 1}
    heads, rank = cfg.num_attention_heads, cfg.kv_lora_rank
    assert shapes["q_lat"] == (3, width, heads, rank) and shapes["o_lat"] == (3, width, heads, rank)
    assert shapes["c_kv"] == (3, width, rank) and shapes["experts"] == (3, width, cfg.num_experts_per_tok)
    assert shapes["router_scores"] == (3, width, cfg.n_routed_experts)
    logits = seen[-1][2]
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(logits[b, :len(p.tokens)].numpy(), actual[b])
