"""The peers' kernels that tests/kernels/test_bench_mla.py times beside ours.

SGLang's Triton attention kernels, as an engine author would otherwise run them for DDTree:
`extend_attention_fwd` with a custom mask (tree verify; what SGLang's tree speculative
decoding uses) and `decode_attention_fwd` (MLA decode, one token), with SGLang's own split
policy `get_num_kv_splits_triton`. Their source is not in this repository:
`scripts/fetch_peers.sh` extracts four files of the pinned sglang wheel (checksummed) into
the ignored folder `.peers/`. The two modules of sglang they import and we do not carry are
our own stand-ins beside this file (`sglang_srt_utils`, `sglang_srt_environ`); `load_sglang()`
registers them, and package modules over `.peers/`, under sglang's names, so the wheel's
`sglang/__init__.py` (which imports all of SGLang) never runs.

FlashMLA's sm_90a dense MLA decode kernel (deepseek-ai/FlashMLA, as SGLang packages it in the
sgl-flash-mla wheel): `scripts/fetch_peers.sh` extracts the compiled extension
`.peers/flash_mla/_C_legacy.abi3.so` (checksummed); `load_flashmla()` loads it into torch, which
registers `torch.ops.flash_mla_legacy` (its Python wrapper is not carried: the op is called as is).

FlashInfer's paged MLA kernels (flashinfer-ai/flashinfer's `BatchMLAPagedAttention`: its Hopper
kernel, the "fa3" backend, and the "fa2" one): neither FlashInfer's Python package nor its JIT is
carried; `scripts/build_flashinfer_mla.sh` compiles our C wrapper `scripts/peers/flashinfer_mla.cu`
against the pinned FlashInfer headers into `.peers/flashinfer_mla/libflashinfer_mla.so`, and
`load_flashinfer()` calls it with ctypes on torch tensors' pointers.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from . import sglang_srt_environ, sglang_srt_utils

PEERS = Path(__file__).resolve().parents[3] / ".peers"
ATTENTION = PEERS / "sglang" / "kernels" / "ops" / "attention"
FLASHMLA_LIB = PEERS / "flash_mla" / "_C_legacy.abi3.so"
FLASHINFER_LIB = PEERS / "flashinfer_mla" / "libflashinfer_mla.so"
FLASHINFER_FLOAT_WS = 128 << 20     # the split schedule's partial outputs (FlashInfer's documented size)
FLASHINFER_INT_WS = 8 << 20         # the plan's index arrays (the size FlashInfer's wrapper takes)
LATENT = 512                        # q and the keys: latent (512) then rotary (64), bf16


class PeerUnavailable(RuntimeError):
    """The peer kernels cannot be loaded here (not fetched, or no triton); the message says which."""


def _package(name: str, path: Path | None) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path else []
    sys.modules[name] = module


def load_sglang() -> SimpleNamespace:
    """-> namespace(extend_attention_fwd, decode_attention_fwd, get_num_kv_splits_triton, version)."""
    if not (ATTENTION / "extend_attention.py").is_file():
        raise PeerUnavailable(f"SGLang's kernels are not in {PEERS} (run scripts/fetch_peers.sh)")
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise PeerUnavailable(f"SGLang's kernels need triton: {exc}") from exc
    if "sglang.kernels.ops.attention" not in sys.modules:
        _package("sglang", PEERS / "sglang")
        _package("sglang.kernels", PEERS / "sglang" / "kernels")
        _package("sglang.kernels.ops", PEERS / "sglang" / "kernels" / "ops")
        _package("sglang.kernels.ops.attention", ATTENTION)
        _package("sglang.srt", None)
        sys.modules["sglang.srt.utils"] = sglang_srt_utils
        sys.modules["sglang.srt.environ"] = sglang_srt_environ
    extend = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
    decode = importlib.import_module("sglang.kernels.ops.attention.decode_attention")
    metadata = importlib.import_module("sglang.kernels.ops.attention.metadata")
    return SimpleNamespace(extend_attention_fwd=extend.extend_attention_fwd,
                           decode_attention_fwd=decode.decode_attention_fwd,
                           get_num_kv_splits_triton=metadata.get_num_kv_splits_triton,
                           version=(PEERS / "VERSION").read_text().strip())


def load_flashmla() -> SimpleNamespace:
    """-> namespace(dense_decode_fwd, version): FlashMLA's dense decode op,
    dense_decode_fwd(q [B, s_q, H, 576], kcache [pages, page, 1, 576], head_size_v, seqlens_k [B],
    block_table [B, W], softmax_scale, is_causal, tile_scheduler_metadata | None, num_splits | None)
    -> (out [B, s_q, H, 512], lse [B, H, s_q], tile_scheduler_metadata, num_splits).
    Raises PeerUnavailable naming the reason (not fetched, no CUDA torch, or the library does not load)."""
    if not FLASHMLA_LIB.is_file():
        raise PeerUnavailable(f"FlashMLA's library is not at {FLASHMLA_LIB} (run scripts/fetch_peers.sh)")
    if not torch.cuda.is_available():
        raise PeerUnavailable("FlashMLA needs torch with CUDA and a GPU: none visible")
    if not hasattr(torch.ops.flash_mla_legacy, "dense_decode_fwd"):
        try:
            torch.ops.load_library(str(FLASHMLA_LIB))
        except (OSError, RuntimeError) as exc:
            raise PeerUnavailable(f"FlashMLA's library does not load in torch {torch.__version__}: "
                                  f"{str(exc).splitlines()[0][:200]}") from exc
    return SimpleNamespace(dense_decode_fwd=torch.ops.flash_mla_legacy.dense_decode_fwd,
                           version=(FLASHMLA_LIB.parent / "VERSION").read_text().strip())


def flashinfer_library(path: Path) -> ctypes.CDLL:
    """Our wrapper of FlashInfer's MLA (scripts/peers/flashinfer_mla.cu) with its C signatures;
    loading needs no GPU. Raises PeerUnavailable when it is not built or does not load."""
    if not path.is_file():
        raise PeerUnavailable(f"FlashInfer's MLA library is not at {path} (run scripts/build_flashinfer_mla.sh)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise PeerUnavailable(f"FlashInfer's MLA library does not load: {str(exc)[:200]}") from exc
    p, u32, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    lib.fimla_last_error.restype = ctypes.c_char_p
    lib.fimla_plan.argtypes = [p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p, p, p, u32, u32, i32, p]
    for run in (lib.fimla_run_fa2, lib.fimla_run_fa3):
        run.argtypes = [p, p, p, p, p, u32, u32, p, p, u32, u32, p, p, u32, u32, p, i32, u32, u32, ctypes.c_float, p]
    return lib


def load_flashinfer(backend: str | None = None) -> SimpleNamespace:
    """-> namespace(plan, run, backend, version): FlashInfer's paged MLA attention, bf16, latent 512, rotary 64.
    plan(qo_indptr, kv_indptr, kv_len, num_heads, causal) -> a plan: the split schedule for requests
    of qo_indptr[b + 1] - qo_indptr[b] queries over kv_len[b] keys in the pages kv_indptr[b] ..
    kv_indptr[b + 1] - 1 of kv_indices (host lists), made once per shape on the current stream.
    run(plan, q [n, H, 576], kcache [pages, page, 576], kv_indices int32, scale) -> out [n, H, 512].
    causal: query i of a request sees keys 0 .. kv_len - qo_len + i (FlashInfer's right-aligned mask).
    backend: the one FlashInfer's wrapper picks, "fa3" (its Hopper kernel) on compute capability 9.0,
    else "fa2", unless named ("fa2" runs on SM80 and later, "fa3" on SM90 only). Raises PeerUnavailable
    naming the reason (not built, does not load, no GPU)."""
    lib = flashinfer_library(FLASHINFER_LIB)
    if not torch.cuda.is_available():
        raise PeerUnavailable("FlashInfer's MLA needs torch with CUDA and a GPU: none visible")
    if backend not in (None, "fa2", "fa3"):
        raise ValueError(f"FlashInfer's MLA backends are fa2 and fa3, not {backend!r}")
    backend = backend or ("fa3" if torch.cuda.get_device_capability() == (9, 0) else "fa2")
    launch = getattr(lib, f"fimla_run_{backend}")

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"FlashInfer {what} ({backend}): {lib.fimla_last_error().decode()} (status {status})")

    def plan(qo_indptr: list[int], kv_indptr: list[int], kv_len: list[int], num_heads: int,
             causal: bool) -> SimpleNamespace:
        def i32(values):
            return (ctypes.c_int32 * len(values))(*values)
        made = SimpleNamespace(info=(ctypes.c_int64 * 18)(), causal=causal,
                               float_ws=torch.empty(FLASHINFER_FLOAT_WS, dtype=torch.uint8, device="cuda"),
                               int_ws=torch.empty(FLASHINFER_INT_WS, dtype=torch.uint8, device="cuda"),
                               int_host=torch.empty(FLASHINFER_INT_WS, dtype=torch.uint8, pin_memory=True))
        check(lib.fimla_plan(made.info, made.float_ws.data_ptr(), FLASHINFER_FLOAT_WS, made.int_ws.data_ptr(),
                             made.int_host.data_ptr(), FLASHINFER_INT_WS, i32(qo_indptr), i32(kv_indptr),
                             i32(kv_len), len(kv_len), num_heads, causal, torch.cuda.current_stream().cuda_stream),
              "plan")
        return made

    def run(made: SimpleNamespace, q: torch.Tensor, kcache: torch.Tensor, kv_indices: torch.Tensor,
            scale: float) -> torch.Tensor:
        if (q.dtype != torch.bfloat16 or kcache.dtype != torch.bfloat16 or kv_indices.dtype != torch.int32
                or q.stride(2) != 1 or kcache.stride(2) != 1):
            raise ValueError("FlashInfer's MLA is built for bf16 rows of unit stride and int32 indices")
        n, heads, _ = q.shape
        out = torch.empty(n, heads, LATENT, dtype=q.dtype, device=q.device)
        rope = LATENT * q.element_size()                          # bytes to the rotary part of a row
        check(launch(made.info, made.float_ws.data_ptr(), made.int_ws.data_ptr(), q.data_ptr(), q.data_ptr() + rope,
                     q.stride(0), q.stride(1), kcache.data_ptr(), kcache.data_ptr() + rope, kcache.stride(0),
                     kcache.stride(1), kv_indices.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), None,
                     made.causal, heads, kcache.shape[1], scale, torch.cuda.current_stream().cuda_stream), "run")
        return out

    return SimpleNamespace(plan=plan, run=run, backend=backend,
                           version=f"{(FLASHINFER_LIB.parent / 'VERSION').read_text().strip()} ({backend})")


def plan_requests(fi: SimpleNamespace, batch: int, queries: int, pages: int, keys: int, heads: int) -> SimpleNamespace:
    """fi.plan (load_flashinfer's) for `batch` requests alike: request b's `queries` queries over
    `keys` keys in row b of a block table of `pages` pages a row; causal when queries > 1 (a chain)."""
    return fi.plan([b * queries for b in range(batch + 1)], [b * pages for b in range(batch + 1)], [keys] * batch,
                   heads, queries > 1)
