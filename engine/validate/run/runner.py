"""The runner: every fixture's checks through the checked adapter, as one report or case by case.

A case is one row of the report, known before anything runs (`plan(fixtures, dtype)`):
its section (a fixture's path in the fixture directory; "<preset> (random weights)" for
the built-in engine's invariant on a preset without a fixture; "validate" for the run's
own requirements), its check name and the capabilities it exercises. Its id,
`section::name`, is the same in every run and for every adapter, because the plan depends
on the fixture files and the dtype's regime alone: the built-in engine's own rows are
cases of every plan, skipped for any other adapter; the batched rows (rows/batched.py) are
cases, skipped for a protocol v1 adapter; a paged_kv fixture's rows (rows/paged.py) are
its cases, skipped rows in a v1 adapter's report too; and bf16's routing row is a case,
skipped where the adapter's model did not run.

    validation = Validation(adapter, fixtures, require="declared", dtype="float32")
    row = validation.check(case)          # one case: its fixture's checks run once, then kept
    report = validation.report()          # every row, as `kdtree validate` prints it

A section's checks run the first time the report or one of its cases asks, and are kept
for the life of the `Validation` (a model fixture's rows share its weights and its
replayed traces, so they run together). The "validate" cases (`capability <name>`: a
required capability exercised by some row; `any check ran`) run every section. The
report holds every section's rows in plan order, then the requirements
(`requirements`): a row skipped for a required capability the adapter lacks is a FAIL,
and so is a required capability no row exercised; the report shows a "validate" row only
when it fails, or, skipped, for a declared capability that no fixture has checks for.
`validate(...)` is `Validation(...).report()`; engine/pytest_plugin.py runs the cases one
test each.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import torch

import kdtr_format
from kdtr_format import PRESETS, KdtrError

from ...adapter import TorchAdapter
from ...parallel import World
from ..door.capabilities import resolve_capabilities
from ..door.checked import checked_views
from ..door.guard import AdapterFault, adapter_name, attribute, call, describe
from ..door.protocol import CAPABILITIES
from ..door.protocol_v2 import CAPABILITIES_V2
from ..fixtures import kdtr_files, find_fixtures
from ..judging.acceptance import with_trace_acceptance
from ..judging.deviations import with_deviations
from ..judging.regime import DTYPES, CasesView, Regime
from ..reports.report import ANY_CHECK_RAN, REQUIREMENTS, Check, Report, Status, ValidateError
from ..rows.batched import BATCHED_KERNEL_ROWS, batched_kernel_checks
from ..rows.batched_model import ROWS as BATCHED_MODEL_ROWS, batched_model_checks
from ..rows.corpus import corpus_rows
from ..rows.engine import ENGINE_ROWS
from ..rows.invariant import INVARIANT_ROWS, preset_invariant_checks
from ..rows.kernel import KERNEL_KINDS, KERNEL_ROWS, kernel_checks
from ..rows.model import ROWS, model_fixture_checks
from ..rows.paged import PAGED_KIND, PAGED_ROWS, paged_checks

BUILTIN_ONLY = "skipped (the built-in engine's own check: not run for an adapter)"
V2_ONLY = "skipped (a batched check: protocol v2 adapters only)"
NO_ROUTING = "skipped (the model did not run: no routing to watch)"
CPU_THREADS = 1          # torch's intra-op threads on the CPU: tiny models gain nothing from more on shared cores


@dataclass(frozen=True)
class Case:
    """One row of the report, before it runs. builtin_only: a check of the built-in engine's
    own decode loops or invariant, skipped for any other adapter; v2_only: a batched check
    (rows/batched.py), skipped for a protocol v1 adapter; absent: the detail of its
    skipped row when its section's checks return no such row (a row that exists only when
    the adapter's model ran; empty: they always return it)."""

    section: str
    name: str
    needs: tuple[str, ...] = ()
    builtin_only: bool = False
    absent: str = ""
    v2_only: bool = False

    @property
    def id(self) -> str:
        return f"{self.section}::{self.name}"


@dataclass(frozen=True)
class _Section:
    """Where a section's rows come from: a fixture file, or a preset without one."""

    name: str
    cases: tuple[Case, ...]
    path: Path | None = None
    preset: str | None = None


def plan(fixtures: str | os.PathLike | None = None, dtype: str = "float32") -> list[Case]:
    """Every case of a run over these fixtures (find_fixtures' default when None) in `dtype`'s
    regime, in report order."""
    _check_dtype(dtype)
    directory = find_fixtures(fixtures)
    return [case for section in _sections(directory, dtype) for case in section.cases] + _requirement_cases()


def _sections(directory: Path, dtype: str) -> list[_Section]:
    root = directory if directory.is_dir() else directory.parent       # one fixture file: just that file
    sections = []
    for path in kdtr_files(directory):
        name = str(path.relative_to(root))
        sections.append(_Section(name, _fixture_cases(path, name, dtype), path=path))
    if directory.is_dir():
        for preset in sorted(set(PRESETS) - {p.stem for p in kdtr_files(directory)}):
            name = f"{preset} (random weights)"
            sections.append(_Section(name, tuple(Case(name, row, (), True) for row in INVARIANT_ROWS), preset=preset))
    return sections


def _fixture_cases(path: Path, section: str, dtype: str) -> tuple[Case, ...]:
    """A fixture's cases as its checks return their rows: its own, then the batched ones."""
    try:
        with kdtr_format.open(path) as reader:
            kind = reader.metadata.get("kind")
            batched = BATCHED_MODEL_ROWS if kind == "model" else BATCHED_KERNEL_ROWS.get(kind, {})
            return (*_per_request_cases(reader, section, dtype),
                    *(Case(section, name, tuple(sorted(needs)), v2_only=True) for name, needs in batched.items()))
    except KdtrError as exc:
        raise ValidateError(f"{path}: {exc}") from None


def _per_request_cases(reader, section: str, dtype: str) -> tuple[Case, ...]:
    kind = reader.metadata.get("kind")
    if kind == "model":
        regime = Regime.of(reader.metadata, dtype)
        if regime is None:                   # model_fixture_checks's one skipped row
            return (Case(section, f"{dtype} cases"),)
        cases = [Case(section, name, tuple(sorted(needs))) for name, needs in ROWS.items()]
        if regime.routing_threshold is not None:
            cases.append(Case(section, "routing", absent=NO_ROUTING))
        return (*cases, *(Case(section, name, (), True, absent) for name, absent in ENGINE_ROWS.items()),
                *(Case(section, name, (), True) for name in INVARIANT_ROWS))
    if kind == "corpus":
        return tuple(Case(section, name, tuple(sorted(needs))) for name, needs in corpus_rows(reader))
    rows = PAGED_ROWS if kind == PAGED_KIND else KERNEL_ROWS.get(kind)
    if rows is not None:
        return tuple(Case(section, name, tuple(sorted(needs))) for name, needs in rows.items())
    return (Case(section, "fixture"),)


def _requirement_cases() -> list[Case]:
    return [Case(REQUIREMENTS, f"capability {cap}", (cap,)) for cap in CAPABILITIES] + \
        [Case(REQUIREMENTS, ANY_CHECK_RAN)]


class Validation:
    """One validation run (module docstring). adapter None = the built-in engine; require: the
    capabilities whose checks must run (protocol.resolve_capabilities; None = what the adapter
    declares, else what it implements; under the declaration, only those of them that the
    fixtures have checks for: a declared capability without any is a skipped "validate" row);
    invariant: the built-in engine in batch-invariant mode; dtype: the compute dtype the
    adapter is told (`set_dtype`) and judged in (judging/regime.py); world: the built-in engine
    sharded over it (engine.parallel); page_size: the built-in engine's KV cache paged
    (engine/cache.py); log: told each section as it starts. ValidateError for an adapter or
    fixtures that cannot be checked."""

    def __init__(self, adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
                 log: Callable[[str], None] = lambda line: None, require: str | Collection[str] | None = None,
                 invariant: bool = False, dtype: str = "float32", world: World | None = None,
                 page_size: int | None = None) -> None:
        _check_dtype(dtype)
        self.builtin = adapter is None
        self.adapter = (TorchAdapter(device, invariant=invariant, world=world, page_size=page_size) if self.builtin
                        else adapter)
        _set_dtype(self.adapter, dtype)
        self._checked, self._batched = checked_views(self.adapter)   # protocol v2: also batched (rows/batched.py)
        self.dtype = dtype
        self.caps, self.required = resolve_capabilities(self.adapter, require)
        directory = find_fixtures(fixtures)
        self.sections = {s.name: s for s in _sections(directory, dtype)}
        self.declared = require in (None, "declared")   # then required where the fixtures' rows check it
        self.unchecked: set[str] = set()        # declared, but no row checks it (known once the report is made)
        self.log = log
        self.fixtures = str(directory)
        self.given = str(fixtures) if fixtures is not None else self.fixtures   # the user's path, not its cache copy
        self._report = Report(implementation=attribute(self.adapter, "name", type(self.adapter).__name__),
                              adapter=f"{type(self.adapter).__module__}.{type(self.adapter).__qualname__}",
                              device=device, fixtures=self.fixtures, backends=_backends(self.adapter))
        self._rows: dict[str, list[Check]] = {}

    def check(self, case: Case) -> Check:
        """The case's row, the requirements applied (a "validate" case runs every section)."""
        if case.section == REQUIREMENTS:
            return self._requirement(case)
        skipped = self.skip_reason(case)
        if skipped:
            return Check(case.section, case.name, Status.SKIPPED, detail=skipped, needs=case.needs)
        rows = self.rows(case.section)
        found = next((c for c in rows if c.name == case.name), None)
        stopped = next((c for c in rows if c.name == "fixture"), None)
        if found is None and stopped is not None:    # the fixture's checks stopped: its one FAIL row says why
            found = dataclasses.replace(stopped, name=case.name, needs=case.needs)
        elif found is None and case.absent:
            found = Check(case.section, case.name, Status.SKIPPED, detail=case.absent, needs=case.needs)
        elif found is None:
            raise LookupError(f"{case.id}: the fixture's checks returned no such row (plan and checks disagree)")
        return requirements([found], self.caps, self.required, self.fixtures, exercised=False)[0]

    def skip_reason(self, case: Case) -> str | None:
        """Why the case is skipped for this adapter whatever its section's checks return (a row
        of the built-in engine's own, a batched row for a protocol v1 adapter); None if not."""
        if case.builtin_only and not self.builtin:
            return BUILTIN_ONLY
        if case.v2_only and self._batched is None:
            return V2_ONLY
        return None

    def report_sections(self) -> list[str]:
        """The sections whose rows the report holds, in plan order (a preset without a fixture:
        the built-in engine's invariant only)."""
        return [s.name for s in self.sections.values() if self.builtin or s.preset is None]

    def header(self) -> Report:
        """The report as it stands, without its rows: implementation, device, fixtures, backends,
        and the deviations and seconds of the sections run so far."""
        return dataclasses.replace(self._report, checks=[])

    def rows(self, section: str) -> list[Check]:
        """A section's rows as its checks returned them, run on the first call."""
        if section not in self._rows:
            began = time.perf_counter()
            self._rows[section] = self._run(self.sections[section])
            self._report.section_seconds[section] = time.perf_counter() - began
        return self._rows[section]

    def report(self) -> Report:
        """Every section's rows in plan order, then the requirements, then a skipped row for
        each declared capability that no fixture has checks for."""
        checks = [c for name in self.report_sections() for c in self.rows(name)]
        if self.declared:
            self.unchecked = self.required - {cap for c in checks for cap in c.needs}
        self._report.checks = requirements(checks, self.caps, self.required - self.unchecked, self.fixtures) + \
            [self._unchecked(cap) for cap in sorted(self.unchecked)]
        return self._report

    def _run(self, section: _Section) -> list[Check]:
        if section.preset is not None:
            self.log(f"invariant on preset {section.preset} (no fixture: random weights)")
            return preset_invariant_checks(self.adapter, section.preset)
        self.log(f"checking {section.name}")
        try:
            with kdtr_format.open(section.path) as reader:
                return self._per_request(reader, section.name) + self._batched_checks(reader, section.name)
        except KdtrError as exc:
            raise ValidateError(f"{section.path}: {exc}") from None
        except ValidateError:
            raise
        except AdapterFault as fault:   # an optional method outside any row's checks (deviations)
            return [fault.check(section.name, "fixture")]
        except Exception as exc:        # a malformed fixture (adapter faults are rows of their own checks)
            return [Check(section.name, "fixture", Status.FAIL, detail=f"checking stopped: {describe(exc)}")]


    def _batched_checks(self, reader, section: str) -> list[Check]:
        """The batched rows of one fixture (none for a v1 adapter); model fixtures in the run's dtype."""
        if self._batched is None:
            return []
        rows = batched_model_checks if reader.metadata.get("kind") == "model" else batched_kernel_checks
        return rows(self._batched, self.caps, reader, section, self.dtype)
    def _per_request(self, reader, section: str) -> list[Check]:
        kind = reader.metadata.get("kind")
        if kind == "model":
            checks = model_fixture_checks(self._checked, self.caps, reader, section, self.builtin, self.dtype)
            regime = Regime.of(reader.metadata, self.dtype)
            if regime is not None:
                checks = with_trace_acceptance(checks, CasesView(reader, regime))
            return stamped(with_deviations(self._report, self._checked, checks, section), "exact")
        if kind == PAGED_KIND:            # protocol 2 only: the v2 view (None for a v1 adapter)
            return stamped(paged_checks(self._batched, self.caps, reader, section, self.dtype), "")
        if kind in KERNEL_KINDS:
            return stamped(kernel_checks(kind, self._checked, self.caps, reader, section, self.dtype),
                            "float32: the kernel case's tolerance (float32 inputs)")
        return [Check(section, "fixture", Status.FAIL, detail=f"unknown fixture kind {kind!r}")]

    def _unchecked(self, cap: str) -> Check:
        return Check(REQUIREMENTS, f"capability {cap}", Status.SKIPPED, needs=(cap,),
                     detail=f"declared, but no fixture in {self.given} has checks for it "
                            f"(--require {cap} makes this a FAIL)")

    def _requirement(self, case: Case) -> Check:
        """A "validate" case: FAIL as the report's rule has it, else what satisfied it."""
        report = self.report()
        if case.name == ANY_CHECK_RAN:
            if report.executed == 0:
                return Check(case.section, case.name, Status.FAIL, detail="no check ran: every row was skipped")
            return Check(case.section, case.name, Status.EXACT, detail=f"{report.executed} rows ran")
        (cap,) = case.needs
        if cap in self.unchecked:
            return self._unchecked(cap)
        if cap not in self.required:
            return Check(case.section, case.name, Status.SKIPPED, detail=f"capability {cap} is not required",
                         needs=case.needs)
        checks = [c for c in report.checks if c.section != REQUIREMENTS]     # its own FAIL row exercises nothing
        reason = unmet(cap, checks, self.caps, self.fixtures)
        if reason is not None:
            return Check(case.section, case.name, Status.FAIL, detail=reason, needs=case.needs)
        ran = sum(cap in c.needs and c.status is not Status.SKIPPED for c in checks)
        return Check(case.section, case.name, Status.EXACT, detail=f"required; {ran} rows exercised it",
                     needs=case.needs)


def validate(adapter: Any | None = None, fixtures: str | os.PathLike | None = None, device: str = "cpu",
             log: Callable[[str], None] = lambda line: None,
             require: str | Collection[str] | None = None, invariant: bool = False,
             dtype: str = "float32", world: World | None = None, page_size: int | None = None) -> Report:
    """Run every check (package docstring) and return the report (Validation's arguments)."""
    return Validation(adapter, fixtures, device, log, require, invariant, dtype, world, page_size).report()


def requirements(checks: list[Check], caps: set[str], required: set[str], fixtures: str,
                 exercised: bool = True) -> list[Check]:
    """The rows with the requirements applied: a row skipped for a required capability the
    adapter lacks is a FAIL; with `exercised`, so is a required capability that no row exercised
    (a "validate" row added for it)."""
    lacking = required - caps
    rows = [dataclasses.replace(c, status=Status.FAIL,
                                detail=f"required capability {', '.join(sorted(set(c.needs) & lacking))} is "
                                       f"not implemented by the adapter")
            if c.status is Status.SKIPPED and set(c.needs) & lacking else c for c in checks]
    for cap in sorted(required) if exercised else ():
        reason = unmet(cap, checks, caps, fixtures)
        if reason is None or cap in lacking and any(cap in c.needs for c in checks):   # those rows FAIL already
            continue
        rows.append(Check(REQUIREMENTS, f"capability {cap}", Status.FAIL, detail=reason, needs=(cap,)))
    return rows


def unmet(cap: str, checks: list[Check], caps: set[str], fixtures: str) -> str | None:
    """Why a required capability is not met by these rows; None when one of them exercised it."""
    if cap not in caps:
        methods = CAPABILITIES[cap] or CAPABILITIES_V2[cap]      # a protocol 2 capability has no v1 methods
        return f"required, but the adapter has no {', '.join(m + '()' for m in methods)}"
    if any(cap in c.needs and c.status is not Status.SKIPPED for c in checks):
        return None
    return f"required, but no check of {fixtures} exercised it"


def prepare_device(device: str) -> None:
    """Refuse a CUDA device this machine does not have (ValidateError naming it); on the CPU, give
    torch CPU_THREADS intra-op threads. The thread policy of every run `kdtree` and the pytest
    plugin make."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValidateError(f"--device {device}: no CUDA device is visible")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValidateError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    else:
        torch.set_num_threads(CPU_THREADS)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValidateError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def _backends(adapter: Any) -> dict[str, str]:
    """The adapter's `backends` (what ran where, e.g. {"attention": "cuda"}; optional)."""
    backends = attribute(adapter, "backends", {})
    if not isinstance(backends, Mapping):
        raise ValidateError(f"adapter {adapter_name(adapter)}: `backends` must be a mapping of names to what ran "
                            f"them, got {type(backends).__name__}")
    return {str(k): str(v) for k, v in backends.items()}


def _set_dtype(adapter: Any, dtype: str) -> None:
    """Tell the adapter its compute dtype (protocol: `set_dtype`); bfloat16 needs it."""
    set_dtype = attribute(adapter, "set_dtype")
    if not callable(set_dtype):
        if dtype != "float32":
            raise ValidateError(f"--dtype {dtype}: the adapter has no set_dtype method to be told its dtype")
        return
    try:
        call("set_dtype", set_dtype, dtype)
    except AdapterFault as fault:
        refused = isinstance(fault.__cause__, (ValueError, TypeError))
        raise ValidateError(f"--dtype {dtype}: the adapter refuses it ({describe(fault.__cause__)})" if refused
                            else f"--dtype {dtype}: {fault}") from None


def stamped(checks: list[Check], default: str) -> list[Check]:
    """Rows without a regime get `default` for float comparisons, "exact" for exact ones."""
    for check in checks:
        if not check.regime and check.status is not Status.SKIPPED:
            check.regime = default if check.tolerance is not None else "exact"
    return checks
