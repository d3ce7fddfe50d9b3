"""The built-in engine's own rows (`kdtree validate` without --impl), after a model fixture's
per-request and batched rows and before the invariant's (invariant.py): its batched decode
loops against the fixture, and what its decode loop alone decides, which no adapter call
shows: the uniforms it draws, its argmax over the (gathered) vocabulary, invariant mode's
bits. An exception in one is that row's FAIL.

- "engine AR decode (batched)": `ar_decode` over every prompt in one batch, each prompt's
  tokens against its AR tokens.
- "engine DDTree replay (batched)": `ddtree_decode` with the fixture's drafts (the replay
  drafter) and, for sampled traces, its uniforms: the traces of one block size and
  temperature in one batch, the greedy ones beside every prompt as companion requests
  (flat drafts, whose tokens must be their AR tokens), every round's tree, choices and
  acceptance exact, whole token sequences equal.
- "engine sampling: fresh uniforms every round": a sampled DDTree decode of the prompts
  (each at least once, SAMPLING_REQUESTS in all) that draws its own uniforms (SAMPLING: a
  seeded generator, a random drafter), seen through its stages' `sample_choices`. Every
  uniform drawn, the prefill's and every round's, for every request and node, lies in
  [0, 1) and is distinct: a repeat is a generator re-seeded or a draw reused, so rounds
  that are not independent. Consecutive rounds' uniforms at the same request and node are
  uncorrelated: |r| sqrt(pairs) below CORRELATION_Z (independent uniforms exceed it with
  probability below 1e-8).
- "engine greedy: ties go to the smaller id": logits with two equal maxima per row (the
  ids either side of every boundary between two ranks' vocabulary shards under TP, the
  first and the last id, two ids inside one shard), each rank holding its shard, gathered
  as the sharded forward gathers them (`World.gather`) and chosen by the stages' greedy
  choice: the smaller id of each pair, margin 0.
- "engine invariant: logits bitwise across row counts" (in invariant mode, `--invariant`,
  only; the pytest plugin shows it skipped otherwise): every prompt prefilled in one ragged
  forward beside the others, against the same prompt alone, one token per forward: every
  logit bit for bit (docs/precision.md, section 3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np
import torch

from kdtr_format import DDTreeConfig

from ...adapter import TorchAdapter
from ...decode import DecodeResult, ar_decode, ddtree_decode
from ...drafters import RandomDrafter, ReplayDrafter
from ...stages import top2_margins
from ..judging.acceptance import engine_acceptance, with_acceptance
from ..judging.compare import as_int, compare_exact, merge
from ..reports.report import Check, Status
from .cases import ModelCases

ENGINE_AR, ENGINE_REPLAY = "engine AR decode (batched)", "engine DDTree replay (batched)"
ENGINE_SAMPLING = "engine sampling: fresh uniforms every round"
ENGINE_TIES = "engine greedy: ties go to the smaller id"
ENGINE_BITWISE = "engine invariant: logits bitwise across row counts"
NOT_INVARIANT = "skipped (the engine runs in its default mode: `kdtree validate --invariant` checks its invariant mode)"
# The rows in report order, each with the detail of its skipped row where the run has none (runner.Case.absent).
ENGINE_ROWS = {ENGINE_AR: "", ENGINE_REPLAY: "", ENGINE_SAMPLING: "", ENGINE_TIES: "", ENGINE_BITWISE: NOT_INVARIANT}

SAMPLING = DDTreeConfig(block_size=4, budget=8, temperature=1.0)
SAMPLING_TOKENS, SAMPLING_REQUESTS, SAMPLING_SEED = 12, 4, 2026
CORRELATION_Z = 6.0


def engine_checks(adapter: TorchAdapter, fixture: ModelCases, section: str) -> list[Check]:
    """The rows of ENGINE_ROWS, in that order, on the adapter's loaded weights (the bitwise
    row in invariant mode only)."""
    model, stages = adapter.model, adapter.stages
    names = [p["name"] for p in fixture.prompts]
    prompts = [fixture[f"prompts/{p}/tokens"] for p in names]

    def ar_rows() -> list[Check]:
        expected = [fixture[f"prompts/{p}/ar/tokens"] for p in names]
        ar = ar_decode(model, prompts, [len(e) for e in expected], stages=stages)
        return [fixture.tokens(section, "engine AR decode", got.tokens, want, fixture[f"prompts/{p}/ar/margins"],
                               f"prompt {p}", reached=fixture.ar_reached(p)[0], sequence=True)
                for p, got, want in zip(names, ar.requests, expected)]

    greedy: list[DecodeResult] = []           # the greedy traces' own requests, for the acceptance table

    def replay_rows() -> list[Check]:
        rows = []
        for key in sorted({_batch_key(t) for t in fixture.traces}):
            group = [t for t in fixture.traces if _batch_key(t) == key]
            group_rows, result = _replay(fixture, model, stages, section, group, names if key[1] == 0 else [])
            rows += group_rows
            if key[1] == 0:
                greedy.append(dataclasses.replace(result, requests=result.requests[:len(group)]))
        return rows

    replay = _engine_row(section, ENGINE_REPLAY, replay_rows)
    rows = [_engine_row(section, ENGINE_AR, ar_rows), with_acceptance(replay, engine_acceptance(*greedy)),
            _engine_row(section, ENGINE_SAMPLING, lambda: [_fresh_uniforms(adapter, prompts, section)]),
            _engine_row(section, ENGINE_TIES, lambda: [ties_check(adapter, section)])]
    if model.invariant:
        rows.append(_engine_row(section, ENGINE_BITWISE, lambda: [_bitwise(model, prompts, section)]))
    return rows


# ---- sampling: the engine's own uniforms ----

class _DrawnUniforms:
    """The engine's stages, keeping the uniforms [B, N] each sample_choices call is handed."""

    def __init__(self, stages: Any) -> None:
        self.stages, self.drawn = stages, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    def sample_choices(self, logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
        self.drawn.append(uniforms.double().cpu().numpy().copy())
        return self.stages.sample_choices(logits, temperature, uniforms)


def _fresh_uniforms(adapter: TorchAdapter, prompts: list[np.ndarray], section: str) -> Check:
    model = adapter.model
    spy = _DrawnUniforms(adapter.stages)
    requests = prompts * -(-SAMPLING_REQUESTS // len(prompts))             # every prompt, at least that many
    ddtree_decode(model, RandomDrafter(model.cfg.vocab_size, seed=SAMPLING_SEED, device=model.device), requests,
                  SAMPLING, SAMPLING_TOKENS, generator=torch.Generator().manual_seed(SAMPLING_SEED), stages=spy)
    return uniforms_check(section, spy.drawn)


def _draw(k: int) -> str:
    return "the prefill" if k == 0 else f"round {k - 1}"


def uniforms_check(section: str, drawn: list[np.ndarray]) -> Check:
    """The row of a decode's draws: drawn[0] the prefill's uniforms [B, 1], drawn[r + 1] round r's
    [B, N_r] (module docstring)."""
    name = ENGINE_SAMPLING
    where = [(k, b, i) for k, u in enumerate(drawn) for b, i in np.ndindex(u.shape)]
    values = np.concatenate([u.reshape(-1) for u in drawn])
    outside = np.flatnonzero(~((values >= 0) & (values < 1)))             # NaN too
    if outside.size:
        k, b, i = where[outside[0]]
        return Check(section, name, Status.FAIL,
                     detail=f"{_draw(k)}'s uniform [{b}, {i}] is {float(values[outside[0]])!r}, outside [0, 1)")
    order = np.argsort(values, kind="stable")
    repeats = np.flatnonzero(values[order][1:] == values[order][:-1])
    if repeats.size:
        (k0, b0, i0), (k, b, i) = where[order[repeats[0]]], where[order[repeats[0] + 1]]
        value = float(values[order[repeats[0]]])
        return Check(section, name, Status.FAIL,
                     detail=f"{repeats.size} of {len(values)} uniforms repeat an earlier draw: {_draw(k)}'s [{b}, {i}] "
                            f"= {_draw(k0)}'s [{b0}, {i0}] = {value!r} (a generator re-seeded, or a draw reused: "
                            f"every decision needs a fresh uniform)")
    pairs = [(u[:, :w].reshape(-1), v[:, :w].reshape(-1))
             for u, v in zip(drawn[1:], drawn[2:]) for w in [min(u.shape[1], v.shape[1])]]
    x, y = (np.concatenate(side) for side in zip(*pairs)) if pairs else (np.zeros(0), np.zeros(0))
    r = float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 else 0.0
    z = abs(r) * np.sqrt(len(x))
    detail = (f"{len(values)} uniforms over {len(drawn) - 1} rounds of {len(drawn[0])} requests, all distinct; "
              f"consecutive rounds correlate r = {r:+.3f} over {len(x)} pairs")
    if z >= CORRELATION_Z:
        return Check(section, name, Status.FAIL, detail=f"{detail}: |r| sqrt(pairs) = {z:.1f} >= {CORRELATION_Z:g} "
                                                        f"(rounds not independent)")
    return Check(section, name, Status.EXACT, detail=detail)


# ---- greedy ties, across vocabulary shards ----

def tied_logits(vocab: int, world: Any) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """-> (logits float32 [rows, V] of small integers, each row's maximum tied at two ids; the
    smaller id of each pair [rows]; each row's pair in words): the ids either side of every
    shard boundary of `world` (None: one device, no boundary), the first and the last id, and
    two ids inside the first shard."""
    size = world.size if world is not None else 1
    bounds = [world.part(vocab, r)[0] for r in range(1, size)] if world is not None else []
    pairs = [((b - 1, b), f"ids {b - 1}, {b} either side of the boundary of ranks {r} and {r + 1}")
             for r, b in enumerate(bounds)] + [((0, vocab - 1), f"ids 0, {vocab - 1}: the first and the last"),
                                               ((1, 2), "ids 1, 2")]
    logits = np.tile((np.arange(vocab) * 7 % 11).astype(np.float32), (len(pairs), 1))
    for row, ((a, b), _) in enumerate(pairs):
        logits[row, [a, b]] = 20.0
    return logits, np.array([a for (a, _), _ in pairs]), [words for _, words in pairs]


def ties_check(adapter: TorchAdapter, section: str) -> Check:
    model, world = adapter.model, adapter.model.world
    vocab = model.cfg.vocab_size
    logits, expected, words = tied_logits(vocab, world)
    lo, hi = world.part(vocab) if world is not None else (0, vocab)
    shard = torch.tensor(logits[:, lo:hi], device=model.device)
    gathered = world.gather(shard, vocab) if world is not None else shard
    choices = adapter.stages.greedy_choices(gathered[None])[0].cpu().numpy()
    margins = top2_margins(gathered).cpu().numpy()
    where = f"TP {world.size}: ties across its {world.size - 1} shard boundaries" if world is not None else \
        "one device"
    checks = [compare_exact(section, "gathered logits", gathered.cpu().numpy(), logits, where)]
    wrong = np.flatnonzero(choices != expected)
    if wrong.size:
        row = int(wrong[0])
        checks.append(Check(section, ENGINE_TIES, Status.FAIL,
                            detail=f"{words[row]} tie: chose {int(choices[row])}, expected {int(expected[row])} "
                                   f"({wrong.size} of {len(expected)} ties wrong; {where})"))
    checks.append(compare_exact(section, "tie margins", margins, np.zeros(len(expected)), where))
    row = merge(section, ENGINE_TIES, checks)
    return dataclasses.replace(row, detail=row.detail or f"{len(expected)} ties, each to the smaller id ({where})")


# ---- invariant mode: the same bits whatever the rows ----

def _bitwise(model: Any, prompts: list[np.ndarray], section: str) -> Check:
    device, lengths = model.device, [len(p) for p in prompts]
    width = max(lengths)
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(len(prompts), width, width)
    together = model.forward(tokens.to(device), torch.arange(width).expand(len(prompts), width).to(device),
                             causal.to(device), torch.tensor(lengths, device=device),
                             torch.zeros(len(prompts), dtype=torch.int64, device=device),
                             model.new_cache(len(prompts), width)).cpu()
    one = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
    for b, prompt in enumerate(prompts):
        cache = model.new_cache(1, len(prompt))
        for i, token in enumerate(prompt.tolist()):
            alone = model.forward(torch.tensor([[token]], device=device), torch.tensor([[i]], device=device), one,
                                  torch.tensor([1], device=device), torch.tensor([i], device=device), cache)[0, 0].cpu()
            differ = together[b, i] != alone
            if bool(differ.any()):
                return Check(section, ENGINE_BITWISE, Status.FAIL,
                             detail=f"prompt {b} token {i}: its logits in a prefill of {_prompts(len(prompts))} "
                                    f"({sum(lengths)} rows) differ from the same token alone in a 1-row forward in "
                                    f"{int(differ.sum())} of {len(alone)} values, by up to "
                                    f"{float((together[b, i] - alone).abs().max()):.3g}")
    return Check(section, ENGINE_BITWISE, Status.EXACT,
                 detail=f"{sum(lengths)} tokens of {_prompts(len(prompts))}: a ragged prefill of all of them and "
                        f"each token alone in a 1-row forward give the same bits")


def _prompts(n: int) -> str:
    return f"{n} prompt{'s' * (n != 1)}"


# ---- the batched decode loops ----

def _replay(fixture: ModelCases, model, stages, section: str, traces: list[Mapping[str, Any]],
            companions: list[str]) -> tuple[list[Check], DecodeResult]:
    """Traces of one block size and temperature in one batch, each with its own prompt, budget,
    length and (sampled) uniforms, beside companion requests: the fixture's prompts with flat
    drafts, whose tokens must be their AR tokens (DDTree greedy == AR greedy), so that a leak
    between requests has other requests to leak into. Whole sequences are compared."""
    ddtree = DDTreeConfig.from_dict(traces[0]["ddtree"])
    recorded = [{as_int(fixture[f"traces/{t['name']}/rounds/{r}/start"]):
                 fixture[f"traces/{t['name']}/rounds/{r}/draft_logits"] for r in range(t["rounds"])}
                for t in traces] + [{} for _ in companions]
    prompts = [fixture[f"prompts/{t['prompt']}/tokens"] for t in traces] + \
              [fixture[f"prompts/{p}/tokens"] for p in companions]
    budgets = [int(t["ddtree"]["budget"]) for t in traces]
    budgets += [max(budgets)] * len(companions)
    lengths = [int(t["max_new_tokens"]) for t in traces] + \
              [len(fixture[f"prompts/{p}/ar/tokens"]) for p in companions]
    uniforms = _recorded_uniforms(fixture, traces, max(budgets) + 1) if ddtree.temperature > 0 else None
    result = ddtree_decode(model, ReplayDrafter(recorded, fixture.cfg.vocab_size, model.device), prompts, ddtree,
                           lengths, budgets=budgets, stages=stages, record=True, uniforms=uniforms)
    rows = []
    for t, request in zip(traces, result.requests):
        name = t["name"]
        margins = fixture[f"traces/{name}/margins"] if ddtree.temperature > 0 else \
            fixture[f"prompts/{t['prompt']}/ar/margins"]
        ar_reached, taints = fixture.ar_reached(t["prompt"])
        trace_rows = [fixture.tokens(section, "tokens", request.tokens, fixture[f"traces/{name}/tokens"], margins,
                                  f"trace {name}", reached=ar_reached, sequence=True)]
        lengths = compare_exact(section, "acceptance lengths", request.acceptance_lengths,
                                fixture[f"traces/{name}/acceptance_lengths"], f"trace {name}")
        for r, got in enumerate(request.rounds[:t["rounds"]]):
            rp, where = f"traces/{name}/rounds/{r}", f"trace {name} round {r}"
            # The engine computed its own top-k from the draft logits here, and the contract lets
            # top-k lp differ by a float32 ulp between implementations. Where they do and the tree
            # then differs, that is a score near-tie, not a bug: the round's rows are near-ties (the
            # bit-exact tree build from the fixture's top-k is checked on its own, and the committed
            # tokens above stay exact). Scores are compared with the log-prob tolerance.
            round_rows = [compare_exact(section, what, getattr(got, what).numpy(), fixture[f"{rp}/{what}"],
                                        where) for what in ("parents", "tokens", "depths", "accepted")]
            round_rows += [
                fixture.close(section, "scores", got.scores.numpy(), fixture[f"{rp}/scores"], "logprobs", where),
                fixture.tokens(section, "choices", got.choices.numpy(), fixture[f"{rp}/choices"],
                            fixture[f"{rp}/margins"], where, reached=fixture.tree_reached(rp, taints)),
                compare_exact(section, "next root", got.next_root, as_int(fixture[f"{rp}/next_root"]), where)]
            round_rows = replayed_round(round_rows, tree_rows=3,
                                        same_topk=np.array_equal(got.topk_lp.numpy(), fixture[f"{rp}/topk_lp"]))
            choices_tied = any(row.name == "choices" and row.status is Status.NEAR_TIE for row in round_rows)
            trace_rows += follow_near_tie(round_rows, choices_tied, ("accepted", "next root"))
            if any(row.status is Status.NEAR_TIE for row in round_rows):
                break                       # the request left the recorded path: later rounds are not comparable
        tied = any(row.status is Status.NEAR_TIE for row in trace_rows)
        rows += trace_rows + follow_near_tie([lengths], tied, ("acceptance lengths",))
    beside = ", ".join(t["name"] for t in traces)
    for p, request in zip(companions, result.requests[len(traces):]):
        rows.append(fixture.tokens(section, "tokens", request.tokens, fixture[f"prompts/{p}/ar/tokens"],
                                fixture[f"prompts/{p}/ar/margins"],
                                f"prompt {p} with flat drafts, batched with trace {beside}",
                                reached=fixture.ar_reached(p)[0], sequence=True))
    return rows, result


def _recorded_uniforms(fixture: ModelCases, traces: list[Mapping[str, Any]], width: int) -> list[torch.Tensor]:
    """The traces' recorded uniforms as ddtree_decode takes them: [B, 1] for the prefill, then
    [B, width] per round, as many rounds as an engine that commits one token a round needs
    (0.5 where a request has no recorded round or node)."""
    rounds = max(int(t["max_new_tokens"]) for t in traces)
    table = [torch.full((len(traces), 1 if r == 0 else width), 0.5, dtype=torch.float64)
             for r in range(rounds + 1)]
    for b, t in enumerate(traces):
        table[0][b, 0] = float(fixture[f"traces/{t['name']}/prefill_uniform"])
        for r in range(int(t["rounds"])):
            u = fixture[f"traces/{t['name']}/rounds/{r}/uniforms"]
            table[r + 1][b, :len(u)] = torch.tensor(u)
    return table


def _batch_key(trace: Mapping[str, Any]) -> tuple[int, float]:
    """What one engine decode call shares: the block size and the temperature."""
    return int(trace["ddtree"]["block_size"]), float(trace["ddtree"].get("temperature", 0.0))


def _engine_row(section: str, name: str, rows: Callable[[], list[Check]]) -> Check:
    """The built-in engine's row: its comparisons merged (one that is the row already, as it
    is), or a FAIL naming what it raised."""
    try:
        found = rows()
    except Exception as exc:
        return Check(section, name, Status.FAIL, detail=f"the engine raised {type(exc).__name__}: {exc}")
    return found[0] if len(found) == 1 and found[0].name == name else merge(section, name, found)


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
