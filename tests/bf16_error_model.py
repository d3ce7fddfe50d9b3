"""The bf16 error model, measured: the built-in engine in bfloat16 against the float64
reference (refgen) on the same bf16-rounded weights, over seeded weights and prompts.

For every configuration (a preset with its layer count changed, optionally its lm_head
scaled to change the logit scale), seed and prompt, one causal prefill:

- logit error of a row: max over the vocabulary of (|engine - reference| - 2^-8 |reference|)+,
  divided by the logit scale (the reference logits' standard deviation): the error beyond
  the final rounding of the logits to bf16;
- routing-gap error of a (row, MoE layer): how far the engine's gap between the two
  experts at the reference's selection boundary (k-th and (k+1)-th) is from the reference's;
- a row counts (its rounding is measured, not a routing flip's consequence) when no routing
  decision within CLEAN of a tie reaches it (engine.validate.judging.regime.reached_rows, every such
  decision a suspect), and its routing gap at a layer when none at an earlier MoE layer does.

docs/precision.md gives the fit (kdtr_format.precision: logits b sqrt(layers), routing a
constant) and the figures. `python3 tests/bf16_error_model.py` reruns the full measurement
and prints the table; tests/engine/test_precision.py reruns a small part of it against the
constants.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kdtr_format import PRESETS, ModelConfig
from kdtr_format.precision import BF16_UNIT_ROUNDOFF
from engine.capture import capturing
from engine.model import Transformer
from engine.validate.judging.regime import reached_rows
from refgen.bf16 import RoutingRecorder, bf16_weights
from refgen.model import KVCache, Model, _selection, causal_visibility
from refgen.weights import init_weights

CLEAN = 0.03                       # a routing decision this far from a tie cannot have flipped
FULL = [(preset, layers, 1.0) for preset in ("tiny", "tiny2") for layers in (1, 2, 4, 8)] + \
       [("tiny", 2, gain) for gain in (1 / 3, 3.0)] + [("kimi-k2", layers, 1.0) for layers in (1, 2)]


@dataclass
class Measured:
    """One configuration's largest errors over its seeds (rows and gaps that count only)."""

    preset: str
    layers: int
    gain: float
    logit_scale: float
    logit_error: float            # max normalized logit error
    gap_error: float              # max routing-gap error
    rows: int                     # rows that counted / all rows
    total_rows: int
    gaps: int


def configuration(preset: str, layers: int) -> ModelConfig:
    return dataclasses.replace(PRESETS[preset], num_hidden_layers=layers)


def measure_one(cfg: ModelConfig, seed: int, length: int, gain: float = 1.0
                ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One prefill -> (logit scale, row logit errors [m], whether each row counts [m],
    gap errors [m, Lm], whether each gap counts [m, Lm])."""
    weights = init_weights(cfg, seed)
    weights["lm_head"] = weights["lm_head"] * np.float32(gain)
    weights = {name: w.astype(np.float32) for name, w in bf16_weights(weights).items()}
    recorder = RoutingRecorder(Model(cfg, weights))
    prompt = np.random.default_rng([seed, length]).integers(0, cfg.vocab_size, size=length)
    causal = np.tri(length, dtype=bool)
    reference = recorder.forward(prompt, np.arange(length), causal_visibility(length, 0), KVCache.new(cfg, length), 0)
    inputs, suspects = dict(recorder.inputs), recorder.margins < CLEAN
    reach = np.array([layer < cfg.num_hidden_layers - 1 for layer in recorder.moe_layers], dtype=bool)
    counts_row = ~reached_rows(suspects, reach, causal, False)[0]
    engine = Transformer(cfg, weights, dtype=torch.bfloat16)
    with capturing(engine, [length]) as captured:
        logits = engine.forward(torch.tensor(prompt)[None], torch.arange(length)[None],
                                torch.ones(length, length, dtype=torch.bool).tril()[None], torch.tensor([length]),
                                torch.zeros(1, dtype=torch.int64), engine.new_cache(1, length))[0].double().numpy()
    scale = float(reference.std())
    excess = np.maximum(np.abs(logits - reference) - BF16_UNIT_ROUNDOFF * np.abs(reference), 0.0)
    gap_errors, counts = np.zeros(suspects.shape), np.zeros(suspects.shape, dtype=bool)
    for j, layer in enumerate(recorder.moe_layers):
        p = f"layers.{layer}.moe."
        bias = weights[p + "e_score_correction_bias"].astype(np.float64)
        _, selection, _ = _selection(cfg, inputs[layer], weights[p + "gate"], bias)
        engine_selection = np.asarray(captured.values[f"layers.{layer}.router_scores"], dtype=np.float64) + bias
        order = np.argsort(-selection, axis=1, kind="stable")
        k = cfg.num_experts_per_tok
        pair = order[:, [k - 1, k]]
        gap = np.take_along_axis(selection, pair, 1) @ [1.0, -1.0]
        engine_gap = np.take_along_axis(engine_selection, pair, 1) @ [1.0, -1.0]
        gap_errors[:, j] = np.where(np.isfinite(gap), np.abs(engine_gap - gap), 0.0)
        counts[:, j] = ~reached_rows(suspects[:, :j], reach[:j], causal, False)[0]
    return scale, excess.max(axis=1) / scale, counts_row, gap_errors, counts


def measure(preset: str, layers: int, gain: float = 1.0, seeds: int = 8, length: int = 24) -> Measured:
    cfg = configuration(preset, layers)
    scales, logit_errors, gap_errors, rows, total, gaps = [], [0.0], [0.0], 0, 0, 0
    for seed in range(seeds):
        scale, errors, counts_row, gap, counts = measure_one(cfg, seed, length, gain)
        scales.append(scale)
        logit_errors += errors[counts_row].tolist()
        gap_errors += gap[counts].tolist()
        rows, total, gaps = rows + int(counts_row.sum()), total + len(counts_row), gaps + int(counts.sum())
    return Measured(preset, layers, gain, float(np.mean(scales)), max(logit_errors), max(gap_errors), rows, total,
                    gaps)


def main() -> None:
    print(f"bf16 error model: engine bf16 vs float64 reference, bf16-rounded weights, CLEAN = {CLEAN}")
    print(f"{'preset':8} {'layers':>6} {'gain':>5} {'scale':>6} {'logit err':>10} {'/sqrt(L)':>9} "
          f"{'gap err':>9} {'rows':>9} {'gaps':>5} {'s':>5}")
    worst_logit, worst_gap = 0.0, 0.0
    for preset, layers, gain in FULL:
        began = time.perf_counter()
        m = measure(preset, layers, gain)
        worst_logit, worst_gap = max(worst_logit, m.logit_error / layers ** 0.5), max(worst_gap, m.gap_error)
        print(f"{m.preset:8} {m.layers:6} {m.gain:5.2f} {m.logit_scale:6.2f} {m.logit_error:10.4f} "
              f"{m.logit_error / layers ** 0.5:9.4f} {m.gap_error:9.2e} {m.rows:4}/{m.total_rows:<4} {m.gaps:5} "
              f"{time.perf_counter() - began:5.1f}", flush=True)
    print(f"largest logit error / sqrt(layers): {worst_logit:.4f}; largest routing-gap error: {worst_gap:.2e}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
