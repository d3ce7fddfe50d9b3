"""What the `kdtree` commands share: the command group, argument types, the device and
--tp checks, and the messages and resources every command uses."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console
from rich.text import Text

from kdtr_format import KdtrError
from kdtr_format.clikit import Cli, CliError, console, shown

DTYPES = ("float32", "bfloat16")
MAX_CPU_RANKS = 8              # --tp on the CPU: local processes, each holding the replicated weights


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
    """The console script: exit statuses as the module docstring. `kdtree validate` ignores
    SIGINT once its verdict is final (engine/validate/reports/files.py), until the process exits;
    a caller that runs a command in its own process (argv given: the tests) gets its SIGINT
    handler back when the command ends."""
    if argv is None:
        cli.main(prog_name="kdtree")
        return
    handler = signal.getsignal(signal.SIGINT)
    try:
        cli.main(args=argv, prog_name="kdtree")
    finally:
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)




class Device(click.ParamType):
    """cpu, cuda or cuda:N (whether the device is there is checked when the command runs)."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(value)):
            self.fail(f"{value!r}: expected cpu, cuda or cuda:N", param, ctx)
        return str(value)


def _check_tp(tp: int | None, device: str) -> None:
    """Refuse a --tp this machine or the torchrun environment cannot run (before any work)."""
    from ..parallel import torchrun_size

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
    from ..parallel import run

    return run(tp, "cuda" if device.startswith("cuda") else "cpu", job, *args)


def _rank_console(world: Any, stderr: bool = False) -> Console:
    """The console of this rank: rank 0 (or an unsharded run) prints, the other ranks are quiet."""
    return console(stderr) if world is None or world.rank == 0 else Console(quiet=True)


def _check_device(device: str) -> None:
    """The device is there; on the CPU, the runner's thread policy (engine.validate.run.runner.prepare_device)."""
    from ..validate.run.runner import prepare_device

    prepare_device(device)


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



def _wrote(path: Path, err: Console | None = None) -> None:
    """Say on stderr (or `err`) which file a command wrote."""
    (err or console(stderr=True)).print(Text(f"wrote {shown(path)}"))



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




def _require_matplotlib(option: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(f"{option} needs matplotlib: pip install matplotlib (in a checkout: pip install -e '.[plot]')")


class _PathWrapper(textwrap.TextWrapper):
    """textwrap that breaks a word too long for its line after a '/' (a path, between its
    names) before it cuts one in the middle."""

    def _split(self, text: str) -> list[str]:
        room = self.width - len(self.subsequent_indent)
        return [piece for chunk in super()._split(text)
                for piece in (re.split(r"(?<=/)(?=[^/])", chunk) if len(chunk) > room else [chunk])]


def _lines(text: str, width: int | None, first: str = "", rest: str = "  ") -> list[str]:
    """`text` after `first`, wrapped at `width` with the lines after the first indented by `rest`
    (width None: one line); a long path breaks after a '/'."""
    if width is None:
        return [first + text]
    wrapper = _PathWrapper(max(width, len(rest) + 20), initial_indent=first, subsequent_indent=rest,
                           break_on_hyphens=False)
    return wrapper.wrap(text) or [first]


def _wrapped(text: str, width: int | None, first: str = "", rest: str = "  ", style: str = "") -> Text:
    """`text` as one Text of `_lines`."""
    return Text("\n".join(_lines(text, width, first, rest)), style=style)
