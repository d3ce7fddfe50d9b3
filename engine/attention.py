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
(engine/cuda_attention.py implements the same Protocol). A backend may also have
`bind(starts, n_new, new_visibility, num_slots)`, returning the per-layer call
(q_lat, q_pe, c_kv, k_pe, scale) -> o_lat with the metadata every layer shares
prepared once per forward; `bind_attention` gives a plain callable that form too.

Paged caches (engine/cache.py): the per-layer call then gets the pools c_kv
[pages, page_size, R], k_pe [pages, page_size, dr], and the block table int32
[B, T / page_size] maps request b's slot s to row s % page_size of page
table[b, s // page_size]. A backend with `bind_paged(starts, n_new, new_visibility,
block_table)` reads the pools through the table itself (the CUDA kernel); for any
other, `bind_attention` gathers each request's pages into the contiguous [B, T, w]
form first (the torch backends: a reference, not a fast path).

Two torch backends:
- `torch_attention`: the whole batch at once, over every cache slot (masked), so it
  reads nothing back to the host and can be captured in a CUDA graph.
- `invariant_torch_attention`: each query row alone over exactly its visible slots,
  in slot order; a row's output depends on that sequence of keys only, whatever the
  number of rows, their tree and the other requests (docs/precision.md, section 3).
  It loops on the host over rows (it reads n_new, starts and the mask back).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class AttentionBackend(Protocol):
    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, starts: torch.Tensor, n_new: torch.Tensor,
                 new_visibility: torch.Tensor, scale: float) -> torch.Tensor:
        """q_lat [B, N, H, R], q_pe [B, N, H, dr], c_kv [B, T, R], k_pe [B, T, dr],
        starts [B] int64, n_new [B] int64, new_visibility [B, N, N] bool -> o_lat [B, N, H, R]
        (the dtype of q_lat). The new tokens' c_kv/k_pe are already in slots starts[b] + j."""
        ...


def bind_attention(backend: AttentionBackend, starts: torch.Tensor, n_new: torch.Tensor,
                   new_visibility: torch.Tensor, num_slots: int,
                   block_table: torch.Tensor | None = None, reuse_out: bool = False) -> LayerAttention:
    """The per-layer call of `backend` for one forward over a cache of num_slots slots per
    request, paged when block_table int32 [B, num_slots / page_size] is given (module docstring).
    reuse_out: the caller keeps no layer's o_lat past the next call, so a backend that offers
    it (``reuses_out``) may return one buffer every call."""
    reuse = {"reuse_out": True} if reuse_out and getattr(backend, "reuses_out", False) else {}
    if block_table is not None:
        bind_paged = getattr(backend, "bind_paged", None)
        if bind_paged is not None:
            return bind_paged(starts, n_new, new_visibility, block_table, **reuse)
        contiguous = bind_attention(backend, starts, n_new, new_visibility, num_slots)
        table = block_table.long()

        def gathered(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     scale: float) -> torch.Tensor:
            return contiguous(q_lat, q_pe, c_kv[table].flatten(1, 2), k_pe[table].flatten(1, 2), scale)
        return gathered
    bind = getattr(backend, "bind", None)
    if bind is not None:
        return bind(starts, n_new, new_visibility, num_slots, **reuse)
    return lambda q_lat, q_pe, c_kv, k_pe, scale: backend(q_lat, q_pe, c_kv, k_pe, starts, n_new,
                                                          new_visibility, scale)


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


class TorchAttention:
    """The reference backend: matmul, mask, softmax, all in float32, over every slot."""

    def bind(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
             num_slots: int) -> LayerAttention:
        visible = visible_slots(starts, n_new, new_visibility, num_slots)[:, :, None, :]   # [B, N, 1, T]

        def attend(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   scale: float) -> torch.Tensor:
            c, k = c_kv.float(), k_pe.float()                                 # [B, T, R], [B, T, dr]
            scores = (torch.einsum("bnhr,btr->bnht", q_lat.float(), c)
                      + torch.einsum("bnhd,btd->bnht", q_pe.float(), k)) * scale   # [B, N, H, T]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)              # rows seeing nothing -> 0
            return torch.einsum("bnht,btr->bnhr", probs, c).to(q_lat.dtype)   # [B, N, H, R]
        return attend

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return self.bind(starts, n_new, new_visibility, c_kv.shape[1])(q_lat, q_pe, c_kv, k_pe, scale)

    def invariant_form(self) -> AttentionBackend:
        return invariant_torch_attention


class InvariantTorchAttention:
    """Each real query row alone over its visible slots in slot order (module docstring)."""

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                 scale: float) -> torch.Tensor:
        o_lat = torch.zeros_like(q_lat)
        seen = new_visibility.cpu()
        for b, (start, count) in enumerate(zip(starts.tolist(), n_new.tolist())):
            context = torch.arange(start)
            for i in range(count):
                slots = torch.cat([context, start + seen[b, i, :count].nonzero().flatten()]).to(c_kv.device)
                c, k = c_kv[b, slots].float(), k_pe[b, slots].float()           # [S, R], [S, dr]
                scores = (q_lat[b, i].float() @ c.T + q_pe[b, i].float() @ k.T) * scale   # [H, S]
                o_lat[b, i] = (torch.softmax(scores, dim=-1) @ c).to(o_lat.dtype)
        return o_lat

    def invariant_form(self) -> AttentionBackend:
        return self


torch_attention = TorchAttention()
invariant_torch_attention = InvariantTorchAttention()


def invariant_form(backend: AttentionBackend) -> AttentionBackend:
    """The batch-invariant form of `backend` (its `invariant_form()`); ValueError when it has none."""
    make = getattr(backend, "invariant_form", None)
    if make is None:
        raise ValueError(f"attention backend {backend!r} has no invariant form (invariant_form())")
    return make()
