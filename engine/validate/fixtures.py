"""Finding the fixtures: a directory or file given by the user, the committed tests/golden,
or a cache directory that `refgen generate --all --full` fills once, all or nothing; and a
model fixture's weights, read once per open fixture and shared by every check that loads them.

The committed fixtures are slim (docs/fixtures.md, "Slim and full"): they omit the tensors
drawn from a seed. Fixtures found slim are materialized once into the fixture cache
(fixture_cache.py: keyed by content, all or nothing, each copy checked against its slim
file). A fixture made from a checkpoint holds no weights either, but needs no materializing: its
weights are the checkpoint's tensors, which kdtr_format.checkpoint_tensors decodes here.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np

import kdtr_format
from kdtr_format import PRESETS, KdtrError, ModelConfig, checkpoint_tensors
from kdtr_format.seeded import omitted

from .fixture_cache import cache_root, materialized, refgen_into
from .reports.report import ValidateError

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"


def find_fixtures(fixtures: str | os.PathLike | None, generate: bool = True) -> Path:
    """The full fixtures to check: `fixtures` if given (one .kdtr file, or a directory with .kdtr
    files anywhere under it: `kdtr_files`), else the committed tests/golden, else a cache directory
    filled by `python -m refgen generate --all --full`; slim ones materialized (`full_fixtures`)."""
    if fixtures is not None:
        path = Path(fixtures)
        if path.is_file():
            if path.suffix != ".kdtr":
                raise ValidateError(f"fixture file {path} is not a .kdtr file")
            return full_fixtures(path)
        if not path.is_dir():
            raise ValidateError(f"fixture directory or file {path} does not exist")
        if not kdtr_files(path):
            raise ValidateError(f"no .kdtr fixtures under {path}")
        return full_fixtures(path)
    if kdtr_files(GOLDEN_DIR):
        return full_fixtures(GOLDEN_DIR)
    cache = cache_root() / "fixtures"
    if kdtr_files(cache):
        return cache
    if not generate:
        raise ValidateError(f"no fixtures in {GOLDEN_DIR} or {cache}")
    with refgen_into(cache.parent, "generate", "--all", "--full",
                     what="no fixtures found and `refgen generate`") as staging:
        if cache.exists():
            cache.rmdir()
        os.replace(staging, cache)
    return cache


def full_fixtures(path: Path) -> Path:
    """`path` (a fixture file, or a directory of them) when every fixture there is full, else
    its checked, materialized copy in the cache (fixture_cache.materialized): the file of the
    same name, or the directory of the same layout."""
    files = kdtr_files(path)
    if not any(_is_slim(file) for file in files):
        return path
    return materialized(path, files)


def _is_slim(path: Path) -> bool:
    """Whether a fixture file omits seeded tensors (a broken file is left to its reader)."""
    try:
        with kdtr_format.open(path) as reader:
            return bool(omitted(reader))
    except KdtrError:
        return False


def kdtr_files(path: Path) -> list[Path]:
    """[path] for a file; for a directory, every *.kdtr file under it at any depth (the files
    `refgen materialize` copies: symlinked folders are not entered), in tree order: a folder's
    own files by name, then each subfolder's in name order (tests/golden: tiny.kdtr, tiny2.kdtr,
    then kernels/*.kdtr)."""
    if path.is_file():
        return [path]
    files = [file for file in path.rglob("*.kdtr") if file.is_file()] if path.is_dir() else []
    return sorted(files, key=lambda file: _tree_order(file.relative_to(path)))


def _tree_order(relative: Path) -> tuple[tuple[int, str], ...]:
    """Sort key putting a folder's files (0, name) before its subfolders (1, name)."""
    *folders, name = relative.parts
    return (*((1, folder) for folder in folders), (0, name))


def model_fixture_config(reader, path: Path) -> ModelConfig:
    """The fixture's config; a fixture naming a preset must hold exactly that preset's config."""
    metadata = reader.metadata
    try:
        cfg = ModelConfig.from_dict(metadata["config"])
    except (KeyError, KdtrError) as exc:
        raise ValidateError(f"{path.name}: no valid model config in its metadata ({exc})") from None
    preset = metadata.get("preset")
    if preset in PRESETS and PRESETS[preset] != cfg:
        raise ValidateError(f"{path.name}: its config differs from preset {preset!r} (a fixture of "
                            f"another config?)")
    return cfg


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()      # open reader -> (prefix, weights)


def fixture_weights(reader, prefix: str = "") -> dict[str, np.ndarray]:
    """A model fixture's weights for the cases under `prefix` ("" or "bf16/"), named as
    docs/fixtures.md, as float32 arrays: stored ones (``weights/<name>``) read from the file, a
    checkpoint fixture's decoded from the checkpoint's tensors (each verified by its sha256:
    kdtr_format.checkpoint_tensors). Made once per open reader and prefix, and the same arrays handed to
    every caller (the per-request and the batched checks load them into the adapter), so a run
    holds one copy; freed with the reader. The arrays are shared: an adapter reads them and
    copies what it changes (docs/adapter.md)."""
    kept = _WEIGHTS.get(reader)
    if kept is not None and kept[0] == prefix:
        return kept[1]
    _WEIGHTS.pop(reader, None)                 # another prefix's weights go before these are made
    rebuilt = checkpoint_tensors.CheckpointTensors(reader.metadata)
    weights = {}
    for name in checkpoint_tensors.names(reader, prefix + "weights/"):
        value = np.array(reader[name], dtype=np.float32) if name in reader else rebuilt.array(name)
        weights[name[len(prefix + "weights/"):]] = value if value.dtype == np.float32 else value.astype(np.float32)
    _WEIGHTS[reader] = (prefix, weights)
    return weights
