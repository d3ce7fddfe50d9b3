"""A page loaded in headless Chromium, driven through the DevTools protocol over a pipe.

`--remote-debugging-pipe`: Chromium reads commands on its fd 3 and writes replies and
events on its fd 4, each message one JSON object ending in a NUL byte. `load(url)` opens
the page in a fresh profile, waits for its load event and returns a `Page`: every event
seen (console calls, exceptions, log entries, network requests) and `evaluate` /
`screenshot` on the loaded page. Debian's package installs the browser as /usr/bin/chromium.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1280,900"]
TIMEOUT = 60.0


class Page:
    def __init__(self, process: subprocess.Popen, commands: int, replies: int) -> None:
        self.process, self.commands, self.replies = process, commands, replies
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None
        self._buffer, self._next = b"", 0

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One command's result (in the page's session once attached); RuntimeError on an error reply."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        reply = self.wait(lambda m: m.get("id") == self._next)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def wait(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read messages (keeping events) until one is wanted; TimeoutError after TIMEOUT seconds."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if wanted(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.process.poll()})")
            self._buffer += chunk

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate: {result['exceptionDetails']}")
        return result["result"]["value"]

    def screenshot(self, path: Path, width: int = 1280, height: int = 900) -> Path:
        """The top of the page, width x height CSS pixels, as a PNG."""
        shot = self.send("Page.captureScreenshot", format="png",
                         clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def named(self, method: str) -> list[dict[str, Any]]:
        return [e["params"] for e in self.events if e["method"] == method]


def load(url: str) -> tuple[Page, Callable[[], None]]:
    """(the loaded page, close): Chromium with a new profile, the page's events recorded from the start."""
    profile = tempfile.TemporaryDirectory(prefix="kdtree-chromium-")
    to_chromium, commands = os.pipe()
    replies, from_chromium = os.pipe()

    def pipes() -> None:                   # in the child: its fd 3 reads commands, fd 4 writes replies
        os.dup2(to_chromium, 3)
        os.dup2(from_chromium, 4)

    process = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile.name}", "about:blank"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               pass_fds=(3, 4), preexec_fn=pipes)
    os.close(to_chromium)
    os.close(from_chromium)
    page = Page(process, commands, replies)

    def close() -> None:
        try:
            page.session = None
            page.send("Browser.close")
            process.wait(timeout=20)
        except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
        finally:
            os.close(commands)
            os.close(replies)
            profile.cleanup()

    try:
        target = page.send("Target.createTarget", url="about:blank")["targetId"]
        page.session = page.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Page.navigate", url=url)
        page.wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == page.session)
    except BaseException:
        close()
        raise
    return page, close
