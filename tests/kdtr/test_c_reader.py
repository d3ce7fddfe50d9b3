"""The C header kdtr.h against the Python library: same data, same rejections.

Builds tests/kdtr/c/kdtr_dump.c with the system C compiler (and as C++), then
checks it reads Python-written files of every dtype, rejects the corruption
corpus, and accepts exactly the padding bit flips the Python reader accepts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
from kdtr_format._crc32c import crc32c
from kdtr_testlib import CORRUPTIONS, Parts, every_dtype_tensors, small_file

HERE = Path(__file__).resolve().parent
INCLUDE = HERE.parents[1] / "kdtr_format" / "include"
SOURCE = HERE / "c" / "kdtr_dump.c"


def _build(tmp_path_factory, compiler: str, flags: list[str]) -> Path:
    path = shutil.which(compiler)
    if path is None:
        pytest.skip(f"no `{compiler}` compiler on PATH: the C reader is not built")
    out = tmp_path_factory.mktemp(f"build_{compiler.replace('+', 'x')}") / "kdtr_dump"
    subprocess.run([path, *flags, "-Wall", "-Wextra", "-Werror", "-O2", f"-I{INCLUDE}", "-o", str(out), str(SOURCE)],
                   check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def dump_c(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "cc", ["-std=c99", "-Wpedantic"])


@pytest.fixture(scope="module")
def dump_cxx(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "c++", ["-x", "c++", "-std=c++11"])


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


def _expected_dump(path: Path) -> list[str]:
    """What kdtr_dump must print, computed by the Python reader."""
    with kdtr_format.open(path) as f:
        lines = [f"version {f.version[0]}.{f.version[1]} alignment {f.alignment} tensors {len(f)}"]
        for name in f.names():
            info, raw = f.info(name), f.raw(name)
            shape = ",".join(str(d) for d in info.shape)
            lines.append(f"{name}\t{info.dtype}\t({shape})\t{info.offset}\t{info.nbytes}\t{crc32c(raw)}\t{int(raw.sum(dtype=np.uint64))}")
    return lines


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("language", ["c", "cxx"])
def test_reads_python_written_files_of_every_dtype(request, tmp_path, alignment, language):
    binary = request.getfixturevalue(f"dump_{language}")
    path = tmp_path / "all.kdtr"
    metadata = {"preset": "tiny", "nested": {"ü": [1, 2.5, None, True]}}
    kdtr_format.write(path, every_dtype_tensors(seed=alignment), metadata=metadata, alignment=alignment)
    result = _run(binary, str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert json.loads(lines.pop(1).removeprefix("metadata ")) == metadata
    assert lines == _expected_dump(path)


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_rejects_the_corruption_corpus(dump_c, corpus_dir, case):
    result = _run(dump_c, str(corpus_dir / f"{case.name}.kdtr"))
    if not case.c:
        # JSON syntax is checked only by readers that parse JSON; the header hands the text over raw
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message
    assert "offset" in message or "tensor" in message


@pytest.mark.parametrize("name", ["empty", "truncated", "missing"])
def test_rejects_empty_truncated_and_missing_files(dump_c, corpus_dir, name):
    result = _run(dump_c, str(corpus_dir / f"{name}.kdtr"))
    assert result.returncode == 1 and result.stderr.startswith("error: ")


def test_accepts_exactly_the_padding_bit_flips(dump_c, tmp_path):
    path = small_file(tmp_path / "small.kdtr")
    blob = path.read_bytes()
    verdicts = _run(dump_c, "--flips", str(path)).stdout.strip()
    assert len(verdicts) == 8 * len(blob)
    accepted = {i // 8 for i, v in enumerate(verdicts) if v == "0"}
    parts = Parts.of(blob)
    covered = set()
    for r in parts.records:
        covered.update(range(int(r["offset"]), int(r["offset"]) + int(r["nbytes"])))
    padding = set(range(64, 64 + len(parts.data))) - covered
    assert padding and accepted == padding
    assert all(verdicts[8 * i : 8 * i + 8] == "00000000" for i in padding)


def test_rejects_every_truncation(dump_c, tmp_path):
    path = small_file(tmp_path / "small.kdtr")
    verdicts = _run(dump_c, "--truncations", str(path)).stdout.strip()
    assert verdicts == "1" * path.stat().st_size


def test_newer_minor_is_read(dump_c, tmp_path):
    parts = Parts.of(small_file(tmp_path / "small.kdtr").read_bytes())
    parts.header[10] = 3
    parts.header[50] = 0xFF
    path = tmp_path / "v1_3.kdtr"
    path.write_bytes(parts.assemble())
    result = _run(dump_c, str(path))
    assert result.returncode == 0 and result.stdout.startswith("version 1.3 ")
