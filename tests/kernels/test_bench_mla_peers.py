"""The tree-verify MLA kernel beside FlashMLA's dense decode kernel and SGLang's extend kernel in
one run (issue 34), on paged keys (pages of 64 slots, shuffled), Kimi K2 dims, bf16.

Two grids, each over contexts 1k / 8k / 32k and batches 1 / 8 / 32 / 128:

- chain (`test_bench_mla_chain`): 1 query token (decode) and causal chains of 2 / 4 / 8 / 16
  tokens (the MTP / chain-verify shape). FlashMLA runs `dense_decode_fwd` with its causal mask
  (query i of s_q sees context + i + 1 keys); kdtree runs `mla_verify_paged` on the same chain
  expressed as a tree (token i's parent is i - 1) over the same pages. Where
  scripts/build_flashinfer_mla.sh has built it, FlashInfer's paged MLA runs too, on the same
  pages, its causal mask over kv_len = context + s_q keys (query i sees kv_len - s_q + i + 1: the
  same).
- tree (`test_bench_mla_tree`): random trees of 16 / 64 / 128 tokens (what FlashMLA cannot run);
  kdtree's default kernel and its mma.sync kernel ("mma", the path of every non-Hopper GPU; where
  the default kernel is mma, as in a library built without sm_90a, it is timed once) beside
  SGLang's `extend_attention_fwd` with the tree as a custom mask, reading the same pages.
  KDTREE_BENCH_PEERS=0 leaves SGLang out (e.g. to time the no-sm_90a build's kernel alone).

On Hopper every case also times both wgmma kernels forced (`wgmma_ms`: one warpgroup scores
every key tile, auto's choice; `wgmma_pairs_ms`: the seesaw, run only when named), so that the
choice reads against both in the same run.

Every time is the median CUDA-event time of CUDA-graph replays (tests/kernels/gpu_bench.py).
Each peer's output is compared with kdtree's in the same run (relative Frobenius error of the
bf16 outputs, `test_bench_mla.PEER_TOLERANCE`): a peer that computes something else is void, its
time not reported. Ratios are peer time / kdtree time (above 1: kdtree is faster). The rows go to
$KDTREE_BENCH_OUT (JSON) after every case; `python3 -m peers.report FILE` writes the tables and
judges the issue's targets. The default run times one small case of each grid; KDTREE_BENCH=1
the full grids. GPU and peers only: without a GPU, or without the fetched peer
(scripts/fetch_peers.sh), each test skips with the reason.
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch

from kdtr_format import PRESETS
from kernels_cuda.mla_ops import HOPPER_KERNELS, mla_verify_paged, pack_visibility, tensor_core_kernel, verify_kernel
from bench_record import record
from gpu_bench import graph_time_ms
from peers import PeerUnavailable, load_flashinfer, load_flashmla, plan_requests
from test_bench_mla import PEERS, ceilings, load_peers, sglang_extend, time_peer  # noqa: F401 (ceilings: a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")

K2 = PRESETS["kimi-k2"]
HEADS, KV_LORA, ROPE = K2.num_attention_heads, K2.kv_lora_rank, K2.qk_rope_head_dim
PAGE = 64
FULL = os.environ.get("KDTREE_BENCH") == "1"
CONTEXTS, BATCHES = (1024, 8192, 32768), (8, 32, 1, 128)      # batch 128 last: a run cut short has the rest
CHAIN_GRID = ([(c, n, b) for b in BATCHES for c in CONTEXTS for n in (1, 2, 4, 8, 16)] if FULL
              else [(1024, 2, 2)])
TREE_GRID = [(c, n, b) for b in BATCHES for c in CONTEXTS for n in (16, 64, 128)] if FULL else [(1024, 16, 2)]
SGLANG_FLOP_CAP = 1e14        # SGLang's extend kernel only where a call takes about 2 s or less
ROWS: dict[str, list[dict]] = {"chain": [], "tree": []}


@functools.cache
def flashmla():
    """FlashMLA's op namespace, or why it is unavailable (a string)."""
    try:
        return load_flashmla()
    except PeerUnavailable as exc:
        return str(exc)


@functools.cache
def flashinfer():
    """FlashInfer's MLA namespace, or why it is unavailable (a string); KDTREE_BENCH_FLASHINFER=0
    leaves it out (scripts/gpu_peers_mla.sh, when its check against the reference failed)."""
    if os.environ.get("KDTREE_BENCH_FLASHINFER") == "0":
        return "left out: KDTREE_BENCH_FLASHINFER=0 (its check against a float32 reference failed)"
    try:
        return load_flashinfer()
    except PeerUnavailable as exc:
        return str(exc)


def chain_visibility(batch: int, tokens: int, device: str) -> torch.Tensor:
    """bool [batch, tokens, tokens]: a causal chain, token i sees tokens 0 .. i."""
    return torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril().repeat(batch, 1, 1)


def tree_visibility(batch: int, tokens: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """bool [batch, tokens, tokens]: random trees (parent(i) uniform in [0, i)), token i sees its ancestors and itself."""
    parents = (torch.rand(batch, tokens, generator=gen, device=device) * torch.arange(tokens, device=device)).long()
    vis = torch.eye(tokens, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    for i in range(1, tokens):
        vis[:, i] |= vis[torch.arange(batch, device=device), parents[:, i]]
    return vis


def make_case(context: int, tokens: int, batch: int, chain: bool, seed: int) -> dict:
    """Random K2 inputs in shuffled pages of PAGE slots, in both layouts: FlashMLA's kcache
    [P, PAGE, 1, 576] (latent then rotary) and kdtree's pools c_kv [P, PAGE, 512], k_pe [P, PAGE, 64]
    (the same values); q [batch, tokens, H, 576]; block_table int32 [batch, W]; visibility
    bool [batch, tokens, tokens]. Request b's slots: its context, then its tokens."""
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-(context + tokens) // PAGE)
    kcache = torch.randn(batch * width, PAGE, 1, KV_LORA + ROPE, generator=gen, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, tokens, HEADS, KV_LORA + ROPE, generator=gen, device=device, dtype=torch.bfloat16)
    order = torch.randperm(batch * width, generator=gen, device=device)
    vis = chain_visibility(batch, tokens, device) if chain else tree_visibility(batch, tokens, gen, device)
    return dict(kcache=kcache, c_kv=kcache[:, :, 0, :KV_LORA].contiguous(), k_pe=kcache[:, :, 0, KV_LORA:].contiguous(),
                q=q, block_table=order.view(batch, width).to(torch.int32), vis=vis, scale=1.0 / math.sqrt(192))


def kdtree_call(x: dict, context: int, tokens: int, batch: int, kernel: str = "auto"):
    """-> a call of mla_verify_paged on x, returning o_lat [batch * tokens, H, 512]."""
    i32 = dict(dtype=torch.int32, device="cuda")
    q = x["q"].view(batch * tokens, HEADS, -1)
    args = dict(q_lat=q[..., :KV_LORA].contiguous(), q_pe=q[..., KV_LORA:].contiguous(), c_kv=x["c_kv"],
                k_pe=x["k_pe"], block_table=x["block_table"], context=torch.full((batch,), context, **i32),
                tree_sizes=torch.full((batch,), tokens, **i32), q_offsets=torch.arange(batch + 1, **i32) * tokens,
                visibility=pack_visibility(x["vis"]).view(batch * tokens, -1), scale=x["scale"])
    return lambda: mla_verify_paged(**args, max_tree=tokens, max_kv=context + tokens, kernel=kernel)[0]


def hopper_kernels_ms(x: dict, context: int, tokens: int, batch: int) -> dict:
    """On Hopper, each wgmma kernel forced by name ("auto" takes the one-scorer kernel), so that
    the choice reads against both in the same run; elsewhere nothing."""
    if tensor_core_kernel(x["c_kv"].device) != "wgmma":
        return {}
    return {f"{k}_ms": graph_time_ms(kdtree_call(x, context, tokens, batch, k)) for k in HOPPER_KERNELS}


def flashmla_call(fm, x: dict, context: int, tokens: int, batch: int):
    """-> a call of FlashMLA's dense decode on x (causal for chains of 2+ tokens), returning
    out [batch * tokens, H, 512]; its split schedule is computed once here, as an engine does."""
    seqlens = torch.full((batch,), context + tokens, dtype=torch.int32, device="cuda")
    causal = tokens > 1
    _, _, meta, splits = fm.dense_decode_fwd(x["q"], x["kcache"], KV_LORA, seqlens, x["block_table"], x["scale"],
                                             causal, None, None)

    def call() -> torch.Tensor:
        out = fm.dense_decode_fwd(x["q"], x["kcache"], KV_LORA, seqlens, x["block_table"], x["scale"], causal,
                                  meta, splits)[0]
        return out.view(batch * tokens, HEADS, KV_LORA)
    return call


def flashinfer_call(fi, x: dict, context: int, tokens: int, batch: int):
    """-> a call of FlashInfer's paged MLA on x (causal for chains of 2+ tokens, as FlashMLA's), returning
    out [batch * tokens, H, 512]. Request b: tokens queries over context + tokens keys, in its row of
    the block table. Its plan (the split schedule) is made once, at the first call (time_peer's
    eager one, so that a failing plan voids the peer; never inside a graph capture), as an engine does."""
    width = x["block_table"].shape[1]
    plan = functools.cache(lambda: plan_requests(fi, batch, tokens, width, context + tokens, HEADS))
    q = x["q"].view(batch * tokens, HEADS, KV_LORA + ROPE)
    kcache = x["kcache"].view(-1, PAGE, KV_LORA + ROPE)
    return lambda: fi.run(plan(), q, kcache, x["block_table"].view(-1), x["scale"])


def sglang_paged_layout(x: dict, context: int, tokens: int, batch: int) -> dict:
    """x as SGLang's extend kernel takes it (test_bench_mla.sglang_extend), reading FlashMLA's
    pages: kv [P * PAGE, 1, 576], the context slots' rows, the tokens' keys as the extend part,
    the per-request mask [tokens, context + tokens] flattened."""
    device = "cuda"
    kv = x["kcache"].view(-1, 1, KV_LORA + ROPE)
    slots = torch.arange(context + tokens, device=device)
    rows = (x["block_table"].long()[:, slots // PAGE] * PAGE + slots % PAGE)               # [batch, context + tokens]
    mask = torch.cat([torch.ones(batch, tokens, context, dtype=torch.bool, device=device), x["vis"]], dim=2)
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    return dict(kv=kv, q=x["q"].view(batch * tokens, HEADS, -1), prefix_rows=rows[:, :context].reshape(-1),
                k_extend=kv[rows[:, context:].reshape(-1)].contiguous(), mask=mask.reshape(-1),
                qo_indptr=torch.arange(batch + 1, **i32) * tokens, kv_indptr=torch.arange(batch + 1, **i32) * context,
                mask_indptr=torch.arange(batch + 1, **i64) * tokens * (context + tokens))


def figures(context: int, tokens: int, batch: int, vis: torch.Tensor, ms: float, ceilings: dict) -> dict:
    """Work and bytes of one case (kernels_cuda/NOTES-mla.md, "The two numbers") and kdtree's
    rate against the ceilings measured in this run."""
    visible = batch * context * tokens + int(vis.sum())
    flops = visible * HEADS * (2 * (KV_LORA + ROPE) + 2 * KV_LORA)
    io_bytes = (batch * (context + tokens) * (KV_LORA + ROPE) * 2 + batch * tokens * HEADS * (KV_LORA + ROPE) * 2
                + batch * tokens * HEADS * (KV_LORA * 2 + 4))
    return dict(flops=flops, io_bytes=io_bytes, TFLOPs=flops / ms / 1e9, TBps=io_bytes / ms / 1e9,
                mma_fraction=flops / ms / 1e9 / ceilings["bf16_TFLOPs"],
                bw_fraction=io_bytes / ms / 1e9 / ceilings["copy_TBps"])


def dump(ceilings: dict) -> None:
    out = os.environ.get("KDTREE_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"ceilings": ceilings, "page_size": PAGE, **ROWS}, f, indent=1)


@pytest.mark.parametrize("context,tokens,batch", CHAIN_GRID, ids=[f"ctx{c}-chain{n}-b{b}" for c, n, b in CHAIN_GRID])
def test_bench_mla_chain(benchmark, ceilings, context, tokens, batch):
    fm = flashmla()
    if isinstance(fm, str):
        pytest.skip(fm)
    x = make_case(context, tokens, batch, chain=True, seed=context + 7 * tokens + 31 * batch)
    ours = kdtree_call(x, context, tokens, batch)
    ms = benchmark.pedantic(lambda: graph_time_ms(ours), rounds=1, iterations=1)
    assert isinstance(ms, float), ms
    row = dict(context=context, tokens=tokens, batch=batch, kernel=verify_kernel(torch.bfloat16, KV_LORA, ROPE,
               x["c_kv"].device, PAGE), kernel_ms=ms, **figures(context, tokens, batch, x["vis"], ms, ceilings),
               flashmla=fm.version, **hopper_kernels_ms(x, context, tokens, batch))
    row.update(time_peer("flashmla", flashmla_call(fm, x, context, tokens, batch), ours(), ms))
    if "flashmla_ms" in row:
        row["flashmla_bw_fraction"] = row["io_bytes"] / row["flashmla_ms"] / 1e9 / ceilings["copy_TBps"]
    fi = flashinfer()
    if not isinstance(fi, str):
        row["flashinfer"] = fi.version
        row.update(time_peer("flashinfer", flashinfer_call(fi, x, context, tokens, batch), ours(), ms))
    record(benchmark, row, "cuda")
    ROWS["chain"].append(row)
    dump(ceilings)
    assert "flashmla_ms" in row, row.get("flashmla_void")


@pytest.mark.parametrize("context,tokens,batch", TREE_GRID, ids=[f"ctx{c}-tree{n}-b{b}" for c, n, b in TREE_GRID])
def test_bench_mla_tree(benchmark, ceilings, context, tokens, batch):
    sgl = load_peers() if PEERS else "left out (KDTREE_BENCH_PEERS=0)"
    x = make_case(context, tokens, batch, chain=False, seed=context + 7 * tokens + 31 * batch)
    ours = kdtree_call(x, context, tokens, batch)
    ms = benchmark.pedantic(lambda: graph_time_ms(ours), rounds=1, iterations=1)
    assert isinstance(ms, float), ms
    row = dict(context=context, tokens=tokens, batch=batch, kernel=verify_kernel(torch.bfloat16, KV_LORA, ROPE,
               x["c_kv"].device, PAGE), kernel_ms=ms, **figures(context, tokens, batch, x["vis"], ms, ceilings),
               **hopper_kernels_ms(x, context, tokens, batch))
    row["mma_ms"] = ms if row["kernel"] == "mma" else graph_time_ms(kdtree_call(x, context, tokens, batch, "mma"))
    if isinstance(row["mma_ms"], float):
        row["mma_fraction_mma"] = row["flops"] / row["mma_ms"] / 1e9 / ceilings["bf16_TFLOPs"]
    if isinstance(sgl, str):
        row["sglang_extend_void"] = sgl
    elif row["flops"] > SGLANG_FLOP_CAP:
        row["sglang_extend_void"] = f"not timed: {row['flops']:.1e} flop > {SGLANG_FLOP_CAP:.0e} (too slow for the run)"
    else:
        row["sglang"] = sgl.version
        y = sglang_paged_layout(x, context, tokens, batch)
        row.update(time_peer("sglang_extend", sglang_extend(sgl, y, tokens, x["scale"]), ours(), ms))
    record(benchmark, row, "cuda")
    ROWS["tree"].append(row)
    dump(ceilings)
    assert isinstance(row["mma_ms"], float), row["mma_ms"]
