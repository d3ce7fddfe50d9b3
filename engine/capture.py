"""Per-token intermediates of one `Transformer.forward`, through its `capture` hook.

`capturing(model, n_new, request)` sets `model.capture` for one forward and
collects request `request`'s real rows of every capture point (engine/model.py
CAPTURE_POINTS) as numpy arrays keyed as the adapter protocol's `intermediates`
capability keys them (engine/validate/protocol.py):

    "layers.{i}.{point}"  [n, ...]   n = n_new[request], one row per new token
    "logits"              [n, V]

Values keep the compute dtype: float32, bfloat16 as `ml_dtypes.bfloat16`, int64
for `experts`. Besides the rows it records, per MoE layer, how many rows of the
whole call (every request) each expert computed: `expert_counts[i]` [E].
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np
import torch

# Points whose tensors hold only the call's real rows, request-major ([M, ...]); the others are [B, N, ...].
REAL_ROW_POINTS = frozenset({"ffn_in", "router_scores", "experts", "ffn_out"})


def point_key(name: str, layer: int, num_layers: int) -> str:
    """The intermediates key of a capture point: "logits" after the last layer, else "layers.{i}.{name}"."""
    return "logits" if name == "logits" and layer == num_layers else f"layers.{layer}.{name}"


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
    begin = sum(n_new[:request])
    rows = n_new[request]
    num_layers = model.cfg.num_hidden_layers
    captured = Captured()

    def capture(name: str, layer: int, tensor: torch.Tensor) -> None:
        part = tensor[begin:begin + rows] if name in REAL_ROW_POINTS else tensor[request, :rows]
        captured.values[point_key(name, layer, num_layers)] = to_numpy(part)
        if name == "experts":
            captured.expert_counts[layer] = np.bincount(to_numpy(tensor).reshape(-1),
                                                        minlength=model.cfg.n_routed_experts)

    previous, model.capture = model.capture, capture
    try:
        yield captured
    finally:
        model.capture = previous
