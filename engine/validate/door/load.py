"""Loading an adapter from `--impl module:factory` (or path/to/file.py:factory): the import and
the factory run through the door (guard.py), and every way they fail is a ValueError naming
the spec."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .guard import AdapterFault, call, describe, watched


def load_impl(spec: str) -> Any:
    """An adapter from ``module:factory`` or ``path/to/file.py:factory`` (factory() -> adapter).
    ValueError naming the spec when it is empty (an unset variable: never the built-in engine instead),
    when the module cannot be imported, raises (or exits) while
    importing, lacks the factory, or the factory raises, exits or returns None. The import and
    the factory run through the door (guard.py)."""
    refuse_empty(spec)
    target, sep, factory_name = spec.rpartition(":")
    if not sep or not target or not factory_name:
        raise ValueError(f"--impl {spec!r}: expected 'module:factory' or 'path/to/file.py:factory'")
    if is_path(target):
        refuse_non_python(spec, target)
    try:
        with watched(f"importing {target}"):
            module = _import(target)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
            (target == exc.name or target.startswith(exc.name + "."))
        how = ("; name a module on PYTHONPATH or in the current directory, or a file: path/to/file.py:factory"
               if missing else "")           # the module itself is not there, not one it imports
        if missing and Path(target).is_file():          # `--impl notes.txt:X` in notes.txt's folder
            refuse_non_python(spec, target)
        raise ValueError(f"--impl {spec!r}: cannot import {target!r} ({exc}){how}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise ValueError(f"--impl {spec!r}: importing {target} raised {describe(exc)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--impl {spec!r}: {target} has no callable {factory_name!r}")
    try:
        adapter = call(factory_name, factory)
    except AdapterFault as fault:
        raise ValueError(f"--impl {spec!r}: {fault}") from None
    if adapter is None:
        raise ValueError(f"--impl {spec!r}: {factory_name}() returned None, expected an adapter")
    return adapter


def refuse_empty(spec: str) -> None:
    """ValueError for an empty or blank spec (`--impl "$IMPL"` with IMPL unset), which must never
    mean the built-in engine."""
    if not spec.strip():
        raise ValueError(f"--impl {spec!r} is empty: name the adapter's factory, 'module:factory' or "
                         f"'path/to/file.py:factory' (without --impl, kdtree checks its built-in engine)")


def is_path(target: str) -> bool:
    """Whether the part of a spec before its last ':' names a file, not a module: it ends in .py,
    holds a path separator, or is no dotted module name (a.b.c of Python identifiers)."""
    separators = {"/", os.sep, os.altsep} - {None}
    return (target.endswith(".py") or any(sep in target for sep in separators)
            or not all(part.isidentifier() for part in target.split(".")))


def refuse_non_python(spec: str, target: str) -> None:
    """ValueError naming the spec unless `target` is an existing Python file (*.py)."""
    path = Path(target)
    if path.is_dir():
        raise ValueError(f"--impl {spec!r}: {target} is a directory, not a Python file (.py): name the "
                         f"adapter's file, path/to/file.py:factory")
    if not path.exists():
        raise ValueError(f"--impl {spec!r}: no file {target}" + (
            "" if target.endswith(".py") else " (expected path/to/file.py:factory or module:factory)"))
    if path.suffix != ".py":
        raise ValueError(f"--impl {spec!r}: {target} is not a Python file (.py)")


def _import(target: str) -> ModuleType:
    """A module from a file path ending in .py, its folder first on sys.path from then on (as
    `python path/to/file.py` has it: the file imports its neighbours, when loaded and in its
    methods), or by name from sys.path and then the current directory (where `python -m` finds
    it, and a `kdtree` console script would not)."""
    if target.endswith(".py"):
        path = Path(target)
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(f"kdtree_impl_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(target)
    finally:
        if added:
            sys.path.remove(cwd)
