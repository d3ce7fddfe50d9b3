"""The distribution test, for sampling implementations that bring their own randomness.

An implementation that draws its own uniforms cannot be compared token for token
(`sample_accept` with the fixtures' uniforms does that); what it must get right is
the law of what it emits: DDTree sampling has the AR sampling distribution. On a
small vocabulary and a short horizon that law is known exactly: the probability
of every token sequence is the product of the target's conditional
probabilities (`sequence_probabilities` enumerates them). N independent runs
are then tested against it twice (`distribution_test`):

- chi-square goodness of fit: outcomes whose expected count N p is below
  MIN_EXPECTED are pooled into one cell (merged into the smallest other cell if
  still below); X^2 over the c cells against a chi-square law with c - 1 degrees
  of freedom; it fails when the p-value is below `alpha`.
- total variation: TV = 1/2 sum |count / N - p| fails above
  `tv_bound(p, N, delta)` = 1/2 sum sqrt(p (1 - p) / N) + sqrt(ln(1 / delta) / (2 N)).
  The first term bounds E[TV] (Jensen), and one run moves TV by at most 1/N, so
  by McDiarmid's inequality TV exceeds the bound with probability at most delta.
- an observed outcome of probability 0 fails both.

The false-alarm rate is at most alpha + delta at any N (the chi-square part to
its usual large-sample approximation, the TV part exactly). The runs need only
be independent, not identically distributed: for a mixture (the expected law of
runs with different conditions, as in a within-round independence test) both
parts stay valid, the chi-square part conservative.

Power: for a biased law q, X^2 is approximately noncentral chi-square with
noncentrality N sum (q - p)^2 / p over the pooled cells; `chi_square_power`
gives the chance that the test detects q at N. The TV part detects every q with
TV(q, p) > tv_bound(p, N, delta) + tv_bound(q, N, beta) with probability at
least 1 - beta. Needs scipy (the test extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0          # the smallest expected count of a chi-square cell


def sequence_probabilities(next_token: Callable[[tuple[int, ...]], np.ndarray],
                           horizon: int) -> dict[tuple[int, ...], float]:
    """Every token sequence of `horizon` tokens with its probability > 0:
    next_token(prefix) -> probabilities [V] of the token after `prefix`."""
    laws: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(horizon):
        longer = {}
        for prefix, p in laws.items():
            q = np.asarray(next_token(prefix), dtype=np.float64)
            for t in np.flatnonzero(q > 0):
                longer[prefix + (int(t),)] = p * float(q[t])
        laws = longer
    return laws


def pooled_cells(expected: np.ndarray) -> list[np.ndarray]:
    """expected counts [K] -> the chi-square cells, each an array of outcome indices."""
    order = np.argsort(expected)
    small = order[expected[order] < MIN_EXPECTED]
    cells = [np.array([i]) for i in order[expected[order] >= MIN_EXPECTED]]
    if small.size:
        if expected[small].sum() >= MIN_EXPECTED or not cells:
            cells.append(small)
        else:
            cells[0] = np.concatenate([cells[0], small])
    return cells


def tv_bound(probabilities: np.ndarray, n: int, delta: float) -> float:
    """The TV distance that N runs of the exact law exceed with probability at most delta."""
    p = np.asarray(probabilities, dtype=np.float64)
    return 0.5 * float(np.sqrt(p * (1 - p) / n).sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


@dataclass(frozen=True)
class DistributionResult:
    """One distribution test of N runs against an exact law."""

    n: int
    cells: int
    chi2: float
    p_value: float
    tv: float
    tv_bound: float
    alpha: float
    delta: float
    impossible: int                  # runs that emitted an outcome of probability 0

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.p_value >= self.alpha and self.tv <= self.tv_bound

    def __str__(self) -> str:
        return (f"{self.n} runs, {self.cells} cells: chi-square {self.chi2:.1f} (p = {self.p_value:.2e}, "
                f"alpha {self.alpha:g}); TV {self.tv:.4f} (bound {self.tv_bound:.4f}, delta {self.delta:g}); "
                f"{self.impossible} impossible")


def distribution_test(counts: Mapping[Hashable, int], probabilities: Mapping[Hashable, float],
                      alpha: float = 1e-4, delta: float = 1e-4) -> DistributionResult:
    """Observed counts per outcome against the exact probabilities (module docstring)."""
    outcomes = list(probabilities)
    p = np.array([probabilities[o] for o in outcomes], dtype=np.float64)
    observed = np.array([counts.get(o, 0) for o in outcomes], dtype=np.float64)
    impossible = int(sum(c for o, c in counts.items() if o not in probabilities or probabilities[o] == 0))
    n = int(observed.sum()) + impossible
    expected = n * p
    cells = pooled_cells(expected)
    o = np.array([observed[c].sum() for c in cells])
    e = np.array([expected[c].sum() for c in cells])
    chi2 = float(((o - e) ** 2 / e).sum()) if impossible == 0 else math.inf
    p_value = float(stats.chi2.sf(chi2, len(cells) - 1)) if len(cells) > 1 else 1.0
    tv = 0.5 * (float(np.abs(observed / n - p).sum()) + impossible / n)
    return DistributionResult(n, len(cells), chi2, p_value, tv, tv_bound(p, n, delta), alpha, delta, impossible)


def chi_square_power(p: Sequence[float], q: Sequence[float], n: int, alpha: float = 1e-4) -> float:
    """The chance that the chi-square part detects runs of law q (outcomes aligned with p's) at n."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    cells = pooled_cells(n * p)
    pc = np.array([p[c].sum() for c in cells])
    qc = np.array([q[c].sum() for c in cells])
    dof = len(cells) - 1
    noncentrality = n * float(((qc - pc) ** 2 / pc).sum())
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, dof), dof, noncentrality))
