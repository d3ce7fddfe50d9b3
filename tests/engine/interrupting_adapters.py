"""Adapters that press Ctrl-C on the `kdtree validate` watching them, at a given moment, for
tests/engine/test_interrupts.py: the correct stages of hostile_adapters.Stages, with SIGINT sent
to the parent (the CLI's process; the adapter runs in its supervised child) from one call, after
which the call waits for the parent to end the run."""

from __future__ import annotations

import os
import signal
import threading

from hostile_adapters import Stages


def ctrl_c_to_the_parent() -> None:
    """SIGINT to the parent, then wait: the parent kills this child as it answers."""
    os.kill(os.getppid(), signal.SIGINT)
    threading.Event().wait(60)


def interrupts_in_its_factory():
    """Ctrl-C before the checking starts."""
    ctrl_c_to_the_parent()
    return Stages()


class InterruptsInTreeBuild(Stages):
    """Ctrl-C in the middle of the checks (the top-k row is done)."""

    def build_tree(self, topk_lp, topk_id, budget, root):
        ctrl_c_to_the_parent()


class DiesInTreeBuild(Stages):
    """The process ends in the middle of the checks: the parent makes the report itself."""

    def build_tree(self, topk_lp, topk_id, budget, root):
        os._exit(0)


class CtrlCInItself(Stages):
    """Handles SIGINT again (as engines that install their own handlers do), then gets a Ctrl-C
    the parent does not: KeyboardInterrupt in the child alone."""

    def build_tree(self, topk_lp, topk_id, budget, root):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)
