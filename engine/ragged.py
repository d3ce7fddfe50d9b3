"""Ragged batches: request b's rows are rows offsets[b] .. offsets[b+1] of flat tensors.

The validation protocol v2 (engine/validate/door/protocol_v2.py) passes batches this way; the
engine computes on a padded layout ([B, width] with a count per request). These convert
between the two on the tensors' device, and pack and unpack bit-packed visibility rows
(bit j % 32 of word j // 32 of a row: the row sees token j; uint32 words held as int32).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels_cuda.mla_ops import pack_visibility

from .cuda_stages import unpack_visibility

__all__ = ["forward_of_one", "offsets_of", "pack_visibility", "sizes", "to_padded", "to_ragged", "tree_bits",
           "unpack_visibility", "widest"]


def sizes(offsets: torch.Tensor) -> torch.Tensor:
    """offsets [B+1] -> each request's row count [B]."""
    return offsets[1:] - offsets[:-1]


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """Row counts [B] -> int64 offsets [B+1]."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int64)


def widest(counts: torch.Tensor) -> int:
    """The largest of counts [B] (0 for an empty batch): the one host read a padded layout needs."""
    return int(counts.max()) if len(counts) else 0


def to_padded(values: torch.Tensor, offsets: torch.Tensor, width: int, fill: float | int = 0) -> torch.Tensor:
    """values [N, ...] ragged by offsets [B+1] -> [B, width, ...]: request b's rows first in
    its row, `fill` after them (width >= the largest request)."""
    counts = sizes(offsets)
    padded = values.new_full((len(counts), width, *values.shape[1:]), fill)
    request = torch.repeat_interleave(torch.arange(len(counts), device=values.device), counts,
                                      output_size=values.shape[0])
    padded[request, torch.arange(values.shape[0], device=values.device) - offsets[request]] = values
    return padded


def to_ragged(padded: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B, width, ...] holding counts [B] real rows each -> those rows flat [sum(counts), ...]."""
    real = torch.arange(padded.shape[1], device=padded.device)[None, :] < counts[:, None]
    return padded[real]


def tree_bits(visibility: np.ndarray, context: int, device: torch.device, method: str) -> torch.Tensor:
    """Protocol v1's visibility [n, context + n] (numpy) -> the bits of its block over the new rows
    [n, W] on `device`. Protocol 2 sees every cached slot: visibility[:, :context] must be all True."""
    visibility = np.asarray(visibility, dtype=bool)
    if not visibility[:, :context].all():
        raise ValueError(f"{method}: a protocol 2 adapter sees every cached slot; visibility[:, :{context}] "
                         "must be all True")
    return pack_visibility(torch.as_tensor(visibility[:, context:], device=device))


def forward_of_one(tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray, start: int,
                   device: torch.device, method: str = "forward") -> tuple[torch.Tensor, ...]:
    """Protocol v1's forward arguments for one request (tokens, positions [n], visibility
    [n, start + n], start) -> protocol 2's for a batch of one on `device`: tokens, positions [n]
    int64, offsets [2], starts [1], visibility_bits [n, W]."""
    def put(values) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=torch.int64, device=device)

    return (put(tokens), put(positions), put([0, len(tokens)]), put([start]),
            tree_bits(visibility, start, device, method))
