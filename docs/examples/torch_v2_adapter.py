"""A worked example of protocol v2 (docs/adapter.md): a batched torch adapter whose KV
cache is its own, paged, and compacted in place on its device.

    kdtree validate --impl docs/examples/torch_v2_adapter.py:PagedAdapter
    kdtree validate --impl docs/examples/torch_v2_adapter.py:cuda        # on a GPU

The model's math is the built-in engine's (engine.model.Transformer), standing in for your
engine's kernels; the cache around it, the ragged batching and the stages are the
example's own. The cache is a pool of pages shared by every request: a page holds PAGE
consecutive slots of one request, and a request's block table lists its pages in slot
order. Pages are handed out shuffled, so no request's slots are contiguous in the pool.
A forward gathers each request's pages into the contiguous view the model computes on
and writes the new tokens' rows back to their pages; compaction moves rows between pages.
Nothing is copied to the host but sizes.

Declared: model, topk, accept, compact. Left out on purpose (their rows are skipped): tree,
compile, sample_accept, attention, paged_attention, paged_compact.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from engine.cache import KVCache
from engine.model import Transformer
from engine.validate.protocol_v2 import offsets_of, sizes, to_padded, to_ragged, unpack_visibility, widest
from kdtr_format import ModelConfig

PAGE = 16           # slots per page


class PagedAdapter:
    name = "paged torch example adapter (v2)"
    protocol = 2
    capabilities = ("model", "topk", "accept", "compact")

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    # ---- model: the engine's forward over its own paged cache ----
    def load_weights(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.model = Transformer(config, weights, device=self.device)

    def reset(self, batch: int, max_len: int) -> None:
        """A pool of batch * ceil(max_len / PAGE) pages, each request's block table a shuffled share."""
        cfg, pages = self.config, math.ceil(max_len / PAGE)
        layers, shape = cfg.num_hidden_layers, (batch * pages, PAGE)
        self.c_kv = torch.zeros(layers, *shape, cfg.kv_lora_rank, device=self.device)    # [layers, pages, PAGE, R]
        self.k_pe = torch.zeros(layers, *shape, cfg.qk_rope_head_dim, device=self.device)
        order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(batch))
        self.table = order.view(batch, pages).to(self.device)                             # [B, pages]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor,
                visibility_bits: torch.Tensor) -> torch.Tensor:
        """tokens, positions [T], offsets [B+1], starts [B], visibility_bits [T, W] -> logits [T, V]."""
        n_new = sizes(offsets)
        width = widest(n_new)
        view = self._gathered(starts)
        logits = self.model.forward(to_padded(tokens, offsets, width), to_padded(positions, offsets, width),
                                    unpack_visibility(to_padded(visibility_bits, offsets, width), width),
                                    n_new, starts, view, check=False)                     # [B, width, V]
        request, i = self._rows(offsets, len(tokens))
        slots = starts[request] + i
        self._write(request, slots, view.c_kv[:, request, slots], view.k_pe[:, request, slots])
        return to_ragged(logits, n_new)

    def compact_cache(self, starts: torch.Tensor, accepted: torch.Tensor, accept_offsets: torch.Tensor) -> None:
        """In the pages: slot starts[b] + k <- slot starts[b] + path[k], every layer."""
        request, source, target = self._moves(starts, accepted, accept_offsets)
        page, row = self._pages(request, source)
        self._write(request, target, self.c_kv[:, page, row], self.k_pe[:, page, row])

    def _gathered(self, starts: torch.Tensor) -> KVCache:
        """Every request's pages in slot order: the contiguous [layers, B, slots, R] view the model reads."""
        layers, batch = self.c_kv.shape[0], self.table.shape[0]
        return KVCache(c_kv=self.c_kv[:, self.table].reshape(layers, batch, -1, self.c_kv.shape[-1]),
                       k_pe=self.k_pe[:, self.table].reshape(layers, batch, -1, self.k_pe.shape[-1]), lengths=starts)

    def _pages(self, request: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request-relative slots [M] -> (page [M], row within the page [M])."""
        return self.table[request, slots // PAGE], slots % PAGE

    def _write(self, request: torch.Tensor, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        page, row = self._pages(request, slots)
        self.c_kv[:, page, row], self.k_pe[:, page, row] = c_kv, k_pe

    def _rows(self, offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of the `total` ragged rows -> (its request [total], its index within the request [total])."""
        request = torch.repeat_interleave(torch.arange(len(offsets) - 1, device=self.device), sizes(offsets),
                                          output_size=total)
        return request, torch.arange(total, device=self.device) - offsets[request]

    def _moves(self, starts: torch.Tensor, accepted: torch.Tensor,
               accept_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ragged accepted paths -> (request, source slot, target slot), one per accepted node."""
        request, k = self._rows(accept_offsets, len(accepted))
        return request, starts[request] + accepted, starts[request] + k

    # ---- DDTree stages ----
    def topk_logprobs(self, draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, V] -> (topk_lp float32 [B, L, K], topk_id int64 [B, L, K]); equal lp: the smaller id first."""
        if bool(draft_logits.isnan().any()):
            raise ValueError("draft_logits: contains NaN")
        lp = torch.log_softmax(draft_logits.double(), dim=-1).float()
        values, ids = torch.sort(lp, dim=-1, descending=True, stable=True)        # stable: ties keep id order
        width = min(k, lp.shape[-1])
        return values[..., :width].contiguous(), ids[..., :width].contiguous()

    def accept(self, parents: torch.Tensor, tokens: torch.Tensor, choices: torch.Tensor,
               node_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every request's walk at once, on global row indices: from its root to the child whose
        token is the choice at the current node, while one exists."""
        counts = sizes(node_offsets)
        request, _ = self._rows(node_offsets, len(parents))
        parent_row = torch.where(parents >= 0, parents + node_offsets[request], -1)       # [N] global
        current = node_offsets[:-1].clone()                                               # [B] global
        steps = [current]
        for _ in range(widest(counts) - 1):
            match = (parent_row[None, :] == current[:, None]) & (tokens[None, :] == choices[current][:, None])
            moved = match.any(dim=1)
            if not bool(moved.any()):
                break
            current = torch.where(moved, match.int().argmax(dim=1), current)
            steps.append(torch.where(moved, current, -1))
        path = torch.stack(steps, dim=1)                                                  # [B, steps]
        length = (path >= 0).sum(dim=1)
        return to_ragged(path - node_offsets[:-1, None], length), offsets_of(length), choices[current]

    def compact(self, c_kv: torch.Tensor, k_pe: torch.Tensor, starts: torch.Tensor, accepted: torch.Tensor,
                accept_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [B, S, R], k_pe [B, S, dr]: the same moves on one layer's tensors."""
        request, source, target = self._moves(starts, accepted, accept_offsets)
        c_kv, k_pe = c_kv.clone(), k_pe.clone()
        c_kv[request, target], k_pe[request, target] = c_kv[request, source], k_pe[request, source]
        return c_kv, k_pe


def cuda() -> PagedAdapter:
    return PagedAdapter("cuda")
