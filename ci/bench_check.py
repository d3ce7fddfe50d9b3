"""The gate's benchmark ratio checks: speed as ratios measured side by side in one run.

Each check names a pytest-benchmark group, a candidate and a baseline (their
`param`), and the least speedup (baseline median / candidate median) allowed.
Only CPU benchmarks run here; the GPU targets are measured on the GPU machine
and recorded under docs/results/. Exit 1 when any ratio falls short.

    python3 ci/bench_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Suite:
    path: str                  # a pytest-benchmark file under tests/
    env: dict[str, str]        # the size it is run at
    select: str                # pytest -k expression: only the groups the checks read


@dataclass(frozen=True)
class RatioCheck:
    suite: str
    group: str
    candidate: str
    baseline: str
    at_least: float
    target: str                # where the bound comes from


SUITES = {
    "kdtr": Suite("tests/kdtr/test_bench_kdtr.py", {"KDTREE_BENCH": "ci"}, "full_read"),
}

CHECKS = [
    RatioCheck("kdtr", "read", "kdtr_verified", "safetensors", 2.0,
               "PERFORMANCE.md: full read with every checksum >= 2x safetensors load_file"),
    RatioCheck("kdtr", "read", "kdtr_verified", "h5py", 1.0,
               "PERFORMANCE.md: full read with every checksum >= 1x h5py"),
]


def run_suite(suite: Suite, json_path: Path) -> dict[tuple[str, str], float]:
    """Run one benchmark file; -> {(group, param): median seconds}."""
    command = [sys.executable, "-m", "pytest", suite.path, "-q", "-p", "no:cacheprovider",
               "-k", suite.select, "--benchmark-enable", f"--benchmark-json={json_path}"]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, **suite.env})
    if result.returncode != 0:
        raise SystemExit(f"bench_check: {suite.path} failed (pytest exit {result.returncode})")
    report = json.loads(json_path.read_text())
    return {(b["group"], b["param"]): b["stats"]["median"] for b in report["benchmarks"]}


def main() -> int:
    medians: dict[str, dict[tuple[str, str], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, suite in SUITES.items():
            medians[name] = run_suite(suite, Path(tmp) / f"{name}.json")

    failures = 0
    print(f"{'check':<48} {'ratio':>8} {'least':>7}  status")
    for check in CHECKS:
        times = medians[check.suite]
        label = f"{check.group}: {check.candidate} vs {check.baseline}"
        missing = [p for p in (check.candidate, check.baseline) if (check.group, p) not in times]
        if missing:
            print(f"{label:<48} {'-':>8} {check.at_least:>7.2f}  FAIL (no benchmark {missing})")
            failures += 1
            continue
        ratio = times[(check.group, check.baseline)] / times[(check.group, check.candidate)]
        ok = ratio >= check.at_least
        failures += not ok
        print(f"{label:<48} {ratio:>7.2f}x {check.at_least:>6.2f}x  {'ok' if ok else 'FAIL'}  ({check.target})")
    print(f"bench_check: {len(CHECKS) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
