"""The `speculation` row of a `--server` run: what the server says it drafted and accepted over the
run (its /metrics counters, engine/serving/speculation.py, read before the first request and
after the last), and with --require-speculation a FAIL when that is nothing.

    counters = PublishedSpeculation(url, timeout)        # before the run's first request
    ...                                                  # the run
    rows += counters.rows(section, required)             # [] or [the row]

A speculative server whose drafts never run, or whose every draft is rejected, serves the tokens
it serves without speculation: its token rows pass and say nothing about its speculative path.
This row tells such a run from one that exercised it:

- no counters published (no /metrics page, none of the counters on it, or a server not reached
  over HTTP): no row; required, FAIL;
- the counters could not be read (an HTTP error, a malformed page, a counter that went down):
  a skipped row with the reason; required, FAIL;
- zero drafts over the run, or drafts and zero accepted tokens (where the server publishes
  accepted tokens: vLLM): a row that says so; required, FAIL;
- otherwise a row with the counts (drafts, draft tokens, accepted, by draft position).

The counts are the server's over the run, whoever sent the requests: a server shared with
other traffic counts theirs too.
"""

from __future__ import annotations

from typing import Callable

from ...serving import ServerError
from ...serving.speculation import Speculation, read_counters
from ..reports.report import Check, Status

ROW = "speculation"
NONE_PUBLISHED = ("--require-speculation: the server publishes no speculative-decoding counters (vLLM: /metrics "
                  "of a server started with --speculative-config; SGLang: sglang:spec_verify_calls), so nothing "
                  "shows that it speculated")


class PublishedSpeculation:
    """A server's counters at the start of a run, and the row of what they count after it."""

    def __init__(self, url: str, timeout: float, read: Callable[[], Speculation | None] | None = None) -> None:
        """read: the counters now, where they are not a server's /metrics (an in-process engine's own tally)."""
        self.url, self.timeout, self.read = url, timeout, read
        self.before = self._read()

    def rows(self, section: str, required: bool) -> list[Check]:
        """The run's speculation row (module docstring), as a list of none or one."""
        used = self._used()
        if used is None:
            return [Check(section, ROW, Status.FAIL, detail=NONE_PUBLISHED)] if required else []
        if isinstance(used, str):
            return [Check(section, ROW, Status.FAIL if required else Status.SKIPPED,
                          detail=f"the speculation counters could not be read: {used}")]
        table = {"speculation": used.as_dict()}
        counted = f"{used.engine}: {used.line()} over the run"
        if used.drafts == 0:
            missing = "the server drafted nothing, so its speculative path did not run"
        elif used.accepted == 0:
            missing = "the server accepted no draft token, so no draft was ever committed"
        else:
            return [Check(section, ROW, Status.EXACT, detail=counted, tables=table)]
        if required:
            return [Check(section, ROW, Status.FAIL, detail=f"--require-speculation: {counted}: {missing}",
                          tables=table)]
        return [Check(section, ROW, Status.EXACT, detail=f"{counted}: {missing}", tables=table)]

    def _read(self) -> Speculation | str | None:
        """The counters now; None: none published; a str: why they could not be read."""
        if self.read is not None:
            return self.read()
        if not self.url.startswith(("http://", "https://")):
            return None
        try:
            return read_counters(self.url, self.timeout)
        except ServerError as exc:
            return str(exc)

    def _used(self) -> Speculation | str | None:
        """The counts over the run (after less before), None or why not, as _read."""
        after = self._read()
        if isinstance(self.before, str) or after is None or isinstance(after, str):
            return self.before if isinstance(self.before, str) else after
        try:
            return after.since(self.before)
        except ServerError as exc:
            return str(exc)
