"""What a server says about its speculative decoding: its Prometheus counters, read before and
after a run, differenced.

    before = read_counters("http://127.0.0.1:8000", timeout=10)   # None: publishes none
    ...                                                             # the run
    used = read_counters(...).since(before)                        # a Speculation
    used.drafts, used.draft_tokens, used.accepted, used.accepted_per_position

GET /metrics (Prometheus' text format, parsed by prometheus_client). The counters read, each
summed over its label sets (a server with several engines publishes one per engine):

- vLLM (v1): `vllm:spec_decode_num_drafts` (draft rounds), `..._num_draft_tokens`,
  `..._num_accepted_tokens`, and `..._num_accepted_tokens_per_pos` by its `position` label
  (accepted tokens at draft position 0, 1, ...). llama-server (started with `--metrics`)
  publishes the same four under `llamacpp:` (its drafts: verification steps).
- SGLang: `sglang:spec_verify_calls` (verify rounds: one draft each). SGLang publishes its
  acceptance as gauges of the last interval only (`sglang:spec_accept_length`, `_rate`), which
  no difference over a run can use: draft tokens and accepted are unknown (None) there.

A server whose page names none of these counters publishes nothing about speculation (vLLM
without `--speculative-config` registers none): `read_counters` returns None. Every failure to
read (refused, an HTTP error other than 404, a page that is not Prometheus' format, a counter
that went down between the readings: a restarted server) is a `ServerError` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

from .client import Client, ServerError, _excerpt
from .transport import HttpStatusError

# vLLM's counters (its samples are <prefix><name>_total) -> the field each adds to; the engines
# that publish them, by prefix
SPEC_DECODE = {"spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
               "spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
PREFIXES = {"vllm:": "vLLM", "llamacpp:": "llama.cpp"}
SGLANG_VERIFY_CALLS = "sglang:spec_verify_calls"


@dataclass(frozen=True)
class Speculation:
    """Speculative-decoding counts: totals as read, or (`since`) over a run. None: the server
    does not publish that count. accepted_per_position[i]: accepted tokens at draft position i."""

    engine: str
    drafts: int
    draft_tokens: int | None = None
    accepted: int | None = None
    accepted_per_position: tuple[int, ...] | None = None

    def since(self, before: Speculation | None) -> Speculation:
        """These counts less `before`'s (None: the server published none then, so from zero).
        ServerError when a count went down (the server restarted between the readings)."""
        if before is None:
            return self
        if before.engine != self.engine:
            raise ServerError(f"GET /metrics: {before.engine}'s counters before the run, {self.engine}'s after "
                              "(another server answers now)")

        def less(now: int | None, then: int | None, what: str) -> int | None:
            if now is None or then is None:
                return None
            if now < then:
                raise ServerError(f"GET /metrics: {what} went from {then} to {now} during the run (did the server "
                                  "restart?)")
            return now - then

        drafts = less(self.drafts, before.drafts, "drafts")
        draft_tokens = less(self.draft_tokens, before.draft_tokens, "draft tokens")
        accepted = less(self.accepted, before.accepted, "accepted tokens")
        per_position = None
        if self.accepted_per_position is not None and before.accepted_per_position is not None:
            width = max(len(self.accepted_per_position), len(before.accepted_per_position))
            now = self.accepted_per_position + (0,) * (width - len(self.accepted_per_position))
            then = before.accepted_per_position + (0,) * (width - len(before.accepted_per_position))
            per_position = tuple(less(n, t, f"accepted tokens at position {i}") for i, (n, t) in  # type: ignore[misc]
                                 enumerate(zip(now, then)))
        return Speculation(self.engine, drafts, draft_tokens, accepted, per_position)  # type: ignore[arg-type]

    def line(self) -> str:
        """One line: "12 drafts, 36 draft tokens, 20 accepted (by position 9, 7, 4)"."""
        parts = [f"{self.drafts} draft{'s' if self.drafts != 1 else ''}"]
        if self.draft_tokens is not None:
            parts.append(f"{self.draft_tokens} draft tokens")
        if self.accepted is not None:
            by = ""
            if self.accepted and self.accepted_per_position:
                by = f" (by position {', '.join(str(n) for n in self.accepted_per_position)})"
            parts.append(f"{self.accepted} accepted{by}")
        else:
            parts.append("accepted tokens not published")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted": self.accepted, "accepted_per_position":
                    None if self.accepted_per_position is None else list(self.accepted_per_position)}


def read_counters(url: str, timeout: float) -> Speculation | None:
    """The speculative-decoding counters the server at `url` publishes now (module docstring);
    None when it publishes none (no /metrics page, or none of the counters on it)."""
    try:
        page = _MetricsPage(url, timeout).text()
    except _NoPage:
        return None
    return parse_counters(page)


def parse_counters(page: str) -> Speculation | None:
    """A /metrics page (Prometheus' text format) -> its speculative-decoding totals, None when it
    names none. ServerError for a page prometheus_client cannot parse or a counter that is no count."""
    totals: dict[str, float] = {}                               # <prefix><name> -> the sum of its samples
    per_position: dict[str, dict[int, float]] = {}              # prefix -> position -> accepted
    wanted = {prefix + name for prefix in PREFIXES for name in SPEC_DECODE} | {SGLANG_VERIFY_CALLS}
    try:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:                       # by the sample's name, whatever TYPE line grouped it
                name = sample.name.removesuffix("_total")
                if not sample.name.endswith("_total"):
                    continue                                     # _created: when the counter began
                prefix = next((p for p in PREFIXES if name == p + PER_POSITION), None)
                if prefix is not None:
                    positions = per_position.setdefault(prefix, {})
                    position = _position(sample.labels, name)
                    positions[position] = positions.get(position, 0.0) + sample.value
                elif name in wanted:
                    totals[name] = totals.get(name, 0.0) + sample.value
    except ValueError as exc:
        raise ServerError(f"GET /metrics: not Prometheus' text format ({_excerpt(str(exc))})") from None
    if SGLANG_VERIFY_CALLS in totals:
        return Speculation("SGLang", _count(totals[SGLANG_VERIFY_CALLS], SGLANG_VERIFY_CALLS))
    found = [p for p in PREFIXES if p in per_position or any(p + name in totals for name in SPEC_DECODE)]
    if not found:
        return None
    prefix = found[0]
    missing = [prefix + name for name in SPEC_DECODE if prefix + name not in totals]
    if missing:
        raise ServerError(f"GET /metrics: {PREFIXES[prefix]}'s speculative-decoding counters without {missing[0]}_total")
    counts = {field: _count(totals[prefix + name], prefix + name) for name, field in SPEC_DECODE.items()}
    accepted = per_position.get(prefix)
    positions = tuple(_count(accepted.get(i, 0.0), f"{prefix}{PER_POSITION}_total")
                      for i in range(max(accepted) + 1)) if accepted else None
    return Speculation(PREFIXES[prefix], counts["drafts"], counts["draft_tokens"], counts["accepted"], positions)


def _position(labels: Mapping[str, str], name: str) -> int:
    value = labels.get("position", "")
    if not value.isdigit():
        raise ServerError(f"GET /metrics: {name}_total with position label {_excerpt(value)} (expected 0, 1, ...)")
    return int(value)


def _count(value: float, name: str) -> int:
    if not (value >= 0 and float(value).is_integer()):
        raise ServerError(f"GET /metrics: {name}_total is {value!r}, not a count")
    return int(value)


class _NoPage(Exception):
    """The server has no /metrics page (HTTP 404)."""


class _MetricsPage(Client):
    """GET /metrics as text, within the client's bounds (transport.py: a deadline on the whole
    reply, a size limit, no redirect), failing as its requests do (ServerError, one line)."""

    def text(self) -> str:
        try:
            raw = self.fetch("/metrics")
        except HttpStatusError as exc:
            if exc.status == 404:
                raise _NoPage from None
            raise
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ServerError(f"GET /metrics: the page is not UTF-8 text ({_excerpt(raw)})") from None
