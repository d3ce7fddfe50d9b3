"""The invariant attention's tile shapes at the engine benchmark's shapes, on one GPU.

    PYTHONPATH=. python3 scripts/sweep_invariant_attention.py [OUT.json]

k2-mid's attention (64 heads, latent 512, rope 64, bf16) at the contexts and tree sizes of
tests/engine/test_bench_engine.py (AR batch 1 and 8, verify of 17 / 65 / 257 rows a request):
one layer's call of `InvariantAttention` for each (heads a program, warps) against the
default mode's kernel (`CudaAttention`) on the same inputs, median of CUDA-event timings
(tests/kernels/gpu_bench.py), and each output's largest difference from the default kernel's (a
tile shape that computes something else shows). The engine's shape was chosen from its run
(docs/results/invariant-attention-sweep-h100.md).
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests/kernels")

from engine.cuda_attention import CudaAttention  # noqa: E402
from engine.fused.attention import InvariantAttention  # noqa: E402
from gpu_bench import cuda_time_ms  # noqa: E402

HEADS, RANK, ROPE = 64, 512, 64
SHAPES = [  # (requests, new tokens a request, context of request 0; each next request 16 more)
    (1, 1, 159), (8, 1, 159), (1, 17, 158), (1, 65, 158), (1, 257, 158), (8, 17, 159), (8, 65, 159), (8, 257, 159)]
CANDIDATES = [(16, 4), (32, 4), (64, 4), (64, 8)]   # (heads a program, warps)


def chain_visibility(batch: int, n: int) -> torch.Tensor:
    """A random tree a request: node j's parent uniform in [0, j) -> [B, N, N] ancestor mask."""
    g = torch.Generator().manual_seed(0)
    vis = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        vis[b] = torch.eye(n, dtype=torch.bool)
        for j in range(1, n):
            vis[b, j] |= vis[b, int(torch.randint(0, j, (1,), generator=g))]
    return vis.cuda()


def main(out: str | None) -> int:
    if not torch.cuda.is_available():
        print("sweep_invariant_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for batch, n, context in SHAPES:
        starts = torch.tensor([context + 16 * b for b in range(batch)], device="cuda")
        slots = int(starts.max()) + n + 1
        g = torch.Generator(device="cuda").manual_seed(1)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)
        q_lat, q_pe = randn(batch, n, HEADS, RANK), randn(batch, n, HEADS, ROPE)
        c_kv, k_pe = randn(batch, slots, RANK), randn(batch, slots, ROPE)
        n_new = torch.full((batch,), n, device="cuda")
        vis = chain_visibility(batch, n)
        default = CudaAttention().bind(starts, n_new, vis, slots)
        expected = default(q_lat, q_pe, c_kv, k_pe, 0.07).float()
        row = {"batch": batch, "rows": batch * n, "slots": slots,
               "default_ms": cuda_time_ms(lambda: default(q_lat, q_pe, c_kv, k_pe, 0.07))}
        for block_h, warps in CANDIDATES:
            attend = InvariantAttention(block_h=block_h, num_warps=warps).bind(starts, n_new, vis, slots)
            got = attend(q_lat, q_pe, c_kv, k_pe, 0.07).float()
            row[f"h{block_h}_w{warps}_ms"] = cuda_time_ms(lambda: attend(q_lat, q_pe, c_kv, k_pe, 0.07))
            row[f"h{block_h}_w{warps}_diff"] = float((got - expected).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| batch | rows | default ms | " + " | ".join(f"{h} heads, {w} warps" for h, w in CANDIDATES) + " |")
    print("|---" * (3 + len(CANDIDATES)) + "|")
    for r in rows:
        cells = [f"{r[f'h{h}_w{w}_ms']:.3f} ({r[f'h{h}_w{w}_ms'] / r['default_ms']:.2f}x)" for h, w in CANDIDATES]
        print(f"| {r['batch']} | {r['rows']} | {r['default_ms']:.3f} | " + " | ".join(cells) + " |")
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
