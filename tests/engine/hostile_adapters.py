"""Adapters that misbehave, each in one way, for tests/engine/test_adapter_door.py: a correct
adapter (the built-in engine's stages, one request at a time) with one thing broken.

    kdtree validate --impl tests/engine/hostile_adapters.py:HangsInTopk --timeout 1 ...
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from engine.adapter import TorchAdapter
from engine.validate.door.protocol_v2 import METHODS_V2, PerRequest


class Stages(PerRequest):
    """Correct: the built-in engine's top-k, tree build, compile, accept and compaction (protocol v1)."""

    name = "built-in engine stages"
    capabilities = ("topk", "tree", "compile", "accept", "compact")

    def __init__(self) -> None:
        super().__init__(TorchAdapter())


def forgets_to_return():
    Stages()


def exits():
    sys.exit(0)


class Stop(BaseException):
    """Not an Exception (as some bindings' errors are not)."""


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ raised")


class ExitsFourWays(Stages):
    """Four methods, four ways out that are not an Exception's, or not printable."""

    def topk_logprobs(self, draft_logits, k):
        sys.exit(0)

    def build_tree(self, topk_lp, topk_id, budget, root):
        raise GeneratorExit

    def compile_tree(self, parents, depths, start):
        raise Stop("engine stopped")

    def accept(self, parents, tokens, choices):
        raise Unprintable()


class RaisingName(Stages):
    @property
    def name(self) -> str:
        raise RuntimeError("no name today")


class RaisingGetattr(Stages):
    """A __getattr__ that raises RuntimeError, not AttributeError, for a name it does not have."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"no {name} here")


class NumberForBackends(Stages):
    backends = 5


class HangsInTopk(Stages):
    def topk_logprobs(self, draft_logits, k):
        threading.Event().wait()


class DiesInForward:
    """The model capability; forward ends the process where it stands."""

    name = "dies in forward"

    def load_weights(self, config, weights) -> None:
        pass

    def reset(self, max_len: int) -> None:
        pass

    def forward(self, tokens, positions, visibility, start):
        os._exit(0)


class DiesLeavingAProcess(DiesInForward):
    """forward leaves a process of its own behind, holding everything it inherited open, then
    ends. The process writes its pid to $HOSTILE_LEFT/pid, sleeps a minute, writes woke."""

    def forward(self, tokens, positions, visibility, start):
        left = Path(os.environ["HOSTILE_LEFT"])
        if os.fork() == 0:
            (left / "pid").write_text(str(os.getpid()))
            time.sleep(60)
            (left / "woke").write_text("")
            os._exit(0)
        os._exit(0)


class ReusesLogits(PerRequest):
    """Correct (the built-in engine's model, protocol v1), but forward's logits are a view of one
    buffer that the next forward overwrites, as an engine with preallocated outputs returns them."""

    name = "reuses its logits buffer"
    capabilities = ("model",)

    def __init__(self) -> None:
        super().__init__(TorchAdapter())
        self.buffer = np.empty((0, 0), np.float32)

    def forward(self, tokens, positions, visibility, start):
        logits = super().forward(tokens, positions, visibility, start)
        if self.buffer.shape[0] < len(logits):
            self.buffer = np.empty((4096, logits.shape[1]), logits.dtype)
        self.buffer[:len(logits)] = logits
        return self.buffer[:len(logits)]


class ReusesEveryOutput(TorchAdapter):
    """Correct, but every tensor it returns is a view of that method's one buffer, overwritten by
    its next call."""

    def __getattribute__(self, name: str):
        method = super().__getattribute__(name)
        if name not in METHODS_V2 or not callable(method):
            return method
        buffers = super().__getattribute__("__dict__").setdefault("buffers", {})

        def reusing(*args):
            out = method(*args)
            many = isinstance(out, tuple)
            views = []
            for i, t in enumerate(out if many else (out,) if out is not None else ()):
                kept = buffers.get((name, i))
                if kept is None or kept.numel() < t.numel() or kept.dtype != t.dtype:
                    kept = buffers[name, i] = torch.empty(max(t.numel(), 1 << 16), dtype=t.dtype, device=t.device)
                views.append(kept[:t.numel()].view(t.shape).copy_(t))
            return tuple(views) if many else views[0] if views else out
        return reusing
