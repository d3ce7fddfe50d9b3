"""What the project's command lines (`kdtr`, `refgen`, `kdtree`) do the same way.

    @click.group(cls=clikit.Cli, name="refgen", bad_input=(KdtrError,))
    @click.version_option(__version__, "--version", prog_name="refgen")
    def main(): ...

- `Cli`, a click group: `-h` and `--help` on every command; help (exit 0) for
  the group and for any command declared `no_args_is_help=True` when run bare.
  Every failure is one line on stderr, `<prog>: error: ...`, never a traceback:

      0    success
      1    the check failed (validate FAIL, fixture drift, files differ)
      2    bad input: click usage errors, `CliError`, OSError, the group's `bad_input` types
      3    internal error: any other exception (set KDTREE_TRACEBACK=1 to see the traceback)
      130  interrupted (Ctrl-C)
      141  stdout closed early (`| head`): quiet

- `OutputFile`, the one click type for every file a command writes: checked
  while the arguments are parsed (not empty, not a directory, its directory
  exists and is writable), before any work; `atomic_output` then writes it all
  or nothing, with the user's umask. `OutputDirectory` likewise for an output
  directory.
- `console`, `table` and `records`: as wide as the terminal; piped, wide and
  never hard-wrapped; no cell is ever cut to "..." (cells fold instead).
- `shown`: every text a command prints that it did not write itself (a name or path
  from a file, an adapter's name or error, a user's argument) goes through it: a text
  a terminal would act on (escape sequences, other control characters, bidi
  overrides, lone surrogates) is printed as its Python literal. Tables, records and
  error lines apply it to what they are given; no markup is interpreted in them.
"""

from __future__ import annotations

import errno
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence, Union

import click
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import atomic
from .errors import KdtrError
from .writer import _fsync_directory

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141
TRACEBACK_VAR = "KDTREE_TRACEBACK"
PIPED_WIDTH = 200             # the console width when stdout is not a terminal
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())   # click >= 8.2
BadInput = Union[Sequence[type], Callable[[], Sequence[type]]]


class CliError(click.ClickException):
    """Bad input, found by a command: one line, exit status 2."""

    exit_code = EXIT_BAD_INPUT


class Cli(click.Group):
    """A click group that answers every failure with one line and an exit status (module docstring).

    bad_input: the exception types that mean the user's input is bad (exit 2, their message
    shown), or a function returning them (called only to judge an error, so that a command
    line can name types of modules it imports late). failed: the exception types that mean
    the check failed (exit 1, their message shown; `kdtr`: a corrupt file), judged after
    bad_input."""

    def __init__(self, *args: Any, bad_input: BadInput = (), failed: Sequence[type] = (), **kwargs: Any) -> None:
        kwargs.setdefault("context_settings", {}).setdefault("help_option_names", ["-h", "--help"])
        kwargs.setdefault("no_args_is_help", True)
        super().__init__(*args, **kwargs)
        self.bad_input, self.failed = bad_input, tuple(failed)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             **extra: Any) -> None:
        extra.pop("standalone_mode", None)
        prog = prog_name or self.name or "command"
        try:
            status = super().main(args, prog, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:
            click.echo(exc.ctx.get_help())
            status = 0
        except (click.Abort, KeyboardInterrupt):
            status = _fail(prog, "interrupted", EXIT_INTERRUPTED)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            status = EXIT_PIPE_CLOSED
        except click.ClickException as exc:
            status = _fail(prog, exc.format_message(), EXIT_BAD_INPUT)
        except Exception as exc:
            bad_input = self.bad_input() if callable(self.bad_input) else self.bad_input
            if isinstance(exc, (OSError, *bad_input)):
                status = _fail(prog, _describe(exc), EXIT_BAD_INPUT)
            elif isinstance(exc, self.failed):
                status = _fail(prog, _describe(exc), EXIT_FAILED)
            elif os.environ.get(TRACEBACK_VAR):
                raise
            else:
                status = _fail(prog, f"internal error: {type(exc).__name__}: {exc} (a bug; set "
                                     f"{TRACEBACK_VAR}=1 to see where)", EXIT_INTERNAL)
        sys.exit(status if isinstance(status, int) else 0)


def _fail(prog: str, message: str, status: int) -> int:
    click.echo(f"{prog}: error: {shown(' '.join(str(message).split()))}", err=True)
    return status


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    message = str(exc) or type(exc).__name__
    path = getattr(exc, "path", None) if isinstance(exc, KdtrError) else None
    return f"{path}: {message}" if path and not message.startswith(f"{path}: ") else message


# ---------------------------------------------------------------------------- output files

class _OutputPath(click.ParamType):
    """A path the command will write -> Path; refused while parsing when empty or when
    `problem` names a reason."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if isinstance(value, Path):
            return value
        text = str(value)
        problem = "an empty path" if not text.strip() else self.problem(text, Path(text))
        if problem:
            self.fail(problem, param, ctx)
        return Path(text)

    def problem(self, text: str, path: Path) -> str | None:
        raise NotImplementedError


class OutputFile(_OutputPath):
    """A file to write: not a directory, in a directory that exists and is writable."""

    name = "file"

    def problem(self, text: str, path: Path) -> str | None:
        directory = path.parent
        if text.endswith(os.sep) or path.is_dir():
            return f"{text!r} is a directory; give a file name"
        if path.exists() and not path.is_file():
            return f"{text!r} exists and is not a regular file"
        if not directory.is_dir():
            return f"{text!r}: directory {str(directory)!r} does not exist"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{text!r}: directory {str(directory)!r} is not writable"
        if len(os.fsencode(path.name)) > atomic.name_limit(directory):
            return f"{text!r}: the file name is too long"
        return None


class OutputDirectory(_OutputPath):
    """A directory to write into (created when missing): not something else."""

    name = "directory"

    def problem(self, text: str, path: Path) -> str | None:
        return f"{text!r} exists and is not a directory" if path.exists() and not path.is_dir() else None


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Write `path` all or nothing: yields a binary file beside it (`kdtr_format.atomic`: mode
    0666 less the umask, a name within NAME_MAX, symbolic links written through); on success it
    is fsynced and renamed onto `path`, on any exception removed. An OSError names `path`,
    never the temporary file."""
    path = Path(path)
    fd, tmp = atomic.create_beside(str(path))
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        atomic.rename_over(tmp, str(path))
    except BaseException as exc:
        atomic.remove(tmp)
        if isinstance(exc, OSError):
            raise OSError(exc.errno or errno.EIO, exc.strerror or str(exc), str(path)) from None
        raise
    _fsync_directory(os.path.dirname(atomic.target_of(str(path))))


# ---------------------------------------------------------------------------- numbers

class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# ---------------------------------------------------------------------------- output

def shown(text: Any) -> str:
    """`text` as printed: itself when every character is printable, else its Python string
    literal (`'t\\x1b]0;...'`), in which control characters, bidi overrides and lone
    surrogates are escapes a terminal shows and does not act on."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def console(stderr: bool = False) -> Console:
    """A console as wide as its terminal; on a pipe or file PIPED_WIDTH wide and soft-wrapped,
    so that no line is broken. No highlighting: numbers and paths are shown as they are."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return Console(stderr=stderr, highlight=False)
    return Console(stderr=stderr, highlight=False, width=PIPED_WIDTH, soft_wrap=True)


class _Table(Table):
    """A rich Table whose text cells are shown verbatim, through `shown` (never as markup)."""

    def add_row(self, *cells: Any, **options: Any) -> None:
        super().add_row(*(Text(shown(c)) if isinstance(c, str) else c for c in cells), **options)


def table(*columns: str, title: str | None = None, right: Sequence[str] = ()) -> Table:
    """A compact table whose cells fold rather than end in "..."; `right`: right-justified
    columns. The title and text cells are shown verbatim, through `shown` (they may hold a
    file's names or a user's path); a rich Text cell is shown as it is."""
    result = _Table(title=None if title is None else Text(shown(title)), title_justify="left", highlight=False,
                    box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for column in columns:
        result.add_column(column, overflow="fold", justify="right" if column in right else "left")
    return result


def records(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    """Named records, one a row: the name, then its text wrapped beside it at any width
    (for rows too long for table columns). Both shown verbatim, through `shown`."""
    grid = _Table.grid(padding=(0, 2))
    grid.title, grid.title_justify = Text(shown(title), style="italic"), "left"
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for name, text in rows:
        grid.add_row(name, text)
    return grid
