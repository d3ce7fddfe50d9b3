"""KDTR against safetensors (numpy API), npz and h5py, side by side in one run (PERFORMANCE.md).

Default: a small file (cheap; under --benchmark-disable each runs once).
KDTREE_BENCH=1: about 1 GiB in 2048 float32 tensors, as PERFORMANCE.md asks.
KDTREE_BENCH=ci: 64 MiB in 256 tensors, what ci/bench_check.py measures.
Compare within a group: open, random, read (with every checksum for KDTR), write
(KDTR fsyncs by default: compare kdtr with npz_fsync, kdtr_not_durable with npz).

    KDTREE_BENCH=1 PYTHONPATH=. python3 -m pytest tests/kdtr/test_bench_kdtr.py \\
        --benchmark-enable --benchmark-columns=min,median,max,rounds --benchmark-json=/tmp/kdtr-bench.json
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

import kdtr_format
from bench_record import record

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed")
from safetensors import safe_open  # noqa: E402

SIZES = {"1": (2048, 131072), "ci": (256, 65536)}       # 1 GiB; 64 MiB (the CI gate's ratio checks)
BIG = os.environ.get("KDTREE_BENCH") in SIZES
COUNT, ELEMENTS = SIZES.get(os.environ.get("KDTREE_BENCH", ""), (64, 4096))   # default: 1 MiB of float32


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    block = rng.standard_normal(ELEMENTS, dtype=np.float32)
    return {f"weights/layers.{i}.w": np.roll(block, i) for i in range(COUNT)}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tensors) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("bench")
    paths = {kind: directory / f"data.{kind}" for kind in ("kdtr", "safetensors", "npz", "h5")}
    kdtr_format.write(paths["kdtr"], tensors)
    safetensors_numpy.save_file(tensors, paths["safetensors"])
    np.savez(paths["npz"], **tensors)
    _write_h5(paths["h5"], tensors)
    yield paths
    for path in paths.values():
        path.unlink()


def _write_h5(path: Path, tensors: dict[str, np.ndarray]) -> None:
    with h5py.File(path, "w") as f:
        for name, array in tensors.items():
            f.create_dataset(name, data=array)


def _read_kdtr(path: Path) -> int:
    with kdtr_format.open(path) as f:
        return sum(f[name].nbytes for name in f.names())  # first access checks each CRC32C


READERS = {
    "kdtr_verified": _read_kdtr,
    "safetensors": lambda path: sum(a.nbytes for a in safetensors_numpy.load_file(path).values()),
    "npz": lambda path: _read_npz(path),
    "h5py": lambda path: _read_h5(path),
}


def _read_npz(path: Path) -> int:
    with np.load(path) as archive:
        return sum(archive[name].nbytes for name in archive.files)


def _read_h5(path: Path) -> int:
    total = 0
    with h5py.File(path, "r") as f:
        def visit(_: str, node) -> None:
            nonlocal total
            if isinstance(node, h5py.Dataset):
                total += node[()].nbytes
        f.visititems(visit)
    return total


@pytest.mark.benchmark(group="read")
@pytest.mark.parametrize("reader", list(READERS))
def test_full_read(benchmark, files, reader):
    kind = {"kdtr_verified": "kdtr"}.get(reader, reader.replace("h5py", "h5"))
    record(benchmark, {"bytes": COUNT * ELEMENTS * 4, "tensors": COUNT})
    assert benchmark(READERS[reader], files[kind]) == COUNT * ELEMENTS * 4


def _fsynced(write):
    """The same write, then fsync of the file: the durability a KDTR commit has by default."""
    def durable(path: Path, tensors: dict[str, np.ndarray]) -> None:
        write(path, tensors)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return durable


WRITERS = {
    "kdtr": kdtr_format.write,
    "kdtr_not_durable": lambda path, tensors: kdtr_format.write(path, tensors, durable=False),
    "npz": lambda path, tensors: np.savez(path, **tensors),
    "npz_fsync": _fsynced(lambda path, tensors: np.savez(path, **tensors)),
    "safetensors": lambda path, tensors: safetensors_numpy.save_file(tensors, path),
    "h5py": _write_h5,
}


@pytest.mark.benchmark(group="write")
@pytest.mark.parametrize("writer", list(WRITERS))
def test_write(benchmark, tmp_path, tensors, writer):
    path = tmp_path / f"out.{'npz' if writer.startswith('npz') else writer}"
    record(benchmark, {"bytes": COUNT * ELEMENTS * 4, "tensors": COUNT})
    benchmark.pedantic(WRITERS[writer], args=(path, tensors), rounds=3 if BIG else 5, iterations=1)
    assert path.stat().st_size >= COUNT * ELEMENTS * 4
    path.unlink()


def _pick_kdtr(path: Path, picks: list[str]) -> float:
    with kdtr_format.open(path) as f:
        return sum(float(f[name][-1]) for name in picks)


def _pick_safetensors(path: Path, picks: list[str]) -> float:
    with safe_open(path, framework="numpy") as f:
        return sum(float(f.get_tensor(name)[-1]) for name in picks)


def _pick_h5(path: Path, picks: list[str]) -> float:
    with h5py.File(path, "r") as f:
        return sum(float(f[name][-1]) for name in picks)


PICKERS = {"kdtr": _pick_kdtr, "safetensors": _pick_safetensors, "h5": _pick_h5}


@pytest.mark.benchmark(group="open")
@pytest.mark.parametrize("kind", list(PICKERS))
def test_open(benchmark, files, kind):
    """Open and close, reading only what each format needs to list its tensors."""
    record(benchmark, {"bytes": COUNT * ELEMENTS * 4, "tensors": COUNT})
    assert benchmark(PICKERS[kind], files[kind], []) == 0


@pytest.mark.benchmark(group="random")
@pytest.mark.parametrize("kind", list(PICKERS))
def test_random_access(benchmark, files, tensors, kind):
    """Open, then read 16 tensors picked at random (KDTR checks each one's CRC32C)."""
    names = list(tensors)
    picks = [names[i] for i in np.random.default_rng(1).integers(0, len(names), 16)]
    expected = sum(float(tensors[n][-1]) for n in picks)
    record(benchmark, {"bytes": COUNT * ELEMENTS * 4, "tensors": COUNT})
    assert benchmark(PICKERS[kind], files[kind], picks) == pytest.approx(expected)
