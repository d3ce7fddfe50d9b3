"""Time the fused FFN's expert sort (engine/fused/moe.py `align`) in one program and in parallel spans.

    PYTHONPATH=.:tests:tests/kernels python3 scripts/align_ab.py

One GPU run, the same routings both ways: ALIGN_PROGRAMS = 1 (every call one program: the sort
as it was before the spans) against the default (up to ALIGN_PROGRAMS programs a launch past one
chunk of pairs). Routings are uniform random: k2-mid (16 routed experts, top-4, one shared) at the
benchmark's row counts, and Kimi K2 (384 routed, top-8, one shared). Each time is the median
CUDA-graph replay time (tests/kernels/gpu_bench.py); the outputs of both ways are compared.
"""

from __future__ import annotations

import argparse
import sys

CASES = (  # (name, rows, routed experts, top-k, shared experts)
    ("k2-mid AR batch 8", 8, 16, 4, 1), ("k2-mid verify 65", 65, 16, 4, 1),
    ("k2-mid verify 520", 520, 16, 4, 1), ("k2-mid verify 2056", 2056, 16, 4, 1),
    ("K2 verify 65", 65, 384, 8, 1), ("K2 verify 520", 520, 384, 8, 1), ("K2 verify 2056", 2056, 384, 8, 1),
)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("align_ab: needs a CUDA GPU (none is visible to torch)")
    from gpu_bench import graph_time_ms
    from engine.fused import moe

    default = moe.ALIGN_PROGRAMS
    print(f"{'case':22s} {'pairs':>6s} {'one program ms':>15s} {'spans ms':>9s} {'speedup':>8s}")
    for name, rows, routed, k, shared in CASES:
        g = torch.Generator(device="cuda").manual_seed(rows)
        experts = routed + shared
        idx = torch.cat([torch.randint(0, routed, (rows, k), generator=g, device="cuda", dtype=torch.int32),
                         routed + torch.arange(shared, device="cuda", dtype=torch.int32).expand(rows, shared)], 1)
        real = torch.ones(rows, dtype=torch.uint8, device="cuda")
        bm = moe.block_m(idx.numel(), experts)
        times, outputs = {}, {}
        for programs in (1, default):
            moe.ALIGN_PROGRAMS = programs
            try:
                outputs[programs] = [t.clone() for t in moe.align(idx, real, experts, bm)]
                times[programs] = graph_time_ms(lambda: moe.align(idx, real, experts, bm), 50.0)
            finally:
                moe.ALIGN_PROGRAMS = default
        same = all(torch.equal(a, b) for a, b in zip(outputs[1], outputs[default]))
        print(f"{name:22s} {idx.numel():6d} {times[1]:15.4f} {times[default]:9.4f} "
              f"{times[1] / times[default]:7.2f}x{'' if same else '  OUTPUTS DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
