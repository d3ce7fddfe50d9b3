"""The engine's forward on a paged KV cache against the contiguous one, side by side (GPU).

k2-mid (kdtr_format.CONFIGS) with random bf16 weights on the device, the CUDA attention kernel
and stages: one CUDA-graph forward per (layout, batch, width) over a cache prefilled to CONTEXT
tokens a request, timed by its replays (CUDA events). Widths 1 (an AR step) and 65 (a budget-64
tree verify); pages of 64 and 16 slots (the kernel's tensor-core path reads them by TMA) and of
1 slot (its CUDA-core path). The figure is each paged step's time over the contiguous step's in
the same run, and the logits are checked first: bit for bit where the kernel takes the same
path, within bf16 rounding (relative 2e-2) on the CUDA-core path (a paged step that computes
something else is not timed). The JSON goes to $KDTREE_PAGED_OUT; nothing is asserted about speed.
Skipped without CUDA.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from bench_record import record as record_figures
from engine_bench import replay_ms
from kdtr_format import CONFIGS

CONTEXT = 2048
LAYOUTS = (None, 64, 16, 1)
BATCHES = (1, 8)
WIDTHS = (1, 65)


def step_graph(model, batch: int, width: int):
    """A prefilled cache and the forward graph of a full tree of `width` nodes (a chain) on it
    -> (the graph with its static inputs, which must stay alive while it replays; logits of one replay)."""
    from engine.graphs import GraphedModel

    device = model.device
    generator = torch.Generator().manual_seed(batch)
    cache = model.new_cache(batch, CONTEXT + 128)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, CONTEXT), generator=generator).to(device)
    causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    model.forward(prompt, torch.arange(CONTEXT, device=device).expand(batch, -1), causal,
                  zeros + CONTEXT, zeros, cache, check=False)
    graphed = GraphedModel(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, width), generator=generator).to(device)
    positions = CONTEXT + torch.arange(width, device=device).expand(batch, -1)
    chain = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
    logits = graphed.forward(tokens, positions, chain, zeros + width, zeros + CONTEXT, cache, check=False).clone()
    return next(g for key, g in graphed._graphs.items() if key[0] == "forward"), logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="GPU paged-KV benchmark: no CUDA GPU is visible (torch.cuda.is_available() is False)")
def test_bench_gpu_paged_steps(benchmark):
    from engine.adapter import cuda_backends
    from engine.model import Transformer
    from kernels_cuda.mla_ops import paged_tensor_cores
    from engine.validate import random_weights

    stages, attention, notes = cuda_backends()
    if attention is None:
        pytest.skip(f"kernels_cuda does not load: {notes}")
    cfg = CONFIGS["k2-mid"]
    weights = random_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    rows = []

    def run() -> list[dict]:
        for batch in BATCHES:
            for width in WIDTHS:
                flat_ms = flat_logits = None
                for page_size in LAYOUTS:
                    model = Transformer(cfg, weights, device="cuda", dtype=torch.bfloat16, attention=attention,
                                        page_size=page_size)
                    graph, logits = step_graph(model, batch, width)
                    row = {"batch": batch, "width": width, "context": CONTEXT, "page_size": page_size,
                           "attention": "tensor cores" if page_size is None or paged_tensor_cores(page_size)
                           else "CUDA cores"}
                    if flat_logits is not None:
                        row["logits_error"] = float((logits - flat_logits).float().norm() / flat_logits.float().norm())
                    if flat_logits is not None and row["attention"] == "tensor cores" and row["logits_error"] != 0:
                        row["void"] = "logits differ from the contiguous cache's on the same kernel path"
                    elif flat_logits is not None and row["logits_error"] > 2e-2:
                        row["void"] = "logits beyond bf16 rounding of the contiguous cache's"
                    else:
                        row["ms"] = replay_ms(graph.graph, reps=20)
                        if flat_ms is None:
                            flat_ms, flat_logits = row["ms"], logits
                        row["over_contiguous"] = row["ms"] / flat_ms
                    rows.append(row)
                    print(row)
                    del model, graph
                    torch.cuda.empty_cache()
        return rows

    benchmark.pedantic(run, rounds=1, iterations=1)
    doc = {"config": "k2-mid", "dtype": "bfloat16", "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "commit": os.environ.get("KDTREE_COMMIT", "unknown"),
           "backends": notes, "rows": rows}
    if os.environ.get("KDTREE_PAGED_OUT"):
        with open(os.environ["KDTREE_PAGED_OUT"], "w") as f:
            json.dump(doc, f, indent=1)
    record_figures(benchmark, {"rows": rows}, "cuda")
    assert rows and not any("same kernel path" in r.get("void", "") for r in rows), [r for r in rows if "void" in r]
