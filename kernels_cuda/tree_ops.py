"""DDTree's tree stages as torch custom ops (`torch.ops.kdtree.*`) over the CUDA kernels.

Every op checks device, dtype, shape and contiguity first and raises ValueError naming
the problem (on any device: the checks need no GPU); then it launches on torch's current
stream, so the ops work inside CUDA graphs. Nothing falls back to another backend.

Batch layout (engine/stages.py): request b's tree fills columns 0 .. n[b] of [B, width]
tensors; column 0 is the root; padding columns hold -1 (scores -inf) and their
visibility row sees itself only. Launch limits: L <= 32, width <= 4096, K <= 4096 for
top-k; the build's shared memory (about 4 L K + 24 width bytes) must fit the device.
"""

from __future__ import annotations

import functools
import math
import os
from ctypes import c_double, c_int, c_size_t, c_void_p

import torch

from . import _lib

# Which kernel version serves by default: a new version serves only after a GPU run proves it
# (tests and benchmarks select versions explicitly). Top-k v4 and the sampling kernel were proven
# on an H200 on 2026-12-01 (docs/results/kernels-v3-h200.md): bit-exact with v3 / the torch sampler.
SAMPLE_KERNEL = os.environ.get("KDTREE_SAMPLE_KERNEL", "1") == "1"   # CudaStages.sample_choices
TOPK_VERSION = int(os.environ.get("KDTREE_TOPK_VERSION", "4"))      # topk_logprobs(version=0)

_LOGIT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SAMPLE_DTYPES = {**_LOGIT_DTYPES, torch.float64: 3}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], ndim: int | None,
           device: torch.device | None = None) -> None:
    """t has one of `dtypes`, `ndim` dims, is contiguous, on CUDA and on `device` (when given), checked in
    that order (so the dtype, shape and layout errors show on CPU tensors too)."""
    _require(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype in dtypes, f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    _require(ndim is None or t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {list(t.shape)}")
    _require(t.is_contiguous(), f"{name}: must be contiguous (call .contiguous())")
    _require(t.device.type == "cuda", f"{name}: expected a CUDA tensor, got one on {t.device}")
    _require(device is None or t.device == device, f"{name}: on {t.device}, the other inputs on {device}")


def _check_vector(t: torch.Tensor, name: str, batch: int, device: torch.device) -> None:
    _check(t, name, (torch.int64,), 1, device)
    _require(t.shape[0] == batch, f"{name}: expected shape [{batch}], got {list(t.shape)}")


def _launch(name: str, argtypes: tuple, device: torch.device, *args) -> None:
    with torch.cuda.device(device):
        fn = _lib.function(name, argtypes + (c_void_p,))
        _lib.check(fn(*args, _lib.stream(device)), name)


def _p(t: torch.Tensor | None) -> c_void_p:
    return c_void_p(t.data_ptr() if t is not None else None)


# --- top-k log-probs --------------------------------------------------------------------------

@functools.cache
def _topk_workspace_bytes():
    """kdtree_topk_workspace_bytes(dtype, rows, V, K, version, logits) -> size_t."""
    try:
        fn = _lib.library().kdtree_topk_workspace_bytes
    except AttributeError as exc:
        raise _lib.KernelError("kernels library has no symbol 'kdtree_topk_workspace_bytes' (stale build?)") from exc
    fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_void_p]
    fn.restype = c_size_t
    return fn


@torch.library.custom_op("kdtree::topk_logprobs", mutates_args=())
def topk_logprobs(logits: torch.Tensor, k: int, version: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] float32|bf16|fp16 -> (topk_lp float32 [..., K], topk_id int64 [..., K]), K = min(k, V).

    lp = logits - logsumexp in float64 (float exp of exact differences, float64 sums), rounded
    once to float32; rows descending, equal lp to the smaller id (contract section 2).
    version: the kernel (3 or 4: the same outputs bit for bit; NOTES-tree.md), 0 for TOPK_VERSION.
    """
    _check(logits, "logits", tuple(_LOGIT_DTYPES), None)
    _require(logits.dim() >= 2, f"logits: expected [..., V], got shape {list(logits.shape)}")
    _require(isinstance(k, int) and k >= 0, f"k: expected an integer >= 0, got {k!r}")
    version = version or TOPK_VERSION
    _require(version in (3, 4), f"version: expected 3 or 4, got {version!r}")
    vocab = logits.shape[-1]
    _require(vocab > 0, "logits: the vocabulary is empty")
    K = min(k, vocab)
    _require(K <= 4096, f"k: at most 4096 supported, got min(k, V) = {K}")
    topk_lp = torch.empty(*logits.shape[:-1], K, dtype=torch.float32, device=logits.device)
    topk_id = torch.empty(*logits.shape[:-1], K, dtype=torch.int64, device=logits.device)
    rows = logits.numel() // vocab
    dtype = _LOGIT_DTYPES[logits.dtype]
    with torch.cuda.device(logits.device):
        size = _topk_workspace_bytes()(dtype, rows, vocab, K, version, _p(logits))
    workspace = torch.empty(size, dtype=torch.uint8, device=logits.device) if size else None
    _launch("kdtree_topk_logprobs", (c_void_p, c_int, c_int, c_int, c_int, c_int, c_void_p, c_void_p, c_void_p),
            logits.device, _p(logits), dtype, rows, vocab, K, version, _p(workspace), _p(topk_lp), _p(topk_id))
    return topk_lp, topk_id


@topk_logprobs.register_fake
def _(logits: torch.Tensor, k: int, version: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    K = min(k, logits.shape[-1])
    shape = (*logits.shape[:-1], K)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


# --- tree build and compile ---------------------------------------------------------------------

def _build_inputs(topk_lp, topk_id, budgets, roots, width) -> tuple[int, int, int]:
    _check(topk_lp, "topk_lp", (torch.float32,), 3)
    device = topk_lp.device
    _check(topk_id, "topk_id", (torch.int64,), 3, device)
    _require(topk_id.shape == topk_lp.shape, f"topk_id: shape {list(topk_id.shape)} != topk_lp {list(topk_lp.shape)}")
    batch, depth, k = topk_lp.shape
    _check_vector(budgets, "budgets", batch, device)
    _check_vector(roots, "roots", batch, device)
    _require(isinstance(width, int) and 1 <= width <= 4096, f"width: expected an integer in [1, 4096], got {width!r}")
    _require(depth <= 32, f"topk_lp: at most 32 depths supported, got L = {depth}")
    return batch, depth, k


_BUILD_ARGTYPES = (c_void_p, c_void_p, c_int, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p, c_void_p,
                   c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p)


def _tree_outputs(batch: int, width: int, device: torch.device) -> list[torch.Tensor]:
    """n [B], parents, tokens, depths int64 [B, width], scores float64 [B, width] (uninitialized)."""
    index = torch.empty(batch, width, dtype=torch.int64, device=device)
    return [torch.empty(batch, dtype=torch.int64, device=device), index, torch.empty_like(index),
            torch.empty_like(index), torch.empty(batch, width, dtype=torch.float64, device=device)]


def _compiled_outputs(batch: int, width: int, device: torch.device) -> list[torch.Tensor]:
    """positions int64 [B, width], visibility_bits int32 [B, width, W], first_child, next_sibling int64."""
    index = torch.empty(batch, width, dtype=torch.int64, device=device)
    bits = torch.empty(batch, width, -(-width // 32), dtype=torch.int32, device=device)
    return [index, bits, torch.empty_like(index), torch.empty_like(index)]


@torch.library.custom_op("kdtree::build_trees", mutates_args=())
def build_trees(topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor, roots: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_lp float32 [B, L, K], topk_id int64 [B, L, K], budgets, roots int64 [B], width
    -> (n [B], parents, tokens, depths int64 [B, width], scores float64 [B, width]).

    The best-first heap of contract section 3 per request, bit-exact with refgen; budgets are
    capped at width - 1 (pass width = 1 + the largest budget to build every tree in full).
    tokens[:, 0] = roots.
    """
    batch, depth, k = _build_inputs(topk_lp, topk_id, budgets, roots, width)
    out = _tree_outputs(batch, width, topk_lp.device)
    _launch("kdtree_build_trees", _BUILD_ARGTYPES, topk_lp.device, _p(topk_lp), _p(topk_id), batch, depth, k,
            _p(budgets), _p(roots), width, *map(_p, out), *(_p(None),) * 5)
    return tuple(out)


@build_trees.register_fake
def _(topk_lp, topk_id, budgets, roots, width):
    batch = topk_lp.shape[0]
    index = topk_lp.new_empty(batch, width, dtype=torch.int64)
    return (topk_lp.new_empty(batch, dtype=torch.int64), index, torch.empty_like(index), torch.empty_like(index),
            topk_lp.new_empty(batch, width, dtype=torch.float64))


@torch.library.custom_op("kdtree::build_compiled_trees", mutates_args=())
def build_compiled_trees(topk_lp: torch.Tensor, topk_id: torch.Tensor, budgets: torch.Tensor,
                         roots: torch.Tensor, starts: torch.Tensor, width: int) -> list[torch.Tensor]:
    """build_trees and compile_trees in one launch -> [n, parents, tokens, depths, scores,
    positions, visibility_bits, first_child, next_sibling]."""
    batch, depth, k = _build_inputs(topk_lp, topk_id, budgets, roots, width)
    _check_vector(starts, "starts", batch, topk_lp.device)
    out = _tree_outputs(batch, width, topk_lp.device)
    compiled = _compiled_outputs(batch, width, topk_lp.device)
    _launch("kdtree_build_trees", _BUILD_ARGTYPES, topk_lp.device, _p(topk_lp), _p(topk_id), batch, depth, k,
            _p(budgets), _p(roots), width, *map(_p, out), _p(starts), *map(_p, compiled))
    return out + compiled


@build_compiled_trees.register_fake
def _(topk_lp, topk_id, budgets, roots, starts, width):
    batch = topk_lp.shape[0]
    index = topk_lp.new_empty(batch, width, dtype=torch.int64)
    return [topk_lp.new_empty(batch, dtype=torch.int64), index, torch.empty_like(index), torch.empty_like(index),
            topk_lp.new_empty(batch, width, dtype=torch.float64), torch.empty_like(index),
            topk_lp.new_empty(batch, width, -(-width // 32), dtype=torch.int32), torch.empty_like(index),
            torch.empty_like(index)]


@torch.library.custom_op("kdtree::compile_trees", mutates_args=())
def compile_trees(parents: torch.Tensor, depths: torch.Tensor, n: torch.Tensor,
                  starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, depths int64 [B, width], n, starts int64 [B]
    -> (positions [B, width], visibility_bits int32 [B, width, W], first_child, next_sibling [B, width]).

    Contract section 4 from parents alone (any tree in pop order: parents[b, i] < i).
    """
    _check(parents, "parents", (torch.int64,), 2)
    device = parents.device
    _check(depths, "depths", (torch.int64,), 2, device)
    _require(depths.shape == parents.shape, f"depths: shape {list(depths.shape)} != parents {list(parents.shape)}")
    batch, width = parents.shape
    _require(1 <= width <= 4096, f"parents: width must lie in [1, 4096], got {width}")
    _check_vector(n, "n", batch, device)
    _check_vector(starts, "starts", batch, device)
    out = _compiled_outputs(batch, width, device)
    _launch("kdtree_compile_trees", (c_void_p,) * 4 + (c_int, c_int) + (c_void_p,) * 4, device,
            _p(parents), _p(depths), _p(n), _p(starts), batch, width, *map(_p, out))
    return tuple(out)


@compile_trees.register_fake
def _(parents, depths, n, starts):
    batch, width = parents.shape
    return (torch.empty_like(parents), parents.new_empty(batch, width, -(-width // 32), dtype=torch.int32),
            torch.empty_like(parents), torch.empty_like(parents))


# --- sampling choices --------------------------------------------------------------------------

@torch.library.custom_op("kdtree::sample_choices", mutates_args=())
def sample_choices(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """logits [..., V] float32|bf16|fp16|float64, uniforms float64 [...] in [0, 1)
    -> choices int64 [...] (contract section 5).

    Inverse CDF in float64 over ids ascending: p = softmax(logits / T); the smallest id with
    p > 0 whose cdf exceeds u, else the largest id with p > 0 (csrc/tree_sample.cu). A row with
    a NaN logit, no finite maximum, or u outside [0, 1) gets -1 (checked on the device, so the
    op never syncs).
    """
    _check(logits, "logits", tuple(_SAMPLE_DTYPES), None)
    device = logits.device
    _require(logits.dim() >= 1, "logits: expected [..., V], got a scalar")
    vocab = logits.shape[-1]
    _require(vocab > 0, "logits: the vocabulary is empty")
    _require(vocab <= 1 << 20, f"logits: at most 1048576 ids supported, got V = {vocab}")
    _require(isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0,
             f"temperature: sampling needs a finite temperature > 0, got {temperature!r}")
    _check(uniforms, "uniforms", (torch.float64,), logits.dim() - 1, device)
    _require(uniforms.shape == logits.shape[:-1],
             f"uniforms: expected shape {list(logits.shape[:-1])}, got {list(uniforms.shape)}")
    choices = torch.empty(logits.shape[:-1], dtype=torch.int64, device=device)
    _launch("kdtree_sample_choices", (c_void_p, c_int, c_int, c_int, c_double, c_void_p, c_void_p), device,
            _p(logits), _SAMPLE_DTYPES[logits.dtype], uniforms.numel(), vocab, float(temperature), _p(uniforms),
            _p(choices))
    return choices


@sample_choices.register_fake
def _(logits, temperature, uniforms):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


# --- accept and compaction ----------------------------------------------------------------------

@torch.library.custom_op("kdtree::accept_greedy", mutates_args=())
def accept_greedy(parents: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor, choices: torch.Tensor,
                  cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, tokens, choices int64 [B, width], n [B], cols
    -> (accepted int64 [B, cols] padded -1, accept_len [B], next_root [B]) (contract section 6)."""
    _check(parents, "parents", (torch.int64,), 2)
    device = parents.device
    for t, name in ((tokens, "tokens"), (choices, "choices")):
        _check(t, name, (torch.int64,), 2, device)
        _require(t.shape == parents.shape, f"{name}: shape {list(t.shape)} != parents {list(parents.shape)}")
    batch, width = parents.shape
    _require(width >= 1, "parents: needs at least the root column")
    _check_vector(n, "n", batch, device)
    _require(isinstance(cols, int) and cols >= 1, f"cols: expected an integer >= 1, got {cols!r}")
    accepted = torch.empty(batch, cols, dtype=torch.int64, device=device)
    accept_len = torch.empty(batch, dtype=torch.int64, device=device)
    next_root = torch.empty_like(accept_len)
    _launch("kdtree_accept_greedy", (c_void_p,) * 4 + (c_int, c_int, c_int) + (c_void_p,) * 3, device,
            _p(parents), _p(tokens), _p(n), _p(choices), batch, width, cols, _p(accepted), _p(accept_len),
            _p(next_root))
    return accepted, accept_len, next_root


@accept_greedy.register_fake
def _(parents, tokens, n, choices, cols):
    batch = parents.shape[0]
    return parents.new_empty(batch, cols), parents.new_empty(batch), parents.new_empty(batch)


@torch.library.custom_op("kdtree::compact_kv", mutates_args=("c_kv", "k_pe"))
def compact_kv(c_kv: torch.Tensor, k_pe: torch.Tensor, starts: torch.Tensor, accepted: torch.Tensor,
               accept_len: torch.Tensor, block_table: torch.Tensor | None = None) -> None:
    """In place, every layer in one launch: slot starts[b] + k <- slot starts[b] + accepted[b, k]
    for k < accept_len[b], as if in increasing k (contract section 7; non-prefix paths too).

    Contiguous (block_table None): c_kv [layers, B, S, kv_lora], k_pe [layers, B, S, d_rope];
    request b's slot s is row s of [layer, b]. Paged: c_kv [layers, P, page_size, kv_lora],
    k_pe [layers, P, page_size, d_rope] and block_table int32 [B, W]; slot s is row
    s % page_size of page block_table[b, s // page_size]. Any one 2+ byte dtype. Entries
    breaking the contract (accepted[b, k] < k, a source past S or past the table's W pages, a
    table entry outside [0, P)) are skipped on the device: the op never syncs (CUDA graphs).
    """
    _check(c_kv, "c_kv", (torch.float32, torch.bfloat16, torch.float16), 4)
    device = c_kv.device
    _check(k_pe, "k_pe", (c_kv.dtype,), 4, device)
    layers, blocks, slots, _ = c_kv.shape       # blocks: requests, or pages when paged
    _require(k_pe.shape[:3] == c_kv.shape[:3], f"k_pe: leading dims {list(k_pe.shape[:3])} != c_kv's {[layers, blocks, slots]}")
    batch = blocks
    if block_table is not None:
        _check(block_table, "block_table", (torch.int32,), 2, device)
        batch = block_table.shape[0]
        _require(block_table.shape[1] >= 1, f"block_table: expected [B, W >= 1], got {list(block_table.shape)}")
        _require(slots >= 1, f"c_kv: pages of {slots} slots (expected [layers, P, page_size >= 1, kv_lora])")
    _check_vector(starts, "starts", batch, device)
    _check_vector(accept_len, "accept_len", batch, device)
    _check(accepted, "accepted", (torch.int64,), 2, device)
    _require(accepted.shape[0] == batch and accepted.shape[1] >= 1,
             f"accepted: expected [{batch}, a_max >= 1], got {list(accepted.shape)}")
    row = c_kv.element_size()
    table_stride = 0 if block_table is None else block_table.shape[1]
    _launch("kdtree_compact_kv", (c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int, c_void_p, c_void_p, c_int,
                                  c_void_p, c_void_p, c_int, c_int), device,
            _p(c_kv), _p(k_pe), layers, batch, slots, c_kv.shape[3] * row, k_pe.shape[3] * row, _p(starts),
            _p(accepted), accepted.shape[1], _p(accept_len), _p(block_table), table_stride, blocks)


@compact_kv.register_fake
def _(c_kv, k_pe, starts, accepted, accept_len, block_table=None):
    return None
