"""Per-token intermediates of one `Transformer.forward`, through its `capture` hook.

`capturing(model, n_new, request)` sets `model.capture` for one forward and
collects request `request`'s real rows of every capture point (engine/model.py
CAPTURE_POINTS, each [B, N, ...]) as numpy arrays keyed as the adapter protocol's
`intermediates` keys them (engine/validate/door/protocol.py):

    "layers.{i}.{point}"  [n, ...]   n = n_new[request], one row per new token
    "logits"              [n, V]     in the model's dtype (its bits: the head rounds to it)

Values keep the compute dtype: float32, bfloat16 as `ml_dtypes.bfloat16`, int64
for `experts`. Besides the rows it records, per MoE layer, how many real rows of
the whole call (every request) each expert computed: `expert_counts[i]` [E].
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np
import torch


def point_key(name: str, layer: int) -> str:
    """The intermediates key of a capture point: "logits" (the model gives it layer -1), else
    "layers.{i}.{name}"."""
    return "logits" if name == "logits" else f"layers.{layer}.{name}"


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A copy on the host, bfloat16 as ml_dtypes.bfloat16 (numpy has no bfloat16 of its own)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return tensor.numpy().copy()


@dataclass
class Captured:
    """One forward's intermediates of one request (module docstring)."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    expert_counts: dict[int, np.ndarray] = field(default_factory=dict)


@contextmanager
def capturing(model, n_new: Sequence[int], request: int = 0) -> Iterator[Captured]:
    """Collect request `request`'s rows of the forwards run inside the block; n_new [B] as passed
    to the forward. The model's previous capture is restored on exit."""
    n_new = [int(n) for n in n_new]
    rows = n_new[request]
    captured = Captured()

    def capture(name: str, layer: int, tensor: torch.Tensor) -> None:
        if name == "logits":
            tensor = tensor.to(model.dtype)
        captured.values[point_key(name, layer)] = to_numpy(tensor[request, :rows])
        if name == "experts":
            chosen = torch.cat([tensor[b, :n] for b, n in enumerate(n_new)])
            captured.expert_counts[layer] = np.bincount(to_numpy(chosen).reshape(-1),
                                                        minlength=model.cfg.n_routed_experts)

    previous, model.capture = model.capture, capture
    try:
        yield captured
    finally:
        model.capture = previous
