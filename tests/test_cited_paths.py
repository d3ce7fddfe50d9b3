"""Every repository path the docs and the code's docstrings and comments name exists, and every
Markdown file a docstring or comment names is one of the repository's.

A path is a word that starts at one of the repository's top-level folders (`engine/`, `refgen/`,
`tests/`, ...) and ends in a file name with an extension, or a `*` pattern of them
(`tests/engine/test_server*.py`). It is found when it exists from the repository root or from
the folder of the file naming it or one above (tests/x.py may say `engine/test_cli.py` for
tests/engine/test_cli.py). A module moved or renamed leaves its old path in a docstring; this
test names the file and line. NOT_COMMITTED lists the paths the docs name as made on demand,
never committed. A bare Markdown name (`model.md`) in a docstring or comment must be a file of
the repository by that name: the design files outside it (MODEL.md, ...) are restated under
docs/, and the code cites those (tests/test_docs.py holds the docs to the same rule).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("ci", "docs", "engine", "kdtr_format", "kernels_cuda", "refgen", "scripts", "tests")
CITED = re.compile(r"(?<![\w/.$~-])((?:%s)/[\w./*-]*\.[A-Za-z*]\w*)" % "|".join(TOP))
MD_NAME = re.compile(r"(?<![\w$/.:{}-])([\w-]+\.md)\b")     # not part of a path, a $VARIABLE or a {template}
WRITTEN = {"k2_layers.md"}                    # a file a benchmark writes, named in its docstring
NOT_COMMITTED = {
    "tests/golden/kimi-k2.kdtr",            # 275 MB: `refgen generate --preset kimi-k2` writes it
    "docs/results/tp-*.md",                 # the TP tables, committed with the GPU run that makes them
}


def citing_files() -> list[Path]:
    docs = [REPO / "README.md", REPO / "kdtr_format" / "SPEC.md",
            *(p for p in (REPO / "docs").rglob("*.md") if "notes" not in p.relative_to(REPO / "docs").parts)]
    code = [p for top in TOP for p in (REPO / top).rglob("*.py")]
    return sorted(p for p in docs + code if p != Path(__file__).resolve())    # this file's examples are stale on purpose


def found(path: str, citing: Path) -> bool:
    folder = citing.parent
    return any(any(base.glob(path)) if "*" in path else (base / path).exists()
               for base in (REPO, folder, *folder.parents))


def missing(citing: Path) -> list[str]:
    text = citing.read_text(errors="replace")
    return [f"{citing.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}"
            for m in CITED.finditer(text)
            if m.group(1) not in NOT_COMMITTED and not found(m.group(1), citing)]


def prose(source: str) -> list[tuple[int, str]]:
    """The (line, text) of a Python file's docstrings and comments."""
    tree = ast.parse(source)
    texts = [(node.body[0].lineno, node.body[0].value.value) for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
             and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
             and isinstance(node.body[0].value.value, str)]
    comments = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    return texts + comments


def test_every_cited_repository_path_exists():
    stale = [line for citing in citing_files() for line in missing(citing)]
    assert not stale, "paths named that are not in the repository:\n" + "\n".join(stale)


def test_every_markdown_file_a_docstring_or_comment_names_is_in_the_repository():
    names = {p.name for p in REPO.rglob("*.md") if ".git" not in p.parts}
    outside = [f"{citing.relative_to(REPO)}:{line}: {name}"
               for citing in citing_files() if citing.suffix == ".py"
               for line, text in prose(citing.read_text()) for name in MD_NAME.findall(text) if name not in names | WRITTEN]
    assert not outside, "Markdown files named that are not in the repository:\n" + "\n".join(outside)


@pytest.mark.parametrize("text, kind", [("see engine/validate/regime.py (the regime)", "stale"),
                                        ("see engine/validate/judging/regime.py.", "present"),
                                        ("tests/engine/test_server*.py", "present"),
                                        ("tests/engine/test_nothing_*.py", "stale")])
def test_a_stale_path_is_caught(text, kind):
    citing = REPO / "engine" / "probe_cited_paths.py"       # never written: only its folder is used
    matches = [m.group(1) for m in CITED.finditer(text)]
    assert matches, text
    assert all(found(p, citing) for p in matches) == (kind == "present")
