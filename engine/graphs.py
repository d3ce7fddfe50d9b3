"""CUDA graphs of the engine's hot loops: the forward at bucketed widths, the AR step, the DDTree round.

`GraphedModel(model)` wraps a `Transformer` on a CUDA device and is passed to `ar_decode` /
`ddtree_decode` in its place:

- `forward` replays a graph captured once per (cache, batch, bucket width): the inputs are
  copied into the graph's static buffers, the width padded up to the bucket (`BUCKETS`; the
  padding rows are masked by n_new as always), and the result is a view of the graph's static
  logits, valid until the next call. Widths past the largest bucket run eagerly.
- `new_cache` hands out one pooled cache per (batch, length rounded up to CACHE_ROUND), so
  repeated decodes find their graphs again: one decode at a time per GraphedModel.
- `ar_step`: greedy AR's step (the forward of each request's last token, argmax, top-1/top-2
  margin, start += 1, last = choice, the cache's lengths = starts) in one graph, the last tokens
  and starts resident on the device; the host reads (choice, margin) once per step.
- `ddtree_round`: greedy DDTree's round after the draft in three graphs, `build` (top-k
  log-probs, tree build and compile in one launch, the dense visibility), `verify` (the forward
  over 1 + the possible nodes, at most 1 + budget, columns) and `accept` (choices, accept, KV
  compaction, the accepted path's tokens and margins, start += a, root = next root, the cache's
  lengths = starts), with the kernels_cuda tree ops. CUDA events between the three time each on
  the device; the host copies one packed row per request back once per round.

The host's part of a step or round is one replay per graph, one copy back and the commit: the
starts and roots never leave the device, and the activity (and budgets) are copied to it only
when a request finishes.

Capture: each graph's function runs twice on a side stream (lazy initialization, library
workspaces), then is captured into one memory pool shared by the model's graphs (one replays at
a time). Warm-up and capture run with n_new = 0 for every request, so they write nothing into
the cache; every tensor a graph reads or writes is held by its object (a tensor freed after capture
would leave the graph reading memory the allocator hands out again); the functions must read
nothing back to the host (Transformer.forward with
check=False, the tree ops), or the capture fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .attention import invariant_torch_attention
from .cache import KVCache
from .model import Transformer
from .stages import Stages, top2_margins

BUCKETS = tuple(sorted({1 << i for i in range(11)} | {(1 << i) + 1 for i in range(10)}))
CACHE_ROUND = 256


def bucket_width(n: int) -> int | None:
    """The smallest bucket >= n (None past the largest)."""
    return next((b for b in BUCKETS if b >= n), None)


def capture(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn warmed up twice on a side stream, then captured -> (graph, what fn returned in capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class GraphedModel:
    """A CUDA `Transformer` whose forward, AR step and DDTree round replay CUDA graphs (module docstring)."""

    def __init__(self, model: Transformer) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"GraphedModel: the model must be on a CUDA device, got {model.device}")
        if model.attention is invariant_torch_attention:
            raise ValueError("GraphedModel: invariant mode with the torch attention backend reads the host; "
                             "load kernels_cuda (CudaAttention) to capture it")
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, model.device, model.dtype
        self.pool = torch.cuda.graph_pool_handle()
        self._caches: dict[tuple[int, int], KVCache] = {}
        self._graphs: dict[tuple, object] = {}

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """The pooled cache of `batch` requests and at least `max_len` slots, lengths zeroed."""
        length = CACHE_ROUND * max(1, math.ceil(max_len / CACHE_ROUND))
        cache = self._caches.get((batch, length))
        if cache is None:
            cache = self._caches[batch, length] = self.model.new_cache(batch, length)
        cache.lengths.zero_()
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                n_new: torch.Tensor, starts: torch.Tensor, cache: KVCache, *, check: bool = True) -> torch.Tensor:
        """Transformer.forward's contract; the logits are a view valid until the next call."""
        model = self.model
        model._check_inputs(tokens, positions, new_visibility, n_new, starts, cache)
        if check:
            model._check_values(tokens, positions, new_visibility, n_new, starts, cache)
        batch, n = tokens.shape
        width = bucket_width(n)
        if batch == 0 or n == 0 or width is None or width > cache.max_len:
            return model.forward(tokens, positions, new_visibility, n_new, starts, cache, check=False)
        key = ("forward", id(cache), batch, width)
        if key not in self._graphs:
            self._graphs[key] = _ForwardGraph(model, cache, batch, width, self.pool)
        return self._graphs[key](tokens, positions, new_visibility, n_new, starts)[:, :n]

    __call__ = forward

    def ar_step(self, cache: KVCache, stages: Stages) -> "ARStep":
        """The greedy AR step graph of this cache."""
        key = ("ar", id(cache))
        if key not in self._graphs:
            self._graphs[key] = ARStep(self.model, cache, stages, self.pool)
        return self._graphs[key]

    def ddtree_round(self, cache: KVCache, depth: int, k: int, budget: int) -> "DDTreeRound":
        """The greedy DDTree round graphs of this cache, L = depth, K = k, budget (the largest)."""
        key = ("ddtree", id(cache), depth, k, budget)
        if key not in self._graphs:
            self._graphs[key] = DDTreeRound(self.model, cache, depth, k, budget, self.pool)
        return self._graphs[key]


class _ForwardGraph:
    """One forward graph: static inputs [B, width], static logits [B, width, V]."""

    def __init__(self, model: Transformer, cache: KVCache, batch: int, width: int, pool) -> None:
        device = model.device
        self.cache = cache                      # kept alive: the graph holds its memory
        self.tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.tokens)
        self.visibility = torch.eye(width, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        self.n_new = torch.zeros(batch, dtype=torch.int64, device=device)
        self.starts = torch.zeros_like(self.n_new)
        self.graph, self.logits = capture(lambda: model.forward(self.tokens, self.positions, self.visibility,
                                                                self.n_new, self.starts, cache, check=False), pool)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, new_visibility: torch.Tensor,
                 n_new: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        self.tokens[:, :n].copy_(tokens)
        self.positions[:, :n].copy_(positions)
        self.visibility[:, :n, :n].copy_(new_visibility)
        self.n_new.copy_(n_new)
        self.starts.copy_(starts)
        self.graph.replay()
        return self.logits


class ARStep:
    """Greedy AR's step in one graph (module docstring). `load` the state after prefill, then
    each call takes the active mask (host) -> (choices, margins) per request on the host."""

    def __init__(self, model: Transformer, cache: KVCache, stages: Stages, pool) -> None:
        device, batch = model.device, cache.batch
        self.cache = cache
        self.last = torch.zeros(batch, dtype=torch.int64, device=device)
        self.starts = torch.zeros_like(self.last)
        self.active = torch.zeros_like(self.last)
        self.loaded_active: list[bool] | None = None     # what self.active holds
        self.host = torch.empty(batch, 2, dtype=torch.float64, pin_memory=True)
        self.done = torch.cuda.Event()
        self.see_self = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)    # read by every replay

        def step() -> torch.Tensor:
            logits = model.forward(self.last[:, None], self.starts[:, None], self.see_self, self.active, self.starts,
                                   cache, check=False)[:, 0]                               # [B, V]
            choices = stages.greedy_choices(logits[:, None])[:, 0]
            self.last.copy_(torch.where(self.active > 0, choices, self.last))
            self.starts.add_(self.active)
            cache.lengths.copy_(self.starts)
            return torch.stack([choices.double(), top2_margins(logits)], dim=1)            # [B, 2]
        self.graph, self.out = capture(step, pool)

    def load(self, last: torch.Tensor, starts: torch.Tensor) -> None:
        """last [B] (each request's last committed token), starts [B] (its cached tokens)."""
        self.last.copy_(last)
        self.starts.copy_(starts)
        self.cache.lengths.copy_(self.starts)
        self.loaded_active = None

    def __call__(self, active: list[bool]) -> tuple[list[int], list[float]]:
        """One step of the active requests (the mask goes to the device only when it changed):
        their starts and the cache's lengths advance on the device -> (choices, margins)."""
        if active != self.loaded_active:
            self.active.copy_(torch.tensor(active))
            self.loaded_active = list(active)
        self.graph.replay()
        self.host.copy_(self.out, non_blocking=True)
        self.done.record()
        self.done.synchronize()
        choices, margins = zip(*self.host.tolist())
        return [int(c) for c in choices], list(margins)


@dataclass
class RoundResult:
    """One DDTree round on the host, per request: accept_len, next_root, the accepted path's
    tokens and margins (a of each; the root first); and the device seconds per stage."""

    accept_len: list[int]
    next_root: list[int]
    path_tokens: list[list[int]]
    path_margins: list[list[float]]
    seconds: dict[str, float]


class DDTreeRound:
    """Greedy DDTree's round after the draft in three graphs (module docstring). The round's
    inputs stay on the device: `load` them after prefill; the accept graph advances starts,
    roots and the cache's lengths, and the budgets and activity are copied again only when
    they change."""

    STAGES = ("build", "verify", "accept")

    def __init__(self, model: Transformer, cache: KVCache, depth: int, k: int, budget: int, pool) -> None:
        from kernels_cuda import tree_ops

        from .cuda_stages import _possible_nodes, unpack_visibility

        device, batch = model.device, cache.batch
        width = 1 + _possible_nodes(depth, k, budget)
        self.cache = cache
        self.draft = torch.zeros(batch, depth, model.cfg.vocab_size, device=device)
        self.budgets = torch.zeros(batch, dtype=torch.int64, device=device)
        self.roots, self.starts = torch.zeros_like(self.budgets), torch.zeros_like(self.budgets)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.loaded: tuple[list[int], list[bool]] | None = None     # what self.budgets, self.active hold
        self.host = torch.empty(batch, 2 * (depth + 2), dtype=torch.float64, pin_memory=True)
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(len(self.STAGES) + 1)]
        self.depth = depth

        def build() -> tuple[torch.Tensor, ...]:
            topk_lp, topk_id = tree_ops.topk_logprobs(self.draft, k)
            n, parents, tokens, _, _, positions, bits, _, _ = tree_ops.build_compiled_trees(
                topk_lp, topk_id, self.budgets, self.roots, self.starts, width)
            return (n, parents, tokens, positions, unpack_visibility(bits, width),
                    torch.where(self.active, n + 1, 0), tokens.clamp(min=0))
        self.build, built = capture(build, pool)
        self.build.replay()                     # valid trees (root only, n_new 0) for the next warm-ups
        self.built = built                      # n, parents, tokens, positions, visibility, n_new, ids
        n, parents, tokens, positions, visibility, n_new, ids = built
        self.verify, self.logits = capture(lambda: model.forward(ids, positions, visibility, n_new, self.starts,
                                                                 cache, check=False), pool)
        self.verify.replay()
        logits = self.logits                    # the verify graph's output, the accept graph's input

        def accept() -> torch.Tensor:
            choices = logits.argmax(dim=-1)                                               # [B, W]
            accepted, accept_len, next_root = tree_ops.accept_greedy(parents, tokens, n, choices, depth + 1)
            tree_ops.compact_kv(cache.c_kv, cache.k_pe, self.starts, accepted, accept_len,
                                block_table=cache.block_table)
            path = accepted.clamp(min=0)                                                  # [B, L+1]
            out = torch.cat([accept_len[:, None].double(), next_root[:, None].double(),
                             tokens.gather(1, path).double(), top2_margins(logits, path)], dim=1)
            self.starts.add_(torch.where(self.active, accept_len, 0))
            self.roots.copy_(torch.where(self.active, next_root, self.roots))
            cache.lengths.copy_(self.starts)
            return out
        self.accept, self.out = capture(accept, pool)

    def load(self, roots: torch.Tensor, starts: torch.Tensor) -> None:
        """roots [B] (each request's last committed token), starts [B] (its cached tokens)."""
        self.roots.copy_(roots)
        self.starts.copy_(starts)
        self.cache.lengths.copy_(self.starts)
        self.loaded = None

    def __call__(self, draft_logits: torch.Tensor, budgets: list[int], active: list[bool]) -> RoundResult:
        """draft_logits [B, L, V]; per request its budget and whether it is active (an inactive
        one writes nothing and keeps its start and root) -> RoundResult."""
        if (budgets, active) != self.loaded:
            packed = torch.tensor([budgets, active], dtype=torch.int64).to(self.budgets.device)
            self.budgets.copy_(packed[0])
            self.active.copy_(packed[1] > 0)
            self.loaded = (list(budgets), list(active))
        self.draft.copy_(draft_logits)
        events = self.events
        events[0].record()
        for graph, event in zip((self.build, self.verify, self.accept), events[1:]):
            graph.replay()
            event.record()
        self.host.copy_(self.out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        seconds = {stage: events[i].elapsed_time(events[i + 1]) / 1e3 for i, stage in enumerate(self.STAGES)}
        width = self.depth + 1
        result = RoundResult([], [], [], [], seconds)
        for row in self.host.tolist():
            a = int(row[0])
            result.accept_len.append(a)
            result.next_root.append(int(row[1]))
            result.path_tokens.append([int(t) for t in row[2:2 + a]])
            result.path_margins.append(row[2 + width:2 + width + a])
        return result
