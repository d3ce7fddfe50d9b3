"""Drafters: where a DDTree round's per-depth distributions come from.

One interface, `Drafter.draft(contexts, roots, depth) -> draft_logits [B, L, V]`:
contexts[b] holds request b's cached tokens (the prompt and every committed
token but the root), roots[b] the root (the last committed token), and row
d - 1 of the output is the drafter's distribution for the token d places after
the root (L = depth). Every drafter here gives a request the same logits
whatever the rest of its batch holds, so batch independence can be tested.

- `OracleDrafter`: noise around the true continuation with a chosen accuracy.
  An UPPER BOUND, not a drafter: it reads the answer (an AR run's tokens).
- `RandomDrafter`: plain noise; acceptance near 1 token a round.
- `ReplayDrafter`: the draft logits a fixture trace recorded, so that the
  engine replays refgen's exact drafts.
- `LayerSkipDrafter`: a real self-drafter (LayerSkip-style early exit). The
  first k target layers, the final norm and the lm_head form a shallow model
  with its own KV cache. Each round it feeds the committed tokens it has not
  seen plus the root (depth 1's distribution is the logits at the root), then
  runs depth - 1 greedy steps, feeding its own argmax back in (depth d's
  distribution is conditioned on its guesses for depths < d). The guessed
  slots are overwritten next round; only committed tokens stay cached.
  Cost per round: depth shallow forwards of k layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from kdtr_format import ModelConfig

from .cache import KVCache
from .model import Transformer


class Drafter(Protocol):
    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        """contexts: B int64 [c_b] (CPU); roots [B] int64 -> draft_logits [B, depth, V] float32."""
        ...


def hit_logit(logits: torch.Tensor, accuracy: float, confidence: float | None) -> torch.Tensor:
    """The oracle's logit for the true token where it is drafted top-1: [...] from noise logits
    [..., V]. `confidence` above the best noise logit; or, with confidence None, calibrated:
    logsumexp(noise) + log(p / (1 - p)) with p the accuracy within [0.001, 0.999], so that the
    true token's probability is the accuracy itself and the tree's path probabilities are the
    drafter's hit rates (a fixed margin over noise on a large vocabulary gives the truth a small probability,
    and a budgeted tree then spends its nodes on siblings instead of depth)."""
    if confidence is not None:
        return logits.amax(-1) + confidence
    p = min(max(accuracy, 0.001), 0.999)
    return torch.logsumexp(logits, -1) + math.log(p / (1.0 - p))


def _request_generator(seed: int, context: torch.Tensor, root: int, device: torch.device) -> torch.Generator:
    """A generator seeded by the request's own state (never its batch slot)."""
    key = (seed, len(context), int(root), tuple(context[-4:].tolist()))
    generator = torch.Generator(device=device)
    generator.manual_seed(hash(key) & ((1 << 63) - 1))
    return generator


class RandomDrafter:
    """Gaussian logits (std `scale`), seeded per request state."""

    def __init__(self, vocab_size: int, seed: int = 0, scale: float = 1.0,
                 device: str | torch.device = "cpu") -> None:
        self.vocab_size, self.seed, self.scale = vocab_size, seed, scale
        self.device = torch.device(device)

    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        out = [torch.randn(depth, self.vocab_size, device=self.device,
                           generator=_request_generator(self.seed, ctx, root, self.device)) * self.scale
               for ctx, root in zip(contexts, roots.tolist())]
        return torch.stack(out)


class OracleDrafter:
    """Noise around the true continuation (an upper bound: it knows the answer).

    sequences[b]: request b's true token sequence (its prompt, then the AR output).
    The noise is standard normal. At each depth the true token is top-1 with
    probability `accuracy`, at `hit_logit` (`confidence` above the best noise logit,
    or calibrated with confidence None); otherwise it lands at rank 1 to 3 (half the
    misses) or at the very bottom. Depths past the known sequence are noise.
    """

    def __init__(self, sequences: Sequence[Sequence[int] | torch.Tensor], vocab_size: int,
                 accuracy: float = 0.8, seed: int = 0, confidence: float | None = 4.0,
                 device: str | torch.device = "cpu") -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"oracle accuracy must lie in [0, 1], got {accuracy}")
        self.sequences = [torch.tensor(np.asarray(s), dtype=torch.int64).reshape(-1) for s in sequences]
        self.vocab_size, self.accuracy, self.seed, self.confidence = vocab_size, accuracy, seed, confidence
        self.device = torch.device(device)

    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        if len(contexts) != len(self.sequences):
            raise ValueError(f"oracle drafter knows {len(self.sequences)} sequences, got {len(contexts)} requests")
        return torch.stack([self._one(seq, ctx, root, depth)
                            for seq, ctx, root in zip(self.sequences, contexts, roots.tolist())])

    def _one(self, sequence: torch.Tensor, context: torch.Tensor, root: int, depth: int) -> torch.Tensor:
        """-> [depth, V] float32."""
        generator = _request_generator(self.seed, context, root, self.device)
        logits = torch.randn(depth, self.vocab_size, device=self.device, generator=generator)
        decide = torch.rand(depth, 2, device=self.device, generator=generator)     # hit?, where if missed
        truth_at = len(context) + 1 + torch.arange(depth)                           # sequence index per depth
        known = truth_at < len(sequence)
        if not bool(known.any()):
            return logits
        rows = torch.arange(depth, device=self.device)[known.to(self.device)]
        truth = sequence[truth_at[known]].to(self.device)                            # [k]
        top = logits[rows].topk(min(4, self.vocab_size), dim=-1).values             # [k, <=4]
        rank = (1 + (decide[rows, 1] * 2 * (top.shape[1] - 1)).long()).clamp(max=top.shape[1] - 1)
        between = (top.gather(1, (rank - 1)[:, None]) + top.gather(1, rank[:, None]))[:, 0] / 2
        missed = torch.where(decide[rows, 1] < 0.5, between, logits[rows].min(-1).values - 1.0)
        value = torch.where(decide[rows, 0] < self.accuracy, hit_logit(logits[rows], self.accuracy, self.confidence),
                            missed)
        logits[rows, truth] = value
        return logits


class ReplayDrafter:
    """Recorded draft logits: recorded[b][start] = [L, V] for request b at cache length start.

    A start with no record (a request that is already done, or one that left
    the recorded path) gets flat logits; a comparison of the rounds against the
    trace is what tells the second case.
    """

    def __init__(self, recorded: Sequence[Mapping[int, torch.Tensor | np.ndarray]], vocab_size: int,
                 device: str | torch.device = "cpu") -> None:
        self.recorded = [{int(s): torch.tensor(np.asarray(v), dtype=torch.float32) for s, v in r.items()}
                         for r in recorded]
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        out = []
        for b, ctx in enumerate(contexts):
            logits = self.recorded[b].get(len(ctx), torch.zeros(depth, self.vocab_size))
            if logits.shape != (depth, self.vocab_size):
                raise ValueError(f"replay drafter: request {b} recorded {list(logits.shape)}, "
                                 f"requested {[depth, self.vocab_size]}")
            out.append(logits)
        return torch.stack(out).to(self.device)


class LayerSkipDrafter:
    """The first `num_layers` target layers + final norm + lm_head, run greedily (module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor | np.ndarray], num_layers: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"layerskip: num_layers must lie in [1, {cfg.num_hidden_layers}], got {num_layers!r}")
        shallow = dataclasses.replace(cfg, num_hidden_layers=num_layers,
                                      first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))
        kept = {name: w for name, w in weights.items()
                if not name.startswith("layers.") or int(name.split(".")[1]) < num_layers}
        self.model = Transformer(shallow, kept, device=device, dtype=dtype)
        self.cache: KVCache | None = None
        self.cached: list[torch.Tensor] = []       # per request: the tokens whose KV the cache holds

    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        model, device = self.model, self.model.device
        sequences = [torch.cat([ctx, root.reshape(1).cpu()]) for ctx, root in zip(contexts, roots)]
        batch = len(sequences)
        need = max(len(s) for s in sequences) + depth
        if self.cache is None or self.cache.batch != batch or self.cache.max_len < need:
            self.cache = model.new_cache(batch, 2 * need)
            self.cached = [torch.zeros(0, dtype=torch.int64) for _ in range(batch)]
        reuse = torch.tensor([min(_common_prefix(c, s), len(s) - 1) for c, s in zip(self.cached, sequences)])
        lengths = torch.tensor([len(s) for s in sequences])
        n_new = lengths - reuse
        width = int(n_new.max())
        tokens = torch.zeros(batch, width, dtype=torch.int64)
        for b, s in enumerate(sequences):
            tokens[b, :n_new[b]] = s[reuse[b]:]
        positions = reuse[:, None] + torch.arange(width)[None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril().expand(batch, width, width)
        logits = model.forward(tokens.to(device), positions.to(device), causal.to(device), n_new.to(device),
                               reuse.to(device), self.cache)
        out = [logits[torch.arange(batch, device=device), (n_new - 1).to(device)]]          # [B, V]
        ones = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        for d in range(2, depth + 1):
            slot = (lengths + d - 2).to(device)
            step = model.forward(out[-1].argmax(-1)[:, None], slot[:, None], ones,
                                 torch.ones(batch, dtype=torch.int64, device=device), slot, self.cache)
            out.append(step[:, 0])
        self.cached = sequences
        return torch.stack(out[:depth], dim=1)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the longest common prefix of two int64 vectors."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if differ.numel() else m
