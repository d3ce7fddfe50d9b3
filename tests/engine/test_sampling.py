"""Sampled DDTree, checked exactly and statistically.

Exactly: `kdtree validate`'s sample_accept capability against the fixtures' sampled
traces and adversarial cases (the built-in engine passes; the `<=` bug, a missing cap
at the top of the CDF and one uniform shared by a round's nodes each fail, naming
where).

Statistically, for the built-in engine drawing its own uniforms (engine.validate.
distribution): RUNS requests of one prompt on a vocabulary of 8, HORIZON tokens each;
the law of the emitted sequences against the target's exact law enumerated in float64
by refgen, and the joint law of two nodes' choices within one round against the
product of their exact laws. Each test's false-alarm rate is at most ALPHA + DELTA =
2e-4 and CI runs it at a fixed seed (SEED). Power at RUNS = 2000, documented in
docs/adapter.md and computed in `test_documented_power`: the chi-square part alone
detects with probability >= 0.99 an engine that emits the greedy sequence instead of
a sample at rate 0.22, and a temperature off by 15%; the planted bugs below (the
greedy next root, one uniform shared by a round's nodes, the temperature ignored)
fail at this seed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import numpy as np
import pytest
import torch

from kdtr_format import PRESETS, DDTreeConfig
from engine.adapter import TorchAdapter
from engine.validate.door.protocol_v2 import PerRequest
from engine.decode import ddtree_decode
from engine.drafters import RandomDrafter
from engine.model import Transformer
from engine.stages import TorchStages
from engine.validate import Status, validate
from refgen.model import KVCache, Model
from refgen.weights import init_weights

pytest.importorskip("scipy", reason="scipy is not installed (pip install -e '.[test]' from a checkout): the sampling tests' "
                    "chi-square laws need it")
from engine.validate.judging.distribution import (chi_square_power, distribution_test,  # noqa: E402
                                          sequence_probabilities, tv_bound)

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=8, hidden_size=32, num_hidden_layers=1,
                          first_k_dense_replace=1, intermediate_size=64)
PROMPT = [3, 1, 4, 1, 5]
DDTREE = DDTreeConfig(block_size=3, budget=6, temperature=1.5)
HORIZON, RUNS, SEED = 3, 2000, 2026
ALPHA = DELTA = 1e-4


@functools.cache
def target() -> tuple[Transformer, Model]:
    weights = init_weights(CFG, 7)
    return Transformer(CFG, weights), Model(CFG, weights)


@functools.cache
def next_token(prefix: tuple[int, ...], temperature: float = DDTREE.temperature) -> np.ndarray:
    """The target's exact law of the token after PROMPT + prefix (float64)."""
    tokens = np.array(PROMPT + list(prefix))
    logits = target()[1].prefill(tokens, KVCache.new(CFG, len(tokens)))[-1] / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


@functools.cache
def runs(stages_name: str = "torch"):
    """RUNS sampled DDTree decodes of PROMPT in one batch, every round recorded."""
    return ddtree_decode(target()[0], RandomDrafter(CFG.vocab_size, seed=1), [PROMPT] * RUNS, DDTREE, HORIZON,
                         generator=torch.Generator().manual_seed(SEED), stages=STAGES[stages_name](), record=True)


def sequence_test(result):
    return distribution_test(Counter(tuple(r.tokens) for r in result.requests),
                             sequence_probabilities(next_token, HORIZON), ALPHA, DELTA)


def independence_test(result):
    """Round 0's choices at the root and at node 1 (its first child): every request with the
    same first token has the same tree, so the exact joint law is a mixture of products."""
    pairs = Counter((int(r.rounds[0].choices[0]), int(r.rounds[0].choices[1])) for r in result.requests)
    groups = Counter((r.tokens[0], int(r.rounds[0].tokens[1])) for r in result.requests)
    law = np.zeros((CFG.vocab_size, CFG.vocab_size))
    for (first, child), count in groups.items():
        law += count / RUNS * np.outer(next_token((first,)), next_token((first, child)))
    return distribution_test(pairs, {(a, b): law[a, b] for a, b in zip(*np.nonzero(law))}, ALPHA, DELTA)


# ---- planted bugs, as stages the decode loop takes ----

class SharedUniform(TorchStages):
    """One uniform for every node of a round (the first node's)."""

    def sample_choices(self, logits, temperature, uniforms):
        return super().sample_choices(logits, temperature, uniforms[:, :1].expand_as(uniforms))


class GreedyNextRoot(TorchStages):
    """The sampled walk, but the next root is the target's argmax at the last accepted node."""

    def greedy_choices(self, logits):
        self.logits = logits
        return super().greedy_choices(logits)

    def sample_choices(self, logits, temperature, uniforms):
        self.logits = logits
        return super().sample_choices(logits, temperature, uniforms)

    def accept(self, trees, choices):
        accepted, accept_len, _ = super().accept(trees, choices)
        last = accepted.gather(1, (accept_len - 1)[:, None])
        return accepted, accept_len, self.logits.argmax(-1).gather(1, last)[:, 0]


class IgnoresTemperature(TorchStages):
    def sample_choices(self, logits, temperature, uniforms):
        return super().sample_choices(logits, 1.0, uniforms)


STAGES = {"torch": TorchStages, "shared uniform": SharedUniform, "greedy next root": GreedyNextRoot,
          "ignores temperature": IgnoresTemperature}


def test_the_runs_exercise_the_tree():
    """Rounds accept several tokens, and siblings, so the tests below test DDTree, not AR."""
    first_rounds = [r.rounds[0] for r in runs().requests]
    accepted = Counter(len(r.accepted) for r in first_rounds)
    assert accepted[2] > RUNS // 10 and accepted[3] > RUNS // 50, accepted
    siblings = sum(int(len(r.accepted) > 1 and int(r.accepted[1]) != 1) for r in first_rounds)
    assert siblings > RUNS // 20, siblings


def test_sampled_sequences_follow_the_target_distribution():
    result = sequence_test(runs())
    assert result.passed, str(result)
    assert result.cells >= 20, str(result)            # enough cells for the test to see a shape


def test_choices_within_a_round_are_independent():
    result = independence_test(runs())
    assert result.passed, str(result)


@pytest.mark.parametrize("planted, sequences, independence", [
    ("shared uniform", False, False),
    ("greedy next root", False, True),
    ("ignores temperature", False, False),
])
def test_planted_sampling_bugs_fail(planted, sequences, independence):
    result = runs(planted)
    assert sequence_test(result).passed is sequences, str(sequence_test(result))
    assert independence_test(result).passed is independence, str(independence_test(result))


def test_documented_power():
    """docs/adapter.md's power statement, computed for RUNS runs: the chi-square part alone
    detects, with probability >= 0.99, an engine that emits the greedy sequence instead of a
    sample at rate 0.22 (TV 0.11), and one whose temperature is off by 15% either way; at the
    exact law it fires at rate ALPHA; the TV bound is 0.13."""
    laws = sequence_probabilities(next_token, HORIZON)
    outcomes = list(laws)
    p = np.array([laws[o] for o in outcomes])
    greedy = np.zeros_like(p)
    greedy[int(np.argmax(p))] = 1.0                  # the likeliest sequence is the greedy one here
    assert chi_square_power(p, 0.78 * p + 0.22 * greedy, RUNS, ALPHA) >= 0.99
    for factor in (0.85, 1.15):
        off = sequence_probabilities(lambda prefix: next_token(prefix, DDTREE.temperature * factor), HORIZON)
        assert chi_square_power(p, [off.get(o, 0.0) for o in outcomes], RUNS, ALPHA) >= 0.99, factor
    assert chi_square_power(p, p, RUNS, ALPHA) == pytest.approx(ALPHA, rel=0.05)
    assert tv_bound(p, RUNS, DELTA) < 0.13


# ---- exactly, through validate's sample_accept ----

def cdf(logits: np.ndarray, temperature: float) -> np.ndarray:
    x = logits / temperature
    p = np.exp(x - x.max(axis=1, keepdims=True))
    return np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)


class Sampler:
    """sample_accept alone, from its own inverse CDF, with the built-in accept walk."""

    name = "sampler"

    def choose(self, cdf: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        below = (cdf <= uniforms[:, None]).sum(axis=1)
        last_positive = cdf.shape[1] - 1 - np.argmax(np.diff(cdf, prepend=0.0, axis=1)[:, ::-1] > 0, axis=1)
        return np.minimum(below, last_positive)

    def sample_accept(self, parents, tokens, logits, temperature, uniforms):
        choices = self.choose(cdf(logits, temperature), uniforms)
        return (choices, *PerRequest(TorchAdapter()).accept(parents, tokens, choices))


class LessOrEqual(Sampler):
    """The `<=` bug: the first token with u <= cdf, so u = 0 takes a token of probability 0."""

    def choose(self, cdf, uniforms):
        return np.array([np.searchsorted(row, u, side="left") for row, u in zip(cdf, uniforms)])


class Uncapped(Sampler):
    """No cap: when rounding leaves u above the last cdf value, a token of probability 0."""

    def choose(self, cdf, uniforms):
        return np.minimum((cdf <= uniforms[:, None]).sum(axis=1), cdf.shape[1] - 1)


class OneUniform(Sampler):
    def choose(self, cdf, uniforms):
        return super().choose(cdf, np.full_like(uniforms, uniforms[0]))


def sample_accept_row(adapter, golden, tmp_path):
    (tmp_path / "tiny2.kdtr").symlink_to(golden / "tiny2.kdtr")
    report = validate(adapter, tmp_path)
    (row,) = [c for c in report.checks if c.name == "sample accept"]
    return row


def test_a_correct_sampler_passes_every_sampled_round_and_case(golden, tmp_path):
    assert sample_accept_row(Sampler(), golden, tmp_path).status is Status.EXACT
    assert validate(TorchAdapter(), tmp_path, require="sample_accept").counts()["FAIL"] == 0


@pytest.mark.parametrize("adapter, where", [
    (LessOrEqual, "(case u_zero)"),
    (Uncapped, "(case u_max)"),
    (OneUniform, "(trace t7 round 0)"),
])
def test_broken_samplers_fail_naming_where(golden, tmp_path, adapter, where):
    row = sample_accept_row(adapter(), golden, tmp_path)
    assert row.status is Status.FAIL and row.detail.endswith(where), row.detail


def test_the_engine_replay_fails_a_greedy_next_root(golden, tmp_path, builtin_decode_only):
    """The built-in engine's own sampled decode, replayed with the fixture's uniforms."""
    (tmp_path / "tiny2.kdtr").symlink_to(golden / "tiny2.kdtr")
    builtin_decode_only(GreedyNextRoot())
    report = validate(None, tmp_path, require="none")
    (replay,) = [c for c in report.checks if c.name == "engine DDTree replay (batched)"]
    assert replay.status is Status.FAIL and "(trace t7" in replay.detail, replay.detail
