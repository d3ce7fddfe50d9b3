"""The runner: every fixture in the directory through the checked adapter, one report,
then the capability requirements (protocol.resolve_capabilities) applied to it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Collection

import kdtr_format
from kdtr_format import PRESETS, KdtrError

from ..adapter import TorchAdapter
from ..parallel import World
from .acceptance import with_trace_acceptance
from .batched import batched_checks
from .checked import checked_views
from .deviations import with_deviations
from .fixtures import _kdtr_files, find_fixtures
from .invariant import preset_invariant_checks
from .kernel_checks import _KERNEL_CASES
from .model_checks import _model_fixture
from .protocol import CAPABILITIES, resolve_capabilities
from .regime import DTYPES, CasesView, Regime
from .report import Check, Report, Status, ValidateError


def validate(adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
             log: Callable[[str], None] = lambda line: None,
             require: str | Collection[str] | None = None, invariant: bool = False,
             dtype: str = "float32", world: World | None = None) -> Report:
    """Run every check (package docstring) and return the report. adapter None = the built-in
    engine; require: the capabilities whose checks must run (protocol.resolve_capabilities;
    None = what the adapter declares, else what it implements; when `fixtures` is one file,
    only those of them that the file has checks for); invariant: the built-in engine in
    batch-invariant mode; dtype: the compute dtype the adapter is told (`set_dtype`) and
    judged in (regime.py); world: the built-in engine sharded over it (engine.parallel)."""
    builtin = adapter is None
    if builtin:
        adapter = TorchAdapter(device, invariant=invariant, world=world)
    _set_dtype(adapter, dtype)
    caps, required = resolve_capabilities(adapter, require)
    directory = find_fixtures(fixtures)
    report = Report(implementation=getattr(adapter, "name", type(adapter).__name__), device=device,
                    fixtures=str(directory), backends=dict(getattr(adapter, "backends", {})))
    checked, batched = checked_views(adapter)          # protocol v2: also batched, timed (batched.py)
    root = directory if directory.is_dir() else directory.parent       # one fixture file: just that file
    for path in _kdtr_files(directory):
        section = str(path.relative_to(root))
        log(f"checking {section}")
        try:
            with kdtr_format.open(path) as reader:
                kind = reader.metadata.get("kind")
                if kind == "model":
                    checks = _model_fixture(checked, caps, reader, section, builtin, dtype)
                    regime = Regime.of(reader.metadata, dtype)
                    if regime is not None:
                        checks = with_trace_acceptance(checks, CasesView(reader, regime))
                    report.checks += _stamped(with_deviations(report, adapter, checks, section), "exact")
                elif kind in _KERNEL_CASES:
                    report.checks += _stamped(_KERNEL_CASES[kind](checked, caps, reader, section),
                                              "float32: the kernel case's tolerance (float32 inputs)")
                else:
                    report.checks.append(Check(section, "fixture", Status.FAIL,
                                               detail=f"unknown fixture kind {kind!r}"))
                report.checks += batched_checks(batched, caps, reader, section, dtype)
        except KdtrError as exc:
            raise ValidateError(f"{path}: {exc}") from None
        except ValidateError:
            raise
        except Exception as exc:        # a malformed fixture (adapter faults are rows of their own checks)
            report.checks.append(Check(section, "fixture", Status.FAIL,
                                       detail=f"checking stopped: {type(exc).__name__}: {exc}"))
    if builtin and directory.is_dir():
        for preset in sorted(set(PRESETS) - {p.stem for p in _kdtr_files(directory)}):
            log(f"invariant on preset {preset} (no fixture: random weights)")
            report.checks += preset_invariant_checks(adapter, preset)
    unchecked: set[str] = set()
    if require in (None, "declared"):      # the declaration is required where these fixtures can check it
        checkable = {cap for c in report.checks for cap in c.needs}
        unchecked, required = required - checkable, required & checkable
    report.checks = requirements(report.checks, caps, required, str(directory))
    report.checks += [Check("validate", f"capability {cap}", Status.SKIPPED, needs=(cap,),
                            detail=f"declared, but no fixture in {directory} has checks for it "
                                   f"(--require {cap} makes this a FAIL)") for cap in sorted(unchecked)]
    return report


def requirements(checks: list[Check], caps: set[str], required: set[str], fixtures: str) -> list[Check]:
    """The rows with the requirements applied: a row skipped for a required capability the
    adapter lacks is a FAIL, and so is a required capability that no row exercised."""
    lacking = required - caps
    rows = [dataclasses.replace(c, status=Status.FAIL,
                                detail=f"required capability {', '.join(sorted(set(c.needs) & lacking))} is "
                                       f"not implemented by the adapter")
            if c.status is Status.SKIPPED and set(c.needs) & lacking else c for c in checks]
    for cap in sorted(required):
        if any(cap in c.needs and c.status is not Status.SKIPPED for c in checks):
            continue
        if cap in lacking:
            if any(cap in c.needs for c in checks):
                continue
            detail = f"required, but the adapter has no {', '.join(m + '()' for m in CAPABILITIES[cap])}"
        else:
            detail = f"required, but no check of {fixtures} exercised it"
        rows.append(Check("validate", f"capability {cap}", Status.FAIL, detail=detail, needs=(cap,)))
    return rows


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
