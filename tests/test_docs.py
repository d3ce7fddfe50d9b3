"""The documentation stands on its own: it cites only files of this repository, the README
keeps exactly two commands for a fresh machine, and the README and `refgen verify` say
the same thing by "regenerates identically"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refgen.cli import IDENTICALLY
from refgen.regen import REGEN_REL

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
