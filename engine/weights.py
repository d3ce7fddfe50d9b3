"""A config's weights checked against their names and shapes (kdtr_format.weights), and loaded
from a KDTR fixture.

Names and layouts are docs/fixtures.md "Weights" (torch layout [out, in]);
a fixture stores them under ``weights/<name>`` (float32; for a fixture made from
a checkpoint, the checkpoint's dequantized weights) and its config under
``metadata["config"]``. The router (`ROUTER_WEIGHTS`) stays float32 in any
compute dtype.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch

import kdtr_format
from kdtr_format import ModelConfig
from kdtr_format.weights import weight_shapes

ROUTER_WEIGHTS = ("moe.gate", "moe.e_score_correction_bias")      # name suffixes kept in float32


def check_weights(cfg: ModelConfig, weights: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first missing, unexpected or misshapen weight."""
    expected = weight_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing (expected shape {list(shape)})")
        got = tuple(weights[name].shape)
        if got != shape:
            raise ValueError(f"weight {name!r} has shape {list(got)}, expected {list(shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"weight {extra[0]!r} is not part of this config "
                         f"({len(extra)} unexpected weight(s))")


def as_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A torch tensor owning a copy of (or sharing) `value`'s data."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
    raise TypeError(f"weights must be torch tensors or numpy arrays, got {type(value).__name__}")


def weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` is held in when the model computes in `dtype`."""
    return torch.float32 if name.endswith(ROUTER_WEIGHTS) else dtype


def load_fixture_weights(path_or_reader: str | os.PathLike | Any, dtype: torch.dtype = torch.float32
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights) from a KDTR fixture: a path or an open `kdtr_format` reader.

    Each tensor is converted from the file's memory map straight to the dtype the model
    holds it in (`weight_dtype`), one at a time, so loading a large fixture costs the
    weights in the compute dtype and no more; they outlive the reader.
    """
    if isinstance(path_or_reader, (str, os.PathLike)):
        with kdtr_format.open(path_or_reader) as reader:
            return load_fixture_weights(reader, dtype)
    reader = path_or_reader
    metadata = reader.metadata
    if not isinstance(metadata, Mapping) or "config" not in metadata:
        raise ValueError("fixture has no metadata['config'] (not a kdtree model fixture?)")
    cfg = ModelConfig.from_dict(metadata["config"])
    prefix = "weights/"
    weights = {}
    for name in reader.names(prefix):
        stored = reader.torch(name)
        target = weight_dtype(name, dtype)
        weights[name[len(prefix):]] = stored.clone() if stored.dtype == target else stored.to(target)
    if not weights:
        raise ValueError("fixture holds no 'weights/...' tensors (a slim fixture? `refgen materialize FILE "
                         "--out DIR` writes its full form)")
    check_weights(cfg, weights)
    return cfg, weights
