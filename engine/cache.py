"""The engine's MLA KV cache: one latent and one rotary row per token and layer.

MLA caches only c_kv [kv_lora] and k_pe [d_rope] per token (576 values a token
at Kimi K2 dims), shared by every head. Both are stacked over layers so that a
compaction or a copy moves every layer in one indexing operation:

    c_kv [layers, batch, max_len, kv_lora]
    k_pe [layers, batch, max_len, d_rope]
    lengths int64 [batch]     committed tokens per request

`Transformer.forward` writes slots but never changes `lengths`: the decoding
loop owns them (it knows when a round's tokens are committed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtr_format import ModelConfig


@dataclass
class KVCache:
    c_kv: torch.Tensor      # [layers, batch, max_len, kv_lora]
    k_pe: torch.Tensor      # [layers, batch, max_len, d_rope]
    lengths: torch.Tensor   # int64 [batch]

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "KVCache":
        """A zero-filled cache for `batch` requests of up to `max_len` tokens each."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVCache.allocate: {name} must be an integer >= 0, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCache.allocate: dtype must be a floating dtype, got {dtype}")
        layers = cfg.num_hidden_layers
        return cls(
            c_kv=torch.zeros(layers, batch, max_len, cfg.kv_lora_rank, device=device, dtype=dtype),
            k_pe=torch.zeros(layers, batch, max_len, cfg.qk_rope_head_dim, device=device, dtype=dtype),
            lengths=torch.zeros(batch, device=device, dtype=torch.int64),
        )

    @property
    def num_layers(self) -> int:
        return self.c_kv.shape[0]

    @property
    def batch(self) -> int:
        return self.c_kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[2]

    @property
    def device(self) -> torch.device:
        return self.c_kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.c_kv.dtype
