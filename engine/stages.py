"""DDTree's discrete stages in torch, batched over requests with different trees.

docs/ddtree-semantics.md is the law: top-K
log-probs (section 2), the best-first tree build (3), compile (4), target
choices (5), accept (6) and KV compaction (7). `Stages` is the protocol every
backend meets; `TorchStages` is the reference torch path that the CUDA
kernels (engine/cuda_stages.py) are measured against.

Batch layout: request b's tree has n[b] non-root nodes, so n[b] + 1 tree
tokens in columns 0 .. n[b] of [B, Nmax] tensors (Nmax = max(n) + 1); column
0 is the root. Padding columns hold -1 (scores: -inf) and never stand for a
real token: the node count is the truth, never the token values.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import torch

from .cache import KVCache


@dataclass
class TreeBatch:
    """Draft trees of a batch in pop order (parents[b, i] < i for real nodes i >= 1)."""

    n: torch.Tensor          # int64 [B]: non-root nodes per request
    parents: torch.Tensor    # int64 [B, Nmax]: parents[:, 0] = -1
    tokens: torch.Tensor     # int64 [B, Nmax]: tokens[:, 0] = the root token
    depths: torch.Tensor     # int64 [B, Nmax]: depths[:, 0] = 0
    scores: torch.Tensor     # float64 [B, Nmax]: scores[:, 0] = 0
    depth: int               # L, the drafted depths the trees were built from

    @property
    def width(self) -> int:
        """Nmax, the tree-token columns."""
        return self.parents.shape[1]

    def real(self) -> torch.Tensor:
        """-> bool [B, Nmax]: which columns hold real tree tokens."""
        return torch.arange(self.width, device=self.n.device)[None, :] <= self.n[:, None]


@dataclass
class CompiledBatch:
    """What tree verification needs (contract section 4), every encoding derived from parents."""

    positions: torch.Tensor         # int64 [B, Nmax]: starts + depths (padding -1)
    visibility: torch.Tensor        # bool [B, Nmax, Nmax]: j is i or an ancestor (padding: i only)
    visibility_bits: torch.Tensor   # int32 [B, Nmax, W]: the uint32 words' bits, W = ceil(Nmax / 32)
    first_child: torch.Tensor       # int64 [B, Nmax]: smallest child index, -1 for none
    next_sibling: torch.Tensor      # int64 [B, Nmax]: next larger index under the same parent, -1 none


class Stages(Protocol):
    def topk_logprobs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def build_trees(self, topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor,
                    roots: torch.Tensor) -> TreeBatch: ...

    def compile_trees(self, trees: TreeBatch, starts: torch.Tensor) -> CompiledBatch: ...

    def greedy_choices(self, logits: torch.Tensor) -> torch.Tensor: ...

    def sample_choices(self, logits: torch.Tensor, temperature: float,
                       uniforms: torch.Tensor) -> torch.Tensor: ...

    def accept(self, trees: TreeBatch, choices: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def compact_kv(self, cache: KVCache, starts: torch.Tensor, accepted: torch.Tensor,
                   accept_len: torch.Tensor) -> None: ...


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_tensor(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    _check(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check(t.dtype in dtypes, f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _check(t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {list(t.shape)}")


def _check_batch_vector(t: torch.Tensor, name: str, batch: int, device: torch.device) -> None:
    _check_tensor(t, name, (torch.int64,), 1)
    _check(t.shape[0] == batch, f"{name}: expected shape [{batch}], got {list(t.shape)}")
    _check(t.device == device, f"{name}: on {t.device}, the other inputs on {device}")


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> float64 [..., V]: logits - (max + log(sum(exp(logits - max)))), in float64."""
    x = logits.double()
    peak = x.amax(dim=-1, keepdim=True)
    return x - (peak + (x - peak).exp().sum(dim=-1, keepdim=True).log())


def top2_margins(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] -> float64 [...]: the top-1 minus the top-2 logit (0 at a tie for the top,
    inf when V == 1). Two max reductions around one masked copy: no sort or selection pass.
    rows int64 [B, P]: of logits [B, N, V], only rows[b, p] of request b -> float64 [B, P]."""
    if rows is not None:
        logits = logits.gather(1, rows[:, :, None].expand(-1, -1, logits.shape[-1]))
    top1, first = logits.max(dim=-1)
    top2 = logits.scatter(-1, first[..., None], float("-inf")).amax(dim=-1)
    return top1.double() - top2.double()


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> int64 [...]: an integer key with the floats' order (no NaN; -0 == +0)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)                   # + 0.0 turns -0 into +0
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _tree_for_request(lp: list[list[float]], ids: list[list[int]], budget: int
                      ) -> tuple[list[int], list[int], list[int], list[float]]:
    """The best-first heap of contract section 3 for one request (lp already float64 values).

    -> parents, tokens (tokens[0] left -1), depths, scores, in pop order.
    """
    depth, k = len(lp), len(lp[0]) if lp else 0
    parents, tokens, depths, scores = [-1], [-1], [0], [0.0]
    paths: list[tuple[int, ...]] = [()]
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []   # (-score, rank path, parent, d, r)
    if depth > 0 and k > 0:
        heap.append((-(scores[0] + lp[0][0]), (0,), 0, 1, 0))
    while heap and len(parents) <= budget:
        neg_score, path, parent, d, r = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        tokens.append(ids[d - 1][r])
        depths.append(d)
        scores.append(-neg_score)
        paths.append(path)
        if r + 1 < k:
            heapq.heappush(heap, (-(scores[parent] + lp[d - 1][r + 1]), paths[parent] + (r + 1,),
                                  parent, d, r + 1))
        if d < depth:
            heapq.heappush(heap, (-(scores[node] + lp[d][0]), path + (0,), node, d + 1, 0))
    return parents, tokens, depths, scores


class TorchStages:
    """The reference torch implementation of `Stages` (CPU or CUDA tensors)."""

    def topk_logprobs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_logits [B, L, V] float32|bf16 -> (topk_lp float32 [B, L, K], topk_id int64 [B, L, K]).

        lp = logits - logsumexp in float64, rounded once to float32; K = min(k, V); each row
        descending, equal float32 values ordered by the smaller id (contract section 2).
        """
        _check_tensor(draft_logits, "draft_logits", (torch.float32, torch.bfloat16, torch.float16), 3)
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 0, f"k: expected an integer >= 0, got {k!r}")
        vocab = draft_logits.shape[2]
        _check(vocab > 0, "draft_logits: the vocabulary is empty")
        _check(not bool(draft_logits.isnan().any()), "draft_logits: contains NaN")
        lp = log_softmax64(draft_logits).float()                             # [B, L, V]
        ids = torch.arange(vocab, device=lp.device, dtype=torch.int64)
        key = (_ordered_bits(lp) << 32) | (0xFFFFFFFF - ids)                 # larger = better, unique
        topk_id = 0xFFFFFFFF - (key.topk(min(k, vocab), dim=-1).values & 0xFFFFFFFF)
        return lp.gather(-1, topk_id), topk_id

    def build_trees(self, topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor,
                    roots: torch.Tensor) -> TreeBatch:
        """topk_lp float32 [B, L, K], topk_id int64 [B, L, K], budgets [B], roots [B] -> TreeBatch.

        Each request's best-first heap (contract section 3), on the host, bit-exact with refgen.
        """
        _check_tensor(topk_lp, "topk_lp", (torch.float32,), 3)
        _check_tensor(topk_id, "topk_id", (torch.int64,), 3)
        _check(topk_id.shape == topk_lp.shape,
               f"topk_id: shape {list(topk_id.shape)} != topk_lp {list(topk_lp.shape)}")
        device = topk_lp.device
        _check(topk_id.device == device, f"topk_id: on {topk_id.device}, topk_lp on {device}")
        batch, depth, _ = topk_lp.shape
        _check_batch_vector(budgets, "budgets", batch, device)
        _check_batch_vector(roots, "roots", batch, device)
        _check(not bool((budgets < 0).any()), f"budgets: must be >= 0, got {budgets.tolist()}")
        _check(not bool(topk_lp.isnan().any()), "topk_lp: contains NaN")
        _check(not bool((topk_lp.diff(dim=-1) > 0).any()), "topk_lp: each row must be non-increasing")

        lp64 = topk_lp.double().cpu().tolist()
        ids = topk_id.cpu().tolist()
        built = [_tree_for_request(lp64[b], ids[b], int(budget))
                 for b, budget in enumerate(budgets.tolist())]
        width = max((len(p) for p, *_ in built), default=1)
        parents = torch.full((batch, width), -1, dtype=torch.int64)
        tokens, depths = parents.clone(), parents.clone()
        scores = torch.full((batch, width), float("-inf"), dtype=torch.float64)
        for b, (p, t, d, s) in enumerate(built):
            parents[b, :len(p)] = torch.tensor(p)
            tokens[b, :len(t)] = torch.tensor(t)
            depths[b, :len(d)] = torch.tensor(d)
            scores[b, :len(s)] = torch.tensor(s, dtype=torch.float64)
        tokens[:, 0] = roots.cpu()
        n = torch.tensor([len(p) - 1 for p, *_ in built], dtype=torch.int64)
        return TreeBatch(n=n.to(device), parents=parents.to(device), tokens=tokens.to(device),
                         depths=depths.to(device), scores=scores.to(device), depth=depth)

    def compile_trees(self, trees: TreeBatch, starts: torch.Tensor) -> CompiledBatch:
        """TreeBatch, starts [B] (cache lengths) -> CompiledBatch (contract section 4)."""
        batch, width = trees.parents.shape
        device = trees.parents.device
        _check_batch_vector(starts, "starts", batch, device)
        _check(not bool((starts < 0).any()), f"starts: must be >= 0, got {starts.tolist()}")
        real = trees.real()
        positions = torch.where(real, starts[:, None] + trees.depths, -1)

        visibility = torch.eye(width, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        ancestor = trees.parents.clone()                                      # [B, Nmax], -1 = none
        for _ in range(trees.depth):
            rows, cols = (ancestor >= 0).nonzero(as_tuple=True)
            if rows.numel() == 0:
                break
            visibility[rows, cols, ancestor[rows, cols]] = True
            ancestor = torch.where(ancestor >= 0, trees.parents.gather(1, ancestor.clamp(min=0)), -1)

        words = -(-width // 32)
        padded = torch.zeros(batch, width, words * 32, dtype=torch.int64, device=device)
        padded[..., :width] = visibility
        weights = torch.ones(32, dtype=torch.int64, device=device) << torch.arange(32, device=device)
        packed = (padded.view(batch, width, words, 32) * weights).sum(-1)     # [B, Nmax, W] in [0, 2^32)
        visibility_bits = (packed - ((packed >> 31) << 32)).to(torch.int32)   # same bits, signed

        # Children grouped by parent, in increasing index within a group (stable sort);
        # non-children sort last under the sentinel parent `width`.
        is_child = (trees.parents >= 0) & real
        sorted_parent, order = torch.sort(torch.where(is_child, trees.parents, width), dim=1, stable=True)
        same = (sorted_parent[:, 1:] == sorted_parent[:, :-1]) & (sorted_parent[:, :-1] < width)
        next_sibling = torch.full((batch, width), -1, dtype=torch.int64, device=device)
        next_sibling.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], -1))
        group_head = torch.ones_like(is_child)
        group_head[:, 1:] = ~same
        group_head &= sorted_parent < width
        first_child = torch.full((batch, width + 1), -1, dtype=torch.int64, device=device)
        first_child.scatter_(1, torch.where(group_head, sorted_parent, width), order)
        first_child = first_child[:, :width]
        return CompiledBatch(positions=positions, visibility=visibility, visibility_bits=visibility_bits,
                             first_child=first_child, next_sibling=next_sibling)

    def greedy_choices(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, N, V] -> int64 [B, N]: argmax, ties to the smaller id."""
        _check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16, torch.float64), 3)
        return logits.argmax(dim=-1)

    def sample_choices(self, logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
        """logits [B, N, V], uniforms float [B, N] in [0, 1) -> int64 [B, N].

        Inverse CDF in float64 over ids ascending: p = softmax(logits / T); the smallest id
        with cdf > u, capped at the largest id with p > 0 (contract section 5).
        """
        _check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16, torch.float64), 3)
        _check(isinstance(temperature, (int, float)) and temperature > 0,
               f"temperature: sampling needs temperature > 0, got {temperature!r}")
        _check(isinstance(uniforms, torch.Tensor) and uniforms.shape == logits.shape[:2],
               f"uniforms: expected shape {list(logits.shape[:2])}")
        u = uniforms.double()
        _check(bool(((u >= 0) & (u < 1)).all()), "uniforms: every value must lie in [0, 1)")
        p = log_softmax64(logits.double() / temperature).exp()                # [B, N, V]
        choices = (p.cumsum(dim=-1) <= u[..., None]).sum(dim=-1)
        vocab = p.shape[-1]
        last_positive = vocab - 1 - (p.flip(-1) > 0).int().argmax(dim=-1)
        return torch.minimum(choices, last_positive)

    def accept(self, trees: TreeBatch, choices: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """choices int64 [B, Nmax] -> (accepted int64 [B, L+1] padded -1, accept_len [B], next_root [B]).

        Walk from the root to the child whose token is the target's choice at the current
        node while one exists (contract section 6); accepted[b, :accept_len[b]] is the path.
        """
        batch, width = trees.parents.shape
        device = trees.parents.device
        _check_tensor(choices, "choices", (torch.int64,), 2)
        _check(choices.shape == (batch, width), f"choices: expected shape {[batch, width]}, "
                                                f"got {list(choices.shape)}")
        _check(choices.device == device, f"choices: on {choices.device}, the trees on {device}")
        real = trees.real()
        current = torch.zeros(batch, dtype=torch.int64, device=device)
        accepted = torch.full((batch, trees.depth + 1), -1, dtype=torch.int64, device=device)
        accepted[:, 0] = 0
        accept_len = torch.ones(batch, dtype=torch.int64, device=device)
        for step in range(1, trees.depth + 1):
            choice = choices.gather(1, current[:, None])                              # [B, 1]
            match = (trees.parents == current[:, None]) & (trees.tokens == choice) & real
            moved = match.any(dim=1)
            if not bool(moved.any()):
                break
            current = torch.where(moved, match.int().argmax(dim=1), current)
            accepted[:, step] = torch.where(moved, current, -1)
            accept_len += moved.long()
        next_root = choices.gather(1, current[:, None])[:, 0]
        return accepted, accept_len, next_root

    def compact_kv(self, cache: KVCache, starts: torch.Tensor, accepted: torch.Tensor,
                   accept_len: torch.Tensor) -> None:
        """In place, every layer: slot starts[b] + k <- slot starts[b] + accepted[b, k] for
        k < accept_len[b] (contract section 7; right for non-prefix paths). Leaves
        cache.lengths to the caller."""
        batch = cache.batch
        device = cache.device
        _check_batch_vector(starts, "starts", batch, device)
        _check_batch_vector(accept_len, "accept_len", batch, device)
        _check_tensor(accepted, "accepted", (torch.int64,), 2)
        _check(accepted.shape[0] == batch and accepted.device == device,
               f"accepted: expected [{batch}, a_max] on {device}, got {list(accepted.shape)} on {accepted.device}")
        _check(bool(((accept_len >= 1) & (accept_len <= accepted.shape[1])).all()),
               f"accept_len: must lie in [1, {accepted.shape[1]}], got {accept_len.tolist()}")
        valid = torch.arange(accepted.shape[1], device=device)[None, :] < accept_len[:, None]
        rows, k = valid.nonzero(as_tuple=True)
        node = accepted[rows, k]
        _check(bool((node >= k).all()), "accepted: node indices must increase from node 0 (accepted[k] >= k)")
        src, dst = starts[rows] + node, starts[rows] + k
        _check(bool((src < cache.max_len).all()), f"accepted: a source slot lies beyond the cache's "
                                                  f"{cache.max_len} slots")
        src_rows, dst_rows = cache.slot_rows(src, rows), cache.slot_rows(dst, rows)   # paged or not
        for pool in cache.rows():                                           # [layers, rows, w]
            pool[:, dst_rows] = pool[:, src_rows]
