"""The documentation stands on its own: it cites only files of this repository, the README
keeps exactly two commands for a fresh machine, the README and `refgen verify` say the same
thing by "regenerates identically", and every example output is what its command prints.

An example output is a fenced block right under the line OUTPUT_MARK:

    <!-- output: tests/test_docs.py runs the command and compares -->
    ```
    $ kdtree validate --impl docs/examples/numpy_adapter.py:NumpyAdapter
    ...
    PASSED: 41 checks (25 exact, 4 within tolerance, 12 skipped)
    ```

The first line is the command, run from the repository root, piped (so no line is wrapped)
and as in CI (the variable CI set);
the others are lines of what it prints (stdout and stderr), in order, adjacent where they are
adjacent in the block; a line `...` stands for any lines left out. What legitimately differs
from run to run or machine to machine is not compared (VARIES): times, the checkout's path,
a measured float error (its rounding is the CPU's and BLAS's) and the bound it is held to (atol +
rtol |x| at the element of the worst error, which the rounding picks), and whether a float64 value
came out exact or within tolerance (the same reason). Each distinct command runs
once for all the blocks that show it.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from refgen.cli import IDENTICALLY
from refgen.regen import REGEN_REL
from terminal import piped

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "kdtr_format" / "SPEC.md",
               *(REPO / "docs").rglob("*.md"), *(REPO / "docs").rglob("*.py")])
# a file name ending in .md that is not part of a longer path, a $VARIABLE or a URL
MD_NAME = re.compile(r"(?<![\w$/.:-])([\w./-]*\w\.md)\b")


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_cite_only_files_of_the_repository(doc):
    text = doc.read_text()
    assert "/work/" not in text, f"{doc.name} names a path outside the repository"
    names = {p.name for p in REPO.rglob("*.md") if ".git" not in p.parts}
    for cited in MD_NAME.findall(text):
        found = (REPO / cited).is_file() or (doc.parent / cited).is_file() or ("/" not in cited and cited in names)
        assert found, f"{doc.name} cites {cited}, which is not in the repository"


def test_the_readme_keeps_two_commands_for_a_fresh_machine():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    assert [len(b.strip().splitlines()) for b in blocks] == [1, 1], blocks
    assert blocks[0].strip().endswith("kdtree validate") and blocks[1].strip().endswith("ci/gate")


def test_readme_and_refgen_verify_define_regenerates_identically():
    readme = one_line((REPO / "README.md").read_text())
    assert f"floats within {REGEN_REL:g} of their scale" in IDENTICALLY
    assert f"regenerates identically ({IDENTICALLY})" in readme


def test_readme_says_how_to_install_torch_and_the_plot_extra():
    readme = one_line((REPO / "README.md").read_text())
    assert "https://download.pytorch.org/whl/cpu" in readme
    assert "'.[plot]'" in readme


# ---------------------------------------------------------------------------- example outputs

OUTPUT_MARK = "<!-- output: tests/test_docs.py runs the command and compares -->"
GAP = "..."
VARIES = [
    (re.compile(r"\b\d+(\.\d+)? ?s\b"), "<seconds>"),                                 # 0.3 s, in 10.58s
    (re.compile(r"\b(prefill|topk|build|compile|verify|accept|compact) \d+\.\d+"), r"\1 <ms>"),   # stage ms
    (re.compile(r"\b\d\.\d\de[-+]\d\d( <= | > )"), r"<error>\1"),                    # a measured error
    (re.compile(r"( <= | > )\d\.\d\de[-+]\d\d\b"), r"\1<bound>"),      # its bound, atol + rtol|x| at the worst element
    (re.compile(re.escape(str(REPO) + os.sep)), ""),                                      # the checkout's path
    # a float64 value that the CPU's BLAS reproduces bit for bit or within 1e-14: exact or within
    # tolerance (their sum is compared, and every other status)
    (re.compile(r"\b(\d+) exact, (\d+) within tolerance\b"),
     lambda m: f"{int(m[1]) + int(m[2])} exact or within tolerance"),
    (re.compile(r"^( *)(exact           |within tolerance)"), r"\1<passed>        "),
]


@dataclass(frozen=True)
class Example:
    doc: str
    line: int               # of the command, 1-based
    command: str
    shown: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != OUTPUT_MARK:
                continue
            assert lines[i + 1].strip() == "```" and lines[i + 2].startswith("$ "), \
                f"{doc.name}:{i + 1}: the output mark must stand over a fenced block starting with `$ COMMAND`"
            end = lines.index("```", i + 2)
            found.append(Example(str(doc.relative_to(REPO)), i + 3, lines[i + 2][2:], tuple(lines[i + 3 : end])))
    return found


EXAMPLES = examples()
_printed: dict[str, str] = {}


def printed(command: str) -> str:
    """What `command` prints, piped, from the repository root (run once per command)."""
    if command not in _printed:
        result = piped(shlex.split(command), timeout=600,          # CI: pytest's summary lines whole
                       env={"PYTEST_ADDOPTS": "-p no:cacheprovider", "CI": "true"})
        assert "Traceback" not in result.output, f"{command}:\n{result.output}"
        _printed[command] = result.output
    return _printed[command]


def normal(line: str) -> str:
    for pattern, replacement in VARIES:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def unmatched(shown: tuple[str, ...], output: list[str]) -> str | None:
    """The first shown line the output lacks where the block puts it, or None when all match."""
    at = 0
    gap = False
    for line in shown:
        if line.strip() == GAP:
            gap = True
            continue
        want = normal(line)
        if gap:
            found = next((k for k in range(at, len(output)) if normal(output[k]) == want), None)
        else:
            found = at if at < len(output) and normal(output[at]) == want else None
        if found is None:
            return line
        at, gap = found + 1, False
    return None


def test_the_docs_show_example_outputs():
    assert {e.doc for e in EXAMPLES} >= {"docs/adapter.md", "docs/ci.md"}


@pytest.mark.slow                   # each command is a validate run or a pytest session: 10-20 s on 2 cores
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_an_example_output_is_what_its_command_prints(example):
    output = printed(example.command).splitlines()
    missing = unmatched(example.shown, output)
    assert missing is None, (f"{example}: `{example.command}` does not print, where the block shows it:\n"
                             f"{missing}\n--- it printed:\n" + "\n".join(output))


@pytest.mark.parametrize("shown, output, missing", [
    (("a", "b"), ["a", "b"], None),
    (("a", "b"), ["a", "x", "b"], "b"),                         # adjacent in the block: adjacent in the output
    (("a", "...", "b"), ["a", "x", "b"], None),
    (("...", "c"), ["a", "b"], "c"),
    (("in 1.5s", "7.50e-06 <= 3.89e-04 x"), ["in 20.25s", "7.53e-06 <= 3.89e-04 x"], None),
    (("7.50e-06 <= 3.89e-04",), ["7.50e-06 <= 3.90e-04"], None),       # the bound at the worst element varies
    (("7.5e-06 <= 3.9e-04 [float32: atol 0.0003]",), ["7.5e-06 <= 3.9e-04 [float32: atol 0.0004]"],
     "7.5e-06 <= 3.9e-04 [float32: atol 0.0003]"),                     # the tolerance's terms are compared
    (("got 5, expected 1",), ["got 4, expected 1"], "got 5, expected 1"),
    (("41 checks (25 exact, 4 within tolerance, 12 skipped)",), ["41 checks (27 exact, 2 within tolerance, 12 skipped)"],
     None),
    (("41 checks (25 exact, 4 within tolerance, 12 skipped)",), ["41 checks (25 exact, 3 within tolerance, 12 skipped)"],
     "41 checks (25 exact, 4 within tolerance, 12 skipped)"),
    (("  exact             prefill logits",), ["  within tolerance  prefill logits"], None),
    (("  exact             prefill logits",), ["  FAIL              prefill logits"], "  exact             prefill logits"),
])
def test_the_comparison_varies_only_what_varies(shown, output, missing):
    assert unmatched(shown, output) == missing
