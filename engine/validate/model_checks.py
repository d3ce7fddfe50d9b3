"""Model fixtures (`<preset>.kdtr`) through the adapter: prefill and verify logits
within tolerance, AR tokens, tree build, target choices, accept and committed tokens
exact, every trace replayed teacher-forced; for the built-in engine also its own
batched decode loops and the invariant on the fixture's weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from kdtr_format import DDTreeConfig, ModelConfig

from ..adapter import TorchAdapter
from ..decode import DecodeResult, ar_decode, ddtree_decode
from ..drafters import ReplayDrafter
from .acceptance import engine_acceptance, with_acceptance
from .compare import _int, _words, compare_exact, compare_tree, merge, skipped, unpack_bits
from .fixtures import model_fixture_config
from .invariant import invariant_checks
from .regime import Regime, RoutingWatch, reached_rows, sequence_reached
from .report import Check, Status


def _model_fixture(adapter: Any, caps: set[str], reader, path: Path, builtin: bool,
                   dtype: str = "float32") -> list[Check]:
    cfg = model_fixture_config(reader, path)
    section = path.name
    regime = Regime.of(reader.metadata, dtype)
    if regime is None:
        return [Check(section, f"{dtype} cases", Status.SKIPPED,
                      detail=f"the fixture holds no {dtype} cases (regenerate it with `refgen generate`)")]
    fixture = _Fixture(reader, cfg, regime, exact="intermediates" in caps)
    metadata = regime.metadata
    checks: list[Check] = []
    if "model" in caps:
        prefix = regime.prefix + "weights/"
        adapter.load_weights(cfg, {name[len(prefix):]: np.array(reader[name], dtype=np.float32)
                                   for name in reader.names(prefix)})
        prefill, ar = [], []
        for prompt in metadata["prompts"]:
            p, a = fixture.prompt_checks(adapter, section, prompt["name"])
            prefill.append(p)
            ar.append(a)
        checks += [merge(section, "prefill logits", prefill), merge(section, "AR tokens", ar)]
    else:
        checks += [skipped(section, "prefill logits"), skipped(section, "AR tokens")]
    checks += fixture.trace_checks(adapter, caps, section)
    if regime.routing_threshold is not None and "model" in caps:
        checks.append(fixture.routing.check(section))
    if builtin:
        checks += fixture.engine_decode_checks(adapter, section)
        checks += invariant_checks(adapter, [fixture[f"prompts/{p['name']}/tokens"] for p in metadata["prompts"]],
                                   regime.margin_threshold, section, regime.label("tokens"))
    return checks


class _Fixture:
    """A model fixture's cases for one regime (its tensors, read lazily) and the checks over them."""

    def __init__(self, reader, cfg: ModelConfig, regime: Regime, exact: bool) -> None:
        self.reader, self.cfg, self.regime = reader, cfg, regime
        self.prompts, self.traces = regime.metadata["prompts"], regime.metadata["traces"]
        self.routing = RoutingWatch(regime, cfg, exact)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.reader[self.regime.prefix + name])

    def close(self, section: str, name: str, actual, expected, kind: str, where: str,
              reached: np.ndarray | None = None) -> Check:
        return self.regime.close(section, name, actual, expected, kind, where, reached)

    def tokens(self, section: str, name: str, actual, expected, margins, where: str,
               reached: np.ndarray | None = None, sequence: bool = False) -> Check:
        return self.regime.tokens(section, name, actual, expected, margins, where, reached, sequence)

    def route(self, where: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The reference's routing of the rows at `where` (bf16 cases), else None."""
        if self.regime.routing_threshold is None:
            return None
        return self[f"{where}/router_experts"], self[f"{where}/router_margins"]

    def ar_reached(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's AR decisions a possible routing flip reaches [N], and the cached keys it
        moved [m + N - 1] (every near-tie a suspect: the engine's own loops report no experts)."""
        if self.regime.routing_threshold is None:
            n = len(self[f"prompts/{prompt}/ar/tokens"])
            return np.zeros(n, dtype=bool), np.zeros(n + len(self[f"prompts/{prompt}/tokens"]), dtype=bool)
        margins = np.concatenate([self[f"prompts/{prompt}/router_margins"][:-1],
                                  self[f"prompts/{prompt}/ar/router_margins"]])
        reached, taints = sequence_reached(margins, self.regime.routing_threshold, self.routing.reach)
        m = len(self[f"prompts/{prompt}/tokens"])
        return reached[m - 1:], taints

    def max_len(self) -> int:
        longest = max(p["length"] for p in self.prompts)
        most = max((t["max_new_tokens"] for t in self.traces), default=0)
        ar_tokens = max(len(self[f"prompts/{p['name']}/ar/tokens"]) for p in self.prompts)
        budget = max((t["ddtree"]["budget"] for t in self.traces), default=0)
        return longest + max(most, ar_tokens) + budget + 2

    def prompt_checks(self, adapter, section: str, name: str) -> tuple[Check, Check]:
        """Prefill logits and the adapter's own AR greedy loop (stops at the first divergence)."""
        prompt = self[f"prompts/{name}/tokens"]
        expected = self[f"prompts/{name}/ar/tokens"]
        margins = self[f"prompts/{name}/ar/margins"]
        m = len(prompt)
        adapter.reset(self.max_len())
        self.routing.reset()
        route = self.route(f"prompts/{name}")
        logits, reached = self.routing.forward(adapter, prompt, np.arange(m), np.tri(m, dtype=bool), 0, route,
                                               f"prompt {name} prefill")
        prefill = self.close(section, "prefill logits", logits, self[f"prompts/{name}/prefill_logits"],
                             "logits", f"prompt {name}", reached)
        tokens = [int(np.argmax(logits[-1]))]
        decisions = [reached is not None and bool(reached[-1])]
        ar_route = self.route(f"prompts/{name}/ar")
        while len(tokens) < len(expected) and tokens[-1] == expected[len(tokens) - 1]:
            start = m + len(tokens) - 1
            row = None if ar_route is None else tuple(a[len(tokens):len(tokens) + 1] for a in ar_route)
            step, reached = self.routing.forward(adapter, np.array([tokens[-1]]), np.array([start]),
                                                 np.ones((1, start + 1), dtype=bool), start, row,
                                                 f"prompt {name} AR token {len(tokens)}")
            tokens.append(int(np.argmax(step[-1])))
            decisions.append(reached is not None and bool(reached[0]))
        ar = self.tokens(section, "AR tokens", tokens, expected[:len(tokens)], margins, f"prompt {name}",
                         np.array(decisions), sequence=True)
        if ar.status is Status.EXACT and len(tokens) != len(expected):
            ar = Check(section, "AR tokens", Status.FAIL, detail=f"prompt {name}: stopped early")
        return prefill, ar

    def trace_checks(self, adapter, caps: set[str], section: str) -> list[Check]:
        """Every trace replayed teacher-forced through the adapter (module docstring)."""
        found: dict[str, list[Check]] = {k: [] for k in
                                         ("top-k log-probs", "tree build", "tree compile", "verify logits",
                                          "target choices", "accept", "DDTree tokens")}
        for trace in self.traces:
            if trace["ddtree"].get("temperature", 0.0) == 0.0:
                self._trace(adapter, caps, section, trace, found)
        needs = {"top-k log-probs": {"topk"}, "tree build": {"tree"}, "tree compile": {"compile"},
                 "verify logits": {"model"},
                 "target choices": {"model"}, "accept": {"accept"}, "DDTree tokens": {"model", "accept"}}
        return [merge(section, name, rows) if needs[name] <= caps else skipped(section, name)
                for name, rows in found.items()]

    def _trace(self, adapter, caps: set[str], section: str, trace: Mapping[str, Any],
               found: dict[str, list[Check]]) -> None:
        name = trace["name"]
        prefix = f"traces/{name}"
        prompt = self[f"prompts/{trace['prompt']}/tokens"]
        budget = int(trace["ddtree"]["budget"])
        committed: list[int] = []          # the adapter's own: its prefill's argmax, then its rounds
        reached_decisions: list[bool] = []
        if "model" in caps:
            adapter.reset(self.max_len())
            self.routing.reset()
            m = len(prompt)
            logits, reached = self.routing.forward(adapter, prompt, np.arange(m), np.tri(m, dtype=bool), 0,
                                                   self.route(f"prompts/{trace['prompt']}"), f"trace {name} prefill")
            committed.append(int(np.argmax(logits[-1])))
            reached_decisions.append(reached is not None and bool(reached[-1]))
        for r in range(int(trace["rounds"])):
            rp = f"{prefix}/rounds/{r}"
            where = f"trace {name} round {r}"
            start, root = _int(self[f"{rp}/start"]), _int(self[f"{rp}/root"])
            parents, tokens, depths = self[f"{rp}/parents"], self[f"{rp}/tokens"], self[f"{rp}/depths"]
            topk_lp, topk_id = self[f"{rp}/topk_lp"], self[f"{rp}/topk_id"]
            choices_expected, margins = self[f"{rp}/choices"], self[f"{rp}/margins"]
            accepted_expected = self[f"{rp}/accepted"]
            if "topk" in caps and topk_lp.shape[0] > 0:
                lp, ids = adapter.topk_logprobs(self[f"{rp}/draft_logits"], topk_id.shape[1])
                found["top-k log-probs"] += [compare_exact(section, "top-k ids", ids, topk_id, where),
                                             self.close(section, "top-k lp", lp, topk_lp, "logprobs", where)]
            if "tree" in caps:
                found["tree build"] += compare_tree(section, adapter.build_tree(topk_lp, topk_id, budget, root),
                                                    (parents, tokens, depths, self[f"{rp}/scores"]), where)
            if "compile" in caps:
                positions, bits, _, _ = adapter.compile_tree(parents, depths, start)
                found["tree compile"] += [
                    compare_exact(section, "positions", positions, self[f"{rp}/positions"], where),
                    compare_exact(section, "visibility bits", _words(bits), _words(self[f"{rp}/visibility_bits"]),
                                  where)]
            choices = choices_expected
            if "model" in caps:
                n = len(tokens)
                visibility = np.concatenate([np.ones((n, start), dtype=bool),
                                             unpack_bits(self[f"{rp}/visibility_bits"], n)], axis=1)
                route = self.route(rp)
                logits, reached = self.routing.forward(adapter, tokens, self[f"{rp}/positions"], visibility, start,
                                                       route, where, commit=False)
                found["verify logits"].append(self.close(section, "verify logits", logits,
                                                         self[f"{rp}/verify_logits"], "logits", where, reached))
                choices = np.argmax(logits, axis=-1)
                found["target choices"].append(self.tokens(section, "target choices", choices,
                                                           choices_expected, margins, where, reached))
                a = len(accepted_expected)
                path_route = None if route is None else tuple(x[accepted_expected] for x in route)
                restated, restated_reached = self.routing.forward(
                    adapter, tokens[accepted_expected], start + np.arange(a),
                    np.concatenate([np.ones((a, start), dtype=bool), np.tri(a, dtype=bool)], axis=1), start,
                    path_route, f"{where}, accepted path restated")
                found["verify logits"].append(self.close(
                    section, "verify logits", restated, self[f"{rp}/verify_logits"][accepted_expected],
                    "logits", f"{where}, accepted path restated causally", restated_reached))
            if "accept" in caps:
                accepted, next_root = adapter.accept(parents, tokens, choices_expected)
                found["accept"] += [compare_exact(section, "accepted", accepted, accepted_expected, where),
                                    compare_exact(section, "next root", next_root,
                                                  _int(self[f"{rp}/next_root"]), where)]
                if "model" in caps:
                    path, bonus = adapter.accept(parents, tokens, choices)
                    committed += [int(t) for t in tokens[np.asarray(path)[1:]]] + [int(bonus)]
                    reached_decisions += [reached is not None and bool(reached[i]) for i in path]
        if {"model", "accept"} <= caps:
            expected = self[f"{prefix}/tokens"]
            found["DDTree tokens"].append(self.tokens(section, "DDTree tokens", committed[:len(expected)], expected,
                                                      self[f"prompts/{trace['prompt']}/ar/margins"], f"trace {name}",
                                                      np.array(reached_decisions[:len(expected)]), sequence=True))

    def engine_decode_checks(self, adapter: TorchAdapter, section: str) -> list[Check]:
        """The built-in engine's own batched decode loops against the fixture."""
        model, stages = adapter.model, adapter.stages
        prompts = [p["name"] for p in self.prompts]
        expected = [self[f"prompts/{p}/ar/tokens"] for p in prompts]
        ar = ar_decode(model, [self[f"prompts/{p}/tokens"] for p in prompts], [len(e) for e in expected],
                       stages=stages)
        checks = [merge(section, "engine AR decode (batched)",
                        [self.tokens(section, "engine AR decode", got.tokens, want, self[f"prompts/{p}/ar/margins"],
                                     f"prompt {p}", self.ar_reached(p)[0], sequence=True)
                         for p, got, want in zip(prompts, ar.requests, expected)])]
        rows, results = [], []
        greedy = [t for t in self.traces if t["ddtree"].get("temperature", 0.0) == 0.0]
        for block_size in sorted({t["ddtree"]["block_size"] for t in greedy}):
            group = [t for t in greedy if t["ddtree"]["block_size"] == block_size]
            group_rows, result = self._replay(model, stages, section, group)
            rows += group_rows
            results.append(result)
        checks.append(with_acceptance(merge(section, "engine DDTree replay (batched)", rows),
                                      engine_acceptance(*results)))
        return checks

    def _replay(self, model, stages, section: str,
                traces: list[Mapping[str, Any]]) -> tuple[list[Check], DecodeResult]:
        """Traces of one block size in one batch, each with its own budget and length."""
        recorded = [{_int(self[f"traces/{t['name']}/rounds/{r}/start"]):
                     self[f"traces/{t['name']}/rounds/{r}/draft_logits"] for r in range(t["rounds"])}
                    for t in traces]
        ddtree = DDTreeConfig.from_dict(traces[0]["ddtree"])
        result = ddtree_decode(model, ReplayDrafter(recorded, self.cfg.vocab_size, model.device),
                               [self[f"prompts/{t['prompt']}/tokens"] for t in traces], ddtree,
                               [int(t["max_new_tokens"]) for t in traces],
                               budgets=[int(t["ddtree"]["budget"]) for t in traces], stages=stages, record=True)
        rows = []
        for t, request in zip(traces, result.requests):
            name = t["name"]
            expected = self[f"traces/{name}/tokens"]
            ar_reached, taints = self.ar_reached(t["prompt"])
            trace_rows = [self.tokens(section, "tokens", request.tokens[:len(expected)], expected,
                                      self[f"prompts/{t['prompt']}/ar/margins"], f"trace {name}", ar_reached,
                                      sequence=True)]
            lengths = compare_exact(section, "acceptance lengths", request.acceptance_lengths,
                                    self[f"traces/{name}/acceptance_lengths"], f"trace {name}")
            for r, got in enumerate(request.rounds[:t["rounds"]]):
                rp, where = f"traces/{name}/rounds/{r}", f"trace {name} round {r}"
                # The engine computed its own top-k from the draft logits here, and the contract lets
                # top-k lp differ by a float32 ulp between implementations. Where they do and the tree
                # then differs, that is a score near-tie, not a bug: the round's rows are near-ties (the
                # bit-exact tree build from the fixture's top-k is checked on its own, and the committed
                # tokens above stay exact). Scores are compared with the log-prob tolerance.
                round_rows = [compare_exact(section, what, getattr(got, what).numpy(), self[f"{rp}/{what}"],
                                            where) for what in ("parents", "tokens", "depths", "accepted")]
                round_rows += [
                    self.close(section, "scores", got.scores.numpy(), self[f"{rp}/scores"], "logprobs", where),
                    self.tokens(section, "choices", got.choices.numpy(), self[f"{rp}/choices"],
                                self[f"{rp}/margins"], where, self._tree_reached(rp, taints)),
                    compare_exact(section, "next root", got.next_root, _int(self[f"{rp}/next_root"]), where)]
                round_rows = replayed_round(round_rows, tree_rows=3,
                                            same_topk=np.array_equal(got.topk_lp.numpy(), self[f"{rp}/topk_lp"]))
                choices_tied = any(row.name == "choices" and row.status is Status.NEAR_TIE for row in round_rows)
                trace_rows += follow_near_tie(round_rows, choices_tied, ("accepted", "next root"))
                if any(row.status is Status.NEAR_TIE for row in round_rows):
                    break                       # the request left the recorded path: later rounds are not comparable
            tied = any(row.status is Status.NEAR_TIE for row in trace_rows)
            rows += trace_rows + follow_near_tie([lengths], tied, ("acceptance lengths",))
        return rows, result

    def _tree_reached(self, rp: str, taints: np.ndarray) -> np.ndarray | None:
        """A round's nodes a possible routing flip reaches (bf16 cases), from the round's own routing and
        the prompt's AR keys cached before it (taints of its causal sequence)."""
        if self.regime.routing_threshold is None:
            return None
        start = _int(self[f"{rp}/start"])
        parents = self[f"{rp}/parents"]
        visibility = unpack_bits(self[f"{rp}/visibility_bits"], len(parents))
        suspects = self[f"{rp}/router_margins"] < self.regime.routing_threshold
        return reached_rows(suspects, self.routing.reach, visibility, bool(taints[:start].any()))[0]


def follow_near_tie(rows: list[Check], tied: bool, names: tuple[str, ...]) -> list[Check]:
    """When `tied` (a near-tie decided what these rows depend on: a round's choices for its accept
    path and next root, any of a trace's decisions for its acceptance lengths), the FAIL rows of
    `names` are near-ties: they follow the near-tie, they do not add a failure of their own."""
    if not tied:
        return rows
    return [dataclasses.replace(row, status=Status.NEAR_TIE, detail=f"{row.detail}; follows a near-tie decision")
            if row.status is Status.FAIL and row.name in names else row for row in rows]


def replayed_round(rows: list[Check], tree_rows: int, same_topk: bool) -> list[Check]:
    """A replayed round's checks, the first `tree_rows` of them on the tree's shape. When the
    implementation's own top-k log-probs differ from the fixture's (by the float32 ulp the contract
    allows) and the tree differs, every failing row of the round is a near-tie, not a bug."""
    tree_differs = any(row.status is Status.FAIL for row in rows[:tree_rows])
    if same_topk or not tree_differs:
        return rows
    return [dataclasses.replace(row, status=Status.NEAR_TIE,
                                detail=f"{row.detail}; top-k lp differ from the fixture's (contract: a score near-tie)")
            if row.status is Status.FAIL else row for row in rows]
