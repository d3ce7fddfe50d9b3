"""A model fixture's cases for one regime: its tensors (read lazily), the regime's judging of
them, and the routing a bf16 case's flips could reach. The per-request rows (model.py), the
engine's decode rows (engine.py) and the batched rows (batched_model.py) read their fixture
through it."""

from __future__ import annotations

import numpy as np

from kdtr_format import ModelConfig

from ..judging.compare import as_int, unpack_bits
from ..judging.regime import Regime, RoutingWatch, reached_rows, sequence_reached
from ..reports.report import Check


class ModelCases:
    """A model fixture's cases for one regime (its tensors, read lazily) and the checks over them."""

    def __init__(self, reader, cfg: ModelConfig, regime: Regime, exact: bool) -> None:
        self.reader, self.cfg, self.regime = reader, cfg, regime
        self.threshold = regime.margin_threshold
        self.prompts, self.traces = regime.metadata["prompts"], regime.metadata["traces"]
        self.routing = RoutingWatch(regime, cfg, exact)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.reader[self.regime.prefix + name])

    def close(self, section: str, name: str, actual, expected, kind: str, where: str, locate=None,
              reached: np.ndarray | None = None) -> Check:
        return self.regime.close(section, name, actual, expected, kind, where, locate, reached)

    def tokens(self, section: str, name: str, actual, expected, margins, where: str, locate=None,
               reached: np.ndarray | None = None, sequence: bool = False) -> Check:
        return self.regime.tokens(section, name, actual, expected, margins, where, locate, reached, sequence)

    def route(self, where: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The reference's routing of the rows at `where` (bf16 cases), else None."""
        if self.regime.routing_threshold is None:
            return None
        return self[f"{where}/router_experts"], self[f"{where}/router_margins"]

    def ar_reached(self, prompt: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The prompt's AR decisions a possible routing flip reaches [N], and the cached keys it
        moved [m + N - 1] (every near-tie a suspect: the engine's own loops report no experts);
        (None, None) outside bf16."""
        if self.regime.routing_threshold is None:
            return None, None
        margins = np.concatenate([self[f"prompts/{prompt}/router_margins"][:-1],
                                  self[f"prompts/{prompt}/ar/router_margins"]])
        reached, taints = sequence_reached(margins, self.regime.routing_threshold, self.routing.reach)
        return reached[len(self[f"prompts/{prompt}/tokens"]) - 1:], taints

    def tree_reached(self, rp: str, taints: np.ndarray | None) -> np.ndarray | None:
        """A round's nodes a possible routing flip reaches (bf16 cases), from the round's own routing and
        the prompt's AR keys cached before it (`taints` of ar_reached)."""
        if taints is None:
            return None
        visibility = unpack_bits(self[f"{rp}/visibility_bits"], len(self[f"{rp}/parents"]))
        suspects = self[f"{rp}/router_margins"] < self.regime.routing_threshold
        return reached_rows(suspects, self.routing.reach, visibility, bool(taints[:as_int(self[f"{rp}/start"])].any()))[0]

    def max_len(self) -> int:
        longest = max(p["length"] for p in self.prompts)
        most = max((t["max_new_tokens"] for t in self.traces), default=0)
        ar_tokens = max(len(self[f"prompts/{p['name']}/ar/tokens"]) for p in self.prompts)
        budget = max((t["ddtree"]["budget"] for t in self.traces), default=0)
        return longest + max(most, ar_tokens) + budget + 2
