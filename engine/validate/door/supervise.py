"""`kdtree validate`'s supervisor: the checking (the runner and the adapter under test) runs in
a child process, so that whatever the adapter does, a report is shown and written and the
exit status says why.

    run = supervise(job, timeout=CALL_TIMEOUT_S, target=child, log=print)
    run.returned or run.stopped

The child runs target(send, job): the validation (run/isolated.py), which tells
the parent its log, the start and end of every stretch of the adapter's code (its import, its
factory, each method call) and each section's rows as it finishes; what target returns (the
CLI's: the exit status, the report drawn for the parent's console, a report for stdout) is
`run.returned`. An exception in the child is raised here, as if it had happened here (bad
input stays bad input). The parent ends the run early and makes the report itself,
`run.stopped` (stopped_report: the rows so far, a FAIL row for the row in flight,
the rest "not run"), when

- a call outlives `timeout` seconds: the child is killed, and the row reads
  `topk_logprobs() did not return within 300 s (case budget0); nothing after it ran`;
- the child ends without returning (os._exit, a crash, a signal): `forward() ended the
  process with exit status 0`, or `... with signal SIGSEGV`. Its end is read from its exit
  status, not from the pipe, which a process the adapter started may still hold open.

Before the checking starts (the adapter's import, factory and set_dtype) either is bad input,
a CliError naming --impl and the call. The child ignores SIGINT from its start (the signal is
held blocked while it starts, so that a Ctrl-C in that moment still reaches the parent): Ctrl-C
is the parent's to answer (KeyboardInterrupt here): the parent sends the child SIGTERM, which the
child raises as KeyboardInterrupt where it stands (its cleanups run; it exits 130), and kills
it after STOP_S. A child that lingers after
it returned (a thread of the adapter's) is killed after GRACE_S.

The child is forked: it starts at once, with what this process has imported, and imports the
engine itself (the CLI's parent imports neither torch nor the engine, so nothing is imported
twice). Where CUDA is initialized in this process, which a fork cannot take along, it is
spawned instead (target and job are then pickled). The messages that hold the engine's
objects travel as pickled bytes, loaded only to make a stopped run's report.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable, Iterator

from kdtr_format.clikit import CliError

from ..reports.files import ReportFiles
from ..reports.report import Check, Report, Status

CALL_TIMEOUT_S = 300.0      # far beyond any call of a real engine on the committed fixtures
GRACE_S = 5.0               # a child's time to exit after it returned
STOP_S = 2.0                # a child's time to stop on Ctrl-C (SIGTERM) before it is killed
POLL_S = 0.2                # how often a silent child is looked at (alive? its call too long?)

Send = Callable[[tuple], None]


@dataclass(frozen=True)
class ValidateJob:
    """What the child validates (engine.validate.Validation's arguments; impl: the adapter's
    --impl spec, None for the built-in engine) and where its report goes: the --json, --junit-xml
    and --html files, which the child writes staged and the parent publishes (reports/files.py)."""

    impl: str | None
    fixtures: Path | None
    device: str
    dtype: str
    require: str
    invariant: bool
    page_size: int | None
    reports: ReportFiles = field(default_factory=ReportFiles)
    console: dict[str, Any] = field(default_factory=dict)    # rich.Console's arguments: the parent's terminal


@dataclass
class Supervised:
    """How a supervised run ended: what target returned (None when the run was stopped), or the
    report the parent made of a run that ended early."""

    returned: Any = None
    stopped: Report | None = None


@dataclass
class _Run:
    """What the parent knows of the child's run so far."""

    calls: list[tuple[str, tuple[str, str, str] | None, float]] = field(default_factory=list)
    plan: bytes | None = None                       # pickled (the report's header, each section's row names)
    rows: dict[str, bytes] = field(default_factory=dict)     # each finished section's pickled (rows, header)
    section: str | None = None


def supervise(job: ValidateJob, timeout: float, target: Callable[[Send, ValidateJob], Any],
              log: Callable[[str], None]) -> Supervised:
    """target(send, job) in a watched child (module docstring). log: told each line of the
    child's log as it comes."""
    context = multiprocessing.get_context(_start_method())
    here, there = context.Pipe()
    process = context.Process(target=_child, args=(there, job, target), name="kdtree-validate")
    with _sigint_held(process):
        process.start()
    there.close()
    try:
        _release_sigint()                # a Ctrl-C held while the child started is raised here
        return _watch(job, process, here, timeout, log)
    except KeyboardInterrupt:            # Ctrl-C: the child stops (its finally blocks run), else is killed
        process.terminate()
        process.join(STOP_S)
        process.kill()
        raise
    except BaseException:                # the child's error: the child goes now
        process.kill()
        raise
    finally:
        here.close()
        process.join(GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _start_method() -> str:
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    return "fork" if not cuda and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _can_hold_sigint() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")


@contextmanager
def _sigint_held(process: BaseProcess) -> Iterator[None]:
    """SIGINT blocked (held pending, not lost) while the child starts: the child is born with it
    blocked and ignores it before letting it through (`_child`); the parent's is raised by
    `_release_sigint` once the child can be stopped. If the start fails, it is released here."""
    if not _can_hold_sigint():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    except BaseException:
        _release_sigint()
        raise


def _release_sigint() -> None:
    """Unblock SIGINT: one held while the child started is raised now, as KeyboardInterrupt."""
    if _can_hold_sigint():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _child(conn: Connection, job: ValidateJob, target: Callable[[Send, ValidateJob], Any]) -> None:
    """The child process: what target returns, or its exception, to the parent. What the child
    prints goes to stderr: stdout is the parent's. A Ctrl-C that reaches it (an adapter that
    handles SIGINT again) ends it quietly with status 130: the parent answers it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)         # a Ctrl-C held since its birth is dropped here
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, _stop)
    os.dup2(2, 1)
    try:
        conn.send(("done", target(conn.send, job)))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:
        conn.send(("raised", _portable(exc)))


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM in the child: the parent's Ctrl-C, raised where the child is (its finally blocks run:
    a materialization in progress removes its staging directory, fixture_cache.py)."""
    raise KeyboardInterrupt


def _portable(exc: Exception) -> Exception:
    """exc with its traceback as a note, or a RuntimeError saying as much when it does not pickle."""
    where = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__} in the checking process (it does not pickle)")
    exc.add_note(f"in the checking process:\n{where}")
    return exc


def _watch(job: ValidateJob, process: BaseProcess, conn: Connection, timeout: float,
           log: Callable[[str], None]) -> Supervised:
    run = _Run()
    while True:
        if not conn.poll(POLL_S):
            if process.exitcode is not None:       # gone, though a process it left may hold the pipe open
                return _stopped(job, run, _ended(process.exitcode))
            if run.calls and time.monotonic() >= run.calls[-1][2] + timeout:
                process.kill()
                return _stopped(job, run, f"did not return within {timeout:g} s")
            continue
        try:
            kind, *body = conn.recv()
        except EOFError:
            process.join()
            return _stopped(job, run, _ended(process.exitcode))
        if kind == "log":
            log(body[0])
        elif kind == "call":
            run.calls.append((body[0], body[1], body[2]))
        elif kind == "return":
            run.calls.pop()
        elif kind == "plan":
            run.plan = body[0]
        elif kind == "section":
            run.section = body[0]
        elif kind == "rows":
            run.rows[body[0]] = body[1]
        elif kind == "done":
            return Supervised(returned=body[0])
        else:                                      # "raised": the child's exception, raised here
            raise body[0]


def _ended(exitcode: int | None) -> str:
    """How the child ended, as the rest of "forward() ..." reads."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"ended the process with signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"ended the process with signal {-exitcode}"
    return f"ended the process with exit status {exitcode}"


def _stopped(job: ValidateJob, run: _Run, how: str) -> Supervised:
    """The report of a run that ended early; before the checking started, the CliError."""
    label, row, _ = run.calls[-1] if run.calls else (None, None, 0.0)
    if run.plan is None:
        if label is None:
            raise RuntimeError(f"the run {how} before the checking started")
        raise CliError(f"--impl {job.impl}: {label} {how}" if job.impl else f"{label} {how}")
    header, cases = pickle.loads(run.plan)
    rows = {}
    for section, blob in run.rows.items():
        rows[section], header = pickle.loads(blob)
    return Supervised(stopped=stopped_report(header, cases, rows, run.section, label, row, how))


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
