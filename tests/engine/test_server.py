"""`kdtree validate --server` at temperature 0 against in-process fake servers (tests/fake_servers.py):
the faithful ones (each API, each way of returning ids, speculative decoding on, batched, bf16) pass;
each broken one fails with a row naming what differs; a server that fails at the HTTP level is a
one-line FAIL. The judging itself: a divergence at a near-tie against one beyond it, the margin of
every differing position shown, and judging that goes on along the fixture's known prefixes."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import kdtr_format
from engine.validate.judging.prefixes import KnownPrefixes
from engine.validate.judging.regime import CasesView, Regime
from engine.validate.reports.report import Status
from engine.validate.rows.served import Served, tokens_row
from engine.validate.run.server import ServerRun, validate_server
from fake_servers import Engine, FakeServer

PROMPTS = ("p0", "p1", "p2")


@pytest.fixture(scope="module")
def exports(golden, tmp_path_factory):
    """tiny exported as float32 and as bfloat16 (refgen export)."""
    from refgen.export import export

    path = (golden / "tiny.kdtr")
    with kdtr_format.open(path) as reader:
        return {dtype: export(reader, path, tmp_path_factory.mktemp("export") / f"tiny-{dtype}", dtype).directory
                for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def engines(golden):
    made = {}

    def get(dtype: str = "float32") -> Engine:
        if dtype not in made:
            made[dtype] = Engine((golden / "tiny.kdtr"), dtype)
        return made[dtype]
    return get


def run(server: FakeServer, fixtures, **options):
    return validate_server(ServerRun(server.url, server.api, **options), fixtures)


def rows(report) -> dict[str, object]:
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("api, ids, logprobs", [("sglang", "token_ids", None), ("openai", "token_ids", None),
                                                ("openai", "names", 2), ("openai", "text", 0)])
def test_faithful_servers_pass(engines, exports, api, ids, logprobs):
    """Every way a reply carries its ids (SGLang's output_ids, vLLM's token_ids or token_id:<id> log-prob
    names, the exported tokenizer's words) gives the fixture's AR tokens; three requests in one batch."""
    with FakeServer(engines(), api, ids=ids, batch=3) as server:
        report = run(server, exports["float32"], concurrency=3, logprobs=logprobs)
    found = rows(report)
    assert not report.failed, report.summary()
    assert found["server"].status is Status.EXACT
    for p in PROMPTS:
        assert found[f"tokens {p}"].status is Status.EXACT
        if logprobs is not None:
            lp = found[f"logprobs {p}"]
            assert lp.status is Status.WITHIN and lp.error <= lp.tolerance and "log-softmax(logits)" in lp.detail
    assert len(found) == 1 + len(PROMPTS) * (1 if logprobs is None else 2)


def test_speculative_server_passes_with_copies_batched(engines, exports):
    """DDTree with a LayerSkip drafter behind the API, six requests (two copies of each prompt) in one batch."""
    with FakeServer(engines(), "sglang", batch=6, speculative=True) as server:
        report = run(server, exports["float32"], concurrency=6)
    assert not report.failed, report.summary()
    assert all(rows(report)[f"tokens {p}"].detail == "2 requests, every one as the fixture's" for p in PROMPTS)


def test_bf16_export_is_judged_in_bf16(engines, exports):
    """A bf16 engine on the bf16 export: the regime comes from the export; near-ties are no failures."""
    with FakeServer(engines("bfloat16"), "openai") as server:
        report = run(server, exports["bfloat16"])
    assert not report.failed, [c.text() for c in report.checks]
    assert all(rows(report)[f"tokens {p}"].regime.startswith("bf16: near-tie below margin") for p in PROMPTS)
    assert report.fixtures.endswith("tiny.kdtr")


@pytest.mark.parametrize("bug, api, options, row, says", [
    ("accept_off_by_one", "sglang", {}, "tokens p0", "served"),
    ("drop_last", "openai", {}, "tokens p0", "served 15 tokens for max_new_tokens 16, the last missing"),
    ("logprob_of_runner_up", "sglang", {"logprobs": 0}, "logprobs p0", "beyond tolerance"),
])
def test_broken_servers_fail_naming_what_differs(engines, exports, bug, api, options, row, says):
    with FakeServer(engines(), api, bug=bug) as server:
        report = run(server, exports["float32"], **options)
    check = rows(report)[row]
    assert report.failed and check.status is Status.FAIL, check.text()
    assert says in check.detail
    if bug == "accept_off_by_one":          # the first divergence is one the fixture's margin rules out
        assert check.margin >= check.tolerance and "expected" in check.detail and "FAIL" in check.detail


def test_leaky_batch_fails_only_when_requests_arrive_together(engines, exports):
    """One request at a time it is right; three in one batch, the two after the batch's first are wrong."""
    with FakeServer(engines(), "openai", bug="leaky_batch") as server:
        alone = run(server, exports["float32"])
    with FakeServer(engines(), "openai", bug="leaky_batch", batch=3) as server:
        together = run(server, exports["float32"], concurrency=3)
    assert not alone.failed, alone.summary()
    statuses = sorted(rows(together)[f"tokens {p}"].status.value for p in PROMPTS)
    assert statuses == ["FAIL", "FAIL", "exact"]
    assert all("served" in c.detail and "expected" in c.detail for c in together.checks if c.status is Status.FAIL)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bug, api, options, says", [
    ("http_500", "sglang", {}, "POST /generate: HTTP 500 Internal Server Error: CUDA error: an illegal memory access"),
    ("not_json", "openai", {}, "POST /v1/completions: the reply is not JSON (<html>"),
    ("no_ids", "sglang", {}, "POST /generate: malformed reply: output_ids: expected a list, got null"),
    ("no_ids", "openai", {}, "the text's word 'hello' is not in the exported tokenizer's vocabulary"),
    ("hang", "sglang", {"timeout": 0.3}, "POST /generate: no whole reply within 0.3 s (--timeout"),
])
def test_http_failures_are_one_line_fails(engines, exports, bug, api, options, says):
    with FakeServer(engines(), api, bug=bug) as server:
        report = run(server, exports["float32"], **options)
    failing = [c for c in report.checks if c.status is Status.FAIL]
    assert [c.name for c in failing] == [f"tokens {p}" for p in PROMPTS]
    assert all(says in c.detail and "\n" not in c.detail for c in failing), failing[0].detail


def test_no_server_is_one_fail_row(exports):
    report = validate_server(ServerRun(f"http://127.0.0.1:{_closed_port()}", "sglang"), exports["float32"])
    assert [c.text().split("  ")[:2] for c in report.checks] == [["FAIL", "tiny.kdtr::server"]]
    assert "connection refused" in report.checks[0].detail


def test_a_fixture_file_without_the_tokenizer_needs_ids_in_the_reply(engines, golden):
    """Validated against the fixture file itself, text alone cannot stand for ids."""
    with FakeServer(engines(), "openai", ids="text") as server:
        report = run(server, (golden / "tiny.kdtr"))
    assert "carries no token ids" in rows(report)["tokens p0"].detail


# ---------------------------------------------------------------------------- the judge

@pytest.fixture(scope="module")
def cases(golden):
    """dtype -> (regime, prompt -> KnownPrefixes) of tiny."""
    with kdtr_format.open((golden / "tiny.kdtr")) as reader:
        cfg = kdtr_format.ModelConfig.from_dict(reader.metadata["config"])
        out = {}
        for dtype in ("float32", "bfloat16"):
            regime = Regime.of(reader.metadata, dtype)
            out[dtype] = regime, {p: KnownPrefixes(CasesView(reader, regime), cfg, p) for p in PROMPTS}
        yield out


def _runner_up(known: KnownPrefixes, k: int) -> int:
    ar = known.ar_tokens.tolist()
    return int(np.argsort(known.logits(tuple(ar[:k])))[-2])


def test_divergences_are_judged_by_the_margin_each_shown(cases):
    """float32: every AR margin is above the threshold, so the runner-up anywhere is a FAIL. bf16: at a
    decision below the bf16 threshold a near-tie; above it a near-tie only where a possible routing flip
    reaches the row (every AR decision of tiny's bf16 cases), else a FAIL. Each shows its margin."""
    for dtype, k_at, expect in (("float32", lambda m, t: m >= t, Status.FAIL),
                                ("bfloat16", lambda m, t: m < t, Status.NEAR_TIE),
                                ("bfloat16", lambda m, t: m >= t, Status.NEAR_TIE)):
        regime, known = cases[dtype]
        threshold = regime.margin_threshold
        p, k = next((p, k) for p in PROMPTS for k in range(len(known[p].ar_tokens))
                    if k_at(known[p].ar_margins[k], threshold) and tuple(known[p].ar_tokens[:k]) in known[p])
        ar, other = known[p].ar_tokens.tolist(), _runner_up(known[p], k)
        check = tokens_row("s", "tokens", [Served(ar[:k] + [other] + ar[k + 1:])], known[p], regime, 1024)
        assert check.status is expect, check.text()
        assert f"at {k}: served {other}, expected {ar[k]} (margin {known[p].ar_margins[k]:.3g} vs " \
               f"{threshold:.3g}" in check.detail
        assert ("reached by a routing flip" in check.detail) == bool(known[p].ar_reached[k])
    regime, known = cases["bfloat16"]
    p, k = next((p, k) for p in PROMPTS for k in range(len(known[p].ar_tokens))
                if known[p].ar_margins[k] >= regime.margin_threshold)
    known[p].ar_reached[k] = False                         # out of every routing near-tie's reach: a FAIL
    try:
        ar = known[p].ar_tokens.tolist()
        check = tokens_row("s", "tokens", [Served(ar[:k] + [(ar[k] + 1) % 1024] + ar[k + 1:])], known[p], regime,
                           1024)
    finally:
        known[p].ar_reached[k] = True
    assert check.status is Status.FAIL and check.margin == known[p].ar_margins[k]


def test_judging_goes_on_along_known_prefixes(cases):
    """Served tokens that leave the AR path for a sibling the fixture's trees hold are judged from the
    sibling's logits on: following them adds nothing to the row, a wrong token there is listed too (a
    tree node's margin is above the threshold: a FAIL); past the known prefixes nothing is judged."""
    regime, known = cases["float32"]
    p, k, sibling = next((p, k, s) for p in PROMPTS for k in range(len(known[p].ar_tokens))
                         for s in sorted(known[p].children(tuple(known[p].ar_tokens[:k].tolist())))
                         if s != known[p].ar_tokens[k]
                         and tuple(known[p].ar_tokens[:k].tolist()) + (s,) in known[p])
    prefix = tuple(known[p].ar_tokens[:k].tolist()) + (sibling,)
    logits = known[p].logits(prefix)
    follow, wrong = int(np.argmax(logits)), int(np.argmin(logits))
    tail = [0] * (len(known[p].ar_tokens) - k - 2)
    followed = tokens_row("s", "tokens", [Served(list(prefix) + [follow] + tail)], known[p], regime, 1024)
    assert followed.status is Status.FAIL and f"at {k}: served {sibling}" in followed.detail
    assert f"at {k + 1}:" not in followed.detail
    strayed = tokens_row("s", "tokens", [Served(list(prefix) + [wrong] + tail)], known[p], regime, 1024)
    assert f"at {k + 1}: served {wrong}, expected {follow}" in strayed.detail
    if tail:
        assert "leave the fixture's known prefixes: not judged" in strayed.detail
