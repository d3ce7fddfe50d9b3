"""The `kdtree` command line: `validate` (the main job), `diverge` and `demo`.

    kdtree validate [--fixtures DIR|FILE] [--device cpu|cuda[:N]] [--dtype float32|bfloat16] [--json PATH]
                    [--junit-xml PATH] [--html PATH] [--impl module:factory] [--require CAPS] [--invariant]
                    [--tp N] [--page-size N]
    kdtree validate --server URL --fixtures EXPORT [--api openai|sglang] [--concurrency N]
                    [--temperature T --samples N --seed S] [--logprobs K] [--timeout S]   (docs/serving.md)
    kdtree diverge (--fixture PATH | --config NAME) [--way chunk|tree|batch] [--dtype bfloat16] [--json PATH]
    kdtree demo [--preset tiny | --fixture PATH] [--prompt 1,2,3] [--budget 32] [--block-size 8] [--plot PATH]
                [--invariant] [--tp N] [--page-size N]

Exit status: 0 passed, 1 a check failed (validate), the two ways differ (diverge) or
DDTree differed from AR (demo), 2 bad input, 3 internal error, 130 interrupted (kdtr_format/clikit.py). Every bad
argument is refused before any work, in one line on stderr; --json, --junit-xml, --html
and --plot are written all or nothing, with the user's umask.

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
import os
import platform
import re
import subprocess
import textwrap
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import click
import numpy as np
from rich.console import Console
from rich.filesize import decimal
from rich.text import Text

import kdtr_format
from kdtr_format import PRESETS, DDTreeConfig, KdtrError, ModelConfig
from kdtr_format.clikit import Cli, CliError, FiniteFloat, OutputFile, atomic_output, console, table

if TYPE_CHECKING:
    from .decode import DecodeResult
    from .diverge import Divergence
    from .diverge_run import Memory, Subject
    from .diverge_ways import Way
    from .validate import Report

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
MAX_CPU_RANKS = 8              # --tp on the CPU: local processes, each holding the replicated weights
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


def _rank_console(world: Any) -> Console:
    """The console of this rank: rank 0 (or an unsharded run) prints, the other ranks are quiet."""
    return console() if world is None or world.rank == 0 else Console(quiet=True)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CliError(f"--device {device}: no CUDA device is visible")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    else:
        torch.set_num_threads(1)    # tiny models gain nothing from intra-op threads on shared cores


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


SERVER_ONLY = ("api", "concurrency", "temperature", "samples", "seed", "logprobs", "timeout")
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
        click.option("--timeout", type=FiniteFloat(0.001, 86400.0), default=60.0, show_default=True,
                     help="With --server: seconds to wait for each reply."),
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
@click.option("--json", "json_path", type=OutputFile(), default=None,
              help="Also write the report as JSON here (with versions, commit, device and timings).")
@click.option("--junit-xml", "junit_path", type=OutputFile(), default=None,
              help="Also write the report as JUnit XML here (one testcase per row), for CI test views.")
@click.option("--html", "html_path", type=OutputFile(), default=None,
              help="Also write the report as one self-contained HTML page here, with plots (needs "
                   "matplotlib: the `plot` extra).")
@click.option("--impl", type=str, default=None,
              help="Adapter factory to validate: module:factory (a module on PYTHONPATH or in the "
                   "current directory) or path/to/file.py:factory (default: the built-in torch engine).")
@click.option("--require", type=str, default="declared", show_default=True,
              help="Capabilities whose checks must run, comma-separated (model, topk, tree, compile, accept, "
                   "sample_accept, compact, attention, paged_attention, paged_compact); `declared`: the "
                   "adapter's `capabilities`, else what it implements; `none`: nothing required. A required "
                   "capability that is skipped or that no fixture exercises is a FAIL.")
@click.option("--invariant", is_flag=True, help="The built-in engine in batch-invariant mode.")
@_engine_layout_options
@_server_options
def validate_command(fixtures: Path | None, device: str, dtype: str, json_path: Path | None,
                     junit_path: Path | None, html_path: Path | None, impl: str | None, require: str,
                     invariant: bool, tp: int | None, page_size: int | None, **served: Any) -> int:
    """Check an implementation against the golden fixtures, or (--server) what a serving engine serves;
    exit 1 on any failure."""
    if served["server"] is not None or _given(*SERVER_ONLY):
        return _validate_server(fixtures, dtype, json_path, junit_path, html_path, **served)
    for flag, given in (("--invariant", invariant), ("--tp", tp), ("--page-size", page_size)):
        if given and impl:
            raise CliError(f"{flag} is a mode of the built-in engine; it does not apply to --impl")
    if html_path is not None:
        _require_matplotlib("--html")
    _check_tp(tp, device)
    _check_device(device)
    return _on_ranks(tp, device, _validate, fixtures, device, dtype, json_path, junit_path, html_path, impl, require,
                     invariant, page_size)


def _validate(world: Any, fixtures: Path | None, device: str, dtype: str, json_path: Path | None,
              junit_path: Path | None, html_path: Path | None, impl: str | None, require: str, invariant: bool,
              page_size: int | None) -> int:
    """validate's work on one rank (world None: unsharded) -> its exit status."""
    from .validate import load_impl, validate

    try:
        adapter = load_impl(impl) if impl else None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    device = device if world is None else str(world.device)
    out = _rank_console(world)
    steps = _Steps(lambda line: out.print(Text(line, style="dim")))
    report = validate(adapter, fixtures, device, log=steps, require=require, invariant=invariant, dtype=dtype,
                      world=world, page_size=page_size)
    report.versions, report.commit, report.device_name = _versions(), _commit(), _device_name(device)
    report.timings = steps.timings()
    render(report, out)
    if world is None or world.rank == 0:           # one file of each, from the first rank
        _write_reports(report, json_path, junit_path, html_path)
    return 1 if report.failed else 0


def _write_reports(report: Report, json_path: Path | None, junit_path: Path | None, html_path: Path | None) -> None:
    """The report's files: JSON, JUnit XML and HTML, each where a path is given."""
    from .validate import write_json

    if json_path is not None:
        write_json(report, json_path)
    if junit_path is not None:
        from .validate.junit import write_junit
        write_junit(report, junit_path)
    if html_path is not None:
        from .validate.html import write_html
        write_html(report, html_path)


def _given(*names: str) -> list[str]:
    """The options among `names` given on the command line (or by an environment variable), as flags."""
    ctx = click.get_current_context()
    return [f"--{name.replace('_', '-')}" for name in names
            if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)]


def _validate_server(fixtures: Path | None, dtype: str, json_path: Path | None, junit_path: Path | None,
                     html_path: Path | None, server: str | None, samples: int | None, **options: Any) -> int:
    """validate --server: a serving engine's tokens against a fixture (engine/validate/server.py)."""
    if server is None:
        raise CliError(f"{_given(*SERVER_ONLY)[0]} applies to --server URL")
    if _given(*NOT_FOR_SERVER):
        raise CliError(f"{_given(*NOT_FOR_SERVER)[0]} applies to an adapter or the built-in engine, not to --server")
    if options["temperature"] == 0 and _given("samples", "seed"):
        raise CliError(f"{_given('samples', 'seed')[0]} applies to sampled runs: give --temperature T > 0")
    if html_path is not None:
        _require_matplotlib("--html")
    from .validate.server import SAMPLES, ServerRun, validate_server

    out = console()
    steps = _Steps(lambda line: out.print(Text(line, style="dim")))
    run = ServerRun(server, samples=samples or SAMPLES, **options)
    report = validate_server(run, fixtures, dtype if _given("dtype") else None, log=steps)
    report.versions, report.commit, report.timings = _versions(), _commit(), steps.timings()
    render(report, out)
    _write_reports(report, json_path, junit_path, html_path)
    return 1 if report.failed else 0


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
    """The checkout's commit (`-dirty` when it has changes), None outside a git checkout."""
    if not (REPO_ROOT / ".git").exists():
        return None
    try:
        run = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else None


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)"


def render(report: Report, out: Console) -> None:
    """The report as rows under their fixture: status, check, numbers; a detail on the lines below,
    wrapped to the console's width (readable at 80 columns)."""
    width = out.width
    status_w = max((len(c.status.value) for c in report.checks), default=0)
    name_w = min(max((len(c.name) for c in report.checks), default=0), 36)
    indent = " " * (2 + status_w + 2)
    out.print(Text(f"kdtree validate: {report.implementation}", style="bold"))
    section = None
    for c in report.checks:
        if c.section != section:
            section = c.section
            out.print(Text(section, style="bold"))
        numbers = c.numbers()
        line = Text.assemble("  ", (c.status.value.ljust(status_w), STATUS_STYLE[c.status.value]), "  ", c.name)
        details = [c.detail] if c.detail else []
        if numbers and len(line) + 2 + max(name_w - len(c.name), 0) + len(numbers) <= width:
            line.append(" " * (2 + max(name_w - len(c.name), 0)) + numbers)
        elif numbers:
            details.insert(0, numbers)
        out.print(line)
        for detail in details:
            wrapped = textwrap.wrap(detail, max(width - len(indent), 20), break_on_hyphens=False)
            out.print(Text("\n".join(indent + part for part in wrapped), style="dim" if c.status.value != "FAIL" else ""))
    if report.backends:
        out.print(Text("backends: " + ", ".join(f"{k}: {v}" for k, v in report.backends.items())))
    for fixture, declared in report.deviations.items():
        out.print(Text(f"known deviations declared by the implementation for {fixture}:"))
        for deviation in declared:
            out.print(Text(f"  {deviation.line()}"))
    out.print(Text(f"fixtures: {report.fixtures}"))
    out.print(Text(report.summary(), style="bold red" if report.failed else "bold green"))


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
            subject = _reading_subject(fixture, prompt, adapter, diverge_run.from_fixture)
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
    out.print(Text(f"kdtree diverge: {subject.label}; {a.label} vs {b.label}, "
                   f"{len(a.tokens) - a.prompt_length} new tokens after {a.prompt_length}", style="bold"))
    for line in divergence.explanation:
        out.print(Text(f"  {line}"))
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

    cfg = model.cfg
    adapter = TorchAdapter(device if world is None else world.device, invariant=invariant, world=world,
                           page_size=page_size)
    with _reading(model.path) as reader:
        adapter.load_weights(cfg, {n[len("weights/"):]: np.array(reader[n]) for n in reader.names("weights/")})
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
    return 0 if all(r.tokens == ar.tokens for r in runs.values()) else 1


def _demo_model(preset: str | None, fixture: Path | None) -> _DemoModel:
    """The model fixture named by --fixture, else by --preset (default tiny) in the fixture directory."""
    from .validate import find_fixtures, model_fixture_config

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
    return _DemoModel(fixture, str(meta.get("preset", fixture.stem)), cfg, tokens)


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
    out.print(Text(f"model {model.name} ({model.path}); prompt ({len(prompt)} tokens): {prompt}"))
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
        raise CliError(f"{option} needs matplotlib (pip install 'kdtree[plot]')")


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
