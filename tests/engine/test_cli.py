"""The `kdtree` CLI: validate passes on the committed fixtures, fails on a broken adapter
naming the check, writes its JSON report; demo runs; bad input is one line and non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cli import main
from engine.validate import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"


def needs(*names: str) -> None:
    for name in names:
        if not (GOLDEN_DIR / name).exists():
            pytest.skip(f"golden fixture {GOLDEN_DIR / name} is absent (generate it with `refgen generate`)")


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in-process (it sets torch's CPU threads to 1: restored after)."""
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def kdtree(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_validate_passes_on_the_committed_fixtures(tmp_path, capsys):
    needs("tiny.kdtr", "tiny2.kdtr")
    report_path = tmp_path / "report.json"
    code, out, _ = run_main(["validate", "--json", str(report_path)], capsys)
    assert code == 0, out
    assert "PASSED" in out
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["counts"]["FAIL"] == 0
    names = {(c["section"], c["name"]) for c in report["checks"]}
    for wanted in [("tiny.kdtr", "verify logits"), ("tiny2.kdtr", "engine DDTree replay (batched)"),
                   ("tiny.kdtr", "invariant DDTree == AR (layerskip)")]:
        assert wanted in names
    logits = next(c for c in report["checks"] if c["name"] == "verify logits")
    assert logits["status"] == "within tolerance" and 0 < logits["error"] <= logits["tolerance"]
    assert {c["status"] for c in report["checks"]} <= {"exact", "within tolerance", "near-tie"}
    assert report["backends"] == {"stages": "torch", "attention": "torch"}


def test_validate_example_adapter_passes_and_broken_one_fails(tmp_path):
    needs("kernels/tree_build.kdtr")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "tree_build.kdtr").symlink_to(GOLDEN_DIR / "kernels" / "tree_build.kdtr")
    good = kdtree("validate", "--fixtures", str(tmp_path), "--impl", "docs/examples/numpy_adapter.py:NumpyAdapter",
                  "--require", "topk,tree")          # this directory exercises nothing else it implements
    assert good.returncode == 0, good.stdout + good.stderr
    broken = kdtree("validate", "--fixtures", str(tmp_path), "--json", str(tmp_path / "r.json"),
                    "--impl", "docs/examples/broken_adapter.py:BrokenTieAdapter", "--require", "topk,tree")
    assert broken.returncode == 1
    assert "FAILED" in broken.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    failed = [c for c in report["checks"] if c["status"] == "FAIL"]
    assert [c["name"] for c in failed] == ["tree build"] and "tied" in failed[0]["detail"]


def test_demo_runs_and_plots(tmp_path, capsys):
    needs("tiny.kdtr")
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    plot = tmp_path / "acceptance.png"
    code, out, _ = run_main(["demo", "--max-new-tokens", "12", "--budget", "8", "--block-size", "4",
                             "--plot", str(plot)], capsys)
    assert code == 0, out
    assert "NO" not in out and out.count("yes") == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["validate", "--fixtures", "/no/such/dir"], "fixture directory /no/such/dir does not exist"),
    (["validate", "--device", "tpu"], "--device must be cpu or cuda"),
    (["validate", "--impl", "no_such_module_xyz:make"], "cannot import"),
    (["validate", "--json", "/no/such/dir/r.json"], "directory /no/such/dir does not exist"),
    (["demo", "--preset", "huge"], "unknown preset 'huge'"),
    (["demo", "--budget", "-1"], "budget"),
    (["demo", "--fixture", "/no/such.kdtr"], "no fixture /no/such.kdtr"),
    (["demo", "--prompt", "1,x"], "comma-separated token ids"),
    (["demo", "--prompt", ",".join(["1"] * 600)], "max_position_embeddings"),
    (["demo", "--preset", "tiny2", "--fixture", str(GOLDEN_DIR / "tiny.kdtr")], "holds preset 'tiny', not 'tiny2'"),
    (["nonsense"], "No such command"),
])
def test_bad_input_is_one_line(capsys, args, message):
    if "--fixture" in args and "tiny.kdtr" in args[-1]:
        needs("tiny.kdtr")
    if args[0] == "demo" and "--fixture" not in args and "--preset" not in args:
        needs("tiny.kdtr")
    code, out, err = run_main(args, capsys)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdtree: error: ") and message in lines[0], err


def test_bad_input_leaves_no_traceback_and_no_file(tmp_path):
    result = kdtree("validate", "--fixtures", str(tmp_path / "missing"), "--json", str(tmp_path / "r.json"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
