"""One engine server on 127.0.0.1: started in its own process group, waited for (bounded), stopped
by its PID.

    with Server(command, env, log_path, port, started_within=300) as server:
        server.url                       # http://127.0.0.1:<port>, answering
        server.alive()                   # False once the process has exited

Stopping: SIGTERM to the server's process group (the server and the workers it forked), SIGKILL
to that group after STOP_S. The group is the server's own (start_new_session), so nothing else
is signalled. The runner stops every server it started on any exit: the `with` block, and
SIGTERM / SIGINT turned into SystemExit (install_signal_exit).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

EXCEPTION = re.compile(r"(^|\s)[A-Z]\w*(Error|Exception)(: |$)")    # "RuntimeError: ...", "AssertionError"
STOP_S = 30.0                   # seconds between SIGTERM and SIGKILL
POLL_S = 2.0


class StartError(Exception):
    """A server that exited or did not answer in time; the message is one line and names its log."""


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def install_signal_exit() -> None:
    """SIGTERM and SIGINT raise SystemExit, so that `with Server(...)` blocks stop their servers."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)


class Server:
    """A server process (module docstring). ready_path: a GET path that answers 200 once the server
    serves (vLLM and llama-server: /v1/models)."""

    def __init__(self, command: list[str], env: Mapping[str, str], log_path: Path, port: int,
                 started_within: float, ready_path: str = "/v1/models") -> None:
        self.command, self.env, self.log_path, self.port = command, dict(env), log_path, port
        self.started_within, self.ready_path = started_within, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> Server:
        began = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while not self._answers():
                if not self.alive():
                    raise StartError(f"the server exited ({self.process.returncode}) before answering: "
                                     f"{self.last_error()} (log: {self.log_path})")
                if time.monotonic() - began > self.started_within:
                    raise StartError(f"the server did not answer {self.ready_path} within {self.started_within:g} s "
                                     f"(log: {self.log_path})")
                time.sleep(POLL_S)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_S; waits for the server."""
        if self.process is None:
            return
        group = self.process.pid                 # start_new_session: the group's id is the server's pid
        for signum, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, STOP_S)):
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
                time.sleep(0.5)                  # workers leave after their parent
                os.killpg(group, 0)             # anyone left in the group?
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.process.poll()

    def last_error(self) -> str:
        """The log's first line naming an exception (the root cause comes before the errors it
        causes), else its last line, shortened."""
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        errors = [line for line in lines if EXCEPTION.search(line) and "WARNING" not in line]
        line = (errors[:1] or lines[-1:] or ["empty log"])[0]
        return line if len(line) <= 240 else line[:237] + "..."

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

