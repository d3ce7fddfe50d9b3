"""The runner: every fixture in the directory through the adapter, one report."""

from __future__ import annotations

import os
from typing import Any, Callable

import kdtr_format
from kdtr_format import PRESETS, KdtrError

from ..adapter import TorchAdapter
from .acceptance import with_trace_acceptance
from .deviations import with_deviations
from .fixtures import _kdtr_files, find_fixtures
from .invariant import preset_invariant_checks
from .kernel_checks import _KERNEL_CASES
from .model_checks import _model_fixture
from .protocol import capabilities
from .report import Check, Report, Status, ValidateError


def validate(adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
             log: Callable[[str], None] = lambda line: None) -> Report:
    """Run every check (module docstring) and return the report. adapter None = the built-in engine."""
    builtin = adapter is None
    if builtin:
        adapter = TorchAdapter(device)
    directory = find_fixtures(fixtures)
    report = Report(implementation=getattr(adapter, "name", type(adapter).__name__), device=device,
                    fixtures=str(directory), backends=dict(getattr(adapter, "backends", {})))
    caps = capabilities(adapter)
    root = directory if directory.is_dir() else directory.parent       # one fixture file: just that file
    for path in _kdtr_files(directory):
        log(f"checking {path.relative_to(root)}")
        try:
            with kdtr_format.open(path) as reader:
                kind = reader.metadata.get("kind")
                if kind == "model":
                    checks = with_trace_acceptance(_model_fixture(adapter, caps, reader, path, builtin), reader)
                    report.checks += with_deviations(report, adapter, checks, path.name)
                elif kind in _KERNEL_CASES:
                    report.checks += _KERNEL_CASES[kind](adapter, caps, reader,
                                                         str(path.relative_to(root)))
                else:
                    report.checks.append(Check(path.name, "fixture", Status.FAIL,
                                               detail=f"unknown fixture kind {kind!r}"))
        except KdtrError as exc:
            raise ValidateError(f"{path}: {exc}") from None
        except ValidateError:
            raise
        except Exception as exc:        # an adapter that crashes fails this fixture, not the run
            report.checks.append(Check(path.name, "run", Status.FAIL, detail=f"{type(exc).__name__}: {exc}"))
    if builtin and directory.is_dir():
        for preset in sorted(set(PRESETS) - {p.stem for p in _kdtr_files(directory)}):
            log(f"invariant on preset {preset} (no fixture: random weights)")
            report.checks += preset_invariant_checks(adapter, preset)
    return report
