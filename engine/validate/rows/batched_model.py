"""Batched model-fixture checks (protocol v2): every trace of the fixture as one request of
one batch, through the adapter's own cache and its own compaction, timed per stage.

1. `batched prefill logits`: the fixture's weights loaded, the cache reset for one request
   per trace, every trace's prompt prefilled in one ragged causal forward.
2. Round r, for the requests whose trace has a round r (the others sit it out with no
   tokens): top-k, tree build, compile, accept and sample accept from the fixture's own
   inputs in batched calls (batched.py); then the pipeline: one verify forward of every
   active request's tree at the fixture's start, each request's own choices (the argmax
   of its logits; sampled: sample_accept with the fixture's uniforms) through accept,
   and compact_cache with the fixture's accepted paths (teacher-forced, so one wrong
   round cannot hide the others).
3. Round 0's verify logits are `batched verify logits`; each later round reads KV that the
   adapter's compact_cache moved, and is `batched cache compaction`. So that stale KV
   cannot hide, the trees of even rounds carry poison: children of the root that no node
   sees and none is accepted, enough of them that the rejected slots reach past all the
   next round writes; a cache that lets a slot at or past `starts` be seen fails there.
4. `batched DDTree tokens`: the tokens each request committed by its own choices, against
   the trace's (greedy judged by the prompt's AR margins, sampled by the trace's). The row
   carries the acceptance table of the adapter's own accepted paths (greedy traces,
   judging/acceptance.py) and `stage_seconds`: per stage (prefill, topk, build, compile, verify,
   accept, compact) the sum of its calls' own time as CheckedV2 measures it (CUDA-
   synchronized, the wall clock on the CPU), with the device named. The teacher-forced
   accept checks of step 2 are not timed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from kdtr_format import DDTreeConfig

from ...weights import on_device
from ..door.checked import CheckedV2, fault_into
from ..fixtures import fixture_weights, model_fixture_config
from ..judging.acceptance import account, with_acceptance
from ..judging.compare import as_int, compare_tokens, row, unpack_bits
from ..judging.regime import Regime
from ..reports.report import Check, Status
from .batched import (Request, accept_rows, at, build_rows, compile_rows, groups, host, listing, offsets,
                      packed_rows, put, sample_accept_rows, split, timed, topk_rows)
from .cases import ModelCases

ROWS: dict[str, set[str]] = {
    "batched prefill logits": {"model"},
    "batched top-k log-probs": {"topk"},
    "batched tree build": {"tree"},
    "batched tree compile": {"compile"},
    "batched verify logits": {"model"},
    "batched accept": {"accept"},
    "batched sample accept": {"sample_accept"},
    "batched cache compaction": {"model"},
    "batched DDTree tokens": {"model", "accept"},
}
STAGES = ("prefill", "topk", "build", "compile", "verify", "accept", "compact")


@dataclass
class _Trace:
    """One trace as one request of the batch, and what the adapter did with it."""

    meta: Mapping[str, Any]
    prompt: np.ndarray
    rounds: list[Request]
    poison: int                      # root children added to its trees on poisoned rounds
    start: int                       # its committed length in the adapter's cache
    committed: list[int] | None = None
    paths: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)   # (parents, own accepted)

    @property
    def temperature(self) -> float:
        return float(self.meta["ddtree"].get("temperature", 0.0))


def _trace(fixture: ModelCases, meta: Mapping[str, Any]) -> _Trace:
    name, reader = meta["name"], fixture.reader
    rounds = []
    for r in range(int(meta["rounds"])):
        prefix = f"traces/{name}/rounds/{r}/"
        rounds.append(Request(f"trace {name} round {r}", reader, prefix, int(meta["ddtree"]["budget"]),
                              as_int(reader[prefix + "root"]), as_int(reader[prefix + "start"]), meta))
    depth = DDTreeConfig.from_dict(meta["ddtree"]).depth
    prompt = fixture[f"prompts/{meta['prompt']}/tokens"]
    widest = max((len(r["tokens"]) for r in rounds), default=1)
    return _Trace(meta, prompt, rounds, poison=widest + depth + 2, start=len(prompt))


def batched_model_checks(adapter: CheckedV2, caps: set[str], reader, section: str,
                         dtype: str = "float32") -> list[Check]:
    """The rows of ROWS for one model fixture (module docstring), judged in float32. In bfloat16 they
    are skipped rows saying why: the routing watch that tells a bf16 routing flip from a bug
    (judging/regime.py) follows one request's forward, and a batch has no per-request reach yet."""
    if dtype != "float32":
        return [Check(section, name, Status.SKIPPED,
                      detail=f"batched rows are judged in float32 only; --dtype {dtype} judges the per-request rows")
                for name in ROWS]
    cfg = model_fixture_config(reader, Path(section))
    fixture = ModelCases(reader, cfg, Regime.of(reader.metadata, dtype), exact=False)
    return _Run(adapter, caps, fixture, section).checks()


class _Run:
    """One batched run over a model fixture's traces."""

    def __init__(self, adapter: CheckedV2, caps: set[str], fixture: ModelCases, section: str) -> None:
        self.adapter, self.caps, self.fixture, self.section = adapter, caps, fixture, section
        self.traces = [_trace(fixture, t) for t in fixture.traces]
        self.found: dict[str, list[Check]] = {name: [] for name in ROWS}
        self.seconds: dict[str, float] = {}

    def checks(self) -> list[Check]:
        model = "model" in self.caps and self.prefill()
        for r in range(max((len(t.rounds) for t in self.traces), default=0)):
            active = [t for t in self.traces if r < len(t.rounds)]
            self.stage_checks([t.rounds[r] for t in active], [t.temperature for t in active])
            model = model and self.verify(r, active)
        return self.rows()

    def _stopped(self, fault: Check) -> bool:
        """A fault that stops the model pipeline, on every model row not yet reached."""
        for name, needs in ROWS.items():
            if "model" in needs and not self.found[name]:
                self.found[name].append(dataclasses.replace(fault, name=name))
        return False

    def prefill(self) -> bool:
        adapter, fixture, traces = self.adapter, self.fixture, self.traces
        name, rows = "batched prefill logits", self.found["batched prefill logits"]
        with fault_into(rows, self.section, name, "every prompt") as run:
            adapter.load_weights(fixture.cfg, {n: on_device(w, adapter.device)
                                               for n, w in fixture_weights(fixture.reader).items()})
            adapter.reset(len(traces), fixture.max_len() + max(t.poison for t in traces))
            lengths = [len(t.prompt) for t in traces]
            with adapter.timing(self.seconds, "prefill"):
                logits = adapter.forward(put(adapter, np.concatenate([t.prompt for t in traces]), torch.int64),
                                         put(adapter, np.concatenate([np.arange(m) for m in lengths]), torch.int64),
                                         offsets(lengths, adapter), put(adapter, np.zeros(len(traces)), torch.int64),
                                         packed_rows([np.tri(m, dtype=bool) for m in lengths], adapter))
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            for b, (t, got) in enumerate(zip(traces, split(host(logits), bounds))):
                rows.append(fixture.close(self.section, name, got, fixture[f"prompts/{t.meta['prompt']}/prefill_logits"],
                                          "logits", f"trace {t.meta['name']} prompt; request {b} of a batch of {len(traces)}"))
        if run.fault:
            return self._stopped(rows[-1])
        last = logits[torch.as_tensor(bounds[1:] - 1, device=adapter.device)]                        # [B, V]
        for t, token in zip(traces, host(last.argmax(dim=-1))):
            t.committed = [int(token)] if t.temperature == 0 and "accept" in self.caps else None
        self._first_sampled([t for t in traces if t.temperature > 0], last)
        return True

    def _first_sampled(self, sampled: list[_Trace], last: torch.Tensor) -> None:
        """A sampled trace's first token: its sample_accept of the root-only tree with its prefill uniform."""
        if "sample_accept" not in self.caps:
            return
        for group in groups(sampled, lambda t: t.temperature):
            rows = torch.as_tensor([self.traces.index(t) for t in group], device=self.adapter.device)
            minus = put(self.adapter, np.full(len(group), -1), torch.int64)
            uniforms = np.array([float(self.fixture[f"traces/{t.meta['name']}/prefill_uniform"]) for t in group])
            committed = self._commit(group, "first tokens", lambda: self.adapter.sample_accept(
                minus, minus, last[rows].double(), offsets([1] * len(group), self.adapter), group[0].temperature,
                put(self.adapter, uniforms, torch.float64))[1:])
            for t, tokens in zip(group, committed):
                t.committed = tokens

    def stage_checks(self, rounds: list[Request], temperatures: list[float]) -> None:
        """The round's stages from the fixture's inputs, each in batched calls (batched.py)."""
        adapter, section, found, caps = self.adapter, self.section, self.found, self.caps
        if "topk" in caps:
            topk_rows(adapter, section, rounds, found["batched top-k log-probs"], self._logprobs, self.seconds)
        if "tree" in caps:
            build_rows(adapter, section, rounds, found["batched tree build"], self.seconds)
        if "compile" in caps:
            compile_rows(adapter, section, rounds, found["batched tree compile"], self.seconds)
        if "accept" in caps:
            accept_rows(adapter, section, [q for q, t in zip(rounds, temperatures) if t == 0], found["batched accept"])
        if "sample_accept" in caps:
            for temperature in sorted({t for t in temperatures if t > 0}):
                sample_accept_rows(adapter, section, [q for q, t in zip(rounds, temperatures) if t == temperature],
                                   temperature, found["batched sample accept"])

    def _logprobs(self, section: str, name: str, actual: Any, expected: Any, where: str) -> Check:
        return self.fixture.close(section, name, actual, expected, "logprobs", where)

    def verify(self, r: int, active: list[_Trace]) -> bool:
        """Round r's verify forward (poisoned on even rounds), the requests' own commits, then
        compact_cache; False when a fault stopped the pipeline."""
        adapter, fixture, section = self.adapter, self.fixture, self.section
        name = "batched verify logits" if r == 0 else "batched cache compaction"
        counts, tokens, positions, visibility, starts = [], [], [], [], []
        for t in self.traces:
            if t not in active:
                counts.append(0)
                starts.append(t.start)
                continue
            q = t.rounds[r]
            n, extra = len(q["tokens"]), t.poison if r % 2 == 0 else 0
            seen = np.eye(n + extra, dtype=bool)
            seen[:n, :n], seen[n:, 0] = unpack_bits(q["visibility_bits"], n), True
            tokens.append(np.concatenate([q["tokens"], (q.root + 1 + 7 * np.arange(extra)) % fixture.cfg.vocab_size]))
            positions.append(np.concatenate([q["positions"], np.full(extra, q.start + 1)]))
            visibility.append(seen)
            counts.append(n + extra)
            starts.append(q.start)
        bounds = offsets(counts, adapter)
        with fault_into(self.found[name], section, name, f"round {r}: {listing([t.rounds[r] for t in active])}") as run:
            with adapter.timing(self.seconds, "verify"):
                logits = adapter.forward(put(adapter, np.concatenate(tokens), torch.int64),
                                         put(adapter, np.concatenate(positions), torch.int64), bounds,
                                         put(adapter, starts, torch.int64), packed_rows(visibility, adapter))
            everything = host(logits)
            for b, t in enumerate(self.traces):
                if t in active:
                    self.found[name].append(self._verify_row(name, r, t, b, everything, host(bounds)))
        if run.fault:
            return self._stopped(self.found[name][-1])
        self._own_commits(r, active, logits, host(bounds))
        paths = [t.rounds[r]["accepted"] if t in active else np.zeros(0, np.int64) for t in self.traces]
        with fault_into(self.found["batched cache compaction"], section, "batched cache compaction",
                        f"round {r}: compact_cache") as compact:
            with adapter.timing(self.seconds, "compact"):
                adapter.compact_cache(put(adapter, starts, torch.int64), put(adapter, np.concatenate(paths), torch.int64),
                                      offsets([len(p) for p in paths], adapter))
        if compact.fault:
            return self._stopped(self.found["batched cache compaction"][-1])
        for t in active:
            t.start = t.rounds[r].start + len(t.rounds[r]["accepted"])
        return True

    def _verify_row(self, name: str, r: int, t: _Trace, b: int, logits: np.ndarray, bounds: np.ndarray) -> Check:
        q = t.rounds[r]
        n = len(q["tokens"])
        where = at(q, b, len(self.traces))
        if r > 0:
            where += f"; reads the KV compact_cache left after round {r - 1}" + \
                     (", its rejected slots poisoned" if (r - 1) % 2 == 0 else "")
        depths, positions = q["depths"], q["positions"]
        return self.fixture.close(self.section, name, logits[bounds[b]:bounds[b] + n], q["verify_logits"], "logits",
                                  where, lambda i: f"first wrong node {i} (depth {depths[i]}, position {positions[i]})")

    def _own_commits(self, r: int, active: list[_Trace], logits: torch.Tensor, bounds: np.ndarray) -> None:
        """Each active request's own choices through accept (greedy) or sample_accept, added to
        the tokens it committed."""
        adapter = self.adapter
        committing = [t for t in active if t.committed is not None]
        for group in groups(committing, lambda t: t.temperature):
            rounds = [t.rounds[r] for t in group]
            rows = np.concatenate([np.arange(bounds[self.traces.index(t)], bounds[self.traces.index(t)] + len(q["tokens"]))
                                   for t, q in zip(group, rounds)])
            own = logits[torch.as_tensor(rows, device=adapter.device)]
            trees = [put(adapter, np.concatenate([q[w] for q in rounds]), torch.int64) for w in ("parents", "tokens")]
            bounds_g = offsets([len(q["tokens"]) for q in rounds], adapter)
            if group[0].temperature == 0:
                call = lambda: adapter.accept(*trees, own.argmax(dim=-1), bounds_g)     # noqa: E731
            else:
                uniforms = put(adapter, np.concatenate([q["uniforms"] for q in rounds]), torch.float64)
                call = lambda: adapter.sample_accept(*trees, own.double(), bounds_g, group[0].temperature,   # noqa: E731
                                                     uniforms)[1:]
            for t, q, tokens in zip(group, rounds, self._commit(group, f"round {r}", call, rounds)):
                t.committed = None if tokens is None else t.committed + tokens

    def _commit(self, group: Sequence[_Trace], where: str, call: Callable[[], tuple[torch.Tensor, ...]],
                rounds: Sequence[Request] | None = None) -> list[list[int] | None]:
        """The tokens each request of `group` commits from call() -> (accepted [A], accept_offsets,
        next_roots [B]) over its tree (rounds; None: the root-only tree), timed as accept; None
        for a request whose path does not lie in its tree, all None when the call faulted."""
        rows = self.found["batched DDTree tokens"]
        with fault_into(rows, self.section, "batched DDTree tokens", f"{where}: {listing(rounds or [])}") as run:
            with timed(self.adapter, self.seconds, "accept"):
                accepted, bounds, next_roots = call()
            paths, next_roots = list(split(host(accepted), host(bounds))), host(next_roots)
        if run.fault:
            return [None] * len(group)
        committed: list[list[int] | None] = []
        for b, (t, path) in enumerate(zip(group, paths)):
            tokens = rounds[b]["tokens"] if rounds else np.array([-1])
            if len(path) == 0 or path.min() < 0 or path.max() >= len(tokens):
                committed.append(None)
                continue
            if rounds and t.temperature == 0:
                t.paths.append((rounds[b]["parents"], path))
            committed.append([int(token) for token in tokens[path[1:]]] + [int(next_roots[b])])
        return committed

    def rows(self) -> list[Check]:
        fixture, section = self.fixture, self.section
        for b, t in enumerate(self.traces):
            if t.committed is None:
                continue
            name, prompt = t.meta["name"], t.meta["prompt"]
            expected = fixture[f"traces/{name}/tokens"]
            margins = fixture[f"traces/{name}/margins"] if t.temperature > 0 else fixture[f"prompts/{prompt}/ar/margins"]
            self.found["batched DDTree tokens"].append(compare_tokens(
                section, "batched DDTree tokens", t.committed[:len(expected)], expected, margins, fixture.threshold,
                f"trace {name}; request {b} of a batch of {len(self.traces)}"))
        checks = [row(section, name, needs, self.caps, self.found[name]) for name, needs in ROWS.items()]
        return [self._timed(c) if c.name == "batched DDTree tokens" else c for c in checks]

    def _timed(self, check: Check) -> Check:
        """The DDTree tokens row with the adapter's acceptance table and its time per stage."""
        device = self.adapter.device
        label = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
        seconds = {stage: self.seconds[stage] for stage in STAGES if stage in self.seconds}
        check = with_acceptance(check, account(p for t in self.traces for p in t.paths), seconds, label)
        if "stage_seconds" not in check.tables:
            return check
        rounds = max(len(t.rounds) for t in self.traces)
        timing = (f"stage ms on {label} ({len(self.traces)} requests, {rounds} rounds): "
                  + ", ".join(f"{stage} {1e3 * s:.2f}" for stage, s in seconds.items()))
        return dataclasses.replace(check, detail=f"{check.detail}; {timing}")
