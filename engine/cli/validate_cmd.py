"""`kdtree validate`: the golden fixtures against an adapter (in a watched child) or a server,
and the terminal report."""

from __future__ import annotations

import io
import os
import platform
import subprocess
import textwrap
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click
import numpy as np
from rich.console import Console
from rich.text import Text

from kdtr_format.clikit import EXIT_BAD_INPUT, CliError, FiniteFloat, OutputFile, console, shown

from ..validate.door.supervise import CALL_TIMEOUT_S, ValidateJob, supervise
from ..validate.reports.files import STDOUT, ReportFiles
from .common import (
    DTYPES, Device, _check_device, _check_tp, _engine_layout_options, _lines, _on_ranks,
    _rank_console, _require_matplotlib, _version, _wrapped, _wrote, cli,
)

if TYPE_CHECKING:
    from ..validate import Report

REPO_ROOT = Path(__file__).resolve().parents[2]
STATUS_STYLE = {"exact": "green", "within tolerance": "green", "near-tie": "yellow", "skipped": "dim",
                "FAIL": "bold red"}


class ReportFile(OutputFile):
    """A report file to write (OutputFile), or - for stdout."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        return STDOUT if value == STDOUT else super().convert(value, param, ctx)


def _impl_given(spec: str | None) -> str | None:
    """--impl as given; an empty one (`--impl "$IMPL"` with IMPL unset) is bad input, never the
    built-in engine."""
    from ..validate.door.load import refuse_empty

    try:
        if spec is not None:
            refuse_empty(spec)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return spec


def _under_torchrun() -> bool:
    """Whether torchrun started this process: its variables are set (engine.parallel.torchrun_size
    reads them; this asks without importing torch)."""
    return all(name in os.environ for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))


class ServerUrl(click.ParamType):
    """http(s)://host[:port][/path prefix] -> the URL without a trailing slash."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip()
        parts = urllib.parse.urlsplit(text)
        try:
            parts.port
        except ValueError:
            self.fail(f"{value!r}: the port is not a number from 0 to 65535", param, ctx)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            self.fail(f"{value!r}: expected http://host:port, e.g. http://127.0.0.1:30000", param, ctx)
        return text.rstrip("/")


SERVER_ONLY = ("api", "concurrency", "temperature", "samples", "seed", "logprobs", "require_speculation")
SERVER_TIMEOUT_S = 60.0            # --server: seconds each reply may take, by default
SERVER_DEVICE = "server"           # a --server report's device (engine/validate/run/server.py: DEVICE)
NOT_FOR_SERVER = ("device", "impl", "require", "invariant", "tp", "page_size")


def _server_options(command: Callable) -> Callable:
    """--server and the options of a served model's validation (engine/validate/run/server.py)."""
    options = [
        click.option("--server", type=ServerUrl(), default=None,
                     help="Validate a running serving engine (SGLang, vLLM) at this URL instead of an adapter: "
                          "the fixture's prompts as token ids, its AR tokens as the answer (docs/serving.md). "
                          "--fixtures: a `refgen export` directory or a model fixture file."),
        click.option("--api", type=click.Choice(("openai", "sglang")), default="openai", show_default=True,
                     help="With --server: the OpenAI-compatible /v1/completions (vLLM, SGLang) or SGLang's /generate."),
        click.option("--concurrency", type=click.IntRange(1, 256), default=1, show_default=True,
                     help="With --server: requests in flight at once (copies of the prompts fill them), so that "
                          "the server batches them."),
        click.option("--temperature", type=FiniteFloat(0.0, 100.0), default=0.0, show_default=True,
                     help="With --server: above 0, seeded runs tested against the fixture's softmax(logits / T)."),
        click.option("--samples", type=click.IntRange(min=1), default=None,
                     help="With --server --temperature T: runs per prompt (default 400)."),
        click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True,
                     help="With --server --temperature T: the first run's seed (run i has seed + i)."),
        click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="K",
                     help="With --server: ask for log-probs (the served token's, and the top K) and check them."),
        click.option("--require-speculation", is_flag=True,
                     help="With --server: FAIL the run unless the server's /metrics show that it drafted and "
                          "accepted tokens over it (a speculative run that never drafts tests nothing of it)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@cli.command("validate")
@click.option("--fixtures", type=click.Path(exists=True, path_type=Path), default=None,
              help="A fixture directory (every .kdtr file under it, subfolders included; none is an error), "
                   "or one fixture file (then only that file is checked). Default: tests/golden, else fixtures "
                   "generated once into a cache directory.")
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="The implementation's compute dtype, and the tolerance regime it is judged in "
                   "(docs/precision.md).")
@click.option("--json", "json_path", type=ReportFile(), default=None,
              help="Also write the report as JSON here (with versions, commit, device and timings); - for "
                   "stdout (the terminal report then goes to stderr).")
@click.option("--junit-xml", "junit_path", type=ReportFile(), default=None,
              help="Also write the report as JUnit XML here (one testcase per row), for CI test views; - for "
                   "stdout.")
@click.option("--html", "html_path", type=ReportFile(), default=None,
              help="Also write the report as one self-contained HTML page here, with plots (needs "
                   "matplotlib: the `plot` extra); - for stdout.")
@click.option("--impl", type=str, default=None, callback=lambda ctx, param, value: _impl_given(value),
              help="Adapter factory to validate: module:factory (a module on PYTHONPATH or in the "
                   "current directory) or path/to/file.py:factory (a spec with a / is a path, and "
                   "must name a .py file; default: the built-in torch engine).")
@click.option("--require", type=str, default="declared", show_default=True,
              help="Capabilities whose checks must run, comma-separated (model, topk, tree, compile, accept, "
                   "sample_accept, compact, attention, paged_attention, paged_compact); `declared`: the "
                   "adapter's `capabilities`, else what it implements; `none`: nothing required. A required "
                   "capability that is skipped or that no fixture exercises is a FAIL.")
@click.option("--timeout", type=FiniteFloat(0.0, min_open=True), default=None, metavar="SECONDS",
              help=f"Seconds one call of the adapter may take: a call that takes longer FAILs its row and stops "
                   f"the run (default {CALL_TIMEOUT_S:g}); with --server, seconds each reply may take in "
                   f"all, from connecting to its last byte (default {SERVER_TIMEOUT_S:g}).")
@click.option("--invariant", is_flag=True, help="The built-in engine in batch-invariant mode.")
@_engine_layout_options
@_server_options
def validate_command(fixtures: Path | None, device: str, dtype: str, json_path: Path | str | None,
                     junit_path: Path | str | None, html_path: Path | str | None, impl: str | None, require: str,
                     timeout: float | None, invariant: bool, tp: int | None, page_size: int | None,
                     **served: Any) -> int:
    """Check an implementation against the golden fixtures, or (--server) what a serving engine serves;
    exit 1 on any failure."""
    if served["server"] is not None or _given(*SERVER_ONLY):
        return _validate_server(fixtures, dtype, (json_path, junit_path, html_path),
                                timeout=timeout or SERVER_TIMEOUT_S, **served)
    for flag, given in (("--invariant", invariant), ("--tp", tp), ("--page-size", page_size)):
        if given and impl:
            raise CliError(f"{flag} is a mode of the built-in engine; it does not apply to --impl")
    named = [flag for flag, path in (("--json", json_path), ("--junit-xml", junit_path), ("--html", html_path))
             if path == STDOUT]
    if len(named) > 1:
        raise CliError(f"{' and '.join(named)} name stdout (-): one report can go there")
    if html_path is not None:
        _require_matplotlib("--html")
    reports = (json_path, junit_path, html_path)
    if tp is not None or _under_torchrun():
        if timeout is not None:
            raise CliError("--timeout watches an adapter in a child process; --tp runs the built-in engine's "
                           "ranks unwatched")
        _check_tp(tp, device)
        _check_device(device)
        first = os.environ.get("RANK", "0") == "0"          # under torchrun, the first rank's files alone
        with ReportFiles(reports if first else (None, None, None)) as files:
            return _published(files, _on_ranks(tp, device, _validate, fixtures, device, dtype, files, require,
                                               invariant, page_size))
    out = console(stderr=STDOUT in reports)
    steps = _log_steps(out)
    with ReportFiles(reports) as files:
        job = ValidateJob(impl, fixtures, device, dtype, require, invariant, page_size, files,
                          console={"width": out.width, "color_system": out.color_system, "soft_wrap": out.soft_wrap,
                                   "force_terminal": out.is_terminal, "highlight": False})
        run = supervise(job, timeout or CALL_TIMEOUT_S, _validate_child, steps)
        if run.stopped is not None:
            _check_device(device)                   # the child's thread policy: the report names its threads
            status = _finish(run.stopped, impl, out, steps, device, files)
        else:
            status, drawn, unwritten = run.returned
            out.file.write(drawn)
            out.file.flush()
            if unwritten is not None:
                raise CliError(unwritten)
        return _published(files, status)


def _validate_child(send: Callable[[tuple], None], job: ValidateJob) -> tuple[int, str, str | None]:
    """A supervised validate's child (engine/validate/door/supervise.py): the checking, the report
    drawn and written to its staged files -> (the exit status, the report drawn for the parent's
    console, the one-line error of a report file that could not be written, else None). The
    parent prints the log as it comes, then the report, and publishes the files."""
    from ..validate.run.isolated import serve

    drawn = io.StringIO()
    steps = _Steps(lambda line: None)
    report = serve(send, job, steps)
    try:
        status = _finish(report, job.impl, Console(file=drawn, **job.console), steps, job.device, job.reports)
    except OSError as exc:
        return EXIT_BAD_INPUT, drawn.getvalue(), f"{exc.filename}: {exc.strerror}"
    return status, drawn.getvalue(), None


def _validate(world: Any, fixtures: Path | None, device: str, dtype: str, files: ReportFiles, require: str,
              invariant: bool, page_size: int | None) -> int:
    """validate of the built-in engine on one rank of --tp -> its exit status (reports: the
    ReportFiles the first rank writes)."""
    from ..validate import validate

    device = str(world.device) if world is not None else device
    out = _rank_console(world, stderr=STDOUT in files.paths)
    steps = _log_steps(out)
    report = validate(None, fixtures, device, log=steps, require=require, invariant=invariant, dtype=dtype,
                      world=world, page_size=page_size)
    first = world is None or world.rank == 0           # one file of each, from the first rank
    return _finish(report, None, out, steps, device, files if first else ReportFiles())


def _log_steps(out: Console) -> _Steps:
    """The runner's log on `out`, each line escaped (names come from files) and, on a terminal,
    wrapped under itself."""
    return _Steps(lambda line: out.print(_wrapped(shown(line), out.width if out.is_terminal else None, style="dim")))


def _finish(report: Report, impl: str | None, out: Console, steps: _Steps, device: str | None,
            files: ReportFiles) -> int:
    """The report's run described (impl: the --impl spec), shown on `out` and written to the
    staged report files (OSError naming a file that cannot be written) -> the exit status."""
    report.impl, report.versions, report.commit = impl, _versions(), _commit()
    if device is not None:                         # None: a server's run (its device is the server's)
        report.device_name = _device_name(device)
    report.timings = steps.timings()
    render(report, out)
    files.write(report)
    return 1 if report.failed else 0


def _published(files: ReportFiles, status: int) -> int:
    """The run's report files moved into place, each named on stderr (the verdict: from here
    Ctrl-C is ignored) -> status."""
    err = console(stderr=True)
    files.publish(lambda path: _wrote(path, err))
    return status


def _given(*names: str) -> list[str]:
    """The options among `names` given on the command line (or by an environment variable), as flags."""
    ctx = click.get_current_context()
    return [f"--{name.replace('_', '-')}" for name in names
            if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)]


def _validate_server(fixtures: Path | None, dtype: str, reports: tuple, server: str | None, samples: int | None,
                     **options: Any) -> int:
    """validate --server: a serving engine's tokens against a fixture (engine/validate/run/server.py)."""
    if server is None:
        raise CliError(f"{_given(*SERVER_ONLY)[0]} applies to --server URL")
    if _given(*NOT_FOR_SERVER):
        raise CliError(f"{_given(*NOT_FOR_SERVER)[0]} applies to an adapter or the built-in engine, not to --server")
    if options["temperature"] == 0 and _given("samples", "seed"):
        raise CliError(f"{_given('samples', 'seed')[0]} applies to sampled runs: give --temperature T > 0")
    if reports[2] is not None:
        _require_matplotlib("--html")
    from ..validate.run.server import SAMPLES, ServerRun, validate_server

    out = console(stderr=STDOUT in reports)
    steps = _log_steps(out)
    run = ServerRun(server, samples=samples or SAMPLES, **options)
    report = validate_server(run, fixtures, dtype if _given("dtype") else None, log=steps)
    with ReportFiles(reports) as files:
        return _published(files, _finish(report, None, out, steps, None, files))


class _Steps:
    """The runner's log, shown and timed: each line starts a step that lasts until the next."""

    def __init__(self, show: Callable[[str], None]) -> None:
        self.show = show
        self.began = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def __call__(self, line: str) -> None:
        self.marks.append((line, time.perf_counter()))
        self.show(line)

    def timings(self) -> dict[str, Any]:
        """{"total_seconds": s, "steps": [{"step": line, "seconds": s}, ...]}"""
        now = time.perf_counter()
        ends = [t for _, t in self.marks[1:]] + [now]
        return {"total_seconds": now - self.began,
                "steps": [{"step": line, "seconds": end - start} for (line, start), end in zip(self.marks, ends)]}


def _versions() -> dict[str, str | None]:
    import torch

    return {"kdtree": _version(), "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def _commit() -> str | None:
    """This kdtree checkout's commit (`-dirty` when it has changes): that of the git repository
    whose work tree is REPO_ROOT and tracks this file, never of a repository that merely encloses
    a copied or installed kdtree (None then, and outside git). GIT_* variables are ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> str | None:
        run = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10,
                             env=env)
        return run.stdout.strip() or None if run.returncode == 0 else None

    try:
        top = git("rev-parse", "--show-toplevel")
        if top is None or Path(top).resolve() != REPO_ROOT.resolve() or \
                git("ls-files", "--error-unmatch", "--", str(Path(__file__).resolve().relative_to(REPO_ROOT))) is None:
            return None
        return git("describe", "--always", "--dirty", "--abbrev=40", "--exclude=*")
    except (OSError, subprocess.SubprocessError):
        return None


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)"


def render(report: Report, out: Console) -> None:
    """The report as rows under their fixture: status, check, numbers; a detail on the lines below.
    On a terminal every line fits its width (a long name or detail wraps under itself, never to
    column 0); piped, no line is wrapped. What the fixtures and the adapter wrote goes through
    `shown`."""
    width = out.width if out.is_terminal else None
    status_w = max((len(c.status.value) for c in report.checks), default=0)
    name_w = min(max((len(shown(c.name)) for c in report.checks), default=0), 36)
    indent = " " * (2 + status_w + 2)
    out.print(_wrapped(f"kdtree validate: {shown(report.implementation)}", width, style="bold"))
    if report.device == SERVER_DEVICE:
        out.print(_wrapped(f"server: {shown(report.adapter)}", width))
    else:
        loaded = shown(f"--impl {report.impl}") if report.impl else "built-in"
        out.print(_wrapped(f"adapter: {shown(report.adapter)} ({loaded})", width))
    section = None
    for c in report.checks:
        if c.section != section:
            section = c.section
            out.print(_wrapped(shown(section), width, style="bold"))
        name, numbers = shown(c.name), c.numbers()
        head = f"  {c.status.value.ljust(status_w)}  "
        lines = _lines(name, width, head, indent)
        details = [shown(c.detail)] if c.detail else []
        gap = " " * (2 + max(name_w - len(name), 0) if len(lines) == 1 else 2)
        if numbers and (width is None or len(lines[-1] + gap + numbers) <= width):
            lines[-1] += gap + numbers
        elif numbers:
            details.insert(0, numbers)
        row = Text("\n".join(lines))
        row.stylize(STATUS_STYLE[c.status.value], 2, 2 + len(c.status.value))
        out.print(row)
        for detail in details:
            out.print(_wrapped(detail, width, indent, indent, style="dim" if c.status.value != "FAIL" else ""))
    if report.backends:
        out.print(_wrapped("backends: " + ", ".join(f"{k}: {shown(v)}" for k, v in report.backends.items()), width))
    for fixture, declared in report.deviations.items():
        out.print(_wrapped(f"known deviations declared by the implementation for {shown(fixture)}:", width))
        for deviation in declared:
            out.print(_wrapped(shown(deviation.line()), width, "  ", "    "))
    out.print(_wrapped(f"fixtures: {shown(report.fixtures)}", width))
    out.print(Text(report.summary(), style="bold red" if report.failed else "bold green"))
    _recap_failures(report, out, width)


def _recap_failures(report: Report, out: Console, width: int | None) -> None:
    """The FAIL rows again under the verdict, one line each: section::name: the detail (cut to the
    terminal's width; piped, whole)."""
    failed = [c for c in report.checks if c.status.value == "FAIL"]
    if not failed:
        return
    out.print(Text(f"FAIL rows ({len(failed)}):", style="bold red"))
    for c in failed:
        line = f"{shown(c.section)}::{shown(c.name)}: {shown(c.detail) or 'FAIL'}"
        out.print(Text("  " + (line if width is None else textwrap.shorten(line, width - 2, placeholder=" ..."))))


