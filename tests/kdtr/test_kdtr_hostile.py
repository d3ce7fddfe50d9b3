"""Hostile input: every malformed file ends in a KdtrError naming the problem, never anything else.

Exhaustive single-bit flips and truncations of a small file, property-based
overwrites (hypothesis), and the hand-made corruption corpus (kdtr_testlib).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdtr_format
from kdtr_format import format as fmt
from kdtr_testlib import CORRUPTIONS, SMALL_METADATA, Parts, every_dtype_tensors, read_everything, small_file

REPO = Path(__file__).resolve().parents[2]


def _outcome(source: Path | bytes, original: tuple[dict, dict[str, bytes]]) -> str:
    """'rejected' on a KdtrError, 'identical' when everything reads back unchanged; anything else fails."""
    try:
        got = read_everything(source)
    except kdtr_format.KdtrError as e:
        assert str(e), "a KdtrError must say what is wrong"
        return "rejected"
    assert got == original, "a mutated file was accepted with different content"
    return "identical"


def _padding(blob: bytes) -> set[int]:
    """Byte positions between tensors that no checksum covers."""
    parts = Parts.of(blob)
    covered = np.zeros(len(blob), bool)
    for r in parts.records:
        covered[int(r["offset"]) : int(r["offset"]) + int(r["nbytes"])] = True
    return {i for i in range(fmt.HEADER_SIZE, fmt.HEADER_SIZE + len(parts.data)) if not covered[i]}


@pytest.fixture(scope="module", params=["e", "q"], ids=["last_tensor_empty", "last_tensor_with_data"])
def valid(request, tmp_path_factory) -> tuple[bytes, tuple[dict, dict[str, bytes]]]:
    path = small_file(tmp_path_factory.mktemp("valid") / "valid.kdtr", last=request.param)
    return path.read_bytes(), read_everything(path)


def test_every_single_bit_flip_is_rejected_unless_it_hits_padding(tmp_path, valid):
    blob, original = valid
    accepted = set()
    for position in range(len(blob)):
        for bit in range(8):
            mutated = bytearray(blob)
            mutated[position] ^= 1 << bit
            if _outcome(mutated, original) == "identical":
                accepted.add(position)
    padding = _padding(blob)
    assert padding, "the sample file must have padding for this test to mean anything"
    assert accepted == padding


def test_every_truncation_is_rejected(tmp_path, valid):
    blob, original = valid
    for length in range(len(blob)):
        assert _outcome(blob[:length], original) == "rejected", length
    path = tmp_path / "cut.kdtr"
    for length in range(0, len(blob), 61):
        path.write_bytes(blob[:length])
        assert _outcome(path, original) == "rejected", length


def test_trailing_garbage_is_rejected(tmp_path, valid):
    blob, original = valid
    path = tmp_path / "long.kdtr"
    for extra in [b"\0", bytes(64), blob[-64:]]:
        path.write_bytes(blob + extra)
        assert _outcome(path, original) == "rejected"


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory) -> list[tuple[bytes, tuple[dict, dict[str, bytes]]]]:
    directory = tmp_path_factory.mktemp("fuzz")
    bases = []
    for name, make in [
        ("small128", lambda p: small_file(p, alignment=128)),
        ("dtypes", lambda p: kdtr_format.write(p, every_dtype_tensors(), metadata=SMALL_METADATA)),
    ]:
        path = directory / f"{name}.kdtr"
        make(path)
        bases.append((path.read_bytes(), read_everything(path)))
    return bases


EDITS = st.lists(st.tuples(st.sampled_from(["anywhere", "index_to_end", "header"]), st.integers(0, 2**20),
                           st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.integers(0, 1), edits=EDITS, cut=st.one_of(st.none(), st.integers(0, 2**20)))
def test_random_overwrites_and_truncations_end_in_kdtr_error_or_identical_data(fuzz_bases, base, edits, cut):
    blob, original = fuzz_bases[base]
    index_offset = fmt.parse_trailer(blob[-fmt.TRAILER_SIZE :]).index_offset
    regions = {"anywhere": (0, len(blob)), "index_to_end": (index_offset, len(blob)), "header": (0, fmt.HEADER_SIZE)}
    mutated = bytearray(blob)
    for region, position, value in edits:
        start, stop = regions[region]
        at = start + position % (stop - start)
        mutated[at : at + len(value)] = value
    if cut is not None:
        mutated = mutated[: cut % (len(mutated) + 1)]
    _outcome(bytes(mutated), original)


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_corruption_corpus_is_rejected_with_a_message_naming_the_problem(corpus_dir, case):
    with pytest.raises(kdtr_format.KdtrError) as caught:
        read_everything(corpus_dir / f"{case.name}.kdtr")
    message = str(caught.value)
    assert case.match in message
    assert "offset" in message or "tensor" in message


@pytest.mark.parametrize("name", ["empty", "truncated"])
def test_empty_and_truncated_files_are_rejected(corpus_dir, name):
    with pytest.raises(kdtr_format.FormatError, match="offset"):
        kdtr_format.open(corpus_dir / f"{name}.kdtr")


def test_unknown_major_is_a_version_error_even_when_nothing_else_parses(tmp_path):
    path = tmp_path / "v2.kdtr"
    path.write_bytes(fmt.MAGIC + struct.pack("<HH", 2, 0) + bytes(200))
    with pytest.raises(kdtr_format.VersionError, match="major version 2"):
        kdtr_format.open(path)


def test_newer_minor_is_read_and_its_reserved_bytes_ignored(tmp_path, valid):
    blob, original = valid
    parts = Parts.of(blob)
    struct.pack_into("<H", parts.header, 10, 7)
    parts.header[40] = 0xAB
    parts.records[0]["reserved"][:] = 5
    parts.trailer["reserved"] = b"\x01" * 12
    path = tmp_path / "v1_7.kdtr"
    path.write_bytes(parts.assemble())
    assert read_everything(path) == original
    with kdtr_format.open(path) as f:
        assert f.version == (1, 7)


@pytest.mark.parametrize("name", ["huge_tensor_count", "huge_names_size", "huge_metadata_size", "shape_overflow",
                                  "nbytes_huge", "offset_out_of_bounds"])
def test_huge_claimed_sizes_allocate_nothing_big(corpus_dir, name):
    tracemalloc.start()
    try:
        with pytest.raises(kdtr_format.FormatError):
            kdtr_format.open(corpus_dir / f"{name}.kdtr")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_data_corruption_is_caught_lazily_and_by_verify(corpus_dir):
    with kdtr_format.open(corpus_dir / "data_checksum.kdtr") as f:
        assert f["b/c"].tolist() == [[1, 2], [3, 4]]
        with pytest.raises(kdtr_format.ChecksumError, match="tensor 'a', offset 64"):
            f.verify()


def test_a_file_truncated_while_open_fails_verify_with_an_error_not_a_bus_error(tmp_path):
    """Run apart: a reader that touched the mapping past the new end of file would die of SIGBUS."""
    path = tmp_path / "shrinking.kdtr"
    kdtr_format.write(path, {"big": np.arange(1 << 20, dtype=np.float64), "after": np.ones(3)})
    script = textwrap.dedent(f"""
        import os, kdtr_format
        f = kdtr_format.open({str(path)!r})
        os.truncate({str(path)!r}, os.path.getsize({str(path)!r}) // 2)
        try:
            f.verify()
        except kdtr_format.FormatError as e:
            print(e)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert "changed while open" in result.stdout and "tensor 'big'" in result.stdout


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.kdtr"
    os.mkfifo(fifo)
    script = f"import kdtr_format; kdtr_format.open({str(fifo)!r})"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "OSError" in result.stderr and "Not a regular file" in result.stderr


def test_bool_bytes_other_than_0_and_1_are_refused_on_access_and_by_verify(corpus_dir):
    with kdtr_format.open(corpus_dir / "bool_byte_2.kdtr") as f:
        assert f["a"].tolist() == [0, 1, 2, 3, 4]
        for access in (f.__getitem__, f.raw, f.torch):
            with pytest.raises(kdtr_format.FormatError, match=r"bool byte 2 is not 0 or 1 \(tensor 'b/c', offset 130\)"):
                access("b/c")
    with kdtr_format.open(corpus_dir / "bool_byte_2.kdtr") as f:
        with pytest.raises(kdtr_format.FormatError, match="bool byte 2"):
            f.verify()
