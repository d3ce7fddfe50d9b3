"""Batch-invariant MLA attention on the tensor cores: invariant mode's attention on a GPU.

The contract is `engine.attention`'s (absorbed MLA over the latent cache, a visibility mask,
padding rows 0). What makes it invariant is the order in which a query row meets its keys. Row
i of request b sees its *key list*: the cached slots 0 .. starts[b] - 1, then its visible new
tokens j (slot starts[b] + j) in increasing j; key c of the list is

    slot(c) = c                              c < starts[b]
    slot(c) = starts[b] + new_index[i, c - starts[b]]     otherwise (new_index: its visible j's, ascending)

The kernel walks the list in blocks of BLOCK_KEYS keys from c = 0 (tensor-core tile products,
online softmax in float32, P rounded to the compute dtype as the default-mode kernel does) and
cuts it into splits of `split_keys` keys (SPLIT_KEYS by default); the splits' partial outputs are
combined in split order.
Block and split boundaries are fixed points of the list, the heads of one row are the rows of
every tile, and no tile mixes query rows, so a row's output is a function of its key list alone:
the same bits whatever the tree beside it, its gaps (an AR step sees the same list with no gaps),
the batch, the cache's size or layout.

Launches per layer: one (one split: the cache holds at most split_keys slots a request), else two
(the splits, then their combine). Only the splits holding a row's keys run for it, and a row whose
list fits in the first split gets its output from that split's program directly, which is what
the combine would give (one split that saw keys: weight exp(0) = 1, o x 1 / 1 = o), so the
combine passes it by. `InvariantAttention.bind` builds the key lists once per forward on the
device (no host read: a CUDA graph can hold it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import cast, dot

BLOCK_H = 64           # heads per program: the rows of every tile product (all of K2's: a row's keys
                       # read once; docs/results/invariant-attention-sweep-h100.md, with 8 warps)
BLOCK_KEYS = 32        # keys per tile
SPLIT_KEYS = 512       # keys per split (a multiple of BLOCK_KEYS)


@triton.jit
def _split_kernel(q_lat_ptr, q_pe_ptr, c_kv_ptr, k_pe_ptr, table_ptr, new_index_ptr, starts_ptr, length_ptr,
                  out_ptr, part_o_ptr, part_lse_ptr, scale, rows, N, H, R, DR, pages_per_request, page_size,
                  c_page_stride, k_page_stride,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                  SPLIT_KEYS: tl.constexpr, IEEE: tl.constexpr):
    """Program (row, head block, split): the split's keys of the row's list -> out (the whole list
    in split 0) or the split's normalized partial output and log-sum-exp (float32); nothing for a
    split past the list."""
    row = tl.program_id(0)
    split = tl.program_id(2)
    b = row // N
    length = tl.load(length_ptr + row)
    lo = split * SPLIT_KEYS
    if lo >= length and split > 0:        # past the row's list: the combine reads no partial of it
        return
    start = tl.load(starts_ptr + b)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_DR)
    head_row = row.to(tl.int64) * H + h                                   # [BH]
    q = tl.load(q_lat_ptr + head_row[:, None] * R + r[None, :], mask=(h < H)[:, None] & (r < R)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + head_row[:, None] * DR + d[None, :], mask=(h < H)[:, None] & (d < DR)[None, :],
                   other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    hi = tl.minimum(lo + SPLIT_KEYS, length)
    for c0 in range(lo, hi, BLOCK_KEYS):
        c = c0 + tl.arange(0, BLOCK_KEYS)
        valid = c < hi
        new = c - start
        j = tl.load(new_index_ptr + row.to(tl.int64) * N + new, mask=valid & (new >= 0), other=0)
        slot = tl.where(new >= 0, start + j, c)
        page = tl.load(table_ptr + b * pages_per_request + slot // page_size, mask=valid, other=0).to(tl.int64)
        within = (slot % page_size).to(tl.int64)
        c_kv = tl.load(c_kv_ptr + (page * c_page_stride + within * R)[:, None] + r[None, :],
                       mask=valid[:, None] & (r < R)[None, :], other=0.0)          # [BK, BR]
        k_pe = tl.load(k_pe_ptr + (page * k_page_stride + within * DR)[:, None] + d[None, :],
                       mask=valid[:, None] & (d < DR)[None, :], other=0.0)         # [BK, BDR]
        s = dot(q, tl.trans(c_kv), tl.zeros([BLOCK_H, BLOCK_KEYS], dtype=tl.float32), IEEE)
        s = dot(q_pe, tl.trans(k_pe), s, IEEE) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot(cast(p, c_kv_ptr.dtype.element_ty), c_kv, acc * alpha[:, None], IEEE)
        m_i = m_new
    seen = l_i > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    inside = (h < H)[:, None] & (r < R)[None, :]
    if length <= SPLIT_KEYS:              # the whole list in this split: the output itself
        tl.store(out_ptr + head_row[:, None] * R + r[None, :], cast(o, out_ptr.dtype.element_ty), mask=inside)
    else:
        part = split.to(tl.int64) * rows * H + head_row                    # [BH]
        tl.store(part_o_ptr + part[:, None] * R + r[None, :], o, mask=inside)
        tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=h < H)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, length_ptr, out_ptr, rows, H, R,
                    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """Program (row, head block) of a row whose list spans several splits: out = sum_s w_s o_s /
    sum_s w_s over the splits holding its keys, w_s = exp(lse_s - max lse), in split order; a
    split that saw no key weighs exactly 0. Rows within one split have their output already."""
    row = tl.program_id(0)
    length = tl.load(length_ptr + row)
    if length <= SPLIT_KEYS:
        return
    splits = tl.cdiv(length, SPLIT_KEYS)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    head_row = row.to(tl.int64) * H + h
    inside = (h < H)[:, None] & (r < R)[None, :]
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + s * rows * H + head_row, mask=h < H, other=float("-inf")))
    numerator = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    denominator = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(splits):
        part = s * rows * H + head_row
        lse = tl.load(part_lse_ptr + part, mask=h < H, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
        numerator += w[:, None] * tl.load(part_o_ptr + part[:, None] * R + r[None, :], mask=inside, other=0.0)
        denominator += w
    seen = denominator > 0.0
    o = tl.where(seen[:, None], numerator / tl.where(seen, denominator, 1.0)[:, None], 0.0)
    tl.store(out_ptr + head_row[:, None] * R + r[None, :], cast(o, out_ptr.dtype.element_ty), mask=inside)


def key_lists(starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """starts [B], n_new [B], new_visibility [B, N, N] bool -> (new_index int32 [B N, N]: row i's
    visible new tokens j < n_new[b] in increasing order, then padding; length int32 [B N]: its
    key list's length, starts[b] + their count, 0 for a padding row)."""
    batch, n = new_visibility.shape[:2]
    j = torch.arange(n, device=new_visibility.device)
    real = j[None, :] < n_new[:, None]                                    # [B, N]
    seen = new_visibility & real[:, None, :] & real[:, :, None]           # [B, N, N]
    new_index = torch.where(seen, j, n + j).sort(dim=-1).values.clamp(max=max(n - 1, 0))
    length = torch.where(real, starts[:, None] + seen.sum(-1), 0)
    return new_index.to(torch.int32).view(batch * n, n), length.to(torch.int32).view(batch * n)


def _rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A layer's keys [requests or pages, slots, w] -> (the same with unit row stride, its page stride)."""
    if cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
        cache = cache.contiguous()
    return cache, cache.stride(0)


class InvariantAttention:
    """AttentionBackend (engine.attention): q_lat [B, N, H, R], q_pe [B, N, H, dr], c_kv [B, T, R],
    k_pe [B, T, dr] (or pools and a block table: `bind_paged`), starts [B], n_new [B],
    new_visibility [B, N, N] -> o_lat [B, N, H, R] in q_lat's dtype, bitwise a function of each
    row's key list (module docstring). float32 or bfloat16 on one CUDA device (or Triton's
    interpreter). split_keys, block_h (heads a program, a power of two) and num_warps are one
    choice for every call: a row's bits follow them."""

    reuses_out = True           # bind(..., reuse_out=True): engine.attention.bind_attention

    def __init__(self, split_keys: int = SPLIT_KEYS, block_h: int = BLOCK_H, num_warps: int = 8) -> None:
        if split_keys <= 0 or split_keys % BLOCK_KEYS:
            raise ValueError(f"InvariantAttention: split_keys must be a positive multiple of {BLOCK_KEYS}, "
                             f"got {split_keys}")
        self.split_keys, self.block_h, self.num_warps = split_keys, block_h, num_warps

    def invariant_form(self) -> "InvariantAttention":
        return self

    def bind(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor, num_slots: int,
             reuse_out: bool = False):
        batch = new_visibility.shape[0]
        table = torch.arange(batch, device=new_visibility.device, dtype=torch.int32)[:, None]   # request b: page b
        return self._bound(starts, n_new, new_visibility, table, reuse_out)

    def bind_paged(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                   block_table: torch.Tensor, reuse_out: bool = False):
        """The per-layer call over the pools c_kv [pages, page_size, R], k_pe [pages, page_size, dr]."""
        return self._bound(starts, n_new, new_visibility, block_table.to(torch.int32).contiguous(), reuse_out)

    def _bound(self, starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor, table: torch.Tensor,
               reuse_out: bool):
        """The per-layer call: request b's slot s is row s % page of page table[b, s // page], page
        the keys' second dimension (a contiguous cache: one page a request, table [B, 1])."""
        batch, n = new_visibility.shape[:2]
        new_index, length = key_lists(starts, n_new, new_visibility)
        context = starts.to(torch.int32).contiguous()
        kept: list[torch.Tensor] = []         # reuse_out: the o_lat every call returns
        parts: list[torch.Tensor] = []        # the splits' partials, allocated at the first call

        def attend(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   scale: float) -> torch.Tensor:
            heads, rank = q_lat.shape[2:]
            rope = q_pe.shape[3]
            rows = batch * n
            page = c_kv.shape[1]
            splits = triton.cdiv(max(table.shape[1] * page, 1), self.split_keys)
            o_lat = kept[0] if kept else torch.empty(batch, n, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
            if reuse_out and not kept:
                kept.append(o_lat)
            if splits > 1 and not parts:
                parts.extend([torch.empty(splits, rows, heads, rank, dtype=torch.float32, device=q_lat.device),
                              torch.empty(splits, rows, heads, dtype=torch.float32, device=q_lat.device)])
            if rows == 0 or heads == 0:
                return o_lat
            c_rows, c_stride = _rows(c_kv)
            k_rows, k_stride = _rows(k_pe)
            part_o, part_lse = parts or (o_lat, o_lat)        # one split: no partial is written
            block_r, block_dr = triton.next_power_of_2(rank), max(16, triton.next_power_of_2(rope))
            grid = (rows, triton.cdiv(heads, self.block_h))
            _split_kernel[grid + (splits,)](
                q_lat.contiguous(), q_pe.contiguous(), c_rows, k_rows, table, new_index, context, length, o_lat,
                part_o, part_lse, scale, rows, n, heads, rank, rope, table.shape[1], page, c_stride, k_stride,
                BLOCK_H=self.block_h, BLOCK_R=block_r, BLOCK_DR=block_dr, BLOCK_KEYS=BLOCK_KEYS,
                SPLIT_KEYS=self.split_keys, IEEE=q_lat.dtype == torch.float32, num_warps=self.num_warps)
            if splits > 1:
                _combine_kernel[grid](part_o, part_lse, length, o_lat, rows, heads, rank,
                                      BLOCK_H=self.block_h, BLOCK_R=block_r, SPLIT_KEYS=self.split_keys,
                                      num_warps=self.num_warps)
            return o_lat
        return attend

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 starts: torch.Tensor, n_new: torch.Tensor, new_visibility: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return self.bind(starts, n_new, new_visibility, c_kv.shape[1])(q_lat, q_pe, c_kv, k_pe, scale)


invariant_attention = InvariantAttention()
