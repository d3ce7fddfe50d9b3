"""The writer: it writes only what both readers accept, refuses everything else with a WriterError
naming the tensor or field, and commits atomically (temporary file gone after any exception, a
name within NAME_MAX, the user's umask, symbolic links written through)."""

from __future__ import annotations

import errno
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdtr_format


def _nested_tuples(depth: int) -> tuple:
    value: tuple = ()
    for _ in range(depth - 1):
        value = (value,)
    return value


def _cycle() -> dict:
    loop: dict = {}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"ok": [1], "bad": "x\ud800y"}, r"metadata\['bad'\]: a string not encodable as UTF-8"),
        ({"ok": {"\udc80": 1}}, r"metadata\['ok'\]: key '\\udc80' is not encodable as UTF-8"),
        ({"t": _nested_tuples(64)}, r"metadata\['t'\](\[0\])+: nests deeper than 64"),
        ({"t": _nested_tuples(5000)}, "nests deeper than 64"),
        ({"loop": _cycle()}, "nests deeper than 64 levels .or contains itself"),
        ({"n": [1, 2**64]}, r"metadata\['n'\]\[1\]: an integer outside"),
        ({"f": (1.0, float("inf"))}, r"metadata\['f'\]\[1\]: inf is not representable"),
        ({"x": {"y": np.float32(1)}}, r"metadata\['x'\]\['y'\]: float32 is not a JSON type"),
        ({"k": {1: 2}}, r"metadata\['k'\]: key 1 is not a string"),
    ],
    ids=["surrogate_value", "surrogate_key", "tuples_65_deep", "tuples_5000_deep", "cycle", "huge_int", "inf",
         "numpy_scalar", "int_key"],
)
def test_bad_metadata_is_a_writer_error_naming_the_field(tmp_path, metadata, match):
    with pytest.raises(kdtr_format.WriterError, match=match):
        kdtr_format.write(tmp_path / "m.kdtr", {}, metadata=metadata)
    assert list(tmp_path.iterdir()) == []


class _Unmovable(torch.Tensor):
    """A tensor whose copy to the CPU fails, as one on a lost device does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise RuntimeError("device lost")
        return super().__torch_function__(func, types, args, kwargs or {})


def _torch_cases() -> dict[str, object]:
    dense = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # quantized: deprecated; sparse CSR: beta
        quantized = torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
        csr = dense.to_sparse_csr()
    return {
        "meta": (torch.empty(3, device="meta"), "a meta-device torch tensor has no data"),
        "sparse_coo": (dense.to_sparse(), "a torch.sparse_coo torch tensor"),
        "sparse_csr": (csr, "a torch.sparse_csr torch tensor"),
        "quantized": (quantized, "unsupported torch dtype torch.qint8"),
        "unmovable": (dense.as_subclass(_Unmovable), "cannot copy a cpu tensor to the CPU: device lost"),
    }


@pytest.mark.parametrize("case", list(_torch_cases()))
def test_torch_tensors_kdtr_cannot_hold_are_writer_errors(tmp_path, case):
    tensor, match = _torch_cases()[case]
    with pytest.raises(kdtr_format.WriterError, match=f"tensor 'w/{case}': {match}"):
        kdtr_format.write(tmp_path / "t.kdtr", {"w/" + case: tensor})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "array, match",
    [
        (np.empty((0, 2**62 + 1), np.uint8), r"shape \[0, 4611686018427387905\] is over the 2\*\*62-byte cap"),
        (np.empty((0, 2**61 + 1), np.int16), r"shape \[0, 2305843009213693953\] is over the 2\*\*62-byte cap"),
        (torch.empty(0, 2**62 + 1, dtype=torch.uint8), r"shape \[0, 4611686018427387905\] is over the 2\*\*62"),
        (np.array([0, 1, 2], np.uint8).view(np.bool_), "a bool byte is 2"),
        (torch.tensor([0, 7], dtype=torch.uint8).view(torch.bool), "a bool byte is 7"),
        (np.zeros(2, np.complex64), "unsupported dtype complex64"),
    ],
    ids=["empty_over_cap", "empty_int16_over_cap", "torch_empty_over_cap", "bool_byte_2", "torch_bool_byte_7", "complex"],
)
def test_tensors_the_readers_would_refuse_are_writer_errors(tmp_path, array, match):
    with pytest.raises(kdtr_format.WriterError, match=f"tensor 'x': {match}"):
        kdtr_format.write(tmp_path / "x.kdtr", {"x": array})
    assert list(tmp_path.iterdir()) == []


def test_empty_tensors_at_the_cap_are_written_and_read(tmp_path):
    path = tmp_path / "e.kdtr"
    kdtr_format.write(path, {"e": np.empty((0, 2**62), np.uint8), "bools": np.array([True, False])})
    with kdtr_format.open(path) as f:
        f.verify()
        assert f["e"].shape == (0, 2**62) and f["bools"].tolist() == [True, False]


JSON_LEAVES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
               | st.text(st.characters(codec=None), max_size=8))
METADATA_VALUES = st.recursive(JSON_LEAVES, lambda children: st.lists(children, max_size=4)
                               | st.tuples(children, children) | st.dictionaries(st.text(max_size=6), children, max_size=4),
                               max_leaves=30)


def _as_json(value: object) -> object:
    """What a JSON round trip gives back for a value the writer accepted: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.text(max_size=6), METADATA_VALUES, max_size=5))
def test_whatever_the_writer_accepts_the_reader_gives_back(tmp_path, metadata):
    path = tmp_path / "p.kdtr"
    path.unlink(missing_ok=True)            # tmp_path is shared by hypothesis's examples
    try:
        kdtr_format.write(path, {}, metadata=metadata, durable=False)
    except kdtr_format.WriterError:
        assert not path.exists()
        return
    with kdtr_format.open(path) as f:
        f.verify()
        assert f.metadata == _as_json(metadata)


class _FailingFlush:
    """A file whose flush fails like a full disk's, and whose close flushes first (as io.BufferedWriter)."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        try:
            self.flush()
        finally:
            self.real.close()


def test_a_failing_flush_in_commit_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "full.kdtr"
    with pytest.raises(OSError, match="No space left"):
        with kdtr_format.Writer(path) as w:
            w.add("a", np.zeros(1000))
            w._file = _FailingFlush(w._file)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only: mounting needs CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the failing-flush test covers the same path")
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_at_commit_leaves_no_temporary_file(tiny_tmpfs):
    """The tensor fills the file system to the byte; the index no longer fits."""
    with pytest.raises(OSError) as caught:
        with kdtr_format.Writer(tiny_tmpfs / "full.kdtr") as w:
            w.add("fill", np.zeros((256 << 10) - 64, np.uint8))
    assert caught.value.errno == errno.ENOSPC
    assert list(tiny_tmpfs.iterdir()) == []


@pytest.mark.parametrize("name", ["x" * 250 + ".kdtr", "ü" * 125 + ".kdtr", "🌲" * 62 + "k.kdtr"],
                         ids=["255_ascii", "255_bytes_two_byte_chars", "254_bytes_four_byte_chars"])
def test_names_up_to_name_max_work(tmp_path, name):
    assert len(name.encode()) >= 254
    kdtr_format.write(tmp_path / name, {"a": np.zeros(2)})
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert kdtr_format.open(tmp_path / name)["a"].tolist() == [0, 0]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_users_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        kdtr_format.write(tmp_path / "p.kdtr", {"a": np.zeros(1)})
    finally:
        os.umask(old)
    assert (tmp_path / "p.kdtr").stat().st_mode & 0o777 == 0o666 & ~umask


def test_writing_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    real = tmp_path / "store" / "fixture.kdtr"
    real.parent.mkdir()
    kdtr_format.write(real, {"old": np.zeros(1)})
    link = tmp_path / "link.kdtr"
    link.symlink_to(real)
    kdtr_format.write(link, {"new": np.ones(1)})
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert kdtr_format.open(real).names() == ["new"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["fixture.kdtr"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.kdtr"
    link.symlink_to(tmp_path / "target.kdtr")
    kdtr_format.write(link, {"a": np.zeros(1)})
    assert link.is_symlink() and kdtr_format.open(tmp_path / "target.kdtr").names() == ["a"]


@pytest.mark.parametrize("where, error", [("missing/out.kdtr", FileNotFoundError), ("out.kdtr", IsADirectoryError)])
def test_errors_name_the_users_path_not_a_temporary_one(tmp_path, where, error):
    target = tmp_path / where
    if error is IsADirectoryError:
        target.mkdir()
    with pytest.raises(error) as caught:
        kdtr_format.write(target, {"a": np.zeros(1)})
    assert caught.value.filename == str(target)


def test_writer_used_without_with_removes_its_file_on_abort(tmp_path):
    w = kdtr_format.Writer(tmp_path / "a.kdtr")
    w.add("x", np.zeros(3))
    w.abort()
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_stay_within_the_limit_and_beside_the_target(tmp_path, monkeypatch):
    made = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (made.append(path), real_open(path, *a, **k))[1])
    kdtr_format.write(tmp_path / ("n" * 255), {"a": np.zeros(1)})
    temporary = Path(next(p for p in made if str(p).endswith(".tmp")))
    assert temporary.parent == tmp_path and len(temporary.name.encode()) <= 255
    assert temporary.name.startswith(".nnn")

