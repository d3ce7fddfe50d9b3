"""Starting the ranks: one process per rank, joined in one torch.distributed group.

- Under torchrun (WORLD_SIZE, RANK and LOCAL_RANK in the environment) this process is one rank:
  `run` joins the group the environment names (env://) and runs the job here.
- Otherwise `run` spawns the ranks itself as local processes (torch.multiprocessing, the spawn
  start method), joined through a file store in a private temporary directory, and returns rank
  0's result. A `Gang` keeps such processes and their group alive across jobs (the tests share
  one per world size).

Backend and device follow the device kind: "cpu" -> gloo, each rank on the CPU with one intra-op
thread (the ranks already share the cores); "cuda" -> NCCL, rank r on cuda:<local rank r>.

A job is a picklable function job(world, *args) -> result, run on every rank with the same
arguments; it must call the same collectives in the same order on every rank (the sharded
forward does). An exception on any rank is re-raised here (the lowest failing rank's, with a
note naming the rank and its traceback); the other ranks get GRACE_S to finish, then the gang is
stopped, since they may be waiting in a collective the failed rank never joins. A gang whose
every rank answered (failed or not) stays up; one with a dead or silent rank is stopped.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import tempfile
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .world import World

GRACE_S = 10.0                                          # the other ranks' time to finish after a failure
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)    # a collective waiting longer raises
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")

Job = Callable[..., Any]


def torchrun_size() -> int | None:
    """The world size torchrun started this process in; None when not under torchrun."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def join(rank: int, size: int, local_rank: int, device: str,
         store: dist.Store | None = None) -> World:
    """Join the group as `rank` of `size` (store None: the env:// rendezvous) -> this rank's World."""
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"rank {rank}: local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        where = torch.device("cuda", local_rank)
        torch.cuda.set_device(where)
        options = {"backend": "nccl", "device_id": where}
    elif device == "cpu":
        where = torch.device("cpu")
        torch.set_num_threads(1)
        options = {"backend": "gloo"}
    else:
        raise ValueError(f"the ranks' device kind must be 'cpu' or 'cuda', got {device!r}")
    if store is None:
        dist.init_process_group(init_method="env://", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                **options)
    else:
        dist.init_process_group(store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **options)
    return World(rank=rank, size=size, device=where)


def run(size: int, device: str, job: Job, *args: Any) -> Any:
    """job(world, *args) on `size` ranks -> this rank's result under torchrun, else rank 0's."""
    launched = torchrun_size()
    if launched is None:
        with Gang(size, device) as gang:
            return gang.run(job, *args)[0]
    if launched != size:
        raise ValueError(f"torchrun started {launched} process(es) but {size} ranks were asked for")
    world = join(int(os.environ["RANK"]), size, int(os.environ["LOCAL_RANK"]), device)
    try:
        return job(world, *args)
    finally:
        dist.destroy_process_group()


class Gang:
    """`size` local rank processes in one group, each running every job it is sent (module docstring)."""

    def __init__(self, size: int, device: str = "cpu") -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"Gang: size must be an integer >= 1, got {size!r}")
        self.size = size
        context = mp.get_context("spawn")
        self._directory = tempfile.TemporaryDirectory(prefix="kdtree-ranks-")
        store = os.path.join(self._directory.name, "store")
        self._conns: list[connection.Connection] = []
        self._procs = []
        for rank in range(size):
            here, there = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, size, device, store, there), daemon=True,
                                   name=f"kdtree-rank-{rank}")
            proc.start()
            there.close()
            self._conns.append(here)
            self._procs.append(proc)

    @property
    def running(self) -> bool:
        """Whether the ranks are up (not stopped by `close` or by a dead or silent rank)."""
        return bool(self._procs)

    def run(self, job: Job, *args: Any) -> list[Any]:
        """job(world, *args) on every rank -> the results in rank order (module docstring)."""
        if not self.running:
            raise RuntimeError("Gang: the ranks were stopped")
        for conn in self._conns:
            conn.send((job, args))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = None
        while len(outcomes) < self.size:
            waiting = {conn: rank for rank, conn in enumerate(self._conns) if rank not in outcomes}
            ready = connection.wait(list(waiting), None if deadline is None else max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for conn in ready:
                rank = waiting[conn]
                outcomes[rank] = self._receive(rank)
                if not outcomes[rank][0] and deadline is None:
                    deadline = time.monotonic() + GRACE_S
        failures = [value for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if len(outcomes) < self.size or not all(proc.is_alive() for proc in self._procs):
            self.close(now=True)                            # a rank is stuck in a collective, or dead
        if failures:
            raise failures[0]
        return [outcomes[rank][1] for rank in range(self.size)]

    def _receive(self, rank: int) -> tuple[bool, Any]:
        try:
            return self._conns[rank].recv()
        except (EOFError, OSError):
            self._procs[rank].join(1)
            return False, RuntimeError(f"rank {rank} died (exit code {self._procs[rank].exitcode})")

    def close(self, now: bool = False) -> None:
        """Stop the ranks: asked to leave, then terminated if they do not within GRACE_S (one
        waiting in a collective); now: terminated at once."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        began = time.monotonic()
        for proc in self._procs:
            if not now:
                proc.join(max(GRACE_S - (time.monotonic() - began), 0.1))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._directory.cleanup()

    def __enter__(self) -> "Gang":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(rank: int, size: int, device: str, store: str, conn: connection.Connection) -> None:
    """One spawned rank: join the group at the first job, run jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)            # Ctrl-C is the parent's to answer
    world = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):                           # the parent is gone
            break
        if message is None:
            break
        job, args = message
        try:
            if world is None:
                world = join(rank, size, rank, device, dist.FileStore(store, size))
            outcome = (True, job(world, *args))
        except BaseException as exc:                          # sent back, re-raised by the parent
            outcome = (False, _portable(exc, rank))
        conn.send(outcome)
    if world is not None:
        dist.destroy_process_group()


def _portable(exc: BaseException, rank: int) -> BaseException:
    """exc with a note naming the rank and its traceback, or a RuntimeError saying as much
    when exc does not survive pickling."""
    where = f"raised on rank {rank}:\n{''.join(traceback.format_exception(exc))}"
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    exc.add_note(where)
    return exc
