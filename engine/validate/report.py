"""The report: one `Check` row per comparison, a `Report` of rows, and its JSON form.

A row's status is one of exact, within tolerance, near-tie (a token divergence at a
decision whose reference margin is below the fixture's threshold), skipped, FAIL.
The report fails when any row is FAIL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ValidateError(Exception):
    """Bad input to the runner (missing fixtures, a fixture that contradicts its preset)."""


class Status(str, Enum):
    EXACT = "exact"
    WITHIN = "within tolerance"
    NEAR_TIE = "near-tie"
    SKIPPED = "skipped"
    FAIL = "FAIL"


_SEVERITY = {Status.SKIPPED: 0, Status.EXACT: 1, Status.WITHIN: 2, Status.NEAR_TIE: 3, Status.FAIL: 4}


@dataclass
class Check:
    """One row of the report. error / tolerance: the worst element's |actual - expected| and
    its tolerance (floats); margin: the reference's top1 - top2 logit gap at a token divergence;
    regime: the tolerance regime that judged it and its numbers (engine/validate/regime.py)."""

    section: str
    name: str
    status: Status
    error: float | None = None
    tolerance: float | None = None
    margin: float | None = None
    detail: str = ""
    regime: str = ""

    @property
    def ratio(self) -> float:
        if self.error is None or not self.tolerance:
            return 0.0 if not self.error else float("inf")
        return self.error / self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status.value}


@dataclass
class Report:
    implementation: str
    device: str
    fixtures: str
    backends: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    def summary(self) -> str:
        counts = self.counts()
        verdict = "FAILED" if self.failed else "PASSED"
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"{verdict}: {len(self.checks)} checks ({parts})"

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "device": self.device, "fixtures": self.fixtures,
                "backends": self.backends, "passed": not self.failed, "counts": self.counts(),
                "summary": self.summary(), "checks": [c.to_dict() for c in self.checks]}


def write_json(report: Any, path: str | os.PathLike) -> None:
    """A Report (or anything with to_dict(), e.g. a divergence) as JSON, written atomically
    (a temporary file, then a rename)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValidateError(f"--json {path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report.to_dict(), f, indent=2, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
