"""`kdtree validate --server` as people run it: the rows on the terminal (80 columns) are the rows of the
JSON, JUnit XML and HTML reports; a broken server exits 1 with its failing rows in each; bad input is one
line and exit 2, before anything is sent."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from cli_run import run_main
from fake_servers import FakeServer
from terminal import assert_clean_error, in_terminal, piped

ROWS = ["server", "tokens p0", "logprobs p0", "tokens p1", "logprobs p1", "tokens p2", "logprobs p2"]


def _reports(tmp_path):
    return [f"--json={tmp_path / 'r.json'}", f"--junit-xml={tmp_path / 'r.xml'}", f"--html={tmp_path / 'r.html'}"]


@pytest.mark.parametrize("bug", [None, "drop_last"])
def test_the_reports_hold_the_terminals_rows(engine, export_dir, tmp_path, capsys, bug):
    with FakeServer(engine, "sglang", bug=bug) as server:
        code, out, err = run_main(["validate", "--server", server.url, "--api", "sglang", "--fixtures", str(export_dir),
                                   "--logprobs", "1", *_reports(tmp_path)], capsys)
    assert code == (0 if bug is None else 1), out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["name"] for c in report["checks"]] == ROWS and report["passed"] is (bug is None)
    assert report["implementation"] == f"server {server.url} (sglang API)" and report["versions"]["kdtree"]
    failing = [c["name"] for c in report["checks"] if c["status"] == "FAIL"]
    assert failing == ([] if bug is None else ["tokens p0", "tokens p1", "tokens p2"])
    for name in ROWS:
        assert name in out
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("name") == "tiny.kdtr" and [t.get("name") for t in suite.iter("testcase")] == ROWS
    assert [t.get("name") for t in suite.iter("testcase") if t.find("failure") is not None] == failing
    page = (tmp_path / "r.html").read_text()
    assert all(name in page for name in ROWS) and f": {'FAILED' if bug else 'PASSED'}</title>" in page


@pytest.mark.slow
def test_a_broken_server_in_a_terminal_80_columns_wide(engine, export_dir):
    with FakeServer(engine, "openai", bug="accept_off_by_one") as server:
        result = in_terminal(["kdtree", "validate", "--server", server.url, "--fixtures", str(export_dir)], columns=80)
    assert result.returncode == 1, result.output
    assert result.widest <= 80 and "Traceback" not in result.output
    assert "FAIL" in result.output and "expected" in result.output and "FAILED" in result.output


@pytest.mark.parametrize("args, mentions", [
    (["--server", "ftp://127.0.0.1:1"], "expected http://host:port"),
    (["--server", "http://127.0.0.1:99999"], "the port is not a number"),
    (["--concurrency", "4"], "--concurrency applies to --server URL"),
    (["--server", "http://127.0.0.1:1", "--tp", "2"], "--tp applies to an adapter or the built-in engine"),
    (["--server", "http://127.0.0.1:1", "--samples", "100"], "--samples applies to sampled runs"),
])
def test_bad_input_is_one_line(args, mentions, capsys, export_dir):
    code, out, err = run_main(["validate", "--fixtures", str(export_dir), *args], capsys)
    assert code == 2 and mentions in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_piped(export_dir):
    assert_clean_error(piped(["kdtree", "validate", "--server", "http://127.0.0.1:1", "--fixtures",
                              str(export_dir / "config.json")]), "not a .kdtr")
