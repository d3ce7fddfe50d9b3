"""Finding the fixtures: a directory or file given by the user, the committed tests/golden,
or a cache directory that `refgen generate --all --full` fills once, all or nothing; and a
model fixture's weights, read once per open fixture and shared by every check that loads them.

The committed fixtures are slim (docs/fixtures.md, "Slim and full"): they omit the tensors
drawn from a seed. Fixtures found slim are materialized once, by `python -m refgen
materialize` (the engine runs refgen, never imports it), into a cache directory named by
their content: <KDTREE_CACHE_DIR, default ~/.cache/kdtree>/golden-<sha256 of the files>/.
All or nothing: refgen writes into a staging directory that is then renamed into place;
a process that loses the race to another (pytest-xdist workers) takes the winner's. A
fixture made from a checkpoint holds no weights either, but needs no materializing: its
weights are the checkpoint's tensors, which kdtr_format.checkpoint_tensors decodes here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np

import kdtr_format
from kdtr_format import PRESETS, KdtrError, ModelConfig, checkpoint_tensors

from .reports.report import ValidateError

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
SEEDED_KEY = "seeded_tensors"        # refgen/files.py: the tensors a slim fixture omits


def cache_root() -> Path:
    """Where materialized and generated fixtures are kept: $KDTREE_CACHE_DIR, else ~/.cache/kdtree."""
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree")


def find_fixtures(fixtures: str | os.PathLike | None, generate: bool = True) -> Path:
    """The full fixtures to check: `fixtures` if given (one .kdtr file, or a directory holding
    .kdtr files), else the committed tests/golden, else a cache directory filled by
    `python -m refgen generate --all --full`; slim ones materialized (`full_fixtures`)."""
    if fixtures is not None:
        path = Path(fixtures)
        if path.is_file():
            if path.suffix != ".kdtr":
                raise ValidateError(f"fixture file {path} is not a .kdtr file")
            return full_fixtures(path)
        if not path.is_dir():
            raise ValidateError(f"fixture directory or file {path} does not exist")
        if not kdtr_files(path):
            raise ValidateError(f"no .kdtr fixtures in {path}")
        return full_fixtures(path)
    if kdtr_files(GOLDEN_DIR):
        return full_fixtures(GOLDEN_DIR)
    cache = cache_root() / "fixtures"
    if kdtr_files(cache):
        return cache
    if not generate:
        raise ValidateError(f"no fixtures in {GOLDEN_DIR} or {cache}")
    staging = _refgen_into(cache.parent, "generate", "--all", "--full", what="no fixtures found and `refgen generate`")
    if cache.exists():
        cache.rmdir()
    os.replace(staging, cache)
    return cache


def full_fixtures(path: Path) -> Path:
    """`path` (a fixture file, or a directory of them) when every fixture there is full, else
    its materialized copy in the cache: the file of the same name, or the directory of the
    same layout."""
    files = kdtr_files(path)
    if not any(_is_slim(file) for file in files):
        return path
    target = cache_root() / f"golden-{_content_key(path, files)}"
    if not target.is_dir():
        staging = _refgen_into(cache_root(), "materialize", str(path), what=f"{path} holds slim fixtures and "
                                                                            "`refgen materialize`")
        try:
            os.rename(staging, target)
        except OSError:                  # another process materialized the same fixtures first
            shutil.rmtree(staging, ignore_errors=True)
            if not target.is_dir():
                raise
    return target / path.name if path.is_file() else target


def _is_slim(path: Path) -> bool:
    """Whether a fixture file omits seeded tensors (a broken file is left to its reader)."""
    try:
        with kdtr_format.open(path) as reader:
            recorded = reader.metadata.get(SEEDED_KEY)
            return isinstance(recorded, dict) and not set(recorded) <= set(reader.names())
    except KdtrError:
        return False


def _content_key(path: Path, files: list[Path]) -> str:
    """sha256 (16 hex digits) of the fixtures' names and bytes."""
    root = path if path.is_dir() else path.parent
    digest = hashlib.sha256()
    for file in files:
        digest.update(os.fsencode(file.relative_to(root)) + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _refgen_into(parent: Path, *command: str, what: str) -> Path:
    """A new staging directory under `parent` filled by `python -m refgen COMMAND... --out STAGING`;
    ValidateError (refgen's last line) and nothing left behind when refgen fails."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fixtures.", dir=parent))
    except OSError as exc:
        raise ValidateError(f"cannot write the fixture cache {parent}: {exc.strerror or exc} (set KDTREE_CACHE_DIR "
                            "to a writable directory)") from None
    staging.chmod(0o755)
    run = subprocess.run([sys.executable, "-m", "refgen", *command, "--out", str(staging)],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not kdtr_files(staging):
        shutil.rmtree(staging, ignore_errors=True)
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValidateError(f"{what} failed: {last[0]}")
    return staging


def kdtr_files(path: Path) -> list[Path]:
    """The fixture files of a directory (its *.kdtr and kernels/*.kdtr), or [path] for a file."""
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.kdtr")) + sorted(path.glob("kernels/*.kdtr")) if path.is_dir() else []
    return [file for file in files if file.is_file()]


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
