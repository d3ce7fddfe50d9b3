"""Planted bugs for tests/engine/test_rows.py: broken adapters, each wrong in one way, and
patches of the built-in engine at the seams its own rows check.

- Protocol 1 adapters (`Engine` subclasses, one request at a time) for the per-request rows;
  protocol 2 ones (`TorchAdapter` subclasses) wrong only for requests 1 and after, for the
  batched rows; `Only` hides the capabilities a plant does not concern.
- Patches (each takes pytest's monkeypatch): `engine_seams` (the AR loop, the replay and the
  invariant's decodes commit a token too many in their last request; the uniforms come from a
  generator re-seeded at every draw; greedy ties go to the larger id), `split_by_rows`
  (invariant attention that is not row-count invariant), `power_of_two_offsets` (the paged
  cache's in-page offset as `slot & (page - 1)`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import engine.attention
import engine.decode
import engine.validate.rows.engine as engine_rows
import engine.validate.rows.invariant as invariant
from engine.adapter import TorchAdapter
from engine.cache import KVCache
from engine.stages import TorchStages
from engine.validate.door.protocol import CAPABILITIES as V1_CAPABILITIES
from engine.validate.door.protocol import protocol_version
from engine.validate.door.protocol_v2 import CAPABILITIES_V2, PerRequest, sizes

SHIFT = 1e-2                       # a constant added to logits: every decision the same, every value off


# ---- adapters ----

class Engine(PerRequest):
    """The built-in engine through protocol v1: one request at a time, numpy."""

    def __init__(self) -> None:
        super().__init__(TorchAdapter())


class Only:
    """`adapter` showing only the methods of `caps` (and no declaration), so that the rows of
    the other capabilities are skipped."""

    def __init__(self, adapter: Any, *caps: str) -> None:
        table = CAPABILITIES_V2 if protocol_version(adapter) == 2 else V1_CAPABILITIES
        self._adapter = adapter
        self._hidden = {"capabilities"} | {m for cap, methods in table.items() if cap not in caps for m in methods}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in self._hidden:
            raise AttributeError(name)
        return getattr(self._adapter, name)


# v1 (per request)

class PrefillShifted(Engine):
    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + SHIFT if start == 0 else logits


class StaleDecodeStep(Engine):
    """A decode fast path that kicks in on the third of consecutive one-token forwards (at
    starts s, s + 1, s + 2) and returns the previous one's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, np.ndarray]] = []

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        fast = [s for s, _ in self.steps[-2:]] == [start - 2, start - 1]
        stale = self.steps[-1][1] if fast else logits
        self.steps = self.steps + [(start, logits)] if len(tokens) == 1 else []
        return stale


class VerifyShifted(Engine):
    """Forwards of several tokens after the prompt (trees, restated paths) shifted."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        return logits + SHIFT if start > 0 and len(tokens) > 1 else logits


class TopTwoSwapped(Engine):
    """Every tree row's two largest logits swapped."""

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        if start > 0 and len(tokens) > 1:
            order = np.argsort(-logits, axis=1)[:, :2]
            rows = np.arange(len(logits))[:, None]
            logits[rows, order] = logits[rows, order[:, ::-1]]
        return logits


class LogitsAsLogprobs(Engine):
    """Top-k ids right, their log-probs the raw logits (no log-sum-exp)."""

    def topk_logprobs(self, draft_logits, k):
        _, ids = super().topk_logprobs(draft_logits, k)
        return np.take_along_axis(np.asarray(draft_logits, dtype=np.float32), ids, axis=1), ids


class ScoresOffByOneUlp(Engine):
    def build_tree(self, topk_lp, topk_id, budget, root):
        parents, tokens, depths, scores = super().build_tree(topk_lp, topk_id, budget, root)
        return parents, tokens, depths, np.nextafter(scores, -np.inf)


class IndexPositions(Engine):
    """Tree positions start + node index instead of start + depth."""

    def compile_tree(self, parents, depths, start):
        _, *rest = super().compile_tree(parents, depths, start)
        return start + np.arange(len(parents)), *rest


class NoSiblings(Engine):
    def compile_tree(self, parents, depths, start):
        positions, bits, first_child, next_sibling = super().compile_tree(parents, depths, start)
        return positions, bits, first_child, np.full_like(next_sibling, -1)


class WrongNextRoot(Engine):
    def accept(self, parents, tokens, choices):
        accepted, _ = super().accept(parents, tokens, choices)
        return accepted, int(choices[0])              # the root's choice, not the last accepted node's


class OneUniform(Engine):
    """Sampling that takes the root's uniform for every node."""

    def sample_accept(self, parents, tokens, logits, temperature, uniforms):
        return super().sample_accept(parents, tokens, logits, temperature, np.full_like(uniforms, uniforms[0]))


class OneSlotTooMany(Engine):
    """Compaction that also writes slot start + a (the next round's first slot) with the last moved row."""

    def compact(self, c_kv, k_pe, start, accepted):
        c_kv, k_pe = (np.array(a) for a in super().compact(c_kv, k_pe, start, accepted))
        end = start + len(accepted)
        if end < len(c_kv):
            c_kv[end], k_pe[end] = c_kv[end - 1], k_pe[end - 1]
        return c_kv, k_pe


class SecondKeyTile(Engine):
    """Attention off for a request whose cached context passes 64 keys (a second key tile):
    never request 0 of a verify_attention case (test_rows.py checks the fixture for it)."""

    def attention(self, q_lat, q_pe, c_kv, k_pe, visibility, scale):
        o_lat = super().attention(q_lat, q_pe, c_kv, k_pe, visibility, scale)
        n, keys = np.asarray(visibility).shape
        return o_lat * 1.01 if keys - n > 64 else o_lat


class WrongExperts(Engine):
    """A model that reports (bf16 `intermediates`) other experts than it routed to."""

    def intermediates(self, tokens, positions, visibility, start):
        out = self.adapter.intermediates(tokens, positions, visibility, start)
        return {name: (value + 1) % self.adapter.model.cfg.n_routed_experts if name.endswith(".experts") else value
                for name, value in out.items()}


# v2 (batched), each wrong only for requests 1 and after

def later_rows(offsets: torch.Tensor) -> slice:
    """The ragged rows of requests 1 .. B-1."""
    return slice(int(offsets[1]), None)


class LaterPrefillShifted(TorchAdapter):
    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        logits = super().forward(tokens, positions, offsets, starts, visibility_bits)
        if bool((starts == 0).all()):
            logits[later_rows(offsets)] += SHIFT
        return logits


class LaterVerifyShifted(TorchAdapter):
    """The first verify after the prefill (start at the prompt's end) shifted, for requests 1 and after."""

    prompts: torch.Tensor | None = None              # the last prefill's prompt lengths

    def forward(self, tokens, positions, offsets, starts, visibility_bits):
        logits = super().forward(tokens, positions, offsets, starts, visibility_bits)
        if bool((starts == 0).all()):
            self.prompts = sizes(offsets)
        elif self.prompts is not None and len(self.prompts) == len(starts):
            first = (starts == self.prompts) & (torch.arange(len(starts)) >= 1)
            logits[torch.repeat_interleave(first, sizes(offsets))] += SHIFT
        return logits


class LaterTopk(TorchAdapter):
    def topk_logprobs(self, draft_logits, k):
        lp, ids = super().topk_logprobs(draft_logits, k)
        lp[1:] += 1e-3
        return lp, ids


class LaterScores(TorchAdapter):
    def build_trees(self, topk_lp, topk_id, budgets, roots):
        node_offsets, parents, tokens, depths, scores = super().build_trees(topk_lp, topk_id, budgets, roots)
        later = later_rows(node_offsets)
        scores[later] = torch.nextafter(scores[later], torch.tensor(-torch.inf, dtype=scores.dtype))
        return node_offsets, parents, tokens, depths, scores


class LaterPositions(TorchAdapter):
    def compile_trees(self, parents, depths, node_offsets, starts):
        positions, *rest = super().compile_trees(parents, depths, node_offsets, starts)
        positions[later_rows(node_offsets)] += 1
        return positions, *rest


class LaterNextRoot(TorchAdapter):
    def accept(self, parents, tokens, choices, node_offsets):
        accepted, accept_offsets, next_roots = super().accept(parents, tokens, choices, node_offsets)
        next_roots[1:] += 1
        return accepted, accept_offsets, next_roots


class LaterSharedUniforms(TorchAdapter):
    """Sampling that reads every request's uniforms from request 0's rows."""

    def sample_accept(self, parents, tokens, logits, node_offsets, temperature, uniforms):
        request = torch.repeat_interleave(torch.arange(len(node_offsets) - 1), sizes(node_offsets))
        index = (torch.arange(len(parents)) - node_offsets[request]).clamp(max=int(node_offsets[1]) - 1)
        return super().sample_accept(parents, tokens, logits, node_offsets, temperature, uniforms[index])


class LaterPathIgnored(TorchAdapter):
    """Cache compaction that moves request 0's path only."""

    def compact_cache(self, starts, accepted, accept_offsets):
        first = int(accept_offsets[1])
        super().compact_cache(starts, accepted[:first], accept_offsets.clamp(max=first))


class LaterSlotTooMany(TorchAdapter):
    """Compaction that also writes, for requests 1 and after, slot start + a with the last moved row."""

    def compact(self, c_kv, k_pe, starts, accepted, accept_offsets):
        c_kv, k_pe = super().compact(c_kv, k_pe, starts, accepted, accept_offsets)
        for b in range(1, len(starts)):
            end = int(starts[b] + accept_offsets[b + 1] - accept_offsets[b])
            if end < c_kv.shape[1]:
                c_kv[b, end], k_pe[b, end] = c_kv[b, end - 1], k_pe[b, end - 1]
        return c_kv, k_pe


class LaterAttention(TorchAdapter):
    def attention(self, q_lat, q_pe, c_kv, k_pe, q_offsets, *rest):
        o_lat = super().attention(q_lat, q_pe, c_kv, k_pe, q_offsets, *rest)
        o_lat[later_rows(q_offsets)] *= 1.01
        return o_lat


class LaterPagedAttention(TorchAdapter):
    def paged_attention(self, q_lat, q_pe, c_kv, k_pe, block_table, q_offsets, *rest):
        o_lat = super().paged_attention(q_lat, q_pe, c_kv, k_pe, block_table, q_offsets, *rest)
        o_lat[later_rows(q_offsets)] *= 1.01
        return o_lat


class LaterPagedSlotTooMany(TorchAdapter):
    """Paged compaction that also writes, for requests 1 and after, slot start + a (through the
    request's table) with the last moved row."""

    def paged_compact(self, c_kv, k_pe, block_table, starts, accepted, accept_offsets):
        c_kv, k_pe = super().paged_compact(c_kv, k_pe, block_table, starts, accepted, accept_offsets)
        page = c_kv.shape[1]
        for b in range(1, len(starts)):
            end = int(starts[b] + accept_offsets[b + 1] - accept_offsets[b])
            (src, dst) = ((int(block_table[b, s // page]), s % page) for s in (end - 1, end))
            if dst[0] >= 0:
                for pool in (c_kv, k_pe):
                    pool[dst] = pool[src]
        return c_kv, k_pe


class NoWeights(Engine):
    """Every v1 method; over fixtures without cases only load_weights is called."""

    def load_weights(self, config, weights):
        pass


# ---- the built-in engine's seams ----

def one_token_more(decode: Callable[..., Any]) -> Callable[..., Any]:
    """`decode`, its last request committing one token past its max_new_tokens."""
    def decoded(*args, **kwargs):
        result = decode(*args, **kwargs)
        result.requests[-1].tokens.append(result.requests[-1].tokens[-1])
        return result
    return decoded


def reseeded(generator: torch.Generator, batch: int, width: int) -> torch.Tensor:
    """The engine's uniforms from a generator re-seeded with its initial seed at every draw."""
    generator.manual_seed(generator.initial_seed())
    return torch.rand(batch, width, generator=generator, dtype=torch.float64)


def ties_to_the_larger_id(stages: TorchStages, logits: torch.Tensor) -> torch.Tensor:
    return logits.shape[-1] - 1 - logits.flip(-1).argmax(dim=-1)


def engine_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_rows, "ar_decode", one_token_more(engine_rows.ar_decode))
    monkeypatch.setattr(engine_rows, "ddtree_decode", one_token_more(engine_rows.ddtree_decode))
    monkeypatch.setattr(engine.decode, "_uniforms", reseeded)
    monkeypatch.setattr(TorchStages, "greedy_choices", ties_to_the_larger_id)
    monkeypatch.setattr(invariant, "ddtree_decode", one_token_more(invariant.ddtree_decode))


class SplitByRows(engine.attention.InvariantTorchAttention):
    """Invariant attention whose key sum is split in two halves, merged by their log-sum-exp,
    when the forward has more than one row: right to rounding, but not the same bits."""

    def __call__(self, q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale):
        if int(n_new.max()) <= 1:
            return super().__call__(q_lat, q_pe, c_kv, k_pe, starts, n_new, new_visibility, scale)
        o_lat = torch.zeros_like(q_lat)
        for b, (start, count) in enumerate(zip(starts.tolist(), n_new.tolist())):
            for i in range(count):
                slots = torch.cat([torch.arange(start), start + new_visibility[b, i, :count].nonzero().flatten()])
                c, k = c_kv[b, slots].float(), k_pe[b, slots].float()
                scores = (q_lat[b, i].float() @ c.T + q_pe[b, i].float() @ k.T) * scale      # [H, S]
                half = max(1, len(slots) // 2)
                parts = [(torch.logsumexp(scores[:, h], -1), torch.softmax(scores[:, h], -1) @ c[h])
                         for h in (slice(0, half), slice(half, None)) if h.start < len(slots)]
                total = torch.logsumexp(torch.stack([lse for lse, _ in parts]), 0)
                o_lat[b, i] = sum(torch.exp(lse - total)[:, None] * o for lse, o in parts).to(o_lat.dtype)
        return o_lat


def split_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.attention, "invariant_torch_attention", SplitByRows())


def power_of_two_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's paged cache with an in-page offset of `slot & (page - 1)`."""
    def slot_rows(cache, slots, requests=None):
        if requests is None:
            requests = torch.arange(slots.shape[0], device=slots.device)[:, None]
        page = cache.page_size
        return cache.block_table.long()[requests, slots // page] * page + (slots & (page - 1))
    monkeypatch.setattr(KVCache, "slot_rows", slot_rows)
