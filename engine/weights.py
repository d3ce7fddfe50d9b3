"""A config's weights checked against their names and shapes (kdtr_format.weights), and loaded
from a KDTR fixture.

Names and layouts are docs/fixtures.md "Weights" (torch layout [out, in]); a fixture stores
them under ``weights/<name>`` (float32) and its config under ``metadata["config"]``; a fixture
made from a checkpoint names them in its metadata instead (kdtr_format.checkpoint_tensors: the
checkpoint's tensors and how to decode them). The router (`ROUTER_WEIGHTS`) stays float32 in
any compute dtype.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch

import kdtr_format
from kdtr_format import ModelConfig, checkpoint_tensors
from kdtr_format.seeded import omitted, slim_hint
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
    """A torch tensor of `value`: itself; for a writable, contiguous float32 numpy array one that
    shares its memory (the runner's fixture weights: one copy for the runner and the engine);
    for any other array a float32 copy (a read-only memory map of a file among them)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == np.float32 and value.flags.writeable and value.flags.c_contiguous:
            return torch.from_numpy(value)
        return torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
    raise TypeError(f"weights must be torch tensors or numpy arrays, got {type(value).__name__}")


def on_device(value: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`value` as a float32 tensor on `device`: sharing its memory where `as_tensor` shares and the
    device is the CPU, else a copy there."""
    return as_tensor(value).to(device=device, dtype=torch.float32)


def weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` is held in when the model computes in `dtype`."""
    return torch.float32 if name.endswith(ROUTER_WEIGHTS) else dtype


def load_fixture_weights(path_or_reader: str | os.PathLike | Any, dtype: torch.dtype = torch.float32
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights) from a KDTR fixture: a path or an open `kdtr_format` reader.

    Each weight is converted straight to the dtype the model holds it in (`weight_dtype`), one
    at a time, so loading a large fixture costs the weights in the compute dtype and no more: a
    stored one from the file's memory map, a checkpoint fixture's decoded from the checkpoint's
    tensors (each verified by its sha256: kdtr_format.checkpoint_tensors). They outlive the reader.
    A slim fixture (its seeded weights not stored, docs/fixtures.md) is a ValueError naming the
    file and what gives its full form: the engine does not draw seeded weights (refgen does).
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
    slim = [name for name in omitted(reader) if name.startswith(prefix)]
    if slim:
        raise ValueError(f"{reader.path}: a slim fixture: its {len(slim)} weights are drawn from its seed, not "
                         f"stored; engine.validate.find_fixtures({str(reader.path)!r}) gives the materialized copy "
                         f"`kdtree validate` uses, or {slim_hint(reader.path)}")
    rebuilt = checkpoint_tensors.CheckpointTensors(metadata)
    weights = {}
    for name in checkpoint_tensors.names(reader, prefix):
        target = weight_dtype(name, dtype)
        if name in reader:
            stored = reader.torch(name)
            weights[name[len(prefix):]] = stored.clone() if stored.dtype == target else stored.to(target)
        else:                               # a fresh float32 array: kept as it is in float32
            weights[name[len(prefix):]] = torch.from_numpy(rebuilt.array(name)).to(target)
    if not weights:
        raise ValueError(f"{reader.path}: holds no 'weights/...' tensors (not a model fixture?)")
    check_weights(cfg, weights)
    return cfg, weights
