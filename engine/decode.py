"""Batched decoding: autoregressive (greedy or sampled) and DDTree (greedy or sampled).

Every request of a batch has its own prompt length, cache start, tree and
acceptance; requests that are done (max_new_tokens committed, or a stop token
emitted) sit out the remaining rounds with no new tokens.

State before a DDTree round (docs/ddtree-semantics.md): `start` tokens have
their KV in the cache; the root (the last committed token) is committed but
not cached. A round drafts L = block_size - 1 depths, builds a tree of at most
`budget` nodes under the root, verifies the n + 1 tree tokens in one target
forward with the ancestor-only mask, follows the target's choices down the
tree, compacts the accepted path's KV to slots start .. start + a - 1 and
commits a tokens. DDTree greedy emits exactly the AR greedy tokens.

`max_new_tokens` (one for all requests, or one per request) counts every
committed token, the first one (the argmax of the prefill's last logits)
included, as the fixtures' `ar/tokens` do.

`model` is a `Transformer` or an `engine.graphs.GraphedModel`. With the latter, greedy
AR runs each step as one CUDA graph, and greedy DDTree with `CudaStages` runs each round
after the draft as three (build, verify, accept; record=True takes the eager path): the
host reads back the committed tokens once per step or round. The device times of the
graphs go to the stages "build", "verify" and "accept". In every decode the rest of a round's
wall time (its inputs' copy, committing its tokens) goes to "host" (`StageTimer.round`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kdtr_format import DDTreeConfig

from .cuda_stages import CudaStages
from .drafters import Drafter
from .graphs import GraphedModel
from .metrics import DecodeMetrics, StageTimer
from .stages import Stages, TorchStages, top2_margins


@dataclass
class RoundRecord:
    """One DDTree round of one request, for comparison with a fixture trace."""

    start: int
    root: int
    topk_lp: torch.Tensor   # [L, K] float32
    topk_id: torch.Tensor   # [L, K] int64
    parents: torch.Tensor   # [n+1] int64
    tokens: torch.Tensor    # [n+1] int64, tokens[0] = root
    depths: torch.Tensor    # [n+1] int64
    scores: torch.Tensor    # [n+1] float64
    choices: torch.Tensor   # [n+1] int64
    accepted: torch.Tensor  # [a] int64
    next_root: int


@dataclass
class RequestResult:
    """One request's output: committed tokens, the top1 - top2 logit margin of
    each greedy decision behind them (NaN when sampled), and its own counts."""

    tokens: list[int]
    margins: list[float]
    target_forwards: int
    acceptance_lengths: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)


@dataclass
class DecodeResult:
    requests: list[RequestResult]
    metrics: DecodeMetrics

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]


def ar_decode(model, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int | Sequence[int], *,
              stop_tokens: Sequence[int] = (), temperature: float = 0.0,
              generator: torch.Generator | None = None,
              stages: Stages | None = None) -> DecodeResult:
    """Autoregressive decoding: prefill, then one target forward per token.

    temperature 0 is greedy; above 0 each token is drawn by inverse CDF with a
    uniform from `generator` (one [B] draw per step, float64, on the CPU).
    """
    stages = stages or TorchStages()
    batch = _Batch(model, prompts, max_new_tokens, stop_tokens, extra_slots=0)
    last = batch.prefill(stages, temperature, generator)
    step = model.ar_step(batch.cache, stages) if isinstance(model, GraphedModel) and temperature == 0 else None
    if step is not None:
        step.load(last.to(batch.device), torch.tensor(batch.starts, device=batch.device))
    while batch.any_active:
        with batch.timer.round():
            active = batch.active_list()
            if step is not None:
                with batch.timer("verify"):
                    choices, margins = step(active)
            else:
                starts = torch.tensor(batch.starts, device=batch.device)
                with batch.timer("verify"):
                    logits = model.forward(last[:, None].to(batch.device), starts[:, None],
                                           torch.ones(batch.size, 1, 1, dtype=torch.bool, device=batch.device),
                                           torch.tensor(active, device=batch.device).long(), starts, batch.cache,
                                           check=False)
                with batch.timer("accept"):
                    uniforms = _uniforms(generator, batch.size, 1) if temperature > 0 else None
                    choice_t, margin_t = _choose(stages, logits, temperature, uniforms)
                    last = choice_t[:, 0].cpu()
                    choices, margins = last.tolist(), margin_t[:, 0].tolist()
            batch.rounds += 1
            for b in range(batch.size):
                if active[b]:
                    batch.starts[b] += 1
                    batch.requests[b].acceptance_lengths.append(1)
                    batch.commit(b, [choices[b]], [margins[b]])
            if step is None:
                batch.sync_cache_lengths()
    return batch.result()


def ddtree_decode(model, drafter: Drafter | None, prompts: Sequence[Sequence[int] | torch.Tensor],
                  ddtree: DDTreeConfig, max_new_tokens: int | Sequence[int], *, stop_tokens: Sequence[int] = (),
                  budgets: Sequence[int] | None = None, generator: torch.Generator | None = None,
                  uniforms: Sequence[torch.Tensor] | None = None, stages: Stages | None = None,
                  record: bool = False) -> DecodeResult:
    """DDTree decoding, batched. Greedy at ddtree.temperature 0, else sampled.

    budgets: a per-request node budget (default ddtree.budget for all).
    drafter: may be None only when ddtree.depth == 0 (the tree is the root alone).
    Sampling uniforms, one per decision: when given, `uniforms[0]` [B, >= 1] float64 for
    the prefill's first token and `uniforms[r + 1]` [B, >= Nmax] for round r (a fixture's
    recorded uniforms replay its sampled trace exactly); else drawn from `generator`
    (torch.rand on the CPU, float64), independently for every node.
    record: keep every round's tree, choices and acceptance (RequestResult.rounds).
    """
    stages = stages or TorchStages()
    depth = ddtree.depth
    if depth > 0 and drafter is None:
        raise ValueError(f"ddtree_decode: block_size {ddtree.block_size} needs a drafter")
    request_budgets = [ddtree.budget] * len(prompts) if budgets is None else list(budgets)
    if len(request_budgets) != len(prompts):
        raise ValueError(f"ddtree_decode: {len(request_budgets)} budgets for {len(prompts)} prompts")
    if any(not isinstance(b, int) or b < 0 for b in request_budgets):
        raise ValueError(f"ddtree_decode: budgets must be integers >= 0, got {request_budgets}")
    sampled = ddtree.temperature > 0
    if sampled and generator is None and uniforms is None:
        raise ValueError("ddtree_decode: sampling needs a generator or per-round uniforms")

    batch = _Batch(model, prompts, max_new_tokens, stop_tokens,
                   extra_slots=min(max(request_budgets), _tree_capacity(depth, model.cfg.vocab_size)) + 1)
    vocab = model.cfg.vocab_size
    k = min(max(request_budgets), vocab)            # K = min(B, V); the widest budget serves all
    roots = batch.prefill(stages, ddtree.temperature, generator, None if uniforms is None else uniforms[0])
    graphed = (model.ddtree_round(batch.cache, depth, k, max(request_budgets))
               if isinstance(model, GraphedModel) and isinstance(stages, CudaStages) and depth > 0
               and not sampled and not record else None)
    if graphed is not None:
        graphed.load(roots.to(batch.device), torch.tensor(batch.starts, device=batch.device))
    while batch.any_active:
        with batch.timer.round():
            active = batch.active_list()
            budgets = [budget if on else 0 for budget, on in zip(request_budgets, active)]
            if graphed is not None:
                with batch.timer("draft"):
                    draft_logits = drafter.draft(batch.contexts(), graphed.roots, depth)
                result = graphed(draft_logits, budgets, active)
                for stage, seconds in result.seconds.items():
                    batch.timer.seconds[stage] += seconds
                accept_len, next_root = result.accept_len, result.next_root
                path_tokens, path_margins = result.path_tokens, result.path_margins
            else:
                # the round's inputs in one copy to the device: budgets, roots, starts, activity
                round_budgets, roots_dev, starts_dev, active_dev = torch.tensor(
                    [budgets, roots.tolist(), batch.starts, active], dtype=torch.int64).to(batch.device)
                active_dev = active_dev.bool()
                with batch.timer("draft"):
                    if depth > 0:
                        draft_logits = drafter.draft(batch.contexts(), roots_dev, depth)
                with batch.timer("build"):
                    if depth > 0:
                        topk_lp, topk_id = stages.topk_logprobs(draft_logits, k)
                    else:
                        topk_lp = torch.zeros(batch.size, 0, k, dtype=torch.float32, device=batch.device)
                        topk_id = torch.zeros(batch.size, 0, k, dtype=torch.int64, device=batch.device)
                    trees = stages.build_trees(topk_lp, topk_id, round_budgets, roots_dev)
                with batch.timer("compile"):
                    compiled = stages.compile_trees(trees, starts_dev)
                n_new = trees.n.to(batch.device) + 1
                with batch.timer("verify"):
                    logits = model.forward(trees.tokens.clamp(min=0), compiled.positions, compiled.visibility,
                                           torch.where(active_dev, n_new, 0), starts_dev, batch.cache,
                                           check=False)
                with batch.timer("accept"):
                    round_uniforms = None
                    if sampled:
                        round_uniforms = (uniforms[batch.rounds + 1] if uniforms is not None
                                          else _uniforms(generator, batch.size, logits.shape[1]))
                        round_uniforms = round_uniforms[:, :logits.shape[1]]
                    choices = _choices(stages, logits, ddtree.temperature, round_uniforms)
                    accepted, accept_len_t, next_root_t = stages.accept(trees, choices)
                with batch.timer("compact"):
                    stages.compact_kv(batch.cache, starts_dev, accepted, accept_len_t)
                path = accepted.clamp(min=0)
                accept_len, next_root = accept_len_t.tolist(), next_root_t.tolist()
                path_tokens = [row[:a] for row, a in zip(trees.tokens.gather(1, path).tolist(), accept_len)]
                path_margins = [row[:a] for row, a in
                                zip(_margins(logits, ddtree.temperature, path).tolist(), accept_len)]
                if record:
                    accepted, choices = accepted.cpu(), choices.cpu()
                    for b in range(batch.size):
                        if active[b]:
                            batch.requests[b].rounds.append(_record(
                                b, batch.starts[b], int(roots[b]), topk_lp, topk_id, trees, choices,
                                accepted[b, :accept_len[b]], next_root[b]))
                roots = next_root_t.cpu()
            batch.rounds += 1
            for b in range(batch.size):
                if not active[b]:
                    continue
                a = accept_len[b]
                batch.starts[b] += a
                batch.requests[b].acceptance_lengths.append(a)
                batch.commit(b, path_tokens[b][1:] + [next_root[b]], path_margins[b])
            if graphed is None:
                batch.sync_cache_lengths()
    return batch.result()


def _tree_capacity(depth: int, vocab: int) -> int:
    """The most non-root nodes a tree of `depth` levels over `vocab` tokens can hold."""
    total, level = 0, 1
    for _ in range(depth):
        level *= vocab
        total += level
        if total > 1 << 40:
            break
    return total


class _Batch:
    """Per-request outputs, starts and activity for one decode call."""

    def __init__(self, model, prompts, max_new_tokens: int | Sequence[int], stop_tokens: Sequence[int],
                 extra_slots: int) -> None:
        cfg = model.cfg
        self.model = model
        self.prompts = [_as_prompt(p, cfg.vocab_size, i) for i, p in enumerate(prompts)]
        if not self.prompts:
            raise ValueError("no prompts given")
        self.size = len(self.prompts)
        limits = [max_new_tokens] * self.size if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != self.size or any(not isinstance(n, int) or n < 1 for n in limits):
            raise ValueError(f"max_new_tokens must be an integer >= 1 or one per prompt, got {max_new_tokens!r}")
        self.max_new_tokens = limits
        ends = [len(p) + n for p, n in zip(self.prompts, limits)]
        longest = max(ends)
        if longest > cfg.max_position_embeddings:
            b = ends.index(longest)
            raise ValueError(f"prompt {b} ({len(self.prompts[b])} tokens) plus max_new_tokens {limits[b]} "
                             f"exceeds max_position_embeddings {cfg.max_position_embeddings}")
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.device = torch.device(model.device)
        self.cache = model.new_cache(self.size, longest + extra_slots)
        self.starts = [len(p) for p in self.prompts]         # cached tokens per request
        self.requests = [RequestResult([], [], 0, []) for _ in self.prompts]
        self.done = [False] * self.size
        self.rounds = 0
        self.timer = StageTimer(self.device)

    @property
    def any_active(self) -> bool:
        return not all(self.done)

    def active_list(self) -> list[bool]:
        return [not d for d in self.done]

    def contexts(self) -> list[torch.Tensor]:
        """Per request: every cached token (the prompt, then committed tokens but the root)."""
        return [torch.cat([p, torch.tensor(r.tokens[:-1], dtype=torch.int64)])
                for p, r in zip(self.prompts, self.requests)]

    def prefill(self, stages: Stages, temperature: float, generator: torch.Generator | None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward of every prompt; commits and returns the first tokens [B]
        (sampled with uniforms[:, 0] when given, else with uniforms from `generator`)."""
        lengths = torch.tensor(self.starts)
        width = int(lengths.max())
        tokens = torch.zeros(self.size, width, dtype=torch.int64)
        for b, p in enumerate(self.prompts):
            tokens[b, :len(p)] = p
        positions = torch.arange(width).expand(self.size, width)
        causal = torch.ones(width, width, dtype=torch.bool).tril().expand(self.size, width, width)
        with self.timer("prefill"):
            logits = self.model.forward(tokens.to(self.device), positions.to(self.device),
                                        causal.to(self.device), lengths.to(self.device),
                                        torch.zeros(self.size, dtype=torch.int64, device=self.device),
                                        self.cache, check=False)
            last = logits[torch.arange(self.size, device=self.device), (lengths - 1).to(self.device)]
            if temperature > 0:
                uniforms = uniforms[:, :1] if uniforms is not None else _uniforms(generator, self.size, 1)
            choices, margins = _choose(stages, last[:, None], temperature, uniforms)
        self.sync_cache_lengths()
        for b in range(self.size):
            self.commit(b, [int(choices[b, 0])], [float(margins[b, 0])])
        return choices[:, 0].cpu()

    def commit(self, b: int, tokens: list[int], margins: list[float]) -> None:
        """Append tokens to request b up to max_new_tokens or the first stop token."""
        request = self.requests[b]
        request.target_forwards += 1
        for token, margin in zip(tokens, margins):
            request.tokens.append(token)
            request.margins.append(margin)
            if len(request.tokens) >= self.max_new_tokens[b] or token in self.stop_tokens:
                self.done[b] = True
                return

    def sync_cache_lengths(self) -> None:
        self.cache.lengths.copy_(torch.tensor(self.starts))

    def result(self) -> DecodeResult:
        acceptance = [a for r in self.requests for a in r.acceptance_lengths]
        metrics = DecodeMetrics(tokens=sum(len(r.tokens) for r in self.requests), rounds=self.rounds,
                                target_forwards=self.rounds + 1,
                                acceptance_lengths=acceptance,
                                stage_seconds=dict(self.timer.seconds))
        return DecodeResult(self.requests, metrics)


def _as_prompt(prompt, vocab_size: int, index: int) -> torch.Tensor:
    """prompt [m] int64 on the CPU, checked against the vocabulary."""
    tokens = torch.tensor(np.asarray(prompt), dtype=torch.int64).reshape(-1)
    if tokens.numel() == 0:
        raise ValueError(f"prompt {index} is empty")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size})")
    return tokens


def _uniforms(generator: torch.Generator | None, batch: int, width: int) -> torch.Tensor:
    """uniforms [batch, width] float64 on the CPU."""
    return torch.rand(batch, width, generator=generator, dtype=torch.float64)


def _choices(stages: Stages, logits: torch.Tensor, temperature: float,
             uniforms: torch.Tensor | None) -> torch.Tensor:
    """logits [B, N, V] -> choices [B, N] int64: greedy at temperature 0, else sampled."""
    if temperature > 0:
        return stages.sample_choices(logits, temperature, uniforms.to(logits.device))
    return stages.greedy_choices(logits)


def _margins(logits: torch.Tensor, temperature: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, N, V] -> the top-1 minus top-2 margins float64 [B, N] (rows [B, P]: of those rows
    only, [B, P]); NaN when sampled."""
    if temperature > 0:
        shape = logits.shape[:2] if rows is None else rows.shape
        return torch.full(shape, float("nan"), dtype=torch.float64, device=logits.device)
    return top2_margins(logits, rows)


def _choose(stages: Stages, logits: torch.Tensor, temperature: float,
            uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, N, V] -> (choices [B, N] int64, margins [B, N] float64; NaN when sampled)."""
    return _choices(stages, logits, temperature, uniforms), _margins(logits, temperature)


def _record(b: int, start: int, root: int, topk_lp: torch.Tensor, topk_id: torch.Tensor, trees,
            choices: torch.Tensor, accepted: torch.Tensor, next_root: int) -> RoundRecord:
    count = int(trees.n[b]) + 1
    return RoundRecord(start=start, root=root, topk_lp=topk_lp[b].cpu(), topk_id=topk_id[b].cpu(),
                       parents=trees.parents[b, :count].cpu(), tokens=trees.tokens[b, :count].cpu(),
                       depths=trees.depths[b, :count].cpu(), scores=trees.scores[b, :count].cpu(),
                       choices=choices[b, :count].clone(), accepted=accepted.clone(),
                       next_root=next_root)
