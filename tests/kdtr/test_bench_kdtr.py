"""KDTR against safetensors (numpy API), npz and h5py, side by side in one run (the KDTR targets of docs/status.md).

Default: a small file (cheap; under --benchmark-disable each runs once).
KDTREE_BENCH=1: about 1 GiB in 2048 float32 tensors, the size of docs/results/kdtr-bench.md; 1,000,000 tiny
tensors; metadata at the 64 MiB cap; `kdtr inspect` on 200,000 tensors.
KDTREE_BENCH=ci: 64 MiB in 256 tensors, what ci/bench_check.py measures.
Compare within a group: open, random, read (with every checksum for KDTR), write
(KDTR fsyncs by default: compare kdtr with npz_fsync, kdtr_not_durable with npz);
many (every tensor of a file of tiny ones, KDTR at two sizes to show the cost per tensor stays
flat, safetensors alongside); metadata (opening a file whose metadata is the costliest shape to
check, against reading and checksumming its bytes, and against json.loads of the text);
inspect (summary and --all, against listing the names).

    KDTREE_BENCH=1 PYTHONPATH=. python3 -m pytest tests/kdtr/test_bench_kdtr.py \\
        --benchmark-enable --benchmark-columns=min,median,max,rounds --benchmark-json=/tmp/kdtr-bench.json
"""

from __future__ import annotations

import json
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


MANY = 1_000_000 if os.environ.get("KDTREE_BENCH") == "1" else 20_000
METADATA_BYTES = 64 << 20 if os.environ.get("KDTREE_BENCH") == "1" else 4 << 20
INSPECT = 200_000 if os.environ.get("KDTREE_BENCH") == "1" else 20_000


def _many_kdtr(path: Path, count: int) -> Path:
    with kdtr_format.Writer(path, durable=False) as w:
        x = np.zeros(2, np.float32)
        for i in range(count):
            w.add(f"cases/{i}/x", x)
    return path


@pytest.fixture(scope="module")
def many_files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("many")
    paths = {f"kdtr_{MANY}": _many_kdtr(directory / "many.kdtr", MANY),
             f"kdtr_{MANY // 10}": _many_kdtr(directory / "tenth.kdtr", MANY // 10)}
    x = np.zeros(2, np.float32)
    paths[f"safetensors_{MANY}"] = directory / "many.safetensors"
    safetensors_numpy.save_file({f"cases/{i}/x": x for i in range(MANY)}, paths[f"safetensors_{MANY}"])
    yield paths
    for path in paths.values():
        path.unlink()


def _read_every_kdtr(path: Path) -> int:
    with kdtr_format.open(path) as f:
        return sum(f[name].size for name in f.names())


def _read_every_safetensors(path: Path) -> int:
    with safe_open(path, framework="numpy") as f:
        return sum(f.get_tensor(name).size for name in f.keys())


@pytest.mark.benchmark(group="many")
@pytest.mark.parametrize("case", [f"kdtr_{MANY}", f"kdtr_{MANY // 10}", f"safetensors_{MANY}"])
def test_read_every_tiny_tensor(benchmark, many_files, case):
    """Open and read every tensor; the median divided by the count is the cost per tensor."""
    read = _read_every_kdtr if case.startswith("kdtr") else _read_every_safetensors
    count = int(case.rsplit("_", 1)[1])
    assert benchmark.pedantic(read, args=(many_files[case],), rounds=3, iterations=1) == 2 * count


@pytest.fixture(scope="module")
def metadata_file(tmp_path_factory) -> tuple[Path, bytes]:
    """A file whose metadata is `{"a": [[], [], ...]}` of METADATA_BYTES: a value every 3 bytes."""
    from kdtr_testlib import small_file, with_metadata

    directory = tmp_path_factory.mktemp("metadata")
    text = b'{"a":[' + b"[]," * ((METADATA_BYTES - 16) // 3) + b"0]}"
    path = directory / "metadata.kdtr"
    path.write_bytes(with_metadata(small_file(directory / "small.kdtr").read_bytes(), text))
    yield path, text
    path.unlink()


def _read_and_checksum(path: Path) -> int:
    from kdtr_format._crc32c import crc32c

    return crc32c(path.read_bytes()) >= 0


METADATA_CASES = {
    "kdtr_open": lambda path, text: len(kdtr_format.open(path)) == 4,
    "read_and_crc32c": lambda path, text: _read_and_checksum(path),
    "json_loads": lambda path, text: isinstance(json.loads(text), dict),
}


@pytest.mark.benchmark(group="metadata")
@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_open_with_metadata_at_the_cap(benchmark, metadata_file, case):
    """Opening checks the metadata's framing (UTF-8, depth, integers) but does not parse it: compare
    with the floor (read the file, checksum it) and with what parsing alone would cost."""
    path, text = metadata_file
    assert benchmark.pedantic(METADATA_CASES[case], args=(path, text), rounds=3, iterations=1)


@pytest.fixture(scope="module")
def inspect_file(tmp_path_factory) -> Path:
    path = _many_kdtr(tmp_path_factory.mktemp("inspect") / "inspect.kdtr", INSPECT)
    yield path
    path.unlink()


def _inspect(path: Path, *options: str) -> int:
    from click.testing import CliRunner

    from kdtr_format.cli import main

    result = CliRunner().invoke(main, ["inspect", str(path), "--no-metadata", *options])
    assert result.exit_code == 0, result.output
    return result.stdout.count("\n")


def _list_names(path: Path) -> int:
    with kdtr_format.open(path) as f:
        return len("\n".join(f.names()).splitlines()) + 2


INSPECT_CASES = {"summary": lambda path: _inspect(path), "all": lambda path: _inspect(path, "--all"),
                 "names_only": _list_names}


@pytest.mark.benchmark(group="inspect")
@pytest.mark.parametrize("case", list(INSPECT_CASES))
def test_inspect_many_tensors(benchmark, inspect_file, case):
    lines = benchmark.pedantic(INSPECT_CASES[case], args=(inspect_file,), rounds=3, iterations=1)
    assert lines > (INSPECT if case != "summary" else 1000)
