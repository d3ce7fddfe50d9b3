"""Invariant mode's attention against the default mode's, one layer call at K2 widths (64 heads,
latent 512, rope 64) on a GPU: the tensor-core invariant kernel (engine/fused/attention.py), the
CUDA kernel's invariant plan (one split on the CUDA cores) and its default plan, per dtype, for an
AR step and a chain-shaped verify of 17 and 65 rows at batch 1 and 8 over contexts of 256 and 2048.
CUDA-event time of 50 calls after 5 warm-up calls; prints a markdown table.

    PYTHONPATH=. python3 scripts/bench_invariant_attention.py [out.json]
"""

from __future__ import annotations

import json
import sys

import torch

from engine.attention import bind_attention
from engine.cuda_attention import CudaAttention
from engine.fused.attention import InvariantAttention

BACKENDS = {"default (CUDA kernel)": CudaAttention(), "invariant, CUDA-core plan": CudaAttention(invariant=True),
            "invariant, tensor cores": InvariantAttention()}


def timed(call, repeats: int = 50) -> float:
    for _ in range(5):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 8):
            for context in (256, 2048):
                for n in (1, 17, 65):
                    g = torch.Generator(device="cuda").manual_seed(0)
                    q_lat = torch.randn(batch, n, 64, 512, device="cuda", generator=g).to(dtype)
                    q_pe = torch.randn(batch, n, 64, 64, device="cuda", generator=g).to(dtype)
                    c_kv = torch.randn(batch, context + n, 512, device="cuda", generator=g).to(dtype)
                    k_pe = torch.randn(batch, context + n, 64, device="cuda", generator=g).to(dtype)
                    starts = torch.full((batch,), context, device="cuda")
                    n_new = torch.full((batch,), n, device="cuda")
                    vis = torch.ones(batch, n, n, dtype=torch.bool, device="cuda").tril()
                    row = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "rows": n}
                    outputs = {}
                    for name, backend in BACKENDS.items():
                        attend = bind_attention(backend, starts, n_new, vis, context + n, reuse_out=True)
                        row[name] = timed(lambda: attend(q_lat, q_pe, c_kv, k_pe, 0.07))
                        outputs[name] = attend(q_lat, q_pe, c_kv, k_pe, 0.07).float().clone()
                    reference = outputs["default (CUDA kernel)"]
                    difference = outputs["invariant, tensor cores"] - reference
                    row["max |tensor cores - default|"] = float(difference.abs().max())
                    rows.append(row)
    names = list(BACKENDS)
    print("| dtype | batch | context | rows | " + " | ".join(f"{n} ms" for n in names)
          + " | tensor-core invariant / default | max abs difference |")
    print("|---" * (6 + len(names)) + "|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['rows']} | "
              + " | ".join(f"{r[n]:.4f}" for n in names)
              + f" | {r[names[2]] / r[names[0]]:.2f} | {r['max |tensor cores - default|']:.2e} |")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
