"""A run's report files (`--json`, `--junit-xml`, `--html`), none of which may claim a verdict
the run did not reach: each is written under a staged name beside its target, and moved into
place only once the run has finished and exits with its verdict.

    files = ReportFiles((json_path, junit_path, html_path))    # each a path, "-" (stdout) or None
    with files:                        # on the way out, whatever was staged and not published goes
        files.write(report)            # in this process or another (the same token names the same files)
        files.publish(wrote)           # the verdict: from here to the exit, Ctrl-C is ignored

- `publish` starts by ignoring SIGINT, and SIGINT stays ignored until the process exits: a Ctrl-C
  that came before raises KeyboardInterrupt from that first step (Python runs a pending handler
  before it changes one), so no Ctrl-C slips between the last check and the moves, and none after
  them turns a finished run into an interrupted one whose files are in place. Ctrl-C at any
  earlier moment (before, during or after the checks, while the reports are written) leaves no
  report file: the staged ones are removed on the way out (`with files:`), exit 130.
- A staged file is `.<name>.<token>.kdtree.tmp` beside the target (a symbolic link's target,
  which the move then replaces); the report named "-" is staged in the temporary directory and
  copied onto stdout by `publish`. The staged names are known before anything is written, so a
  writer killed half-way (the supervised child, on Ctrl-C) leaves nothing the parent cannot remove.
- A file that cannot be written is an OSError naming the user's path, raised by `write` after the
  checks (the terminal report is shown first), and no report is published.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from kdtr_format import atomic

from .junit import junit_bytes
from .report import Report, json_bytes

STDOUT = "-"                               # a report file named so goes to stdout
FORMS = ("json", "junit", "html")          # the order of ReportFiles.paths


def report_bytes(report: Report, form: str) -> bytes:
    """The report as JSON, JUnit XML or HTML (the HTML needs matplotlib)."""
    if form == "json":
        return json_bytes(report)
    if form == "junit":
        return junit_bytes(report)
    from .html import to_html

    return to_html(report).encode()


@dataclass(frozen=True)
class ReportFiles:
    """The (json, junit, html) report paths of one run, each a path, "-" or None (module docstring)."""

    paths: tuple[Path | str | None, ...] = (None, None, None)
    token: str = field(default_factory=lambda: secrets.token_hex(8))

    def named(self) -> Iterator[tuple[str, Path | str]]:
        """(form, path) of each report asked for."""
        return ((form, path) for form, path in zip(FORMS, self.paths) if path is not None)

    def staged(self, path: Path | str) -> Path:
        """Where `path`'s report is written before it is published."""
        if path == STDOUT:
            return Path(tempfile.gettempdir()) / f"kdtree-stdout-report.{self.token}.tmp"
        directory, name = os.path.split(atomic.target_of(os.fspath(path)))
        suffix = f".{self.token}.kdtree.tmp"
        room = atomic.name_limit(directory) - len(f".{suffix}".encode())
        short = name.encode("utf-8", "surrogateescape")[:max(room, 1)].decode("utf-8", "ignore")
        return Path(directory) / f".{short}{suffix}"

    def write(self, report: Report) -> None:
        """Each report at its staged path (new files, the user's umask, synced); OSError naming the
        user's path when one cannot be written."""
        for form, path in self.named():
            data = report_bytes(report, form)
            staged = self.staged(path)
            try:
                fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
            except OSError as exc:
                raise OSError(exc.errno, f"cannot write the {form} report: {exc.strerror or exc}",
                              os.fspath(path)) from None

    def publish(self, wrote: Callable[[Path], Any] = lambda path: None) -> None:
        """The run's verdict is final: SIGINT ignored from here to the exit (KeyboardInterrupt for a
        Ctrl-C that came first), each staged report moved onto its path (wrote(path) told), the one
        named "-" copied onto stdout."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for _, path in self.named():
            if path == STDOUT:
                continue
            target = atomic.target_of(os.fspath(path))
            try:
                os.replace(self.staged(path), target)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot write the report: {exc.strerror or exc}", os.fspath(path)) from None
            with contextlib.suppress(OSError):          # the rename survives a crash (as atomic_output's)
                directory = os.open(os.path.dirname(target) or ".", os.O_RDONLY)
                try:
                    os.fsync(directory)
                finally:
                    os.close(directory)
            wrote(Path(path))
        for _, path in self.named():
            if path == STDOUT:
                sys.stdout.buffer.write(self.staged(path).read_bytes())
                sys.stdout.buffer.flush()

    def discard(self) -> None:
        """Remove every staged report that is still there."""
        for _, path in self.named():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.staged(path))

    def __enter__(self) -> ReportFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
