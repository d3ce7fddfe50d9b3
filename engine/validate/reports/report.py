"""The report: one `Check` row per comparison, a `Report` of rows, and its JSON form.

A row's status is one of exact, within tolerance, near-tie (a token divergence at a
decision whose reference margin is below the fixture's threshold), skipped, FAIL.
The report fails when any row is FAIL, and when no row ran (every one skipped).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kdtr_format.clikit import atomic_output


class ValidateError(Exception):
    """Bad input to the runner (missing fixtures, a fixture that contradicts its preset)."""


class Status(str, Enum):
    EXACT = "exact"
    WITHIN = "within tolerance"
    NEAR_TIE = "near-tie"
    SKIPPED = "skipped"
    FAIL = "FAIL"


REQUIREMENTS = "validate"                 # the section of the run's own requirement rows
ANY_CHECK_RAN = "any check ran"
SEVERITY = {Status.SKIPPED: 0, Status.EXACT: 1, Status.WITHIN: 2, Status.NEAR_TIE: 3, Status.FAIL: 4}


@dataclass
class Check:
    """One row of the report. section: the fixture's path in the fixture directory;
    error / tolerance: |actual - expected| and its tolerance at the element the row
    reports; margin: the reference's margin at the decision the row reports (a token
    divergence), shown only here, never in the detail; needs: the adapter capabilities
    the row exercises (empty for the built-in engine's own rows); tables: JSON-ready
    detail too large for the row's text (judging/acceptance.py's tables); regime: the tolerance
    regime that judged it and its numbers (judging/regime.py)."""

    section: str
    name: str
    status: Status
    error: float | None = None
    tolerance: float | None = None
    margin: float | None = None
    detail: str = ""
    needs: tuple[str, ...] = ()
    tables: dict[str, Any] = field(default_factory=dict)
    regime: str = ""

    @property
    def ratio(self) -> float:
        if self.error is None or not self.tolerance:
            return 0.0 if not self.error else float("inf")
        return self.error / self.tolerance

    def measure(self) -> str:
        """The row's worst error against its tolerance, or its margin against the threshold."""
        if self.margin is not None:
            return f"margin {self.margin:.2e} vs {self.tolerance:.2e}" if self.tolerance else \
                f"margin {self.margin:.2e}"
        if self.error is not None and self.tolerance is not None:
            return f"{self.error:.2e} {'>' if self.error > self.tolerance else '<='} {self.tolerance:.2e}"
        return "" if self.error is None else f"{self.error:.2e}"

    def numbers(self) -> str:
        """The measure, then [the regime that judged it]."""
        return " ".join(filter(None, [self.measure(), f"[{self.regime}]" if self.regime else ""]))

    def text(self) -> str:
        """The row in one line, as `kdtree validate` prints it: status, section::name, numbers, detail."""
        return "  ".join(filter(None, (self.status.value, f"{self.section}::{self.name}", self.numbers(),
                                       self.detail)))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status.value}


@dataclass
class Report:
    """The rows of one run. implementation: the adapter's own name for itself; adapter: its class
    (module.qualname, the runner's); impl: the `--impl` spec it was loaded from (None: the
    built-in engine). versions (kdtree, python, numpy, torch, cuda), commit (the kdtree
    checkout's `git describe`, None when unknown), device_name and timings (seconds: total and per
    step) describe the run; the CLI fills them and impl. section_seconds: the seconds each
    section's checks took (the runner's)."""

    implementation: str
    device: str
    fixtures: str
    adapter: str = ""
    impl: str | None = None
    backends: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    commit: str | None = None
    device_name: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    deviations: dict[str, list[Any]] = field(default_factory=dict)   # fixture -> [Deviation] (judging/deviations.py)
    section_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def executed(self) -> int:
        """Rows that compared something (not skipped)."""
        return sum(c.status is not Status.SKIPPED for c in self.checks)

    @property
    def failed(self) -> bool:
        return self.executed == 0 or any(c.status is Status.FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    def summary(self) -> str:
        counts = self.counts()
        verdict = "FAILED" if self.failed else "PASSED"
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"
        ran = "; no check ran" if self.executed == 0 else ""
        return f"{verdict}: {len(self.checks)} check{'' if len(self.checks) == 1 else 's'} ({parts}){ran}"

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "adapter": self.adapter, "impl": self.impl,
                "device": self.device, "device_name": self.device_name,
                "fixtures": self.fixtures, "backends": self.backends, "versions": self.versions,
                "commit": self.commit, "timings": self.timings, "section_seconds": self.section_seconds,
                "passed": not self.failed,
                "counts": self.counts(), "summary": self.summary(), "checks": [c.to_dict() for c in self.checks],
                "deviations": {f: [d.to_dict() for d in ds] for f, ds in self.deviations.items()}}


def json_bytes(report: Any) -> bytes:
    """A Report (or anything with to_dict(), e.g. a divergence) as JSON."""
    return json.dumps(report.to_dict(), indent=2, allow_nan=True).encode()


def write_json(report: Any, path: str | os.PathLike) -> None:
    """json_bytes at `path`, written all or nothing with the user's umask."""
    with atomic_output(path) as file:
        file.write(json_bytes(report))
