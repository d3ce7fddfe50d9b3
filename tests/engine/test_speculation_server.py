"""`kdtree validate --server` with the server's speculation counters: the `speculation` row counts
what a fake server (tests/fake_servers.py, publishing /metrics as vLLM or SGLang does) drafted
and accepted over the run; --require-speculation fails a run that drafted or accepted nothing,
or whose server publishes no counters, whatever its tokens."""

from __future__ import annotations

import json
import re

import pytest

from cli_run import run_main
from engine.validate.reports.report import Status
from engine.validate.run.server import ServerRun, validate_server
from fake_servers import FakeServer
from terminal import in_terminal


def _run(server: FakeServer, fixtures, **options):
    report = validate_server(ServerRun(server.url, server.api, **options), fixtures)
    return report, {c.name: c for c in report.checks}


def test_a_speculating_server_is_counted(engine, export_dir):
    """DDTree rounds with a LayerSkip drafter: drafts and accepted tokens over the run, as vLLM counts them."""
    with FakeServer(engine, "openai", speculative=True, metrics="vllm") as server:
        report, rows = _run(server, export_dir, require_speculation=True)
        published = server.batcher.rounds
    assert not report.failed, [c.text() for c in report.checks]
    used = rows["speculation"].tables["speculation"]
    assert used["drafts"] == published.drafts > 0
    assert used["accepted"] == sum(published.accepted_per_position) > 0
    assert used["accepted_per_position"] == published.accepted_per_position
    assert rows["speculation"].status is Status.EXACT and "accepted" in rows["speculation"].detail


def test_counts_are_over_the_run_only(engine, export_dir):
    """A second run counts its own rounds, not the first run's too."""
    with FakeServer(engine, "openai", speculative=True, metrics="vllm") as server:
        _, first = _run(server, export_dir)
        _, second = _run(server, export_dir)
        total = server.batcher.rounds.drafts
    drafts = [r["speculation"].tables["speculation"]["drafts"] for r in (first, second)]
    assert drafts[0] > 0 and drafts[0] + drafts[1] == total and drafts[1] == drafts[0]


@pytest.mark.parametrize("metrics, mentions", [
    ("vllm", "0 drafts, 0 draft tokens, 0 accepted over the run: the server drafted nothing"),
    (None, "publishes no speculative-decoding counters"),
])
def test_required_speculation_that_never_happened_fails(engine, export_dir, metrics, mentions):
    """A server configured to speculate that never drafts (its counters stay at zero), or one that
    publishes nothing: its tokens are exact, yet the run fails with the option."""
    with FakeServer(engine, "openai", metrics=metrics) as server:
        report, rows = _run(server, export_dir, require_speculation=True)
    assert report.failed
    assert [name for name, row in rows.items() if row.status is Status.FAIL] == ["speculation"]
    assert mentions in rows["speculation"].detail
    assert all(rows[f"tokens {p}"].status is Status.EXACT for p in ("p0", "p1", "p2"))


def test_without_the_option_the_counts_are_reported_not_failed(engine, export_dir):
    with FakeServer(engine, "openai", metrics="vllm") as server:
        report, rows = _run(server, export_dir)
    assert not report.failed and rows["speculation"].status is Status.EXACT
    assert "drafted nothing" in rows["speculation"].detail
    with FakeServer(engine, "openai") as server:                   # no /metrics: no row
        report, rows = _run(server, export_dir)
    assert not report.failed and "speculation" not in rows


def test_sglang_publishes_drafts(engine, export_dir):
    """SGLang's verify calls count its drafts; it publishes no accepted-token counter, so drafts decide."""
    with FakeServer(engine, "sglang", speculative=True, metrics="sglang") as server:
        report, rows = _run(server, export_dir, require_speculation=True)
    assert not report.failed, report.summary()
    assert rows["speculation"].tables["speculation"]["drafts"] > 0
    assert "accepted tokens not published" in rows["speculation"].detail


def test_the_option_on_the_command_line(engine, export_dir, tmp_path, capsys):
    with FakeServer(engine, "openai", metrics="vllm") as server:
        code, out, err = run_main(["validate", "--server", server.url, "--fixtures", str(export_dir),
                                   "--require-speculation", f"--json={tmp_path / 'r.json'}"], capsys)
    assert code == 1, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    row = [c for c in report["checks"] if c["name"] == "speculation"]
    assert row and row[0]["status"] == "FAIL" and row[0]["tables"]["speculation"]["drafts"] == 0
    assert "FAIL   speculation" in out or "FAIL  speculation" in out


def test_the_option_needs_a_server(export_dir, capsys):
    code, out, err = run_main(["validate", "--fixtures", str(export_dir), "--require-speculation"], capsys)
    assert code == 2 and "--require-speculation applies to --server URL" in err


@pytest.mark.slow
def test_the_row_in_a_terminal_80_columns_wide(engine, export_dir):
    with FakeServer(engine, "openai", speculative=True, metrics="vllm") as server:
        result = in_terminal(["kdtree", "validate", "--server", server.url, "--fixtures", str(export_dir),
                              "--require-speculation"], columns=80)
    assert result.returncode == 0, result.output
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in result.lines]          # colours off
    assert any(line.split() == ["exact", "speculation"] for line in lines), result.output
    assert all(len(line) <= 80 for line in lines) and "drafts" in result.output
