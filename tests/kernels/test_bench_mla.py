"""Speed of the tree-verify MLA kernel at Kimi K2 dims (PERFORMANCE.md), bf16 with float32
accumulation, against the two ceilings measured in the same run (device-to-device copy
bandwidth, bf16 matrix rate) and a torch baseline (matmul, mask, softmax in float32).

kernel_ms is the median CUDA-event time of replays of a CUDA graph of one `mla_verify` call
(the kernel and, with several key splits, the combine kernel: the GPU's time, as an engine
that captures its decode step sees it); call_ms times the same call made eagerly from Python
(argument checks and the custom-op dispatch included). Fractions of the ceilings use
kernel_ms. Each case's figures go to `benchmark.extra_info` and, when $KDTREE_BENCH_OUT
names a file, to a JSON list there (docs/results/mla-verify-h200.md is written from it).
The default run times one small case; KDTREE_BENCH=1 runs the grid: context 1k / 8k / 32k x
tree tokens 1 / 16 / 64 / 128 x batch 1 / 8 / 32; KDTREE_BENCH_KERNEL_ONLY=1 leaves out the
torch baseline and the CUDA-core path (to compare builds of the kernel quickly). GPU only:
skipped with a reason elsewhere.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

from kdtr_format import PRESETS
from kernels_cuda.mla_ops import mla_verify, pack_visibility
from bench_record import record
from gpu_bench import bf16_matmul_TFLOPs, copy_TBps, cuda_time_ms, graph_time_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")

K2 = PRESETS["kimi-k2"]
HEADS, KV_LORA, ROPE = K2.num_attention_heads, K2.kv_lora_rank, K2.qk_rope_head_dim
FULL = os.environ.get("KDTREE_BENCH") == "1"
KERNEL_ONLY = os.environ.get("KDTREE_BENCH_KERNEL_ONLY") == "1"
GRID = (list(itertools.product([1024, 8192, 32768], [1, 16, 64, 128], [1, 8, 32])) if FULL
        else [(1024, 16, 1)])
MEMORY_CAP = 40e9             # bytes: skip a case whose inputs and baseline intermediates exceed it
GENERIC_FLOP_CAP = 2e11       # time the CUDA-core path only where it finishes quickly
ROWS: list[dict] = []


@pytest.fixture(scope="module")
def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matrix rate, measured now."""
    result = {"gpu": torch.cuda.get_device_name(), "copy_TBps": copy_TBps(),
              "bf16_TFLOPs": bf16_matmul_TFLOPs()}
    return result


def make_inputs(context: int, tree: int, batch: int, seed: int) -> dict:
    """Packed K2 inputs: every request has `context` cached keys and a random tree of `tree` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    parents = (torch.rand(batch, tree, generator=gen, device="cuda")
               * torch.arange(tree, device="cuda")).long()                   # parents[:, i] in [0, i)
    vis = torch.eye(tree, dtype=torch.bool, device="cuda").repeat(batch, 1, 1)
    for i in range(1, tree):                                                 # row i = row parent(i) + i
        vis[:, i] |= vis[torch.arange(batch, device="cuda"), parents[:, i]]
    rows = batch * (context + tree)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    i32 = dict(dtype=torch.int32, device="cuda")
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
        hidden = torch.cat([torch.zeros(tree, context, dtype=torch.bool, device="cuda"), ~x["dense"][b]], 1)
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

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify(**args, max_tree=tree, max_kv=context + tree)

    kernel_ms = benchmark.pedantic(lambda: graph_time_ms(call), rounds=1, iterations=1)
    assert isinstance(kernel_ms, float), kernel_ms
    visible = batch * context * tree + int(x["dense"].sum())                # (query, key) pairs per head
    flops = visible * HEADS * (2 * (KV_LORA + ROPE) + 2 * KV_LORA)
    q_bytes = batch * tree * HEADS * (KV_LORA + ROPE) * 2
    io_bytes = key_bytes + q_bytes + batch * tree * HEADS * (KV_LORA * 2 + 4)
    floor_ms = max(io_bytes / (ceilings["copy_TBps"] * 1e9), flops / (ceilings["bf16_TFLOPs"] * 1e9))
    row = dict(context=context, tree=tree, batch=batch, kernel_ms=kernel_ms, call_ms=cuda_time_ms(call),
               floor_ms=floor_ms,
               TBps=io_bytes / kernel_ms / 1e9, TFLOPs=flops / kernel_ms / 1e9,
               bw_fraction=io_bytes / kernel_ms / 1e9 / ceilings["copy_TBps"],
               mma_fraction=flops / kernel_ms / 1e9 / ceilings["bf16_TFLOPs"],
               bound="memory" if io_bytes / ceilings["copy_TBps"] > flops / ceilings["bf16_TFLOPs"] else "compute")
    if not KERNEL_ONLY:
        row["torch_ms"] = cuda_time_ms(lambda: torch_baseline(x, context, tree, batch), budget_ms=300.0)
        row["speedup_vs_torch"] = row["torch_ms"] / kernel_ms
    if flops < GENERIC_FLOP_CAP and not KERNEL_ONLY:
        row["generic_ms"] = cuda_time_ms(lambda: mla_verify(**args, max_tree=tree, max_kv=context + tree,
                                                            generic=True))
    record(benchmark, row, "cuda")
    ROWS.append(row)
    out = os.environ.get("KDTREE_BENCH_OUT")
    if out:                                      # after every case: a run cut short keeps its rows
        with open(out, "w") as f:
            json.dump({"ceilings": ceilings, "cases": ROWS}, f, indent=1)
