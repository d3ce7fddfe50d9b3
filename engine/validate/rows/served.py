"""Judging what a server served against a model fixture's references: token sequences, log-probs,
and the law of sampled tokens. Each judge returns one `Check` row of a prompt.

- `tokens_row` (temperature 0): every request of the prompt against its AR tokens. A differing
  token is a near-tie only when its own reference logit is within the regime's threshold of the
  best one there (bf16: within the threshold and FLIP_LOGIT_SCALES logit scales where a possible
  routing flip reaches the row), else a FAIL; where the fixture holds no logits at that prefix
  (the AR path beyond the traces), the decision's margin stands in for it. Judging goes on along
  the fixture's known prefixes (judging/prefixes.py) and stops where the served tokens leave them
  (those positions are counted, not judged). Every differing position is listed with its margin
  and how far below the best the served token is. A reply of another length than max_new_tokens
  is a FAIL, its tokens judged as far as they go; a request that errored is a FAIL naming its error.
- `logprobs_row`: each served log-prob (the served token's, and the top-k's) at a known prefix
  against the reference's log-softmax of the logits there (at temperature T > 0, of logits / T
  too: vLLM reports the raw model's log-probs, SGLang those it sampled from; the row names the
  form that fits). Tolerance: twice the regime's logits rule at the row's largest |logit|
  (|d log_softmax(z)_x| <= |dz_x| + max_i |dz_i|), divided by T for the tempered form. An
  entry naming another token than the one served is a FAIL. With top-k asked, the served top-k
  must be the reference's k most likely tokens as a set (the served token's entry may come
  beside them, as vLLM adds it): a token of the reference's top k missing, or a token outside it
  served, is a FAIL unless its logit is within twice the logits rule of the k-th boundary (a
  near-tie there may swap); fewer or more entries, or fewer rows than tokens, a FAIL.
- `sampling_row` (temperature T > 0): the served tokens of N seeded runs against the reference
  law softmax(logits / T) at known prefixes. Which prefixes, chosen before any run from the
  fixture alone (`sampling_family`): those the reference law reaches in expectation at least
  MIN_REACH times in N runs. At each, conditional on the runs that reach it, the next tokens
  are a multinomial sample of the reference law whatever happened before, so the distribution
  test (judging/distribution.py: chi-square and total variation) applies; run at alpha / m and delta / m
  for the m prefixes of the run, all of them together raise a false alarm with probability at
  most ALPHA + DELTA. It cannot see the law after prefixes the fixture holds no logits for, nor
  the correlation between positions beyond the conditional laws it tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..judging.compare import SEVERITY
from ..judging.prefixes import KnownPrefixes, Prefix
from ..judging.regime import Regime
from ..reports.report import Check, Status

MIN_REACH = 25.0             # expected runs reaching a prefix before its law is tested
FLIP_LOGIT_SCALES = 2.0      # logit scales a near-tie routing flip may move the gap between two logits
                             # (1.98 the largest in tiny's bf16 cases: tests/engine/test_server_hostile.py)
ALPHA = DELTA = 5e-5         # the false-alarm budget of one sampling row, split over its prefixes


@dataclass(frozen=True)
class Served:
    """One request's outcome: the reply's tokens, log-prob entries and top-k (None when not asked),
    or the one-line error that replaced the reply."""

    tokens: list[int]
    logprobs: list[tuple[int | None, float]] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    error: str = ""


@dataclass(frozen=True)
class Divergence:
    """A served token that is not the reference's: margin, the decision's top1 - top2 gap; below,
    how far the served token's own reference logit is below the best (None where the fixture holds
    no logits at that prefix); allowed, the most a near-tie may be below (the regime's threshold,
    widened at a row a routing flip reaches)."""

    position: int
    served: int
    expected: int
    margin: float
    below: float | None
    allowed: float
    status: Status

    def text(self, threshold: float) -> str:
        kind = "near-tie" if self.status is Status.NEAR_TIE else "FAIL"
        routing = ", reached by a routing flip" if self.allowed > threshold else ""
        own = "the fixture holds no logits to place it" if self.below is None else \
            f"{self.below:.3g} below the best, {'within' if self.below < self.allowed else 'beyond'} {self.allowed:.3g}"
        return (f"at {self.position}: served {self.served}, expected {self.expected} (margin {self.margin:.3g} "
                f"vs {threshold:.3g}; served token {own}{routing}: {kind})")


def _worst(statuses: Sequence[Status]) -> Status:
    return max(statuses, key=SEVERITY.get, default=Status.EXACT)


def _requests(k: int, of: int) -> str:
    return f"request {k + 1} of {of}: " if of > 1 else ""


# ---------------------------------------------------------------------------- tokens

@dataclass(frozen=True)
class TokenVerdict:
    status: Status
    divergences: tuple[Divergence, ...]
    unjudged: int               # positions after the served tokens left the known prefixes
    problem: str                # a wrong length, else ""
    error: str = ""             # the request's error, which replaced its reply


def flip_allowance(regime: Regime) -> float:
    """How far below the best a served token may be at a row a routing flip reaches (bf16): the
    regime's threshold and FLIP_LOGIT_SCALES logit scales; 0 where nothing is reached (float32)."""
    if regime.routing_threshold is None:
        return 0.0
    return FLIP_LOGIT_SCALES * float(regime.metadata["logit_scale"])


def judge_tokens(served: Served, known: KnownPrefixes, regime: Regime, vocab: int) -> TokenVerdict:
    """One greedy reply against the prompt's AR tokens and known prefixes (module docstring)."""
    if served.error:
        return TokenVerdict(Status.FAIL, (), 0, "", served.error)
    threshold, flip = regime.margin_threshold, flip_allowance(regime)
    expected, tokens = known.ar_tokens, served.tokens
    n = len(expected)
    problem = "" if len(tokens) == n else \
        f"served {len(tokens)} tokens for max_new_tokens {n}" + (", the last missing" if len(tokens) == n - 1 else "")
    divergences: list[Divergence] = []
    unjudged = 0
    for k, token in enumerate(tokens[:n]):
        prefix = tuple(tokens[:k])
        logits = known.logits(prefix)
        if not divergences:                       # on the AR path
            want, margin, reached = int(expected[k]), float(known.ar_margins[k]), bool(known.ar_reached[k])
        else:
            if logits is None:
                unjudged = min(len(tokens), n) - k
                break
            top = np.argsort(logits)[::-1][:2]
            want, margin, reached = int(top[0]), float(logits[top[0]] - logits[top[1]]), known.reached(prefix)
        allowed = threshold + (flip if reached else 0.0)
        if token >= vocab:
            problem = problem or f"at {k}: served token {token}, outside the vocabulary of {vocab}"
            divergences.append(Divergence(k, token, want, margin, None, allowed, Status.FAIL))
            break
        if token != want:
            below = None if logits is None else float(logits[want] - logits[token])
            near = (margin if below is None else below) < allowed
            divergences.append(Divergence(k, token, want, margin, below, allowed,
                                          Status.NEAR_TIE if near else Status.FAIL))
    statuses = [d.status for d in divergences] + ([Status.FAIL] if problem else [])
    return TokenVerdict(_worst(statuses), tuple(divergences), unjudged, problem)


def tokens_row(section: str, name: str, replies: Sequence[Served], known: KnownPrefixes, regime: Regime,
               vocab: int) -> Check:
    """The prompt's greedy row over its requests (copies sent together under --concurrency). A
    request that errored is named as such, apart from the replies that differ."""
    threshold = regime.margin_threshold
    verdicts = [judge_tokens(s, known, regime, vocab) for s in replies]
    status = _worst([v.status for v in verdicts])
    label = regime.label("tokens")
    errored = sum(bool(v.error) for v in verdicts)
    differ = sum(v.status is not Status.EXACT and not v.error for v in verdicts)
    if status is Status.EXACT:
        together = f"{len(replies)} requests, every one as the fixture's" if len(replies) > 1 else ""
        return Check(section, name, Status.EXACT, detail=together, regime=label)
    tally = "; ".join(f"{count} of {len(replies)} requests {what}" for count, what in
                      ((errored, "errored"), (differ, "differ")) if count) if len(replies) > 1 else ""
    k = next(i for i, v in enumerate(verdicts) if v.status is status)
    verdict = verdicts[k]
    if verdict.error:
        return Check(section, name, status, detail=_requests(k, len(replies)) + verdict.error
                     + (f"; {tally}" if tally else ""))
    parts = [verdict.problem] if verdict.problem else []
    parts += [d.text(threshold) for d in verdict.divergences]
    if verdict.unjudged:
        parts.append(f"the last {verdict.unjudged} position(s) leave the fixture's known prefixes: not judged")
    telling = next((d for d in verdict.divergences if d.status is status), None)
    return Check(section, name, status, margin=None if telling is None else telling.margin,
                 tolerance=None if telling is None else threshold,
                 detail=_requests(k, len(replies)) + "; ".join(parts) + (f"; {tally}" if tally else ""), regime=label)


# ---------------------------------------------------------------------------- log-probs

@dataclass(frozen=True)
class _Entry:
    """One served log-prob against the reference's, in both forms (raw, tempered)."""

    where: str
    error: tuple[float, float]
    tolerance: tuple[float, float]
    reached: bool


def logprobs_row(section: str, name: str, replies: Sequence[Served], known: KnownPrefixes, regime: Regime,
                 temperature: float, top: int = 0) -> Check:
    """The prompt's log-prob row over its requests, `top` the k of the top-k asked (module docstring)."""
    rule = regime.tolerances["logits"]
    label = f"{regime.short}: 2 x (atol {rule['atol']:.2g} + rtol {rule['rtol']:.2g}|x|)"
    entries: list[_Entry] = []
    sets: list[tuple[str, bool]] = []            # positions whose top-k is not the reference's: (what, reached)
    served_positions = 0
    for k, served in enumerate(replies):
        at = _requests(k, len(replies))
        if served.error:
            return Check(section, name, Status.FAIL, detail=at + served.error)
        if served.logprobs is None or len(served.logprobs) != len(served.tokens):
            count = "none" if served.logprobs is None else len(served.logprobs)
            return Check(section, name, Status.FAIL, regime=label,
                         detail=f"{at}{count} log-prob entries for {len(served.tokens)} served tokens")
        if top and (served.top_logprobs is None or len(served.top_logprobs) != len(served.tokens)):
            count = "no" if served.top_logprobs is None else len(served.top_logprobs)
            return Check(section, name, Status.FAIL, regime=label,
                         detail=f"{at}{count} top-logprob rows for {len(served.tokens)} served tokens (top {top} asked)")
        served_positions += len(served.tokens)
        for j, (token, (named, value)) in enumerate(zip(served.tokens, served.logprobs)):
            prefix = tuple(served.tokens[:j])
            logits = known.logits(prefix)
            if logits is None:
                continue
            if named != token:
                return Check(section, name, Status.FAIL, regime=label,
                             detail=f"{at}at {j} the log-prob entry names token {named}, the served token is {token}")
            given = served.top_logprobs[j] if top else {}
            entries += _compare(logits, [(token, value)] + sorted(given.items()), temperature, rule, f"{at}at {j}",
                                known.reached(prefix))
            if top:
                problem = _top_set(logits, given, token, top, 2 * _scale(rule, logits))
                if problem:
                    sets.append((f"{at}at {j}: {problem}", known.reached(prefix)))
    if not entries:
        return Check(section, name, Status.SKIPPED, regime=label,
                     detail=f"none of the {served_positions} served positions has known logits in the fixture")
    values = _values(entries, temperature, served_positions)
    if not sets:
        return dataclasses.replace(values, section=section, name=name, regime=label)
    status = Status.NEAR_TIE if all(reached for _, reached in sets) else Status.FAIL
    first = next(what for what, reached in sets if not reached or status is Status.NEAR_TIE)
    routing = ", every one reached by a routing flip" if status is Status.NEAR_TIE else ""
    return Check(section, name, _worst([status, values.status]), values.error, values.tolerance, regime=label,
                 detail=f"{len(sets)} position(s) whose top {top} is not the reference's{routing}: {first}; "
                        f"{values.detail}")


def _values(entries: list[_Entry], temperature: float, served_positions: int) -> Check:
    """The row of the served values (section and name left empty)."""
    form = _form(entries, temperature)
    ratio = [e.error[form] / e.tolerance[form] for e in entries]
    entry = entries[int(np.argmax(ratio))]
    beyond = [e for e, r in zip(entries, ratio) if r > 1]
    which = "log-softmax(logits)" if form == 0 else f"log-softmax(logits / {temperature:g})"
    summary = f"{len(entries)} log-probs at known prefixes ({served_positions} served positions), as {which}"
    if not beyond:
        status = Status.EXACT if entry.error[form] == 0 else Status.WITHIN
        return Check("", "", status, entry.error[form], entry.tolerance[form], detail=summary)
    status = Status.NEAR_TIE if all(e.reached for e in beyond) else Status.FAIL
    other = ""
    if temperature > 0 and temperature != 1:
        alt = max(e.error[1 - form] / e.tolerance[1 - form] for e in entries)
        other = f"; as {'log-softmax(logits / T)' if form == 0 else 'log-softmax(logits)'} up to {alt:.3g} x tolerance"
    routing = ", every one reached by a routing flip" if status is Status.NEAR_TIE else ""
    return Check("", "", status, entry.error[form], entry.tolerance[form],
                 detail=f"{len(beyond)} of {summary} beyond tolerance{routing}{other}; the worst {entry.where}")


def _scale(rule: dict, logits: np.ndarray) -> float:
    """The logits rule at the row's largest |logit|: how far one served logit may be off."""
    return rule["atol"] + rule["rtol"] * float(np.abs(logits).max())


def _top_set(logits: np.ndarray, given: dict[int, float], token: int, k: int, tolerance: float) -> str:
    """What differs between the served top-k tokens (`given`: k entries, or k + 1 whose least likely is
    the served `token`'s) and the reference's k most likely, "" when nothing does. A swap across the
    k-th boundary is allowed where the two logits are within `tolerance` (each may be off by half of it)."""
    k = min(k, len(logits))
    ranked = sorted(given, key=lambda t: given[t], reverse=True)      # the served top k, then the served token's
    if len(given) < k or len(given) > k + 1 or (len(given) == k + 1 and ranked[k] != token):
        return f"{len(given)} top-logprob entries for the top {k}"
    named = set(ranked[:k])
    outside = sorted(t for t in named if not 0 <= t < len(logits))
    if outside:
        return f"the top {k} names token {outside[0]}, outside the vocabulary of {len(logits)}"
    order = np.argsort(logits)[::-1]
    kth, beyond = float(logits[order[k - 1]]), float(logits[order[k]]) if k < len(logits) else -math.inf
    missing = [int(t) for t in order[:k] if int(t) not in named and logits[t] - beyond > tolerance]
    if missing:
        t = missing[0]
        return (f"the top {k} misses token {t}, {logits[t] - beyond:.3g} above the reference's {_nth(k + 1)} "
                f"(beyond {tolerance:.3g}; {len(missing)} missing)")
    intruders = sorted((t for t in named if kth - logits[t] > tolerance), key=lambda t: logits[t])
    if intruders:
        t = intruders[0]
        return (f"the top {k} holds token {t}, {kth - logits[t]:.3g} below the reference's {_nth(k)} "
                f"(beyond {tolerance:.3g})")
    return ""


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _compare(logits: np.ndarray, pairs: list[tuple[int, float]], temperature: float, rule: dict,
             where: str, reached: bool) -> list[_Entry]:
    scale = _scale(rule, logits)
    forms = [_log_softmax(logits), _log_softmax(logits / temperature) if temperature > 0 else _log_softmax(logits)]
    tolerance = (2 * scale, 2 * scale / (temperature if temperature > 0 else 1.0))
    out = []
    for token, value in pairs:
        if not 0 <= token < len(logits) or not math.isfinite(value):
            out.append(_Entry(f"{where}: token {token} log-prob {value}", (math.inf, math.inf), tolerance, reached))
            continue
        out.append(_Entry(f"{where}, token {token}: served {value:.6g}, reference {forms[0][token]:.6g}"
                          + (f" (tempered {forms[1][token]:.6g})" if temperature not in (0, 1) else ""),
                          (abs(value - forms[0][token]), abs(value - forms[1][token])), tolerance, reached))
    return out


def _form(entries: list[_Entry], temperature: float) -> int:
    """0: the raw log-softmax fits best; 1: the tempered one (temperature > 0, != 1)."""
    if temperature in (0, 1):
        return 0
    worst = [max(e.error[f] / e.tolerance[f] for e in entries) for f in (0, 1)]
    return int(worst[1] < worst[0])


def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


# ---------------------------------------------------------------------------- the law of sampled tokens

def sampling_family(known: KnownPrefixes, temperature: float, runs: int) -> list[Prefix]:
    """The prefixes whose law a sampled run of `runs` tests (module docstring), in depth-first order."""
    family, stack = [], [((), 1.0)]
    while stack:
        prefix, reach = stack.pop()
        if runs * reach < MIN_REACH:
            continue
        family.append(prefix)
        law = _softmax(known.logits(prefix), temperature)
        stack += [(prefix + (t,), reach * float(law[t])) for t in sorted(known.children(prefix), reverse=True)
                  if prefix + (t,) in known]
    return family


def sampling_row(section: str, name: str, replies: Sequence[Served], known: KnownPrefixes, family: list[Prefix],
                 tests: int, temperature: float, asked: int) -> Check:
    """The prompt's sampled runs against the reference law at each prefix of its `family`, each test at
    ALPHA / tests and DELTA / tests (`tests`: the family sizes of every prompt of the run)."""
    label = f"law of softmax(logits / {temperature:g}): false alarms <= {ALPHA + DELTA:.2g} a row"
    errors = [s.error for s in replies if s.error]
    if errors:
        return Check(section, name, Status.FAIL, regime=label, detail=f"{len(errors)} of {len(replies)} runs failed: "
                                                                      f"{errors[0]}")
    short = [(k, s) for k, s in enumerate(replies) if len(s.tokens) != asked]
    if short:
        k, s = short[0]
        return Check(section, name, Status.FAIL, regime=label,
                     detail=f"run {k + 1}: served {len(s.tokens)} tokens for max_new_tokens {asked} "
                            f"({len(short)} of {len(replies)} runs)")
    try:
        from ..judging.distribution import distribution_test
    except ImportError:
        return Check(section, name, Status.SKIPPED, regime=label,
                     detail="the distribution test needs scipy (pip install 'kdtree[test]')")
    results = []
    for prefix in family:
        nexts = [s.tokens[len(prefix)] for s in replies if tuple(s.tokens[:len(prefix)]) == prefix]
        if not nexts:
            continue
        law = _softmax(known.logits(prefix), temperature)
        counts: dict[int, int] = {}
        for token in nexts:
            counts[token] = counts.get(token, 0) + 1
        result = distribution_test(counts, dict(enumerate(law.tolist())), ALPHA / tests, DELTA / tests)
        results.append((prefix, result, counts, law))
    if not results:
        return Check(section, name, Status.SKIPPED, regime=label, detail="no run reached a tested prefix")
    failed = [r for r in results if not r[1].passed]
    prefix, result, counts, law = min(failed or results, key=lambda r: (r[1].passed, r[1].p_value))
    top = max(counts, key=counts.get)
    where = (f"after {list(prefix)}" if prefix else "the first token") + \
        f": {result}; most served {top} ({counts[top]} of {result.n}, reference p {law[top]:.3g})"
    summary = f"{len(results)} prefixes tested over {len(replies)} runs"
    error, bound = _numbers(result)
    if failed:
        return Check(section, name, Status.FAIL, error, bound, regime=label, detail=f"{len(failed)} of {summary} fail; "
                                                                                   f"the worst {where}")
    return Check(section, name, Status.WITHIN, error, bound, regime=label, detail=f"{summary}; the least likely {where}")


def _numbers(result) -> tuple[float, float]:
    """A test's measure against its bound: total variation when it fails that part, else chi-square
    against its critical value at the test's alpha."""
    if result.tv > result.tv_bound:
        return result.tv, result.tv_bound
    from scipy import stats

    critical = float(stats.chi2.isf(result.alpha, result.cells - 1)) if result.cells > 1 else math.inf
    return result.chi2, critical


def _softmax(z: np.ndarray, temperature: float) -> np.ndarray:
    return np.exp(_log_softmax(np.asarray(z, dtype=np.float64) / temperature))
