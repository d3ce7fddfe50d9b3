"""Running the CLIs as people do: in a pseudo-terminal of a given width, and piped.

    result = in_terminal(["kdtr", "inspect", path], columns=80)
    result.widest                       # the longest line the terminal shows
    result = piped(["kdtr", "inspect", path])
    assert_clean_error(result)          # non-zero exit, one line, no traceback

`in_terminal` gives the child a real tty on stdin, stdout and stderr (so rich,
click and progress bars take their interactive paths), sets the window size,
and collects everything the child writes. `interrupt_on` sends Ctrl-C (SIGINT to
the child's process group, as a terminal does) once that text has appeared.
The commands run with this checkout first on PYTHONPATH, so the code under test
is this tree's, whatever is installed.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"kdtr": "kdtr_format", "refgen": "refgen", "kdtree": "engine"}
_COLOUR = re.compile(r"\x1b\[[0-9;]*m|\x1b\[\?[0-9;]*[hl]|\x1b\][^\x07]*\x07")   # SGR, cursor show/hide, titles
_LINE_BREAK = re.compile(r"\r\n|\n|\r|\x1b\[[0-9;]*[ABCDEFGHJK]")   # new line, cursor moves, erase


@dataclass
class Result:
    returncode: int
    output: str            # stdout and stderr together (a terminal shows both)
    stdout: str = ""       # piped runs only
    stderr: str = ""

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.replace("\r\n", "\n").splitlines() if line.strip()]

    @property
    def screen_lines(self) -> list[str]:
        """The text as a terminal shows it, line by line: colours dropped, and a new line at every
        carriage return or cursor move (progress bars redraw in place)."""
        text = _COLOUR.sub("", self.output)
        return [line for line in _LINE_BREAK.split(text) if line.strip()]

    @property
    def widest(self) -> int:
        """The longest screen line, in characters (0 for no output)."""
        return max(map(len, self.screen_lines), default=0)


def command(argv: list[str]) -> list[str]:
    """`kdtr ...` / `refgen ...` / `kdtree ...` as `python -m <package> ...`."""
    name, *rest = argv
    return [sys.executable, "-m", COMMANDS.get(name, name), *rest]


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    for var in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM"):
        env.pop(var, None)
    env["TERM"] = "xterm-256color"
    env.update(extra or {})
    return env


def in_terminal(argv: list[str], columns: int = 80, rows: int = 24, timeout: float = 120.0,
                cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                interrupt_on: str | None = None) -> Result:
    """Run argv in a pseudo-terminal `columns` wide; -> exit status and all output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    process = subprocess.Popen(command(argv), stdin=slave, stdout=slave, stderr=slave, cwd=cwd or REPO,
                               env=environment(env), start_new_session=True, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    interrupted = interrupt_on is None
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                raise TimeoutError(f"{' '.join(argv)} did not finish in {timeout:.0f} s; output so far:\n"
                                   + b"".join(chunks).decode(errors="replace"))
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:          # EIO: the child closed the terminal
                    data = b""
                if not data:
                    break
                chunks.append(data)
                if not interrupted and interrupt_on in b"".join(chunks).decode(errors="replace"):
                    os.killpg(process.pid, signal.SIGINT)
                    interrupted = True
            elif process.poll() is not None and not select.select([master], [], [], 0.2)[0]:
                break
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return Result(returncode, b"".join(chunks).decode(errors="replace"))


def piped(argv: list[str], timeout: float = 120.0, cwd: str | os.PathLike | None = None,
          env: dict[str, str] | None = None, stdin: str = "") -> Result:
    """Run argv with stdin, stdout and stderr on pipes (a script, CI, `| less`)."""
    run = subprocess.run(command(argv), input=stdin, capture_output=True, text=True, timeout=timeout,
                         cwd=cwd or REPO, env=environment(env))
    return Result(run.returncode, run.stdout + run.stderr, run.stdout, run.stderr)


def assert_clean_error(result: Result, mentions: str | None = None) -> None:
    """A bad input's answer: a non-zero exit, no traceback, one error line (naming `mentions`)."""
    assert result.returncode != 0, f"exit 0 on bad input; output:\n{result.output}"
    assert "Traceback" not in result.output, f"a traceback:\n{result.output}"
    errors = [line for line in result.lines if "error" in line.lower()]
    assert len(errors) == 1, f"expected one error line, got:\n{result.output}"
    if mentions is not None:
        assert mentions in errors[0], f"the error does not name {mentions!r}:\n{result.output}"
