"""The routed experts of a MoE layer, dispatched without reading anything back to the host.

Given each row's routing (expert ids idx [M, k] and weights [M, k] from `engine.model.route`),
every row's routed output is

    out[t] = sum_{j < k} weight[t, j] * Expert_{idx[t, j]}(x[t])       (float32, j in rank order)
    Expert_e(x) = W_down_e (silu(W_gate_e x) * (W_up_e x))

summed in rank order j = 0 .. k-1, so the combine has one fixed order (no atomics). Rows with
real[t] False (padding) get 0 and never share an expert matrix product with a real row. Two
dispatches compute it, both free of host synchronization (no `.item()`, `.tolist()`,
`nonzero` or data-dependent Python branching), so either can be captured in a CUDA graph:

- ``grouped``: the (row, slot) pairs sorted by expert (padding pairs sorted last, past every
  group) and one grouped matrix product per projection over the sorted rows
  (`torch._grouped_mm` with the groups' end offsets on the device). Only the chosen experts'
  weights are read: what an AR decode step needs to run at its memory floor. It runs where
  torch has a grouped kernel: CUDA bf16 on Hopper (CUTLASS) and the CPU (a loop over groups,
  where reading the offsets costs nothing). Elsewhere torch's fallback would read the offsets
  back, so `moe_dispatch` picks ``dense`` there.
- ``dense``: every expert on every row as batched products over the experts, then each row
  gathers its k experts' outputs. It reads every expert and does E / k times the routed
  flops; its products have the same shape whatever the routing, which is what invariant mode
  needs (docs/precision.md, section 3).

Under expert parallelism (engine/parallel) a `RoutedExperts` holds one rank's experts, global
ids first .. first + E - 1, and every row's output is the sum above over the slots j whose
expert it holds (0 for the others); the ranks' outputs are then summed by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DISPATCHES = ("grouped", "dense")


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]: W_down (silu(W_gate x) * (W_up x))."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def moe_dispatch(device: torch.device, dtype: torch.dtype) -> str:
    """The dispatch to use on `device` in `dtype` (module docstring)."""
    if device.type == "cpu":
        return "grouped"
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] == 9:
        return "grouped"
    return "dense"


class RoutedExperts:
    """E routed experts of one layer, global ids first .. first + E - 1 (all of them: first 0):
    w_gate, w_up [E, I, D], w_down [E, D, I]."""

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, first: int = 0) -> None:
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.num_experts = w_gate.shape[0]
        self.first = first
        # [E, in, out] views for x @ W^T, column-major per expert as the grouped kernel takes them.
        self.gate_t, self.up_t, self.down_t = (w.transpose(1, 2) for w in (w_gate, w_up, w_down))

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, real: torch.Tensor,
                 dispatch: str) -> torch.Tensor:
        """x [M, D], idx int64 [M, k] (global ids), weight float32 [M, k], real bool [M] -> float32 [M, D]."""
        rows, k = idx.shape
        if rows == 0 or k == 0 or self.num_experts == 0:
            return x.new_zeros(x.shape, dtype=torch.float32)
        local = idx - self.first                                            # [M, k]
        held = (local >= 0) & (local < self.num_experts)                    # [M, k]: the slots served here
        if dispatch == "grouped":
            y = self._grouped(x, local, real[:, None] & held)
        elif dispatch == "dense":
            y = self._dense(x, local.clamp(0, self.num_experts - 1))
        else:
            raise ValueError(f"MoE dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        out = (torch.where(held[..., None], y.float(), 0.0) * weight[..., None]).sum(1)   # [M, D], rank order
        return torch.where(real[:, None], out, 0.0)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
        """idx [M, k] local ids, computed bool [M, k] -> y [M, k, D]: pair (t, j)'s expert
        output (garbage where not computed)."""
        rows, k = idx.shape
        experts = self.num_experts
        expert = torch.where(computed, idx, experts).flatten()               # [M k], the others -> E
        order = torch.argsort(expert, stable=True)                           # [M k] pairs by expert
        bounds = torch.arange(1, experts + 1, device=x.device, dtype=expert.dtype)
        ends = torch.searchsorted(expert[order], bounds).to(torch.int32)     # [E] group ends
        xs = x[order // k]                                                   # [M k, D]
        h = F.silu(torch._grouped_mm(xs, self.gate_t, offs=ends)) * torch._grouped_mm(xs, self.up_t, offs=ends)
        ys = torch._grouped_mm(h, self.down_t, offs=ends)                    # [M k, D] sorted
        return torch.empty_like(ys).index_copy_(0, order, ys).view(rows, k, -1)

    def _dense(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """idx [M, k] local ids -> y [M, k, D]: every expert on every row, then each row's k."""
        rows = x.shape[0]
        xs = x.expand(self.num_experts, *x.shape)                           # [E, M, D]
        h = F.silu(torch.bmm(xs, self.gate_t)) * torch.bmm(xs, self.up_t)   # [E, M, I]
        ye = torch.bmm(h, self.down_t)                                      # [E, M, D]
        return ye[idx, torch.arange(rows, device=x.device)[:, None]]        # [M, k, D]
