"""refgen.decode and refgen.drafters: the DDTree == AR greedy invariant, forward counts,
round bookkeeping, sampling, stop tokens; on a hash stand-in target and the real model."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdtr_format import PRESETS, DDTreeConfig, ModelConfig
from refgen.ddtree import sample_choices
from refgen.decode import ARResult, DDTreeResult, ar_greedy, ddtree_decode
from refgen.drafters import OracleDrafter, RandomDrafter, TargetDrafter
from refgen.model import KVCache, Model, causal_visibility
from refgen.weights import init_weights


class HashTarget:
    """A stand-in target with Model's forward/cache contract and no linear algebra.

    Each token writes (token, position) into every layer's cache slot (c_kv[l][s, 0:2],
    k_pe[l][s, 0]). A query's logits are a hash of what it reads back from every layer
    for the keys it sees, in slot order, and of its own position: a wrong visibility,
    position, or compaction of any layer changes them.
    """

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.cfg: ModelConfig = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab_size,
                                                    num_hidden_layers=2)
        self.seed = seed
        self.forwards = 0

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                cache: KVCache, start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start+n] -> logits float64 [n, V]."""
        n = len(tokens)
        assert visibility.shape == (n, start + n) and visibility.dtype == bool
        assert positions.shape == (n,)
        self.forwards += 1
        for c_kv, k_pe in zip(cache.c_kv, cache.k_pe):
            c_kv[start:start + n, 0] = tokens
            c_kv[start:start + n, 1] = positions
            k_pe[start:start + n, 0] = positions
        logits = np.empty((n, self.cfg.vocab_size))
        for i in range(n):
            keys = np.flatnonzero(visibility[i])
            seen = np.concatenate([c[keys, :2] for c in cache.c_kv] + [k[keys, :1] for k in cache.k_pe],
                                  axis=1)                                   # [keys, 3 * layers]
            digest = hashlib.blake2b(seen.tobytes() + np.int64(positions[i]).tobytes(), digest_size=8,
                                     key=np.int64(self.seed).tobytes())
            logits[i] = np.random.default_rng(int.from_bytes(digest.digest(), "little")).standard_normal(
                self.cfg.vocab_size)
        return logits


@functools.cache
def real_model(preset: str) -> Model:
    cfg = PRESETS[preset]
    return Model(cfg, init_weights(cfg, seed=1))


def make_drafter(kind: str, target_cfg: ModelConfig, prompt: np.ndarray, ar: ARResult,
                 accuracy: float, seed: int) -> OracleDrafter | RandomDrafter:
    if kind == "oracle":
        return OracleDrafter(np.concatenate([prompt, ar.tokens]), target_cfg.vocab_size, accuracy, seed)
    return RandomDrafter(target_cfg.vocab_size, seed)


def check_result_bookkeeping(result: DDTreeResult, prompt: np.ndarray, cfg: DDTreeConfig,
                             max_new_tokens: int, vocab_size: int) -> None:
    """Every round's tensors have the fixture shapes and chain into the next round."""
    L = cfg.depth
    start, root = len(prompt), int(result.tokens[0])
    committed = [root]
    for r in result.rounds:
        n = r.tree.n
        K = r.topk_lp.shape[1]
        assert r.start == start and r.root == root and r.tree.tokens[0] == root
        assert r.draft_logits.shape == (L, vocab_size) and r.draft_logits.dtype == np.float32
        assert r.topk_id.shape == (L, K) and K == min(cfg.budget, vocab_size)
        assert n <= cfg.budget
        assert r.verify_logits.shape == (n + 1, vocab_size)
        assert r.choices.shape == r.margins.shape == (n + 1,)
        assert r.accepted[0] == 0 and 1 <= len(r.accepted) <= L + 1
        np.testing.assert_array_equal(r.compiled.positions, start + r.tree.depths)
        np.testing.assert_array_equal(r.compaction_src, start + r.accepted)
        assert r.next_root == r.choices[r.accepted[-1]]
        committed += [*r.tree.tokens[r.accepted[1:]].tolist(), r.next_root]
        start, root = start + len(r.accepted), r.next_root
    np.testing.assert_array_equal(result.acceptance_lengths, [len(r.accepted) for r in result.rounds])
    assert result.target_forwards == 1 + len(result.rounds)
    assert committed[:max_new_tokens] == result.tokens.tolist()
    if result.rounds:                                              # only the last round overshoots
        assert len(committed) - result.acceptance_lengths[-1] < max_new_tokens <= len(committed)


# ------------------------------------------------------------------ the invariant

budgets = st.one_of(st.sampled_from([0, 1]), st.integers(2, 6), st.integers(24, 64))
# The real model's verify forward costs CPU time per tree token: smaller "large" budgets.
small_budgets = st.one_of(st.sampled_from([0, 1]), st.integers(2, 6), st.integers(12, 20))
block_sizes = st.sampled_from([1, 2, 4, 8, 16])
drafter_kinds = st.tuples(st.sampled_from(["oracle", "random"]), st.sampled_from([0.0, 0.5, 0.9, 1.0]),
                          st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 47), min_size=1, max_size=6), budget=budgets,
       block_size=block_sizes, drafter=drafter_kinds, max_new_tokens=st.integers(1, 24),
       target_seed=st.integers(0, 3))
def test_invariant_stand_in(prompt: list[int], budget: int, block_size: int,
                            drafter: tuple[str, float, int], max_new_tokens: int, target_seed: int) -> None:
    target = HashTarget(vocab_size=48, seed=target_seed)
    prompt = np.array(prompt)
    ar = ar_greedy(target, prompt, max_new_tokens)
    assert ar.target_forwards == target.forwards == max_new_tokens          # 1 per token, prefill's included
    assert len(ar.tokens) == len(ar.margins) == max_new_tokens
    cfg = DDTreeConfig(block_size=block_size, budget=budget)
    target.forwards = 0
    result = ddtree_decode(target, make_drafter(drafter[0], target.cfg, prompt, ar, *drafter[1:]),
                           prompt, cfg, max_new_tokens)
    np.testing.assert_array_equal(result.tokens, ar.tokens)
    assert result.target_forwards == target.forwards
    check_result_bookkeeping(result, prompt, cfg, max_new_tokens, target.cfg.vocab_size)


@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
def test_invariant_real_model(preset: str) -> None:
    model = real_model(preset)
    V = model.cfg.vocab_size

    @settings(max_examples=5, deadline=None, database=None)
    @given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=5), budget=small_budgets,
           block_size=block_sizes, drafter=drafter_kinds, max_new_tokens=st.integers(1, 8))
    def check(prompt: list[int], budget: int, block_size: int, drafter: tuple[str, float, int],
              max_new_tokens: int) -> None:
        prompt = np.array(prompt)
        ar = ar_greedy(model, prompt, max_new_tokens)
        cfg = DDTreeConfig(block_size=block_size, budget=budget)
        result = ddtree_decode(model, make_drafter(drafter[0], model.cfg, prompt, ar, *drafter[1:]),
                               prompt, cfg, max_new_tokens)
        divergent = np.flatnonzero(result.tokens != ar.tokens)
        assert divergent.size == 0, (f"DDTree differs from AR at token {divergent[0]} "
                                     f"(AR margin {ar.margins[divergent[0]]:.3g})")
        check_result_bookkeeping(result, prompt, cfg, max_new_tokens, V)

    check()


class SecondBestDrafter:
    """Puts the true continuation at rank 1 behind a decoy at every depth (lp about -0.6 and
    -0.8): the true path is (1, 1, ...), node 2 onwards, never a prefix of tree order."""

    def __init__(self, true_sequence: np.ndarray, vocab_size: int) -> None:
        self.true_sequence, self.vocab_size = true_sequence, vocab_size

    def __call__(self, context: np.ndarray, depth: int) -> np.ndarray:
        logits = np.zeros((depth, self.vocab_size), dtype=np.float32)
        for d in range(min(depth, len(self.true_sequence) - len(context))):
            truth = self.true_sequence[len(context) + d]
            logits[d, (truth + 1) % self.vocab_size] = 10.0
            logits[d, truth] = 9.8
        return logits


def test_non_prefix_accept_paths_keep_the_invariant() -> None:
    """Accepted paths like [0, 2, 6, ...] make compaction move KV onto slots that later
    copies read: a wrong copy order or a missed layer changes later tokens."""
    target = HashTarget(vocab_size=48, seed=1)
    prompt = np.array([7, 3, 30])
    ar = ar_greedy(target, prompt, 24)
    drafter = SecondBestDrafter(np.concatenate([prompt, ar.tokens]), 48)
    result = ddtree_decode(target, drafter, prompt, DDTreeConfig(block_size=5, budget=20), 24)
    np.testing.assert_array_equal(result.tokens, ar.tokens)
    assert all(r.accepted[:2].tolist() == [0, 2] and len(r.accepted) >= 3 for r in result.rounds)


def test_real_model_oracle_accepts_deep_trees() -> None:
    """A perfect oracle on the real model: every round accepts the whole depth (L + 1 tokens)."""
    model = real_model("tiny")
    prompt = np.array([3, 14, 15, 92])
    ar = ar_greedy(model, prompt, 13)
    result = ddtree_decode(model, OracleDrafter(np.concatenate([prompt, ar.tokens]), 1024, 1.0, 0),
                           prompt, DDTreeConfig(block_size=4, budget=6), 13)
    np.testing.assert_array_equal(result.tokens, ar.tokens)
    assert result.acceptance_lengths.tolist() == [4, 4, 4]
    assert result.target_forwards == 4


def test_ar_prefill_logits_and_margins() -> None:
    target = HashTarget(vocab_size=32)
    prompt = np.array([5, 1, 4])
    ar = ar_greedy(target, prompt, 4)
    cache = KVCache.new(target.cfg, 3)
    expected = target.forward(prompt, np.arange(3), causal_visibility(3, 0), cache, 0)
    np.testing.assert_array_equal(ar.prefill_logits, expected)
    sorted_last = np.sort(ar.prefill_logits[-1])
    assert ar.tokens[0] == np.argmax(ar.prefill_logits[-1])
    assert ar.margins[0] == sorted_last[-1] - sorted_last[-2]


# ------------------------------------------------------------------ stop tokens, truncation, zero


def test_stop_token_ends_both_loops() -> None:
    target = HashTarget(vocab_size=40, seed=7)
    prompt = np.array([1, 2, 3])
    full = ar_greedy(target, prompt, 20)
    stop = int(full.tokens[6])
    cut = full.tokens.tolist().index(stop) + 1
    ar = ar_greedy(target, prompt, 20, stop_tokens=(stop,))
    assert ar.tokens.tolist() == full.tokens[:cut].tolist() and ar.target_forwards == cut
    drafter = OracleDrafter(np.concatenate([prompt, full.tokens]), 40, 1.0, 0)
    result = ddtree_decode(target, drafter, prompt, DDTreeConfig(8, 16), 20, stop_tokens=(stop,))
    assert result.tokens.tolist() == ar.tokens.tolist()
    assert result.acceptance_lengths.tolist() == [8]                  # the stop was inside round 1
    assert result.target_forwards == 2


def test_last_round_is_truncated() -> None:
    target = HashTarget(vocab_size=40)
    prompt = np.array([9])
    ar = ar_greedy(target, prompt, 30)
    drafter = OracleDrafter(np.concatenate([prompt, ar.tokens]), 40, 1.0, 0)
    result = ddtree_decode(target, drafter, prompt, DDTreeConfig(16, 15), 5)
    assert result.tokens.tolist() == ar.tokens[:5].tolist()
    assert result.acceptance_lengths.tolist() == [16] and result.target_forwards == 2


def test_zero_new_tokens() -> None:
    target = HashTarget(vocab_size=16)
    ar = ar_greedy(target, np.array([1, 2]), 0)
    assert ar.tokens.size == 0 and ar.target_forwards == 1 and ar.prefill_logits.shape == (2, 16)
    result = ddtree_decode(target, RandomDrafter(16, 0), np.array([1, 2]), DDTreeConfig(4, 4), 0)
    assert result.tokens.size == 0 and result.rounds == [] and result.target_forwards == 1


# ------------------------------------------------------------------ sampling


def test_sampling_is_reproducible_from_recorded_uniforms() -> None:
    target = HashTarget(vocab_size=24)
    prompt = np.array([4, 2])
    cfg = DDTreeConfig(block_size=4, budget=10, temperature=0.8)
    drafter = RandomDrafter(24, 5)
    first = ddtree_decode(target, drafter, prompt, cfg, 12, uniforms_seed=11)
    again = ddtree_decode(target, drafter, prompt, cfg, 12, uniforms_seed=11)
    other = ddtree_decode(target, drafter, prompt, cfg, 12, uniforms_seed=12)
    assert first.tokens.tolist() == again.tokens.tolist() != other.tokens.tolist()
    first_token = sample_choices(ar_greedy(target, prompt, 0).prefill_logits[-1:], 0.8,
                                 np.array([first.prefill_uniform]))
    assert first.tokens[0] == first_token[0]
    for r in first.rounds:
        assert r.uniforms.shape == (r.tree.n + 1,)
        np.testing.assert_array_equal(sample_choices(r.verify_logits, 0.8, r.uniforms), r.choices)
    greedy = ddtree_decode(target, drafter, prompt, DDTreeConfig(4, 10), 12)
    assert greedy.prefill_uniform is None and all(r.uniforms is None for r in greedy.rounds)


def test_a_margin_floor_redraws_only_the_uniforms_near_a_boundary() -> None:
    target = HashTarget(vocab_size=24)
    cfg = DDTreeConfig(block_size=4, budget=10, temperature=0.8)
    plain = ddtree_decode(target, RandomDrafter(24, 5), np.array([4, 2]), cfg, 16, uniforms_seed=3)
    floored = ddtree_decode(target, RandomDrafter(24, 5), np.array([4, 2]), cfg, 16, uniforms_seed=3,
                            margin_floor=0.05)
    assert min(r.margins.min() for r in plain.rounds) < 0.05 <= min(r.margins.min() for r in floored.rounds)
    assert floored.margins.min() >= 0.05 and len(floored.margins) == len(floored.tokens)
    for r in floored.rounds:
        np.testing.assert_array_equal(sample_choices(r.verify_logits, 0.8, r.uniforms), r.choices)


def test_the_target_drafter_drafts_the_targets_own_chain() -> None:
    model = real_model("tiny2")
    context = np.array([5, 9, 2, 7])
    drafts = TargetDrafter(model)(context, 3)
    ar = ar_greedy(model, context, 3)
    assert drafts.shape == (3, model.cfg.vocab_size) and drafts.dtype == np.float32
    np.testing.assert_array_equal(drafts[0], ar.prefill_logits[-1].astype(np.float32))
    assert np.argmax(drafts, axis=1).tolist() == ar.tokens.tolist()
    np.testing.assert_array_equal(TargetDrafter(model)(context, 3), drafts)


def test_sampling_has_the_ar_sampling_distribution() -> None:
    """The first two sampled tokens over many uniform seeds vs the target's exact joint law;
    and within round 0, the root's and node 1's choices vs the product of their exact laws
    (each node has a uniform of its own)."""
    V, T, runs = 4, 1.0, 1000
    target = HashTarget(vocab_size=V, seed=3)
    prompt = np.array([1, 0])

    def softmax(row: np.ndarray) -> np.ndarray:
        e = np.exp((row - row.max()) / T)
        return e / e.sum()

    cache = KVCache.new(target.cfg, 4)
    p_first = softmax(target.forward(prompt, np.arange(2), causal_visibility(2, 0), cache, 0)[-1])
    joint = np.zeros((V, V))
    for t1 in range(V):
        logits = target.forward(np.array([t1]), np.array([2]), np.ones((1, 3), dtype=bool), cache, 2)
        joint[t1] = p_first[t1] * softmax(logits[0])
    drafter = RandomDrafter(V, 0)                                 # V = 4: the tree holds most paths
    counts = np.zeros((V, V))
    within, within_law = Counter(), np.zeros((V, V))
    multi_token_rounds = 0
    for seed in range(runs):
        result = ddtree_decode(target, drafter, prompt, DDTreeConfig(3, 6, temperature=T), 2,
                               uniforms_seed=seed)
        counts[result.tokens[0], result.tokens[1]] += 1
        multi_token_rounds += int(result.acceptance_lengths[0] > 1)
        first_round = result.rounds[0]
        within[int(first_round.choices[0]), int(first_round.choices[1])] += 1
        within_law += np.outer(softmax(first_round.verify_logits[0]), softmax(first_round.verify_logits[1])) / runs
    assert multi_token_rounds > runs // 4                          # the tree path is really exercised
    expected = joint * runs
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45.0, f"chi-square {chi2:.1f} over 15 degrees of freedom (p < 1e-4)"
    pytest.importorskip("scipy", reason="scipy is not installed (pip install -e '.[test]' from a checkout): the "
                        "independence check's chi-square law needs it")
    from engine.validate.judging.distribution import distribution_test

    independence = distribution_test(within, {(a, b): within_law[a, b] for a in range(V) for b in range(V)})
    assert independence.passed, str(independence)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("prompt,max_new,message", [
    (np.array([], dtype=np.int64), 3, "prompt"),
    (np.array([1, 99]), 3, r"prompt: token ids must lie in \[0, 16\)"),
    (np.array([[1, 2]]), 3, "prompt"),
    (np.array([1.0, 2.0]), 3, "prompt"),
    (np.array([1, 2]), -1, "max_new_tokens"),
])
def test_decode_bad_input(prompt: np.ndarray, max_new: int, message: str) -> None:
    target = HashTarget(vocab_size=16)
    with pytest.raises(ValueError, match=message):
        ar_greedy(target, prompt, max_new)
    with pytest.raises(ValueError, match=message):
        ddtree_decode(target, RandomDrafter(16, 0), prompt, DDTreeConfig(4, 4), max_new)


def test_decode_rejects_mismatched_drafter_and_config() -> None:
    target = HashTarget(vocab_size=16)
    with pytest.raises(ValueError, match="vocab_size 17"):
        ddtree_decode(target, RandomDrafter(17, 0), np.array([1]), DDTreeConfig(4, 4), 3)
    with pytest.raises(ValueError, match="DDTreeConfig"):
        ddtree_decode(target, RandomDrafter(16, 0), np.array([1]), {"block_size": 4, "budget": 4}, 3)

    class WrongShape(RandomDrafter):
        def __call__(self, context: np.ndarray, depth: int) -> np.ndarray:
            return super().__call__(context, depth + 1)

    with pytest.raises(ValueError, match=r"drafter: expected float32 \[3, 16\]"):
        ddtree_decode(target, WrongShape(16, 0), np.array([1]), DDTreeConfig(4, 4), 3)


# ------------------------------------------------------------------ drafters


@pytest.mark.parametrize("make", [lambda: RandomDrafter(50, 3),
                                  lambda: OracleDrafter(np.arange(40) % 50, 50, 0.7, 3)])
def test_drafters_are_deterministic(make) -> None:
    drafter = make()
    context = np.array([5, 6, 7, 8])
    out = drafter(context, 6)
    assert out.shape == (6, 50) and out.dtype == np.float32
    np.testing.assert_array_equal(out, make()(context.copy(), 6))
    assert not np.array_equal(out, drafter(np.array([5, 6, 7, 9]), 6))
    assert not np.array_equal(out, drafter(np.array([4, 5, 6, 7, 8]), 6))
    assert drafter(context, 0).shape == (0, 50)


def truth_ranks(drafter: OracleDrafter, context_len: int, depth: int) -> list[int]:
    logits = drafter(drafter.true_sequence[:context_len], depth)
    ranks = []
    for d in range(depth):
        truth = drafter.true_sequence[context_len + d]
        ranks.append(int((logits[d] > logits[d, truth]).sum()))
    return ranks


def test_oracle_accuracy_and_wrong_ranks() -> None:
    V = 64
    sequence = np.random.default_rng(0).integers(0, V, size=400)
    perfect = OracleDrafter(sequence, V, 1.0, 0)
    assert all(r == 0 for c in range(1, 300, 7) for r in truth_ranks(perfect, c, 15))
    never = OracleDrafter(sequence, V, 0.0, 0)
    wrong = [r for c in range(1, 300, 7) for r in truth_ranks(never, c, 15)]
    assert set(wrong) <= {*range(1, 8), V - 1} and V - 1 in wrong and 1 in wrong
    half = OracleDrafter(sequence, V, 0.5, 0)
    hits = np.mean([r == 0 for c in range(1, 300, 3) for r in truth_ranks(half, c, 15)])
    assert 0.45 < hits < 0.55
    # The true token holds most of the probability when it is top-1.
    logits = perfect(sequence[:10], 1)[0].astype(np.float64)
    assert np.exp(logits.max()) / np.exp(logits).sum() > 0.5


def test_oracle_past_the_sequence_is_noise() -> None:
    drafter = OracleDrafter(np.array([1, 2, 3]), 10, 1.0, 0)
    out = drafter(np.array([1, 2]), 4)                              # depth 1 knows token 3, then nothing
    assert np.argmax(out[0]) == 3 and out.shape == (4, 10)


@pytest.mark.parametrize("build,message", [
    (lambda: RandomDrafter(0, 1), "vocab_size"),
    (lambda: OracleDrafter(np.array([1, 20]), 10, 0.5, 0), "true_sequence"),
    (lambda: OracleDrafter(np.array([1, 2]), 10, 1.5, 0), "accuracy"),
    (lambda: RandomDrafter(10, 0)(np.array([], dtype=np.int64), 2), "context"),
    (lambda: RandomDrafter(10, 0)(np.array([1]), -1), "depth"),
    (lambda: RandomDrafter(10, -3), "seed"),
    (lambda: OracleDrafter(np.array([1]), 10, 0.5, 1.5), "seed"),
])
def test_drafter_bad_input(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_refgen_stages_import_neither_torch_nor_engine() -> None:
    code = ("import sys, refgen.ddtree, refgen.drafters, refgen.decode; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
