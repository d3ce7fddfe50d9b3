"""Absorbed-form MLA attention over the latent cache, with a visibility mask.

For query i of request b (head h) and cache slot s:

    score(s) = (q_lat[b,i,h] . c_kv[b,s] + q_pe[b,i,h] . k_pe[b,s]) * scale
    o_lat[b,i,h] = sum_s softmax_s(score) c_kv[b,s]      over the visible slots

Slot s is visible to query i iff s < starts[b] (every cached token), or
s = starts[b] + j with j < n_new[b] and new_visibility[b, i, j] (a new token
of the same forward: causal for prefill / AR decode, ancestor-only for a
tree). Query rows i >= n_new[b] are padding: they see no slot and their
o_lat is zero, so no NaN can leave this function.

`AttentionBackend` is the seam where a CUDA kernel replaces `torch_attention`
(engine/cuda_attention.py implements the same Protocol).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                 new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
        """q_lat [B, N, H, R], q_pe [B, N, H, dr], c_kv [B, T, R], k_pe [B, T, dr],
        starts [B] int64, n_new [B] int64, new_visibility [B, N, N] bool -> o_lat [B, N, H, R]
        (the dtype of q_lat). The new tokens' c_kv/k_pe are already in slots starts[b] + j."""
        ...


def visible_slots(starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                  num_slots: int) -> torch.Tensor:
    """-> bool [B, N, num_slots]: which cache slots each query row sees (module docstring)."""
    batch, n = new_visibility.shape[:2]
    slot = torch.arange(num_slots, device=starts.device)                  # [T]
    cached = slot[None, :] < starts[:, None]                              # [B, T]
    j = slot[None, :] - starts[:, None]                                   # [B, T] new-token index
    is_new = (j >= 0) & (j < n_new[:, None])                              # [B, T]
    j_clamped = j.clamp(0, max(n - 1, 0))
    if n == 0:
        return cached[:, None, :].expand(batch, 0, num_slots)
    new_seen = torch.gather(new_visibility, 2, j_clamped[:, None, :].expand(batch, n, num_slots))
    visible = cached[:, None, :] | (is_new[:, None, :] & new_seen)        # [B, N, T]
    real_row = torch.arange(n, device=starts.device)[None, :] < n_new[:, None]
    return visible & real_row[:, :, None]


def torch_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                    k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                    new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference backend: matmul, mask, softmax, all in float32 (AttentionBackend)."""
    t_used = int((starts + n_new).max()) if starts.numel() else 0          # slots anyone can see
    c = c_kv[:, :t_used].float()                                          # [B, T, R]
    k = k_pe[:, :t_used].float()                                          # [B, T, dr]
    scores = (torch.einsum("bnhr,btr->bnht", q_lat.float(), c)
              + torch.einsum("bnhd,btd->bnht", q_pe.float(), k)) * scale  # [B, N, H, T]
    visible = visible_slots(starts, n_new, new_visibility, t_used)        # [B, N, T]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)                  # rows seeing nothing -> 0
    o_lat = torch.einsum("bnht,btr->bnhr", probs, c)                      # [B, N, H, R]
    return o_lat.to(q_lat.dtype)
