"""Fixtures for the golden-fixture and CLI tests: the committed golden
directory, readers of its files, and two ways to run the `refgen` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner, Result

import kdtr_format

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def golden() -> Callable[[str], Path]:
    """golden("tiny.kdtr") -> the committed fixture's path; the test fails (never
    skips) when it is missing."""

    def _path(relative: str) -> Path:
        path = REPO / "tests" / "golden" / relative
        assert path.is_file(), f"{path} is missing: run `refgen generate --all` and commit it"
        return path

    return _path


@pytest.fixture
def open_golden(golden):
    """open_golden("tiny.kdtr") -> a KDTR reader of the committed file, closed after the test."""
    readers = []

    def _open(relative: str) -> kdtr_format.Reader:
        readers.append(kdtr_format.open(golden(relative)))
        return readers[-1]

    yield _open
    for reader in readers:
        reader.close()


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
