"""Timing and ceilings shared by the GPU benchmarks (docs/status.md's targets).

Times are medians of CUDA-event timings after one warm-up; `graph_time_ms` times
replays of a CUDA graph, the device's time without the host's launch overhead. The
ceilings are measured in the same run as the work they bound: a 1 GiB device-to-device
copy (bytes read + written) and an 8192^3 bf16 matrix product on random data.
"""

from __future__ import annotations

import torch


def cuda_time_ms(fn, budget_ms: float = 200.0, max_reps: int = 50) -> float:
    """Median of CUDA-event timings of fn() after one warm-up; about budget_ms of repeats (3 at least)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while len(times) < 3 or (sum(times) < budget_ms and len(times) < max_reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def capture_graph(fn):
    """fn() warmed up on a side stream, then captured -> (the CUDA graph, fn's return value
    from the capture: the tensors each replay writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph, captured


def graph_time_ms(fn, budget_ms: float = 200.0) -> float | str:
    """cuda_time_ms of replays of a CUDA graph of fn(), or the capture error's text."""
    try:
        graph, _ = capture_graph(fn)
    except RuntimeError as exc:
        return f"capture failed: {exc}"
    return cuda_time_ms(graph.replay, budget_ms)


def peer_time_ms(fn, budget_ms: float = 200.0) -> tuple[float, bool]:
    """(ms, eager): graph_time_ms of fn(), or cuda_time_ms of eager calls where a graph cannot
    capture it (a peer's kernel whose launch does host work), eager then True."""
    ms = graph_time_ms(fn, budget_ms)
    return (ms, False) if isinstance(ms, float) else (cuda_time_ms(fn, budget_ms), True)


def copy_TBps() -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written), measured now."""
    src = torch.randn(2**28, device="cuda")                                   # 1 GiB
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 / ms / 1e9


def bf16_matmul_TFLOPs() -> float:
    """bf16 matrix rate in TFLOP/s on an 8192^3 product of random data, measured now."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = cuda_time_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192**3 / ms / 1e9
