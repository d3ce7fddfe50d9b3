"""Model fixtures (`<preset>.kdtr`) through the checked adapter: prefill and verify
logits within tolerance; AR tokens, tree build, target choices, accept, sampled choices
and committed tokens exact, every trace (greedy and sampled) replayed teacher-forced; the
fixture's adversarial sampling cases exact. For the built-in engine also its own rows
(engine.py) and the invariant (invariant.py) on the fixture's weights.

A FAIL in verify logits, target choices or sampled choices names the first wrong node
(trace, round, node index, its depth and position) and points to `kdtree diverge`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..door.checked import fault_into
from ..fixtures import fixture_weights, model_fixture_config
from ..judging.compare import as_int, as_words, compare_exact, compare_tree, row, unpack_bits
from ..judging.regime import Regime
from ..reports.report import Check, Status
from .cases import ModelCases
from .engine import engine_checks
from .invariant import invariant_checks

# The report's rows for a model fixture, and the adapter capabilities each needs.
ROWS: dict[str, set[str]] = {
    "prefill logits": {"model"},
    "AR tokens": {"model"},
    "top-k log-probs": {"topk"},
    "tree build": {"tree"},
    "tree compile": {"compile"},
    "verify logits": {"model"},
    "target choices": {"model"},
    "sampled choices": {"model", "sample_accept"},
    "accept": {"accept"},
    "sample accept": {"sample_accept"},
    "DDTree tokens": {"model", "accept"},
    "sampled DDTree tokens": {"model", "sample_accept"},
}
DIVERGE_HINT = "`kdtree diverge` finds the first op where verify and decode differ"


def model_fixture_checks(adapter: Any, caps: set[str], reader, section: str, builtin: bool,
                         dtype: str = "float32") -> list[Check]:
    """The rows of ROWS for one model fixture in the regime of `dtype` (one skipped row when the
    fixture holds no such cases); for the built-in engine (builtin), its decode and invariant rows too."""
    cfg = model_fixture_config(reader, Path(section))
    regime = Regime.of(reader.metadata, dtype)
    if regime is None:
        return [Check(section, f"{dtype} cases", Status.SKIPPED,
                      detail=f"the fixture holds no {dtype} cases (regenerate it with `refgen generate`)")]
    metadata = regime.metadata
    fixture = _Checks(reader, cfg, regime, exact=callable(getattr(adapter, "intermediates", None)))
    found: dict[str, list[Check]] = {name: [] for name in ROWS}
    model = "model" in caps
    if model:
        loading: list[Check] = []
        with fault_into(loading, section, "model") as load:
            adapter.load_weights(cfg, fixture_weights(reader, regime.prefix))
        if load.fault:                 # no weights: every row that needs the model carries the fault
            for name, needs in ROWS.items():
                if "model" in needs:
                    found[name].append(dataclasses.replace(loading[0], name=name))
            model = False
    if model:
        for prompt in metadata["prompts"]:
            fixture.prompt_checks(adapter, section, prompt["name"], found)
    for trace in fixture.traces:
        fixture.trace_checks(adapter, caps, model, section, trace, found)
    if "sample_accept" in caps:
        fixture.sample_case_checks(adapter, section, found["sample accept"])
    checks = [row(section, name, needs, caps, found[name]) for name, needs in ROWS.items()]
    if regime.routing_threshold is not None and model:
        checks.append(fixture.routing.check(section))
    if builtin:
        checks += engine_checks(adapter, fixture, section)
        checks += invariant_checks(adapter, [fixture[f"prompts/{p['name']}/tokens"] for p in metadata["prompts"]],
                                   fixture.threshold, section, regime.label("tokens"))
    return checks


class _Checks(ModelCases):
    """A model fixture's cases and the checks over them."""

    def prompt_checks(self, adapter, section: str, name: str, found: dict[str, list[Check]]) -> None:
        """Prefill logits and the adapter's own AR greedy loop (stops at the first divergence)."""
        prompt = self[f"prompts/{name}/tokens"]
        expected = self[f"prompts/{name}/ar/tokens"]
        m = len(prompt)
        with fault_into(found["prefill logits"], section, "prefill logits", f"prompt {name}") as prefill:
            adapter.reset(self.max_len())
            self.routing.reset()
            logits, reached = self.routing.forward(adapter, prompt, np.arange(m), np.tri(m, dtype=bool), 0,
                                                   self.route(f"prompts/{name}"), f"prompt {name} prefill")
            found["prefill logits"].append(self.close(section, "prefill logits", logits,
                                                      self[f"prompts/{name}/prefill_logits"], "logits",
                                                      f"prompt {name}", reached=reached))
        if prefill.fault:
            return
        tokens = [int(np.argmax(logits[-1]))]
        decisions = [reached is not None and bool(reached[-1])]        # reached by a routing flip
        ar_route = self.route(f"prompts/{name}/ar")
        with fault_into(found["AR tokens"], section, "AR tokens", f"prompt {name}") as loop:
            while len(tokens) < len(expected) and tokens[-1] == expected[len(tokens) - 1]:
                start = m + len(tokens) - 1
                rows = None if ar_route is None else tuple(a[len(tokens):len(tokens) + 1] for a in ar_route)
                step, reached = self.routing.forward(adapter, np.array([tokens[-1]]), np.array([start]),
                                                     np.ones((1, start + 1), dtype=bool), start, rows,
                                                     f"prompt {name} AR token {len(tokens)}")
                tokens.append(int(np.argmax(step[-1])))
                decisions.append(reached is not None and bool(reached[0]))
        if loop.fault:
            return
        ar = self.tokens(section, "AR tokens", tokens, expected[:len(tokens)], self[f"prompts/{name}/ar/margins"],
                         f"prompt {name}", reached=np.array(decisions), sequence=True)
        if ar.status is Status.EXACT and len(tokens) != len(expected):
            ar = Check(section, "AR tokens", Status.FAIL, detail=f"prompt {name}: stopped early")
        found["AR tokens"].append(ar)

    def trace_checks(self, adapter, caps: set[str], model: bool, section: str, trace: Mapping[str, Any],
                     found: dict[str, list[Check]]) -> None:
        """One trace replayed teacher-forced: every round takes the fixture's start, root, draft and
        tree; the adapter's own choices are accumulated into its committed tokens."""
        name, prefix = trace["name"], f"traces/{trace['name']}"
        temperature = float(trace["ddtree"].get("temperature", 0.0))
        sampled = temperature > 0
        commits = "sample_accept" if sampled else "accept"
        committed: list[int] | None = None            # the adapter's own: its first token, then its rounds
        reached: list[bool] = []                       # per committed token: reached by a routing flip (bf16)
        if model:
            model, first, first_reached = self._first_token(adapter, caps, section, trace, found)
            committed = [first] if first is not None and commits in caps else None
            reached.append(first_reached)
        for r in range(int(trace["rounds"])):
            rp, where = f"{prefix}/rounds/{r}", f"trace {name} round {r}"
            self._stage_checks(adapter, caps, section, rp, where, int(trace["ddtree"]["budget"]), temperature,
                               found)
            if not model:
                continue
            logits, nodes_reached = self._verify(adapter, section, rp, where, found)
            if logits is None:
                model, committed = False, None
                continue
            commit = self._own_choices(adapter, caps, section, rp, where, logits, nodes_reached, temperature, found)
            if commit is None or committed is None:
                committed = None
            else:
                committed += commit[0]
                reached += commit[1]
        if committed is not None:
            expected = self[f"{prefix}/tokens"]
            margins = self[f"{prefix}/margins"] if sampled else self[f"prompts/{trace['prompt']}/ar/margins"]
            rowname = "sampled DDTree tokens" if sampled else "DDTree tokens"
            found[rowname].append(self.tokens(section, rowname, committed[:len(expected)], expected, margins,
                                              f"trace {name}", reached=np.array(reached[:len(expected)]),
                                              sequence=True))

    def _first_token(self, adapter, caps: set[str], section: str, trace: Mapping[str, Any],
                     found: dict[str, list[Check]]) -> tuple[bool, int | None, bool]:
        """The adapter's prefill of the trace's prompt -> (it ran, the first token, whether a routing
        flip reached its row): greedy, the argmax; sampled, its sample_accept of the root-only tree with
        the trace's prefill uniform (None without sample_accept, or when that faulted)."""
        prompt = self[f"prompts/{trace['prompt']}/tokens"]
        m, where = len(prompt), f"trace {trace['name']} prefill"
        with fault_into(found["verify logits"], section, "verify logits", where) as prefill:
            adapter.reset(self.max_len())
            self.routing.reset()
            logits, reached = self.routing.forward(adapter, prompt, np.arange(m), np.tri(m, dtype=bool), 0,
                                                   self.route(f"prompts/{trace['prompt']}"), where)
            last = logits[-1:]
        if prefill.fault:
            return False, None, False
        last_reached = reached is not None and bool(reached[-1])
        temperature = float(trace["ddtree"].get("temperature", 0.0))
        if temperature == 0:
            return True, int(np.argmax(last[0])), last_reached
        if "sample_accept" not in caps:
            return True, None, last_reached
        with fault_into(found["sampled choices"], section, "sampled choices", where) as first:
            _, _, token = adapter.sample_accept(np.array([-1]), np.array([-1]), last.astype(np.float64), temperature,
                                                self[f"traces/{trace['name']}/prefill_uniform"].reshape(1))
        return True, None if first.fault else token, last_reached

    def _stage_checks(self, adapter, caps: set[str], section: str, rp: str, where: str, budget: int,
                      temperature: float, found: dict[str, list[Check]]) -> None:
        """One round's stages from the fixture's own inputs: top-k, tree build, compile, accept
        (and sample accept for a sampled round), each exact."""
        parents, tokens, depths = self[f"{rp}/parents"], self[f"{rp}/tokens"], self[f"{rp}/depths"]
        topk_lp, topk_id = self[f"{rp}/topk_lp"], self[f"{rp}/topk_id"]
        if "topk" in caps and topk_lp.shape[0] > 0:
            with fault_into(found["top-k log-probs"], section, "top-k log-probs", where):
                lp, ids = adapter.topk_logprobs(self[f"{rp}/draft_logits"], topk_id.shape[1])
                found["top-k log-probs"] += [compare_exact(section, "top-k ids", ids, topk_id, where),
                                             self.close(section, "top-k lp", lp, topk_lp, "logprobs", where)]
        if "tree" in caps:
            with fault_into(found["tree build"], section, "tree build", where):
                built = adapter.build_tree(topk_lp, topk_id, budget, as_int(self[f"{rp}/root"]))
                found["tree build"] += compare_tree(section, built, (parents, tokens, depths, self[f"{rp}/scores"]),
                                                    where)
        if "compile" in caps:
            with fault_into(found["tree compile"], section, "tree compile", where):
                positions, bits, _, _ = adapter.compile_tree(parents, depths, as_int(self[f"{rp}/start"]))
                found["tree compile"] += [
                    compare_exact(section, "positions", positions, self[f"{rp}/positions"], where),
                    compare_exact(section, "visibility bits", as_words(bits), as_words(self[f"{rp}/visibility_bits"]),
                                  where)]
        if "accept" in caps:
            with fault_into(found["accept"], section, "accept", where):
                accepted, next_root = adapter.accept(parents, tokens, self[f"{rp}/choices"])
                found["accept"] += self._accepted(section, rp, where, accepted, next_root)
        if temperature > 0 and "sample_accept" in caps:
            with fault_into(found["sample accept"], section, "sample accept", where):
                choices, accepted, next_root = adapter.sample_accept(parents, tokens, self[f"{rp}/verify_logits"],
                                                                     temperature, self[f"{rp}/uniforms"])
                found["sample accept"] += [compare_exact(section, "choices", choices, self[f"{rp}/choices"], where),
                                           *self._accepted(section, rp, where, accepted, next_root)]

    def _accepted(self, section: str, rp: str, where: str, accepted, next_root: int) -> list[Check]:
        return [compare_exact(section, "accepted", accepted, self[f"{rp}/accepted"], where),
                compare_exact(section, "next root", next_root, as_int(self[f"{rp}/next_root"]), where)]

    def _verify(self, adapter, section: str, rp: str, where: str,
                found: dict[str, list[Check]]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The round's tree verify through the adapter's forward, then the accepted path restated
        causally at slots start .. start + a - 1; both against the fixture's verify logits.
        -> (the verify logits [n+1, V], None when the forward faulted; the nodes a routing flip
        reached [n+1], bf16 only)."""
        start, tokens, accepted = as_int(self[f"{rp}/start"]), self[f"{rp}/tokens"], self[f"{rp}/accepted"]
        expected = self[f"{rp}/verify_logits"]
        n, a = len(tokens), len(accepted)
        with fault_into(found["verify logits"], section, "verify logits", where) as verify:
            visibility = np.concatenate([np.ones((n, start), dtype=bool),
                                         unpack_bits(self[f"{rp}/visibility_bits"], n)], axis=1)
            route = self.route(rp)
            logits, reached = self.routing.forward(adapter, tokens, self[f"{rp}/positions"], visibility, start,
                                                   route, where, commit=False)
            node = _Nodes(self, rp)
            found["verify logits"].append(node.hinted(self.close(section, "verify logits", logits, expected, "logits",
                                                                 where, lambda i: f"first wrong {node(i)}", reached)))
            path_route = None if route is None else tuple(x[accepted] for x in route)
            restated, restated_reached = self.routing.forward(
                adapter, tokens[accepted], start + np.arange(a),
                np.concatenate([np.ones((a, start), dtype=bool), np.tri(a, dtype=bool)], axis=1), start,
                path_route, f"{where}, accepted path restated")
            node = _Nodes(self, rp)
            found["verify logits"].append(node.hinted(self.close(
                section, "verify logits", restated, expected[accepted], "logits",
                f"{where}, accepted path restated causally", lambda k: f"first wrong {node(int(accepted[k]))}",
                restated_reached)))
        return (None, None) if verify.fault else (logits, reached)

    def _own_choices(self, adapter, caps: set[str], section: str, rp: str, where: str, logits: np.ndarray,
                     reached: np.ndarray | None, temperature: float,
                     found: dict[str, list[Check]]) -> tuple[list[int], list[bool]] | None:
        """The adapter's choices from its own verify logits (greedy: the argmax; sampled: its
        sample_accept with the fixture's uniforms) against the fixture's, and the tokens the
        adapter commits with them, with whether a routing flip reached the node behind each
        (`reached`, bf16). None when it cannot commit them itself."""
        parents, tokens = self[f"{rp}/parents"], self[f"{rp}/tokens"]
        expected, margins = self[f"{rp}/choices"], self[f"{rp}/margins"]
        node = _Nodes(self, rp)
        if temperature == 0:
            choices = np.argmax(logits, axis=-1)
            found["target choices"].append(node.hinted(self.tokens(section, "target choices", choices, expected,
                                                                   margins, where, lambda i: f"at {node(i)}", reached)))
            if "accept" not in caps:
                return None
            with fault_into(found["DDTree tokens"], section, "DDTree tokens", where) as walk:
                path, bonus = adapter.accept(parents, tokens, choices)
        else:
            if "sample_accept" not in caps:
                return None
            with fault_into(found["sampled choices"], section, "sampled choices", where) as walk:
                choices, path, bonus = adapter.sample_accept(parents, tokens, logits.astype(np.float64), temperature,
                                                             self[f"{rp}/uniforms"])
                found["sampled choices"].append(node.hinted(self.tokens(section, "sampled choices", choices,
                                                                        expected, margins, where,
                                                                        lambda i: f"at {node(i)}", reached)))
        if walk.fault or len(path) == 0 or path.max(initial=0) >= len(tokens) or path.min(initial=0) < 0:
            return None
        flags = [reached is not None and bool(reached[i]) for i in path]     # the nodes behind the commits
        return [int(t) for t in tokens[path[1:]]] + [bonus], flags

    def sample_case_checks(self, adapter, section: str, rows: list[Check]) -> None:
        """The fixture's adversarial sampling cases (uniform exactly 0, exactly on a CDF boundary,
        1 - 2^-53; tokens of probability 0 beside them): choices, accepted, next root exact."""
        def case(name: str) -> np.ndarray:             # the cases are the fixture's, whatever the regime
            return np.asarray(self.reader[name])

        for spec in self.reader.metadata.get("sample_cases", []):
            p, where = f"sample_cases/{spec['name']}/", f"case {spec['name']}"
            with fault_into(rows, section, "sample accept", where):
                choices, accepted, next_root = adapter.sample_accept(
                    case(p + "parents"), case(p + "tokens"), case(p + "logits"), float(spec["temperature"]),
                    case(p + "uniforms"))
                rows += [compare_exact(section, "choices", choices, case(p + "choices"), where),
                         compare_exact(section, "accepted", accepted, case(p + "accepted"), where),
                         compare_exact(section, "next root", next_root, as_int(case(p + "next_root")), where)]

class _Nodes:
    """A round's nodes in words for one comparison's detail ('node i (depth d, position p)'),
    keeping the node it named: a FAIL row carries it as tables["first_wrong_node"] (trace,
    round, node, depth, position, and the round's parents and accepted path)."""

    def __init__(self, fixture: ModelCases, rp: str) -> None:
        self.fixture, self.rp, self.named = fixture, rp, None

    def __call__(self, i: int) -> str:
        self.named = i
        depths, positions = self.fixture[f"{self.rp}/depths"], self.fixture[f"{self.rp}/positions"]
        return f"node {i} (depth {depths[i]}, position {positions[i]})"

    def hinted(self, check: Check) -> Check:
        """A FAIL row of the model's own numbers, pointed at the tool that localizes it, with its node."""
        if check.status is not Status.FAIL:
            return check
        tables = dict(check.tables)
        if self.named is not None:
            trace, r = self.rp[len("traces/"):].rsplit("/rounds/", 1)
            i, f = self.named, self.fixture
            tables["first_wrong_node"] = {
                "trace": trace, "round": int(r), "node": i, "depth": int(f[f"{self.rp}/depths"][i]),
                "position": int(f[f"{self.rp}/positions"][i]), "parents": f[f"{self.rp}/parents"].tolist(),
                "accepted": f[f"{self.rp}/accepted"].tolist()}
        return dataclasses.replace(check, detail=f"{check.detail}; {DIVERGE_HINT}", tables=tables)


