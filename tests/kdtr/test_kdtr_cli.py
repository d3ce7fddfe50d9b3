"""The `kdtr` CLI: exit codes, one-line errors, diff tolerances, lossless conversions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kdtr_format
from kdtr_format.cli import main
from kdtr_testlib import SMALL_METADATA, every_dtype_tensors, read_everything, small_file

REPO = Path(__file__).resolve().parents[2]


def kdtr(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(result) -> str:
    err = result.stderr
    assert err.startswith("kdtr: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in result.output + err
    return err


@pytest.fixture
def sample(tmp_path) -> Path:
    return small_file(tmp_path / "sample.kdtr")


def test_verify_good_file(sample):
    result = kdtr("verify", sample)
    assert result.exit_code == 0 and result.stdout.startswith("ok: ")


def test_verify_corrupt_file_names_the_tensor(corpus_dir):
    result = kdtr("verify", corpus_dir / "data_checksum.kdtr")
    assert result.exit_code == 1
    assert "tensor 'a'" in _one_line_error(result)


def test_verify_malformed_file_names_the_offset(corpus_dir):
    result = kdtr("verify", corpus_dir / "overlapping_offsets.kdtr")
    assert result.exit_code == 1
    assert "overlaps" in _one_line_error(result)


def test_inspect_lists_tensors_and_metadata(sample):
    result = kdtr("inspect", sample)
    assert result.exit_code == 0
    for text in ["b/c", "int16", "[2, 2]", "int4", "nested", "'ü'"]:
        assert text in result.stdout
    assert "b/c" not in kdtr("inspect", sample, "--prefix", "a").stdout


def test_cat_values_and_summary(sample):
    result = kdtr("cat", sample, "b/c")
    assert result.exit_code == 0 and "[[1 2]\n [3 4]]" in result.stdout
    summary = kdtr("cat", sample, "a", "--summary")
    assert "min 0  max 4  mean 2" in summary.stdout
    assert "[-8  7  3]" in kdtr("cat", sample, "q").stdout


def _pair(tmp_path, b_values, metadata_b=None):
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    base = {"x": np.array([1.0, 2.0, 3.0], np.float32), "n": np.arange(4)}
    kdtr_format.write(a, base, metadata={"tol": 1e-3})
    kdtr_format.write(b, {**base, "x": np.array(b_values, np.float32)}, metadata=metadata_b or {"tol": 1e-3})
    return a, b


def test_diff_equal_files(tmp_path):
    a, b = _pair(tmp_path, [1.0, 2.0, 3.0])
    result = kdtr("diff", a, b)
    assert result.exit_code == 0 and result.stdout.startswith("same")


def test_diff_reports_max_abs_rel_ulp_and_first_index(tmp_path):
    one_ulp_above_2 = float(np.nextafter(np.float32(2.0), np.float32(3.0)))
    a, b = _pair(tmp_path, [1.0, one_ulp_above_2, 3.5])
    result = kdtr("diff", a, b)
    assert result.exit_code == 1
    line = next(l for l in result.stdout.splitlines() if l.startswith("x:"))
    assert "max abs 0.5" in line and "max rel 0.142857" in line
    assert "2 outside tolerance, first at [1]" in line
    # the largest ulp distance: float32 steps are 2**-22 in [2, 4), so 3.0 -> 3.5 is 2**21 of them
    assert f"max ulp {2**21}" in line


def test_diff_tolerances_decide_the_exit_status(tmp_path):
    a, b = _pair(tmp_path, [1.0, 2.0, 3.003])
    assert kdtr("diff", a, b).exit_code == 1
    assert kdtr("diff", a, b, "--atol", "0.01").exit_code == 0
    assert kdtr("diff", a, b, "--rtol", "1e-3").exit_code == 0
    assert kdtr("diff", a, b, "--rtol", "1e-4").exit_code == 1
    close = kdtr("diff", a, b, "--atol", "0.01")
    assert "x: close" in close.stdout


def test_diff_reports_metadata_and_missing_tensors(tmp_path):
    a, b = _pair(tmp_path, [1.0, 2.0, 3.0], metadata_b={"tol": 1e-4, "extra": True})
    kdtr_format.write(b, {"x": np.array([1.0, 2.0, 3.0], np.float32)}, metadata={"tol": 1e-4, "extra": True})
    result = kdtr("diff", a, b, "--atol", "1")
    assert result.exit_code == 1
    assert "n: only in A" in result.stdout
    assert "metadata.tol: 0.001 != 0.0001" in result.stdout
    assert "metadata.extra: only in B" in result.stdout


def test_diff_dtype_and_shape_mismatch(tmp_path):
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    kdtr_format.write(a, {"x": np.zeros(3, np.float32), "y": np.zeros(3)})
    kdtr_format.write(b, {"x": np.zeros(3, np.float64), "y": np.zeros(4)})
    result = kdtr("diff", a, b)
    assert result.exit_code == 1
    assert "x: dtype differs: float32[3] vs float64[3]" in result.stdout
    assert "y: shape differs" in result.stdout


@pytest.mark.parametrize("extension", [".h5", ".hdf5", ".npz", ".safetensors", ".kdtr"])
def test_convert_round_trips_bit_exact_with_metadata(tmp_path, extension):
    if extension == ".safetensors":
        pytest.importorskip("safetensors", reason="safetensors is not installed")
    source = tmp_path / "source.kdtr"
    kdtr_format.write(source, every_dtype_tensors(), metadata=SMALL_METADATA)
    middle, back = tmp_path / f"middle{extension}", tmp_path / "back.kdtr"
    assert kdtr("convert", source, middle, "--alignment", "256").exit_code == 0
    assert kdtr("convert", middle, back).exit_code == 0
    assert read_everything(back) == read_everything(source)
    with kdtr_format.open(back) as f, kdtr_format.open(source) as g:
        assert f.names() == g.names()
        assert [f.info(n).dtype for n in f] == [g.info(n).dtype for n in g]


def test_convert_reads_foreign_npz_and_h5(tmp_path):
    import h5py

    np.savez(tmp_path / "plain.npz", w=np.eye(2), i=np.arange(3))
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["group/w"] = np.ones((2, 2), np.float32)
    for name in ["plain.npz", "plain.h5"]:
        assert kdtr("convert", tmp_path / name, tmp_path / f"{name}.kdtr").exit_code == 0
    with kdtr_format.open(tmp_path / "plain.npz.kdtr") as f:
        assert f.names() == ["w", "i"] and f.metadata == {}
    with kdtr_format.open(tmp_path / "plain.h5.kdtr") as f:
        assert f.names() == ["group/w"] and f["group/w"].dtype == np.float32


@pytest.mark.parametrize(
    "args, status, text",
    [
        (["verify", "{tmp}/missing.kdtr"], 2, "No such file"),
        (["cat", "{sample}", "nope"], 2, "no tensor named 'nope'"),
        (["convert", "{sample}", "{tmp}/out.txt"], 2, "unsupported extension '.txt'"),
        (["convert", "{tmp}/in.csv", "{tmp}/out.kdtr"], 2, "unsupported extension '.csv'"),
        (["verify", "{tmp}"], 2, "directory"),
        (["verify", "{tmp}/garbage.kdtr"], 1, "not a KDTR file"),
        (["diff", "{sample}"], 2, "Missing argument"),
        (["diff", "{sample}", "{sample}", "--rtol", "-1"], 2, "tolerances"),
        (["frobnicate"], 2, "No such command"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(tmp_path, sample, args, status, text):
    (tmp_path / "garbage.kdtr").write_bytes(b"not a kdtr file at all" * 10)
    result = kdtr(*[a.format(tmp=tmp_path, sample=sample) for a in args])
    assert result.exit_code == status
    assert text in _one_line_error(result)


def test_failed_convert_leaves_no_output(tmp_path):
    source = tmp_path / "clash.kdtr"
    kdtr_format.write(source, {"a": np.zeros(1), "a/b": np.zeros(1)})
    result = kdtr("convert", source, tmp_path / "out.h5")
    assert result.exit_code == 2 and "cannot store tensor 'a/b' in HDF5" in _one_line_error(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash.kdtr"]


def test_entry_point_module_runs_as_a_process(sample):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "kdtr_format", "verify", str(sample)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ")
    bad = subprocess.run([sys.executable, "-m", "kdtr_format", "cat", str(sample), "zzz"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def _nextafter_steps(a, b) -> int:
    """Reference ulp distance: walk from a to b one representable value at a time."""
    steps, x = 0, a
    while x != b:
        x = np.nextafter(x, b)
        steps += 1
    return steps


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("a_steps, b_steps", [(-2, 1), (0, 5), (-7, -3), (3, -4)])
def test_ulp_distance_matches_stepping_across_zero(dtype, a_steps, b_steps):
    from kdtr_format.compare import compare_arrays

    tiny = np.finfo(dtype).smallest_subnormal
    a, b = np.array([a_steps * tiny], dtype), np.array([b_steps * tiny], dtype)
    result = compare_arrays(a, b)
    assert result.max_ulp == _nextafter_steps(a[0], b[0]) == abs(a_steps - b_steps)
