"""The C header kdtr.h against the Python library: same data, same rejections.

Builds tests/kdtr/c/kdtr_dump.c with the system C compiler (and as C++), then
checks it reads Python-written files of every dtype, rejects the corruption
corpus, and accepts exactly the padding bit flips the Python reader accepts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
from kdtr_format._crc32c import crc32c
from kdtr_testlib import (CORRUPTIONS, RULE_MESSAGES, Parts, every_dtype_tensors, metadata_text,
                          reference_metadata_rule, small_file, with_metadata)

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
    assert case.match in message, "the C header must name the rule the Python reader names"
    assert "offset" in message or "tensor" in message


@pytest.mark.parametrize("name", ["empty", "truncated", "missing"])
def test_rejects_empty_truncated_and_missing_files(dump_c, corpus_dir, name):
    result = _run(dump_c, str(corpus_dir / f"{name}.kdtr"))
    assert result.returncode == 1 and result.stderr.startswith("error: ")


@pytest.mark.parametrize("last", ["e", "q"], ids=["last_tensor_empty", "last_tensor_with_data"])
def test_accepts_exactly_the_padding_bit_flips(dump_c, tmp_path, last):
    path = small_file(tmp_path / "small.kdtr", last=last)
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


@pytest.mark.parametrize("last", ["e", "q"], ids=["last_tensor_empty", "last_tensor_with_data"])
def test_rejects_every_truncation(dump_c, tmp_path, last):
    path = small_file(tmp_path / "small.kdtr", last=last)
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


def test_metadata_rules_agree_with_the_reference(dump_c, tmp_path):
    """Random JSON-ish texts: the C header accepts exactly those the byte-at-a-time reference accepts
    (the Python reader is held to the same reference), naming the same rule."""
    valid = small_file(tmp_path / "small.kdtr").read_bytes()
    rng = np.random.default_rng(11)
    texts = [metadata_text(rng) for _ in range(150)]
    texts += [b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}", b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}", b'{"a": "\\\\", "b": -9223372036854775808}',
              b'{"a": 18446744073709551615, "b": "18446744073709551616", "c": 1.8446744073709551616e19}']
    outcomes = set()
    for i, text in enumerate(texts):
        path = tmp_path / f"m{i}.kdtr"
        path.write_bytes(with_metadata(valid, text))
        rule = reference_metadata_rule(text)
        result = _run(dump_c, str(path))
        outcomes.add(rule)
        if rule is None:
            assert result.returncode == 0, (text, result.stderr)
        else:
            assert result.returncode == 1 and RULE_MESSAGES[rule] in result.stderr, (text, rule, result.stderr)
    assert {None, "depth", "integer", "object"} <= outcomes


def _random_metadata(rng: np.random.Generator, depth: int = 1) -> object:
    kind = int(rng.integers(0, 9 if depth < 64 else 6))
    if kind == 0:
        return int(rng.choice([0, -1, 2**63, 2**64 - 1, -(2**63), 2**53 + 1]))
    if kind == 1:
        return float(rng.choice([0.5, -0.0, 1e308, 5e-324, 1e-300]))
    if kind == 2:
        return "".join(rng.choice(list('ab"\\0123456789{}[]ü🌲 '), int(rng.integers(0, 8))))
    if kind in (3, 4, 5):
        return [None, True, False][kind - 3]
    if kind == 6:
        return [_random_metadata(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    keys = ["k", '"', "\\", "1", "ü"]
    return {str(rng.choice(keys)) + str(i): _random_metadata(rng, depth + 1) for i in range(int(rng.integers(0, 4)))}


def test_whatever_the_writer_writes_the_c_header_accepts(dump_c, tmp_path):
    rng = np.random.default_rng(5)
    for i in range(60):
        metadata = {"v": _random_metadata(rng, 2), "deep": _nested(int(rng.integers(1, 64)))}
        path = tmp_path / f"w{i}.kdtr"
        kdtr_format.write(path, {"b": np.array([True, False])}, metadata=metadata, durable=False)
        result = _run(dump_c, str(path))
        assert result.returncode == 0, (metadata, result.stderr)
        assert json.loads(result.stdout.splitlines()[1].removeprefix("metadata ")) == metadata


def _nested(depth: int) -> list:
    """Lists nested `depth` deep, inside the top-level object and its "deep" key: depth + 1 levels in all."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_a_file_truncated_while_open_fails_verify_cleanly(dump_c, tmp_path):
    path = tmp_path / "shrinking.kdtr"
    kdtr_format.write(path, {"big": np.arange(1 << 20, dtype=np.float64), "after": np.ones(3)})
    result = _run(dump_c, "--shrink", str(path))
    assert result.returncode == 1, f"not a clean failure (signal {-result.returncode if result.returncode < 0 else None})"
    assert "changed while open" in result.stderr


def test_a_fifo_is_refused_without_blocking(dump_c, tmp_path):
    fifo = tmp_path / "pipe.kdtr"
    os.mkfifo(fifo)
    result = _run(dump_c, str(fifo))
    assert result.returncode == 1 and "not a regular file" in result.stderr
