"""Every `refgen` and `kdtree` command as people run it (tests/terminal.py): in a terminal
80 columns wide and piped, with hostile arguments, and asking for help.

Three tables drive it; a new command or a new bad invocation is one line in one of them:

- RUNS: each command with small inputs. In the terminal: exit 0, no traceback, no line
  wider than 80 columns, nothing cut to "...", and a short text whole on one line (not
  broken across table cells); piped: the same, and a long text whole on one line
  (nothing wrapped or truncated).
- HOSTILE: a bad invocation and the text its one error line must name. Also: no
  traceback, a non-zero exit, and nothing written into the row's own {out} directory.
- COMMANDS: every command answers -h (and, where it needs arguments, no arguments)
  with its help, and every program answers --version.

Words in braces are filled in: {golden} the committed (slim) fixtures, {files} the bad files
made below, {out} a fresh empty directory per run. The runs go two at a time (they are
mostly interpreter and torch start-up).
"""

from __future__ import annotations

import os
import re
import shlex
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import kdtr_format
from refgen.cli import IDENTICALLY
from terminal import Result, assert_clean_error, in_terminal, piped

RUNS = [
    # argv; text whole on a line at 80 columns; text whole on a line when piped
    ("refgen list", "kernels/verify_attention.kdtr, 4 cases",
     "kernels/verify_attention.kdtr, 4 cases (+1 large): ragged tree-verify MLA attention batches"),
    ("refgen generate --kernels --out {out}", "kernels/verify_attention.kdtr", "fixtures written to {out}"),
    ("refgen verify {golden}/kernels/tree_build.kdtr", "1 of 1 fixtures regenerate identically",
     f"1 of 1 fixtures regenerate identically ({IDENTICALLY})"),
    ("refgen show {golden}/tiny.kdtr", "drafter oracle 0.6",
     "t1  prompt p1, drafter oracle 0.6, block 6, budget 20, tokens 12, rounds"),
    ("refgen materialize {golden}/kernels/tree_build.kdtr --out {out}", "tree_build.kdtr",
     "full fixtures written to {out}"),
    ("refgen show {golden}/kernels/verify_attention.kdtr", "tiny_ragged  preset tiny",
     "tiny_ragged  preset tiny, heads 4, kv_lora_rank 64, qk_rope_head_dim 16, scale 0.174"),
    ("kdtree validate --fixtures {golden}/tiny2.kdtr", "invariant DDTree == AR (layerskip)",
     "kdtree validate: torch engine (cpu, stages: torch, attention: torch)"),
    ("kdtr inspect {golden}/kernels/tree_build.kdtr --no-metadata", "cases/beyond_possible/first_child",
     "KDTR 1.0, alignment 64, "),
    ("kdtr verify {golden}/kernels/accept_compact.kdtr", "accept_compact.kdtr", "accept_compact.kdtr"),
    ("kdtree demo --max-new-tokens 4 --budget 4 --block-size 3 --plot {out}/demo.png", "DDTree layerskip",
     "oracle: knows the AR continuation, right with probability 0.8 (an upper bound); layerskip"),
]

HOSTILE = [
    # argv                                                        the error line names, exit status
    ("refgen show {files}/corrupt.kdtr",                          "{files}/corrupt.kdtr: data checksum mismatch", 2),
    ("refgen show {files}/plain.kdtr",                            "not a refgen fixture", 2),
    ("refgen show {files}/malformed.kdtr",                        "malformed model fixture metadata", 2),
    ("refgen show {files}/absent.kdtr",                           "does not exist", 2),
    ("refgen verify {files}/dir_named_kdtr",                      "no .kdtr fixtures found", 2),
    ("refgen verify {files}/absent",                              "does not exist", 2),
    ("refgen materialize {files}/plain.kdtr --out {out}",         "not a refgen fixture", 2),
    ("refgen materialize {files}/corrupt.kdtr --out {out}",       "{files}/corrupt.kdtr: data checksum mismatch", 2),
    ("refgen materialize {golden}/tiny.kdtr",                     "Missing option '--out'", 2),
    ("refgen generate --preset huge --out {out}",                 "unknown preset 'huge'", 2),
    ("refgen generate --out {out}",                               "nothing to generate", 2),
    ("refgen generate --kernels --out {files}/plain.kdtr",        "exists and is not a directory", 2),
    ("refgen generate --kernels --out ''",                        "'--out': an empty path", 2),
    ("refgen generate --config-file {files}/broken.json --out {out}", "not valid JSON", 2),
    ("refgen generate --seed -1 --kernels --out {out}",           "'--seed'", 2),
    ("refgen generate --bogus",                                   "--bogus", 2),
    ("refgen nonsense",                                           "No such command 'nonsense'", 2),
    ("kdtree demo --device foo",                                  "'foo': expected cpu, cuda or cuda:N", 2),
    ("kdtree demo --budget 100000",                               "--budget 100000: a verify forward of 100001 tree tokens", 2),
    ("kdtree demo --block-size 600",                              "max_position_embeddings 512", 2),
    ("kdtree demo --prompt '1 2 3'",                              "'1 2 3' is not a token id", 2),
    ("kdtree demo --prompt 1,,2",                                 "an empty item", 2),
    ("kdtree demo --prompt ''",                                   "'--prompt': empty", 2),
    ("kdtree demo --max-new-tokens 0",                            "'--max-new-tokens'", 2),
    ("kdtree demo --budget -1",                                   "'--budget'", 2),
    ("kdtree demo --block-size 0",                                "'--block-size'", 2),
    ("kdtree demo --accuracy nan",                                "'nan' is not a finite number", 2),
    ("kdtree demo --accuracy 1.5",                                "'--accuracy'", 2),
    ("kdtree demo --plot {out}",                                  "is a directory", 2),
    ("kdtree demo --plot ''",                                     "'--plot': an empty path", 2),
    ("kdtree demo --plot {out}/missing/a.png",                    "directory '{out}/missing' does not exist", 2),
    ("kdtree validate --json {out}",                              "is a directory", 2),
    ("kdtree validate --json ''",                                 "'--json': an empty path", 2),
    ("kdtree validate --json {out}/missing/r.json",               "directory '{out}/missing' does not exist", 2),
    ("kdtree validate --fixtures {files}/absent",                 "does not exist", 2),
    ("kdtree validate --device tpu",                              "'tpu': expected cpu, cuda or cuda:N", 2),
    ("kdtree validate --fixtures {golden}/kernels/tree_build.kdtr --impl {files}/raises_at_import.py:make",
                                                                  "importing {files}/raises_at_import.py raised RuntimeError", 2),
    ("kdtree validate --fixtures {golden}/kernels/tree_build.kdtr --impl {files}/factory_raises.py:make --json {out}/r.json",
                                                                  "make() raised ZeroDivisionError", 2),
    ("kdtree validate --fixtures {golden}/kernels/tree_build.kdtr --impl {files}/forgets_return.py:make --json {out}/r.json",
                                                                  "make() returned None, expected an adapter", 2),
    ("kdtree validate --fixtures {golden}/kernels/tree_build.kdtr --impl {files}/factory_exits.py:make --json {out}/r.json",
                                                                  "make() raised SystemExit: 0", 2),
    ("kdtree validate --fixtures {golden}/kernels/tree_build.kdtr --impl {files}/factory_dies.py:make --json {out}/r.json",
                                                                  "make() ended the process with exit status 3", 2),
    ("kdtree validate --json - --junit-xml -",                    "--json and --junit-xml name stdout (-)", 2),
    ("kdtree validate --timeout 0",                               "'--timeout'", 2),
    ("kdtree validate --timeout nan",                             "'nan' is not a finite number", 2),
    ("kdtree nonsense",                                           "No such command 'nonsense'", 2),
    ("kdtr verify {files}/corrupt.kdtr",                          "{files}/corrupt.kdtr: data checksum mismatch", 2),
    ("kdtr inspect {files}/absent.kdtr",                          "absent.kdtr: No such file or directory", 2),
    ("kdtr cat {golden}/kernels/tree_build.kdtr cases/tied_logits/parents --threshold -1", "'--threshold'", 2),
    ("kdtr diff {golden}/tiny.kdtr {golden}/tiny2.kdtr --rtol nan", "'nan' is not a finite number", 2),
    ("kdtr convert {files}/plain.kdtr ''",                        "empty", 2),
    ("kdtr nonsense",                                             "No such command 'nonsense'", 2),
]

COMMANDS = [
    # command            prints its help when run with no arguments (the others run with defaults)
    ("refgen",           True),
    ("refgen list",      False),
    ("refgen generate",  True),
    ("refgen verify",    False),
    ("refgen show",      True),
    ("refgen materialize", True),
    ("kdtree",           True),
    ("kdtree validate",  False),
    ("kdtree demo",      False),
    ("kdtr",             True),
    ("kdtr inspect",     True),
    ("kdtr verify",      True),
    ("kdtr diff",        True),
    ("kdtr cat",         True),
    ("kdtr convert",     True),
]
PROGRAMS = sorted({command.split()[0] for command, _ in COMMANDS})


def make_files(files: Path, golden: Path) -> None:
    """The bad inputs HOSTILE names under {files}."""
    corrupt = bytearray((golden / "kernels" / "tree_build.kdtr").read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF                      # inside a tensor's data
    (files / "corrupt.kdtr").write_bytes(bytes(corrupt))
    kdtr_format.write(files / "plain.kdtr", {"x": np.zeros(3)}, {"made by": "someone else"})
    kdtr_format.write(files / "malformed.kdtr", {"x": np.zeros(3)}, {"kdtree_fixture": 1, "kind": "model"})
    (files / "dir_named_kdtr" / "x.kdtr").mkdir(parents=True)
    (files / "broken.json").write_text("{")
    (files / "raises_at_import.py").write_text("raise RuntimeError('planted at import')\n")
    (files / "factory_raises.py").write_text("def make():\n    return 1 / 0\n")
    make_hostile_names(files, golden)
    (files / "forgets_return.py").write_text("def make():\n    dict()\n")
    (files / "factory_exits.py").write_text("import sys\n\n\ndef make():\n    sys.exit(0)\n")
    (files / "factory_dies.py").write_text("import os\n\n\ndef make():\n    os._exit(3)\n")


# What a terminal would act on (an OSC title, a CSI screen erase, the C1 CSI, BEL, a bidi
# override), rich markup, matplotlib mathtext, a lone surrogate and a non-UTF-8 byte, in
# names a fixture and an adapter bring.
OSC, ERASE, C1, RTL = "\x1b]0;pwned\x07", "\x1b[2J", "\x9b31m", "\u202e"
HOSTILE_TRACE = f"t{OSC}{RTL}"
HOSTILE_PROMPT = "[/x]"
HOSTILE_ADAPTER = f"{OSC}adapter{RTL}"
HOSTILE_RAISES = f"{ERASE}{C1}{RTL}\udc80 boom"
HOSTILE_FIXTURE = os.fsdecode(b"\x1b[2J\xff$\\foo$.kdtr")
RAW = [OSC, "\x1b]", ERASE, "\x9b", "\x07", RTL, "\ufffd"]      # none may reach the terminal (\ufffd: an undecodable byte)


def make_hostile_names(files: Path, golden: Path) -> None:
    """{files}/names.kdtr: tiny2's metadata with a prompt and a trace renamed (refgen show);
    {files}/names/: the tree_build fixture under a hostile file name, and an adapter whose
    name and exception hold control characters (kdtree validate)."""
    with kdtr_format.open(golden / "tiny2.kdtr") as reader:
        meta = reader.metadata
    meta["prompts"][0]["name"] = HOSTILE_PROMPT
    meta["traces"][0]["name"] = HOSTILE_TRACE
    kdtr_format.write(files / "names.kdtr", {"x": np.zeros(1)}, meta)
    (files / "names").mkdir()
    (files / "names" / HOSTILE_FIXTURE).write_bytes((golden / "kernels" / "tree_build.kdtr").read_bytes())
    (files / "hostile_adapter.py").write_text(
        "class Hostile:\n"
        f"    name = {HOSTILE_ADAPTER!r}\n"
        "    capabilities = ('tree',)\n\n"
        "    def build_tree(self, topk_lp, topk_id, budget, block_size):\n"
        f"        raise RuntimeError({HOSTILE_RAISES!r})\n\n\n"
        "def make():\n    return Hostile()\n")


class Runs:
    """Every run of this file, in the order the tests ask for them. `result(key)` starts that
    run and the next one not yet started, so that two run at a time, and waits for its own."""

    def __init__(self, root: Path, golden: Path) -> None:
        self.root, self.golden, self.outs = root, golden, {}
        self.files = root / "files"
        self.files.mkdir()
        make_files(self.files, golden)
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.jobs: dict[str, Callable[[], Result]] = {}
        self.futures: dict[str, Future] = {}

    def fill(self, text: str, key: str) -> str:
        return text.format(golden=self.golden, files=self.files, out=self.out(key))

    def out(self, key: str) -> Path:
        if key not in self.outs:
            self.outs[key] = self.root / f"out{len(self.outs)}"
            self.outs[key].mkdir()
        return self.outs[key]

    def add(self, key: str, argv: str, terminal: bool, columns: int = 80, **options) -> None:
        words = shlex.split(self.fill(argv, key))
        self.jobs[key] = (lambda: in_terminal(words, columns=columns, **options)) if terminal else \
            (lambda: piped(words))

    def result(self, key: str) -> Result:
        self._start(key)
        self._start(next((k for k in self.jobs if k not in self.futures), key))
        return self.futures[key].result()

    def _start(self, key: str) -> None:
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self.jobs[key])


@pytest.fixture(scope="module")
def runs(committed_golden, tmp_path_factory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("cli"), committed_golden)
    for argv, *_ in RUNS:
        runs.add(f"terminal {argv}", argv, terminal=True)
    for argv, *_ in RUNS:
        runs.add(f"piped {argv}", argv, terminal=False)
    runs.add("wide", "refgen show {golden}/tiny.kdtr", terminal=True, columns=160)
    runs.add("interrupted", "kdtree validate --fixtures {golden}/tiny2.kdtr --json {out}/r.json",
             terminal=True, interrupt_on="checking")
    for argv, *_ in HOSTILE:
        runs.add(f"hostile {argv}", argv, terminal=False)
    for command, no_args_help in COMMANDS:
        runs.add(f"help {command}", f"{command} -h", terminal=False)
        if no_args_help:
            runs.add(f"bare {command}", command, terminal=False)
    for program in PROGRAMS:
        runs.add(f"version {program}", f"{program} --version", terminal=False)
    for terminal in (True, False):
        where = "terminal" if terminal else "piped"
        for argv in NAMES:
            runs.add(f"names {where} {argv}", argv, terminal=terminal)
    yield runs
    runs.pool.shutdown(cancel_futures=True)


def ids(table: list[tuple]) -> list[str]:
    return [row[0] for row in table]


# ---------------------------------------------------------------------------- (a) commands

@pytest.mark.parametrize("argv, short, long", RUNS, ids=ids(RUNS))
def test_in_a_terminal_80_columns(runs, argv, short, long):
    key = f"terminal {argv}"
    result = runs.result(key)
    assert result.returncode == 0 and "Traceback" not in result.output, result.output
    too_wide = [line for line in result.screen_lines if len(line) > 80]
    assert not too_wide, "lines wider than the 80-column terminal:\n" + "\n".join(too_wide)
    assert "…" not in result.output, f"a cell cut short:\n{result.output}"
    text = runs.fill(short, key)
    assert any(text in line for line in result.screen_lines), f"{text!r} is not whole:\n{result.output}"


@pytest.mark.parametrize("argv, short, long", RUNS, ids=ids(RUNS))
def test_piped(runs, argv, short, long):
    key = f"piped {argv}"
    result = runs.result(key)
    assert result.returncode == 0 and "Traceback" not in result.output, result.output
    assert "…" not in result.output and "\x1b[" not in result.output, result.output
    text = runs.fill(long, key)
    assert any(text in line for line in result.stdout.splitlines()), f"{text!r} is not whole:\n{result.stdout}"


@pytest.mark.parametrize("argv", [argv for argv, *_ in RUNS if "--plot" in argv])
def test_a_file_written_is_named_on_stderr(runs, argv):
    key = f"piped {argv}"
    result = runs.result(key)
    (written,) = [word for word in shlex.split(runs.fill(argv, key)) if word.startswith(str(runs.out(key)))]
    assert Path(written).is_file() and f"wrote {written}" in result.stderr.splitlines(), result.stderr


def test_a_wider_terminal_is_used_in_full(runs):
    result = runs.result("wide")
    assert result.returncode == 0
    assert 80 < result.widest <= 160, "\n".join(result.screen_lines)


def test_ctrl_c_during_validate_is_one_line_and_130(runs):
    result = runs.result("interrupted")
    assert result.returncode == 130
    assert_clean_error(result, mentions="interrupted")
    assert list(runs.out("interrupted").iterdir()) == []


# ---------------------------------------------------------------------------- (b) hostile arguments

@pytest.mark.parametrize("argv, names, status", HOSTILE, ids=ids(HOSTILE))
def test_hostile_argument(runs, argv, names, status):
    key = f"hostile {argv}"
    result = runs.result(key)
    assert_clean_error(result, mentions=runs.fill(names, key))
    assert result.stdout == "", f"output beside the error:\n{result.stdout}"
    assert result.returncode == status
    assert list(runs.out(key).iterdir()) == [], "a bad invocation wrote files"


# ---------------------------------------------------------------------------- (c) help and version

@pytest.mark.parametrize("command, no_args_help", COMMANDS, ids=ids(COMMANDS))
def test_help(runs, command, no_args_help):
    keys = [f"help {command}"] + ([f"bare {command}"] if no_args_help else [])
    for key in keys:
        result = runs.result(key)
        assert result.returncode == 0 and result.stderr == "", result.output
        assert result.stdout.startswith(f"Usage: {command} "), result.output
        assert max(map(len, result.stdout.splitlines())) <= 80, result.stdout


@pytest.mark.parametrize("program", PROGRAMS)
def test_version(runs, program):
    result = runs.result(f"version {program}")
    assert result.returncode == 0, result.output
    assert re.fullmatch(rf"{program}, version \d+\.\d+\.\d+\S*( \(.*\))?", result.stdout.strip()), result.output


# ---------------------------------------------------------------------------- (d) names from files

NAMES = {
    # argv: exit status, the names as the run shows them (escaped)
    "refgen show {files}/names.kdtr": (0, [HOSTILE_PROMPT, repr(HOSTILE_TRACE)]),
    "kdtree validate --fixtures {files}/names --impl {files}/hostile_adapter.py:make --require tree "
    "--html {out}/r.html --junit-xml {out}/r.xml":
        (1, [repr(HOSTILE_ADAPTER), repr(HOSTILE_FIXTURE), "raised RuntimeError", "wrote {out}/r.html",
             "wrote {out}/r.xml"]),
}


@pytest.mark.parametrize("where", ["terminal", "piped"])
@pytest.mark.parametrize("argv", NAMES, ids=list(NAMES))
def test_names_from_files_reach_the_terminal_escaped(runs, argv, where):
    key = f"names {where} {argv}"
    result = runs.result(key)
    status, shown = NAMES[argv]
    assert result.returncode == status and "Traceback" not in result.output, result.output
    raw = [r for r in RAW if r in result.output]
    assert not raw, f"{raw} reached the terminal raw:\n{result.output!r}"
    text = " ".join(result.screen_lines) if where == "terminal" else result.output
    for name in shown:
        assert runs.fill(name, key) in text, f"{name!r} is not shown:\n{result.output}"
    if where == "terminal":
        too_wide = [line for line in result.screen_lines if len(line) > 80]
        assert not too_wide, "lines wider than the 80-column terminal:\n" + "\n".join(too_wide)
