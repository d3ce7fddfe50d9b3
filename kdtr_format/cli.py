"""`kdtr`: inspect, verify, diff, cat and convert KDTR files.

Exit status: 0 success; 1 a file is corrupt or malformed, or (diff) the files
differ; 2 bad usage or input that is not there (missing file, unknown tensor,
unsupported extension, missing optional library). Errors are one line on
stderr, `kdtr: error: ...`, never a traceback.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

from . import format as fmt
from .compare import compare_arrays, diff_metadata
from .convert import ConvertError, convert as convert_file
from .errors import KdtrError, TensorNotFoundError
from .reader import Reader

EXIT_DIFFERENT = 1
EXIT_USAGE = 2
_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _Cli(click.Group):
    """A click group whose every failure is one line and an exit status (see the module docstring)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:
            click.echo(e.ctx.get_help())
            status = 0
        except click.exceptions.Abort:
            _error("aborted")
            status = 130
        except click.ClickException as e:
            _error(e.format_message())
            status = EXIT_USAGE
        except (TensorNotFoundError, ConvertError) as e:
            _error(str(e))
            status = EXIT_USAGE
        except KdtrError as e:
            _error(str(e))
            status = EXIT_DIFFERENT
        except OSError as e:
            _error(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
            status = EXIT_USAGE
        sys.exit(status or 0)


def _error(message: str) -> None:
    click.echo(f"kdtr: error: {' '.join(str(message).split())}", err=True)


@contextmanager
def _progress(label: str, unit_bytes: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (shown only on a terminal); yields update(done, total)."""
    console = Console(stderr=True)
    columns = [TextColumn(label), BarColumn()]
    columns += [DownloadColumn()] if unit_bytes else [TextColumn("{task.completed:.0f}/{task.total:.0f}")]
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect, verify, diff, print and convert KDTR files."""


@main.command()
@click.argument("path")
@click.option("--prefix", default=None, help="Only tensors whose name starts with this.")
@click.option("--no-metadata", is_flag=True, help="Leave out the metadata tree.")
def inspect(path: str, prefix: str | None, no_metadata: bool) -> None:
    """Table of tensors and the metadata tree."""
    console = Console()
    with Reader(path) as f:
        names = f.names(prefix)
        total = sum(f.info(n).nbytes for n in names)
        table = Table(title=f"{path}: KDTR {f.version[0]}.{f.version[1]}, alignment {f.alignment}, "
                            f"{len(names)} tensors, {total} bytes")
        for column in ["name", "dtype", "shape", "offset", "nbytes", "crc32c"]:
            table.add_column(column, justify="right" if column in ("offset", "nbytes") else "left")
        for name in names:
            info = f.info(name)
            table.add_row(name, info.dtype, str(list(info.shape)), str(info.offset), str(info.nbytes), f"{info.crc32c:08x}")
        console.print(table)
        if not no_metadata:
            tree = Tree("metadata")
            _grow(tree, f.metadata)
            console.print(tree)


def _grow(tree: Tree, value: object) -> None:
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    for key, child in items or []:
        if isinstance(child, (dict, list)) and child:
            _grow(tree.add(f"[bold]{key}[/bold]"), child)
        else:
            tree.add(f"[bold]{key}[/bold]: {child!r}")


@main.command()
@click.argument("path")
def verify(path: str) -> None:
    """Check the layout and every checksum (exit 1 naming the first bad tensor)."""
    with Reader(path) as f:
        total = sum(f.info(n).nbytes for n in f.names())
        with _progress("verify", unit_bytes=True) as update:
            f.verify(progress=update)
        click.echo(f"ok: {path}: {len(f)} tensors, {total} bytes, all checksums match")


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (against B).")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--prefix", default=None, help="Only tensors whose name starts with this.")
def diff(a: str, b: str, rtol: float, atol: float, prefix: str | None) -> int:
    """Compare tensors and metadata of A against reference B (exit 1 when they differ)."""
    if rtol < 0 or atol < 0:
        raise click.BadParameter("tolerances must be >= 0")
    different = 0
    with Reader(a) as fa, Reader(b) as fb:
        names_a, names_b = fa.names(prefix), fb.names(prefix)
        for name in names_a + [n for n in names_b if n not in fa]:
            if name not in fb or name not in fa:
                click.echo(f"{name}: only in {'A' if name in fa else 'B'}")
                different += 1
                continue
            result = compare_arrays(fa[name], fb[name], rtol=rtol, atol=atol)
            if result.status == "equal":
                continue
            if result.status in ("dtype", "shape"):
                ia, ib = fa.info(name), fb.info(name)
                click.echo(f"{name}: {result.status} differs: {ia.dtype}{list(ia.shape)} vs {ib.dtype}{list(ib.shape)}")
            else:
                ulp = f", max ulp {result.max_ulp}" if result.max_ulp is not None else ""
                outside = f", {result.count} outside tolerance, first at {list(result.first_index)}" if result.count else ""
                click.echo(f"{name}: {result.status}: max abs {result.max_abs:.6g}, max rel {result.max_rel:.6g}{ulp}{outside}"
                           + ("" if result.count else f", first difference at {list(result.first_index)}"))
            different += not result.same
        for line in diff_metadata(fa.metadata, fb.metadata):
            click.echo(line)
            different += 1
    click.echo(f"{'different' if different else 'same'}: {different} difference(s) beyond rtol={rtol}, atol={atol}")
    return EXIT_DIFFERENT if different else 0


@main.command()
@click.argument("path")
@click.argument("name")
@click.option("--summary", "mode", flag_value="summary", help="Statistics only.")
@click.option("--values", "mode", flag_value="values", help="All values, however many.")
@click.option("--threshold", type=int, default=1000, show_default=True,
              help="Without --summary/--values: values up to this many elements, else a summary.")
def cat(path: str, name: str, mode: str | None, threshold: int) -> None:
    """Print one tensor's values, or a summary of them."""
    with Reader(path) as f:
        array, info = f[name], f.info(name)
        click.echo(f"{name}: {info.dtype} {list(info.shape)}")
        if mode == "values" or (mode is None and array.size <= threshold):
            with np.printoptions(threshold=sys.maxsize if mode == "values" else threshold, linewidth=120):
                click.echo(np.array2string(array.astype(np.int8) if info.dtype == "int4" else array))
            return
        values = array.astype(np.float64).reshape(-1)
        finite = values[np.isfinite(values)]
        stats = {"elements": values.size, "nan": int(np.isnan(values).sum()), "inf": int(np.isinf(values).sum())}
        if finite.size:
            stats.update(min=finite.min(), max=finite.max(), mean=finite.mean(), std=finite.std())
        click.echo("  ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--alignment", type=int, default=fmt.DEFAULT_ALIGNMENT, show_default=True,
              help="Data alignment when writing KDTR.")
def convert(src: str, dst: str, alignment: int) -> None:
    """Convert between .kdtr, .h5/.hdf5, .npz and .safetensors (by extension), losslessly."""
    with _progress("convert", unit_bytes=False) as update:
        written = convert_file(src, dst, alignment=alignment, progress=update)
    click.echo(f"wrote {dst}: {written} tensors")
