"""`kdtree validate`'s checking in a watched child process (engine/supervise.py): the run, told
to the parent as it goes (`serve`), and the report the parent makes of a run that ended early
(`stopped_report`).

What the child tells the parent, in order (send, a multiprocessing connection's):

    ("log", line)                    a line of the runner's log (a section starts)
    ("call", label, row, began)      the adapter's code starts running: label "forward()" or
                                     "importing x.py"; row (section, name, where) of the row in
                                     flight, None outside any row's checks; began: time.monotonic()
    ("return",)                      ... and is done
    ("plan", pickled)                set up: (the report's header, each section's row names in
                                     report order)
    ("section", name)                a section's checks start
    ("rows", name, pickled)          (its rows, the header so far: deviations, seconds)

The engine's objects travel pickled, so that the parent loads them (and the engine) only to
report a run that ended early.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import TYPE_CHECKING, Callable

from . import guard
from .protocol import load_impl
from .report import Check, Report, Status, ValidateError
from .runner import Validation, prepare_device

if TYPE_CHECKING:
    from ..supervise import Send, ValidateJob


def serve(send: Send, job: ValidateJob, log: Callable[[str], None]) -> Report:
    """The job's validation, told to the parent as it goes (module docstring) -> its report.
    log: told the runner's log here too (to time its steps)."""
    def watch(label: str | None, row: guard.Row | None) -> None:
        where = None if row is None else (row.section, row.name, row.where)
        send(("call", label, where, time.monotonic()) if label is not None else ("return",))

    def told(line: str) -> None:
        log(line)
        send(("log", line))

    with guard.watching(watch):
        prepare_device(job.device)
        try:
            adapter = load_impl(job.impl) if job.impl else None
        except ValueError as exc:                  # load_impl names the spec and what went wrong
            raise ValidateError(str(exc)) from None
        validation = Validation(adapter, job.fixtures, job.device, log=told, require=job.require,
                                invariant=job.invariant, dtype=job.dtype, page_size=job.page_size)
        sections = validation.report_sections()
        cases = {name: [case.name for case in validation.sections[name].cases if validation.skip_reason(case) is None]
                 for name in sections}
        send(("plan", pickle.dumps((validation.header(), cases))))
        for name in sections:
            send(("section", name))
            send(("rows", name, pickle.dumps((validation.rows(name), validation.header()))))
        return validation.report()


def stopped_report(header: Report, cases: dict[str, list[str]], rows: dict[str, list[Check]], section: str | None,
                   label: str | None, row: tuple[str, str, str] | None, how: str) -> Report:
    """The report of a run that ended early: the rows of the sections that finished, a FAIL row
    for the row in flight (row: its section, name and where; None: the section's "fixture" row)
    naming the adapter's code that was running (label; None: none was) and `how` it ended, and
    every other row of the plan skipped as not run."""
    section, name, where = row if row is not None else (section or "validate", "fixture", "")
    what = f"{label} {how}" if label is not None else f"the run {how}, outside the adapter's calls"
    stop = Check(section, name, Status.FAIL, detail=f"{what}{f' ({where})' if where else ''}; nothing after it ran")
    not_run = f"not run: the run stopped at {section}::{name}"
    checks: list[Check] = []
    for part, names in cases.items():
        if part in rows:
            checks += rows[part]
            continue
        if part == section:
            checks.append(stop)
        checks += [Check(part, n, Status.SKIPPED, detail=not_run) for n in names if (part, n) != (section, name)]
    if stop not in checks:                    # stopped after the last section's rows
        checks.append(stop)
    return dataclasses.replace(header, checks=checks)
