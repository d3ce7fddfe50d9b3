"""`kdtree validate --impl SPEC` and `--fixtures DIR` as people give them.

--impl: a spec whose part before the last ':' ends in .py, holds a '/' or is no dotted module
name is a file path, and must name an existing .py file (a path that is no Python file, a
directory, a missing file: one line, exit 2); a dotted module name, a package folder of the
current directory included, still imports. --fixtures DIR: every .kdtr file under DIR, at any
depth, a folder's own files before its subfolders'; none is one line, exit 2.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cli_run import run_main
from engine.validate import load_impl
from engine.validate.fixtures import kdtr_files
from terminal import assert_clean_error, piped

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

ADAPTER_SOURCE = "class A:\n    name = 'mine'\n\ndef make():\n    return A()\n"


def error_line(args: list[str], capsys) -> str:
    """The one error line of `kdtree validate ARGS`, which must exit 2 and print nothing else."""
    code, out, err = run_main(["validate", *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("kdtree: error: "), (code, out, err)
    return lines[0]


# ---- --impl: a path is a Python file, a module name imports ----

NOT_A_MODULE = " (expected path/to/file.py:factory or module:factory)"


@pytest.mark.parametrize("target, problem", [
    ("{tmp}/adapter.txt", "{tmp}/adapter.txt is not a Python file (.py)"),     # Python inside, but no .py
    ("{tmp}/adapters/", "{tmp}/adapters/ is a directory, not a Python file (.py): name the adapter's file, "
                        "path/to/file.py:factory"),
    ("{tmp}/missing", "no file {tmp}/missing" + NOT_A_MODULE),
    ("{tmp}/missing.py", "no file {tmp}/missing.py"),
    ("my-adapter", "no file my-adapter" + NOT_A_MODULE),              # no module can be named so
    ("adapter.txt", "adapter.txt is not a Python file (.py)"),        # a file of the current directory
])
def test_a_path_that_is_no_python_file_is_named(tmp_path, monkeypatch, capsys, target, problem):
    (tmp_path / "adapter.txt").write_text(ADAPTER_SOURCE)
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "a.py").write_text(ADAPTER_SOURCE)
    monkeypatch.chdir(tmp_path)
    spec = target.format(tmp=tmp_path) + ":make"
    line = error_line(["--impl", spec], capsys)
    assert line == f"kdtree: error: --impl {spec!r}: {problem.format(tmp=tmp_path)}"


@pytest.mark.skipif(not Path("/etc/passwd").is_file(), reason="no /etc/passwd on this machine")
def test_etc_passwd_is_not_read_as_a_module_piped():
    result = piped(["kdtree", "validate", "--impl", "/etc/passwd:X"])
    assert_clean_error(result, "/etc/passwd is not a Python file (.py)")
    assert result.returncode == 2 and "cannot import" not in result.output, result.output


def test_module_names_still_import(tmp_path, monkeypatch):
    """A dotted name, a package folder of the current directory and a module in it, are modules."""
    package = tmp_path / "kdtree_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(ADAPTER_SOURCE)
    (package / "sub.py").write_text(ADAPTER_SOURCE.replace("mine", "sub"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("kdtree_test_pkg", "kdtree_test_pkg.sub"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert load_impl("kdtree_test_pkg:make").name == "mine"
    assert load_impl("kdtree_test_pkg.sub:make").name == "sub"


def test_a_module_spec_validates(committed_golden, capsys):
    code, out, err = run_main(["validate", "--fixtures", str(committed_golden / "kernels" / "tree_build.kdtr"),
                               "--impl", "engine.adapter:TorchAdapter", "--require", "none"], capsys)
    assert code == 0 and "(--impl engine.adapter:TorchAdapter)" in out and out.splitlines()[-1].startswith(
        "PASSED: "), out + err


# ---- --fixtures DIR: every .kdtr file under it ----

def test_fixture_files_in_tree_order(tmp_path):
    """A folder's own files by name, then each subfolder's, in name order, at any depth; only
    .kdtr files."""
    for name in ("z.kdtr", "a/y.kdtr", "a/b/x.kdtr", "c/w.kdtr", "c/notes.txt", "a/b/d/v.kdtr", "a/b/u.kdtr"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    found = [str(file.relative_to(tmp_path)) for file in kdtr_files(tmp_path)]
    assert found == ["z.kdtr", "a/y.kdtr", "a/b/u.kdtr", "a/b/x.kdtr", "a/b/d/v.kdtr", "c/w.kdtr"]


def test_the_committed_layout_keeps_its_order(committed_golden):
    """tests/golden: its model fixtures, then kernels/, each by name (the order of its reports)."""
    expected = sorted(committed_golden.glob("*.kdtr")) + sorted(committed_golden.glob("kernels/*.kdtr"))
    assert len(expected) > 2 and kdtr_files(committed_golden) == expected


def test_fixtures_in_any_subfolder_are_checked(committed_golden, tmp_path, capsys):
    """Slim fixtures two folders down and in a folder not named kernels/: both materialized
    and checked, each section named by its path under DIR."""
    (tmp_path / "a" / "deeper").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    shutil.copy(committed_golden / "kernels" / "tree_build.kdtr", tmp_path / "a" / "deeper")
    shutil.copy(committed_golden / "kernels" / "accept_compact.kdtr", tmp_path / "b")
    code, out, err = run_main(["validate", "--fixtures", str(tmp_path), "--impl",
                               f"{EXAMPLES / 'numpy_adapter.py'}:NumpyAdapter", "--require", "none"], capsys)
    assert code == 0, out + err
    sections = [line for line in out.splitlines() if line.endswith(".kdtr") and not line.startswith("checking ")]
    assert sections == ["a/deeper/tree_build.kdtr", "b/accept_compact.kdtr"], out
    assert out.splitlines()[-1].startswith("PASSED: "), out


def test_a_directory_without_fixtures_is_one_line(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("not a fixture")
    result = piped(["kdtree", "validate", "--fixtures", str(tmp_path)])
    assert_clean_error(result, f"no .kdtr fixtures under {tmp_path}")
    assert result.returncode == 2
