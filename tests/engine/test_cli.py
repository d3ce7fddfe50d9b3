"""The `kdtree` CLI in this process: validate passes on the committed fixtures, fails on a
broken adapter naming the check, writes its JSON report (what ran, where, how long) with
the user's umask; demo runs on any model fixture; bad input that needs the engine loaded
to judge is one line and exit 2 (the rest: tests/test_cli_terminal.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
import torch

import engine.cli.validate_cmd
from cli_run import run_main
from engine.validate import load_impl
from kdtr_format import PRESETS
from refgen.files import write_fixture
from refgen.fixtures import model_fixture

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"


def kdtree(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def with_umask(mask: int, run):
    """run() with the process umask set to `mask`, restored after."""
    old = os.umask(mask)
    try:
        return run()
    finally:
        os.umask(old)


def test_validate_passes_on_the_committed_fixtures(tmp_path, capsys):
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


def test_validate_example_adapter_passes_and_broken_one_fails(golden, tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "tree_build.kdtr").symlink_to(golden / "kernels" / "tree_build.kdtr")
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


def test_the_json_report_says_what_ran_where_and_how_long(golden, tmp_path, capsys):
    fixture = golden / "kernels" / "tree_build.kdtr"
    report_path = tmp_path / "report.json"
    code, out, _ = run_main(["validate", "--fixtures", str(fixture), "--json", str(report_path),
                             "--require", "topk,tree,compile"], capsys)          # what this one file exercises
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["fixtures"] == str(fixture)
    assert {c["section"] for c in report["checks"]} == {"tree_build.kdtr"}, "one file: only its checks"
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["numpy"] == np.__version__
    assert report["versions"]["kdtree"] and report["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    cli_file = Path(engine.cli.validate_cmd.__file__).resolve().relative_to(REPO)
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(cli_file)], cwd=REPO,
                             capture_output=True).returncode == 0
    if tracked:
        assert head and report["commit"] in (head, f"{head}-dirty")
    else:       # no .git, or one that predates the CLI's files (a copied checkout): no commit, never a wrong one
        assert report["commit"] is None
    assert report["device"] == "cpu" and "cores" in report["device_name"]
    steps = report["timings"]["steps"]
    assert [s["step"] for s in steps] == ["checking tree_build.kdtr"]
    assert 0 < steps[0]["seconds"] <= report["timings"]["total_seconds"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_json_report_and_plot_follow_the_umask(golden, tmp_path, capsys, mask):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    report, plot = tmp_path / "r.json", tmp_path / "a.png"
    with_umask(mask, lambda: run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"),
                                       "--json", str(report), "--impl",
                                       str(EXAMPLES / "numpy_adapter.py") + ":NumpyAdapter"], capsys))
    with_umask(mask, lambda: run_main(["demo", "--max-new-tokens", "3", "--budget", "2", "--block-size", "2",
                                       "--plot", str(plot)], capsys))
    assert [oct(p.stat().st_mode & 0o777) for p in (report, plot)] == [oct(0o666 & ~mask)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "r.json"]      # no temporary files left


def test_demo_runs_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    plot = tmp_path / "acceptance.png"
    code, out, _ = run_main(["demo", "--max-new-tokens", "12", "--budget", "8", "--block-size", "4",
                             "--plot", str(plot)], capsys)
    assert code == 0, out
    assert "NO" not in out and out.count("yes") == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_runs_on_a_fixture_that_is_no_preset(tmp_path, capsys):
    """As `refgen generate --config-file` writes it: named after the file, its own config."""
    cfg = dataclasses.replace(PRESETS["tiny2"], num_hidden_layers=2, first_k_dense_replace=1)
    write_fixture(tmp_path / "my-model.kdtr", model_fixture(cfg, "my-model", seed=3, source="config-file"))
    code, out, err = run_main(["demo", "--fixture", str(tmp_path / "my-model.kdtr"), "--max-new-tokens", "6",
                               "--budget", "6", "--block-size", "3"], capsys)
    assert code == 0, out + err
    assert out.startswith(f"model my-model ({tmp_path / 'my-model.kdtr'})") and out.count("yes") == 3


def test_impl_module_in_the_current_directory(tmp_path, monkeypatch):
    """`--impl mod:factory` finds mod.py in the current directory, also from a console script
    (whose sys.path does not hold the current directory)."""
    (tmp_path / "kdtree_test_cwd_adapter.py").write_text("class A:\n    name = 'mine'\n\ndef make():\n    return A()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "kdtree_test_cwd_adapter", raising=False)
    assert load_impl("kdtree_test_cwd_adapter:make").name == "mine"
    assert str(tmp_path) not in sys.path
    with pytest.raises(ValueError, match="name a module on PYTHONPATH or in the current directory"):
        load_impl("kdtree_test_no_such_module:make")


def test_a_corrupt_model_fixture_is_named(golden, tmp_path, capsys):
    data = bytearray((golden / "tiny2.kdtr").read_bytes())
    with kdtr_format.open(golden / "tiny2.kdtr") as reader:
        embedding = reader.info("weights/embed_tokens")
    data[embedding.offset + embedding.nbytes // 2] ^= 0xFF      # inside the weights the demo loads
    (tmp_path / "broken.kdtr").write_bytes(bytes(data))
    code, _, err = run_main(["demo", "--fixture", str(tmp_path / "broken.kdtr")], capsys)
    assert code == 2 and err.startswith(f"kdtree: error: {tmp_path / 'broken.kdtr'}: data checksum mismatch"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["demo", "--prompt", "5000"], "--prompt: token id 5000 is outside the model's vocabulary of 1024"),
    (["demo", "--preset", "huge"], "--preset huge: no fixture"),
    (["demo", "--fixture", "{golden}/kernels/tree_build.kdtr"], "not a model fixture (kind 'tree_build')"),
    (["demo", "--preset", "tiny2", "--fixture", "{golden}/tiny.kdtr"], "holds 'tiny', not --preset 'tiny2'"),
    (["demo", "--prompt", ",".join(["1"] * 600)], "max_position_embeddings 512"),
    (["validate", "--impl", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
    (["validate", "--impl", ""], "--impl '' is empty: name the adapter's factory"),     # `--impl "$IMPL"`, IMPL unset
    (["validate", "--impl", " ", "--tp", "2"], "--impl ' ' is empty: name the adapter's factory"),
    (["validate", "--fixtures", str(REPO / "README.md")], "is not a .kdtr file"),
    (["diverge", "--fixture", "{golden}/tiny.kdtr", "--tokens", "100000"],
     "--tokens 100000: tiny.kdtr prompt p2 holds 16 AR tokens to compare; give --tokens 16 or fewer"),
    (["diverge", "--config", "tiny", "--tokens", "100000"],
     "--prompt-length 64 + --tokens 100000 need 100064 positions; tiny has max_position_embeddings 512"),
    (["validate", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_bad_input_is_one_line(golden, capsys, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda is good input here")
    code, out, err = run_main([arg.format(golden=golden) for arg in args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdtree: error: ") and message in lines[0], err


def test_a_failing_run_lists_its_fail_rows_under_the_verdict(golden, tmp_path, capsys):
    code, out, _ = run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"), "--impl",
                             f"{EXAMPLES / 'broken_adapter.py'}:BrokenTieAdapter", "--require", "none"], capsys)
    assert code == 1
    lines = out.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("FAILED: "))
    assert lines[verdict + 1:] == ["FAIL rows (1):", "  tree_build.kdtr::tree build: 21 differ; first at [13]: "
                                   "got 5, expected 1 (case tied_logits)"], out


def test_a_passing_run_lists_no_fail_rows(golden, capsys):
    code, out, _ = run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"), "--impl",
                             f"{EXAMPLES / 'numpy_adapter.py'}:NumpyAdapter", "--require", "none"], capsys)
    assert code == 0 and out.splitlines()[-1].startswith("PASSED: "), out


def test_a_report_that_cannot_be_written_comes_after_the_terminal_report(golden, tmp_path, capsys, monkeypatch):
    """The JUnit file's directory is gone when the reports are written: the terminal report of the
    checks is shown, then one error line naming the file; no report is published, exit 2."""
    from engine.validate.door import supervise
    from engine.validate.reports.files import ReportFiles

    if supervise._start_method() != "fork":      # the child writes the reports, the parent publishes them
        pytest.skip("the supervisor spawns its child here (CUDA is initialized in this process, or the platform "
                    "cannot fork): the patched staging path would reach the parent only")
    staged = ReportFiles.staged
    monkeypatch.setattr(ReportFiles, "staged", lambda self, path: tmp_path / "gone" / "r.xml" if str(path).endswith(
        ".xml") else staged(self, path))
    code, out, err = run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"), "--impl",
                               f"{EXAMPLES / 'numpy_adapter.py'}:NumpyAdapter", "--require", "none",
                               "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")], capsys)
    assert code == 2
    assert out.splitlines()[-1].startswith("PASSED: "), out
    assert err.splitlines()[-1] == (f"kdtree: error: {tmp_path / 'r.xml'}: cannot write the junit report: "
                                    f"No such file or directory"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a report published by a run that exits 2"


def test_a_long_path_wraps_between_its_names():
    from engine.cli.common import _lines

    path = "/root/.cache/kdtree/golden-bb87a4c704e70a53/some/longer/directory/tiny.kdtr"
    lines = _lines(f"declared, but no fixture in {path} has checks for it", 48, "    ", "    ")
    assert all(len(line) <= 48 for line in lines), lines
    assert path in "".join(line.strip() for line in lines), lines
    assert all(line.endswith("/") for line in lines[:-1]), lines            # broken between names, never in one


def test_the_capability_row_names_the_fixtures_as_given(committed_golden):
    """A declared capability no fixture checks: the row names the path the user gave, not its
    materialized copy in the cache."""
    from engine.validate import validate

    given = committed_golden / "kernels" / "tree_build.kdtr"
    report = validate(load_impl(f"{REPO / 'tests' / 'engine' / 'hostile_adapters.py'}:Stages"), given)
    row = next(c for c in report.checks if c.name == "capability compact")
    assert row.detail == f"declared, but no fixture in {given} has checks for it (--require compact makes this a FAIL)"


def test_diverge_continuation_lines_keep_their_indent():
    from io import StringIO
    from types import SimpleNamespace

    from rich.console import Console

    from engine.cli.diverge_cmd import render_divergence

    way = SimpleNamespace(label="AR decode", tokens=list(range(43)), prompt_length=27)
    divergence = SimpleNamespace(explanation=["every earlier point is bitwise equal, so this op returned different "
                                              "bits for the same inputs: AR decode ran it with M = 1 (batch 1)"],
                                 points=[], decisions=[], dtype="float32")
    text = StringIO()
    render_divergence(SimpleNamespace(label="tiny.kdtr prompt p2"), way, way, divergence,
                      Console(file=text, width=80, force_terminal=True, color_system=None))
    lines = text.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("kdtree diverge: ") and lines[1] == "  27", lines          # the header, wrapped
    assert lines[2].startswith("  every earlier") and lines[3] == "    the same inputs: AR decode ran it with M = 1 " \
                                                                  "(batch 1)", lines


def test_demo_says_how_many_ranks_it_ran_on():
    from io import StringIO
    from types import SimpleNamespace

    from rich.console import Console

    from engine.cli.demo_cmd import _DemoModel, _print_demo
    from kdtr_format import DDTreeConfig

    metrics = SimpleNamespace(target_forwards=3, mean_acceptance=2.0, tokens_per_second=1.0,
                              stage_seconds=__import__("collections").defaultdict(float))
    runs = {"AR": SimpleNamespace(tokens=[[1, 2]], metrics=metrics)}
    text = StringIO()
    _print_demo(Console(file=text, width=200), _DemoModel(Path("tiny.kdtr"), "tiny", PRESETS["tiny"], [5]), [5],
                DDTreeConfig(block_size=3, budget=4), runs, 2, "legend")
    assert "block size 3, budget 4; on 2 ranks (--tp 2: tensor and expert parallel); AR tokens" in text.getvalue()


@pytest.mark.skipif(not os.access("/proc", os.W_OK), reason="/proc is refused as unwritable while the options "
                                                           "are parsed here (not root)")
def test_a_report_under_proc_comes_after_the_terminal_report(golden, tmp_path, capsys):
    """The issue's case: /proc passes the parse-time check as root, and no file can be made there."""
    code, out, err = run_main(["validate", "--fixtures", str(golden / "kernels" / "tree_build.kdtr"), "--impl",
                               f"{EXAMPLES / 'numpy_adapter.py'}:NumpyAdapter", "--require", "none",
                               "--json", str(tmp_path / "r.json"), "--junit-xml", "/proc/nope.xml"], capsys)
    assert code == 2 and out.splitlines()[-1].startswith("PASSED: "), out
    assert err.splitlines()[-1].startswith("kdtree: error: /proc/nope.xml: cannot write the junit report: "), err
    assert list(tmp_path.iterdir()) == []
