"""The rules of the built-in engine's own rows (engine/validate/rows/engine.py), each at its line:

- "engine sampling: fresh uniforms every round": a uniform of exactly 1.0 is outside [0, 1)
  (the largest float64 below 1 is inside); consecutive rounds whose uniforms correlate fail
  once |r| sqrt(pairs) reaches CORRELATION_Z, on either side of zero, and pass just below it.
  Under independence r sqrt(pairs) is about a standard normal (the products of the centred
  pairs are uncorrelated, each of variance 1/144 against a product of variances 1/144), so a
  bound on |r| alone (never reached: |r| <= 1) is a check that cannot fail.
- a near-tie decides only the rows that depend on it (`follow_near_tie`): a round's accepted
  path and next root follow a near-tie in its choices, a trace's acceptance lengths any
  near-tie of the trace; a FAIL in any other row stays a FAIL. A replayed round's rows are
  all near-ties only when its tree differs and the engine's own top-k log-probs differ from
  the fixture's (`replayed_round`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.validate.reports.report import Check, Status
from engine.validate.rows.engine import CORRELATION_Z, follow_near_tie, replayed_round, uniforms_check

REQUESTS, NODES, ROUNDS = 4, 9, 10            # as the row's own decode: 4 requests, budget 8 (9 nodes)


def copula_draws(rho: float, seed: int) -> list[np.ndarray]:
    """A sampler whose uniforms at one request and node follow a Gaussian AR(1) chain across
    rounds (each uniform exactly U(0, 1), consecutive rounds correlated through rho): the
    prefill's [B, 1], then ROUNDS rounds of [B, N]."""
    rng = np.random.default_rng(seed)
    phi = np.vectorize(lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2))))
    z = rng.standard_normal((REQUESTS, NODES))
    drawn = [rng.random((REQUESTS, 1))]
    for _ in range(ROUNDS):
        drawn.append(phi(z))
        z = rho * z + math.sqrt(1 - rho * rho) * rng.standard_normal((REQUESTS, NODES))
    return drawn


def z_score(drawn: list[np.ndarray]) -> float:
    """r sqrt(pairs) of consecutive rounds' uniforms at the same request and node (signed)."""
    x = np.concatenate([u.reshape(-1) for u in drawn[1:-1]])
    y = np.concatenate([u.reshape(-1) for u in drawn[2:]])
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / math.sqrt((x * x).sum() * (y * y).sum())) * math.sqrt(len(x))


def independent_draws(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((REQUESTS, 1))] + [rng.random((REQUESTS, NODES)) for _ in range(ROUNDS)]


# ---- uniforms in [0, 1) ----

def test_a_uniform_of_exactly_one_is_outside_and_the_largest_below_one_is_inside():
    drawn = independent_draws()
    drawn[3][2, 5] = 1.0
    check = uniforms_check("s", drawn)
    assert check.status is Status.FAIL
    assert check.detail == "round 2's uniform [2, 5] is 1.0, outside [0, 1)"
    drawn[3][2, 5] = np.nextafter(1.0, 0.0)
    drawn[4][0, 0] = 0.0
    assert uniforms_check("s", drawn).status is Status.EXACT


@pytest.mark.parametrize("value", [-0.0 - 2.0 ** -60, 1.0 + 2.0 ** -52, math.nan])
def test_a_prefill_uniform_outside_the_interval_fails(value):
    drawn = independent_draws()
    drawn[0][1, 0] = value
    check = uniforms_check("s", drawn)
    assert check.status is Status.FAIL and check.detail.startswith("the prefill's uniform [1, 0] is "), check.detail


# ---- consecutive rounds uncorrelated ----

@pytest.mark.parametrize("rho, seed", [(0.36, 1), (-0.35, 2)])
def test_rounds_correlated_just_over_the_bound_fail(rho, seed):
    drawn = copula_draws(rho, seed)
    z = z_score(drawn)
    assert CORRELATION_Z <= abs(z) < CORRELATION_Z + 0.5, z          # just over the line
    check = uniforms_check("s", drawn)
    assert check.status is Status.FAIL, check.detail
    assert f"|r| sqrt(pairs) = {abs(z):.1f} >= {CORRELATION_Z:g}" in check.detail
    assert f"over {(ROUNDS - 1) * REQUESTS * NODES} pairs" in check.detail


def test_rounds_correlated_just_under_the_bound_pass():
    drawn = copula_draws(0.35, 1)
    z = z_score(drawn)
    assert CORRELATION_Z - 0.5 < abs(z) < CORRELATION_Z, z
    assert uniforms_check("s", drawn).status is Status.EXACT


def test_independent_rounds_stay_far_below_the_bound():
    """The bound's false-alarm rate: r sqrt(pairs) of independent uniforms is about N(0, 1)
    (P(|z| >= 6) = 2e-9); over 200 seeded decodes its spread is about 1."""
    zs = np.array([z_score(independent_draws(seed)) for seed in range(200)])
    assert 0.8 < zs.std() < 1.2 and np.abs(zs).max() < 4.5, (zs.std(), np.abs(zs).max())
    assert all(uniforms_check("s", independent_draws(seed)).status is Status.EXACT for seed in range(20))


# ---- a near-tie and the rows that follow it ----

def round_rows(choices: Status) -> list[Check]:
    """A replayed round: its tree rows wrong, its choices `choices`, its accept rows wrong."""
    fail = Status.FAIL
    return [Check("s", "parents", fail, detail="1 differ"), Check("s", "tokens", fail, detail="1 differ"),
            Check("s", "scores", fail, detail="beyond tolerance"), Check("s", "choices", choices, detail="at 2"),
            Check("s", "accepted", fail, detail="got [0, 2]"), Check("s", "next root", fail, detail="got 7")]


def test_a_near_tie_in_the_choices_makes_only_the_accept_rows_near_ties():
    rows = follow_near_tie(round_rows(Status.NEAR_TIE), True, ("accepted", "next root"))
    assert {r.name: r.status for r in rows} == {
        "parents": Status.FAIL, "tokens": Status.FAIL, "scores": Status.FAIL, "choices": Status.NEAR_TIE,
        "accepted": Status.NEAR_TIE, "next root": Status.NEAR_TIE}
    followed = [r for r in rows if r.name in ("accepted", "next root")]
    assert all(r.detail.endswith("; follows a near-tie decision") for r in followed)
    assert follow_near_tie(round_rows(Status.FAIL), False, ("accepted", "next root")) == round_rows(Status.FAIL)


def test_a_trace_near_tie_makes_its_acceptance_lengths_a_near_tie_and_nothing_else():
    lengths = Check("s", "acceptance lengths", Status.FAIL, detail="differ")
    other = Check("s", "tokens", Status.FAIL, detail="at 3")
    assert [r.status for r in follow_near_tie([lengths, other], True, ("acceptance lengths",))] == \
        [Status.NEAR_TIE, Status.FAIL]


def test_a_replayed_round_is_a_score_near_tie_only_when_its_topk_and_its_tree_differ():
    wrong_tree = round_rows(Status.EXACT)
    assert all(r.status is not Status.FAIL for r in replayed_round(wrong_tree, tree_rows=3, same_topk=False))
    assert replayed_round(wrong_tree, tree_rows=3, same_topk=True) == wrong_tree
    right_tree = [Check("s", n, Status.EXACT) for n in ("parents", "tokens", "depths")] + \
        [Check("s", "accepted", Status.FAIL, detail="got [0, 2]")]
    assert replayed_round(right_tree, tree_rows=3, same_topk=False) == right_tree
