"""Writing and reading `refgen export` directories, for the export tests (tests/refgen/test_export_*.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import kdtr_format
from refgen.export import export


def exported_weights(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the export's model*.safetensors (one file or its shards), by name (float32
    and FP8 exports: numpy reads no bfloat16)."""
    found = {}
    for file in sorted(directory.glob("model*.safetensors")):
        found.update(load_file(file))
    return found


def target_and_draft(fixture: Path, root: Path) -> tuple[Path, Path]:
    """The fixture exported plain (a target) and with --layers 2 (a draft) under root ->
    (target directory, draft directory)."""
    with kdtr_format.open(fixture) as reader:
        return (export(reader, fixture, root / "target").directory,
                export(reader, fixture, root / "draft", layers=2).directory)
