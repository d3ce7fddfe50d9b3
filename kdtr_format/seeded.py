"""A fixture's seeded tensors: drawn from its seed, so a *slim* file omits them.

Every kdtree fixture records its seeded tensors in its metadata, ``seeded_tensors``: name ->
dtype, shape and sha256 (docs/fixtures.md, "Slim and full"). A slim file (what is committed,
what `refgen generate` writes) does not hold them; `refgen materialize` writes the full file.
The format reads this record and no more: drawing the tensors is refgen's (kdtr_format imports
neither refgen nor the engine), so a reader asked for an omitted tensor names the command.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

SEEDED_KEY = "seeded_tensors"


def recorded_seeded(metadata: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The metadata's seeded tensors (name -> checksum), {} when it records none."""
    recorded = metadata.get(SEEDED_KEY, {}) if isinstance(metadata, Mapping) else {}
    return recorded if isinstance(recorded, dict) else {}


def omitted(reader: Any) -> list[str]:
    """The seeded tensors a fixture file does not hold ([]: a full file), in the metadata's order."""
    held = set(reader.names())
    return [name for name in recorded_seeded(reader.metadata) if name not in held]


def slim_hint(path: str | os.PathLike) -> str:
    """How to make a full fixture of a slim file."""
    return f"`refgen materialize {path} --out DIR` writes the full fixture"
