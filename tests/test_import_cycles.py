"""Imports run one way: no module of the project's packages imports, at any level (a function's
imports and TYPE_CHECKING blocks included), a module that imports it back."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("kdtr_format", "refgen", "engine", "kernels_cuda")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` names in an import statement (a name imported from a package,
    when it is a module, counts as that module); a package's own submodules do not count."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                          for alias in node.names]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                targets.add(name)
    return targets


def test_no_two_modules_import_each_other() -> None:
    paths = {module_name(path): path for package in PACKAGES for path in (REPO / package).rglob("*.py")}
    graph = {module: imported(module, path, set(paths)) for module, path in paths.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"an import cycle: {' -> '.join(error.args[1])}") from None
