"""One rank's place in the tensor-parallel group, and the three collectives the sharded forward uses.

Every collective goes through torch.distributed (gloo on the CPU, NCCL on CUDA), on the
group's every rank in the same order: the ranks run the same program on the same
replicated inputs (SPMD), so their control flow agrees without coordination.

- `sum`: the sum of the ranks' partial outputs [M, D] (attention o_proj, the FFN), an
  all-reduce in the backend's own order. gloo's ring and NCCL's rings and trees cut the
  buffer into chunks and start each chunk's sum on another rank, so at world size 3 or more
  an element's order of addition depends on where its row sits in the buffer (measured with
  gloo at world sizes 3 and 4: a row reduced alone and the same row inside a batch differ
  in their last bits); at world size 2 it is a + b either way, exact and commutative.
- `sum_in_rank_order`: the same sum as an all-gather of the partials, then
  ((p_0 + p_1) + p_2) + ... elementwise on every rank: one fixed order for every element,
  whatever the number of rows (invariant mode's reduction; world-size times the bytes).
- `gather`: the vocab shards of the logits [M, V_r] into [M, V] in rank order (a copy).

Both sums give every rank the same bits, so the replicated activations stay identical
across ranks (an all-reduce broadcasts one result; the fold runs the same adds everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process as rank `rank` of `size`, computing on `device`; `group` None is the default group."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None

    def part(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi): the items of n that `rank` (default: this rank) holds. Contiguous, in rank
        order, the first n % size ranks one more; a rank may hold none (3 heads over 4 ranks)."""
        rank = self.rank if rank is None else rank
        base, extra = divmod(n, self.size)
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (rank < extra)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] partial on every rank -> the sum over ranks (in place; the backend's order)."""
        dist.all_reduce(x, group=self.group)
        return x

    def sum_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] partial on every rank -> the sum over ranks, added in rank order elementwise."""
        parts = self._all_gather(x.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [..., hi - lo] (this rank's part of n) -> [..., n]: every rank's part in rank order."""
        width = -(-n // self.size)                                   # the largest part
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = self._all_gather(padded)
        sizes = [hi - lo for lo, hi in (self.part(n, r) for r in range(self.size))]
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return parts
