"""Tolerance regimes: how float outputs and token decisions are judged in the compute dtype
the implementation runs (`kdtree validate --dtype`), and the routing watch of bf16 runs.

- float32: a model fixture's own cases (weights/, prompts/, traces/) and metadata:
  `tolerances`, and a token divergence is a near-tie below `margin_threshold`.
- bfloat16: the fixture's bf16 cases (`bf16/...`, computed in float64 from the same
  weights rounded to bf16) and `metadata["bf16"]`: `tolerances_bf16` and
  `bf16_margin_threshold` from the measured bf16 error model (kdtr_format.precision),
  and routing: bf16 rounding may route a token near a routing tie to another expert,
  which moves its logits, and through attention those of every token that sees it at a
  later layer, far beyond rounding. `RoutingWatch` follows every forward: where the
  implementation reports its experts (the `intermediates` capability) it compares
  them with the reference's; a different choice at a decision whose reference margin
  is at least `routing_threshold` is a FAIL (a routing bug), one below it a routing
  near-tie. The rows such a flip reaches (the token itself; the tokens that see it, when
  the flip is at an MoE layer below the last; every later row once a reached row's keys
  are cached) are judged apart: off the tolerance they are near-ties, not failures.
  Without reported experts every reference near-tie counts as a possible flip.

Every row of the report names its regime and numbers (`Check.regime`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from kdtr_format import ModelConfig

from ..reports.report import Check, Status
from .compare import compare_close, compare_tokens, merge

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Regime:
    """One dtype's way of judging a model fixture: where its cases live (`prefix`), their
    metadata, tolerances per kind, the greedy near-tie threshold, and (bf16) the routing threshold."""

    dtype: str
    prefix: str
    metadata: Mapping[str, Any]
    tolerances: Mapping[str, Mapping[str, float]]
    margin_threshold: float
    routing_threshold: float | None = None

    @classmethod
    def of(cls, metadata: Mapping[str, Any], dtype: str) -> "Regime | None":
        """The regime of a model fixture for `dtype`; None when it holds no cases for it."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if dtype == "float32":
            return cls("float32", "", metadata, metadata["tolerances"], float(metadata["margin_threshold"]))
        cases = metadata.get("bf16")
        if cases is None:
            return None
        return cls("bfloat16", "bf16/", cases, cases["tolerances_bf16"], float(cases["bf16_margin_threshold"]),
                   float(cases["routing_threshold"]))

    @property
    def short(self) -> str:
        return "bf16" if self.dtype == "bfloat16" else self.dtype

    def label(self, kind: str) -> str:
        """The regime and its numbers for a row of `kind` (a tolerance kind, "tokens" or "routing")."""
        if kind == "tokens":
            routing = "; or reached by a routing flip" if self.routing_threshold is not None else ""
            return f"{self.short}: near-tie below margin {self.margin_threshold:.2g}{routing}"
        if kind == "routing":
            return f"{self.short}: routing near-tie below gap {self.routing_threshold:.2g}"
        rule = self.tolerances[kind]
        return f"{self.short}: atol {rule['atol']:.2g} + rtol {rule['rtol']:.2g}|x|"

    def close(self, section: str, name: str, actual: Any, expected: Any, kind: str, where: str,
              locate: Any = None, reached: np.ndarray | None = None) -> Check:
        """Within the tolerance of `kind` (compare_close; `locate` names a row); rows `reached` by a
        routing flip [rows] bool are judged apart: off the tolerance they make the row a near-tie,
        not a failure."""
        rule = self.tolerances[kind]
        actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
        label = self.label(kind)
        if reached is None or not reached.any() or actual.shape != expected.shape:
            return dataclasses.replace(compare_close(section, name, actual, expected, rule["rtol"], rule["atol"], where,
                                                     locate), regime=label)
        rows = reached.reshape((-1,) + (1,) * (expected.ndim - 1))
        strict = compare_close(section, name, actual, expected, rule["rtol"], np.where(rows, np.inf, rule["atol"]),
                               where, locate)
        apart = compare_close(section, name, actual[reached], expected[reached], rule["rtol"], rule["atol"], where)
        note = f"{int(reached.sum())} of {len(reached)} rows reached by a routing flip"
        if strict.status is not Status.FAIL and apart.status is Status.FAIL:
            return Check(section, name, Status.NEAR_TIE, apart.error, apart.tolerance,
                         detail=f"{note}, off by up to {apart.error:.3g} (tolerance {apart.tolerance:.3g}){_at(where)}",
                         regime=label)
        return dataclasses.replace(strict, detail=f"{strict.detail}; {note}" if strict.detail else note, regime=label)

    def tokens(self, section: str, name: str, actual: Any, expected: Any, margins: Any, where: str,
               locate: Any = None, reached: np.ndarray | None = None, sequence: bool = False) -> Check:
        """Token decisions (compare_tokens) at this regime's near-tie threshold; a decision whose row is
        `reached` by a routing flip is a near-tie. `sequence`: the tokens follow each other (AR, DDTree
        output), so only the first divergence is judged."""
        check = compare_tokens(section, name, actual, expected, margins, self.margin_threshold, where, locate,
                               tied=reached, sequence=sequence)
        return dataclasses.replace(check, regime=self.label("tokens"))


class CasesView:
    """A fixture reader seen through a regime: tensor names under its cases' prefix, its cases'
    metadata (for code that reads a fixture's prompts and traces)."""

    def __init__(self, reader: Any, regime: Regime) -> None:
        self.reader, self.regime = reader, regime

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.regime.metadata

    def __getitem__(self, name: str) -> Any:
        return self.reader[self.regime.prefix + name]


def _at(where: str) -> str:
    return f" ({where})" if where else ""


def reached_rows(suspects: np.ndarray, reach: np.ndarray, new_visibility: np.ndarray,
                 cache_reached: bool) -> tuple[np.ndarray, np.ndarray]:
    """One forward's rows: suspects [n, Lm] (a routing flip, or a possible one, per row and MoE
    layer), reach [Lm] (the MoE layers below the last, whose flips reach the tokens that see the
    row), new_visibility [n, n], cache_reached (a cached key was computed from a reached row)
    -> (reached [n]: rows whose logits a flip can move, taints [n]: rows whose keys it moved)."""
    n = len(suspects)
    own = suspects.any(axis=1)
    through = suspects[:, reach].any(axis=1)
    others = (new_visibility & ~np.eye(n, dtype=bool) & through[None, :]).any(axis=1)
    return own | others | cache_reached, through | others | cache_reached


class RoutingWatch:
    """Routing flips of one request across its forwards (module docstring). float32: forwards
    pass straight through and nothing is reached. exact: the adapter reports its experts
    (`intermediates` with "layers.{i}.experts"); else every reference near-tie is a suspect."""

    def __init__(self, regime: Regime, cfg: ModelConfig, exact: bool) -> None:
        self.regime, self.exact = regime, exact
        self.active = regime.routing_threshold is not None
        self.moe_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_dense_layer(i)]
        self.reach = np.array([i < cfg.num_hidden_layers - 1 for i in self.moe_layers], dtype=bool)
        self.cache_reached = False
        self.flips: list[Check] = []

    def reset(self) -> None:
        self.cache_reached = False

    def forward(self, adapter: Any, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray, start: int,
                rows: tuple[np.ndarray, np.ndarray] | None, where: str, commit: bool = True
                ) -> tuple[np.ndarray, np.ndarray | None]:
        """adapter.forward (or intermediates) -> (logits [n, V], reached rows [n] or None). rows: the
        reference's (router_experts [n, Lm, k], router_margins [n, Lm]) of these rows. commit: the
        forward's keys stay in the cache (a verify's are restated by the next forward)."""
        if not self.active:
            return adapter.forward(tokens, positions, visibility, start), None
        experts, margins = (np.asarray(a) for a in rows)
        near = margins < self.regime.routing_threshold
        new_visibility = np.asarray(visibility)[:, start:]
        if self.exact:
            out = adapter.intermediates(tokens, positions, visibility, start)
            logits, suspects = out["logits"], self._flips(out, experts, margins, new_visibility, where)
        else:
            logits, suspects = adapter.forward(tokens, positions, visibility, start), near
        reached, taints = reached_rows(suspects, self.reach, new_visibility, self.cache_reached)
        if commit:
            self.cache_reached = bool(taints.any())
        return np.asarray(logits, dtype=np.float64), reached

    def _flips(self, out: Mapping[str, np.ndarray], experts: np.ndarray, margins: np.ndarray,
               new_visibility: np.ndarray, where: str) -> np.ndarray:
        """The rows and layers where the adapter chose other experts than the reference, layer by
        layer. Each is recorded: a FAIL when the reference margin there is at least the threshold and
        no earlier flip reached the row (its own at an earlier layer, one of a token it sees, or one
        behind a cached key), else a routing near-tie."""
        threshold = self.regime.routing_threshold
        flips = np.zeros(margins.shape, dtype=bool)
        for j, layer in enumerate(self.moe_layers):
            earlier, _ = reached_rows(flips[:, :j], self.reach[:j], new_visibility, self.cache_reached)
            chosen = np.sort(np.asarray(out[f"layers.{layer}.experts"]), axis=1)
            flips[:, j] = (chosen != experts[:, j]).any(axis=1)
            for i in np.flatnonzero(flips[:, j]):
                wide = margins[i, j] >= threshold and not earlier[i]
                cause = "" if not earlier[i] else "; an earlier flip reached this row"
                self.flips.append(Check("", "routing", Status.FAIL if wide else Status.NEAR_TIE,
                                        margin=float(margins[i, j]), tolerance=threshold,
                                        detail=f"row {i} layer {layer}: experts {chosen[i].tolist()}, reference "
                                               f"{experts[i, j].tolist()}, margin {margins[i, j]:.3g} vs threshold "
                                               f"{threshold:.3g}{cause} ({where})"))
        return flips

    def check(self, section: str) -> Check:
        """The fixture's routing row: every flip a near-tie, or the first FAIL."""
        label = self.regime.label("routing")
        if not self.exact:
            return Check(section, "routing", Status.SKIPPED, regime=label,
                         detail="the adapter reports no experts (intermediates): every row a reference routing "
                                "near-tie reaches is judged apart")
        if not self.flips:
            return Check(section, "routing", Status.EXACT, regime=label, detail="every expert choice as the reference's")
        row = merge(section, "routing", [dataclasses.replace(f, section=section) for f in self.flips])
        return dataclasses.replace(row, regime=label, detail=f"{len(self.flips)} flip(s); {row.detail}")


def sequence_reached(margins: np.ndarray, threshold: float, reach: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of one causal sequence (a prompt's prefill rows, then its AR rows) with the reference's
    router_margins [T, Lm] -> (reached [T], taints [T]) with every near-tie a suspect."""
    return reached_rows(margins < threshold, reach, np.tri(len(margins), dtype=bool), False)
