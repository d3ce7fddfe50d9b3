"""The AR step of k2-mid with the fused and the unfused layers, side by side, on one GPU.

    PYTHONPATH=. python3 scripts/profile_step.py [OUT.json]

For each dtype and batch (1, 8): the AR step's CUDA-graph replay time (after a 24-token decode
captured the graph), and torch's profile of the eager forward it replays (launches, launches per
layer, device time, top kernels); the fused forward's logits against the unfused one's on the same
step. A quick look before the whole benchmark (tests/engine/test_bench_engine.py); figures
are not committed from here.
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests")

from engine.adapter import cuda_backends  # noqa: E402
from engine.decode import ar_decode  # noqa: E402
from engine.graphs import GraphedModel  # noqa: E402
from engine.model import Transformer  # noqa: E402
from engine.validate import random_weights  # noqa: E402
from engine_bench import forward_profile, replay_ms  # noqa: E402
from kdtr_format import CONFIGS  # noqa: E402


def main(out: str | None) -> int:
    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU; none is visible to torch", file=sys.stderr)
        return 2
    cfg = CONFIGS["k2-mid"]
    stages, attention, backends = cuda_backends()
    print("backends", backends)
    doc = []
    for dtype in (torch.bfloat16, torch.float32):
        weights = random_weights(cfg, seed=0, device="cuda", dtype=dtype)
        models = {f: Transformer(cfg, weights, device="cuda", dtype=dtype, attention=attention, fused=f)
                  for f in (True, False)}
        for batch in (1, 8):
            prompts = [list(range(1 + b, 65 + b)) for b in range(batch)]
            logits = {}
            for fused, model in models.items():
                graphed = GraphedModel(model)
                ar_decode(graphed, prompts, 24, stages=stages)
                step = next(g for k, g in graphed._graphs.items() if k[0] == "ar" and g.cache.batch == batch)
                starts = step.starts.clone()
                step.active.fill_(1)
                ms = replay_ms(step.graph, before=lambda: step.starts.copy_(starts))
                step.starts.copy_(starts)
                ones = torch.ones(batch, 1, 1, dtype=torch.bool, device="cuda")
                profile = forward_profile(model, step.last[:, None], starts[:, None], ones, step.active, starts,
                                          step.cache, top=40)
                logits[fused] = model.forward(step.last[:, None], starts[:, None], ones, step.active, starts,
                                              step.cache, check=False)
                row = {"dtype": str(dtype), "batch": batch, "fused": fused, "replay_ms": ms, **profile}
                doc.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "top"}))
                for name, count, kernel_ms in profile["top"]:
                    print(f"    {kernel_ms:8.3f} ms {count:4d}x {name}")
            diff = float((logits[True] - logits[False]).abs().max())
            print(f"{dtype} batch {batch}: fused vs unfused logits max |diff| {diff:.3g} "
                  f"(scale {float(logits[False].abs().max()):.3g})")
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
