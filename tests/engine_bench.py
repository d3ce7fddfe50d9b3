"""The GPU engine benchmark's pieces (tests/engine/test_bench_engine.py runs them; docs/status.md's targets).

- `BatchedOracle`: the oracle drafter's rule (engine.drafters.OracleDrafter: the true token top-1
  with probability `accuracy`, at `hit_logit`, calibrated here so that its probability is the
  accuracy and the tree goes as deep as the hit rate deserves; else at rank 1 to 3 or at the
  bottom), drawn for the whole batch at once from one generator, so that drafting costs a few
  kernels a round instead of a dozen per request. It is an upper-bound stand-in for a drafter;
  its cost is reported, and excluded where a figure says "without the draft".
- `forward_cost`: the bytes and flops a forward must move and do, counted from the config:
  every weight it needs read once (the routed experts that its tokens chose, counted from a
  captured run, not all of them), the KV of every request read once and the new KV written,
  the logits written; 2 flops per weight per token, and attention's 2 (R + dr) + 2 R per key
  per head per token. The floor is the larger of bytes / copy bandwidth and flops / the
  dtype's matrix rate, with both ceilings measured in the same run (`ceilings`).
- `peaked_weights`: a benchmark model whose logit margins look like a trained model's. On the
  random model the top-1 margin is a fraction of a logit, below the bf16 rounding spread (which
  moves logits by up to ~4 there between row counts), so default-mode bf16 verify rejects every
  draft (tau 1) whatever the drafter; here each token's embedding dominates the residual stream
  and the lm_head row of one successor token (a fixed permutation) is that embedding's
  direction, so the greedy successor leads by several logits (median 7.7 on k2-mid, measured
  and reported as `margins`) over logits of std ~1.
- `forward_profile`: torch's profiler on one eager forward: the launches per step and per
  layer, their device time and the top kernels.
- `replay_ms`: the median device time of a CUDA graph's replays (CUDA events around each).
- `Bench`: the whole plan within a time budget, every figure into one JSON document: AR and
  verify steps against their floors in both modes, both dtypes, batch 1 and 8, and the DDTree
  sweep, each point with its bound (engine_report.add_bounds: AR step floor / verify step floor,
  the speedup / tau the model allows); tests/engine_report.py writes the table and the plot.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from engine.drafters import hit_logit
from engine_report import add_bounds
from kdtr_format import DDTreeConfig, ModelConfig

MATMUL = 8192                 # the ceilings' matrix products are MATMUL^3


class BatchedOracle:
    """OracleDrafter's rule for a whole batch per draw (module docstring).

    sequences[b]: request b's true token sequence (its prompt, then the AR output)."""

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int, accuracy: float, seed: int = 0,
                 confidence: float | None = None, device: str | torch.device = "cpu") -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"oracle accuracy must lie in [0, 1], got {accuracy}")
        self.device = torch.device(device)
        self.lengths = torch.tensor([len(s) for s in sequences], device=self.device)
        width = max(len(s) for s in sequences)
        self.truth = torch.zeros(len(sequences), width, dtype=torch.int64, device=self.device)
        for b, s in enumerate(sequences):
            self.truth[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.int64)
        self.vocab_size, self.accuracy, self.confidence = vocab_size, accuracy, confidence
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def draft(self, contexts: Sequence[torch.Tensor], roots: torch.Tensor, depth: int) -> torch.Tensor:
        """-> draft_logits [B, depth, V] float32."""
        batch, g = len(contexts), self.generator
        logits = torch.randn(batch, depth, self.vocab_size, generator=g, device=self.device)
        decide = torch.rand(batch, depth, 2, generator=g, device=self.device)         # hit?, where if missed
        at = torch.tensor([len(c) for c in contexts], device=self.device)[:, None] + 1 + \
            torch.arange(depth, device=self.device)                                     # [B, L] truth index
        known = at < self.lengths[:, None]
        truth = self.truth.gather(1, at.clamp(max=self.truth.shape[1] - 1))             # [B, L]
        top = logits.topk(min(4, self.vocab_size), dim=-1).values                       # [B, L, 4]
        last = top.shape[-1] - 1
        rank = (1 + (decide[..., 1] * 2 * last).long()).clamp(max=last)
        between = (top.gather(-1, (rank - 1)[..., None]) + top.gather(-1, rank[..., None]))[..., 0] / 2
        missed = torch.where(decide[..., 1] < 0.5, between, logits.amin(-1) - 1.0)
        value = torch.where(decide[..., 0] < self.accuracy, hit_logit(logits, self.accuracy, self.confidence), missed)
        value = torch.where(known, value, logits.gather(-1, truth[..., None])[..., 0])
        return logits.scatter_(-1, truth[..., None], value[..., None])


@dataclass
class Cost:
    bytes: float
    flops: float

    def floor_ms(self, copy_TBps: float, matrix_TFLOPs: float) -> float:
        return max(self.bytes / (copy_TBps * 1e9), self.flops / (matrix_TFLOPs * 1e9))

    def bound(self, copy_TBps: float, matrix_TFLOPs: float) -> str:
        return "bytes" if self.bytes / copy_TBps >= self.flops / matrix_TFLOPs else "flops"


def layer_params(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """-> (attention matrices' params per layer, one routed expert's, the shared experts', the dense MLP's)."""
    d, h, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = h * cfg.qk_head_dim * d if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + 1 + h * cfg.qk_head_dim)
    attention = q + (r + dr) * d + r + h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * r + d * h * cfg.v_head_dim
    expert = 3 * d * cfg.moe_intermediate_size
    return attention, expert, cfg.n_shared_experts * expert, 3 * d * cfg.intermediate_size


def forward_cost(cfg: ModelConfig, element: int, contexts: Sequence[int], new: Sequence[int],
                 new_pairs: int, touched: Sequence[int]) -> Cost:
    """A forward of requests with contexts[b] cached and new[b] new tokens, new_pairs (new token,
    new key) pairs visible; touched[l]: routed experts its tokens chose in layer l (dense layers:
    ignored); element: bytes per weight and KV value."""
    attention, expert, shared, dense = layer_params(cfg)
    d, e = cfg.hidden_size, cfg.n_routed_experts
    tokens, kv_width = sum(new), cfg.kv_lora_rank + cfg.qk_rope_head_dim
    keys = sum(n * c for c, n in zip(contexts, new)) + new_pairs      # (token, visible key) pairs
    weights = flops = 0.0
    for layer in range(cfg.num_hidden_layers):
        weights += element * (attention + 2 * d)
        flops += 2 * tokens * attention + keys * cfg.num_attention_heads * (2 * kv_width + 2 * cfg.kv_lora_rank)
        if cfg.is_dense_layer(layer):
            weights += element * dense
            flops += 2 * tokens * dense
        else:
            weights += 4 * (e * d + e) + element * (touched[layer] * expert + shared)   # the router is float32
            flops += 2 * tokens * (e * d + cfg.num_experts_per_tok * expert + shared)
    weights += element * (cfg.vocab_size * d + d)                                          # lm_head, final norm
    flops += 2 * tokens * cfg.vocab_size * d
    kv = element * kv_width * cfg.num_hidden_layers * (sum(contexts) + 2 * tokens)         # read all, write new
    activations = tokens * (element * d + 4 * cfg.vocab_size)                               # embeddings in, logits out
    return Cost(bytes=weights + kv + activations, flops=flops)


def touched_experts(model, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                    n_new: torch.Tensor, starts: torch.Tensor, cache) -> list[int]:
    """Distinct routed experts per layer that the real rows of this forward choose (an eager
    forward with the capture hook, on a copy of the cache)."""
    real = torch.arange(tokens.shape[1], device=tokens.device)[None] < n_new[:, None]
    chosen: dict[int, torch.Tensor] = {}

    def keep(name: str, layer: int, t: torch.Tensor) -> None:
        if name == "experts":
            chosen[layer] = t[real].unique()
    copy = cache_copy(cache)
    model.capture = keep
    try:
        model.forward(tokens, positions, visibility, n_new, starts, copy, check=False)
    finally:
        model.capture = None
    return [int(chosen[layer].numel()) if layer in chosen else 0 for layer in range(model.cfg.num_hidden_layers)]


def peaked_weights(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """random_weights with trained-like logit margins (module docstring): embeddings of unit RMS,
    lm_head[successor[v]] = embed[v] / |embed[v]| for a seeded permutation `successor`."""
    from engine.validate import random_weights

    weights = random_weights(cfg, seed=seed, device=device, dtype=torch.float32)
    embed = weights["embed_tokens"]                                                  # [V, D]
    successor = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed)).to(embed.device)
    lm_head = torch.empty_like(weights["lm_head"])
    lm_head[successor] = embed / embed.norm(dim=1, keepdim=True)
    weights["embed_tokens"] = embed / embed.pow(2).mean().sqrt()
    weights["lm_head"] = lm_head
    return {name: value.to(dtype) for name, value in weights.items()}


def margin_summary(result) -> dict:
    """The top-1 / top-2 logit margins of a decode's tokens: median and 10th percentile."""
    margins = np.array([m for r in result.requests for m in r.margins], dtype=np.float64)
    return {"median": float(np.median(margins)), "p10": float(np.quantile(margins, 0.1)), "tokens": len(margins)}


def cache_copy(cache):
    """A contiguous cache with the same contents (what a measuring forward may write into)."""
    return type(cache)(cache.c_kv.clone(), cache.k_pe.clone(), cache.lengths.clone())


def forward_profile(model, tokens: torch.Tensor, positions: torch.Tensor, visibility: torch.Tensor,
                    n_new: torch.Tensor, starts: torch.Tensor, cache, top: int = 12) -> dict:
    """The device activity of one eager forward (the kernels its CUDA graph replays: kernels,
    memsets and copies), from torch's profiler, on a copy of the cache -> {"kernels": launches,
    "per_layer": launches / layers, "kernel_ms": their summed device time, "top": [[name,
    launches, ms], ...] by device time}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    copy = cache_copy(cache)

    def run() -> None:
        model.forward(tokens, positions, visibility, n_new, starts, copy, check=False)
        torch.cuda.synchronize()
    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = totals.setdefault(event.name, [event.name, 0, 0.0])
            entry[1] += 1
            entry[2] += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0) or 0.0
    launches = sum(e[1] for e in totals.values())
    ranked = sorted(totals.values(), key=lambda e: -e[2])
    return {"kernels": launches, "per_layer": launches / model.cfg.num_hidden_layers,
            "kernel_ms": sum(e[2] for e in ranked) / 1e3,
            "top": [[name[:90], count, us / 1e3] for name, count, us in ranked[:top]]}


def cuda_ms(fn: Callable[[], object], reps: int = 10, before: Callable[[], object] | None = None) -> float:
    """Median device time of fn() over `reps` calls after one warm-up, CUDA events around each
    call only (`before()` runs first each time, outside the timed span)."""
    fn()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        if before is not None:
            before()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 10, before: Callable[[], object] | None = None) -> float:
    return cuda_ms(graph.replay, reps, before)


def ceilings() -> dict:
    """Copy bandwidth (TB/s, bytes read + written) and the bf16 and float32 matrix rates (TFLOP/s)
    on random data, measured now."""
    src = torch.randn(2**28, device="cuda")                                               # 1 GiB
    dst = torch.empty_like(src)
    copy = 2 * 2**30 / cuda_ms(lambda: dst.copy_(src)) / 1e9
    rates = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = (torch.randn(MATMUL, MATMUL, device="cuda", dtype=dtype) for _ in range(2))
        rates[name] = 2 * MATMUL**3 / cuda_ms(lambda: a @ b, reps=5) / 1e9
    return {"gpu": torch.cuda.get_device_name(), "copy_TBps": copy, "bf16_TFLOPs": rates["bf16"],
            "fp32_TFLOPs": rates["fp32"]}


# ---- the sweep ----

@dataclass
class Plan:
    """What run_bench measures (the defaults fit about 6 minutes of an H200)."""

    tokens: int = 96                                   # committed tokens per request
    block_size: int = 16
    batches: tuple[int, ...] = (1, 8)
    budgets: tuple[int, ...] = (64, 16, 256)           # the first is the target's
    accuracies: tuple[float, ...] = (0.4, 0.65, 0.82, 0.92, 0.97)
    side_accuracies: tuple[float, ...] = (0.4, 0.82, 0.97)   # at the other budgets
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    modes: tuple[str, ...] = ("default", "invariant")
    peaked_budgets: tuple[int, ...] = (64,)            # the peaked model: bf16, in these modes
    peaked_modes: tuple[str, ...] = ("default", "invariant")
    seconds: float = 300.0                             # work not begun by then is recorded as skipped
    invariant_forward: str = "fused"                   # invariant mode's forward: the fused layers' invariant
                                                       # form (engine/fused/linear.py), or "tiled"

    def runs(self) -> list[tuple[str, str, str]]:
        """(model, dtype, mode) in the order measured: the random model in every dtype and mode,
        the peaked model's bf16 runs (the DDTree target's) second, early in the time budget."""
        runs = [("random", d, m) for d in self.dtypes for m in self.modes]
        if self.peaked_budgets:
            runs[1:1] = [("peaked", "bfloat16", m) for m in self.peaked_modes]
        return runs


def decode_seconds(metrics, without: Sequence[str] = ()) -> float:
    """Wall seconds of a decode's rounds: every stage but prefill (and `without`)."""
    return sum(v for k, v in metrics.stage_seconds.items() if k != "prefill" and k not in without)


class Bench:
    """Runs the plan on one GPU and collects the JSON document (module docstring)."""

    def __init__(self, cfg: ModelConfig, plan: Plan, out: str | None, log: Callable[[str], None] = print,
                 device: str = "cuda") -> None:
        self.cfg, self.plan, self.out, self.log = cfg, plan, out, log
        self.device = torch.device(device)
        self.began = time.perf_counter()
        self.doc: dict = {"config": "k2-mid", "date": datetime.date.today().isoformat(),
                          "commit": os.environ.get("KDTREE_COMMIT", "unknown"), "torch": torch.__version__,
                          "plan": plan.__dict__, "timing_s": {}, "notes": [], "steps": [], "ar": [], "sweep": [],
                          "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def save(self) -> None:
        """Bound every sweep point whose steps are measured, and rewrite the JSON (after every
        point: a run cut short keeps what it measured)."""
        add_bounds(self.doc)
        self.doc["timing_s"]["total"] = self.elapsed()
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.doc, f, indent=1)

    def part(self, name: str, fn: Callable[[], object]) -> object:
        began = time.perf_counter()
        try:
            return fn()
        finally:
            self.doc["timing_s"][name] = self.doc["timing_s"].get(name, 0.0) + time.perf_counter() - began
            self.save()

    def run(self) -> dict:
        from engine.adapter import cuda_backends
        from engine.validate import random_weights

        self.doc["ceilings"] = ceilings_ = self.part("ceilings", ceilings)
        stages, attention, backends = cuda_backends()
        self.doc["backends"] = backends
        if stages is None or attention is None:
            self.doc["notes"].append(f"kernels_cuda did not load: {backends}; nothing measured")
            self.save()
            return self.doc
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, self.cfg.vocab_size, (64 + 16 * b,), generator=generator).tolist()
                   for b in range(max(self.plan.batches))]
        weights, made = None, None
        for model_name, dtype_name, mode in self.plan.runs():
            dtype = getattr(torch, dtype_name)
            if made != (model_name, dtype_name):
                make = peaked_weights if model_name == "peaked" else random_weights
                weights = None                  # the previous model's weights freed before the next is made
                weights = self.part("weights", lambda: make(self.cfg, seed=0, device=self.device, dtype=dtype))
                made = (model_name, dtype_name)
            try:
                self.measure(weights, dtype_name, mode, attention, stages, prompts, ceilings_, model_name)
            except Exception as exc:            # one broken combination must not cost the others
                self.doc["notes"].append(f"{model_name} {dtype_name} {mode}: stopped by {type(exc).__name__}: "
                                         f"{traceback.format_exc(limit=-3)}")
                self.log(self.doc["notes"][-1])
                torch.cuda.synchronize()
            torch.cuda.empty_cache()                # the mode's graphs and caches are gone
        self.save()
        return self.doc

    def measure(self, weights, dtype_name: str, mode: str, attention, stages, prompts, ceilings_,
                model_name: str) -> None:
        """One (model, dtype, mode): AR decodes, the steps against their floors (the random model
        only: a step's time does not depend on the weights' values) and the DDTree sweep."""
        from engine.decode import ar_decode, ddtree_decode
        from engine.graphs import GraphedModel
        from engine.model import Transformer

        dtype, invariant, plan = getattr(torch, dtype_name), mode == "invariant", self.plan
        model = Transformer(self.cfg, weights, device=self.device, dtype=dtype, attention=attention,
                            invariant=invariant, fused=True if invariant and plan.invariant_forward == "fused" else None)
        self.doc.setdefault("layers", {})[f"{dtype_name} {mode}"] = "fused" if model.fused_forward else "unfused"
        graphed = GraphedModel(model)
        key = dict(model=model_name, dtype=dtype_name, mode=mode)
        peaked = model_name == "peaked"
        element, rate = (2, ceilings_["bf16_TFLOPs"]) if dtype == torch.bfloat16 else (4, ceilings_["fp32_TFLOPs"])
        for batch in plan.batches:
            if self.elapsed() > plan.seconds:
                self.doc["skipped"].append({**key, "batch": batch, "budget": "all", "accuracy": "all"})
                continue
            batch_prompts = prompts[:batch]
            for _ in range(2):                          # the first run captures the graphs (same cache)
                ar = self.part("AR", lambda: ar_decode(graphed, batch_prompts, plan.tokens, stages=stages))
            decoded = ar.metrics.tokens - batch
            ar_s = decode_seconds(ar.metrics)
            self.doc["ar"].append({**key, "batch": batch, "tokens_per_s": decoded / ar_s,
                                   "ms_per_step": 1e3 * ar_s / ar.metrics.rounds, "margins": margin_summary(ar)})
            if not peaked:
                self.part("steps", lambda: self.ar_step(graphed, model, batch, key, element, rate, ceilings_))
            truth = [p + r.tokens for p, r in zip(batch_prompts, ar.requests)]
            for budget in (plan.peaked_budgets if peaked else plan.budgets):
                accuracies = plan.accuracies if budget == plan.budgets[0] else plan.side_accuracies
                for accuracy in accuracies:
                    point = {**key, "batch": batch, "budget": budget, "accuracy": accuracy}
                    if self.elapsed() > plan.seconds:
                        self.doc["skipped"].append(point)
                        continue
                    ddtree = DDTreeConfig(block_size=plan.block_size, budget=budget)

                    def run(tokens: int):
                        drafter = BatchedOracle(truth, self.cfg.vocab_size, accuracy, seed=1, device=self.device)
                        return ddtree_decode(graphed, drafter, batch_prompts, ddtree, tokens, stages=stages)
                    if accuracy == accuracies[0]:
                        self.part("DDTree", lambda: run(plan.tokens))                        # capture the graphs
                        if not peaked:
                            self.part("steps", lambda: self.verify_step(graphed, model, batch, budget, key,
                                                                        element, rate, ceilings_))
                    dd = self.part("DDTree", lambda: run(plan.tokens))
                    self.sweep_point(point, ar, ar_s, dd)

    def sweep_point(self, point: dict, ar, ar_s: float, dd) -> None:
        m = dd.metrics
        dd_s, dd_no_draft = decode_seconds(m), decode_seconds(m, without=("draft",))
        parts = {k: m.stage_seconds.get(k, 0.0) for k in ("build", "compile", "accept", "compact", "host")}
        other = sum(parts.values())
        verify = m.stage_seconds["verify"]
        tau = m.mean_acceptance
        steps = [s for s in self.doc["steps"] if s["kind"] == "ar" and s["dtype"] == point["dtype"]
                 and s["mode"] == point["mode"] and s["batch"] == point["batch"]]        # the random model's
        verify_steps = [s for s in self.doc["steps"] if s["kind"] == "verify" and s["dtype"] == point["dtype"]
                        and s["mode"] == point["mode"] and s["batch"] == point["batch"]
                        and s["budget"] == point["budget"]]
        point.update(tau=tau, rounds=m.rounds, speedup=ar_s / dd_s, speedup_without_draft=ar_s / dd_no_draft,
                     verify_ms_per_round=1e3 * verify / m.rounds, other_ms_per_round=1e3 * other / m.rounds,
                     other_ms_by_stage={k: 1e3 * v / m.rounds for k, v in parts.items()},
                     draft_ms_per_round=1e3 * m.stage_seconds["draft"] / m.rounds, other_over_verify=other / verify,
                     tokens_match=float(np.mean([a == b for a, b in zip(ar.tokens, dd.tokens)])),
                     margins_match=float(np.mean([a.margins == b.margins for a, b in zip(ar.requests, dd.requests)])),
                     ddtree_tokens_per_s=(m.tokens - len(dd.tokens)) / dd_s)
        if steps and verify_steps:
            point["verify_over_ar_step"] = verify_steps[0]["ms"] / steps[0]["ms"]
        self.doc["sweep"].append(point)
        self.log(f"{point['model']} {point['dtype']} {point['mode']} B{point['batch']} budget {point['budget']} acc "
                 f"{point['accuracy']}: tau {tau:.2f} speedup {point['speedup']:.2f} "
                 f"({point['speedup'] / tau:.2f} tau) tokens match {point['tokens_match']:.2f}")

    def ar_step(self, graphed, model, batch: int, key, element, rate, ceilings_) -> None:
        """The AR step graph at the end of the run's context (starts restored before each replay)."""
        step = next(g for k, g in graphed._graphs.items() if k[0] == "ar" and g.cache.batch == batch)
        starts = step.starts.clone()
        step.active.fill_(1)
        ms = replay_ms(step.graph, before=lambda: step.starts.copy_(starts))
        step.starts.copy_(starts)
        ones = torch.ones(batch, 1, 1, dtype=torch.bool, device=self.device)
        touched = touched_experts(model, step.last[:, None], starts[:, None], ones, step.active, starts, step.cache)
        cost = forward_cost(self.cfg, element, starts.tolist(), [1] * batch, batch, touched)
        self.step_row({**key, "kind": "ar", "batch": batch, "rows": batch}, ms, cost, touched, rate, ceilings_,
                      context=starts.tolist())
        self.doc["steps"][-1]["profile"] = forward_profile(model, step.last[:, None], starts[:, None], ones,
                                                           step.active, starts, step.cache)

    def verify_step(self, graphed, model, batch: int, budget: int, key, element, rate, ceilings_) -> None:
        """The verify graph of this (batch, budget), every request active with a full tree."""
        rnd = next(g for k, g in graphed._graphs.items() if k[0] == "ddtree" and k[4] == budget
                   and g.cache.batch == batch)
        rnd.active.fill_(True)
        rnd.budgets.fill_(budget)
        rnd.build.replay()
        _, _, _, positions, visibility, n_new, ids = rnd.built
        ms = replay_ms(rnd.verify)
        real = torch.arange(ids.shape[1], device=self.device)[None] < n_new[:, None]
        pairs = int((visibility & real[:, :, None] & real[:, None, :]).sum())
        touched = touched_experts(model, ids, positions, visibility, n_new, rnd.starts, rnd.cache)
        starts = rnd.starts.tolist()
        cost = forward_cost(self.cfg, element, starts, n_new.tolist(), pairs, touched)
        self.step_row({**key, "kind": "verify", "batch": batch, "budget": budget, "rows": int(n_new.sum())}, ms,
                      cost, touched, rate, ceilings_, context=starts)
        kept = rnd.starts.clone(), rnd.roots.clone()     # the round's state, put back around each accept replay

        def restore() -> None:
            rnd.starts.copy_(kept[0])
            rnd.roots.copy_(kept[1])
        accept_ms = replay_ms(rnd.accept, before=restore)
        restore()
        self.doc["steps"][-1].update(build_ms=replay_ms(rnd.build), accept_ms=accept_ms,
                                     profile=forward_profile(model, ids, positions, visibility, n_new,
                                                             rnd.starts, rnd.cache))

    def step_row(self, row: dict, ms: float, cost: Cost, touched: list[int], rate: float, ceilings_: dict,
                 context: list[int]) -> None:
        floor = cost.floor_ms(ceilings_["copy_TBps"], rate)
        row.update(ms=ms, floor_ms=floor, x_floor=ms / floor, bytes=cost.bytes, flops=cost.flops,
                   bound=cost.bound(ceilings_["copy_TBps"], rate), touched_experts=touched, context=context)
        self.doc["steps"].append(row)
        self.log(f"{row['dtype']} {row['mode']} {row['kind']} B{row['batch']} rows {row['rows']}: {ms:.3f} ms, "
                 f"floor {floor:.3f} ms ({row['bound']}), {ms / floor:.2f}x")
