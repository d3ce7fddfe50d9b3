"""End-to-end engine benchmarks: AR against DDTree in the same run (docs/status.md's targets).

Each benchmark times one call that decodes the same prompts with AR and then
with DDTree, and records side by side (benchmark.extra_info): tokens per
second of each, the speedup, tau (tokens per round), target forwards, the
time per stage, and speedup / tau (on the GPU the target is >= 0.9 of its bound, the
AR step's floor over the verify step's). Nothing is asserted about speed.

- CPU: the `tiny` preset, oracle and layerskip drafters. Default sizes are
  small; `KDTREE_BENCH=1` decodes longer.
- GPU: the `k2-mid` config (kdtr_format.CONFIGS) with random bf16 and float32 weights made
  on the device, default and invariant mode, through CUDA graphs (engine.graphs), the CUDA
  stages and attention kernel: AR and tree-verify steps against their floors, and an oracle
  accuracy sweep (tau about 2 to 10) at budgets 64, 16, 256, block 16, batch 1 and 8
  (tests/engine_bench.py; the JSON goes to $KDTREE_BENCH_OUT, tests/engine_report.py writes
  the table and the plot). Skipped without CUDA. One command runs it: scripts/gpu_engine.sh.
- CPU tests of the GPU benchmark's pieces: the batched oracle's rule, the byte and flop
  counts against the weights the config has, the plan's grid, and the report's verdicts
  (invariant against default mode, floors, speedup / tau against its bound), tables and plot,
  on hand-made documents and on the committed H200 run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

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
QUICK = os.environ.get("KDTREE_BENCH") == "quick"     # the GPU plan with three accuracies, one at the side budgets


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
    plan = Plan(tokens=256) if BIG else Plan(accuracies=(0.4, 0.82, 0.97), side_accuracies=(0.97,)) if QUICK else Plan()
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
    """A hand-made run: bf16 batch 1 steps in both modes (AR floor 0.55 ms; verify floor 1.0 ms,
    bound 0.55, in the default mode, 1.1 ms, bound 0.5, in invariant mode), a float32 AR step of
    the default mode only, nothing at batch 8; a sweep of the random and the peaked model."""
    step = dict(model="random", dtype="bfloat16", batch=1, rows=1, context=[100], bytes=1e9, flops=1e9,
                bound="bytes", touched_experts=[0, 4, 4])
    ar = {**step, "kind": "ar", "floor_ms": 0.55}
    verify = {**step, "kind": "verify", "budget": 64, "rows": 65, "floor_ms": 1.0}
    point = dict(model="random", dtype="bfloat16", mode="default", batch=1, budget=64, accuracy=0.9, rounds=10,
                 tau=5.0, speedup=3.0, speedup_without_draft=4.5, verify_ms_per_round=1.0, other_ms_per_round=0.05,
                 draft_ms_per_round=0.2, other_over_verify=0.05, tokens_match=1.0, margins_match=1.0,
                 ddtree_tokens_per_s=900.0, verify_over_ar_step=1.1)
    peaked = {**point, "model": "peaked"}
    return {"config": "k2-mid", "date": "2026-12-01", "commit": "abc", "torch": "2.11",
            "ceilings": {"gpu": "H200", "copy_TBps": 4.3, "bf16_TFLOPs": 790.0, "fp32_TFLOPs": 50.0},
            "backends": {}, "plan": {}, "timing_s": {"total": 300.0}, "notes": [], "skipped": [],
            "steps": [{**ar, "mode": "default", "ms": 0.66, "x_floor": 1.2,
                       "profile": {"kernels": 250, "per_layer": 25.0, "kernel_ms": 0.4,
                                   "top": [["fused_moe_kernel", 24, 0.2]]}},
                      {**verify, "mode": "default", "ms": 2.0, "x_floor": 2.0, "build_ms": 0.1, "accept_ms": 0.2},
                      {**ar, "mode": "invariant", "ms": 0.825, "x_floor": 1.5,
                       "profile": {"kernels": 400, "per_layer": 40.0, "kernel_ms": 0.7,
                                   "top": [["invariant_matmul", 48, 0.5]]}},
                      {**verify, "mode": "invariant", "floor_ms": 1.1, "ms": 2.8, "x_floor": 2.8 / 1.1},
                      {**ar, "dtype": "float32", "mode": "default", "floor_ms": 0.8, "ms": 1.0, "x_floor": 1.25}],
            "ar": [dict(dtype="bfloat16", mode="default", batch=1, tokens_per_s=1600.0, ms_per_step=0.6)],
            "sweep": [point, {**point, "accuracy": 0.5, "tau": 2.0, "speedup": 1.2, "speedup_without_draft": 1.5,
                              "other_over_verify": 0.2},
                      {**point, "dtype": "float32", "tokens_match": 0.5},
                      {**peaked, "tau": 2.0, "speedup": 0.8, "speedup_without_draft": 0.9},
                      {**peaked, "tau": 5.0, "speedup": 2.0, "speedup_without_draft": 2.5},
                      {**peaked, "mode": "invariant", "tau": 4.0, "speedup": 2.0, "speedup_without_draft": 2.2,
                       "other_over_verify": 0.08},
                      {**peaked, "batch": 8, "tau": 4.0, "speedup": 1.6, "speedup_without_draft": 2.0, "bound": 0.5},
                      {**peaked, "batch": 8, "mode": "invariant",
                       "other_ms_by_stage": {"build": 0.01, "compile": 0.0, "accept": 0.015, "compact": 0.0,
                                             "host": 0.025}}]}


def bound_target(batch: int, mode: str, dtype: str = "bfloat16") -> str:
    return (f"speedup / tau over its bound, budget 64, batch {batch}, {dtype}, {mode} mode, peaked model, "
            f"without the draft")


def test_plan_measures_the_targets_grid():
    """Both modes and dtypes at batch 1 and 8, budget 64 first; the peaked model in both modes,
    right after the first run (what a time budget cuts is the float32 end)."""
    plan = Plan()
    assert {1, 8} <= set(plan.batches) and plan.budgets[0] == 64 and plan.peaked_budgets == (64,)
    assert plan.runs() == [("random", "bfloat16", "default"), ("peaked", "bfloat16", "default"),
                           ("peaked", "bfloat16", "invariant"), ("random", "bfloat16", "invariant"),
                           ("random", "float32", "default"), ("random", "float32", "invariant")]
    assert Plan(peaked_budgets=()).runs() == [r for r in plan.runs() if r[0] == "random"]


def test_report_states_every_target():
    found = {name: (measured, met) for name, measured, _, met in engine_report.verdicts(sample_doc())}
    # invariant mode against the default mode's same step: 0.825 / 0.66 = 1.25 <= 1.3; 2.8 / 2.0 = 1.4
    assert found["AR step, invariant / default mode (bfloat16, batch 1)"] == ("1.25x (0.825 ms vs 0.660 ms)", True)
    assert found["verify step, invariant / default mode (bfloat16, batch 1, budget 64)"] == \
        ("1.40x (2.800 ms vs 2.000 ms)", False)
    assert found["AR step, invariant / default mode (float32, batch 1)"] == ("not measured", None)
    # the default mode against the floors, both dtypes and batches
    assert found["AR step / floor, default mode (bfloat16, batch 1)"][1] is True                 # 1.2x
    assert found["verify step / floor, default mode (bfloat16, batch 1, budget 64)"][1] is False  # 2.0x
    assert found["AR step / floor, default mode (float32, batch 1)"] == \
        ("1.25x floor (1.000 ms vs 0.800 ms, bytes-bound)", True)
    for dtype in ("bfloat16", "float32"):
        assert found[f"AR step / floor, default mode ({dtype}, batch 8)"] == ("not measured", None)
        assert found[f"verify step, invariant / default mode ({dtype}, batch 8, budget 64)"] == ("not measured", None)
    assert found["kernels per layer, AR step (bfloat16, batch 1)"] == ("25.0 (250 launches a step)", False)
    # round work but draft and verify, per mode: 20% (default), 8% (invariant)
    other = found["round work but draft and verify, worst point (default mode)"]
    assert other[1] is False and other[0].startswith("20.0%")
    other = found["round work but draft and verify, worst point (invariant mode)"]
    assert other[1] is True and other[0].startswith("8.0%")
    # speedup / tau over the bound 0.55 / 1.0: tau 2: 0.9 / 2 = 0.45 -> 0.818 < 0.9 (all in 0.4 / 0.55)
    assert found[bound_target(1, "default")] == ("0.82 at worst: speedup / tau 0.45 against the bound 0.55 (tau 2.00; "
                                                 "all in 0.73 of the bound; taus 2.0, 5.0)", False)
    assert found[bound_target(1, "invariant")][0].startswith("1.10 at worst")  # its own bound: 2.2 / 4 / 0.5
    assert found[bound_target(8, "default")][0].startswith("1.00 at worst")    # the recorded bound 0.5: 2.0 / 4 / 0.5
    assert found[bound_target(8, "invariant")] == ("not measured (no AR and verify steps for the bound)", None)
    assert bound_target(1, "default", "float32") not in found                  # no peaked float32 point
    assert found["tokens identical to AR, float32 default"][1] is False


def test_add_bounds_records_the_floor_ratio():
    doc = sample_doc()
    engine_report.add_bounds(doc)
    tau_2 = doc["sweep"][3]                                     # peaked, bf16 default, batch 1, tau 2
    assert tau_2["bound"] == pytest.approx(0.55) and tau_2["speedup_over_tau_over_bound"] == pytest.approx(0.45 / 0.55)
    assert doc["sweep"][6]["bound"] == 0.5                      # recorded: kept
    assert "bound" not in doc["sweep"][7]                       # batch 8: no steps


def test_report_markdown_and_plot(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(sample_doc()))
    assert engine_report.main([str(path), str(tmp_path / "engine")]) == 0
    text = (tmp_path / "engine.md").read_text()
    assert "| verify step / floor, default mode (bfloat16, batch 1, budget 64) | 2.00x floor" in text
    assert "| AR step, invariant / default mode (float32, batch 1) | not measured | <= 1.3x | not measured |" in text
    assert "| bfloat16 | AR decode | 1 | 1 | 0.550 | bytes | 0.660 | 0.825 | 1.25 | 1.20 | 1.50 | 25.0 / 40.0 | " \
           "4.0 | n/a | n/a |" in text
    assert "| bfloat16 | verify (budget 64) | 1 | 65 | 1.000 | bytes | 2.000 | 2.800 | 1.40 | 2.00 | 2.55 | " \
           "n/a / n/a | 4.0 | 0.100 | 0.200 |" in text
    assert "| float32 | AR decode | 1 | 1 | 0.800 | bytes | 1.000 | n/a | n/a | 1.25 | n/a | n/a / n/a |" in text
    assert "| float32 | AR decode | 8 |" + " not measured |" * 12 in text
    assert "| peaked | bfloat16 | default | 1 | 64 | 0.9 | 2.00 | 0.80 | 0.90 | 0.45 | 0.55 | 0.82 | " in text
    assert "| peaked | bfloat16 | invariant | 8 | 64 | 0.9 | 5.00 | 3.00 | 4.50 | 0.90 | n/a | n/a | 1.000 | " \
           "0.050 | 0.010 / 0.015 / 0.025 | 5.0% |" in text
    assert "| peaked | bfloat16 | default | 1 | 64 | 0.9 | 5.00 | 2.00 | 2.50 | 0.50 | 0.55 | 0.91 | 1.000 | " \
           "0.050 | n/a | 5.0% |" in text                                  # a run before the split
    assert "| `fused_moe_kernel` | 24 | 0.200 |" in text and "| `invariant_matmul` | 48 | 0.500 |" in text
    assert (tmp_path / "engine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert engine_report.main([str(tmp_path / "missing.json"), str(tmp_path / "x")]) == 1


def test_report_renders_the_old_h200_run():
    """docs/results/engine-gpu-h200.json (2026-12-02): both modes' steps were measured, the
    peaked model in the default mode only; the bound comes from the steps' floors."""
    doc = json.loads((Path(__file__).parents[2] / "docs/results/engine-gpu-h200.json").read_text())
    found = {name: (measured, met) for name, measured, _, met in engine_report.verdicts(doc)}
    assert found[bound_target(1, "invariant")] == ("not measured", None)
    assert found[bound_target(8, "invariant")] == ("not measured", None)
    # 0.493 ms / 0.893 ms (bf16 batch 1 floors) = 0.55
    assert "against the bound 0.55" in found[bound_target(1, "default")][0]
    assert found["verify step, invariant / default mode (float32, batch 1, budget 64)"] == \
        ("0.83x (24.555 ms vs 29.516 ms)", True)
    text = engine_report.markdown(doc)
    assert f"| {bound_target(1, 'invariant')} | not measured | >= 0.9 | not measured |" in text
    assert "Not measured: targets this run did not measure" in text


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
