"""The engine's MLA KV cache: one latent and one rotary row per token and layer.

MLA caches only c_kv [kv_lora] and k_pe [d_rope] per token (576 values a token
at Kimi K2 dims), shared by every head. Both are stacked over layers so that a
compaction or a copy moves every layer in one indexing operation. Two layouts:

contiguous (page_size None):
    c_kv [layers, batch, max_len, kv_lora]
    k_pe [layers, batch, max_len, d_rope]

paged (as vLLM, SGLang and FlashMLA keep it):
    c_kv [layers, pages, page_size, kv_lora]
    k_pe [layers, pages, page_size, d_rope]
    block_table int32 [batch, max_len / page_size]: request b's slot s is row
        s % page_size of page block_table[b, s // page_size]

and in both, lengths int64 [batch], the committed tokens per request.

A paged cache hands its pages out in a fixed shuffled order, as a serving engine's
allocator leaves them after a while, so every paged run reads pages out of order.
Each request owns its pages (the engine shares none: it has no prefix cache).

Both layouts are one array of rows per layer: `slot_rows` maps (request, slot) to a
row of `rows(layer)`, and every write and move goes through it. `Transformer.forward`
writes slots but never changes `lengths`: the decoding loop owns them (it knows when a
round's tokens are committed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kdtr_format import ModelConfig

PAGE_ORDER_SEED = 0   # the fixed shuffle of a paged cache's pages


@dataclass
class KVCache:
    c_kv: torch.Tensor                        # [layers, batch, max_len, R] or [layers, pages, page, R]
    k_pe: torch.Tensor                        # [layers, batch, max_len, dr] or [layers, pages, page, dr]
    lengths: torch.Tensor                     # int64 [batch]
    block_table: torch.Tensor | None = None   # int32 [batch, max_len / page]: the paged layout

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, page_size: int | None = None) -> "KVCache":
        """A zero-filled cache for `batch` requests of up to `max_len` tokens each; paged
        with `page_size` (max_len rounded up to whole pages)."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVCache.allocate: {name} must be an integer >= 0, got {value!r}")
        if page_size is not None and (not isinstance(page_size, int) or isinstance(page_size, bool)
                                      or page_size < 1):
            raise ValueError(f"KVCache.allocate: page_size must be an integer >= 1 or None, got {page_size!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCache.allocate: dtype must be a floating dtype, got {dtype}")
        layers, widths = cfg.num_hidden_layers, (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        lengths = torch.zeros(batch, device=device, dtype=torch.int64)
        if page_size is None:
            c_kv, k_pe = (torch.zeros(layers, batch, max_len, w, device=device, dtype=dtype) for w in widths)
            return cls(c_kv, k_pe, lengths)
        per_request = math.ceil(max_len / page_size)
        order = torch.randperm(batch * per_request, generator=torch.Generator().manual_seed(PAGE_ORDER_SEED))
        block_table = order.view(batch, per_request).to(device=device, dtype=torch.int32)
        c_kv, k_pe = (torch.zeros(layers, batch * per_request, page_size, w, device=device, dtype=dtype)
                      for w in widths)
        return cls(c_kv, k_pe, lengths, block_table)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int | None:
        return self.c_kv.shape[2] if self.paged else None

    @property
    def num_layers(self) -> int:
        return self.c_kv.shape[0]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0] if self.paged else self.c_kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.c_kv.shape[2] if self.paged else self.c_kv.shape[2]

    @property
    def device(self) -> torch.device:
        return self.c_kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.c_kv.dtype

    def slot_rows(self, slots: torch.Tensor, requests: torch.Tensor | None = None) -> torch.Tensor:
        """slots int64 (each in [0, max_len)) of `requests` (broadcast with slots; default:
        row b of slots [B, N] is request b) -> int64, their rows in `rows()`."""
        if requests is None:
            requests = torch.arange(slots.shape[0], device=slots.device)[:, None]
        if not self.paged:
            return requests * self.max_len + slots
        page = self.page_size
        return self.block_table.long()[requests, slots // page] * page + slots % page

    def rows(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (c_kv, k_pe) as rows over the same memory: [layers, rows, w], or [rows, w] of one layer."""
        flat = tuple(t.view(t.shape[0], -1, t.shape[-1]) for t in (self.c_kv, self.k_pe))
        return flat if layer is None else (flat[0][layer], flat[1][layer])

    def write(self, layer: int, slots: torch.Tensor, real: torch.Tensor, c_kv: torch.Tensor,
              k_pe: torch.Tensor) -> None:
        """Layer `layer`'s slots [B, N] <- c_kv [B, N, R], k_pe [B, N, dr] where real [B, N];
        padding rows write back what their (distinct) slot holds, so nothing reads the host."""
        index = self.slot_rows(slots).reshape(-1)
        keep = real.reshape(-1, 1)
        for cache, new in zip(self.rows(layer), (c_kv, k_pe)):
            cache.index_copy_(0, index, torch.where(keep, new.reshape(index.shape[0], -1).to(cache.dtype),
                                                    cache[index]))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (c_kv, k_pe) of one layer as attention reads them: [B, max_len, w] contiguous, or
        the pools [pages, page_size, w] (with `block_table`) paged."""
        return self.c_kv[layer], self.k_pe[layer]
