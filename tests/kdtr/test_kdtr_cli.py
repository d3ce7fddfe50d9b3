"""`kdtr` the way people run it: in an 80-column terminal (a pty), piped, and with hostile arguments.

Every bad input gets one error line and a non-zero exit, never a traceback, and leaves no file
behind; output fits 80 columns, uses a wider terminal, and prints names and metadata verbatim.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import kdtr_format
from kdtr_format.cli import main
from kdtr_format.listing import LIST_AT_MOST
from kdtr_testlib import small_file, with_metadata
from terminal import REPO, assert_clean_error, command, environment, in_terminal, piped

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen_lines(output: str) -> list[str]:
    """What a terminal shows, line by line: escape sequences dropped, carriage returns overwrite."""
    lines = []
    for line in _ANSI.sub("", output).replace("\r\n", "\n").split("\n"):
        lines.append(line.split("\r")[-1])
    return [line for line in lines if line.strip()]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """A small file, a second one that differs, and an input for each hostile case."""
    sample = small_file(tmp_path / "sample.kdtr")
    other = tmp_path / "other.kdtr"
    kdtr_format.write(other, {"a": np.arange(5, dtype=np.float32) + 0.5, "wide": np.linspace(0, 1, 40)},
                      metadata={"kind": "other"})
    (tmp_path / "garbage.kdtr").write_bytes(b"not a kdtr file at all" * 10)
    (tmp_path / "empty.kdtr").write_bytes(b"")
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5" * 100)
    os.mkfifo(tmp_path / "fifo.kdtr")
    (tmp_path / "directory.h5").mkdir()
    np.savez(tmp_path / "pickled.npz", objects=np.array([{"a": 1}], dtype=object))
    with h5py.File(tmp_path / "strings.h5", "w") as f:
        f["names"] = np.array([b"ab", b"cd"])
    return {"sample": sample, "other": other, "tmp": tmp_path}


# ---- help, version ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command_name", ["", "inspect", "verify", "diff", "cat", "convert"])
def test_every_command_prints_help_with_no_arguments_and_with_h(command_name):
    args = [command_name] if command_name else []
    bare = piped(["kdtr", *args])
    assert bare.returncode == 0 and not bare.stderr, bare.output
    assert bare.stdout.startswith(f"Usage: kdtr {command_name}".rstrip())
    for flag in ("-h", "--help"):
        asked = CliRunner().invoke(main, [*args, flag], prog_name="kdtr")
        assert asked.exit_code == 0 and asked.stdout.splitlines()[0] == bare.stdout.splitlines()[0]
        assert "Options:" in asked.stdout and "-h, --help" in asked.stdout


def test_version_names_the_package_and_the_format():
    result = piped(["kdtr", "--version"])
    assert result.returncode == 0
    assert result.stdout.strip() == f"kdtr, version {kdtr_format.__version__} (KDTR format 1.0)"


# ---- a real terminal ---------------------------------------------------------------------------------

EVERY_COMMAND = [  # run in the files' directory, by name, as a person would
    (["kdtr", "inspect", "sample.kdtr"], 0),
    (["kdtr", "verify", "sample.kdtr"], 0),
    (["kdtr", "diff", "sample.kdtr", "other.kdtr"], 1),
    (["kdtr", "cat", "sample.kdtr", "a"], 0),
    (["kdtr", "cat", "other.kdtr", "wide"], 0),
    (["kdtr", "cat", "sample.kdtr", "b/c", "--summary"], 0),
    (["kdtr", "convert", "sample.kdtr", "out.h5"], 0),
    (["kdtr", "convert", "out.h5", "back.kdtr"], 0),
    (["kdtr", "convert", "sample.kdtr", "out.npz"], 0),
    (["kdtr", "convert", "sample.kdtr", "out.safetensors"], 0),
    (["kdtr", "-h"], 0),
    (["kdtr", "inspect", "-h"], 0),
]


def test_every_command_works_in_an_80_column_terminal(files):
    for argv, status in EVERY_COMMAND:
        result = in_terminal(argv, columns=80, cwd=files["tmp"])
        assert result.returncode == status, f"{argv}: exit {result.returncode}\n{result.output}"
        assert "Traceback" not in result.output and "error" not in result.output.lower(), result.output
        too_wide = [line for line in screen_lines(result.output) if len(line) > 80]
        assert not too_wide, f"{argv}: lines wider than 80 columns:\n" + "\n".join(too_wide)


def test_values_use_a_wider_terminal(files):
    narrow = screen_lines(in_terminal(["kdtr", "cat", str(files["other"]), "wide"], columns=80).output)
    wide = screen_lines(in_terminal(["kdtr", "cat", str(files["other"]), "wide"], columns=200).output)
    assert max(map(len, narrow)) <= 80 < max(map(len, wide)) <= 200
    assert len(wide) < len(narrow)


def test_convert_and_verify_show_progress_on_a_terminal_and_finish(tmp_path):
    source = tmp_path / "many.kdtr"
    kdtr_format.write(source, {f"t/{i}": np.full(64, i, np.float32) for i in range(2000)}, durable=False)
    result = in_terminal(["kdtr", "convert", str(source), str(tmp_path / "many.npz")], columns=80)
    assert result.returncode == 0 and "wrote" in result.output, result.output
    result = in_terminal(["kdtr", "verify", str(source)], columns=80)
    assert result.returncode == 0 and "ok:" in result.output, result.output


def test_ctrl_c_during_convert_is_one_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "many.kdtr"
    kdtr_format.write(source, {f"t/{i}": np.full(256, i, np.float32) for i in range(20000)}, durable=False)
    result = in_terminal(["kdtr", "convert", str(source), str(tmp_path / "many.h5")], columns=80,
                         interrupt_on="/20000")          # the bar counts written tensors: writing has begun
    assert result.returncode == 130, result.output
    assert "Traceback" not in result.output
    assert [line for line in screen_lines(result.output) if "error" in line] == ["kdtr: error: interrupted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.kdtr"]


# ---- names and metadata verbatim -------------------------------------------------------------------------

HOSTILE_NAMES = ["[/x]", "[bold]x[/bold]", "a\x1b[31mred", "tab\tname", "new\nline", "\u202eevil", "ok/ü/🌲"]


@pytest.fixture
def hostile(tmp_path) -> Path:
    path = tmp_path / "hostile.kdtr"
    kdtr_format.write(path, {name: np.zeros(1, np.int8) for name in HOSTILE_NAMES})
    blob = with_metadata(path.read_bytes(), '{"\\ud800": "[red]v[/red]", "k\\u001b": "\\u202e", "ü": 1}'.encode())
    path.write_bytes(blob)
    return path


@pytest.mark.parametrize("run", [lambda argv: in_terminal(argv, columns=80), piped], ids=["terminal", "piped"])
def test_inspect_prints_names_and_metadata_verbatim_and_safely(hostile, run):
    result = run(["kdtr", "inspect", str(hostile)])
    assert result.returncode == 0, result.output
    out = result.output
    for name in ["[/x]", "[bold]x[/bold]", "ok/ü/🌲", "'a\\x1b[31mred'", "'tab\\tname'", "'new\\nline'", "'\\u202eevil'"]:
        assert name in out, name
    assert "\x1b[31m" not in out and "\u202e" not in out, "a control character reached the terminal"
    text = out.replace("\r\n", "\n")
    metadata = json.loads(text[text.index("metadata:\n") + len("metadata:\n") :])
    assert metadata == {"\ud800": "[red]v[/red]", "k\x1b": "\u202e", "ü": 1}


def test_inspect_of_many_tensors_fits_an_80_column_terminal(tmp_path):
    path = tmp_path / "many.kdtr"
    kdtr_format.write(path, {f"cases/{i}/x": np.zeros(1, np.float32) for i in range(LIST_AT_MOST * 10)}
                      | {f"w{i}/x": np.zeros(1, np.float32) for i in range(10)}, durable=False)
    # named from its folder: the file's own header line is its path, as long as the path is
    result = in_terminal(["kdtr", "inspect", path.name, "--no-metadata"], columns=80, cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "groups by prefix" in result.output
    too_wide = [line for line in screen_lines(result.output) if len(line) > 80]
    assert not too_wide, "lines wider than 80 columns:\n" + "\n".join(too_wide)


def test_inspect_piped_prints_every_long_name_in_full(tmp_path):
    names = [f"weights/model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight_scale_inv" for i in range(732)]
    path = tmp_path / "long.kdtr"
    kdtr_format.write(path, {n: np.zeros(1, np.float32) for n in names}, durable=False)
    result = piped(["kdtr", "inspect", str(path), "--no-metadata"])
    assert result.returncode == 0
    listed = [line.split()[-1] for line in result.stdout.splitlines()[3:]]
    assert listed == names
    assert "…" not in result.stdout


def test_inspect_summarizes_many_tensors_by_prefix_and_lists_them_with_all(tmp_path):
    path = tmp_path / "many.kdtr"
    names = [f"cases/{i}/x" for i in range(LIST_AT_MOST + 5)] + [f"weights/w{i}" for i in range(10)]
    kdtr_format.write(path, {n: np.zeros(2, np.float32) for n in names}, durable=False)
    runner = CliRunner()
    summary = runner.invoke(main, ["inspect", str(path), "--no-metadata"]).stdout.splitlines()
    assert summary[2] == f"{len(names)} tensors in 2 groups by prefix"
    assert [line.split() for line in summary[4:]] == [["tensors", "nbytes", "prefix"], ["1005", "8040", "cases/"],
                                                     ["10", "80", "weights/"]]
    one_group = runner.invoke(main, ["inspect", str(path), "--prefix", "weights/", "--no-metadata"]).stdout
    assert [line.split()[-1] for line in one_group.splitlines()[3:]] == names[-10:]
    paged = runner.invoke(main, ["inspect", str(path), "--prefix", "cases/", "--no-metadata"]).stdout.splitlines()
    assert [line.split()[-1] for line in paged[3:-1]] == names[:LIST_AT_MOST]
    assert paged[-1].startswith("... and 5 more (--all lists every tensor")
    everything = runner.invoke(main, ["inspect", str(path), "--all", "--no-metadata"]).stdout.splitlines()
    assert [line.split()[-1] for line in everything[3:]] == names


def test_a_closed_pipe_ends_quietly(tmp_path):
    path = tmp_path / "many.kdtr"
    kdtr_format.write(path, {f"t{i}": np.zeros(1) for i in range(5000)}, durable=False)
    shell = f"{' '.join(command(['kdtr', 'inspect', str(path), '--all']))} | head -n 2"
    result = subprocess.run(shell, shell=True, capture_output=True, text=True, cwd=REPO, env=environment(), timeout=120)
    assert len(result.stdout.splitlines()) == 2
    assert result.stderr == "", result.stderr


# ---- hostile arguments -----------------------------------------------------------------------------------

HOSTILE = [
    # (argv with {sample} / {other} / {tmp}, exit status, text the error must contain)
    (["cat", "{sample}", "a", "--threshold", "-1"], 2, "--threshold"),
    (["cat", "{sample}", "a", "--threshold", "1e3"], 2, "--threshold"),
    (["diff", "{sample}", "{other}", "--rtol", "nan"], 2, "'nan' is not a finite number"),
    (["diff", "{sample}", "{other}", "--atol", "inf"], 2, "'inf' is not a finite number"),
    (["diff", "{sample}", "{other}", "--rtol", "-1"], 2, "-1.0 is not in the range x>=0"),
    (["diff", "{sample}", "{other}", "--atol", "1e400"], 2, "--atol"),
    (["diff", "{sample}"], 2, "Missing argument"),
    (["convert", "{sample}", "{tmp}/out.kdtr", "--alignment", "100"], 2, "'100' is not a power of two from 64 to 4096"),
    (["convert", "{sample}", "{tmp}/out.kdtr", "--alignment", "99999999999999999999999"], 2, "--alignment"),
    (["convert", "{sample}", "{tmp}/out.txt"], 2, "unsupported extension '.txt'"),
    (["convert", "{tmp}/in.csv", "{tmp}/out.kdtr"], 2, "unsupported extension '.csv'"),
    (["convert", "{tmp}/missing.kdtr", "{tmp}/out.h5"], 2, "{tmp}/missing.kdtr: No such file or directory"),
    (["convert", "{sample}", "{tmp}/no/such/dir/out.h5"], 2, "directory '{tmp}/no/such/dir' does not exist"),
    (["convert", "{sample}", "{tmp}/directory.h5"], 2, "'{tmp}/directory.h5' is a directory"),
    (["convert", "{sample}", ""], 2, "an empty path"),
    (["convert", "{tmp}/garbage.h5", "{tmp}/out.kdtr"], 2, "cannot read {tmp}/garbage.h5 as hdf5"),
    (["convert", "{tmp}/pickled.npz", "{tmp}/out.kdtr"], 2, "cannot read tensor 'objects'"),
    (["convert", "{tmp}/strings.h5", "{tmp}/out.kdtr"], 2, "tensor 'names': unsupported dtype |S2"),
    (["verify", "{tmp}/missing.kdtr"], 2, "No such file or directory"),
    (["verify", "{tmp}"], 2, "Is a directory"),
    (["verify", "{tmp}/fifo.kdtr"], 2, "Not a regular file"),
    (["verify", "{tmp}/garbage.kdtr"], 2, "{tmp}/garbage.kdtr: not a KDTR file"),
    (["verify", "{tmp}/empty.kdtr"], 2, "{tmp}/empty.kdtr: file is 0 bytes, smaller than header plus trailer"),
    (["verify", "{tmp}/\udcff\udcfe.kdtr"], 2, "No such file or directory"),
    (["cat", "{sample}", "nope"], 2, "no tensor named 'nope'"),
    (["cat", "{sample}", "\udcff"], 2, "no tensor named '\\udcff'"),
    (["inspect", "{sample}", "--prefix"], 2, "--prefix"),
    (["inspect", "{sample}", "--bogus"], 2, "No such option '--bogus'"),
    (["frobnicate"], 2, "No such command 'frobnicate'"),
]


@pytest.mark.parametrize("argv, status, mentions", HOSTILE, ids=[" ".join(a)[:60] for a, _, _ in HOSTILE])
def test_hostile_arguments_get_one_error_line_and_leave_nothing_behind(files, argv, status, mentions):
    fill = {k: str(v) for k, v in files.items()}
    before = sorted(p.name for p in files["tmp"].iterdir())
    result = piped(["kdtr", *(a.format(**fill) for a in argv)], timeout=60)
    assert_clean_error(result, mentions.format(**fill))
    assert result.returncode == status, result.output
    assert result.stderr.startswith("kdtr: error: ") and not result.stdout
    assert ".tmp" not in result.output, "an error names a temporary file"
    assert sorted(p.name for p in files["tmp"].iterdir()) == before, "something was left behind"


@pytest.mark.parametrize("extension", [".kdtr", ".h5", ".npz", ".safetensors"])
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_convert_writes_with_the_users_umask(files, extension, umask):
    target = files["tmp"] / f"out{extension}"
    old = os.umask(umask)
    try:
        result = CliRunner().invoke(main, ["convert", str(files["sample"]), str(target)])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_verify_names_the_bad_tensor_and_inspect_the_layout(corpus_dir):
    result = piped(["kdtr", "verify", str(corpus_dir / "data_checksum.kdtr")])
    assert_clean_error(result, "tensor 'a'")
    assert result.returncode == 2
    result = piped(["kdtr", "inspect", str(corpus_dir / "overlapping_offsets.kdtr")])
    assert_clean_error(result, "overlaps the previous tensor")


def test_an_internal_error_is_still_one_line(files, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr("kdtr_format.cli.listing", broken)
    result = CliRunner().invoke(main, ["inspect", str(files["sample"])], prog_name="kdtr")
    assert result.exit_code == 3 and "Traceback" not in result.output
    assert result.stderr == ("kdtr: error: internal error: RuntimeError: boom "
                             "(a bug; set KDTREE_TRACEBACK=1 to see where)\n")


def test_the_console_script_entry_point_runs(files):
    result = subprocess.run([sys.executable, "-c", "import sys; from kdtr_format.cli import main; sys.argv[0] = 'kdtr'; main()",
                             "verify", str(files["sample"])], capture_output=True, text=True, env=environment(), cwd=REPO)
    assert result.returncode == 0 and result.stdout.startswith("ok: ")
