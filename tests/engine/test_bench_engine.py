"""End-to-end engine benchmarks: AR against DDTree in the same run (PERFORMANCE.md).

Each benchmark times one call that decodes the same prompts with AR and then
with DDTree, and records side by side (benchmark.extra_info): tokens per
second of each, the speedup, tau (tokens per round), target forwards, the
time per stage, and speedup / tau (the GPU target is >= 0.8). Nothing is
asserted about speed.

- CPU: the `tiny` preset, oracle and layerskip drafters. Default sizes are
  small; `KDTREE_BENCH=1` decodes longer.
- GPU: the `k2-mid` config (kdtr_format.CONFIGS) with random float32 and bf16
  weights made on the device, batch 1 and 8, oracle and layerskip drafters, the CUDA stages
  and attention kernels when they load. Skipped without CUDA.
  One command runs it and writes the tables: scripts/gpu_engine.sh.
"""

from __future__ import annotations

import os

import pytest
import torch

from kdtr_format import CONFIGS, DDTreeConfig
from engine.adapter import cuda_backends
from engine.decode import DecodeResult, ar_decode, ddtree_decode
from engine.drafters import LayerSkipDrafter, OracleDrafter
from engine.model import Transformer
from engine.validate import random_weights

BIG = os.environ.get("KDTREE_BENCH") == "1"


def run_side_by_side(model, drafter_for, prompts, ddtree: DDTreeConfig, tokens: int, stages=None
                     ) -> tuple[DecodeResult, DecodeResult]:
    ar = ar_decode(model, prompts, tokens, stages=stages)
    dd = ddtree_decode(model, drafter_for(ar), prompts, ddtree, tokens, stages=stages)
    return ar, dd


def record(benchmark, ar: DecodeResult, dd: DecodeResult, **extra) -> None:
    speedup = dd.metrics.tokens_per_second / ar.metrics.tokens_per_second
    tau = dd.metrics.mean_acceptance
    benchmark.extra_info.update(
        ar_tokens_per_s=ar.metrics.tokens_per_second, ddtree_tokens_per_s=dd.metrics.tokens_per_second,
        speedup=speedup, tau=tau, speedup_over_tau=speedup / tau,
        ar_target_forwards=ar.metrics.target_forwards, ddtree_target_forwards=dd.metrics.target_forwards,
        tokens_match=sum(a == b for a, b in zip(ar.tokens, dd.tokens)) / len(ar.tokens),
        ddtree_stage_ms={k: v * 1e3 for k, v in dd.metrics.stage_seconds.items()},
        ar_stage_ms={k: v * 1e3 for k, v in ar.metrics.stage_seconds.items()}, **extra)


@pytest.mark.parametrize("drafter", ["oracle", "layerskip"])
def test_bench_cpu_tiny(benchmark, model_zoo, drafter):
    case = model_zoo.get("tiny")
    model = case.engine("cpu")
    prompts = [list(range(3, 35))]
    tokens = 128 if BIG else 24
    ddtree = DDTreeConfig(block_size=8, budget=32)

    def drafter_for(ar):
        if drafter == "oracle":
            return OracleDrafter([p + t for p, t in zip(prompts, ar.tokens)], case.cfg.vocab_size, 0.8, seed=1)
        return LayerSkipDrafter(case.cfg, case.weights, 2)

    ar, dd = benchmark.pedantic(run_side_by_side, args=(model, drafter_for, prompts, ddtree, tokens),
                                rounds=3 if BIG else 1, iterations=1)
    assert dd.tokens == ar.tokens
    record(benchmark, ar, dd, preset="tiny", drafter=drafter, batch=1, tokens=tokens, device="cpu")


@pytest.fixture(scope="module")
def k2_mid():
    """-> build(dtype): the k2-mid model with random weights made on the device, built once per dtype."""
    if not torch.cuda.is_available():
        pytest.skip("GPU engine benchmark: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    cfg = CONFIGS["k2-mid"]
    built = {}

    def build(dtype: torch.dtype):
        if dtype not in built:
            weights = random_weights(cfg, seed=0, device="cuda", dtype=dtype)
            stages, attention, backends = cuda_backends()
            model = Transformer(cfg, weights, device="cuda", dtype=dtype, attention=attention)
            built[dtype] = cfg, weights, model, stages, backends
        return built[dtype]
    return build


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter", ["oracle", "layerskip"])
def test_bench_gpu_k2_mid(benchmark, k2_mid, batch, drafter, dtype):
    cfg, weights, model, stages, backends = k2_mid(dtype)
    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, cfg.vocab_size, (64 + 16 * b,), generator=generator).tolist() for b in range(batch)]
    tokens = 256 if BIG else 64
    ddtree = DDTreeConfig(block_size=16, budget=64)

    def drafter_for(ar):
        if drafter == "oracle":
            return OracleDrafter([p + t for p, t in zip(prompts, ar.tokens)], cfg.vocab_size, 0.8, seed=1,
                                 device="cuda")
        return LayerSkipDrafter(cfg, weights, 2, device="cuda", dtype=dtype)

    run_side_by_side(model, drafter_for, prompts, ddtree, 8, stages)          # warm up kernels and caches
    ar, dd = benchmark.pedantic(run_side_by_side, args=(model, drafter_for, prompts, ddtree, tokens, stages),
                                rounds=3 if BIG else 1, iterations=1)
    record(benchmark, ar, dd, config="k2-mid", drafter=drafter, batch=batch, tokens=tokens, device="cuda",
           dtype=str(dtype).removeprefix("torch."), gpu=torch.cuda.get_device_name(), backends=backends)
