"""Speed of the GPU tree build (draft logits -> compiled tree) against its baselines (docs/status.md's targets).

Per case, in the same run: the kernels (top-k op, then the fused build + compile op), top-k
v3 and v4 side by side (their outputs must be equal, bit for bit, else the test fails);
(a) what published DDTree code does: torch top-k of float32 log-softmax on the GPU, copy
to the host, a Python heapq per request, the tree copied back; (b) the engine's TorchStages
path (topk_logprobs, build_trees, compile_trees); and the floor, reading the logits once at
the device-to-device copy bandwidth measured in this run. Times are medians of CUDA-event
timings inside the benchmarked function; each case's figures go to `benchmark.extra_info`
and, when $KDTREE_BENCH_OUT names a file, to a JSON list there (docs/results/tree-kernels-h200.md
is written from it). The default run times one small case; KDTREE_BENCH=1 runs the grid:
batch 1 / 16 / 64 / 256 x budget 16 / 64 / 256 / 512 x float32 / bf16, V = 163840, L = 15;
KDTREE_BENCH_BASELINES=0 leaves out (a), (b) and the eager timing (seconds a case);
KDTREE_BENCH_BUDGET_MS sets each graph timing's repeats (default 200 ms).
GPU only: skipped with a reason elsewhere.

Sampling choices (`test_bench_sample_choices`): the kernel (tree_ops.sample_choices) against
the engine's torch path (TorchStages.sample_choices, float64 tensors), both on the GPU, at
batch x nodes rows of V = 163840; the two must choose the same ids (else the row records the
mismatch and the test fails). Floor: the logits read once at the copy bandwidth. The default
run times one case; KDTREE_BENCH=1: batch 1 / 16 / 64 x nodes 16 / 64 x float32 / bf16.
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
BASELINES = os.environ.get("KDTREE_BENCH_BASELINES", "1") == "1"
BUDGET_MS = float(os.environ.get("KDTREE_BENCH_BUDGET_MS", "200"))     # repeats of each graph timing
GRID = (list(itertools.product([64, 256, 16, 1], [64, 16, 256, 512], ["float32", "bfloat16"])) if FULL
        else [(1, 16, "float32")])
SAMPLE_GRID = (list(itertools.product([1, 16, 64], [16, 64], ["float32", "bfloat16"])) if FULL
               else [(1, 16, "float32")])
TORCH_SAMPLE_ROWS = 1024      # the torch path's float64 temporaries: about 8 x rows x V x 8 bytes
ROWS: dict[str, list[dict]] = {"cases": [], "sample_cases": []}


@pytest.fixture(scope="module")
def copy_bandwidth() -> dict:
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    return {"gpu": torch.cuda.get_device_name(), "copy_TBps": copy_TBps()}


def record(ceilings: dict, row: dict, kind: str = "cases") -> None:
    """Keep the row; rewrite $KDTREE_BENCH_OUT after every case (a run cut short keeps its rows)."""
    ROWS[kind].append(row)
    out = os.environ.get("KDTREE_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"ceilings": ceilings, **ROWS}, f, indent=1)


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

    def topk(version: int):
        return lambda: tree_ops.topk_logprobs(logits, budget, version)

    def kernels():
        lp, ids = tree_ops.topk_logprobs(logits, budget, 4)
        return tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, budget + 1)

    (lp, ids), (lp4, ids4) = topk(3)(), topk(4)()
    same = bool(torch.equal(lp, lp4) and torch.equal(ids, ids4))
    floor_ms = logits.nbytes / (copy_bandwidth["copy_TBps"] * 1e12) * 1e3
    row = {"batch": batch, "budget": budget, "dtype": dtype, "floor_ms": floor_ms, "v4_same_as_v3": same,
           "kernel_graph_ms": graph_time_ms(kernels, BUDGET_MS), "topk_graph_ms": graph_time_ms(topk(4), BUDGET_MS),
           "topk_v3_graph_ms": graph_time_ms(topk(3), BUDGET_MS),
           "build_graph_ms": graph_time_ms(
               lambda: tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, budget + 1), BUDGET_MS)}
    if isinstance(row["kernel_graph_ms"], float):
        row["graph_floor_multiple"] = row["kernel_graph_ms"] / floor_ms
    if isinstance(row["topk_graph_ms"], float) and isinstance(row["topk_v3_graph_ms"], float):
        row["topk_floor_multiple"] = row["topk_graph_ms"] / floor_ms
        row["topk_v3_floor_multiple"] = row["topk_v3_graph_ms"] / floor_ms
        row["topk_speedup_v4"] = row["topk_v3_graph_ms"] / row["topk_graph_ms"]
    if BASELINES:
        row["kernel_ms"] = cuda_time_ms(kernels)
        row["published_ms"] = cuda_time_ms(lambda: baseline_published(logits, budget, starts), budget_ms=0)
        stages = TorchStages()
        row["engine_ms"] = cuda_time_ms(lambda: baseline_engine(stages, logits, budgets, roots, starts), budget_ms=0)
        row["speedup_vs_published"] = row["published_ms"] / row["kernel_ms"]
        row["speedup_vs_engine"] = row["engine_ms"] / row["kernel_ms"]
        if isinstance(row["kernel_graph_ms"], float):
            row["graph_speedup_vs_published"] = row["published_ms"] / row["kernel_graph_ms"]
    record(copy_bandwidth, row)
    record_figures(benchmark, row, "cuda")
    benchmark.pedantic(lambda: (kernels(), torch.cuda.synchronize()), rounds=3, iterations=1, warmup_rounds=1)
    assert same, "top-k v4 differs from v3"


@pytest.mark.parametrize("batch, nodes, dtype", SAMPLE_GRID)
def test_bench_sample_choices(benchmark, copy_bandwidth, batch: int, nodes: int, dtype: str) -> None:
    torch.manual_seed(batch * 100 + nodes)
    logits = (2 * torch.randn(batch, nodes, VOCAB, device="cuda")).to(getattr(torch, dtype))
    uniforms = torch.rand(batch, nodes, device="cuda", dtype=torch.float64)

    def kernel() -> torch.Tensor:
        return tree_ops.sample_choices(logits, 0.8, uniforms)

    floor_ms = logits.nbytes / (copy_bandwidth["copy_TBps"] * 1e12) * 1e3
    kernel_ms = graph_time_ms(kernel, BUDGET_MS)
    row = {"batch": batch, "nodes": nodes, "dtype": dtype, "kernel_graph_ms": kernel_ms,
           "kernel_ms": cuda_time_ms(kernel, BUDGET_MS), "floor_ms": floor_ms}
    if isinstance(kernel_ms, float):
        row["graph_floor_multiple"] = kernel_ms / floor_ms
        row["ns_per_logit"] = kernel_ms * 1e6 / logits.numel()
    if batch * nodes <= TORCH_SAMPLE_ROWS:
        stages = TorchStages()
        want = stages.sample_choices(logits, 0.8, uniforms)
        row["same_as_torch"] = bool(torch.equal(kernel(), want))
        row["torch_ms"] = cuda_time_ms(lambda: stages.sample_choices(logits, 0.8, uniforms), budget_ms=0)
        row["speedup_vs_torch"] = row["torch_ms"] / row["kernel_ms"]
    record(copy_bandwidth, row, "sample_cases")
    record_figures(benchmark, row, "cuda")
    benchmark.pedantic(lambda: (kernel(), torch.cuda.synchronize()), rounds=3, iterations=1, warmup_rounds=1)
    assert row.get("same_as_torch", True), "the kernel's choices differ from the torch path's"
