"""The supervisor's stack of adapter calls in flight (engine/validate/door: guard.watched tells the
parent each call's start and end, supervise.py keeps them): a call that ended, by a return or by
raising, leaves the stack, so what the validator's own code does after it is never the
adapter's. A crash of the validator's own code then reads "the run ended ..., outside the
adapter's calls", and the validator's own slow stretch runs on with no call's timeout over it.

The validator's own code is a kernel fixture's row merge (rows/kernel.row), run after the
section's last adapter call (compile_tree, which returns in `Stages` and raises in
`ExitsFourWays`), patched here before the CLI forks its child."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import engine.validate.rows.kernel as kernel_rows
from engine.validate.door import supervise
from cli_run import run_main
from engine.validate import GOLDEN_DIR

HOSTILE = Path(__file__).with_name("hostile_adapters.py")
ENDING = {"Stages": "returned", "ExitsFourWays": "raised"}      # how the last call before the merge ended


@pytest.fixture
def tree_build(tmp_path: Path) -> Path:
    if not (GOLDEN_DIR / "kernels" / "tree_build.kdtr").exists():
        pytest.skip("golden fixture kernels/tree_build.kdtr is absent")
    (tmp_path / "fx" / "kernels").mkdir(parents=True)
    (tmp_path / "fx" / "kernels" / "tree_build.kdtr").symlink_to(GOLDEN_DIR / "kernels" / "tree_build.kdtr")
    return tmp_path / "fx"


def after_the_calls(monkeypatch: pytest.MonkeyPatch, act) -> None:
    """The first row merge of the section does `act()` first (in a forked child only: a spawned
    one imports the module afresh, without the patch)."""
    if supervise._start_method() != "fork":
        pytest.skip("the supervisor spawns its child here (CUDA is initialized in this process, or the "
                    "platform cannot fork): a patch of the validator's code cannot reach it")
    merge = kernel_rows.row
    done = []

    def row(*args, **kwargs):
        if not done:
            done.append(True)
            act()
        return merge(*args, **kwargs)
    monkeypatch.setattr(kernel_rows, "row", row)


def validate(tree_build: Path, adapter: str, report: Path, capsys, *options: str) -> tuple[int, dict, str]:
    code, out, err = run_main(["validate", "--fixtures", str(tree_build), "--impl", f"{HOSTILE}:{adapter}",
                               "--require", "none", "--json", str(report), *options], capsys)
    return code, json.loads(report.read_text()), out + err


@pytest.mark.parametrize("adapter", ENDING)
def test_a_crash_after_the_adapters_calls_is_not_blamed_on_them(tree_build, tmp_path, capsys, monkeypatch, adapter):
    after_the_calls(monkeypatch, lambda: os._exit(3))
    code, report, output = validate(tree_build, adapter, tmp_path / "r.json", capsys)
    assert code == 1, output
    failed = {(c["section"], c["name"]): c["detail"] for c in report["checks"] if c["status"] == "FAIL"}
    assert failed == {("kernels/tree_build.kdtr", "fixture"): "the run ended the process with exit status 3, "
                                                              "outside the adapter's calls; nothing after it ran"}, \
        f"the last call {ENDING[adapter]}: {failed}"


@pytest.mark.parametrize("adapter", ENDING)
def test_the_timeout_bounds_the_adapters_calls_not_the_validators_own_work(tree_build, tmp_path, capsys,
                                                                           monkeypatch, adapter):
    after_the_calls(monkeypatch, lambda: time.sleep(2.0))
    code, report, output = validate(tree_build, adapter, tmp_path / "r.json", capsys, "--timeout", "1")
    stopped = [c["detail"] for c in report["checks"] if "did not return" in c["detail"] or
               c["detail"].startswith("not run: ")]
    assert stopped == [], f"the last call {ENDING[adapter]}: {stopped}"
    assert code == (0 if adapter == "Stages" else 1), output
