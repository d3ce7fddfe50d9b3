"""Tensor-parallel step times against the collectives' bus bandwidth, measured in the same run.

    torchrun --nproc-per-node N scripts/tp_bench.py [--device cuda] [--configs kimi-k2,k2-mid] [--out DIR]

On every rank (random bf16 weights, batch 1, a context of --context tokens already cached):
- the collectives' ceilings: an all-reduce of 256 MiB (bus bandwidth = bytes / time x 2 (N - 1) / N,
  nccl-tests' convention) and of one [1, hidden] row (the latency an AR step pays per collective);
- the AR step (1 token) and the tree-verify step (--tree tokens, causal: the shape of a chain) of
  each config, eager (CUDA graphs are not used under TP), the step's median time, the time spent
  inside its collectives (events around each `World.sum` / `World.gather`), their count and
  bytes, and what those bytes cost at the measured bus bandwidth.

Rank 0 prints a table and writes tp-<N>.json and tp-<N>.md under --out (GPU name and count,
date, commit, torch and NCCL versions). --device cpu runs the same on gloo (a smoke test:
`python3 -m torch.distributed.run --nproc-per-node 2 scripts/tp_bench.py --device cpu --configs tiny`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from engine.adapter import cuda_backends
from engine.model import Transformer
from engine.parallel import World, join
from engine.validate import random_weights
from kdtr_format import CONFIGS, PRESETS

REPS = 10


@dataclass(frozen=True)
class TimedWorld(World):
    """A World that times and counts its collectives (spans: (begin, end, bytes) per call)."""

    spans: list = field(default_factory=list)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(super().sum, x)

    def sum_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(super().sum_in_rank_order, x)

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self._timed(lambda t: World.gather(self, t, n), x)

    def _timed(self, collective: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        begin = _mark(self.device)
        out = collective(x)
        self.spans.append((begin, _mark(self.device), x.numel() * x.element_size()))
        return out

    def collective_ms(self) -> float:
        _sync(self.device)
        return sum(_elapsed_ms(b, e) for b, e, _ in self.spans)


def _mark(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(begin, end) -> float:
    return begin.elapsed_time(end) if isinstance(begin, torch.cuda.Event) else (end - begin) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(world: TimedWorld, fn: Callable[[], object]) -> tuple[float, float]:
    """(step ms, collective ms): medians over REPS calls after a warm-up, the ranks aligned by a barrier."""
    fn()
    steps, collectives = [], []
    for _ in range(REPS):
        dist.barrier()
        _sync(world.device)
        world.spans.clear()
        begin = _mark(world.device)
        fn()
        end = _mark(world.device)
        _sync(world.device)
        steps.append(_elapsed_ms(begin, end))
        collectives.append(world.collective_ms())
    return statistics.median(steps), statistics.median(collectives)


def ceilings(world: TimedWorld, hidden: int) -> dict:
    """The all-reduce's bus bandwidth (GB/s) on 256 MiB of bf16 (16 MiB on the CPU) and its
    latency (us) on one row."""
    big = torch.ones(2**27 if world.device.type == "cuda" else 2**23, dtype=torch.bfloat16, device=world.device)
    row = torch.ones(1, hidden, dtype=torch.bfloat16, device=world.device)
    big_ms = median_ms(world, lambda: dist.all_reduce(big))[0]
    row_ms = median_ms(world, lambda: dist.all_reduce(row))[0]
    factor = 2 * (world.size - 1) / world.size
    return {"buffer_MiB": big.numel() * 2 / 2**20, "busbw_GBps": big.numel() * 2 * factor / big_ms / 1e6 if factor else None,
            "algbw_GBps": big.numel() * 2 / big_ms / 1e6, "row_latency_us": row_ms * 1e3}


def measure(world: TimedWorld, name: str, context: int, tree: int, busbw: float | None) -> list[dict]:
    cfg = PRESETS.get(name) or CONFIGS[name]
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    attention = cuda_backends()[1] if world.device.type == "cuda" else None
    model = Transformer(cfg, random_weights(cfg, seed=0, device=world.device, dtype=dtype), device=world.device,
                        dtype=dtype, attention=attention, world=world)
    cache = model.new_cache(1, context + tree + 1)
    device = world.device

    def forward(n: int, start: int):
        return lambda: model.forward(torch.zeros(1, n, dtype=torch.int64, device=device),
                                     torch.arange(start, start + n, device=device)[None],
                                     torch.ones(n, n, dtype=torch.bool, device=device).tril()[None],
                                     torch.tensor([n], device=device), torch.tensor([start], device=device),
                                     cache, check=False)
    forward(context, 0)()
    rows = []
    for step, n in (("AR", 1), ("verify", tree)):
        step_ms, collective_ms = median_ms(world, forward(n, context))
        count, nbytes = len(world.spans), sum(b for _, _, b in world.spans)
        factor = 2 * (world.size - 1) / world.size
        rows.append({"config": name, "step": step, "tokens": n, "context": context, "step_ms": step_ms,
                     "collective_ms": collective_ms, "collectives": count, "collective_MB": nbytes / 1e6,
                     "at_busbw_ms": nbytes * factor / busbw / 1e6 if busbw else None})
    return rows


def table(doc: dict) -> str:
    lines = [f"# Tensor-parallel steps, {doc['gpus']} x {doc['gpu']} ({doc['date']}, commit {doc['commit']})", "",
             f"all-reduce: bus bandwidth {doc['ceilings']['busbw_GBps'] or float('nan'):.3g} GB/s "
             f"({doc['ceilings']['buffer_MiB']:.0f} MiB bf16), "
             f"one row {doc['ceilings']['row_latency_us']:.1f} us; torch {doc['torch']}, NCCL {doc['nccl']}", "",
             "| config | step | tokens | step ms | in collectives ms | share | collectives | MB | at bus bandwidth ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        at = "" if r["at_busbw_ms"] is None else f"{r['at_busbw_ms']:.3f}"
        lines.append(f"| {r['config']} | {r['step']} | {r['tokens']} | {r['step_ms']:.3f} | {r['collective_ms']:.3f} | "
                     f"{r['collective_ms'] / r['step_ms']:.0%} | {r['collectives']} | {r['collective_MB']:.2f} | {at} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--configs", default="kimi-k2,k2-mid")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tree", type=int, default=65)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    rank, size, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    plain = join(rank, size, local, args.device)
    world = TimedWorld(plain.rank, plain.size, plain.device)
    names = args.configs.split(",")
    hidden = max((PRESETS.get(n) or CONFIGS[n]).hidden_size for n in names)
    limits = ceilings(world, hidden)
    rows = [row for name in names for row in measure(world, name, args.context, args.tree, limits["busbw_GBps"])]
    if rank == 0:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)", "gpus": size,
               "date": datetime.date.today().isoformat(), "commit": os.environ.get("KDTREE_COMMIT", commit),
               "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
               "ceilings": limits, "rows": rows}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"tp-{size}.json").write_text(json.dumps(doc, indent=1))
        (out / f"tp-{size}.md").write_text(table(doc))
        print(table(doc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
