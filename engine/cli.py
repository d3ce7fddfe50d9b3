"""The `kdtree` command line: `validate` (the main job), `diverge` and `demo`.

    kdtree validate [--fixtures DIR|FILE] [--device cpu|cuda[:N]] [--dtype float32|bfloat16] [--json PATH|-]
                    [--junit-xml PATH|-] [--html PATH|-] [--impl module:factory] [--require CAPS]
                    [--timeout SECONDS] [--invariant] [--tp N] [--page-size N]
    kdtree validate --server URL --fixtures EXPORT [--api openai|sglang] [--concurrency N]
                    [--temperature T --samples N --seed S] [--logprobs K] [--timeout S]   (docs/serving.md)
    kdtree diverge (--fixture PATH | --config NAME) [--way chunk|tree|batch] [--dtype bfloat16] [--json PATH]
    kdtree demo [--preset tiny | --fixture PATH] [--prompt 1,2,3] [--budget 32] [--block-size 8] [--plot PATH]
                [--invariant] [--tp N] [--page-size N]

Exit status: 0 passed, 1 a check failed (validate), the two ways differ (diverge) or
DDTree differed from AR (demo), 2 bad input, 3 internal error, 130 interrupted (kdtr_format/clikit.py). Every bad
argument is refused before any work, in one line on stderr; --json, --junit-xml, --html
and --plot are written all or nothing, with the user's umask. A validate report named `-`
goes to stdout (one of them at most), and the terminal report to stderr.

validate runs its checking, the adapter's code included, in a child process
(engine/supervise.py): an adapter that exits, dies or outlives --timeout in one call FAILs
the row in flight, the report is still written, and the exit status is 1. With --tp the
built-in engine's ranks run unwatched, as below.

Help, --version and refused arguments answer without importing torch (seconds):
each command imports the engine when it runs.

--tp N shards the built-in engine over N ranks (docs/tensor-parallel.md). Under torchrun
(`torchrun --nproc-per-node N -m engine validate --tp N`) this process is one of the N ranks
and N must be torchrun's world size; otherwise the command spawns the N ranks as local
processes itself (gloo on the CPU, NCCL with rank r on cuda:r). Every rank runs the command;
rank 0 prints and writes the files; the exit status is the same on every rank.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator

import click
import numpy as np
from rich.console import Console
from rich.filesize import decimal
from rich.text import Text

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig, KdtrError, ModelConfig
from kdtr_format.clikit import Cli, CliError, FiniteFloat, OutputFile, atomic_output, console, shown, table

from .supervise import CALL_TIMEOUT_S, ValidateJob, supervise

if TYPE_CHECKING:
    from .decode import DecodeResult
    from .diverge import Divergence
    from .diverge_run import Memory, Subject
    from .diverge_ways import Way
    from .validate import Report

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
MAX_CPU_RANKS = 8              # --tp on the CPU: local processes, each holding the replicated weights
STDOUT = "-"                   # a validate report file named so goes to stdout
STATUS_STYLE = {"exact": "green", "within tolerance": "green", "near-tie": "yellow", "skipped": "dim",
                "FAIL": "bold red"}


def _version() -> str:
    try:
        return importlib.metadata.version("kdtree")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _bad_input() -> tuple[type[Exception], ...]:
    """The engine's own bad-input errors (imported only when an error needs judging)."""
    return KdtrError, importlib.import_module("engine.validate").ValidateError


@click.group(cls=Cli, name="kdtree", bad_input=_bad_input)
@click.version_option(_version(), "--version", prog_name="kdtree")
def cli() -> None:
    """kdtree: validate DDTree speculative decoding on DeepSeek-V3 / Kimi-K2-class models."""


def main(argv: list[str] | None = None) -> None:
    """The console script: exit statuses as the module docstring."""
    cli.main(args=argv, prog_name="kdtree")


# ---------------------------------------------------------------------------- arguments

class Device(click.ParamType):
    """cpu, cuda or cuda:N (whether the device is there is checked when the command runs)."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(value)):
            self.fail(f"{value!r}: expected cpu, cuda or cuda:N", param, ctx)
        return str(value)


class TokenIds(click.ParamType):
    """Comma-separated token ids ("1,2,3"; spaces around commas allowed) -> list[int]."""

    name = "ids"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        items = [item.strip() for item in str(value).split(",")]
        if not any(items):
            self.fail("empty; give comma-separated token ids, e.g. 1,2,3", param, ctx)
        for item in items:
            if not re.fullmatch(r"\d+", item):
                what = "an empty item" if not item else f"{item!r} is not a token id"
                self.fail(f"{value!r}: {what}; give comma-separated token ids, e.g. 1,2,3", param, ctx)
        return [int(item) for item in items]


class ReportFile(OutputFile):
    """A report file to write (OutputFile), or - for stdout."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        return STDOUT if value == STDOUT else super().convert(value, param, ctx)


def _under_torchrun() -> bool:
    """Whether torchrun started this process: its variables are set (engine.parallel.torchrun_size
    reads them; this asks without importing torch)."""
    return all(name in os.environ for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))


def _check_tp(tp: int | None, device: str) -> None:
    """Refuse a --tp this machine or the torchrun environment cannot run (before any work)."""
    from .parallel import torchrun_size

    try:
        launched = torchrun_size()
    except ValueError as exc:
        raise CliError(f"torchrun environment: {exc}") from None
    if tp is None:
        if launched is not None:
            raise CliError(f"torchrun started {launched} process(es): give --tp {launched}")
        return
    if device.startswith("cuda:"):
        raise CliError(f"--device {device} with --tp: each rank takes the GPU of its local rank; give --device cuda")
    if launched is not None:
        if launched != tp:
            raise CliError(f"--tp {tp}, but torchrun started {launched} process(es)")
        return
    if device == "cpu" and tp > MAX_CPU_RANKS:
        raise CliError(f"--tp {tp}: at most {MAX_CPU_RANKS} ranks on the CPU (each is a process holding "
                       f"the replicated weights)")
    if device == "cuda":
        import torch

        if tp > torch.cuda.device_count():
            raise CliError(f"--tp {tp}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def _on_ranks(tp: int | None, device: str, job: Callable[..., int], *args: Any) -> int:
    """job(world, *args) unsharded (world None) or on the --tp ranks -> its exit status."""
    if tp is None:
        return job(None, *args)
    from .parallel import run

    return run(tp, "cuda" if device.startswith("cuda") else "cpu", job, *args)


def _rank_console(world: Any, stderr: bool = False) -> Console:
    """The console of this rank: rank 0 (or an unsharded run) prints, the other ranks are quiet."""
    return console(stderr) if world is None or world.rank == 0 else Console(quiet=True)


def _check_device(device: str) -> None:
    """The device is there; on the CPU, the runner's thread policy (engine.validate.runner.prepare_device)."""
    from .validate.runner import prepare_device

    prepare_device(device)


# ---------------------------------------------------------------------------- validate

def _engine_layout_options(command: Callable) -> Callable:
    """--tp and --page-size: how the built-in engine is laid out (validate and demo)."""
    command = click.option(
        "--page-size", type=click.IntRange(min=1, max=4096), default=None,
        help="The built-in engine's KV cache in pages of N slots through a block table (as vLLM, SGLang "
             "and FlashMLA keep it; 64 is FlashMLA's); default contiguous.")(command)
    return click.option(
        "--tp", type=click.IntRange(min=1), default=None,
        help="Shard the built-in engine over N ranks (tensor and expert parallel): under torchrun its "
             "N processes, else N local processes spawned here (CPU: gloo; cuda: NCCL, rank r on cuda:r).")(command)


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


SERVER_ONLY = ("api", "concurrency", "temperature", "samples", "seed", "logprobs")
SERVER_TIMEOUT_S = 60.0            # --server: seconds to wait for each reply, by default
NOT_FOR_SERVER = ("device", "impl", "require", "invariant", "tp", "page_size")


def _server_options(command: Callable) -> Callable:
    """--server and the options of a served model's validation (engine/validate/server.py)."""
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
    ]
    for option in reversed(options):
        command = option(command)
    return command


@cli.command("validate")
@click.option("--fixtures", type=click.Path(exists=True, path_type=Path), default=None,
              help="A fixture directory, or one fixture file (then only that file is checked). "
                   "Default: tests/golden, else fixtures generated once into a cache directory.")
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
@click.option("--impl", type=str, default=None,
              help="Adapter factory to validate: module:factory (a module on PYTHONPATH or in the "
                   "current directory) or path/to/file.py:factory (default: the built-in torch engine).")
@click.option("--require", type=str, default="declared", show_default=True,
              help="Capabilities whose checks must run, comma-separated (model, topk, tree, compile, accept, "
                   "sample_accept, compact, attention, paged_attention, paged_compact); `declared`: the "
                   "adapter's `capabilities`, else what it implements; `none`: nothing required. A required "
                   "capability that is skipped or that no fixture exercises is a FAIL.")
@click.option("--timeout", type=FiniteFloat(0.0, min_open=True), default=None, metavar="SECONDS",
              help=f"Seconds one call of the adapter may take: a call that takes longer FAILs its row and stops "
                   f"the run (default {CALL_TIMEOUT_S:g}); with --server, seconds to wait for each reply "
                   f"(default {SERVER_TIMEOUT_S:g}).")
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
        return _on_ranks(tp, device, _validate, fixtures, device, dtype, reports, require, invariant, page_size)
    out = console(stderr=STDOUT in reports)
    steps = _log_steps(out)
    job = ValidateJob(impl, fixtures, device, dtype, require, invariant, page_size, reports,
                      console={"width": out.width, "color_system": out.color_system, "soft_wrap": out.soft_wrap,
                               "force_terminal": out.is_terminal, "highlight": False})
    run = supervise(job, timeout or CALL_TIMEOUT_S, _validate_child, steps)
    if run.stopped is not None:
        _check_device(device)                       # the child's thread policy: the report names its threads
        return _finish(run.stopped, impl, out, console(stderr=True), steps, device, reports)
    status, drawn, notes, stdout = run.returned
    out.file.write(drawn)
    out.file.flush()
    sys.stdout.buffer.write(stdout)
    sys.stdout.buffer.flush()
    err = console(stderr=True)
    err.file.write(notes)
    err.file.flush()
    return status


def _validate_child(send: Callable[[tuple], None], job: ValidateJob) -> tuple[int, str, str, bytes]:
    """A supervised validate's child (engine/supervise.py): the checking, the report written to
    its files -> (the exit status, the report drawn for the parent's console, the notes for its
    stderr (the files written), the report named -). The parent prints the log as it comes,
    then what this returns."""
    from .validate.isolated import serve

    drawn, notes, stdout = io.StringIO(), io.StringIO(), io.BytesIO()
    steps = _Steps(lambda line: None)
    status = _finish(serve(send, job, steps), job.impl, Console(file=drawn, **job.console),
                     Console(file=notes, **{**job.console, "width": 10 ** 6}), steps, job.device, job.reports, stdout)
    return status, drawn.getvalue(), notes.getvalue(), stdout.getvalue()


def _validate(world: Any, fixtures: Path | None, device: str, dtype: str, reports: tuple, require: str,
              invariant: bool, page_size: int | None) -> int:
    """validate of the built-in engine on one rank of --tp -> its exit status."""
    from .validate import validate

    device = str(world.device) if world is not None else device
    out = _rank_console(world, stderr=STDOUT in reports)
    steps = _log_steps(out)
    report = validate(None, fixtures, device, log=steps, require=require, invariant=invariant, dtype=dtype,
                      world=world, page_size=page_size)
    first = world is None or world.rank == 0           # one file of each, from the first rank
    return _finish(report, None, out, console(stderr=True), steps, device, reports if first else (None, None, None))


def _log_steps(out: Console) -> _Steps:
    """The runner's log on `out`, each line escaped (names come from files) and, on a terminal,
    wrapped under itself."""
    return _Steps(lambda line: out.print(_wrapped(shown(line), out.width if out.is_terminal else None, style="dim")))


def _finish(report: Report, impl: str | None, out: Console, err: Console, steps: _Steps, device: str | None,
            reports: tuple, stdout: BinaryIO | None = None) -> int:
    """The report's run described (impl: the --impl spec), shown on `out`, written to the (json,
    junit, html) paths (one named - onto stdout, default sys.stdout's), each file written named
    on `err` -> the exit status."""
    report.impl, report.versions, report.commit = impl, _versions(), _commit()
    if device is not None:                         # None: a server's run (its device is the server's)
        report.device_name = _device_name(device)
    report.timings = steps.timings()
    render(report, out)
    for path, form in zip(reports, ("json", "junit", "html")):
        if path is not None:
            _write_report(report, form, path, stdout or sys.stdout.buffer)
            if path != STDOUT:
                _wrote(path, err)
    return 1 if report.failed else 0


def _given(*names: str) -> list[str]:
    """The options among `names` given on the command line (or by an environment variable), as flags."""
    ctx = click.get_current_context()
    return [f"--{name.replace('_', '-')}" for name in names
            if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)]


def _validate_server(fixtures: Path | None, dtype: str, reports: tuple, server: str | None, samples: int | None,
                     **options: Any) -> int:
    """validate --server: a serving engine's tokens against a fixture (engine/validate/server.py)."""
    if server is None:
        raise CliError(f"{_given(*SERVER_ONLY)[0]} applies to --server URL")
    if _given(*NOT_FOR_SERVER):
        raise CliError(f"{_given(*NOT_FOR_SERVER)[0]} applies to an adapter or the built-in engine, not to --server")
    if options["temperature"] == 0 and _given("samples", "seed"):
        raise CliError(f"{_given('samples', 'seed')[0]} applies to sampled runs: give --temperature T > 0")
    if reports[2] is not None:
        _require_matplotlib("--html")
    from .validate.server import SAMPLES, ServerRun, validate_server

    out = console(stderr=STDOUT in reports)
    steps = _log_steps(out)
    run = ServerRun(server, samples=samples or SAMPLES, **options)
    report = validate_server(run, fixtures, dtype if _given("dtype") else None, log=steps)
    return _finish(report, None, out, console(stderr=True), steps, None, reports)


def _write_report(report: Report, form: str, path: Path | str, stdout: BinaryIO) -> None:
    """The report as JSON, JUnit XML or HTML at `path`, all or nothing; - : onto stdout, whole."""
    if form == "json":
        from .validate import write_json as write
    elif form == "junit":
        from .validate.junit import write_junit as write
    else:
        from .validate.html import write_html as write
    if path != STDOUT:
        write(report, path)
        return
    with tempfile.TemporaryDirectory(prefix="kdtree-report-") as directory:
        write(report, Path(directory) / "report")
        stdout.write((Path(directory) / "report").read_bytes())
        stdout.flush()


def _wrote(path: Path, err: Console | None = None) -> None:
    """Say on stderr (or `err`) which file a command wrote."""
    (err or console(stderr=True)).print(Text(f"wrote {shown(path)}"))


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


def _lines(text: str, width: int | None, first: str = "", rest: str = "  ") -> list[str]:
    """`text` after `first`, wrapped at `width` with the lines after the first indented by `rest`
    (width None: one line)."""
    if width is None:
        return [first + text]
    return textwrap.wrap(text, max(width, len(rest) + 20), initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first]


def _wrapped(text: str, width: int | None, first: str = "", rest: str = "  ", style: str = "") -> Text:
    """`text` as one Text of `_lines`."""
    return Text("\n".join(_lines(text, width, first, rest)), style=style)


# ---------------------------------------------------------------------------- diverge

@cli.command("diverge")
@click.option("--fixture", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A model fixture: its weights, a prompt, its AR tokens and trees.")
@click.option("--config", "config", default=None,
              help="Or a config (a preset, or kdtr_format.CONFIGS such as k2-mid) with the engine benchmark's "
                   "seeded random weights.")
@click.option("--prompt", default=None, help="The fixture's prompt name (default: the longest).")
@click.option("--prompt-length", default=64, show_default=True, type=click.IntRange(min=1),
              help="With --config: random prompt tokens.")
@click.option("--prompt-seed", default=1, show_default=True, type=int, help="With --config: the prompt's seed.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --config: the weights' seed.")
@click.option("--way", type=click.Choice(("chunk", "tree", "batch")), default="chunk", show_default=True,
              help="What AR decode is compared with: one causal chunk, a tree verify, or a batch.")
@click.option("--tokens", "count", default=16, show_default=True, type=click.IntRange(min=1),
              help="New tokens compared (chunk, batch).")
@click.option("--trace", default=None,
              help="With --fixture and --way tree: the round as TRACE/ROUND (default: the longest accepted path).")
@click.option("--batch", default=4, show_default=True, type=click.IntRange(min=2), help="Requests of the batch way.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--impl", type=str, default=None, help="Adapter factory (model and intermediates capabilities).")
@click.option("--invariant", is_flag=True, help="The built-in engine in batch-invariant mode.")
@click.option("--json", "json_path", type=OutputFile(), default=None, help="Also write the finding as JSON here.")
def diverge_command(fixture: Path | None, config: str | None, prompt: str | None, prompt_length: int,
                    prompt_seed: int, seed: int, way: str, count: int, trace: str | None, batch: int, dtype: str,
                    device: str, impl: str | None, invariant: bool, json_path: Path | None) -> int:
    """Where AR decode and a verify of the same tokens differ: the first op beyond the dtype's noise, the
    first bit for bit (exit 1 if any)."""
    if (fixture is None) == (config is None):
        raise CliError("give exactly one of --fixture PATH and --config NAME")
    if invariant and impl is not None:
        raise CliError("--invariant is the built-in engine's mode; an --impl adapter is what it is")
    if config is not None and prompt is not None:
        raise CliError("--prompt names a fixture's prompt; with --config use --prompt-length and --prompt-seed")
    pick = None
    if trace is not None:
        name, _, number = trace.partition("/")
        if not number.isdigit():
            raise CliError(f"--trace {trace!r}: expected TRACE/ROUND, e.g. t1/0")
        pick = (name, int(number))
    _check_device(device)
    from . import diverge_run
    from .adapter import TorchAdapter
    from .validate import load_impl, write_json
    from .validate.fixtures import full_fixtures

    try:
        adapter = load_impl(impl) if impl else TorchAdapter(device, invariant=invariant)
        if not callable(getattr(adapter, "intermediates", None)):
            raise CliError(f"--impl {impl}: the adapter has no `intermediates` method (protocol capability)")
        set_dtype = getattr(adapter, "set_dtype", None)
        if dtype != "float32" and not callable(set_dtype):
            raise CliError(f"--dtype {dtype}: the adapter has no `set_dtype` method")
        if callable(set_dtype):
            set_dtype(dtype)
        if fixture is not None:
            subject = _reading_subject(full_fixtures(fixture), prompt, adapter, diverge_run.from_fixture)
        elif not isinstance(adapter, TorchAdapter):
            raise CliError("--config builds the built-in engine; use --fixture with --impl")
        else:
            need = diverge_run.memory_needed(diverge_run.named_config(config), dtype, prompt_length, count)
            _check_memory(f"--config {config}", need, device)
            subject = diverge_run.from_config(config, adapter, seed, prompt_length, prompt_seed)
        a, b, divergence = diverge_run.run(subject, way, count, batch, pick)
    except ValueError as exc:          # the fixture, config, prompt, trace or way named does not fit
        raise CliError(str(exc)) from None
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise CliError(f"ran out of memory on {device} ({type(exc).__name__}: {exc}); a smaller config, prompt "
                       "or --tokens needs less") from None
    render_divergence(subject, a, b, divergence, console())
    if json_path is not None:
        write_json(divergence, json_path)
        _wrote(json_path)
    return 1 if divergence.first is not None else 0


def _check_memory(what: str, need: Memory, device: str) -> None:
    """State on stderr what a run needs, or refuse it when the device (its weights) or the host
    (the captured values; everything on the CPU) has less available."""
    parts = [(need.total, "cpu")] if device == "cpu" else [(need.device, device), (need.captures, "cpu")]
    for size, where in parts:
        free = _free_bytes(where)
        if size > free:
            raise CliError(f"{what} needs {need}: more than the {decimal(free)} available on {where}; take a "
                           "smaller config (e.g. k2-mid) or a fixture")
    click.echo(f"kdtree: note: {what} needs {need}; {decimal(_free_bytes(device))} available on {device}", err=True)


def _out_of_memory(exc: BaseException) -> bool:
    """Whether an exception is an allocation that failed (numpy's MemoryError, torch's CPU
    allocator or a CUDA out-of-memory error)."""
    import torch

    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or "can't allocate memory" in str(exc)


def _reading_subject(fixture: Path, prompt: str | None, adapter: Any, from_fixture: Callable) -> Subject:
    """from_fixture, a broken file's error naming the file."""
    try:
        return from_fixture(fixture, prompt, adapter)
    except KdtrError as exc:
        raise CliError(f"{fixture}: {exc}") from None


def render_divergence(subject: Subject, a: Way, b: Way, divergence: Divergence, out: Console, rows: int = 16) -> None:
    """The explanation, the differing points in compute order and the decisions that differ."""
    out.print(Text(f"kdtree diverge: {shown(subject.label)}; {shown(a.label)} vs {shown(b.label)}, "
                   f"{len(a.tokens) - a.prompt_length} new tokens after {a.prompt_length}", style="bold"))
    for line in divergence.explanation:
        out.print(Text(f"  {shown(line)}"))
    differing = [p for p in divergence.points if p.tokens]
    if differing:
        points = table("layer", "point", "tokens", "values differ", "max ulp", "x noise", "verdict",
                       title=f"points that differ, in compute order (max ulp at the row's scale; x noise: of "
                             f"the {divergence.dtype} noise; cause: every input agrees)",
                       right=("tokens", "max ulp", "x noise"))
        for p in differing[:rows]:
            points.add_row("-" if p.layer is None else str(p.layer), p.point, str(len(p.tokens)),
                           f"{p.values} / {p.size}", "-" if p.max_ulps is None else f"{p.max_ulps:.3g}",
                           "-" if p.noise_ratio is None else f"{p.noise_ratio:.2g}",
                           f"{p.verdict}, cause" if p.inputs_agree else p.verdict)
        out.print(points)
        if len(differing) > rows:
            out.print(Text(f"  ... and {len(differing) - rows} more points"))
    flipped = [c for c in divergence.decisions if c.choice_a != c.choice_b]
    if flipped:
        choices = table("token", "position", a.label, "margin", b.label, "margin ", title="greedy choices that differ")
        for c in flipped[:rows]:
            choices.add_row(str(c.token), str(c.position), str(c.choice_a), f"{c.margin_a:.3g}", str(c.choice_b),
                            f"{c.margin_b:.3g}")
        out.print(choices)


# ---------------------------------------------------------------------------- demo

@dataclass(frozen=True)
class _DemoModel:
    """The model fixture the demo runs: where it is, its name and config, its longest prompt."""

    path: Path
    name: str
    cfg: ModelConfig
    prompt: list[int] | None


@cli.command("demo")
@click.option("--preset", default=None, help="Run <fixtures>/<preset>.kdtr (default: tiny).")
@click.option("--fixture", "fixture", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Any model fixture to take weights and prompt from (e.g. one made with "
                   "`refgen generate --config-file`).")
@click.option("--prompt", type=TokenIds(), default=None,
              help="Comma-separated token ids (default: the fixture's longest prompt).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens to generate after the prompt.")
@click.option("--budget", default=32, show_default=True, type=click.IntRange(min=0),
              help="Tree nodes under the root per round.")
@click.option("--block-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Draft block: block size - 1 drafted depths.")
@click.option("--accuracy", default=0.8, show_default=True, type=FiniteFloat(0.0, 1.0),
              help="The oracle drafter's accuracy.")
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--plot", "plot_path", type=OutputFile(), default=None,
              help="Save a PNG histogram of acceptance lengths (needs matplotlib: the `plot` extra).")
@click.option("--invariant", is_flag=True, help="Run the engine in batch-invariant mode.")
@_engine_layout_options
def demo_command(preset: str | None, fixture: Path | None, prompt: list[int] | None, max_new_tokens: int,
                 budget: int, block_size: int, accuracy: float, device: str, plot_path: Path | None,
                 invariant: bool, tp: int | None, page_size: int | None) -> int:
    """AR and DDTree side by side on a model fixture's weights (oracle and layerskip drafters)."""
    if plot_path is not None:
        _require_matplotlib("--plot")
    _check_tp(tp, device)
    _check_device(device)
    model = _demo_model(preset, fixture)
    cfg, tokens, ddtree = model.cfg, prompt or model.prompt, DDTreeConfig(block_size=block_size, budget=budget)
    if not tokens:
        raise CliError(f"{model.path} holds no prompts; give --prompt")
    _check_demo_sizes(cfg, tokens, max_new_tokens, ddtree, device)
    return _on_ranks(tp, device, _demo, model, tokens, ddtree, max_new_tokens, accuracy, device, plot_path,
                     invariant, page_size)


def _demo(world: Any, model: _DemoModel, tokens: list[int], ddtree: DDTreeConfig, max_new_tokens: int,
          accuracy: float, device: str, plot_path: Path | None, invariant: bool, page_size: int | None) -> int:
    """The demo's runs on one rank (world None: unsharded) -> its exit status."""
    from .adapter import TorchAdapter
    from .decode import ar_decode, ddtree_decode
    from .drafters import LayerSkipDrafter, OracleDrafter
    from .validate.fixtures import fixture_weights

    cfg = model.cfg
    adapter = TorchAdapter(device if world is None else world.device, invariant=invariant, world=world,
                           page_size=page_size)
    with _reading(model.path) as reader:
        adapter.load_weights(cfg, fixture_weights(reader))
    target, layers = adapter.model, max(1, cfg.num_hidden_layers // 2)
    ar = ar_decode(target, [tokens], max_new_tokens, stages=adapter.stages)
    oracle = OracleDrafter([tokens + ar.tokens[0]], cfg.vocab_size, accuracy, seed=0, device=target.device)
    layerskip = LayerSkipDrafter(cfg, adapter.weights, layers, target.device, target.dtype)
    runs = {"AR": ar}
    for name, drafter in (("DDTree oracle", oracle), ("DDTree layerskip", layerskip)):
        runs[name] = ddtree_decode(target, drafter, [tokens], ddtree, max_new_tokens, stages=adapter.stages)
    _print_demo(_rank_console(world), model, tokens, ddtree, runs,
                f"oracle: knows the AR continuation, right with probability {accuracy} (an upper bound); "
                f"layerskip: the target's first {layers} of {cfg.num_hidden_layers} layers")
    if plot_path is not None and (world is None or world.rank == 0):
        _plot({k: v for k, v in runs.items() if k != "AR"}, plot_path, ddtree.block_size)
        _wrote(plot_path)
    return 0 if all(r.tokens == ar.tokens for r in runs.values()) else 1


def _demo_model(preset: str | None, fixture: Path | None) -> _DemoModel:
    """The model fixture named by --fixture, else by --preset (default tiny) in the fixture directory."""
    from .validate import find_fixtures, model_fixture_config
    from .validate.fixtures import full_fixtures

    if fixture is None:
        name = preset or "tiny"
        fixture = find_fixtures(None) / f"{name}.kdtr"
        if not fixture.is_file():
            hint = (f"run `refgen generate --preset {name}`" if name in PRESETS else
                    f"presets are {', '.join(PRESETS)}; or give --fixture PATH")
            raise CliError(f"--preset {name}: no fixture {fixture} ({hint})")
    with _reading(fixture) as reader:
        meta = reader.metadata
        if meta.get("kind") != "model":
            raise CliError(f"{fixture}: not a model fixture (kind {meta.get('kind')!r}); the demo needs a model's "
                           "weights (`refgen list` shows the kinds)")
        cfg = model_fixture_config(reader, fixture)
        if preset is not None and meta.get("preset") != preset:
            raise CliError(f"{fixture} holds {meta.get('preset')!r}, not --preset {preset!r}")
        prompts = meta.get("prompts") or []
        longest = max(prompts, key=lambda p: p["length"])["name"] if prompts else None
        tokens = np.asarray(reader[f"prompts/{longest}/tokens"]).tolist() if longest else None
    return _DemoModel(full_fixtures(fixture), str(meta.get("preset", fixture.stem)), cfg, tokens)


@contextmanager
def _reading(path: Path) -> Iterator[kdtr_format.Reader]:
    """kdtr_format.open(path), a broken file's error naming the file."""
    try:
        with kdtr_format.open(path) as reader:
            yield reader
    except KdtrError as exc:
        raise CliError(f"{path}: {exc}") from None


def _check_demo_sizes(cfg: ModelConfig, tokens: list[int], max_new_tokens: int, ddtree: DDTreeConfig,
                      device: str) -> None:
    """Refuse, before anything is allocated, a run the model's positions or the device's memory cannot hold."""
    from .decode import _tree_capacity

    if max(tokens) >= cfg.vocab_size:
        raise CliError(f"--prompt: token id {max(tokens)} is outside the model's vocabulary of {cfg.vocab_size}")
    positions = len(tokens) + max_new_tokens + ddtree.depth
    if positions > cfg.max_position_embeddings:
        raise CliError(f"the prompt ({len(tokens)} tokens) + --max-new-tokens {max_new_tokens} + --block-size "
                       f"{ddtree.block_size} - 1 need {positions} positions; the model has "
                       f"max_position_embeddings {cfg.max_position_embeddings}")
    tree = min(ddtree.budget, _tree_capacity(ddtree.depth, cfg.vocab_size)) + 1
    slots = len(tokens) + max_new_tokens + tree
    need = 3 * 4 * cfg.num_attention_heads * tree * slots + 4 * tree * cfg.vocab_size   # scores x3, logits
    free = _free_bytes(device)
    if need > free:
        raise CliError(f"--budget {ddtree.budget}: a verify forward of {tree} tree tokens needs about "
                       f"{need / 1e9:.1f} GB for attention scores, more than the {free / 1e9:.1f} GB free on "
                       f"{device}; give a smaller --budget")


def _free_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _print_demo(out: Console, model: _DemoModel, prompt: list[int], ddtree: DDTreeConfig,
                runs: dict[str, DecodeResult], legend: str) -> None:
    ar_tokens = runs["AR"].tokens[0]
    out.print(Text(f"model {shown(model.name)} ({shown(model.path)}); prompt ({len(prompt)} tokens): {prompt}"))
    out.print(Text(f"block size {ddtree.block_size}, budget {ddtree.budget}; AR tokens: {ar_tokens}"))
    summary = table("run", "same as AR", "target forwards", "tau", "tokens/s", title="AR vs DDTree",
                    right=("target forwards", "tau", "tokens/s"))
    for name, result in runs.items():
        m = result.metrics
        same = Text("yes", style="green") if result.tokens[0] == ar_tokens else Text("NO", style="bold red")
        summary.add_row(name, same, str(m.target_forwards), f"{m.mean_acceptance:.2f}", f"{m.tokens_per_second:.1f}")
    out.print(summary)
    out.print(Text(legend, style="dim"))
    from .metrics import STAGES

    stages = table("stage", *runs, title="time per stage, ms", right=tuple(runs))
    for stage in STAGES:
        stages.add_row(stage, *(f"{r.metrics.stage_seconds[stage] * 1e3:.1f}" for r in runs.values()))
    out.print(stages)


def _require_matplotlib(option: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(f"{option} needs matplotlib: pip install matplotlib (in a checkout: pip install -e '.[plot]')")


def _plot(runs: dict[str, DecodeResult], path: Path, block_size: int) -> None:
    """A PNG histogram of acceptance lengths per run, written all or nothing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    for i, (name, result) in enumerate(runs.items()):
        counts = result.metrics.acceptance_histogram(block_size)
        ax.bar(np.arange(len(counts)) + (i - (len(runs) - 1) / 2) * width, counts, width=width,
               label=f"{name} (tau {result.metrics.mean_acceptance:.2f})")
    ax.set_xlabel("tokens committed per round (acceptance length)")
    ax.set_ylabel("rounds")
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_output(path) as file:
            fig.savefig(file, format="png")
    finally:
        plt.close(fig)
