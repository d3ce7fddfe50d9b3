"""Speed of the GPU tree build (draft logits -> compiled tree) against its baselines (PERFORMANCE.md).

Per case, in the same run: the kernels (top-k op, then the fused build + compile op);
(a) what published DDTree code does: torch top-k of float32 log-softmax on the GPU, copy
to the host, a Python heapq per request, the tree copied back; (b) the engine's TorchStages
path (topk_logprobs, build_trees, compile_trees); and the floor, reading the logits once at
the device-to-device copy bandwidth measured in this run. Times are medians of CUDA-event
timings inside the benchmarked function; each case's figures go to `benchmark.extra_info`
and, when $KDTREE_BENCH_OUT names a file, to a JSON list there (docs/results/tree-kernels-h200.md
is written from it). The default run times one small case; KDTREE_BENCH=1 runs the grid:
batch 1 / 16 / 64 / 256 x budget 16 / 64 / 256 / 512 x float32 / bf16, V = 163840, L = 15.
GPU only: skipped with a reason elsewhere.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os

import pytest
import torch

from engine.stages import TorchStages
from kernels_cuda import tree_ops
from bench_record import record as record_figures
from gpu_bench import copy_TBps, cuda_time_ms, graph_time_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")

VOCAB, DEPTH = 163840, 15
FULL = os.environ.get("KDTREE_BENCH") == "1"
GRID = (list(itertools.product([64, 256, 16, 1], [64, 16, 256, 512], ["float32", "bfloat16"])) if FULL
        else [(1, 16, "float32")])
ROWS: list[dict] = []


@pytest.fixture(scope="module")
def copy_bandwidth() -> dict:
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    return {"gpu": torch.cuda.get_device_name(), "copy_TBps": copy_TBps()}


def record(ceilings: dict, row: dict) -> None:
    """Keep the row; rewrite $KDTREE_BENCH_OUT after every case (a run cut short keeps its rows)."""
    ROWS.append(row)
    out = os.environ.get("KDTREE_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"ceilings": ceilings, "cases": ROWS}, f, indent=1)


def heapq_tree(lp: list[list[float]], ids: list[list[int]], budget: int) -> tuple[list[int], list[int], list[int]]:
    """Baseline (a)'s host build, as published DDTree code writes it: a heapq of (-score, tiebreak, ...)."""
    parents, tokens, depths, scores = [-1], [-1], [0], [0.0]
    heap = [(-lp[0][0], 0, 0, 1, 0)]
    count = 1
    while heap and len(parents) <= budget:
        neg, _, parent, d, r = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        tokens.append(ids[d - 1][r])
        depths.append(d)
        scores.append(-neg)
        if r + 1 < len(lp[0]):
            heapq.heappush(heap, (-(scores[parent] + lp[d - 1][r + 1]), count, parent, d, r + 1))
            count += 1
        if d < len(lp):
            heapq.heappush(heap, (-(scores[node] + lp[d][0]), count, node, d + 1, 0))
            count += 1
    return parents, tokens, depths


def baseline_published(logits: torch.Tensor, budget: int, starts: torch.Tensor) -> list[torch.Tensor]:
    """(a): top-k on the GPU, host heapq per request, positions and ancestor masks built on the host."""
    lp, ids = torch.log_softmax(logits.float(), dim=-1).topk(budget, dim=-1)
    lp, ids = lp.cpu().tolist(), ids.cpu().tolist()
    out = []
    for b, start in enumerate(starts.tolist()):
        parents, tokens, depths = heapq_tree(lp[b], ids[b], budget)
        mask = torch.eye(len(parents), dtype=torch.bool)
        for i in range(1, len(parents)):
            mask[i] |= mask[parents[i]]
        out += [torch.tensor(tokens), torch.tensor(depths) + start, mask]
    return [t.to("cuda", non_blocking=True) for t in out]


def baseline_engine(stages: TorchStages, logits: torch.Tensor, budgets: torch.Tensor, roots: torch.Tensor,
                    starts: torch.Tensor):
    """(b): the engine's torch path."""
    lp, ids = stages.topk_logprobs(logits, int(budgets.max()))
    return stages.compile_trees(stages.build_trees(lp, ids, budgets, roots), starts)


@pytest.mark.parametrize("batch, budget, dtype", GRID)
def test_bench_tree_build(benchmark, copy_bandwidth, batch: int, budget: int, dtype: str) -> None:
    torch.manual_seed(batch * 1000 + budget)
    logits = (2 * torch.randn(batch, DEPTH, VOCAB, device="cuda")).to(getattr(torch, dtype))
    budgets = torch.full((batch,), budget, dtype=torch.int64, device="cuda")
    roots = torch.arange(batch, dtype=torch.int64, device="cuda")
    starts = torch.full((batch,), 4096, dtype=torch.int64, device="cuda")

    def kernels():
        lp, ids = tree_ops.topk_logprobs(logits, budget)
        return tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, budget + 1)

    lp, ids = tree_ops.topk_logprobs(logits, budget)
    topk_ms = cuda_time_ms(lambda: tree_ops.topk_logprobs(logits, budget))
    build_ms = cuda_time_ms(lambda: tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, budget + 1))
    kernel_ms = cuda_time_ms(kernels)
    graph = {"kernel_graph_ms": graph_time_ms(kernels),
             "topk_graph_ms": graph_time_ms(lambda: tree_ops.topk_logprobs(logits, budget)),
             "build_graph_ms": graph_time_ms(
                 lambda: tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, budget + 1))}
    published_ms = cuda_time_ms(lambda: baseline_published(logits, budget, starts), budget_ms=0)
    stages = TorchStages()
    engine_ms = cuda_time_ms(lambda: baseline_engine(stages, logits, budgets, roots, starts), budget_ms=0)
    floor_ms = logits.nbytes / (copy_bandwidth["copy_TBps"] * 1e12) * 1e3
    row = {"batch": batch, "budget": budget, "dtype": dtype, "kernel_ms": kernel_ms, "topk_ms": topk_ms,
           "build_ms": build_ms, "published_ms": published_ms, "engine_ms": engine_ms, "floor_ms": floor_ms,
           "speedup_vs_published": published_ms / kernel_ms, "speedup_vs_engine": engine_ms / kernel_ms,
           "floor_multiple": kernel_ms / floor_ms, **graph}
    if isinstance(graph["kernel_graph_ms"], float):
        row["graph_floor_multiple"] = graph["kernel_graph_ms"] / floor_ms
        row["graph_speedup_vs_published"] = published_ms / graph["kernel_graph_ms"]
    record(copy_bandwidth, row)
    record_figures(benchmark, row, "cuda")
    benchmark.pedantic(lambda: (kernels(), torch.cuda.synchronize()), rounds=3, iterations=1, warmup_rounds=1)
