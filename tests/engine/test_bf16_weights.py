"""The built-in engine in bf16 narrows float32 weights as documented (docs/precision.md, "The bf16
cases"): every weight rounded to bf16, the norm weights included (their arithmetic is float32, on
the rounded values), the router's gate and bias kept float32 and unrounded.

The committed fixtures' bf16 cases hand weights that are bf16 values already, so no validate
row sees what an engine does with wider ones. Here a seeded model's float32 weights (refgen's,
norm weights U(0.8, 1.2): almost none a bf16 value) go into the engine as `kdtree validate`
loads them (TorchAdapter.set_dtype, load_weights); its logits must be bit for bit those of the
same engine handed the weights already rounded (the router's left as they are). An engine that
kept a norm weight unrounded moves logits by about one bf16 rounding: inside every tolerance,
but not the same bits."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from engine.adapter import TorchAdapter
from engine.validate.door.protocol_v2 import PerRequest
from engine.weights import ROUTER_WEIGHTS
from kdtr_format import PRESETS
from refgen.weights import init_weights

CFG = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=2)       # a dense layer, then an MoE one; q_a_norm
NORMS = ("layernorm", "q_a_norm", "kv_a_norm")
PROMPT = np.array([5, 17, 3, 99, 42, 7, 250, 1])


def rounded(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every weight rounded to bf16 (as float32 values) but the router's."""
    return {name: w if name.endswith(ROUTER_WEIGHTS) else w.astype(ml_dtypes.bfloat16).astype(np.float32)
            for name, w in weights.items()}


def bf16_logits(weights: dict[str, np.ndarray]) -> tuple[np.ndarray, TorchAdapter]:
    """A causal prefill of PROMPT by the built-in engine set to bf16 -> (logits [m, V], the engine)."""
    engine = TorchAdapter()
    engine.set_dtype("bfloat16")
    engine.load_weights(CFG, {name: w.copy() for name, w in weights.items()})
    adapter = PerRequest(engine)
    m = len(PROMPT)
    adapter.reset(m)
    return adapter.forward(PROMPT, np.arange(m), np.tri(m, dtype=bool), 0), engine


def test_a_bf16_engine_rounds_float32_norm_weights_and_keeps_the_router_float32():
    weights = init_weights(CFG, 11)
    norms = [name for name in weights if name == "norm" or name.endswith(NORMS)]
    assert len(norms) == 2 * 4 + 1                         # per layer: input, post-attention, q_a, kv_a; the final
    for name in norms:                                     # the case: norm weights that are no bf16 value
        assert (rounded(weights)[name] != weights[name]).mean() > 0.9, name
    got, engine = bf16_logits(weights)
    want, _ = bf16_logits(rounded(weights))
    assert np.array_equal(got, want), f"logits differ by up to {np.abs(got - want).max():.3g}"
    held = engine.model.norm.cpu().numpy()
    assert np.array_equal(held, rounded(weights)["norm"]) and not np.array_equal(held, weights["norm"])


def test_the_routers_gate_stays_unrounded():
    """The router's float32 gate, rounded beforehand, gives other logits: the engine reads it unrounded."""
    weights = init_weights(CFG, 11)
    got, _ = bf16_logits(rounded(weights))
    both = rounded(weights)
    both["layers.1.moe.gate"] = weights["layers.1.moe.gate"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(bf16_logits(both)[0], got)
