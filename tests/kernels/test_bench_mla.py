"""Speed of the tree-verify MLA kernel at Kimi K2 dims (docs/status.md's targets), bf16 with float32
accumulation, against the two ceilings measured in the same run (device-to-device copy
bandwidth, bf16 matrix rate) and a torch baseline (matmul, mask, softmax in float32), and the peers' kernels at the same inputs.

kernel_ms is the median CUDA-event time of replays of a CUDA graph of one `mla_verify` call
(the kernel and, with several key splits, the combine kernel: the GPU's time, as an engine
that captures its decode step sees it); call_ms times the same call made eagerly from Python
(argument checks and the custom-op dispatch included). Fractions of the ceilings use
kernel_ms. Each case's figures go to `benchmark.extra_info` and, when $KDTREE_BENCH_OUT
names a file, to a JSON list there (docs/results/mla-verify-h200.md is written from it).
The default run times one small case; KDTREE_BENCH=1 runs the grid: context 1k / 8k / 32k x
tree tokens 1 / 16 / 64 / 128 x batch 1 / 8 / 32; KDTREE_BENCH_KERNEL_ONLY=1 leaves out the
torch baseline and the CUDA-core kernel (to compare builds of the kernel quickly).
KDTREE_BENCH_KERNEL names the kernel timed as ours (`mla_ops.KERNELS`; default "auto", the
row's `kernel` says which ran) and KDTREE_BENCH_ALSO a comma-separated list of more kernels
graph-timed at every case (`<kernel>_ms`), e.g. "mma,mma_100k" beside wgmma on Hopper. GPU
only: skipped with a reason elsewhere.

Peers (tests/kernels/peers: SGLang's Triton kernels, fetched by scripts/fetch_peers.sh), at
every case, on the same K2 inputs laid out as SGLang keeps them (one [slots, 1, 576] latent +
rotary buffer, the tree tokens' keys as the extend part, a dense bool mask per request):
`extend_attention_fwd` with the custom mask (tree verify), and at 1 tree token also
`decode_attention_fwd` (MLA decode, SGLang's split policy for an H200 and a 128k model
context). Each is graph-timed like ours and its output compared with ours in the same run:
a peer whose output differs from ours by more than bf16 rounding (relative Frobenius error
above PEER_TOLERANCE) is void, its time not reported. Without the fetched files or triton the
peer columns say why they are empty. KDTREE_BENCH_PEERS=0 leaves the peers out;
KDTREE_BENCH_PEER_BUDGET_MS sets the repeats of each peer timing (default 100 ms).

Paged KV (`test_bench_mla_verify_paged`): the same inputs in shuffled pages of 64, 16 and 1
slots, each case timed side by side with the contiguous keys on the same kernel (the one the paged
call takes: on Hopper wgmma for pages 64 and 16, mma for page 1) in the same run (`ratio` =
paged / contiguous; where that kernel is not the contiguous default, `contiguous_auto_ms` times
the default too), its bits checked equal to the contiguous output. KDTREE_BENCH=1: ctx 8k and 32k x trees 1 / 16 / 64 x batch 8 at pages 64
and 16, ctx 32k / 1 token / batch 1 at both, and page 1 at four cases; the rows go to the same
JSON file under "paged". Default: one small case.

FlashInfer's MLA is not among these peers: tests/kernels/test_bench_mla_peers.py times it on the
decode and causal-chain grid, where scripts/build_flashinfer_mla.sh has built it (its wheel and
dependencies exceed the 64 MiB that travels to the GPU machine; its kernels alone do not).
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch

from kdtr_format import PRESETS
from kernels_cuda.mla_ops import mla_verify, mla_verify_paged, pack_visibility, verify_kernel
from bench_record import record
from gpu_bench import bf16_matmul_TFLOPs, copy_TBps, cuda_time_ms, graph_time_ms, peer_time_ms
from peers import PeerUnavailable, load_sglang

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")

K2 = PRESETS["kimi-k2"]
HEADS, KV_LORA, ROPE = K2.num_attention_heads, K2.kv_lora_rank, K2.qk_rope_head_dim
FULL = os.environ.get("KDTREE_BENCH") == "1"
KERNEL_ONLY = os.environ.get("KDTREE_BENCH_KERNEL_ONLY") == "1"
GRID = ([(c, t, b) for b in (8, 32, 1) for c in (1024, 8192, 32768) for t in (1, 16, 64, 128)] if FULL
        else [(1024, 16, 1)])      # batch 8 first: a run cut short still has every context and tree size
MEMORY_CAP = 40e9             # bytes: skip a case whose inputs and baseline intermediates exceed it
GENERIC_FLOP_CAP = 2e11       # time the CUDA-core path only where it finishes quickly
PEERS = os.environ.get("KDTREE_BENCH_PEERS", "1") == "1"
KERNEL = os.environ.get("KDTREE_BENCH_KERNEL", "auto")
ALSO = [k for k in os.environ.get("KDTREE_BENCH_ALSO", "").split(",") if k]
PEER_TOLERANCE = 1e-2         # relative Frobenius error between two bf16 outputs of float32 math
PEER_BUDGET_MS = float(os.environ.get("KDTREE_BENCH_PEER_BUDGET_MS", "100"))   # repeats of a peer timing
SGLANG_MAX_CONTEXT = 131072   # the model context SGLang sizes its decode splits for (K2: 128k and up)
PAGED_GRID = ([(c, t, 8, page) for page in (64, 16) for c in (8192, 32768) for t in (1, 16, 64)]
              + [(32768, 1, 1, 64), (32768, 1, 1, 16)]
              + [(8192, 1, 8, 1), (32768, 1, 8, 1), (32768, 1, 1, 1), (8192, 16, 8, 1)] if FULL
              else [(1024, 16, 1, 16)])
PAGED_BUDGET_MS = 100.0       # repeats of each paged / contiguous timing
ROWS: list[dict] = []
PAGED_ROWS: list[dict] = []


@pytest.fixture(scope="module")
def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matrix rate, measured now."""
    result = {"gpu": torch.cuda.get_device_name(), "copy_TBps": copy_TBps(),
              "bf16_TFLOPs": bf16_matmul_TFLOPs()}
    return result


def make_inputs(context: int, tree: int, batch: int, seed: int, device: str = "cuda") -> dict:
    """Packed K2 inputs: every request has `context` cached keys and a random tree of `tree` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parents = (torch.rand(batch, tree, generator=gen, device=device)
               * torch.arange(tree, device=device)).long()                   # parents[:, i] in [0, i)
    vis = torch.eye(tree, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    for i in range(1, tree):                                                 # row i = row parent(i) + i
        vis[:, i] |= vis[torch.arange(batch, device=device), parents[:, i]]
    rows = batch * (context + tree)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    i32 = dict(dtype=torch.int32, device=device)
    return dict(q_lat=rand(batch * tree, HEADS, KV_LORA), q_pe=rand(batch * tree, HEADS, ROPE),
                c_kv=rand(rows, KV_LORA), k_pe=rand(rows, ROPE),
                context=torch.full((batch,), context, **i32), tree_sizes=torch.full((batch,), tree, **i32),
                q_offsets=torch.arange(batch + 1, **i32) * tree,
                kv_offsets=torch.arange(batch, **i32) * (context + tree),
                visibility=pack_visibility(vis).view(batch * tree, -1), scale=1.0 / math.sqrt(192),
                dense=vis)


def torch_baseline(x: dict, context: int, tree: int, batch: int) -> None:
    """Per request: float32 scores by matmul, ancestor mask, softmax, matmul."""
    for b in range(batch):
        keys = slice(b * (context + tree), (b + 1) * (context + tree))
        queries = slice(b * tree, (b + 1) * tree)
        c, k = x["c_kv"][keys].float(), x["k_pe"][keys].float()
        scores = (x["q_lat"][queries].float() @ c.T + x["q_pe"][queries].float() @ k.T) * x["scale"]
        hidden = torch.cat([torch.zeros(tree, context, dtype=torch.bool, device=c.device), ~x["dense"][b]], 1)
        probs = torch.softmax(scores.masked_fill(hidden[:, None, :], -math.inf), dim=-1)
        (probs @ c).to(torch.bfloat16)


@pytest.mark.parametrize("context,tree,batch", GRID, ids=[f"ctx{c}-tree{t}-b{b}" for c, t, b in GRID])
def test_bench_mla_verify_k2(benchmark, ceilings, context, tree, batch):
    key_bytes = batch * (context + tree) * (KV_LORA + ROPE) * 2
    baseline_bytes = tree * HEADS * (context + tree) * 4 * 3 + (context + tree) * (KV_LORA + ROPE) * 4
    if key_bytes * 2 + baseline_bytes > MEMORY_CAP:
        pytest.skip(f"needs about {(key_bytes * 2 + baseline_bytes) / 1e9:.0f} GB")
    x = make_inputs(context, tree, batch, seed=context + tree + batch)
    args = {k: v for k, v in x.items() if k != "dense"}

    def call(kernel: str = KERNEL) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify(**args, max_tree=tree, max_kv=context + tree, kernel=kernel)

    kernel_ms = benchmark.pedantic(lambda: graph_time_ms(call), rounds=1, iterations=1)
    assert isinstance(kernel_ms, float), kernel_ms
    visible = batch * context * tree + int(x["dense"].sum())                # (query, key) pairs per head
    flops = visible * HEADS * (2 * (KV_LORA + ROPE) + 2 * KV_LORA)
    q_bytes = batch * tree * HEADS * (KV_LORA + ROPE) * 2
    io_bytes = key_bytes + q_bytes + batch * tree * HEADS * (KV_LORA * 2 + 4)
    floor_ms = max(io_bytes / (ceilings["copy_TBps"] * 1e9), flops / (ceilings["bf16_TFLOPs"] * 1e9))
    ran = verify_kernel(torch.bfloat16, KV_LORA, ROPE, x["c_kv"].device) if KERNEL == "auto" else KERNEL
    row = dict(context=context, tree=tree, batch=batch, kernel=ran, kernel_ms=kernel_ms, call_ms=cuda_time_ms(call),
               floor_ms=floor_ms, flops=flops, io_bytes=io_bytes,
               TBps=io_bytes / kernel_ms / 1e9, TFLOPs=flops / kernel_ms / 1e9,
               bw_fraction=io_bytes / kernel_ms / 1e9 / ceilings["copy_TBps"],
               mma_fraction=flops / kernel_ms / 1e9 / ceilings["bf16_TFLOPs"],
               bound="memory" if io_bytes / ceilings["copy_TBps"] > flops / ceilings["bf16_TFLOPs"] else "compute")
    if not KERNEL_ONLY:
        row["torch_ms"] = cuda_time_ms(lambda: torch_baseline(x, context, tree, batch), budget_ms=300.0)
        row["speedup_vs_torch"] = row["torch_ms"] / kernel_ms
    if flops < GENERIC_FLOP_CAP and not KERNEL_ONLY:
        row["generic_ms"] = cuda_time_ms(lambda: call("cuda_cores"))
    for other in ALSO:
        row[f"{other}_ms"] = graph_time_ms(lambda: call(other))
    if PEERS:
        row.update(time_peers(x, context, tree, batch, kernel_ms, call()[0]))
    record(benchmark, row, "cuda")
    ROWS.append(row)
    dump(ceilings)


def dump(ceilings: dict) -> None:
    """Every row so far to $KDTREE_BENCH_OUT, after every case: a run cut short keeps its rows."""
    out = os.environ.get("KDTREE_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"ceilings": ceilings, "cases": ROWS, "paged": PAGED_ROWS}, f, indent=1)


def page_inputs(x: dict, context: int, tree: int, batch: int, page: int, seed: int) -> dict:
    """x's keys in a pool of shuffled pages -> {c_kv [P, page, R], k_pe [P, page, dr], block_table
    int32 [batch, W]}: request b holds W = ceil((context + tree) / page) pages."""
    keys = context + tree
    width = -(-keys // page)
    order = torch.randperm(batch * width, generator=torch.Generator().manual_seed(seed)).to(x["c_kv"].device)
    pools = {}
    for name in ("c_kv", "k_pe"):
        rows = x[name].view(batch, keys, -1)
        padded = torch.nn.functional.pad(rows, (0, 0, 0, width * page - keys))     # [batch, W * page, d]
        pool = torch.empty_like(padded).view(batch * width, page, -1)
        pool[order] = padded.view(batch * width, page, -1)
        pools[name] = pool
    return dict(pools, block_table=order.view(batch, width).to(torch.int32))


@pytest.mark.parametrize("context,tree,batch,page", PAGED_GRID,
                         ids=[f"ctx{c}-tree{t}-b{b}-page{p}" for c, t, b, p in PAGED_GRID])
def test_bench_mla_verify_paged(benchmark, ceilings, context, tree, batch, page):
    x = make_inputs(context, tree, batch, seed=context + tree + batch)
    paged = page_inputs(x, context, tree, batch, page, seed=page)
    shared = {k: x[k] for k in ("q_lat", "q_pe", "context", "tree_sizes", "q_offsets", "visibility", "scale")}
    kernel = verify_kernel(torch.bfloat16, KV_LORA, ROPE, x["c_kv"].device, page)   # what the paged call takes
    limits = dict(max_tree=tree, max_kv=context + tree, kernel=kernel)

    def paged_call() -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify_paged(c_kv=paged["c_kv"], k_pe=paged["k_pe"], block_table=paged["block_table"],
                                **shared, **limits)

    def contiguous_call(**kw) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify(c_kv=x["c_kv"], k_pe=x["k_pe"], kv_offsets=x["kv_offsets"], **shared, **{**limits, **kw})

    contiguous_ms = graph_time_ms(contiguous_call, PAGED_BUDGET_MS)
    paged_ms = benchmark.pedantic(lambda: graph_time_ms(paged_call, PAGED_BUDGET_MS), rounds=1, iterations=1)
    assert isinstance(paged_ms, float) and isinstance(contiguous_ms, float), (paged_ms, contiguous_ms)
    got, want = paged_call(), contiguous_call()
    equal = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    row = dict(context=context, tree=tree, batch=batch, page_size=page, path=kernel,
               paged_ms=paged_ms, contiguous_ms=contiguous_ms, ratio=paged_ms / contiguous_ms, bitwise_equal=equal)
    if kernel != verify_kernel(torch.bfloat16, KV_LORA, ROPE, x["c_kv"].device):
        row["contiguous_auto_ms"] = graph_time_ms(lambda: contiguous_call(kernel="auto"), PAGED_BUDGET_MS)
    record(benchmark, row, "cuda")
    PAGED_ROWS.append(row)
    dump(ceilings)
    assert equal, "paged and contiguous outputs differ"


# ----------------------------------------------------------------------------- peers


@functools.cache
def load_peers():
    """SGLang's kernels, or the reason they are unavailable (a string)."""
    try:
        return load_sglang()
    except PeerUnavailable as exc:
        return str(exc)


def sglang_layout(x: dict, context: int, tree: int, batch: int) -> dict:
    """Our inputs as SGLang keeps them: kv [rows, 1, 576] (latent then rotary), the prefix rows'
    indices, the tree tokens' keys as the extend part, q [tokens, H, 576], and the per-request
    mask [tree, context + tree] (prefix columns visible, tree columns the ancestor mask)."""
    kv = torch.cat([x["c_kv"], x["k_pe"]], dim=1)[:, None, :]                       # [rows, 1, 576]
    device = x["c_kv"].device
    i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    first = x["kv_offsets"].long()[:, None]
    prefix_rows = (first + torch.arange(context, **i64)).reshape(-1)
    tree_rows = (first + context + torch.arange(tree, **i64)).reshape(-1)
    mask = torch.cat([torch.ones(batch, tree, context, dtype=torch.bool, device=device), x["dense"]], dim=2)
    return dict(kv=kv, q=torch.cat([x["q_lat"], x["q_pe"]], dim=2), prefix_rows=prefix_rows,
                all_rows=(first + torch.arange(context + tree, **i64)).reshape(-1),
                k_extend=kv[tree_rows].contiguous(), mask=mask.reshape(-1),
                qo_indptr=torch.arange(batch + 1, **i32) * tree, kv_indptr=torch.arange(batch + 1, **i32) * context,
                mask_indptr=torch.arange(batch + 1, **i64) * tree * (context + tree))


def sglang_extend(sgl, y: dict, tree: int, scale: float):
    """extend_attention_fwd with the custom mask -> a call writing o [tokens, H, 512]."""
    o = y["q"].new_empty(y["q"].shape[0], HEADS, KV_LORA)
    v_extend = y["k_extend"][..., :KV_LORA]

    def call() -> torch.Tensor:
        sgl.extend_attention_fwd(y["q"], y["k_extend"], v_extend, o, y["kv"], y["kv"][..., :KV_LORA],
                                 y["qo_indptr"], y["kv_indptr"], y["prefix_rows"], y["mask"], False,
                                 y["mask_indptr"], tree, 1.0, 1.0, sm_scale=scale)
        return o
    return call


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def sglang_decode(sgl, y: dict, context: int, batch: int, scale: float, sms: int):
    """decode_attention_fwd (MLA: K is V) over context + 1 keys -> a call writing o [batch, H, 512].
    Splits as SGLang's triton backend sets them for a device of `sms` multiprocessors:
    max_kv_splits = max(8, min(next_pow2(sms), next_pow2(max_context / 32))), per-request
    counts from its get_num_kv_splits_triton."""
    device = y["q"].device
    max_splits = max(8, min(next_power_of_2(sms), next_power_of_2(-(-SGLANG_MAX_CONTEXT // 32))))
    i32 = dict(dtype=torch.int32, device=device)
    splits = torch.empty(batch, **i32)
    sgl.get_num_kv_splits_triton[(1,)](splits, torch.full((batch,), context + 1, **i32), batch, 1, HEADS, 1,
                                       max_splits, sms, MAX_NUM_SEQ=max(256, next_power_of_2(batch)))
    kv_indptr = torch.arange(batch + 1, dtype=torch.int64, device=device) * (context + 1)
    logits = torch.empty(batch, HEADS, max_splits, KV_LORA, dtype=torch.float32, device=device)
    lse = torch.empty(batch, HEADS, max_splits, dtype=torch.float32, device=device)
    o = y["q"].new_empty(batch, HEADS, KV_LORA)

    def call() -> torch.Tensor:
        sgl.decode_attention_fwd(y["q"], y["kv"], y["kv"][..., :KV_LORA], o, kv_indptr, y["all_rows"], logits, lse,
                                 splits, max_splits, scale, 1.0, 1.0, has_mla=True)
        return o
    return call


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def time_peer(name: str, call, ours: torch.Tensor, kernel_ms: float) -> dict:
    """{name_ms, name_ratio (peer / ours), name_error}, or {name_void: why}."""
    try:
        out = call()
        torch.cuda.synchronize()
    except Exception as exc:                     # a peer failing must not lose our row
        return {f"{name}_void": f"{type(exc).__name__}: {exc}"[:300]}
    error = relative_error(out, ours)
    if not error <= PEER_TOLERANCE:
        return {f"{name}_void": f"output differs from ours: relative error {error:.2e} > {PEER_TOLERANCE}",
                f"{name}_error": error}
    ms, _ = peer_time_ms(call, PEER_BUDGET_MS)
    return {f"{name}_ms": ms, f"{name}_ratio": ms / kernel_ms, f"{name}_error": error}


def time_peers(x: dict, context: int, tree: int, batch: int, kernel_ms: float, ours: torch.Tensor) -> dict:
    sgl = load_peers()
    if isinstance(sgl, str):
        return {"peers_void": sgl}
    y = sglang_layout(x, context, tree, batch)
    row = {"peers": sgl.version}
    row.update(time_peer("sglang_extend", sglang_extend(sgl, y, tree, x["scale"]), ours, kernel_ms))
    if tree == 1:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        row.update(time_peer("sglang_decode", sglang_decode(sgl, y, context, batch, x["scale"], sms), ours, kernel_ms))
    return row
