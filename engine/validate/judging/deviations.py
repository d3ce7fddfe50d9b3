"""Known deviations: what an adapter declares about where its engine differs from the
reference semantics, and how the report shows it.

An adapter may define ``deviations() -> Sequence[Deviation]``. The runner calls it
after a model fixture's checks, while the adapter still holds that fixture's
weights, so the list may depend on the config (a latent-norm eps that differs only
when the config's convention does). Each declared deviation is appended to the
detail of every row it names (its name and effect), and the report carries the
full declarations per fixture (`Report.deviations`, printed below the table and
written to the JSON). A declaration never changes a row's status or tolerance: a FAIL stays a
FAIL, and the note says what may explain it.

``effect`` is the size of the deviation as the adapter measured it (for the HF
adapter: the largest |logit| change when that one difference is lifted, on the
probe ``measured_on`` describes); None when not measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..reports.report import Check, Report, Status


@dataclass(frozen=True)
class Deviation:
    """One declared difference from the reference semantics. rows: the report rows it
    affects (check names, e.g. "prefill logits"); effect: its measured size."""

    name: str
    rows: tuple[str, ...]
    description: str
    effect: float | None = None
    measured_on: str = ""

    def brief(self) -> str:
        """The deviation as a row names it: its name and effect."""
        return self.name if self.effect is None else f"{self.name} ({self.effect:.1e})"

    def line(self) -> str:
        """The deviation in full: name, what differs, effect and what it was measured on."""
        size = "" if self.effect is None else f" (effect {self.effect:.2e}, {self.measured_on})"
        return f"{self.name}: {self.description}{size}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rows": list(self.rows)}


def declared_deviations(adapter: Any) -> list[Deviation]:
    """The adapter's declaration (empty without a `deviations` method); anything but
    Deviation items is a TypeError naming the method."""
    method = getattr(adapter, "deviations", None)
    if not callable(method):
        return []
    declared = list(method())
    wrong = [type(d).__name__ for d in declared if not isinstance(d, Deviation)]
    if wrong:
        raise TypeError(f"deviations(): expected engine.validate.Deviation items, got {wrong[0]}")
    return declared


def with_deviations(report: Report, adapter: Any, checks: list[Check], section: str) -> list[Check]:
    """A fixture's rows with the adapter's declared deviations noted on the rows they name;
    the declaration is recorded in report.deviations[section]."""
    declared = declared_deviations(adapter)
    if declared:
        report.deviations[section] = declared
    noted = []
    for check in checks:
        named = [d.brief() for d in declared if check.name in d.rows]
        if named and check.status is not Status.SKIPPED:
            note = f"known deviations: {', '.join(named)}"
            check = dataclasses.replace(check, detail=f"{check.detail}; {note}" if check.detail else note)
        noted.append(check)
    return noted
