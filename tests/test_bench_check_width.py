"""ci/bench_check.py's output fits the gate's 80-column log: its own table of checks (a long
label on a line of its own, the target wrapped below), and the pytest-benchmark tables of the
suites it runs (fewer columns, short names)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "bench_check" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("bench_check", REPO / "ci" / "bench_check.py")
    sys.modules["bench_check"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["bench_check"])
bench_check = sys.modules["bench_check"]


def benchmark(name: str, group: str | None, param: str, median: float, **extra_info) -> dict:
    return {"name": name, "group": group, "param": param, "stats": {"median": median},
            "extra_info": {"device": "AMD EPYC 7B13, 2 cores, 1 thread(s)", **extra_info}}


def test_the_checks_fit_80_columns(tmp_path, capsys):
    document = {"benchmarks": [
        *(benchmark(f"test_full_read[{p}]", "read", p, m) for p, m in
          (("kdtr_verified", 1.0), ("safetensors", 2.5), ("npz", 9.0), ("h5py", 0.5))),
        benchmark("test_bench_tree_build[64-64-float32]", None, "64-64-float32", 0.01, batch=64, budget=64,
                  speedup_vs_published=70.0)]}
    (tmp_path / "run.json").write_text(json.dumps(document))
    assert bench_check.main(["--json", str(tmp_path / "run.json")]) == 1            # h5py: 0.50x < 1.00x
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(line for line in lines if len(line) > 80)
    for check in bench_check.CHECKS:                                 # every label whole, on one line
        assert any(line.startswith(check.label) for line in lines), check.label
    assert any(line.endswith("0.50x     1.00x  FAIL") for line in lines), lines
    target = " ".join(" ".join(lines).split())
    assert "docs/results/kdtr-bench.md: full read with every checksum >= 1x h5py" in target


def test_the_suites_tables_are_asked_narrow(monkeypatch, tmp_path):
    """pytest-benchmark's default table is ~200 columns (min, max, mean, stddev, median, IQR,
    outliers, OPS, rounds, iterations); the suites run with median, IQR and rounds (73 columns on
    the kdtr suite)."""
    commands = []
    monkeypatch.setattr(bench_check.subprocess, "run",
                        lambda command, **kwargs: commands.append(command) or type("Done", (), {"returncode": 0}))
    monkeypatch.setattr(bench_check, "load", lambda paths: [])
    bench_check.run_suite(bench_check.SUITES["kdtr"], tmp_path / "kdtr.json")
    assert "--benchmark-columns=median,iqr,rounds" in commands[0] and "--benchmark-name=short" in commands[0]
