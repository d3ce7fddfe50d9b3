"""KDTR writer and reader: round trips, API contract, writer refusals, atomic commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import kdtr_format
from kdtr_format import format as fmt
from kdtr_format._crc32c import crc32c
from kdtr_testlib import every_dtype_tensors

REPO = Path(__file__).resolve().parents[2]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Identical dtype, shape and bits (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("alignment", [64, 256, 4096])
def test_every_dtype_round_trips_bit_exact(tmp_path, alignment):
    tensors = every_dtype_tensors()
    path = tmp_path / "all.kdtr"
    kdtr_format.write(path, tensors, alignment=alignment)
    with kdtr_format.open(path) as f:
        assert f.names() == list(tensors)
        assert len(f) == len(tensors)
        for name, expected in tensors.items():
            got = f[name]
            assert _same(got, expected), name
            assert not got.flags.writeable
            info = f.info(name)
            assert info.offset % alignment == 0
            assert info.shape == expected.shape
            assert info.dtype == expected.dtype.name
        f.verify()


def test_int4_is_packed_low_nibble_first(tmp_path):
    path = tmp_path / "q.kdtr"
    kdtr_format.write(path, {"q": np.array([1, -2, 7], ml_dtypes.int4)})
    with kdtr_format.open(path) as f:
        # element 0 = 1 in the low nibble, element 1 = -2 (0xE) in the high nibble, element 2 = 7 then a zero nibble
        assert f.raw("q").tolist() == [0xE1, 0x07]
        assert f.info("q").nbytes == 2


def test_views_are_zero_copy_over_the_mapping(tmp_path):
    path = tmp_path / "z.kdtr"
    kdtr_format.write(path, {"x": np.arange(1000, dtype=np.float64)})
    with kdtr_format.open(path) as f:
        view = f["x"]
        assert not view.flags.owndata
        assert view.ctypes.data == f.raw("x").ctypes.data
        with pytest.raises(ValueError):
            view[0] = 1.0


TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_round_trip(tmp_path, dtype):
    source = (torch.randn(3, 4, dtype=torch.float64) * 50).to(dtype)
    path = tmp_path / "t.kdtr"
    kdtr_format.write(path, {"t": source, "t0": source[0, 0], "col": source[:, 1]})
    with kdtr_format.open(path) as f:
        for name, expected in [("t", source), ("t0", source[0, 0]), ("col", source[:, 1])]:
            got = f.torch(name)
            assert got.dtype == dtype and got.shape == expected.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8)), name
        assert f.info("t").dtype == str(dtype).removeprefix("torch.")


def test_torch_and_numpy_agree_on_exotic_dtypes(tmp_path):
    tensors = every_dtype_tensors()
    path = tmp_path / "all.kdtr"
    kdtr_format.write(path, tensors)
    with kdtr_format.open(path) as f:
        for name in ["bfloat16", "float8_e4m3fn", "float8_e5m2"]:
            assert f.torch(name).dtype == getattr(torch, name)
            assert np.array_equal(f.torch(name).float().numpy(), f[name].astype(np.float32))
        assert torch.equal(f.torch("int4"), torch.from_numpy(tensors["int4"].astype(np.int8)))


def test_torch_is_not_imported_by_kdtr_format():
    code = "import sys, kdtr_format; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_writing_to_a_torch_tensor_never_reaches_the_file(tmp_path):
    path = tmp_path / "w.kdtr"
    kdtr_format.write(path, {"x": np.zeros(4, np.float32)})
    with kdtr_format.open(path) as f:
        f.torch("x").fill_(7.0)
    with kdtr_format.open(path) as f:
        f.verify()
        assert f["x"].tolist() == [0.0] * 4


def _nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


METADATA_CASES = {
    "empty": {},
    "nested": {"a": {"b": {"c": [1, [2, [3, {"d": None}]]]}}},
    "unicode": {"ключ": "値", "emoji": "🌲", "escape": "\"\\\n\t"},
    "floats": {"tiny": 5e-324, "big": 1.7976931348623157e308, "neg_zero": -0.0, "third": 1 / 3},
    "ints": {"big": 2**63 + 12345, "max": 2**64 - 1, "min": -(2**63), "list": [-(2**63), 2**64 - 1, 0]},
    "bools_null": {"t": True, "f": False, "n": None, "list": [True, None, 0]},
    "depth_64": {"a": _nested_lists(63)},
}


@pytest.mark.parametrize("name", METADATA_CASES)
def test_metadata_round_trips(tmp_path, name):
    metadata = METADATA_CASES[name]
    path = tmp_path / "m.kdtr"
    kdtr_format.write(path, {}, metadata=metadata)
    with kdtr_format.open(path) as f:
        assert f.metadata == metadata
        assert repr(f.metadata) == repr(metadata)
        assert len(f) == 0


def test_names_by_prefix_and_membership(tmp_path):
    names = ["config", "weights/layers.3.attn.kv_b_proj", "weights/norm", "cases/7/expected/logits", "cases/70/x"]
    path = tmp_path / "n.kdtr"
    kdtr_format.write(path, {n: np.zeros(1, np.int64) for n in names})
    with kdtr_format.open(path) as f:
        assert f.names("weights/") == ["weights/layers.3.attn.kv_b_proj", "weights/norm"]
        assert f.names("cases/7/") == ["cases/7/expected/logits"]
        assert f.names("nothing") == []
        assert list(f) == names
        assert "config" in f and "conf" not in f and 3 not in f
        with pytest.raises(kdtr_format.TensorNotFoundError, match="'conf'") as caught:
            f["conf"]
        assert isinstance(caught.value, KeyError)


def test_large_tensor_streams_and_verifies(tmp_path):
    path = tmp_path / "big.kdtr"
    chunk = np.arange(2**23, dtype=np.float64)  # 64 MiB
    with kdtr_format.Writer(path) as w:
        w.add("big", chunk)
        w.add("after", np.ones(3, np.float32))
        w.metadata = {"bytes": chunk.nbytes}
    progress = []
    with kdtr_format.open(path) as f:
        assert f.verify(progress=lambda done, total: progress.append((done, total))) == chunk.nbytes + 12
        assert f["big"][-1] == 2**23 - 1 and f["after"].tolist() == [1, 1, 1]
        assert f.info("big").crc32c == crc32c(chunk)
    assert progress[-1] == (chunk.nbytes + 12, chunk.nbytes + 12)
    assert len(progress) > 1


def test_first_access_checks_the_tensor_checksum(tmp_path):
    path = tmp_path / "c.kdtr"
    kdtr_format.write(path, {"good": np.ones(4, np.float32), "bad": np.ones(4, np.float32)})
    blob = bytearray(path.read_bytes())
    with kdtr_format.open(path) as f:
        blob[f.info("bad").offset + 3] ^= 0x40
    path.write_bytes(bytes(blob))
    with kdtr_format.open(path) as f:
        assert f["good"].tolist() == [1, 1, 1, 1]
        for access in (f.__getitem__, f.torch, f.raw):
            with pytest.raises(kdtr_format.ChecksumError, match="tensor 'bad'"):
                access("bad")
        with pytest.raises(kdtr_format.ChecksumError, match="tensor 'bad'"):
            f.verify()


def test_open_many_tensors_reads_only_the_index(tmp_path):
    path = tmp_path / "many.kdtr"
    kdtr_format.write(path, {f"cases/{i}/expected/logits": np.full(2, i, np.float32) for i in range(10_000)})
    with kdtr_format.open(path) as f:
        assert len(f) == 10_000
        assert not any(f._checked)
        assert f["cases/9999/expected/logits"].tolist() == [9999, 9999]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda w: w.add("", np.zeros(1)), "1 to 1024"),
        (lambda w: w.add("a\0b", np.zeros(1)), "without NUL"),
        (lambda w: w.add("x" * 1025, np.zeros(1)), "1 to 1024"),
        (lambda w: w.add(3, np.zeros(1)), "must be a str"),
        (lambda w: w.add("\ud800", np.zeros(1)), "UTF-8"),
        (lambda w: [w.add("a", np.zeros(1)), w.add("a", np.zeros(1))], "duplicate tensor name 'a'"),
        (lambda w: w.add("c", np.zeros(2, np.complex64)), "unsupported dtype complex64"),
        (lambda w: w.add("o", np.array([None])), "unsupported dtype object"),
        (lambda w: w.add("l", [1, 2]), "expected a numpy array"),
        (lambda w: w.add("t", torch.zeros(2, dtype=torch.complex64)), "unsupported torch dtype"),
        (lambda w: w.add("d", np.zeros((1,) * 9)), "at most 8"),
        (lambda w: w.set_metadata({"x": float("nan")}), "not representable"),
        (lambda w: w.set_metadata({1: "x"}), "not a string"),
        (lambda w: w.set_metadata({"x": np.int64(3)}), "not a JSON type"),
        (lambda w: w.set_metadata([1]), "must be a dict"),
        (lambda w: w.set_metadata({"d": METADATA_CASES["depth_64"]}), "deeper than 64"),
    ],
)
def test_writer_refuses_bad_input(tmp_path, call, match):
    with kdtr_format.Writer(tmp_path / "x.kdtr") as w:
        with pytest.raises(kdtr_format.WriterError, match=match):
            call(w)


@pytest.mark.parametrize("alignment", [0, 32, 48, 100, 8192, 64.0])
def test_writer_refuses_bad_alignment(tmp_path, alignment):
    with pytest.raises(kdtr_format.WriterError, match="alignment"):
        kdtr_format.Writer(tmp_path / "x.kdtr", alignment=alignment)
    assert list(tmp_path.iterdir()) == []


def test_exception_leaves_no_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "f.kdtr"
    kdtr_format.write(path, {"old": np.zeros(1)})
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with kdtr_format.Writer(path) as w:
            w.add("new", np.ones(1000))
            raise RuntimeError("boom")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.kdtr"]


def test_commit_failure_removes_the_temporary_file(tmp_path):
    path = tmp_path / "f.kdtr"
    with pytest.raises(kdtr_format.WriterError, match="not representable"):
        with kdtr_format.Writer(path) as w:
            w.add("a", np.zeros(3))
            w.metadata["bad"] = float("inf")
    assert list(tmp_path.iterdir()) == []


def test_sigkill_mid_write_leaves_no_file_under_the_final_name(tmp_path):
    path = tmp_path / "killed.kdtr"
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, kdtr_format
        with kdtr_format.Writer({str(path)!r}) as w:
            for i in range(10_000):
                w.add(f"t{{i}}", np.full(1 << 18, i, np.float32))
                if i == 3:
                    print("streaming", flush=True)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline().strip() == b"streaming"
    time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not path.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".killed.kdtr.") and p.name.endswith(".tmp") for p in leftovers)


SIGTERM_WRITES = {
    "Writer": """
        with kdtr_format.Writer(path) as w:
            w.add("t", np.zeros(1 << 18, np.float32))
            print("writing", flush=True)
            time.sleep(60)
        """,
    "atomic_output": """
        with atomic_output(path) as file:
            file.write(b"partial")
            print("writing", flush=True)
            time.sleep(60)
        """,
    "replacing": """
        with atomic.replacing(path) as tmp:
            open(tmp, "wb").write(b"partial")
            print("writing", flush=True)
            time.sleep(60)
        """,
}


@pytest.mark.parametrize("how", SIGTERM_WRITES)
def test_sigterm_mid_write_removes_the_temporary_file(tmp_path, how):
    path = tmp_path / "termed.kdtr"
    script = "import sys, time, numpy as np, kdtr_format\nfrom kdtr_format import atomic\n" \
             "from kdtr_format.clikit import atomic_output\n" \
             f"path = {str(path)!r}\n" + textwrap.dedent(SIGTERM_WRITES[how])
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline().strip() == b"writing"
    assert [p.name.endswith(".tmp") for p in tmp_path.iterdir()] == [True]
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_use_after_commit(tmp_path):
    w = kdtr_format.Writer(tmp_path / "a.kdtr")
    w.commit()
    with pytest.raises(kdtr_format.WriterError, match="already closed"):
        w.add("x", np.zeros(1))


def test_non_contiguous_and_big_endian_inputs_are_stored_little_endian(tmp_path):
    base = np.arange(12, dtype=">i4").reshape(3, 4)
    path = tmp_path / "e.kdtr"
    kdtr_format.write(path, {"t": base.T, "big": base})
    with kdtr_format.open(path) as f:
        assert f["t"].dtype == np.dtype("<i4")
        assert np.array_equal(f["t"], base.T) and np.array_equal(f["big"], base)
        assert f.raw("big")[:4].tolist() == [0, 0, 0, 0] and f.raw("big")[4:8].tolist() == [1, 0, 0, 0]


def test_spec_worked_example_is_what_the_writer_writes(tmp_path):
    """SPEC.md's hexdump must stay byte-identical to the writer's output."""
    spec = (REPO / "kdtr_format" / "SPEC.md").read_text()
    example = spec[spec.index("## 8. Worked example") :]
    dump = bytes(
        int(token, 16)
        for line in example.splitlines()
        if len(line) > 10 and line[8:10] == ": " and all(c in "0123456789abcdef" for c in line[:8])
        for token in line[10:58].split()
    )
    path = tmp_path / "example.kdtr"
    kdtr_format.write(path, {"w": np.array([1.0, -2.0], np.float32), "q": np.array([1, -2, 7], ml_dtypes.int4)},
                      metadata={"k": 1})
    assert dump == path.read_bytes()


@pytest.mark.parametrize("durable", [True, False])
def test_durable_option_fsyncs_or_not(tmp_path, monkeypatch, durable):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    kdtr_format.write(tmp_path / "d.kdtr", {"a": np.zeros(3)}, durable=durable)
    assert bool(synced) == durable
    assert kdtr_format.open(tmp_path / "d.kdtr")["a"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("fast", [True, False], ids=["ctypes_libcrc32c", "google_crc32c_copies"])
@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 4097, (8 << 20) + 3])
def test_crc32c_paths_agree_with_google_crc32c(monkeypatch, fast, nbytes):
    import google_crc32c

    from kdtr_format import _crc32c

    if not fast:
        monkeypatch.setattr(_crc32c, "_extend", None)
    elif _crc32c._extend is None:
        pytest.skip("google-crc32c's C library was not found; only the copying path exists here")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert _crc32c.crc32c(data) == google_crc32c.value(data.tobytes())
    assert _crc32c.crc32c(b"123456789") == 0xE3069283
    half = nbytes // 2
    assert _crc32c.crc32c(data[half:], _crc32c.crc32c(data[:half])) == google_crc32c.value(data.tobytes())
