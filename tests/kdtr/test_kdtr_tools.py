"""What the `kdtr` tools compute: cat's values and summary, diff's differences and tolerances,
convert's lossless round trips (driven in-process through click's runner)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kdtr_format
from kdtr_format.cli import main
from kdtr_testlib import SMALL_METADATA, every_dtype_tensors, read_everything, small_file


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
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("x:"))
    assert lines[at] == "x: different, 2 outside tolerance, first at [1]"
    # the largest ulp distance: float32 steps are 2**-22 in [2, 4), so 3.0 -> 3.5 is 2**21 of them
    assert lines[at + 1] == f"  max abs 0.5, max rel 0.142857, max ulp {2**21}"


def test_diff_tolerances_decide_the_exit_status(tmp_path):
    a, b = _pair(tmp_path, [1.0, 2.0, 3.003])
    assert kdtr("diff", a, b).exit_code == 1
    assert kdtr("diff", a, b, "--atol", "0.01").exit_code == 0
    assert kdtr("diff", a, b, "--rtol", "1e-3").exit_code == 0
    assert kdtr("diff", a, b, "--rtol", "1e-4").exit_code == 1
    close = kdtr("diff", a, b, "--atol", "0.01")
    assert "x: close, first difference at [2]" in close.stdout


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
        assert [(f.info(n).dtype, f.info(n).shape) for n in f] == [(g.info(n).dtype, g.info(n).shape) for n in g]
        assert f.metadata == g.metadata


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


def _h5_reaching_outside(directory: Path, how: str) -> Path:
    """An HDF5 file whose dataset `d` (or link `d`) reads bytes of another file in `directory`."""
    import h5py

    (directory / "secret.bin").write_bytes(b"bytes of another file")
    with h5py.File(directory / "other.h5", "w") as f:
        f["x"] = np.arange(4)
    path = directory / f"{how}.h5"
    with h5py.File(path, "w") as f:
        f["own"] = np.zeros(2)
        if how == "external storage":
            f.create_dataset("group/d", shape=(21,), dtype="u1", external=[("secret.bin", 0, 21)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=(4,), dtype="i8")
            layout[:] = h5py.VirtualSource("other.h5", "x", shape=(4,))
            f.create_virtual_dataset("group/d", layout)
        else:
            f["group/d"] = h5py.ExternalLink("other.h5", "/x")
    return path


@pytest.mark.parametrize("how, says", [("external storage", "stores its data in another file"),
                                       ("virtual", "is a virtual dataset"),
                                       ("external link", "is an external link")])
def test_convert_refuses_an_h5_dataset_that_reads_another_file(tmp_path, how, says):
    source = _h5_reaching_outside(tmp_path, how)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = kdtr("convert", source, tmp_path / "out.kdtr")
    error = _one_line_error(result)
    assert result.exit_code == 2 and f"'group/d' {says}" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_failed_convert_leaves_no_output(tmp_path):
    source = tmp_path / "clash.kdtr"
    kdtr_format.write(source, {"a": np.zeros(1), "a/b": np.zeros(1)})
    result = kdtr("convert", source, tmp_path / "out.h5")
    assert result.exit_code == 2 and "cannot store tensor 'a/b' in HDF5" in _one_line_error(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash.kdtr"]


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
