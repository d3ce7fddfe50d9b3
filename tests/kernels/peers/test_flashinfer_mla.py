"""FlashInfer's MLA through our wrapper (scripts/peers/flashinfer_mla.cu): the loader says why it
cannot load; where scripts/build_flashinfer_mla.sh has built the library, it loads without a GPU
and its planner answers with the CUDA error; on a GPU, FlashInfer's output is attention over the
same paged keys as a float32 reference, its causal mask the chain's (query i of s_q sees
context + i + 1 keys, as FlashMLA's)."""

from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch

import peers
from peers import PeerUnavailable, flashinfer_library, load_flashinfer, plan_requests

built = pytest.mark.skipif(not peers.FLASHINFER_LIB.is_file(),
                           reason=f"FlashInfer's MLA library is not at {peers.FLASHINFER_LIB} "
                                  "(run scripts/build_flashinfer_mla.sh)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")
PAGE, HEADS, LATENT, ROPE = 64, 64, 512, 64
SCALE = 1.0 / math.sqrt(192)


def test_loader_names_what_is_missing(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(peers, "FLASHINFER_LIB", tmp_path / "libflashinfer_mla.so")
    with pytest.raises(PeerUnavailable, match="run scripts/build_flashinfer_mla.sh"):
        load_flashinfer()
    (tmp_path / "libflashinfer_mla.so").write_bytes(b"not a library")
    with pytest.raises(PeerUnavailable, match="does not load"):
        load_flashinfer()


@built
def test_the_library_loads_without_a_gpu_and_the_planner_reports_the_cuda_error() -> None:
    lib = flashinfer_library(peers.FLASHINFER_LIB)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the planner would run (test_matches_the_reference checks it)")
    with pytest.raises(PeerUnavailable, match="needs torch with CUDA and a GPU"):
        load_flashinfer()
    plan = (ctypes.c_int64 * 18)()
    indptr, kv_len = (ctypes.c_int32 * 2)(0, 1), (ctypes.c_int32 * 1)(65)
    status = lib.fimla_plan(plan, None, 0, None, None, 0, indptr, indptr, kv_len, 1, HEADS, 0, None)
    assert status > 0 and lib.fimla_last_error().decode().startswith("MLAPlan: ")    # a cudaError_t, named


def c_parameters(signature: str) -> list[type]:
    """The ctypes of a C parameter list of scripts/peers/flashinfer_mla.cu (pointers and streams as void*)."""
    scalars = {"size_t": ctypes.c_size_t, "uint32_t": ctypes.c_uint32, "int": ctypes.c_int, "float": ctypes.c_float}
    kinds = []
    for parameter in signature.replace("\\", " ").split(","):
        words = parameter.replace("*", " * ").split()
        pointer = "*" in words or words[-2] == "cudaStream_t"
        kinds.append(ctypes.c_void_p if pointer else scalars[words[-2]])
    return kinds


@built
def test_the_loaders_argtypes_are_the_wrappers_c_signatures() -> None:
    """A width mismatch (a uint32 passed where the C side reads a size_t, a pointer truncated) does not
    fail on the CPU machine; the argtypes are checked here against the wrapper's source instead."""
    source = (peers.PEERS.parent / "scripts" / "peers" / "flashinfer_mla.cu").read_text()
    plan = re.search(r'extern "C" int fimla_plan\((.*?)\) \{', source, re.S).group(1)
    run = re.search(r"#define FIMLA_RUN_ARGS(.*?)\n#define", source, re.S).group(1)
    lib = flashinfer_library(peers.FLASHINFER_LIB)
    assert lib.fimla_plan.argtypes == c_parameters(plan)
    assert lib.fimla_run_fa2.argtypes == lib.fimla_run_fa3.argtypes == c_parameters(run)


def planned_case(fi, context: int, tokens: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """Random bf16 q [B, T, H, 576] and kcache [B W, PAGE, 576], a shuffled block table [B, W]
    (int32), and FlashInfer's plan for B requests of T queries over context + T keys each."""
    gen = torch.Generator(device="cuda").manual_seed(context + tokens)
    width = -(-(context + tokens) // PAGE)
    kcache = torch.randn(batch * width, PAGE, LATENT + ROPE, generator=gen, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, tokens, HEADS, LATENT + ROPE, generator=gen, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(batch * width, generator=gen, device="cuda").view(batch, width).to(torch.int32)
    plan = plan_requests(fi, batch, tokens, width, context + tokens, HEADS)
    return q, kcache, block_table, plan


def reference(q: torch.Tensor, kcache: torch.Tensor, block_table: torch.Tensor, context: int,
              scale: float) -> torch.Tensor:
    """float32 attention of q [B, T, H, 576] over each request's context + T keys of kcache
    [pages, PAGE, 576] (block_table [B, W]), query i seeing keys 0 .. context + i -> [B, T, H, 512]."""
    tokens = q.shape[1]
    slots = torch.arange(context + tokens, device=q.device)
    keys = kcache[block_table.long()[:, slots // PAGE], slots % PAGE].float()            # [B, L, 576]
    scores = torch.einsum("bthd,bld->bthl", q.float(), keys) * scale
    visible = slots[None, :] <= context + torch.arange(tokens, device=q.device)[:, None]  # [T, L]
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    return torch.einsum("bthl,bld->bthd", scores.softmax(-1), keys[..., :LATENT])


@built
@gpu
@pytest.mark.parametrize("context,tokens,batch", [(1000, 1, 3), (1000, 4, 3), (4097, 16, 2)])
def test_matches_the_reference(context: int, tokens: int, batch: int) -> None:
    """Decode (no mask) and causal chains, contexts that end inside a page, shuffled pages; on an
    H100's 132 SMs the planner splits each request's keys over several CTAs, so the merge runs too."""
    fi = load_flashinfer()
    q, kcache, block_table, plan = planned_case(fi, context, tokens, batch)
    out = fi.run(plan, q.view(batch * tokens, HEADS, -1), kcache, block_table.view(-1), SCALE)
    want = reference(q, kcache, block_table, context, SCALE).view(batch * tokens, HEADS, LATENT)
    error = ((out.float() - want).norm() / want.norm()).item()
    assert error < 1e-2, f"{fi.version}: relative error {error:.2e}"
