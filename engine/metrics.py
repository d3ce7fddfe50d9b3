"""Decode metrics: tokens, rounds, target forwards, acceptance lengths, time per stage.

A `StageTimer` accumulates wall time per stage name; on a CUDA device it calls
`torch.cuda.synchronize` before reading the clock, so each stage is charged
for its own kernels and not for the ones still queued from the stage before.
`StageTimer.round` charges the part of a round's wall time that no stage inside it
took (the host's bookkeeping: copies of the round's inputs, committing tokens) to
"host", so the stages add up to the decode's wall time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

# The DDTree round, in order, then the round's remaining wall time; AR decoding uses prefill,
# verify (its one-token forwards), accept and host.
STAGES = ("prefill", "draft", "build", "compile", "verify", "accept", "compact", "host")


class StageTimer:
    """Wall seconds per stage, synchronized on CUDA devices."""

    def __init__(self, device: torch.device | str) -> None:
        self.sync = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def _now(self) -> float:
        """The clock once the device's queued work is done."""
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if stage not in self.seconds:
            raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
        t0 = self._now()
        try:
            yield
        finally:
            self.seconds[stage] += self._now() - t0

    @contextmanager
    def round(self) -> Iterator[None]:
        """One decoding round: its wall time less what its stages were charged goes to "host"."""
        charged = sum(self.seconds.values())
        t0 = self._now()
        try:
            yield
        finally:
            wall = self._now() - t0
            self.seconds["host"] += max(wall - (sum(self.seconds.values()) - charged), 0.0)


@dataclass
class DecodeMetrics:
    """What one decode run cost.

    tokens: tokens committed over all requests (the first token, from prefill, included).
    rounds: batched rounds after prefill (one batched target forward each).
    target_forwards: batched target forward calls, prefill included (= rounds + 1).
    acceptance_lengths: one entry per (request, round): tokens that round committed
        before truncation (1 for AR; 1 .. L+1 for DDTree).
    stage_seconds: wall seconds per stage (`STAGES`).
    """

    tokens: int
    rounds: int
    target_forwards: int
    acceptance_lengths: list[int]
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.stage_seconds.values())

    @property
    def mean_acceptance(self) -> float:
        """tau: the mean number of tokens a request commits per round."""
        if not self.acceptance_lengths:
            return 0.0
        return float(np.mean(self.acceptance_lengths))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def acceptance_histogram(self, max_length: int | None = None) -> np.ndarray:
        """counts [max_length + 1]: counts[a] = rounds that committed a tokens."""
        top = max(self.acceptance_lengths, default=0)
        size = max(top, max_length or 0) + 1
        return np.bincount(np.asarray(self.acceptance_lengths, dtype=np.int64), minlength=size)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "target_forwards": self.target_forwards,
            "mean_acceptance": self.mean_acceptance,
            "acceptance_histogram": self.acceptance_histogram().tolist(),
            "tokens_per_second": self.tokens_per_second,
            "stage_seconds": dict(self.stage_seconds),
        }
