"""`kdtr`: inspect, verify, diff, cat and convert KDTR files.

The project's command-line conventions (`clikit`): every command prints its help when run with no
arguments or -h; every failure is one line on stderr, `kdtr: error: ...`, never a traceback;
arguments are checked before any work starts, and an output file appears complete or not at all.
Every error names the file it is about. Exit status: 0 success; 1 (diff) the files differ; 2 bad
input (usage, a missing, corrupt or malformed file, an unknown tensor or one a slim fixture does not
store, an extension, dtype or name another format cannot take, a missing optional library); 3 an
internal error; 130 interrupted.

Output is plain text sized for the terminal (80 columns is enough; a wider one is used), and the
same when piped; a progress bar shows on stderr only when stderr is a terminal.
"""

from __future__ import annotations

import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import click
import numpy as np

from . import __version__, clikit
from .clikit import shown
from . import format as fmt
from .checkpoint_tensors import CheckpointTensors
from .compare import compare_arrays, diff_metadata
from .convert import ConvertError, convert as convert_file, kind_of
from .errors import KdtrError, in_file
from .listing import LIST_AT_MOST, listing, metadata_text
from .reader import Reader
from .seeded import omitted, recorded_seeded, slim_hint

EXIT_DIFFERENT = clikit.EXIT_FAILED


def _width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


@contextmanager
def _progress(label: str, unit_bytes: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (shown only on a terminal); yields update(done, total)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    count = DownloadColumn() if unit_bytes else MofNCompleteColumn()
    with Progress(TextColumn(label), BarColumn(), count, TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@contextmanager
def _interrupt_between_steps() -> Iterator[Callable[[], None]]:
    """Ctrl-C takes effect at the next `check()` (between tensors), not inside a library's weakref
    callback, where Python can only print it and carry on (h5py has many); a second Ctrl-C
    interrupts at once."""
    pressed: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    def check() -> None:
        if pressed:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


class _Alignment(click.ParamType):
    """A power of two from 64 to 4096."""

    name = "alignment"

    def convert(self, value, param, ctx):
        number = click.INT.convert(value, param, ctx)
        if number < fmt.MIN_ALIGNMENT or number > fmt.MAX_ALIGNMENT or number & (number - 1):
            self.fail(f"{value!r} is not a power of two from {fmt.MIN_ALIGNMENT} to {fmt.MAX_ALIGNMENT}", param, ctx)
        return number


def _command(**settings):
    return main.command(no_args_is_help=True, **settings)


@click.group(cls=clikit.Cli, name="kdtr", bad_input=(KdtrError, ConvertError))
@click.version_option(__version__, "--version", prog_name="kdtr",
                      message=f"%(prog)s, version %(version)s (KDTR format {fmt.VERSION_MAJOR}.{fmt.VERSION_MINOR})")
def main() -> None:
    """Inspect, verify, diff, print and convert KDTR files.

    Each failure is one line naming the file. Exit status: 0 success; 1 (diff) the files
    differ; 2 bad input: usage, a missing, corrupt or malformed file, a tensor the file does
    not store; 3 a fault of kdtr itself; 130 interrupted."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")    # a path from argv may not be UTF-8


@_command()
@click.argument("path")
@click.option("--prefix", default=None, help="Only tensors whose name starts with this.")
@click.option("--all", "everything", is_flag=True,
              help=f"List every tensor (without it, more than {LIST_AT_MOST} are summarized by prefix).")
@click.option("--no-metadata", is_flag=True, help="Leave out the metadata.")
def inspect(path: str, prefix: str | None, everything: bool, no_metadata: bool) -> None:
    """List the tensors and print the metadata.

    One row per tensor: dtype, shape, bytes, offset, checksum, name (verbatim)."""
    with Reader(path) as f:
        text = None if no_metadata else metadata_text(f.metadata)
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        lines = listing(f, prefix, everything, width)
        slim = omitted(f)
    lines.insert(0, f"{shown(path)}:")
    if slim:
        lines[2:2] = [f"slim: {len(slim)} seeded tensors not stored (metadata seeded_tensors); the full file:",
                      *command_lines(["refgen materialize", shown(path), "--out DIR"], width)]
    click.echo("\n".join(lines))
    if text is not None:
        click.echo(f"metadata:\n{text}")


def command_lines(parts: list[str], width: int | None, indent: str = "  ") -> list[str]:
    """A shell command to copy (`parts`: the program, then each argument with its value), on one
    line; where that is wider than the terminal, one part a line joined by backslash continuations."""
    line = indent + " ".join(parts)
    if width is None or len(line) <= width:
        return [line]
    first, *middle, last = parts
    return [f"{indent}{first} \\", *(f"{indent}  {part} \\" for part in middle), f"{indent}  {last}"]


@_command()
@click.argument("path")
def verify(path: str) -> None:
    """Check the layout, the metadata and every checksum.

    Exit 2 naming the file and its first problem: the tensor and the file offset."""
    with Reader(path) as f, _progress("verify", unit_bytes=True) as update:
        checked = f.verify(progress=update)
        count = len(f)
    click.echo(f"ok: {shown(path)}\n  {count} tensors, {checked} bytes, all checksums match")


@_command()
@click.argument("a")
@click.argument("b")
@click.option("--rtol", type=clikit.FiniteFloat(min=0), default=0.0, show_default=True, help="Relative tolerance (against B).")
@click.option("--atol", type=clikit.FiniteFloat(min=0), default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--prefix", default=None, help="Only tensors whose name starts with this.")
def diff(a: str, b: str, rtol: float, atol: float, prefix: str | None) -> int:
    """Compare tensors and metadata of A against B.

    Per tensor: max abs, max rel and ulp difference, first differing index. Exit 1 when
    anything differs beyond the tolerances."""
    different = 0
    with Reader(a) as fa, Reader(b) as fb:
        metadata_lines = diff_metadata(fa.metadata, fb.metadata)
        names_a, names_b = fa.names(prefix), fb.names(prefix)
        for name in names_a + [n for n in names_b if n not in fa]:
            label = shown(name)
            if name not in fb or name not in fa:
                click.echo(f"{label}: only in {'A' if name in fa else 'B'}")
                different += 1
                continue
            result = compare_arrays(fa[name], fb[name], rtol=rtol, atol=atol)
            if result.status == "equal":
                continue
            if result.status in ("dtype", "shape"):
                ia, ib = fa.info(name), fb.info(name)
                click.echo(f"{label}: {result.status} differs: {ia.dtype}{list(ia.shape)} vs {ib.dtype}{list(ib.shape)}")
            else:
                where = (f"{result.count} outside tolerance, first at {list(result.first_index)}" if result.count
                         else f"first difference at {list(result.first_index)}")
                ulp = f", max ulp {result.max_ulp}" if result.max_ulp is not None else ""
                click.echo(f"{label}: {result.status}, {where}\n  max abs {result.max_abs:.6g}, max rel {result.max_rel:.6g}{ulp}")
            different += not result.same
    for line in metadata_lines:
        click.echo(shown(line))
        different += 1
    click.echo(f"{'different' if different else 'same'}: {different} difference(s) beyond rtol={rtol}, atol={atol}")
    return EXIT_DIFFERENT if different else 0


@_command()
@click.argument("path")
@click.argument("name")
@click.option("--summary", "mode", flag_value="summary", help="Statistics only.")
@click.option("--values", "mode", flag_value="values", help="All values, however many.")
@click.option("--threshold", type=click.IntRange(0, 2**62), default=1000, show_default=True,
              help="Without --summary/--values: values up to this many elements, else a summary.")
def cat(path: str, name: str, mode: str | None, threshold: int) -> None:
    """Print one tensor's values, or a summary of them.

    A checkpoint fixture's weights are rebuilt from the checkpoint (metadata checkpoint_tensors);
    a tensor a slim fixture omits is refused, naming the command that writes the full file."""
    with Reader(path) as f:
        array, dtype, source = _tensor(f, path, name)
        click.echo(f"{shown(name)}: {dtype} {list(array.shape)}{source}")
        if mode == "values" or (mode is None and array.size <= threshold):
            with np.printoptions(threshold=sys.maxsize if mode == "values" else threshold, linewidth=_width()):
                click.echo(np.array2string(array.astype(np.int8) if dtype == "int4" else array))
            return
        values = array.astype(np.float64).reshape(-1)
        finite = values[np.isfinite(values)]
        stats = {"elements": values.size, "nan": int(np.isnan(values).sum()), "inf": int(np.isinf(values).sum())}
        if finite.size:
            stats.update(min=finite.min(), max=finite.max(), mean=finite.mean(), std=finite.std())
        click.echo("  ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))


def _tensor(f: Reader, path: str, name: str) -> tuple[np.ndarray, str, str]:
    """(array, dtype name, where it comes from when not the file) of tensor `name`: stored, or a
    checkpoint fixture's rebuilt from its checkpoint; CliError for one a slim fixture omits."""
    if name in f:
        return f[name], f.info(name).dtype, ""
    if name in recorded_seeded(f.metadata):
        raise clikit.CliError(f"{path}: {name} is not stored: the fixture is slim (its tensors drawn from a seed "
                              "are named, with their sha256, in its metadata's seeded_tensors); "
                              f"{slim_hint(path)}")
    try:
        rebuilt = CheckpointTensors(f.metadata)
        if name in rebuilt:
            array = rebuilt.array(name)
            return array, str(array.dtype), f" (rebuilt from the checkpoint {shown(str(rebuilt.checkpoint))})"
    except KdtrError as exc:
        raise in_file(exc, path)
    return f[name], "", ""              # TensorNotFoundError naming the file


@_command()
@click.argument("src")
@click.argument("dst", type=clikit.OutputFile())
@click.option("--alignment", type=_Alignment(), default=fmt.DEFAULT_ALIGNMENT, show_default=True,
              help="Data alignment when writing KDTR (a power of two from 64 to 4096).")
def convert(src: str, dst: Path, alignment: int) -> None:
    """Convert between KDTR, HDF5, npz and safetensors.

    Formats by extension (.kdtr, .h5/.hdf5, .npz, .safetensors); every dtype, shape, the
    tensor order and the metadata survive a round trip."""
    kind_of(src), kind_of(str(dst))
    with _progress("convert", unit_bytes=False) as update, _interrupt_between_steps() as check:
        def step(done: int, total: int) -> None:
            check()
            update(done, total)

        written = convert_file(src, str(dst), alignment=alignment, progress=step)
    click.echo(f"wrote {shown(dst)}: {written} tensors")
