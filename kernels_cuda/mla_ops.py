"""Tree-verify MLA attention (absorbed form, bit-packed ancestor-only mask) as a torch op.

A ragged batch of B requests (csrc/mla_verify.cu has the math):

    q_lat [T, H, R], q_pe [T, H, dr]     request b's queries are rows q_offsets[b] ..
                                         q_offsets[b] + tree_sizes[b] (T = the sum of tree
                                         sizes, or more with padding rows, left unwritten)
    c_kv [S, R], k_pe [S, dr]            request b's keys, slots 0 .. context[b] + tree_sizes[b]
                                         (its cached context, then its tree tokens), are
                                         rows kv_offsets[b] + s (`mla_verify`)
    c_kv [P, page, R], k_pe [P, page, dr]  or pages, as vLLM / FlashMLA keep them
    block_table int32 [B, W]             (`mla_verify_paged`): slot s is row s % page of page
                                         block_table[b, s // page]; entries past a request's
                                         last page may be -1 and are never read
    visibility [T, W] int32 / uint32     row t: bit j of word j // 32 = token t sees tree token j
                                         (of its own tree); every context key is visible
    -> o_lat [T, H, R] (q's dtype or float32), lse [T, H] float32 (natural log-sum-exp of the
       scaled scores; -inf and o_lat = 0 for a row that sees no key)

Inputs are float32 or bfloat16 (all four alike), with float32 accumulation. Four kernels
(`KERNELS`), picked at run time (`kernel="auto"`, `verify_kernel`):

- "wgmma": bf16 at Kimi K2 dims (R 512, dr 64) on Hopper (compute capability 9.0) when the
  library carries sm_90a code (build.py's default); TMA boxes, so contiguous keys or pages of
  8, 16, 32 or a multiple of 64 slots (`paged_tensor_cores`). One warpgroup scores every key
  tile. "wgmma_pairs", on the same inputs, has the two warpgroups score alternate tiles
  (FlashMLA's seesaw); it runs only when asked for by name: the one-scorer kernel is the
  faster at nearly every shape measured (kernels_cuda/NOTES-mla.md, v4.2).
- "mma": the same inputs on every GPU of compute capability 8.0 and later (and on Hopper for
  the pages wgmma does not read); mma.sync and cp.async, any page size. Its tiles follow the
  device's shared memory; "mma_100k" forces the tile plan of 100 KB GPUs (sm_86 / 89 / 120),
  to test it on a larger one.
- "cuda_cores": everything else (float32, other dims up to kv_lora 512 and rope 64, misaligned
  inputs, the invariant plan).

Each computes the same bits paged and contiguous on the same logical keys.

`mla_verify` checks its arguments (a bad one raises `MlaInputError` naming it) and runs the
op `kdtree::mla_verify_out` on torch's current stream. Long key ranges are split across
blocks (flash-decoding); `plan_splits` picks the split from host-side maxima, which the caller
passes (`max_tree`, `max_kv`) or `mla_verify` reads from the device once.

Invariant plan (`invariant=True`): the CUDA-core kernel with each query row's key list (its
cached slots, then its visible tree tokens in order) cut into at most INVARIANT_SPLITS splits
of whole 32-key blocks, sized from the list's length alone. A row's warp folds a split's keys
one at a time in list order (online softmax per key, the dot products in one fixed lane order)
and the combine adds the splits in order, so its output is a function of its own key list: the
same bits whatever the tree size, the other requests and max_kv, and the same bits for a token
verified inside a tree (its ancestors at scattered slots) as for the token decoded alone over a
contiguous cache.
The default plan has neither property: its splits follow the tree size and the batch (a
split boundary regroups a row's partial sums), and the tensor-core kernels sum each key tile
in an order set by the keys' slots.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from . import _lib

KEY_BLOCK = 64          # split_keys is a multiple of this (the wgmma kernel's key tile)
FAST_ROWS = 64          # query rows per block of the tensor-core kernels
GENERIC_ROWS = 4        # query rows per block of the CUDA-core kernel
FAST_BLOCKS_PER_SM = 1  # resident blocks per multiprocessor (shared memory bound)
GENERIC_BLOCKS_PER_SM = 8
SPLIT_COST_TILES = 4    # a split's fixed cost (its Q tile, pipeline fill, partial outputs to
                        # combine) in key tiles
COMBINE_COST_TILES = 0.2  # each split's share of the combine, which walks a row's splits in order,
                          # in key tiles (fitted to an H100 sweep of every split length:
                          # docs/results/mla-split-sweep-h100.md)
MAX_SPLITS = 128        # the most splits the default plan considers
INVARIANT_SPLITS = 8    # the invariant plan's splits of a row's key list (its partials: 16 KB a row)
CUDA_CORE_DIMS = (512, 64)   # the most kv_lora and rope_dim the CUDA-core kernel holds in registers

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
KERNELS = {"auto": 0, "cuda_cores": 1, "mma": 2, "mma_100k": 3, "wgmma": 4, "wgmma_pairs": 5}  # the C codes
HOPPER_KERNELS = ("wgmma", "wgmma_pairs")
_INDEX_NAMES = ("context", "tree_sizes", "q_offsets")


class MlaInputError(ValueError):
    """An argument of `mla_verify` that the kernel cannot take."""


@dataclass(frozen=True)
class SplitPlan:
    """Request b's keys [0, kv_len) are cut into splits [i * split_keys, (i + 1) * split_keys);
    split_keys 0: each row's key list into num_splits splits sized from its length (the invariant plan)."""

    num_splits: int
    split_keys: int


def tensor_core_kernel(device: torch.device) -> str | None:
    """The tensor-core kernel bf16 inputs at K2 dims take on `device`: "wgmma" (compute
    capability 9.0 and a library with sm_90a code), "mma" (compute capability 8.0 and later),
    or None."""
    return {2: "wgmma", 1: "mma"}.get(_tensor_core_code(device))


def uses_tensor_cores(dtype: torch.dtype, kv_lora: int, rope_dim: int, device: torch.device) -> bool:
    """Whether `mla_verify` takes a tensor-core kernel on contiguous keys: bf16 at Kimi K2 dims
    on a GPU that has one (`tensor_core_kernel`), inputs 16-byte aligned as torch allocations are."""
    return dtype == torch.bfloat16 and kv_lora == 512 and rope_dim == 64 and tensor_core_kernel(device) is not None


def paged_tensor_cores(page_size: int, kernel: str = "wgmma") -> bool:
    """Whether the tensor-core kernel `kernel` reads pages of `page_size` slots. "wgmma": a
    multiple of 64 (one TMA box per 64-key tile and chunk), or 8, 16 or 32 (64 / page_size boxes,
    each at least one 1024-byte period of the 128-byte swizzle; "wgmma_pairs" alike). "mma"
    copies key rows one by one: every page size."""
    if kernel not in HOPPER_KERNELS:
        return True
    return page_size % KEY_BLOCK == 0 or (KEY_BLOCK % page_size == 0 and page_size >= 8)


def verify_kernel(dtype: torch.dtype, kv_lora: int, rope_dim: int, device: torch.device,
                  page_size: int | None = None) -> str:
    """The kernel `kernel="auto"` runs for 16-byte aligned inputs on `device`, contiguous keys
    (page_size None) or pages: wgmma where it runs and reads the layout, else mma on a GPU that has
    tensor-core MLA, else the CUDA cores."""
    if not uses_tensor_cores(dtype, kv_lora, rope_dim, device):
        return "cuda_cores"
    kernel = tensor_core_kernel(device)
    if kernel == "wgmma" and page_size is not None and not paged_tensor_cores(page_size, "wgmma"):
        return "mma"
    return kernel


@functools.cache
def _tensor_core_code(device: torch.device) -> int:
    with torch.cuda.device(device):
        return _lib.function("kdtree_mla_tensor_cores", ())()


def plan_splits(batch: int, max_tree: int, heads: int, max_kv: int, fast: bool, sm_count: int,
                invariant: bool = False) -> SplitPlan:
    """The split that gives the busiest multiprocessor the least work; with `invariant`, each
    row's key list in INVARIANT_SPLITS splits sized from its length, whatever the rest (module
    docstring).

    Blocks = row blocks x splits, run in waves of (resident blocks per multiprocessor x
    sm_count); each block costs its key tiles plus SPLIT_COST_TILES, and the combine (more than
    one split) COMBINE_COST_TILES a split. Ties go to fewer splits."""
    if invariant:
        return SplitPlan(INVARIANT_SPLITS, 0)
    rows_per_block = FAST_ROWS if fast else GENERIC_ROWS
    slots = sm_count * (FAST_BLOCKS_PER_SM if fast else GENERIC_BLOCKS_PER_SM)
    row_blocks = batch * math.ceil(max_tree * heads / rows_per_block)
    tiles = math.ceil(max_kv / KEY_BLOCK)

    def cost(splits: int) -> float:
        busiest = math.ceil(row_blocks * splits / slots) * (math.ceil(tiles / splits) + SPLIT_COST_TILES)
        return busiest + (COMBINE_COST_TILES * splits if splits > 1 else 0.0)

    splits = min(range(1, min(tiles, MAX_SPLITS) + 1), key=lambda s: (cost(s), s))
    split_keys = KEY_BLOCK * math.ceil(tiles / splits)
    return SplitPlan(math.ceil(max_kv / split_keys), split_keys)


def pack_visibility(visibility: torch.Tensor) -> torch.Tensor:
    """bool [..., n, m] -> int32 [..., n, ceil(m / 32)]: bit j % 32 of word j // 32 is
    visibility[..., j] (little-endian bit order, uint32 words stored as int32)."""
    m = visibility.shape[-1]
    words = max(1, math.ceil(m / 32))
    padded = torch.nn.functional.pad(visibility.to(torch.int64), (0, 32 * words - m))
    bits = padded.view(*visibility.shape[:-1], words, 32)
    packed = (bits << torch.arange(32, device=visibility.device)).sum(-1)   # [..., n, W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@torch.library.custom_op("kdtree::mla_verify_out", mutates_args=("o_lat", "lse"))
def mla_verify_out(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   context: torch.Tensor, tree_sizes: torch.Tensor, q_offsets: torch.Tensor,
                   kv_offsets: torch.Tensor | None, visibility: torch.Tensor, scale: float, max_tree: int,
                   num_splits: int, split_keys: int, kernel: str,
                   o_lat: torch.Tensor, lse: torch.Tensor, block_table: torch.Tensor | None = None) -> None:
    """Writes o_lat [T, H, R] and lse [T, H]; arguments already checked by `mla_verify` /
    `mla_verify_paged`. Keys: kv_offsets [B] with c_kv [S, R], or block_table [B, W] with
    pools c_kv [P, page, R] (kv_offsets None). num_splits * split_keys (a multiple of 32)
    covers every request's keys, or split_keys is 0 (the invariant plan, `SplitPlan`); paged on
    wgmma, split_keys is a multiple of min(page, 64) too. kernel: one of `KERNELS` ("auto": the fastest this device runs for the inputs); a
    kernel that cannot run them here raises KernelError."""
    total_tokens, heads, kv_lora = q_lat.shape
    rows = total_tokens * heads
    part_o = part_lse = None
    if num_splits > 1:
        part_o = torch.empty((num_splits, rows, kv_lora), dtype=torch.float32, device=q_lat.device)
        part_lse = torch.empty((num_splits, rows), dtype=torch.float32, device=q_lat.device)
    paged = block_table is not None
    p = ctypes.c_void_p
    fn = _lib.function("kdtree_mla_verify", (
        p, p, p, p, p, p, p, p, p, ctypes.c_int, ctypes.c_int, p, ctypes.c_int, p, p, p, p,
        ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, p))
    status = fn(
        _lib.ptr(q_lat), _lib.ptr(q_pe), _lib.ptr(c_kv), _lib.ptr(k_pe), _lib.ptr(context),
        _lib.ptr(tree_sizes), _lib.ptr(q_offsets), p(None) if paged else _lib.ptr(kv_offsets),
        _lib.ptr(block_table) if paged else p(None), block_table.shape[1] if paged else 0,
        c_kv.shape[1] if paged else 0, _lib.ptr(visibility), visibility.shape[1], _lib.ptr(o_lat), _lib.ptr(lse),
        p(None) if part_o is None else _lib.ptr(part_o), p(None) if part_lse is None else _lib.ptr(part_lse),
        context.shape[0], total_tokens, c_kv.numel() // kv_lora, heads, kv_lora, q_pe.shape[2], max_tree,
        num_splits, split_keys, scale, _DTYPE_CODES[q_lat.dtype], _DTYPE_CODES[o_lat.dtype], KERNELS[kernel],
        _lib.stream(q_lat.device))
    _lib.check(status, "kdtree_mla_verify")


@mla_verify_out.register_fake
def _(q_lat, q_pe, c_kv, k_pe, context, tree_sizes, q_offsets, kv_offsets, visibility, scale,
      max_tree, num_splits, split_keys, kernel, o_lat, lse, block_table=None) -> None:
    return None


def mla_verify(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               context: torch.Tensor, tree_sizes: torch.Tensor, q_offsets: torch.Tensor,
               kv_offsets: torch.Tensor, visibility: torch.Tensor, scale: float, *,
               max_tree: int | None = None, max_kv: int | None = None,
               out_dtype: torch.dtype | None = None, kernel: str = "auto", invariant: bool = False,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention (module docstring) over c_kv [S, R], k_pe [S, dr], request b's
    keys at rows kv_offsets[b] .. -> (o_lat [T, H, R], lse [T, H] float32).

    max_tree / max_kv: the largest tree size and context + tree size. When either is None,
    the index arrays are read back once (a device sync) and their values are checked too
    (offsets consistent, key rows inside c_kv); when both are given they are trusted.
    out_dtype: q's dtype (default) or float32. kernel: one of `KERNELS` ("auto": the fastest
    this device runs for the inputs, `verify_kernel`); one that cannot run them here raises
    MlaInputError naming why. invariant: the invariant plan (module docstring; the CUDA cores).
    out: (o_lat, lse) to write into instead of fresh tensors.
    """
    keys = _KeyRows(_index_tensor("kv_offsets", kv_offsets, _batch_of(context)), paged=False)
    return _verify(q_lat, q_pe, c_kv, k_pe, context, tree_sizes, q_offsets, keys, visibility, scale,
                   max_tree, max_kv, out_dtype, kernel, invariant, out)


def mla_verify_paged(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     context: torch.Tensor, tree_sizes: torch.Tensor, q_offsets: torch.Tensor,
                     block_table: torch.Tensor, visibility: torch.Tensor, scale: float, *,
                     max_tree: int | None = None, max_kv: int | None = None,
                     out_dtype: torch.dtype | None = None, kernel: str = "auto", invariant: bool = False,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_verify` with the keys in pages: c_kv [P, page, R], k_pe [P, page, dr] and
    block_table int32 [B, W] (module docstring) -> (o_lat [T, H, R], lse [T, H] float32).

    The same plan, kernels and bits as `mla_verify` on the same logical keys; with
    kernel="auto", pages that wgmma does not read (`paged_tensor_cores`: 1, 2, 4, non-divisors
    of 64) take the mma kernel. With
    max_tree / max_kv None the values are checked as by `mla_verify`, and each request's pages
    (ceil((context + tree) / page) entries of its table row) must lie in [0, P); given, they
    are trusted and only ceil(max_kv / page) <= W is checked.
    """
    if not isinstance(block_table, torch.Tensor):
        raise MlaInputError(f"block_table: expected a torch.Tensor, got {type(block_table).__name__}")
    batch = _batch_of(context)
    if block_table.dtype != torch.int32:
        raise MlaInputError(f"block_table: dtype {block_table.dtype}, expected int32")
    if block_table.dim() != 2 or (batch >= 0 and block_table.shape[0] != batch) or block_table.shape[1] == 0:
        raise MlaInputError(f"block_table: shape {tuple(block_table.shape)}, expected ({batch}, W >= 1)")
    if not block_table.is_contiguous():
        raise MlaInputError("block_table: must be contiguous (call .contiguous())")
    keys = _KeyRows(block_table, paged=True)
    return _verify(q_lat, q_pe, c_kv, k_pe, context, tree_sizes, q_offsets, keys, visibility, scale,
                   max_tree, max_kv, out_dtype, kernel, invariant, out)


@dataclass(frozen=True)
class _KeyRows:
    """Where request b's key slots are (module docstring): `table` is kv_offsets [B]
    (contiguous) or a block table [B, W] (paged: the pools' page size is c_kv.shape[1])."""

    table: torch.Tensor
    paged: bool

    def check_capacity(self, max_kv: int, page_size: int) -> None:
        """The table's rows can hold max_kv keys (host values only)."""
        if self.paged and math.ceil(max_kv / page_size) > self.table.shape[1]:
            raise MlaInputError(f"block_table: {self.table.shape[1]} pages per request cannot hold {max_kv} keys "
                                f"in pages of {page_size}")

    def check_values(self, kv_lens: list[int], cache_rows: int, page_size: int) -> None:
        """Every request's key slots 0 .. kv_lens[b] land on rows of the cache (reads the table back)."""
        if not self.paged:
            for b, (k, n) in enumerate(zip(self.table.tolist(), kv_lens)):
                if k < 0 or k + n > cache_rows:
                    raise MlaInputError(f"request {b}: keys {k}..{k + n} are outside c_kv's {cache_rows} rows")
            return
        pages, width = cache_rows // page_size, self.table.shape[1]
        for b, (row, n) in enumerate(zip(self.table.tolist(), kv_lens)):
            need = math.ceil(n / page_size)
            if need > width:
                raise MlaInputError(f"request {b}: {n} keys need {need} pages of {page_size}, "
                                    f"block_table has {width} per request")
            bad = [(j, v) for j, v in enumerate(row[:need]) if not 0 <= v < pages]
            if bad:
                raise MlaInputError(f"request {b}: block_table[{b}, {bad[0][0]}] = {bad[0][1]} is not a page of "
                                    f"the pool's {pages}")


def _batch_of(context: torch.Tensor) -> int:
    return context.shape[0] if isinstance(context, torch.Tensor) and context.dim() == 1 else -1


def _verify(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
            context: torch.Tensor, tree_sizes: torch.Tensor, q_offsets: torch.Tensor, keys: _KeyRows,
            visibility: torch.Tensor, scale: float, max_tree: int | None, max_kv: int | None,
            out_dtype: torch.dtype | None, kernel: str, invariant: bool,
            out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_verify` and `mla_verify_paged`: checks, plan, launch (one code path for both layouts)."""
    if kernel not in KERNELS:
        raise MlaInputError(f"kernel: {kernel!r} is not one of {', '.join(map(repr, KERNELS))}")
    if invariant and kernel not in ("auto", "cuda_cores"):
        raise MlaInputError(f"kernel: the invariant plan runs on the CUDA cores, not {kernel!r}")
    _check_tensors(q_lat, q_pe, c_kv, k_pe, visibility, cache_dims=3 if keys.paged else 2)
    batch = _batch_of(context)
    index = [_index_tensor(name, t, batch + (name == "q_offsets"))
             for name, t in zip(_INDEX_NAMES, (context, tree_sizes, q_offsets))]
    if not math.isfinite(scale) or scale <= 0:
        raise MlaInputError(f"scale: must be a finite positive number, got {scale!r}")
    out_dtype = q_lat.dtype if out_dtype is None else out_dtype
    if out_dtype not in (q_lat.dtype, torch.float32):
        raise MlaInputError(f"out_dtype: must be the inputs' dtype {q_lat.dtype} or float32, got {out_dtype}")
    total_tokens, heads, kv_lora = q_lat.shape
    o_lat, lse = _outputs(out, (total_tokens, heads, kv_lora), out_dtype, q_lat.device)
    page_size = c_kv.shape[1] if keys.paged else 0
    if keys.paged and min(c_kv.shape[:2]) == 0:
        raise MlaInputError(f"c_kv: a pool of {c_kv.shape[0]} pages of {page_size} slots "
                            f"(expected [P >= 1, page_size >= 1, R])")
    cache_rows = c_kv.numel() // kv_lora
    if batch > 0 and total_tokens > 0 and (max_tree is None or max_kv is None):
        max_tree, max_kv, kv_lens = _check_values(*index, total_tokens, visibility.shape[1])
        keys.check_values(kv_lens, cache_rows, page_size)
    if max_kv is not None:
        keys.check_capacity(max_kv, page_size)
    _check_device({"q_lat": q_lat, "q_pe": q_pe, "c_kv": c_kv, "k_pe": k_pe, "visibility": visibility,
                   **dict(zip(_INDEX_NAMES, index)), "block_table" if keys.paged else "kv_offsets": keys.table,
                   "out[0]": o_lat, "out[1]": lse})
    if batch == 0 or total_tokens == 0 or max_tree <= 0:
        return o_lat, lse
    if visibility.shape[1] * 32 < max_tree:
        raise MlaInputError(f"visibility: {visibility.shape[1]} words per row cannot hold a tree of {max_tree}")
    kernel = _pick_kernel(kernel, invariant, q_lat, q_pe, c_kv, k_pe, page_size if keys.paged else None)
    if kernel == "cuda_cores" and (kv_lora > CUDA_CORE_DIMS[0] or q_pe.shape[2] > CUDA_CORE_DIMS[1]):
        raise MlaInputError(f"the CUDA-core path takes kv_lora <= {CUDA_CORE_DIMS[0]} and rope_dim <= "
                            f"{CUDA_CORE_DIMS[1]}, got {kv_lora} and {q_pe.shape[2]}")
    sm_count = torch.cuda.get_device_properties(q_lat.device).multi_processor_count
    plan = plan_splits(batch, max_tree, heads, max_kv, kernel != "cuda_cores", sm_count, invariant)
    torch.ops.kdtree.mla_verify_out(q_lat, q_pe, c_kv, k_pe, *index, None if keys.paged else keys.table, visibility,
                                    float(scale), max_tree, plan.num_splits, plan.split_keys, kernel, o_lat, lse,
                                    keys.table if keys.paged else None)
    return o_lat, lse


def _pick_kernel(kernel: str, invariant: bool, q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                 k_pe: torch.Tensor, page_size: int | None) -> str:
    """The kernel that runs (`KERNELS`, "auto" resolved); MlaInputError naming why when the
    one asked for cannot run these inputs on their device. page_size None: contiguous keys."""
    if invariant or kernel == "cuda_cores":
        return "cuda_cores"
    aligned = all(t.data_ptr() % 16 == 0 for t in (q_lat, q_pe, c_kv, k_pe))   # cp.async and TMA read 16 bytes
    dims = (q_lat.dtype, q_lat.shape[2], q_pe.shape[2])
    if kernel == "auto":
        return verify_kernel(*dims, q_lat.device, page_size) if aligned else "cuda_cores"
    here = tensor_core_kernel(q_lat.device)
    if dims != (torch.bfloat16, 512, 64):
        problem = f"takes bfloat16 inputs at kv_lora 512, rope 64, not {dims[0]} at {dims[1]}, {dims[2]}"
    elif not aligned:
        problem = "needs q_lat, q_pe, c_kv and k_pe 16-byte aligned"
    elif here is None:
        problem = f"needs compute capability 8.0 or later, {q_lat.device} has {torch.cuda.get_device_capability(q_lat.device)}"
    elif kernel in HOPPER_KERNELS and here != "wgmma":
        problem = "runs on compute capability 9.0 with a library built with sm_90a (kernels_cuda.build)"
    elif kernel in HOPPER_KERNELS and page_size is not None and not paged_tensor_cores(page_size):
        problem = f"does not read pages of {page_size} slots"
    else:
        return kernel
    raise MlaInputError(f"kernel {kernel!r} {problem}")


def _check_tensors(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   visibility: torch.Tensor, cache_dims: int) -> None:
    """Types, dims, shapes, dtypes, contiguity; c_kv / k_pe have cache_dims dims ([S, .] or [P, page, .])."""
    named = {"q_lat": q_lat, "q_pe": q_pe, "c_kv": c_kv, "k_pe": k_pe, "visibility": visibility}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise MlaInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, dims in (("q_lat", 3), ("q_pe", 3), ("c_kv", cache_dims), ("k_pe", cache_dims), ("visibility", 2)):
        if named[name].dim() != dims:
            raise MlaInputError(f"{name}: expected {dims} dims, got shape {tuple(named[name].shape)}")
    total_tokens, heads, kv_lora = q_lat.shape
    rope_dim = q_pe.shape[2]
    slots = tuple(c_kv.shape[:-1])
    expected = {"q_pe": (total_tokens, heads, rope_dim), "c_kv": (*slots, kv_lora), "k_pe": (*slots, rope_dim)}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise MlaInputError(f"{name}: shape {tuple(named[name].shape)} does not fit q_lat "
                                f"{tuple(q_lat.shape)} (expected {shape})")
    if min(heads, kv_lora, rope_dim) == 0:
        raise MlaInputError(f"q_lat / q_pe: heads, kv_lora and rope dims must be positive, got "
                            f"{(heads, kv_lora, rope_dim)}")
    if visibility.shape[0] != total_tokens or visibility.shape[1] == 0:
        raise MlaInputError(f"visibility: shape {tuple(visibility.shape)}, expected ({total_tokens}, W >= 1)")
    if q_lat.dtype not in _DTYPE_CODES:
        raise MlaInputError(f"q_lat: dtype {q_lat.dtype} is not float32 or bfloat16")
    for name in ("q_pe", "c_kv", "k_pe"):
        if named[name].dtype != q_lat.dtype:
            raise MlaInputError(f"{name}: dtype {named[name].dtype} differs from q_lat's {q_lat.dtype}")
    if visibility.dtype not in (torch.int32, torch.uint32):
        raise MlaInputError(f"visibility: dtype {visibility.dtype}, expected int32 or uint32 words")
    for name, t in named.items():
        if not t.is_contiguous():
            raise MlaInputError(f"{name}: must be contiguous (call .contiguous())")


def _index_tensor(name: str, t: torch.Tensor, length: int) -> torch.Tensor:
    """A [length] index array as int32 (int64 is narrowed)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or (length >= 0 and t.shape[0] != length):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise MlaInputError(f"{name}: expected a 1-D tensor of length {length} (batch"
                            f"{' + 1' if name == 'q_offsets' else ''}), got {shape}")
    if t.dtype not in (torch.int32, torch.int64):
        raise MlaInputError(f"{name}: dtype {t.dtype}, expected int32 or int64")
    return t.to(torch.int32).contiguous()


def _outputs(out: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, int, int],
             dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return (torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape[:2], dtype=torch.float32, device=device))
    o_lat, lse = out
    if tuple(o_lat.shape) != shape or o_lat.dtype != dtype or not o_lat.is_contiguous():
        raise MlaInputError(f"out[0]: expected a contiguous {dtype} tensor of shape {shape}, got "
                            f"{o_lat.dtype} {tuple(o_lat.shape)}")
    if tuple(lse.shape) != shape[:2] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise MlaInputError(f"out[1]: expected a contiguous float32 tensor of shape {shape[:2]}, got "
                            f"{lse.dtype} {tuple(lse.shape)}")
    return o_lat, lse


def _check_device(named: dict[str, torch.Tensor]) -> None:
    """Every tensor on q_lat's device, a CUDA one."""
    device = named["q_lat"].device
    if device.type != "cuda":
        raise MlaInputError(f"inputs must be CUDA tensors, got {device}")
    for name, t in named.items():
        if t.device != device:
            raise MlaInputError(f"{name}: on {t.device}, q_lat on {device} (all tensors on one device)")


def _check_values(context: torch.Tensor, tree_sizes: torch.Tensor, q_offsets: torch.Tensor,
                  total_tokens: int, vis_words: int) -> tuple[int, int, list[int]]:
    """Read the index arrays back once; check them -> (max_tree, max_kv, each request's keys)."""
    ctx, tree, q_off = (t.tolist() for t in (context, tree_sizes, q_offsets))
    for b, (c, n) in enumerate(zip(ctx, tree)):
        if c < 0 or n < 0:
            raise MlaInputError(f"request {b}: negative context {c} or tree size {n}")
        if q_off[b] < 0 or q_off[b] + n > total_tokens:
            raise MlaInputError(f"request {b}: query rows {q_off[b]}..{q_off[b] + n} are outside q_lat's "
                                f"{total_tokens} tokens")
        if n > 32 * vis_words:
            raise MlaInputError(f"request {b}: tree of {n} tokens needs more than {vis_words} visibility words")
    kv_lens = [c + n for c, n in zip(ctx, tree)]
    return max(tree, default=0), max(kv_lens, default=0), kv_lens
