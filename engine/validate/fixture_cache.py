"""The fixture cache: slim fixtures materialized once, kept by content, trusted only as far as
they are checked (docs/fixtures.md, "Slim and full").

    copy = materialized(path, files)    # <cache_root()>/golden-<key>/, the layout of `path`

- The key is the sha256 of the slim files' names and bytes: a changed fixture gets a copy of
  its own, never a stale one.
- `python -m refgen materialize` (the engine runs refgen, never imports it) fills a staging
  directory `.fixtures.*` that is then renamed into place, all or nothing; a process that
  loses the race to another (pytest-xdist workers) takes the winner's.
- A materialized copy must be what its slim file says: the same metadata (but content_hash),
  the slim file's tensors byte for byte, and each seeded tensor of the dtype, shape and
  sha256 the slim file records. It is checked once, and a stamp (`.verified.json` in the copy)
  records what was checked: the copy's size, mtime_ns, ctime_ns and inode and the slim file's
  sha256; any of them different (a file copied over it, a weight edited in place, another
  slim file) and it is checked again. A copy that fails is refused naming the file and what
  differs, and how to rebuild it (remove the directory).
- A staging directory is locked (flock) by the process filling it, and the lock is passed to
  the refgen it runs. An interrupted materialization removes its staging directory (Ctrl-C is
  KeyboardInterrupt here; the supervised child gets SIGTERM, door/supervise.py); one left by a
  process that was killed outright is removed by the next run that uses the cache, once no
  process holds its lock. Creating a staging directory and removing stale ones are
  serialized by a lock on `<cache_root()>/.lock`, so a concurrent run's is never taken for
  stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

import kdtr_format
from kdtr_format import KdtrError
from kdtr_format.seeded import recorded_seeded

from .reports.report import ValidateError

REPO_ROOT = Path(__file__).resolve().parents[2]
STAGING_PREFIX = ".fixtures."
STAMP = ".verified.json"
LOCK = ".lock"


def cache_root() -> Path:
    """Where materialized and generated fixtures are kept: $KDTREE_CACHE_DIR, else ~/.cache/kdtree."""
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree")


def materialized(path: Path, files: list[Path]) -> Path:
    """The checked, materialized copy of the slim fixtures `files` of `path` (a fixture file, or
    a directory of them): the file of the same name, or the directory of the same layout."""
    root = path if path.is_dir() else path.parent
    digests = {file.relative_to(root): _file_sha256(file) for file in files}
    key = hashlib.sha256(b"".join(os.fsencode(name) + b"\0" + digest.encode() + b"\n"
                                  for name, digest in digests.items())).hexdigest()[:16]
    target = cache_root() / f"golden-{key}"
    remove_stale_staging(cache_root())
    if not target.is_dir():
        with refgen_into(cache_root(), "materialize", str(path),
                         what=f"{path} holds slim fixtures and `refgen materialize`") as staging:
            try:
                os.rename(staging, target)
            except OSError:              # another process materialized the same fixtures first
                if not target.is_dir():
                    raise
    _check_copies(target, root, digests)
    return target / path.name if path.is_file() else target


@contextlib.contextmanager
def refgen_into(parent: Path, *command: str, what: str) -> Iterator[Path]:
    """A new staging directory under `parent`, filled by `python -m refgen COMMAND... --out
    STAGING` and locked until the block ends (rename it into place there); removed unless the
    block renamed it, and whatever the way out (refgen failing: ValidateError with refgen's last
    line; Ctrl-C)."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with _locked(parent / LOCK):
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))
            held = os.open(staging, os.O_RDONLY)
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)     # new: no one else holds it
    except OSError as exc:
        raise ValidateError(f"cannot write the fixture cache {parent}: {exc.strerror or exc} (set KDTREE_CACHE_DIR "
                            "to a writable directory)") from None
    try:
        staging.chmod(0o755)
        run = subprocess.run([sys.executable, "-m", "refgen", *command, "--out", str(staging)],
                             cwd=REPO_ROOT, capture_output=True, text=True, pass_fds=(held,))
        if run.returncode != 0 or not any(staging.rglob("*.kdtr")):
            last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ValidateError(f"{what} failed: {last[0]}")
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)         # gone already when renamed into place
        os.close(held)


def remove_stale_staging(parent: Path) -> None:
    """Remove the staging directories under `parent` that no process holds (module docstring)."""
    if not parent.is_dir():
        return
    with contextlib.suppress(OSError), _locked(parent / LOCK):
        for staging in parent.glob(STAGING_PREFIX + "*"):
            try:
                held = os.open(staging, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:              # a live run's
                continue
            else:
                shutil.rmtree(staging, ignore_errors=True)
            finally:
                os.close(held)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """flock(path) held for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_copies(target: Path, root: Path, digests: dict[Path, str]) -> None:
    """Each copy under `target` is the materialization of its slim file under `root` (module
    docstring), checked again only where the stamp no longer holds; ValidateError naming the
    first that is not."""
    stamp_path = target / STAMP
    try:
        stamps = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamps = {}
    stamps = stamps if isinstance(stamps, dict) else {}
    checked = {}
    for name, digest in digests.items():
        copy = target / name
        try:
            info = copy.stat()
        except OSError as exc:
            raise _not_the_copy(target, copy, root / name, f"it cannot be read ({exc.strerror})") from None
        stamp = [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, digest]
        if stamps.get(os.fsdecode(name)) != stamp:
            problem = _copy_problem(copy, root / name)
            if problem is not None:
                raise _not_the_copy(target, copy, root / name, problem)
        checked[os.fsdecode(name)] = stamp
    if checked != stamps:
        _write_stamps(stamp_path, checked)


def _write_stamps(path: Path, stamps: dict) -> None:
    """The stamps at `path`, replaced whole; a read-only cache keeps none (checked on every run)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(stamps, file)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _not_the_copy(target: Path, copy: Path, source: Path, problem: str) -> ValidateError:
    return ValidateError(f"the fixture cache's {copy} is not the materialized {source}: {problem}; remove "
                         f"{target} (the next run materializes it again)")


def _copy_problem(copy: Path, source: Path) -> str | None:
    """What makes `copy` other than the materialization of the slim `source`, else None."""
    try:
        with kdtr_format.open(source) as slim, kdtr_format.open(copy) as full:
            if _without_hash(slim.metadata) != _without_hash(full.metadata):
                return "its metadata differs from the slim file's (another fixture?)"
            recorded = recorded_seeded(slim.metadata)
            extra = set(full.names()) - set(slim.names()) - set(recorded)
            missing = (set(slim.names()) | set(recorded)) - set(full.names())
            if extra or missing:
                name = sorted(extra or missing)[0]
                return f"it holds {name}, which the slim file does not name" if extra else f"it lacks {name}"
            for name in slim.names():
                if _le_bytes(full[name]) != _le_bytes(slim[name]) or full[name].dtype != slim[name].dtype:
                    return f"{name} differs from the slim file's"
            for name, record in recorded.items():
                array = np.asarray(full[name])
                found = [str(array.dtype), list(array.shape), hashlib.sha256(_le_bytes(array)).hexdigest()]
                if found != [record.get("dtype"), list(record.get("shape", [])), record.get("sha256")]:
                    return f"{name} is not the tensor the slim file records (dtype, shape and sha256)"
    except KdtrError as exc:
        return str(exc)
    return None


def _without_hash(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "content_hash"}


def _le_bytes(array: np.ndarray) -> bytes:
    """The array's little-endian C-order bytes: what a seeded tensor's recorded sha256 hashes
    (docs/fixtures.md)."""
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
