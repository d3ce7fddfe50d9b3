"""The invariant (built-in engine only): DDTree greedy == AR greedy, per drafter, on a
fixture's weights and prompts, or on seeded random weights for a preset without one."""

from __future__ import annotations

import numpy as np
import torch

from kdtr_format import PRESETS, DDTreeConfig, ModelConfig
from kdtr_format.precision import bf16_bounds

from ...adapter import TorchAdapter
from ...decode import ar_decode, ddtree_decode
from ...drafters import LayerSkipDrafter, OracleDrafter, RandomDrafter
from ...weights import weight_shapes
from ..judging.acceptance import engine_acceptance, with_acceptance
from ..judging.compare import compare_tokens, merge
from ..reports.report import Check

# The invariant's DDTree setting and drafters (small: it runs on every fixture's weights).
INVARIANT_DDTREE = DDTreeConfig(block_size=5, budget=12)
INVARIANT_TOKENS = 16
MARGIN_REL = 1e-3              # near-tie threshold relative to the logits' spread, as refgen's fixtures
DRAFTERS = ("oracle", "random", "layerskip")
INVARIANT_ROWS = tuple(f"invariant DDTree == AR ({name})" for name in DRAFTERS)


def invariant_checks(adapter: TorchAdapter, prompts: list[np.ndarray], threshold: float,
                     section: str, regime: str = "") -> list[Check]:
    """DDTree greedy == AR greedy on the adapter's loaded weights and these prompts, per drafter.
    A divergence is judged by AR's margin there against `threshold` (the first divergence of
    each request: the tokens after it follow another prefix); `regime` labels the rows."""
    model, stages, cfg = adapter.model, adapter.stages, adapter.model.cfg
    ar = ar_decode(model, prompts, INVARIANT_TOKENS, stages=stages)
    truth = [np.concatenate([p, r.tokens]) for p, r in zip(prompts, ar.requests)]
    drafters = (OracleDrafter(truth, cfg.vocab_size, accuracy=0.7, seed=5, device=model.device),
                RandomDrafter(cfg.vocab_size, seed=6, device=model.device),
                LayerSkipDrafter(cfg, adapter.weights, max(1, cfg.num_hidden_layers // 2), device=model.device,
                                 dtype=model.dtype))
    checks = []
    for name, row_name, drafter in zip(DRAFTERS, INVARIANT_ROWS, drafters):
        result = ddtree_decode(model, drafter, prompts, INVARIANT_DDTREE, INVARIANT_TOKENS, stages=stages,
                               record=True)
        rows = [compare_tokens(section, name, got.tokens, want.tokens, want.margins, threshold, f"prompt {i}",
                               sequence=True)
                for i, (got, want) in enumerate(zip(result.requests, ar.requests))]
        check = merge(section, row_name, rows)
        check.regime = regime
        forwards = (f"tau {result.metrics.mean_acceptance:.2f}, target forwards "
                    f"{result.metrics.target_forwards} vs AR {ar.metrics.target_forwards}")
        check.detail = f"{check.detail}; {forwards}" if check.detail else forwards
        checks.append(with_acceptance(check, engine_acceptance(result), result.metrics.stage_seconds,
                                      str(model.device)))
    return checks


def random_weights(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights made with torch: linear maps scaled by 1/sqrt(fan-in), norm
    weights 1, a small random routing bias (for presets without a fixture, and benchmarks)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            value = torch.randn(shape, device=device, generator=generator) * 1e-2
        elif len(shape) == 1:
            value = torch.ones(shape, device=device)
        else:
            value = torch.randn(shape, device=device, generator=generator) * shape[-1] ** -0.5
        weights[name] = value.to(dtype)
    return weights


def preset_invariant_checks(adapter: TorchAdapter, preset: str) -> list[Check]:
    """The invariant for a preset without a model fixture: random weights and prompts;
    near-tie threshold MARGIN_REL x the logits' standard deviation (as refgen's fixtures),
    or in bfloat16 the bf16 error model's margin threshold (kdtr_format.precision)."""
    cfg = PRESETS[preset]
    adapter.load_weights(cfg, random_weights(cfg, seed=0))
    generator = np.random.default_rng(0)
    prompts = [generator.integers(0, cfg.vocab_size, size=n) for n in (4, 9, 17)]
    probe = adapter.model.forward(*_causal_batch(prompts[-1], adapter.model.device), adapter.model.new_cache(1, 17))
    scale = float(probe.double().std())
    if adapter.model.dtype == torch.bfloat16:
        threshold = bf16_bounds(scale, cfg.num_hidden_layers, float(probe.abs().max())).margin_threshold
        regime = f"bf16: near-tie below margin {threshold:.2g}"
    else:
        threshold = MARGIN_REL * scale
        regime = f"float32: near-tie below margin {threshold:.2g}"
    return invariant_checks(adapter, prompts, threshold, f"{preset} (random weights)", regime)


def _causal_batch(prompt: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One prompt as a causal prefill batch: tokens, positions, visibility, n_new, starts."""
    m = len(prompt)
    return (torch.tensor(prompt, device=device)[None], torch.arange(m, device=device)[None],
            torch.ones(m, m, dtype=torch.bool, device=device).tril()[None], torch.tensor([m], device=device),
            torch.zeros(1, dtype=torch.int64, device=device))
