"""Reference decoding loops: AR greedy and DDTree (greedy or sampling), in numpy.

Both loops drive any `Target` with refgen.model.Model's forward contract and
record everything a fixture stores (docs/fixtures.md): AR tokens and margins,
and for DDTree every round's draft, top-k, tree, compiled tree, verify logits,
choices, accept path and compaction map.

State between rounds (docs/ddtree-semantics.md): `start` tokens have KV in the cache;
the root (the last committed token) is committed to the output but not cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from kdtr_format import DDTreeConfig, ModelConfig

from .ddtree import (CompiledTree, Tree, accept, build_tree, check_int, compact, compile_tree,
                     greedy_choices, max_nodes, sample_choices, sample_margins, topk_logprobs,
                     visibility_over_cache)
from .drafters import Drafter
from .model import KVCache


class Target(Protocol):
    """What the loops need of a model (refgen.model.Model meets it)."""

    cfg: ModelConfig

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                cache: KVCache, start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility bool [n, start+n] -> logits float64 [n, V];
        writes token i's KV at cache slot start + i."""
        ...


@dataclass
class ARResult:
    """tokens int64 [N] (the first is the argmax of the prompt's last prefill logits),
    margins float64 [N] (top-1 minus top-2 logit of each decision),
    prefill_logits float64 [m, V], target_forwards (the prefill counts as one)."""

    tokens: np.ndarray
    margins: np.ndarray
    prefill_logits: np.ndarray
    target_forwards: int


@dataclass
class Round:
    """One DDTree round: the per-round tensors of docs/fixtures.md.

    start: cache length before the round; root: its root token; draft_logits
    float32 [L, V]; topk_lp float32 [L, K]; topk_id int64 [L, K]; tree (root
    set); compiled; verify_logits float64 [n+1, V]; choices int64 [n+1];
    margins float64 [n+1]; accepted int64 [a]; next_root; compaction_src int64
    [a] = start + accepted (the slot copied to slot start + k); uniforms float64
    [n+1] when sampling, else None.
    """

    start: int
    root: int
    draft_logits: np.ndarray
    topk_lp: np.ndarray
    topk_id: np.ndarray
    tree: Tree
    compiled: CompiledTree
    verify_logits: np.ndarray
    choices: np.ndarray
    margins: np.ndarray
    accepted: np.ndarray
    next_root: int
    compaction_src: np.ndarray
    uniforms: np.ndarray | None = None


@dataclass
class DDTreeResult:
    """tokens int64 [N]; margins float64 [N]: the margin of the decision behind each
    token (the prefill's for the first, then each accepted node's choice; as
    Round.margins); target_forwards = 1 (prefill) + len(rounds);
    acceptance_lengths int64 [R] (a per round, before truncation); rounds;
    prefill_uniform: the uniform that sampled the first token (None when greedy)."""

    tokens: np.ndarray
    margins: np.ndarray
    target_forwards: int
    acceptance_lengths: np.ndarray
    rounds: list[Round] = field(default_factory=list)
    prefill_uniform: float | None = None


def _check_prompt(prompt: np.ndarray, vocab_size: int) -> np.ndarray:
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or len(prompt) == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt: expected a non-empty 1-D integer array, got {prompt.dtype} {prompt.shape}")
    if ((prompt < 0) | (prompt >= vocab_size)).any():
        raise ValueError(f"prompt: token ids must lie in [0, {vocab_size})")
    return prompt.astype(np.int64)


def _prefill(target: Target, prompt: np.ndarray, max_len: int) -> tuple[KVCache, np.ndarray]:
    """Causal forward of the prompt at positions 0..m-1 -> (cache, logits float64 [m, V])."""
    m = len(prompt)
    cache = KVCache.new(target.cfg, max_len)
    causal = np.tril(np.ones((m, m), dtype=bool))
    return cache, target.forward(prompt, np.arange(m, dtype=np.int64), causal, cache, 0)


def _until_stop(tokens: list[int], max_new_tokens: int, stop_tokens: Sequence[int]) -> np.ndarray:
    """The first max_new_tokens tokens, cut just after the first stop token."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_tokens:
            tokens = tokens[:i + 1]
            break
    return np.array(tokens, dtype=np.int64)


def ar_greedy(target: Target, prompt: np.ndarray, max_new_tokens: int,
              stop_tokens: Sequence[int] = ()) -> ARResult:
    """Prefill, then one single-token forward per generated token after the first."""
    prompt = _check_prompt(prompt, target.cfg.vocab_size)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
    m = len(prompt)
    cache, prefill_logits = _prefill(target, prompt, m + max_new_tokens)
    forwards = 1
    if max_new_tokens == 0:
        return ARResult(np.zeros(0, dtype=np.int64), np.zeros(0), prefill_logits, forwards)
    choice, margin = greedy_choices(prefill_logits[-1:])
    tokens, margins = [int(choice[0])], [float(margin[0])]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_tokens:
        position = m + len(tokens) - 1
        logits = target.forward(np.array(tokens[-1:], dtype=np.int64),
                                np.array([position], dtype=np.int64),
                                np.ones((1, position + 1), dtype=bool), cache, position)
        forwards += 1
        choice, margin = greedy_choices(logits)
        tokens.append(int(choice[0]))
        margins.append(float(margin[0]))
    return ARResult(np.array(tokens, dtype=np.int64), np.array(margins), prefill_logits, forwards)


MARGIN_FLOOR_DRAWS = 64     # redraws of one uniform whose decision is too near a CDF boundary


def ddtree_decode(target: Target, drafter: Drafter, prompt: np.ndarray, ddtree: DDTreeConfig,
                  max_new_tokens: int, stop_tokens: Sequence[int] = (),
                  uniforms_seed: int | None = None, margin_floor: float = 0.0) -> DDTreeResult:
    """Prefill, then DDTree rounds (draft, top-k, build, compile, verify, accept, compact)
    until max_new_tokens are committed (the last round truncated) or a stop token.

    temperature 0: greedy choices (the output equals `ar_greedy`'s). temperature > 0:
    every choice, the first token's included, is sampled by inverse CDF from uniforms
    drawn by np.random.default_rng(uniforms_seed): one for the first token (recorded in
    DDTreeResult.prefill_uniform), then one per tree node, drawn independently, per
    round (recorded in Round.uniforms). margin_floor > 0 (fixtures only): a uniform
    whose decision's margin (ddtree.sample_margins) is below it is drawn again, up to
    MARGIN_FLOOR_DRAWS times, so that every recorded decision lies away from a CDF
    boundary; the recorded uniforms are then not uniform, and the run is no sample
    of the target distribution, but it is reproduced exactly from its uniforms.
    """
    if not isinstance(ddtree, DDTreeConfig):
        raise ValueError(f"ddtree: expected a kdtr_format.DDTreeConfig, got {type(ddtree).__name__}")
    vocab_size = target.cfg.vocab_size
    if drafter.vocab_size != vocab_size:
        raise ValueError(f"drafter: vocab_size {drafter.vocab_size} differs from the target's {vocab_size}")
    prompt = _check_prompt(prompt, vocab_size)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
    L, budget, temperature = ddtree.depth, ddtree.budget, ddtree.temperature
    rng = np.random.default_rng(uniforms_seed)

    def choose(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """logits [n, V] -> (choices [n], margins [n], uniforms [n] or None)."""
        if temperature == 0:
            return (*greedy_choices(logits), None)
        uniforms = rng.random(len(logits))
        margins = sample_margins(logits, temperature, uniforms)
        for _ in range(MARGIN_FLOOR_DRAWS):
            near = margins < margin_floor
            if not near.any():
                break
            uniforms[near] = rng.random(int(near.sum()))
            margins[near] = sample_margins(logits[near], temperature, uniforms[near])
        return sample_choices(logits, temperature, uniforms), margins, uniforms

    m = len(prompt)
    n_max = min(budget, max_nodes(L, min(budget, vocab_size)))
    cache, prefill_logits = _prefill(target, prompt, m + max_new_tokens + n_max)
    if max_new_tokens == 0:
        return DDTreeResult(np.zeros(0, dtype=np.int64), np.zeros(0), 1, np.zeros(0, dtype=np.int64))
    first, first_margin, prefill_uniform = choose(prefill_logits[-1:])
    output, output_margins = [int(first[0])], [float(first_margin[0])]
    start, rounds = m, []
    stopped = output[-1] in stop_tokens
    while len(output) < max_new_tokens and not stopped:
        root = output[-1]
        context = np.concatenate([prompt, np.array(output, dtype=np.int64)])
        draft_logits = np.asarray(drafter(context, L))
        if draft_logits.shape != (L, vocab_size) or draft_logits.dtype != np.float32:
            raise ValueError(f"drafter: expected float32 [{L}, {vocab_size}], "
                             f"got {draft_logits.dtype} {draft_logits.shape}")
        topk_lp, topk_id = topk_logprobs(draft_logits, budget)
        tree = build_tree(topk_lp, topk_id, budget).with_root(root)
        compiled = compile_tree(tree, start)
        verify_logits = target.forward(tree.tokens, compiled.positions,
                                       visibility_over_cache(compiled, start), cache, start)
        choices, margins, uniforms = choose(verify_logits)
        accepted, next_root = accept(tree, choices)
        for layer_cache in (*cache.c_kv, *cache.k_pe):
            compact(layer_cache, start, accepted)
        rounds.append(Round(start, root, draft_logits, topk_lp, topk_id, tree, compiled,
                            verify_logits, choices, margins, accepted, next_root,
                            start + accepted, uniforms))
        committed = [*tree.tokens[accepted[1:]].tolist(), next_root]
        output.extend(committed)
        output_margins.extend(margins[accepted].tolist())
        stopped = any(token in stop_tokens for token in committed)
        start += len(accepted)
    tokens = _until_stop(output, max_new_tokens, stop_tokens)
    return DDTreeResult(tokens, np.array(output_margins[:len(tokens)]), 1 + len(rounds),
                        np.array([len(r.accepted) for r in rounds], dtype=np.int64), rounds,
                        None if prefill_uniform is None else float(prefill_uniform[0]))
