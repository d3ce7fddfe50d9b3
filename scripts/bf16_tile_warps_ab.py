"""The fused layers' 64-row bf16 tiles at 4 warps (as launched) and at 8, timed on one GPU, and
whether the warp count changes any bit.

    PYTHONPATH=.:tests/kernels python3 scripts/bf16_tile_warps_ab.py

Compiled for sm_90 under the GPU machine's Triton 3.6, these tiles spill at 4 warps (the linear
472-528 stack bytes a thread, the expert products 808 and 392) and not at 8
(docs/results/fused-resources-sm90.md). Shapes are k2-mid's, as scripts/sweep_float32_invariant.py
makes them, in bf16: invariant mode's products of every weight of a layer and the head
(`linear`, 64-row tiles whatever the call) and its experts (16 routed + 1 shared, top 4), and
the default mode's experts at the row counts where they take 64-row blocks. The warp count is forced by overriding the
launch's `num_warps` for those kernels at BLOCK_M 64, bf16. Each time is the median of
CUDA-event timings (tests/kernels/gpu_bench.py); "bits" is the largest difference between the
two (0.0: the same bits).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator

ROWS = [1, 8, 65, 136, 520, 2056]
TILED = ("_linear_kernel", "_expert_matmul_kernel", "_head_bmm_kernel")


@contextlib.contextmanager
def warps(count: int) -> Iterator[None]:
    """Launches of TILED kernels with BLOCK_M 64 and bf16 tiles (IEEE False) take `count` warps."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def forced(self, *args, **kwargs):
        if self.fn.__name__ in TILED and kwargs.get("BLOCK_M") == 64 and kwargs.get("IEEE") is False:
            kwargs["num_warps"] = count
        return run(self, *args, **kwargs)
    JITFunction.run = forced
    try:
        yield
    finally:
        JITFunction.run = run


def compare(name: str, rows: int, call: Callable) -> None:
    import torch
    from gpu_bench import cuda_time_ms

    times, outputs = {}, {}
    for count in (4, 8):
        with warps(count):
            outputs[count] = call().float()
            times[count] = cuda_time_ms(call)
    bits = float((outputs[4] - outputs[8]).abs().max())
    torch.cuda.synchronize()
    print(f"{name:28s} {rows:6d} {times[4]:10.4f} {times[8]:10.4f} {times[4] / times[8]:8.2f} {bits:8.2g}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bf16_tile_warps_ab: needs a CUDA GPU (none is visible to torch)")
    from engine.fused import linear, moe
    from sweep_float32_invariant import EXPERTS, WEIGHTS, expert_inputs, expert_weights

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    print(f"{'call':28s} {'rows':>6s} {'4 warps ms':>10s} {'8 warps ms':>10s} {'speedup':>8s} {'bits':>8s}")
    for name, (n, k) in WEIGHTS.items():
        w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(bf16)
        for m in ROWS:
            x = torch.randn(m, k, generator=g, device="cuda").to(bf16)
            compare(f"linear {name} (invariant)", m, lambda: linear.linear(x, w, invariant=True))
    w_gate, w_up, w_down = (w.to(bf16) for w in expert_weights(g))
    experts = EXPERTS[0] + EXPERTS[1]
    for m in ROWS:
        h, idx, weight, real = expert_inputs(g, m)
        h = h.to(bf16)
        for invariant in (True, False):
            if invariant or moe.block_m(idx.numel(), experts) == 64:
                compare(f"experts ({'invariant' if invariant else 'default'})", m,
                        lambda: moe.experts(h, idx, weight, real, w_gate, w_up, w_down, invariant=invariant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
