"""`kdtr` on bad input: every error names the file it is about, and every bad input exits 2 (a
corrupt file as a missing one: `kdtr diff` exits 1 only for files that differ); a tensor a slim
fixture omits is named as such, with the command that writes the full fixture."""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kdtr_format
from kdtr_format.cli import main
from kdtr_testlib import CORRUPTIONS
from terminal import REPO, assert_clean_error, in_terminal, piped

TREE_BUILD = REPO / "tests" / "golden" / "kernels" / "tree_build.kdtr"


def kdtr(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="kdtr")


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_a_corrupt_file_is_named_and_exits_2(corpus_dir, case):
    """Whichever check finds the problem (opening, the metadata, a tensor's checksum)."""
    bad, good = corpus_dir / f"{case.name}.kdtr", corpus_dir / "valid.kdtr"
    for argv in (["verify", bad], ["diff", good, bad], ["diff", bad, good]):
        result = kdtr(*argv)
        assert result.exit_code == 2, (argv, result.output)
        assert result.stderr.startswith(f"kdtr: error: {bad}: ") and case.match in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_the_reader_marks_its_errors_with_the_file(corpus_dir):
    """The mark, not the message: a program that names the file itself does not name it twice."""
    for name, read in (("bad_end_magic", lambda r: None), ("metadata_bad_json", lambda r: r.metadata),
                       ("data_checksum", lambda r: r["a"]), ("data_checksum", lambda r: r.verify())):
        path = corpus_dir / f"{name}.kdtr"
        with pytest.raises(kdtr_format.FormatError) as caught:
            with kdtr_format.open(path) as reader:
                read(reader)
        assert caught.value.path == str(path) and str(path) not in str(caught.value)


def test_diff_of_a_corrupt_file_piped_is_one_line_naming_it(corpus_dir):
    """The issue's case: `kdtr diff a b` said "end magic ..." without saying which."""
    bad = corpus_dir / "bad_end_magic.kdtr"
    result = piped(["kdtr", "diff", str(corpus_dir / "valid.kdtr"), str(bad)])
    assert_clean_error(result, f"kdtr: error: {bad}: ")
    assert result.returncode == 2


def test_cat_of_a_tensor_a_slim_fixture_omits_says_so_and_what_to_run(tmp_path):
    """tree_build.kdtr is committed slim: its random draft logits are drawn from its seed."""
    name = "cases/random/draft_logits"
    with kdtr_format.open(TREE_BUILD) as reader:
        assert name not in reader and name in reader.metadata["seeded_tensors"]
    path = tmp_path / "tree_build.kdtr"
    shutil.copyfile(TREE_BUILD, path)
    result = kdtr("cat", "--summary", path, name)
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"kdtr: error: {path}: {name} is not stored: the fixture is slim (its tensors drawn "
                             "from a seed are named, with their sha256, in its metadata's seeded_tensors); "
                             f"`refgen materialize {path} --out DIR` writes the full fixture\n")
    assert kdtr("cat", path, "cases/nothing").stderr == f"kdtr: error: no tensor named 'cases/nothing' in {path}\n"


def test_inspect_says_a_fixture_is_slim():
    result = kdtr("inspect", "--no-metadata", TREE_BUILD)
    assert result.exit_code == 0, result.output
    with kdtr_format.open(TREE_BUILD) as reader:
        count = len(reader.metadata["seeded_tensors"])
    lines = result.stdout.splitlines()
    assert lines[2:4] == [f"slim: {count} seeded tensors not stored (metadata seeded_tensors); the full file:",
                          f"  refgen materialize {TREE_BUILD} --out DIR"], lines


def test_inspect_breaks_the_command_to_fit_the_terminal():
    """On a path that makes the one-line command wider than 80 columns, the command takes one
    line a part, joined by backslashes: every line fits, and the shell reads the same command."""
    with tempfile.TemporaryDirectory() as short:      # a path of 70 characters, wherever tmp is
        name = "x" * (70 - len(f"{short}//tree_build.kdtr"))
        path = Path(short) / name / "tree_build.kdtr"
        path.parent.mkdir()
        shutil.copyfile(TREE_BUILD, path)
        result = in_terminal(["kdtr", "inspect", "--no-metadata", str(path)], columns=80)
    assert len(f"  refgen materialize {path} --out DIR") > 80 >= len(f"    {path} \\")
    assert result.returncode == 0 and result.widest <= 80, "\n".join(result.screen_lines)
    start = result.screen_lines.index("  refgen materialize \\")
    command = result.screen_lines[start:start + 3]
    assert command[1:] == [f"    {path} \\", "    --out DIR"], command
    assert shlex.split(" ".join(line.removesuffix("\\") for line in command)) == \
        ["refgen", "materialize", str(path), "--out", "DIR"]


def test_inspect_of_a_full_fixture_says_nothing_of_slim(tmp_path):
    path = tmp_path / "full.kdtr"
    kdtr_format.write(path, {"x": np.zeros(3, np.float32)},
                      metadata={"seeded_tensors": {"x": {"dtype": "float32", "shape": [3], "sha256": "0" * 64}}})
    result = kdtr("inspect", "--no-metadata", path)
    assert result.exit_code == 0 and "slim" not in result.stdout, result.stdout
