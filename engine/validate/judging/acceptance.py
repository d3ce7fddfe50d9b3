"""Acceptance accounting: where a DDTree's accepted tokens come from, per round and per depth.

A tree pays for its width only when the target takes a node the drafter did not
rank first. Each accepted node has a rank among its siblings (its order by index
under its parent, which is its top-k column): rank 0 is the main path (its
parent's first child, the drafter's top-1 under that parent), rank >= 1 a
sibling (a token the rank-0 chain alone would have missed).

Per depth d = 1..L, over the rounds whose accept walk stood at a node of depth d-1
that has children in the tree (`offered`), `main` counts the walks that took the
rank-0 child and `sibling` those that took a rank >= 1 child (the rest stopped
there). Each is split by the walk so far: `on_main` (every earlier step rank 0)
or `after_sibling` (an earlier step took a sibling). The three rates the report
prints:

- main-path acceptance: main / offered, on the main path;
- sibling acceptance at the first mismatch: sibling / (offered - main), on the main
  path (the drafter's top-1 is wrong for the first time: how often a sibling is right);
- acceptance after a sibling: (main + sibling) / offered, after a sibling.

Rows that carry it (the `acceptance` entry of the row's `tables` in the JSON, with
every round's accepted ranks): "DDTree tokens" (the fixture's greedy traces as
recorded, which are the implementation's own wherever that row is exact), "engine
DDTree replay (batched)" and "invariant DDTree == AR (<drafter>)" (the built-in
engine's own decode runs), and "batched DDTree tokens" (a protocol v2 adapter's
own accepted paths, rows/batched_model.py). Runs whose stages are timed add
`stage_seconds` (seconds per stage, CUDA-synchronized) and the device: the
built-in engine's decode runs (engine.metrics.STAGES) and every v2 adapter's
batched run (batched_model.STAGES).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from ..reports.report import Check, Status

ON_MAIN, AFTER_SIBLING = 0, 1


@dataclass
class AcceptanceTable:
    """Counts per (walk so far, depth): offered, main, sibling int64 [2, L] (index 0
    `on_main`, 1 `after_sibling`; column d-1 for depth d); ranks: per round, the ranks
    of its accepted nodes at depths 1 .. a-1."""

    offered: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))
    main: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))
    sibling: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))
    ranks: list[list[int]] = field(default_factory=list)

    def add(self, parents: Any, accepted: Any) -> None:
        """One round: its tree's parents [n+1] and its accepted path [a] (accepted[0] = 0)."""
        parents, accepted = np.asarray(parents), np.asarray(accepted)
        children = [np.flatnonzero(parents == node) for node in range(len(parents))]
        depth = _tree_depth(parents)
        if depth > self.offered.shape[1]:
            grow = ((0, 0), (0, depth - self.offered.shape[1]))
            self.offered, self.main, self.sibling = (np.pad(a, grow) for a in (self.offered, self.main, self.sibling))
        ranks, walk = [], ON_MAIN
        for d, node in enumerate(accepted.tolist()):
            if not children[node].size:
                break
            self.offered[walk, d] += 1
            if d + 1 == len(accepted):
                break
            rank = int(np.flatnonzero(children[node] == accepted[d + 1])[0])
            (self.main if rank == 0 else self.sibling)[walk, d] += 1
            ranks.append(rank)
            walk = walk if rank == 0 else AFTER_SIBLING
        self.ranks.append(ranks)

    def rates(self) -> dict[str, tuple[int, int]]:
        """The three rates of the module docstring as (numerator, denominator)."""
        offered, main, sibling = (a.sum(axis=1) for a in (self.offered, self.main, self.sibling))
        return {"main path": (int(main[ON_MAIN]), int(offered[ON_MAIN])),
                "sibling at the first mismatch": (int(sibling[ON_MAIN]), int(offered[ON_MAIN] - main[ON_MAIN])),
                "after a sibling": (int(main[AFTER_SIBLING] + sibling[AFTER_SIBLING]), int(offered[AFTER_SIBLING]))}

    def summary(self) -> str:
        def rate(num: int, den: int) -> str:
            return f"{num}/{den}" + (f" ({num / den:.0%})" if den else "")
        return "acceptance: " + ", ".join(f"{name} {rate(*pair)}" for name, pair in self.rates().items())

    def to_dict(self) -> dict[str, Any]:
        split = {walk: {kind: getattr(self, kind)[i].tolist() for kind in ("offered", "main", "sibling")}
                 for i, walk in enumerate(("on_main", "after_sibling"))}
        return {"rounds": len(self.ranks), "per_depth": split,
                "rates": {name: {"accepted": n, "of": d} for name, (n, d) in self.rates().items()},
                "accepted_ranks": self.ranks}


def _tree_depth(parents: np.ndarray) -> int:
    depths = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return int(depths.max(initial=0))


def account(rounds: Iterable[tuple[Any, Any]]) -> AcceptanceTable:
    """The table of many rounds, each (parents [n+1], accepted [a])."""
    table = AcceptanceTable()
    for parents, accepted in rounds:
        table.add(parents, accepted)
    return table


def engine_acceptance(*results) -> AcceptanceTable:
    """The table of the built-in engine's recorded decode runs (engine.decode.DecodeResult,
    decoded with record=True): every request's every round."""
    return account((r.parents.cpu().numpy(), r.accepted.cpu().numpy())
                   for result in results for request in result.requests for r in request.rounds)


def with_acceptance(check: Check, table: AcceptanceTable, stage_seconds: Mapping[str, float] | None = None,
                    device: str | None = None) -> Check:
    """The row with the table's summary in its detail and the full table in `tables`;
    stage seconds and the device where the run was timed."""
    if check.status is Status.SKIPPED or not table.ranks:
        return check
    tables = {**check.tables, "acceptance": table.to_dict()}
    if stage_seconds is not None:
        tables["stage_seconds"] = {"device": device, **stage_seconds}
    detail = f"{check.detail}; {table.summary()}" if check.detail else table.summary()
    return dataclasses.replace(check, detail=detail, tables=tables)


def with_trace_acceptance(checks: list[Check], reader) -> list[Check]:
    """A model fixture's rows, its "DDTree tokens" row carrying the acceptance of the
    fixture's greedy traces as recorded; that row and "sampled DDTree tokens" (unless skipped)
    also carry their traces' acceptance lengths as recorded, per trace, in
    tables["acceptance_lengths"] ({trace: [tokens committed per round]})."""
    traces = reader.metadata["traces"]
    greedy = [t for t in traces if t["ddtree"].get("temperature", 0.0) == 0.0]
    rounds = [(reader[f"traces/{t['name']}/rounds/{r}/parents"], reader[f"traces/{t['name']}/rounds/{r}/accepted"])
              for t in greedy for r in range(int(t["rounds"]))]
    lengths = {name: {t["name"]: np.asarray(reader[f"traces/{t['name']}/acceptance_lengths"]).tolist() for t in group}
               for name, group in (("DDTree tokens", greedy), ("sampled DDTree tokens",
                                                               [t for t in traces if t not in greedy]))}
    rows = []
    for c in checks:
        if c.name == "DDTree tokens":
            c = with_acceptance(c, account(rounds))
        if c.name in lengths and lengths[c.name] and c.status is not Status.SKIPPED:
            c = dataclasses.replace(c, tables={**c.tables, "acceptance_lengths": lengths[c.name]})
        rows.append(c)
    return rows
