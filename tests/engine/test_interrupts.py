"""Ctrl-C at every moment of a `kdtree validate` run leaves no report file that claims a verdict
and exits 130; once the verdict is final (the files published), a Ctrl-C no longer changes it.

Each moment is driven from the inside, not by a clock: an adapter that sends SIGINT to the CLI's
process from its factory or a method (interrupting_adapters.py; the adapter runs in the CLI's
supervised child, forked from this process, so what is patched here is patched there too), or
a patched step of the report's writing and publishing (engine/validate/reports/files.py)."""

from __future__ import annotations

import json
import os
import signal
import xml.etree.ElementTree as ET
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

import engine.cli.validate_cmd
from cli_run import run_main
from engine.validate import GOLDEN_DIR
from engine.validate.reports.files import ReportFiles

ADAPTERS = Path(__file__).with_name("interrupting_adapters.py")
STAGES = f"{Path(__file__).with_name('hostile_adapters.py')}:Stages"       # correct: 3 exact rows
TEST_PROCESS = os.getpid()


def ctrl_c_here() -> None:
    """SIGINT to this process (the CLI's parent): KeyboardInterrupt on the next line."""
    os.kill(os.getpid(), signal.SIGINT)


def after(method, then):
    """`method`, then then() (with its result kept)."""
    def patched(*args, **kwargs):
        result = method(*args, **kwargs)
        then()
        return result
    return patched


def before(method, first):
    def patched(*args, **kwargs):
        first()
        return method(*args, **kwargs)
    return patched


def child_ctrl_c() -> None:
    """From the supervised child only: Ctrl-C to the parent, and wait to be killed."""
    if os.getpid() != TEST_PROCESS:
        from interrupting_adapters import ctrl_c_to_the_parent

        ctrl_c_to_the_parent()


def parent_ctrl_c() -> None:
    if os.getpid() == TEST_PROCESS:
        ctrl_c_here()


def validate(tmp_path: Path, capsys, adapter: str | None = None, stdout_report: bool = False) -> tuple[int, str, str]:
    """validate --impl ADAPTER (interrupting_adapters.py; None: the correct Stages) on tree_build.kdtr,
    --json, --html and --junit-xml in tmp_path/out (the JUnit XML on stdout with stdout_report)."""
    out = tmp_path / "out"
    out.mkdir()
    if not (GOLDEN_DIR / "kernels" / "tree_build.kdtr").exists():
        pytest.skip("golden fixture kernels/tree_build.kdtr is absent")
    impl = STAGES if adapter is None else f"{ADAPTERS}:{adapter}"
    return run_main(["validate", "--fixtures", str(GOLDEN_DIR / "kernels" / "tree_build.kdtr"), "--impl", impl,
                     "--require", "none", "--json", str(out / "r.json"), "--html", str(out / "r.html"),
                     "--junit-xml", "-" if stdout_report else str(out / "r.xml")], capsys)


def assert_interrupted(tmp_path: Path, code: int, out: str, err: str) -> None:
    assert code == 130, err
    assert err.splitlines()[-1] == "kdtree: error: interrupted" and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path / "out")) == [], "a report file of an interrupted run"
    assert out == "", "a report on stdout of an interrupted run"


MOMENTS = {
    # the child just started, its start not yet returned in the parent (a Ctrl-C then is held, not lost)
    "child starting": (None, (BaseProcess, "start", after, parent_ctrl_c)),
    # before the checking: the adapter's factory
    "factory": ("interrupts_in_its_factory", None),
    # during the checks: an adapter method
    "checks": ("InterruptsInTreeBuild", None),
    # after the checks, while the child writes the reports (the first one written)
    "child writing": (None, (ReportFiles, "write", after, child_ctrl_c)),
    # the report shown by the parent, the files not yet published
    "before publishing": (None, (ReportFiles, "publish", before, parent_ctrl_c)),
    # the run stopped (the adapter ended the process): the parent writes the report itself
    "parent writing": ("DiesInTreeBuild", (ReportFiles, "write", after, parent_ctrl_c)),
}


@pytest.mark.parametrize("moment", MOMENTS)
def test_ctrl_c_at_any_moment_before_the_verdict_leaves_no_report(tmp_path, capsys, monkeypatch, moment):
    adapter, patch = MOMENTS[moment]
    if patch is not None:
        owner, name, how, ctrl_c = patch
        monkeypatch.setattr(owner, name, how(getattr(owner, name), ctrl_c))
    code, out, err = validate(tmp_path, capsys, adapter, stdout_report=True)
    assert_interrupted(tmp_path, code, out, err)


def test_ctrl_c_once_the_verdict_is_final_changes_nothing(tmp_path, capsys, monkeypatch):
    """The files are being moved into place (the first one is): the run exits with its verdict."""
    monkeypatch.setattr(engine.cli.validate_cmd, "_wrote", before(engine.cli.validate_cmd._wrote, ctrl_c_here))
    code, out, err = validate(tmp_path, capsys)
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "out")) == ["r.html", "r.json", "r.xml"]
    assert json.loads((tmp_path / "out" / "r.json").read_text())["summary"] == "PASSED: 3 checks (3 exact)"
    assert ET.parse(tmp_path / "out" / "r.xml").getroot().get("tests") == "3"


def test_a_ctrl_c_in_the_checking_process_alone_is_one_line(tmp_path, capfd):
    """An adapter that handles SIGINT itself gets one: the child ends quietly (no traceback), its row
    FAILs naming the method it was in and how the process ended, the report is written."""
    code, out, err = validate(tmp_path, capfd, "CtrlCInItself")
    assert code == 1, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    report = json.loads((tmp_path / "out" / "r.json").read_text())
    failed = [c["detail"] for c in report["checks"] if c["status"] == "FAIL"]
    assert len(failed) == 1 and failed[0].startswith("build_tree() ended the process with exit status 130"), failed
