"""End-to-end engine benchmarks: AR against DDTree in the same run (docs/status.md's targets).

Each benchmark times one call that decodes the same prompts with AR and then
with DDTree, and records side by side (benchmark.extra_info): tokens per
second of each, the speedup, tau (tokens per round), target forwards, the
time per stage, and speedup / tau (the GPU target is >= 0.8). Nothing is
asserted about speed.

- CPU: the `tiny` preset, oracle and layerskip drafters. Default sizes are
  small; `KDTREE_BENCH=1` decodes longer.
- GPU: the `k2-mid` config (kdtr_format.CONFIGS) with random bf16 and float32 weights made
  on the device, default and invariant mode, through CUDA graphs (engine.graphs), the CUDA
  stages and attention kernel: AR and tree-verify steps against their floors, and an oracle
  accuracy sweep (tau about 2 to 10) at budgets 64, 16, 256, block 16, batch 1 and 8
  (tests/engine_bench.py; the JSON goes to $KDTREE_BENCH_OUT, tests/engine_report.py writes
  the table and the plot). Skipped without CUDA. One command runs it: scripts/gpu_engine.sh.
- CPU tests of the GPU benchmark's pieces: the batched oracle's rule, the byte and flop
  counts against the weights the config has, and the report's verdicts and plot.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

import engine_bench
import engine_report
from bench_record import record as record_figures
from engine.decode import DecodeResult, ar_decode, ddtree_decode
from engine.drafters import LayerSkipDrafter, OracleDrafter
from engine.model import Transformer
from engine.weights import weight_shapes
from engine_bench import BatchedOracle, Bench, Plan, forward_cost
from kdtr_format import CONFIGS, PRESETS, DDTreeConfig

BIG = os.environ.get("KDTREE_BENCH") == "1"


def run_side_by_side(model, drafter_for, prompts, ddtree: DDTreeConfig, tokens: int, stages=None
                     ) -> tuple[DecodeResult, DecodeResult]:
    ar = ar_decode(model, prompts, tokens, stages=stages)
    dd = ddtree_decode(model, drafter_for(ar), prompts, ddtree, tokens, stages=stages)
    return ar, dd


def record(benchmark, ar: DecodeResult, dd: DecodeResult, **extra) -> None:
    speedup = dd.metrics.tokens_per_second / ar.metrics.tokens_per_second
    tau = dd.metrics.mean_acceptance
    record_figures(benchmark, dict(
        ar_tokens_per_s=ar.metrics.tokens_per_second, ddtree_tokens_per_s=dd.metrics.tokens_per_second,
        speedup=speedup, tau=tau, speedup_over_tau=speedup / tau,
        ar_target_forwards=ar.metrics.target_forwards, ddtree_target_forwards=dd.metrics.target_forwards,
        tokens_match=sum(a == b for a, b in zip(ar.tokens, dd.tokens)) / len(ar.tokens),
        ddtree_stage_ms={k: v * 1e3 for k, v in dd.metrics.stage_seconds.items()},
        ar_stage_ms={k: v * 1e3 for k, v in ar.metrics.stage_seconds.items()}, **extra), "cpu")


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
    record(benchmark, ar, dd, preset="tiny", drafter=drafter, batch=1, tokens=tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="GPU engine benchmark: no CUDA GPU is visible (torch.cuda.is_available() is False)")
def test_bench_gpu_k2_mid(benchmark):
    """The whole plan (engine_bench.Plan) in one call; nothing is asserted about speed."""
    plan = Plan(tokens=256) if BIG else Plan()
    bench = Bench(CONFIGS["k2-mid"], plan, os.environ.get("KDTREE_BENCH_OUT"))
    doc = benchmark.pedantic(bench.run, rounds=1, iterations=1)
    record_figures(benchmark, {"timing_s": doc["timing_s"], "ceilings": doc["ceilings"], "sweep": doc["sweep"],
                               "steps": doc["steps"], "ar": doc["ar"],
                               "verdicts": [v[0] + ": " + v[1] for v in engine_report.verdicts(doc)]}, "cuda")
    assert doc["sweep"], doc["notes"]


# ---- the GPU benchmark's pieces, on the CPU ----

def test_batched_oracle_follows_the_oracle_rule():
    """accuracy 1: the true token is top-1 at every known depth with the calibrated probability
    (0.999), noise past the known sequence; accuracy 0: never top-1; the rule is the batch's, one
    draw for all."""
    vocab, depth = 50, 6
    truth = [list(range(10, 30)), list(range(5, 17))]
    contexts = [torch.tensor(t[:8]) for t in truth]
    sure = BatchedOracle(truth, vocab, 1.0, seed=0).draft(contexts, torch.tensor([t[8] for t in truth]), depth)
    assert sure.shape == (2, depth, vocab)
    for b, t in enumerate(truth):
        for d in range(depth):
            at = 8 + 1 + d
            if at < len(t):
                p = sure[b, d].double().softmax(-1)
                assert int(p.argmax()) == t[at] and 0.999 - 1e-6 <= float(p[t[at]]) < 0.9995
    assert len(truth[1]) < 8 + 1 + depth                      # request 1 runs past its known tokens
    never = BatchedOracle(truth, vocab, 0.0, seed=0).draft(contexts, torch.tensor([0, 0]), depth)
    assert all(int(never[0, d].argmax()) != truth[0][9 + d] for d in range(depth))


@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
def test_forward_cost_counts_every_weight_once(preset):
    """With every expert touched, the weight bytes are the config's weights (engine.weights'
    shapes) less the embedding table (only its rows are read); KV and logits on top."""
    cfg = PRESETS[preset]
    shapes = weight_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes.values())
    router = sum(int(np.prod(s)) for n, s in shapes.items() if n.endswith(("moe.gate", "e_score_correction_bias")))
    element = 2
    expected = element * (total - router - cfg.vocab_size * cfg.hidden_size) + 4 * router
    all_experts = [cfg.n_routed_experts] * cfg.num_hidden_layers
    cost = forward_cost(cfg, element, [0], [1], 1, all_experts)
    kv = element * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 2
    assert cost.bytes == expected + kv + element * cfg.hidden_size + 4 * cfg.vocab_size
    none = forward_cost(cfg, element, [0], [1], 1, [0] * cfg.num_hidden_layers)
    moe_layers = sum(not cfg.is_dense_layer(i) for i in range(cfg.num_hidden_layers))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cost.bytes - none.bytes == element * moe_layers * cfg.n_routed_experts * expert
    longer = forward_cost(cfg, element, [100], [1], 1, all_experts)      # 100 more keys to read and score
    heads, width = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert longer.bytes - cost.bytes == element * width * cfg.num_hidden_layers * 100
    assert longer.flops - cost.flops == cfg.num_hidden_layers * 100 * heads * (2 * width + 2 * cfg.kv_lora_rank)


def sample_doc() -> dict:
    step = dict(dtype="bfloat16", mode="default", batch=1, rows=1, context=[100], bytes=1e9, flops=1e9,
                bound="bytes", touched_experts=[0, 4, 4])
    point = dict(dtype="bfloat16", mode="default", batch=1, budget=64, accuracy=0.9, rounds=10, tau=5.0,
                 speedup=3.0, speedup_without_draft=4.5, verify_ms_per_round=1.0, other_ms_per_round=0.05,
                 draft_ms_per_round=0.2, other_over_verify=0.05, tokens_match=1.0, margins_match=1.0,
                 ddtree_tokens_per_s=900.0, verify_over_ar_step=1.1)
    return {"config": "k2-mid", "date": "2026-12-01", "commit": "abc", "torch": "2.11",
            "ceilings": {"gpu": "H200", "copy_TBps": 4.3, "bf16_TFLOPs": 790.0, "fp32_TFLOPs": 50.0},
            "backends": {}, "plan": {}, "timing_s": {"total": 300.0}, "notes": [], "skipped": [],
            "steps": [{**step, "kind": "ar", "ms": 0.6, "floor_ms": 0.5, "x_floor": 1.2,
                       "profile": {"kernels": 250, "per_layer": 25.0, "kernel_ms": 0.4,
                                   "top": [["fused_moe_kernel", 24, 0.2]]}},
                      {**step, "kind": "verify", "budget": 64, "rows": 65, "ms": 1.0, "floor_ms": 0.5,
                       "x_floor": 2.0}],
            "ar": [dict(dtype="bfloat16", mode="default", batch=1, tokens_per_s=1600.0, ms_per_step=0.6)],
            "sweep": [point, {**point, "accuracy": 0.5, "tau": 2.0, "speedup": 1.2, "speedup_without_draft": 1.5,
                              "other_over_verify": 0.2},
                      {**point, "dtype": "float32", "tokens_match": 0.5},
                      {**point, "model": "peaked", "batch": 8, "speedup_without_draft": 3.0}]}


def test_report_states_every_target(tmp_path):
    doc = sample_doc()
    found = {name: (measured, met) for name, measured, _, met in engine_report.verdicts(doc)}
    assert found["AR decode step (bfloat16, batch 1)"][1] is True                 # 1.2x <= 1.5x
    assert found["kernels per layer, AR step (bfloat16, batch 1)"] == ("25.0 (250 launches a step)", False)
    assert found["tree verify step (bfloat16, batch 1, budget 64)"][1] is False    # 2.0x
    other = found["round work but draft and verify, worst point (default mode)"]
    assert other[1] is False and other[0].startswith("20.0%")
    speedup = found["speedup / tau, budget 64, batch 1, bf16, default mode, random model, without the draft"]
    assert speedup == ("0.75 at worst (tau 2.00; taus 5.0, 2.0)", False)          # 1.5 / 2.0 < 0.8
    assert found["speedup / tau, budget 64, batch 1, bf16, default mode, random model, all in"][1] is False
    peaked = found["speedup / tau, budget 64, batch 8, bf16, default mode, peaked model, without the draft"]
    assert peaked == ("0.60 at worst (tau 5.00; taus 5.0)", True)                 # 3.0 / 5.0 >= 0.5
    assert found["tokens identical to AR, float32 default"][1] is False
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    assert engine_report.main([str(path), str(tmp_path / "engine")]) == 0
    text = (tmp_path / "engine.md").read_text()
    assert "| tree verify step (bfloat16, batch 1, budget 64) | 2.00x floor" in text and "| not met |" in text
    assert "| `fused_moe_kernel` | 24 | 0.200 |" in text and "| 250 | 25.0 | 0.400 |" in text
    assert (tmp_path / "engine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert engine_report.main([str(tmp_path / "missing.json"), str(tmp_path / "x")]) == 1


def test_peaked_model_leads_with_a_trained_like_margin():
    """The peaked benchmark model's greedy successor leads by logits, the random model's by a
    fraction of one (engine_bench.peaked_weights); bf16 keeps the peaked model's argmax."""
    from engine.validate import random_weights

    cfg = dataclasses.replace(PRESETS["kimi-k2"], num_hidden_layers=4)
    tokens = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    args = (tokens, torch.arange(24)[None], torch.ones(24, 24, dtype=torch.bool).tril()[None],
            torch.tensor([24]), torch.tensor([0]))

    def logits(weights, dtype=torch.float32):
        model = Transformer(cfg, weights, dtype=dtype)
        return model(*args, model.new_cache(1, 32))[0]

    def median_margin(x):
        top = x.topk(2, dim=-1).values
        return float((top[:, 0] - top[:, 1]).median())
    peaked = engine_bench.peaked_weights(cfg)
    exact = logits(peaked)
    assert median_margin(exact) > 3.0 > median_margin(logits(random_weights(cfg)))
    assert torch.equal(logits(peaked, torch.bfloat16).argmax(-1), exact.argmax(-1))
