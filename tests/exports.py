"""Reading a `refgen export` directory back, for the export tests (tests/refgen/test_export_*.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def exported_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the export's model*.safetensors (one file or its shards), by name (float32
    and FP8 exports: numpy reads no bfloat16)."""
    found = {}
    for file in sorted(directory.glob("model*.safetensors")):
        found.update(load_file(file))
    return found
