"""Two ways to run the `refgen` command (the golden fixtures: tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner, Result

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def refgen_cli() -> Callable[..., Result]:
    """refgen_cli("verify", path) runs `refgen ARGS` in this process (click's runner)."""
    from refgen.cli import main

    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def refgen_process() -> Callable[..., subprocess.CompletedProcess]:
    """refgen_process("verify") runs `python -m refgen ARGS` from the repository root
    in a fresh interpreter (where the CLI runs BLAS on one thread)."""

    def _run(*args: object) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "refgen", *map(str, args)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)

    return _run
