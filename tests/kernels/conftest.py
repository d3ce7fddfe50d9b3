"""Shared fixtures for the CUDA kernel tests.

- `golden_kernels(kind)`: the reader of tests/golden/kernels/<kind>.kdtr, or a skip naming
  the absent file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDEN_KERNELS = Path(__file__).resolve().parents[1] / "golden" / "kernels"


@pytest.fixture
def golden_kernels():
    from kdtr_format import reader

    def open_kind(kind: str):
        path = GOLDEN_KERNELS / f"{kind}.kdtr"
        if not path.is_file():
            pytest.skip(f"golden kernel cases absent: {path} (generate with `refgen generate`)")
        return reader.open(path)

    return open_kind
