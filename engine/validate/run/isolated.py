"""`kdtree validate`'s checking in a watched child process (the supervisor, door/supervise.py):
the run, told to the parent as it goes (`serve`); the parent makes the report of a run that
ended early (supervise.stopped_report).

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

import pickle
import time
from typing import TYPE_CHECKING, Callable

from ..door import guard
from ..door.load import load_impl
from ..reports.report import Report, ValidateError
from .runner import Validation, prepare_device

if TYPE_CHECKING:
    from ..door.supervise import Send, ValidateJob


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
