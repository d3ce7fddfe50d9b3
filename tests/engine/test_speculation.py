"""engine/serving/speculation.py: a server's speculative-decoding counters read from its /metrics
page and differenced over a run; every malformed page or counter one ServerError line."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.serving import ServerError
from engine.serving.speculation import Speculation, parse_counters, read_counters

# vLLM 0.32.0's own page (abridged), after 36 drafts of 3 tokens, as a draft-model server published it.
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 36.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m"} 1.796579341320133e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 108.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 10.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="2"} 0.0
"""


def test_vllm_page_read_as_published():
    assert parse_counters(VLLM_PAGE) == Speculation("vLLM", 36, 108, 10, (9, 1, 0))


def test_counters_grouped_under_their_bare_names():
    """OpenMetrics' grouping (TYPE x counter, samples x_total and x_created) reads the same."""
    page = (VLLM_PAGE.replace("_total counter", " counter").replace("# TYPE vllm:spec_decode_num_drafts_created gauge\n", "")
            .replace("# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.\n", ""))
    assert "# TYPE vllm:spec_decode_num_drafts counter" in page
    assert parse_counters(page) == Speculation("vLLM", 36, 108, 10, (9, 1, 0))


def test_counters_of_every_engine_are_summed():
    lines = [[line, line.replace('engine="0"', 'engine="1"')] if line.startswith("vllm:spec") else [line]
             for line in VLLM_PAGE.splitlines()]                # each family's samples together, as published
    page = "\n".join(line for group in lines for line in group) + "\n"
    assert parse_counters(page) == Speculation("vLLM", 72, 216, 20, (18, 2, 0))


def test_difference_over_a_run():
    before = Speculation("vLLM", 36, 108, 10, (9, 1, 0))
    after = Speculation("vLLM", 50, 150, 21, (15, 5, 1))
    assert after.since(before) == Speculation("vLLM", 14, 42, 11, (6, 4, 1))
    assert after.since(None) == after
    assert after.since(before).line() == "14 drafts, 42 draft tokens, 11 accepted (by position 6, 4, 1)"


def test_llama_cpp_publishes_vllms_counters_under_its_prefix():
    """llama-server --metrics, as it writes them (no labels but the position)."""
    page = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 41\n"
            "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\nllamacpp:spec_decode_num_draft_tokens_total 90\n"
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter\n"
            "llamacpp:spec_decode_num_accepted_tokens_total 31\n"
            "# TYPE llamacpp:spec_decode_num_drafts_total counter\nllamacpp:spec_decode_num_drafts_total 30\n"
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n"
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 20\n'
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 11\n')
    assert parse_counters(page) == Speculation("llama.cpp", 30, 90, 31, (20, 11))


def test_sglang_publishes_drafts_only():
    page = ("# TYPE sglang:spec_verify_calls_total counter\n"
            'sglang:spec_verify_calls_total{model_name="m"} 40.0\n'
            "# TYPE sglang:spec_accept_length gauge\n"
            'sglang:spec_accept_length{model_name="m"} 2.5\n')
    counts = parse_counters(page)
    assert counts == Speculation("SGLang", 40)
    assert counts.line() == "40 drafts, accepted tokens not published"


def test_no_speculation_counters_is_none():
    assert parse_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None
    assert parse_counters("") is None


@pytest.mark.parametrize("page, message", [
    ("vllm:spec_decode_num_drafts_total{engine=\"0\" 3.0\n", "not Prometheus' text format"),
    (VLLM_PAGE.replace("108.0", "NaN"), "num_draft_tokens_total is nan, not a count"),
    (VLLM_PAGE.replace("} 10.0", "} 2.5"), "num_accepted_tokens_total is 2.5, not a count"),
    (VLLM_PAGE.replace("} 36.0", "} -1.0"), "num_drafts_total is -1.0, not a count"),
    ("\n".join(line for line in VLLM_PAGE.splitlines() if "draft_tokens" not in line),
     "without vllm:spec_decode_num_draft_tokens_total"),
    (VLLM_PAGE.replace('position="1"', 'position="first"'), "position label first"),
], ids=["unparsable", "nan", "fraction", "negative", "missing counter", "position label"])
def test_malformed_pages_are_one_line_errors(page, message):
    with pytest.raises(ServerError, match=message) as caught:
        parse_counters(page)
    assert "\n" not in str(caught.value)


def test_a_counter_that_went_down_is_an_error():
    with pytest.raises(ServerError, match="drafts went from 36 to 3 during the run"):
        Speculation("vLLM", 3, 9, 1, (1, 0, 0)).since(Speculation("vLLM", 36, 108, 10, (9, 1, 0)))
    with pytest.raises(ServerError, match="another server answers now"):
        Speculation("vLLM", 40).since(Speculation("SGLang", 36))


class _Pages(BaseHTTPRequestHandler):
    status, body = 200, VLLM_PAGE.encode()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body)


@pytest.fixture
def pages():
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Pages", (_Pages,), {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_read_over_http(pages):
    url = f"http://127.0.0.1:{pages.server_address[1]}"
    assert read_counters(url, 5) == Speculation("vLLM", 36, 108, 10, (9, 1, 0))
    pages.RequestHandlerClass.status = 404
    assert read_counters(url, 5) is None                      # no /metrics page: publishes nothing
    pages.RequestHandlerClass.status, pages.RequestHandlerClass.body = 500, b'{"detail": "engine dead"}'
    with pytest.raises(ServerError, match=r"^GET /metrics: HTTP 500 .*: engine dead$"):
        read_counters(url, 5)
    pages.RequestHandlerClass.status, pages.RequestHandlerClass.body = 200, b"\xff\xfe"
    with pytest.raises(ServerError, match="not UTF-8"):
        read_counters(url, 5)


def test_refused_connection_is_one_line():
    with pytest.raises(ServerError, match=r"^GET /metrics: connection refused"):
        read_counters("http://127.0.0.1:9", 5)
