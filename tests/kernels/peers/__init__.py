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
"""

from __future__ import annotations

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
