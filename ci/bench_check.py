"""The gate's benchmark checks, read from pytest-benchmark's JSON (docs/ci.md, "Benchmarks").

Two kinds of check, each with the target it comes from (`target`: the doc that states it and
its words there, then "(GPU)" for a GPU benchmark's):

- `RatioCheck`: the speedup of a candidate over a baseline measured side by side in one
  run: baseline median / candidate median of two benchmarks of one pytest-benchmark group
  (told apart by their `param`), at least `at_least`.
- `FigureCheck`: a figure the benchmark recorded in its `extra_info` (tests/bench_record.py:
  a ratio, or a fraction of a ceiling measured in the same run), at least `at_least`, in
  every benchmark of test `test` whose extra_info matches `where`.

    python3 ci/bench_check.py                      # run the CPU suites below, check what they measure
    python3 ci/bench_check.py --json A.json ...    # check JSON written earlier (the GPU machine's too)

Run bare (the gate), the CPU suites run here and their checks must be measured; the GPU
checks are listed as not run. With --json every check whose benchmarks the files hold is
checked and the rest are listed as not measured; files that hold none of them fail. Exit 1
when a check fails, 2 for a file that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

    @property
    def label(self) -> str:
        return f"{self.group}: {self.candidate} vs {self.baseline}"


@dataclass(frozen=True)
class FigureCheck:
    test: str                  # the benchmark's test function
    figure: str                # its extra_info key
    at_least: float
    target: str
    where: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.test} {self.figure}" + "".join(f" {k}={v}" for k, v in self.where.items())


SUITES = {
    "kdtr": Suite("tests/kdtr/test_bench_kdtr.py", {"KDTREE_BENCH": "ci"}, "full_read"),
}

CHECKS: list[RatioCheck | FigureCheck] = [
    RatioCheck("kdtr", "read", "kdtr_verified", "safetensors", 2.0,
               "docs/results/kdtr-bench.md: full read with every checksum >= 2x safetensors load_file"),
    RatioCheck("kdtr", "read", "kdtr_verified", "h5py", 1.0,
               "docs/results/kdtr-bench.md: full read with every checksum >= 1x h5py"),
    FigureCheck("test_bench_tree_build", "speedup_vs_published", 30.0,
                "docs/results/tree-kernels-h200.md: >= 30x faster than (a) at batch 64, budget 64 (GPU)",
                where={"batch": 64, "budget": 64}),
    FigureCheck("test_bench_mla_verify_k2", "speedup_vs_torch", 1.0,
                "docs/results/mla-verify-h200.md: faster than the torch baseline (matmul, mask, softmax in "
                "float32) (GPU)"),
]


class BadInput(Exception):
    """A JSON file that cannot be read as pytest-benchmark's."""


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """Every benchmark of pytest-benchmark JSON files (--benchmark-json or a stored run)."""
    benchmarks = []
    for path in paths:
        try:
            document = json.loads(Path(path).read_text())
            benchmarks += [b for b in document["benchmarks"] if {"name", "stats", "extra_info"} <= set(b)]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{path}: not pytest-benchmark JSON ({type(exc).__name__}: {exc})") from None
    return benchmarks


def measure(check: RatioCheck | FigureCheck, benchmarks: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The check's measured values, each with what it was measured on (empty: not measured)."""
    if isinstance(check, RatioCheck):
        group = {b.get("param"): b for b in benchmarks if b.get("group") == check.group}
        if check.candidate not in group or check.baseline not in group:
            return []
        candidate, baseline = group[check.candidate], group[check.baseline]
        return [(candidate["extra_info"].get("device", ""), baseline["stats"]["median"] / candidate["stats"]["median"])]
    found = []
    for b in benchmarks:
        info = b["extra_info"]
        if b["name"].split("[")[0] == check.test and check.figure in info and \
                all(info.get(k) == v for k, v in check.where.items()):
            found.append((b["name"], float(info[check.figure])))
    return found


def run_suite(suite: Suite, json_path: Path) -> list[dict[str, Any]]:
    """Run one benchmark file; -> its benchmarks."""
    command = [sys.executable, "-m", "pytest", suite.path, "-q", "-p", "no:cacheprovider",
               "-k", suite.select, "--benchmark-enable", f"--benchmark-json={json_path}",
               "--benchmark-columns=median,iqr,rounds", "--benchmark-name=short"]      # tables within 80 columns
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, **suite.env})
    if result.returncode != 0:
        raise SystemExit(f"bench_check: {suite.path} failed (pytest exit {result.returncode})")
    return load([json_path])


def check_all(benchmarks: list[dict[str, Any]], ran_here: set[str] | None) -> int:
    """Print every check's outcome, 80 columns wide; -> the number failed. ran_here: the suites
    this run ran (their checks must be measured; the others are not run here), None for --json
    files."""
    failures = measured = 0
    print(_row("check", "value", "least", "status"))
    for check in CHECKS:
        values = measure(check, benchmarks)
        if not values:
            if ran_here is None:
                status, why = "-", "not measured by these files"
            elif isinstance(check, RatioCheck) and check.suite in ran_here:
                status, why, failures = "FAIL", "not measured", failures + 1
            else:
                status, why = "-", "not run here (a GPU benchmark: check its JSON with --json)"
            print(_row(check.label, "-", f"{check.at_least:.2f}x", status))
            print(_detail(f"{why}; {check.target}"))
            continue
        measured += 1
        for where, value in values:
            ok = value >= check.at_least
            failures += not ok
            print(_row(check.label, f"{value:.2f}x", f"{check.at_least:.2f}x", "ok" if ok else "FAIL"))
            print(_detail(f"{where + '; ' if where else ''}{check.target}"))
    if measured == 0:
        print("bench_check: no check is measured by these benchmarks")
        return failures + 1
    print(f"bench_check: {failures} failed")
    return failures


WIDTH = 80                     # the gate's log: every line fits 80 columns
LABEL_WIDTH = 50


def _row(label: str, value: str, least: str, status: str) -> str:
    """A check's line: its label (alone on the line above when too long), value, bound, status."""
    numbers = f"{value:>9} {least:>9}  {status}"
    if len(label) > LABEL_WIDTH:
        return f"{label}\n{'':<{LABEL_WIDTH}} {numbers}"
    return f"{label:<{LABEL_WIDTH}} {numbers}"


def _detail(text: str) -> str:
    """A check's target and where it was measured, on indented lines below it."""
    return textwrap.fill(text, WIDTH, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False,
                         break_long_words=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The gate's benchmark checks (module docstring).")
    parser.add_argument("--json", nargs="+", type=Path, metavar="FILE",
                        help="check these pytest-benchmark JSON files instead of running the CPU suites")
    args = parser.parse_args(argv)
    try:
        if args.json:
            return 1 if check_all(load(args.json), None) else 0
        with tempfile.TemporaryDirectory() as tmp:
            benchmarks = [b for name, suite in SUITES.items() for b in run_suite(suite, Path(tmp) / f"{name}.json")]
        return 1 if check_all(benchmarks, set(SUITES)) else 0
    except BadInput as exc:
        print(f"bench_check: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
