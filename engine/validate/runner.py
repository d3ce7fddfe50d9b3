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
from .regime import DTYPES, CasesView, Regime
from .report import Check, Report, Status, ValidateError


def validate(adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
             log: Callable[[str], None] = lambda line: None, dtype: str = "float32") -> Report:
    """Run every check (module docstring) and return the report. adapter None = the built-in engine.
    dtype: the compute dtype the implementation is told (`set_dtype`) and judged in (regime.py)."""
    builtin = adapter is None
    if builtin:
        adapter = TorchAdapter(device)
    _set_dtype(adapter, dtype)
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
                    checks = _model_fixture(adapter, caps, reader, path, builtin, dtype)
                    regime = Regime.of(reader.metadata, dtype)
                    if regime is not None:
                        checks = with_trace_acceptance(checks, CasesView(reader, regime))
                    report.checks += _stamped(with_deviations(report, adapter, checks, path.name), "exact")
                elif kind in _KERNEL_CASES:
                    report.checks += _stamped(_KERNEL_CASES[kind](adapter, caps, reader, str(path.relative_to(root))),
                                              "float32: the kernel case's tolerance (float32 inputs)")
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


def _set_dtype(adapter: Any, dtype: str) -> None:
    """Tell the adapter its compute dtype (protocol: `set_dtype`); bfloat16 needs it."""
    if dtype not in DTYPES:
        raise ValidateError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    set_dtype = getattr(adapter, "set_dtype", None)
    if not callable(set_dtype):
        if dtype != "float32":
            raise ValidateError(f"--dtype {dtype}: the adapter has no set_dtype method to be told its dtype")
        return
    try:
        set_dtype(dtype)
    except (ValueError, TypeError) as exc:
        raise ValidateError(f"--dtype {dtype}: the adapter refuses it ({exc})") from None


def _stamped(checks: list[Check], default: str) -> list[Check]:
    """Rows without a regime get `default` for float comparisons, "exact" for exact ones."""
    for check in checks:
        if not check.regime and check.status is not Status.SKIPPED:
            check.regime = default if check.tolerance is not None else "exact"
    return checks
