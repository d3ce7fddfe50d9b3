"""A model fixture's known continuations of a prompt: every prefix of generated tokens after
which the fixture holds the reference's logits, to judge what a server serves beyond the AR
path (after a near-tie, and when it samples).

For one prompt of a regime's cases (docs/fixtures.md) the known prefixes are

- the empty prefix: the last row of ``prompts/{p}/prefill_logits`` (the first token's logits);
- every node of every verified tree of every trace of the prompt: the trace's committed tokens
  before the round, then the tree's path from its root to the node; the node's row of
  ``verify_logits``.

A prefix of k tokens keys the logits of generated token k. Greedy traces accept along the AR
path, so the AR tokens' logits are known as far as the prompt's traces reach (not always to
the end: tiny's p1 and p2 traces run 12 and 10 of 16 tokens); sampled traces add their sampled
path; every tree adds its siblings (the drafts the target did not choose), each with the
target's logits after it.

    known = KnownPrefixes(CasesView(reader, regime), cfg, "p0")
    known.logits((243, 430))       # float64 [V], or None where the fixture holds none
    known.children(())             # the known one-token extensions of a prefix
    known.reached((243, 430))      # bf16: a possible routing flip reaches that row
    known.ar_reached               # bf16: [N] the same for each AR decision

Routing (bf16 cases, regime.py): a row is reached when a reference routing near-tie on it, or
at an MoE layer below the last on an earlier row of its sequence (the prompt's, then its
prefix's), could flip its experts and so move its logits beyond rounding. Outside bf16 nothing
is reached.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kdtr_format import ModelConfig

from .regime import CasesView, RoutingWatch, sequence_reached

Prefix = tuple[int, ...]


class KnownPrefixes:
    """The known prefixes of one prompt (module docstring), read lazily from the fixture."""

    def __init__(self, view: CasesView, cfg: ModelConfig, prompt: str) -> None:
        self.view, self.prompt = view, prompt
        self.threshold = view.regime.routing_threshold
        self.reach = RoutingWatch(view.regime, cfg, exact=False).reach
        at = f"prompts/{prompt}"
        self.prompt_tokens = np.asarray(view[f"{at}/tokens"])
        self.ar_tokens = np.asarray(view[f"{at}/ar/tokens"])
        self.ar_margins = np.asarray(view[f"{at}/ar/margins"], dtype=np.float64)
        m = len(self.prompt_tokens)
        self._rows: dict[Prefix, tuple[str, int]] = {(): (f"{at}/prefill_logits", m - 1)}
        self._routing: dict[Prefix, tuple[str, int]] = {(): (f"{at}/router_margins", m - 1)}
        self._children: dict[Prefix, set[int]] = {}
        for trace in view.metadata["traces"]:
            if trace["prompt"] == prompt:
                self._add_trace(trace, m)
        self.ar_reached = self._ar_reached(at, m)

    def _add_trace(self, trace: dict[str, Any], m: int) -> None:
        prefix = f"traces/{trace['name']}"
        committed = np.asarray(self.view[f"{prefix}/tokens"]).tolist()
        for r in range(int(trace["rounds"])):
            rp = f"{prefix}/rounds/{r}"
            start = int(np.asarray(self.view[f"{rp}/start"]))
            parents = np.asarray(self.view[f"{rp}/parents"]).tolist()
            tokens = np.asarray(self.view[f"{rp}/tokens"]).tolist()
            keys: list[Prefix] = []
            for i, parent in enumerate(parents):      # a node's parent comes before it
                key = (tuple(committed[:start - m]) if parent < 0 else keys[parent]) + (tokens[i],)
                keys.append(key)
                self._rows.setdefault(key, (f"{rp}/verify_logits", i))
                self._routing.setdefault(key, (f"{rp}/router_margins", i))
                self._children.setdefault(key[:-1], set()).add(key[-1])

    def _ar_reached(self, at: str, m: int) -> np.ndarray:
        if self.threshold is None:
            return np.zeros(len(self.ar_tokens), dtype=bool)
        margins = np.concatenate([np.asarray(self.view[f"{at}/router_margins"])[:-1],
                                  np.asarray(self.view[f"{at}/ar/router_margins"])])
        return sequence_reached(margins, self.threshold, self.reach)[0][m - 1:]

    def __contains__(self, prefix: Prefix) -> bool:
        return tuple(prefix) in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def prefixes(self) -> list[Prefix]:
        return list(self._rows)

    def logits(self, prefix: Prefix) -> np.ndarray | None:
        """The reference's logits [V] of the token after `prefix`, None where the fixture holds none."""
        row = self._rows.get(tuple(prefix))
        return None if row is None else np.asarray(self.view[row[0]][row[1]], dtype=np.float64)

    def children(self, prefix: Prefix) -> set[int]:
        return self._children.get(tuple(prefix), set())

    def reached(self, prefix: Prefix) -> bool:
        """Whether a possible routing flip reaches the row after `prefix` (bf16 cases; a known prefix)."""
        if self.threshold is None:
            return False
        m = len(self.prompt_tokens)
        rows = [np.asarray(self.view[f"prompts/{self.prompt}/router_margins"])[:m - 1]]
        for k in range(len(prefix) + 1):
            name, i = self._routing[tuple(prefix[:k])]
            rows.append(np.asarray(self.view[name])[i:i + 1])
        return bool(sequence_reached(np.concatenate(rows), self.threshold, self.reach)[0][-1])
