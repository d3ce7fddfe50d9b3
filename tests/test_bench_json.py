"""Benchmark results in pytest-benchmark's JSON (docs/ci.md): a real run of the KDTR read
benchmarks records its figures and device (tests/bench_record.py), `pytest-benchmark compare`
shows a regression between two runs, and ci/bench_check.py checks its ratio targets from the
medians and its figure targets from extra_info of that same JSON."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench_record import describe, record

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_check", REPO / "ci" / "bench_check.py")
bench_check = sys.modules["bench_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_check)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The KDTR full-read benchmarks at their default (small) size, one round each (in a pytest of
    its own: not an xdist worker, which pytest-benchmark would not let write its JSON)."""
    path = tmp_path_factory.mktemp("bench") / "run.json"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/kdtr/test_bench_kdtr.py", "-q", "-p",
                             "no:cacheprovider", "-k", "full_read", "--benchmark-enable", f"--benchmark-json={path}",
                             "--benchmark-min-rounds=1", "--benchmark-max-time=0.001", "--benchmark-warmup=off"],
                            cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(path.read_text())


def with_medians(document: dict, medians: dict[str, float]) -> dict:
    changed = copy.deepcopy(document)
    for b in changed["benchmarks"]:
        b["stats"]["median"] = medians[b["param"]]
    return changed


def write(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def test_each_benchmark_records_its_figures_and_device(run):
    benchmarks = {b["param"]: b for b in run["benchmarks"]}
    assert set(benchmarks) == {"kdtr_verified", "safetensors", "npz", "h5py"}
    for b in benchmarks.values():
        assert b["group"] == "read" and b["extra_info"] == {"bytes": 64 * 4096 * 4, "tensors": 64,
                                                           "device": describe("cpu")}


def test_record_makes_figures_json_and_names_the_device():
    class Benchmark:
        extra_info: dict = {}

    record(Benchmark, {"ratio": np.float32(2.5), "ids": np.arange(3), "nested": {"n": np.int64(4)}})
    assert json.loads(json.dumps(Benchmark.extra_info)) == {"ratio": 2.5, "ids": [0, 1, 2], "nested": {"n": 4},
                                                            "device": describe("cpu")}
    assert "cores" in describe("cpu")


def test_pytest_benchmark_compare_shows_a_regression(run, tmp_path):
    slower = copy.deepcopy(run)
    for b in slower["benchmarks"]:
        b["stats"] = {k: v * 3 if k in ("min", "max", "mean", "median") else v for k, v in b["stats"].items()}
    paths = [write(tmp_path / "before.json", run), write(tmp_path / "after.json", slower)]
    shown = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", *map(str, paths),
                            "--group-by=name", "--columns=median"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    for param in ("kdtr_verified", "safetensors", "npz", "h5py"):       # each run's median, the later 3x
        assert re.search(rf"test_full_read\[{param}\] \(\S*before\)\s+[\d.,]+ \(1\.0\)\s*\n"
                         rf"test_full_read\[{param}\] \(\S*after\)\s+[\d.,]+ \(3\.00\)", shown.stdout), shown.stdout


def test_bench_check_reads_the_ratios_from_the_medians(run, tmp_path, capsys):
    good = write(tmp_path / "good.json", with_medians(run, {"kdtr_verified": 1.0, "safetensors": 2.5, "npz": 9.0,
                                                           "h5py": 1.2}))
    assert bench_check.main(["--json", str(good)]) == 0
    out = capsys.readouterr().out
    assert "read: kdtr_verified vs safetensors" in out and "2.50x" in out and "1.20x" in out
    assert "not measured by these files" in out                     # the GPU figure checks
    slow = write(tmp_path / "slow.json", with_medians(run, {"kdtr_verified": 1.0, "safetensors": 1.5, "npz": 9.0,
                                                           "h5py": 1.2}))
    assert bench_check.main(["--json", str(slow)]) == 1
    assert re.search(r"kdtr_verified vs safetensors\s+1\.50x\s+2\.00x\s+FAIL", capsys.readouterr().out)


def test_bench_check_reads_figures_from_extra_info(tmp_path, capsys):
    def benchmark(batch: int, speedup: float) -> dict:
        class Benchmark:
            extra_info: dict = {}

        record(Benchmark, {"batch": np.int64(batch), "budget": 64, "speedup_vs_published": np.float64(speedup)})
        return {"name": f"test_bench_tree_build[{batch}-64-float32]", "group": None, "param": f"{batch}-64-float32",
                "stats": {"median": 0.01}, "extra_info": Benchmark.extra_info}

    met = write(tmp_path / "met.json", {"benchmarks": [benchmark(64, 70.0), benchmark(1, 2.0)]})
    assert bench_check.main(["--json", str(met)]) == 0            # batch 1 is not what the target names
    assert re.search(r"speedup_vs_published batch=64 budget=64\s+70\.00x\s+30\.00x\s+ok", capsys.readouterr().out)
    missed = write(tmp_path / "missed.json", {"benchmarks": [benchmark(64, 20.0)]})
    assert bench_check.main(["--json", str(missed)]) == 1


def test_bench_check_refuses_what_it_cannot_check(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{not json")
    assert bench_check.main(["--json", str(tmp_path / "broken.json")]) == 2
    assert capsys.readouterr().err.startswith(f"bench_check: error: {tmp_path / 'broken.json'}: not pytest-benchmark")
    other = write(tmp_path / "other.json", {"benchmarks": [{"name": "test_x", "group": "g", "param": "p",
                                                            "stats": {"median": 1.0}, "extra_info": {}}]})
    assert bench_check.main(["--json", str(other)]) == 1
    assert "no check is measured" in capsys.readouterr().out


@pytest.mark.parametrize("check", bench_check.CHECKS, ids=lambda c: c.label)
def test_each_bench_check_cites_a_doc_of_the_repository_in_its_words(check):
    doc, _, claim = check.target.partition(": ")
    assert (REPO / doc).is_file(), f"{check.target!r} cites {doc}, which is not in the repository"
    assert claim.removesuffix(" (GPU)") in (REPO / doc).read_text().replace("`", ""), \
        f"{doc} does not state {claim!r}"
