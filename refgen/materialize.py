"""Full fixtures from slim ones (`refgen materialize`, docs/fixtures.md "Slim and full").

The seeded tensors a slim file omits (refgen.files) are drawn again from the seed in
its metadata, each checked against the dtype, shape and sha256 the metadata records,
and the full fixture is written atomically: the same metadata, every tensor.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from kdtr_format import ModelConfig

from .bf16 import bf16_weights
from .files import checksum, omitted, recorded_seeded, seeded_names, seeded_problems, stored_hash_problem, write_fixture
from .fixtures import Fixture, FixtureError
from .kernel_cases import kernel_fixture
from .weights import init_weights


def seeded_tensors(metadata: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every seeded tensor of a fixture, drawn again from its metadata: a model fixture's
    weights (and their bf16 rounding when it holds bf16 cases), a kernel fixture's inputs."""
    try:
        kind, seed = metadata["kind"], metadata["generator"]["seed"]
        if kind == "model":
            weights = init_weights(ModelConfig.from_dict(metadata["config"]), seed)
            tensors = {f"weights/{name}": w for name, w in weights.items()}
            if "bf16" in metadata:
                tensors.update({f"bf16/weights/{name}": w for name, w in bf16_weights(weights).items()})
        else:
            tensors = kernel_fixture(kind, seed, bool(metadata["large"])).tensors
    except (KeyError, TypeError) as exc:
        raise FixtureError(f"metadata: missing or malformed entry {exc}") from None
    return {name: tensors[name] for name in seeded_names(metadata, tensors)}


def materialize(reader: Any, out: str | os.PathLike) -> int:
    """Write the full fixture of an open fixture file `reader` (slim or full) to `out`
    atomically -> how many tensors were drawn again. FixtureError, naming the tensor, when
    the file is inconsistent or a regenerated tensor is not the one recorded."""
    metadata = reader.metadata
    problems = [p for p in [stored_hash_problem(reader)] if p] + seeded_problems(reader)
    if problems:
        raise FixtureError(problems[0])
    missing = omitted(reader)
    tensors: dict[str, Any] = {name: reader[name] for name in reader.names()}
    if missing:
        drawn = seeded_tensors(metadata)
        recorded = recorded_seeded(metadata)
        for name in missing:
            if name not in drawn:
                raise FixtureError(f"{name}: recorded as seeded, but refgen draws no such tensor for this fixture")
            if checksum(drawn[name]) != recorded[name]:
                raise FixtureError(
                    f"{name}: drawn again from seed {metadata['generator']['seed']}, it is not the tensor the "
                    f"fixture records (sha256 {str(recorded[name].get('sha256'))[:16]}...): numpy's random stream "
                    f"or refgen's drawing code differs from the one that wrote it (numpy "
                    f"{metadata['generator'].get('numpy')}, this one {np.__version__})")
            tensors[name] = drawn[name]
    write_fixture(out, Fixture(tensors, {k: v for k, v in metadata.items() if k != "content_hash"}))
    return len(missing)
