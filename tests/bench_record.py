"""One benchmark's figures into pytest-benchmark's JSON (docs/ci.md, "Benchmarks").

    record(benchmark, {"kernel_ms": 0.12, "speedup_vs_published": 70.1}, "cuda")

puts the figures in `benchmark.extra_info` (written to `--benchmark-json` and to stored runs
beside the timing statistics) as JSON values (numpy scalars and arrays as numbers and
lists), with `device`: the GPU's name for "cuda", the processor and its cores for "cpu".
ci/bench_check.py reads the ratio and fraction figures from there.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Mapping

import numpy as np


def record(benchmark, figures: Mapping[str, Any], device: str = "cpu") -> None:
    benchmark.extra_info.update({name: _json(value) for name, value in figures.items()})
    benchmark.extra_info["device"] = describe(device)


def describe(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value
