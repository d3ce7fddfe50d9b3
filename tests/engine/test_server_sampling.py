"""`kdtree validate --server --temperature T`: seeded runs of faithful fake servers pass the law test and
the log-prob check, each in the form its API reports (SGLang: of logits / T; vLLM: of the raw logits); a
server that samples at the wrong temperature fails the law, one that reports another token's log-prob the
log-probs. The tested prefixes are chosen from the fixture alone."""

from __future__ import annotations

import numpy as np
import pytest

import kdtr_format
from engine.validate.judging.prefixes import KnownPrefixes
from engine.validate.judging.regime import CasesView, Regime
from engine.validate.reports.report import Status
from engine.validate.rows.served import ALPHA, MIN_REACH, sampling_family
from engine.validate.run.server import ServerRun, validate_server
from fake_servers import Engine, FakeServer

pytest.importorskip("scipy", reason="the law test needs scipy (the test extra)")

PROMPTS = ("p0", "p1", "p2")
T, RUNS, HOT = 0.6, 60, 150


@pytest.fixture(scope="module")
def tiny(golden):
    return (golden / "tiny.kdtr")


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny)


def sampled(server: FakeServer, fixture, runs: int = RUNS, **options):
    run = ServerRun(server.url, server.api, concurrency=16, temperature=T, samples=runs, seed=7, **options)
    return {c.name: c for c in validate_server(run, fixture).checks}


@pytest.mark.slow
@pytest.mark.parametrize("api, ids, form", [("sglang", "token_ids", f"log-softmax(logits / {T:g})"),
                                            ("openai", "names", "log-softmax(logits)")])
def test_faithful_sampling_passes(engine, tiny, api, ids, form):
    with FakeServer(engine, api, ids=ids, batch=16) as server:
        rows = sampled(server, tiny, logprobs=0)
    for p in PROMPTS:
        law, lp = rows[f"sampling {p}"], rows[f"logprobs {p}"]
        assert law.status is Status.WITHIN and law.error <= law.tolerance, law.text()
        assert f"over {RUNS} runs" in law.detail
        assert lp.status is Status.WITHIN and form in lp.detail, lp.text()


@pytest.mark.slow
def test_a_sampler_at_the_wrong_temperature_fails_the_law(engine, tiny):
    """HOT runs: enough that the chi-square part sees temperature 1 for 0.6 at every prompt's first token
    (its power, from the fixture's logits, checked here first)."""
    from engine.validate.judging.distribution import chi_square_power

    with kdtr_format.open(tiny) as reader:
        regime = Regime.of(reader.metadata, "float32")
        cfg = kdtr_format.ModelConfig.from_dict(reader.metadata["config"])
        tests = sum(len(sampling_family(KnownPrefixes(CasesView(reader, regime), cfg, p), T, HOT)) for p in PROMPTS)
        for p in PROMPTS:
            z = np.asarray(reader[f"prompts/{p}/prefill_logits"])[-1]
            laws = [np.exp((z - z.max()) / t) / np.exp((z - z.max()) / t).sum() for t in (T, 1.0)]
            assert chi_square_power(*laws, HOT, alpha=ALPHA / tests) > 0.999, p
    with FakeServer(engine, "sglang", bug="hot_sampler", batch=16) as server:
        rows = sampled(server, tiny, runs=HOT)
    failed = [p for p in PROMPTS if rows[f"sampling {p}"].status is Status.FAIL]
    assert failed == list(PROMPTS), [rows[f"sampling {p}"].text() for p in PROMPTS]
    assert "the first token" in rows["sampling p0"].detail and "chi-square" in rows["sampling p0"].detail


def test_another_tokens_logprob_fails_at_temperature(engine, tiny):
    with FakeServer(engine, "openai", bug="logprob_of_runner_up", ids="names", batch=16) as server:
        rows = sampled(server, tiny, runs=int(MIN_REACH), logprobs=0)
    assert all(rows[f"logprobs {p}"].status is Status.FAIL for p in PROMPTS)
    assert all(rows[f"sampling {p}"].status is Status.WITHIN for p in PROMPTS)   # the tokens themselves are right


def test_the_tested_prefixes_are_those_the_reference_law_reaches(tiny):
    """Chosen before any run, from the fixture alone: exactly the known prefixes that RUNS runs of the
    reference law reach MIN_REACH times in expectation (the root always); fewer runs than MIN_REACH, none."""
    with kdtr_format.open(tiny) as reader:
        regime = Regime.of(reader.metadata, "float32")
        cfg = kdtr_format.ModelConfig.from_dict(reader.metadata["config"])
        known = KnownPrefixes(CasesView(reader, regime), cfg, "p0")

        def reach(prefix: tuple[int, ...]) -> float:
            probability = 1.0
            for j, token in enumerate(prefix):
                weights = np.exp((known.logits(prefix[:j]) - known.logits(prefix[:j]).max()) / T)
                probability *= weights[token] / weights.sum()
            return probability

        family = sampling_family(known, T, RUNS)
        assert family[0] == () and len(family) > 1
        assert set(family) == {p for p in known.prefixes() if RUNS * reach(p) >= MIN_REACH}
        assert sampling_family(known, T, int(MIN_REACH) - 1) == []
