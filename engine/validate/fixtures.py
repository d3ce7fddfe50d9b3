"""Finding the fixtures: a directory given by the user, the committed tests/golden,
or a cache directory that `refgen generate --all` fills once, all or nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kdtr_format import PRESETS, KdtrError, ModelConfig

from .report import ValidateError

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"


def find_fixtures(fixtures: str | os.PathLike | None, generate: bool = True) -> Path:
    """The fixtures to check: `fixtures` if given (one .kdtr file, or a directory holding
    .kdtr files), else the committed tests/golden, else a cache directory filled by
    `python -m refgen generate --all`."""
    if fixtures is not None:
        path = Path(fixtures)
        if path.is_file():
            if path.suffix != ".kdtr":
                raise ValidateError(f"fixture file {path} is not a .kdtr file")
            return path
        if not path.is_dir():
            raise ValidateError(f"fixture directory or file {path} does not exist")
        if not _kdtr_files(path):
            raise ValidateError(f"no .kdtr fixtures in {path}")
        return path
    if _kdtr_files(GOLDEN_DIR):
        return GOLDEN_DIR
    cache = Path(os.environ.get("KDTREE_CACHE_DIR", Path.home() / ".cache" / "kdtree")) / "fixtures"
    if _kdtr_files(cache):
        return cache
    if not generate:
        raise ValidateError(f"no fixtures in {GOLDEN_DIR} or {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fixtures.", dir=cache.parent))   # all or nothing
    staging.chmod(0o755)
    run = subprocess.run([sys.executable, "-m", "refgen", "generate", "--all", "--out", str(staging)],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not _kdtr_files(staging):
        shutil.rmtree(staging, ignore_errors=True)
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValidateError(f"no fixtures found and `refgen generate` failed: {last[0]}")
    if cache.exists():
        cache.rmdir()
    os.replace(staging, cache)
    return cache


def _kdtr_files(path: Path) -> list[Path]:
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
