"""The door between kdtree and the adapter under test: kdtree enters the adapter's code (its
import, its factory, its methods, its attributes) only through here.

- `call(method, function, *args)`: what the method returns. Whatever else ends the call is the
  adapter's failure, an `AdapterFault` naming the method: any exception, and the ways out
  that are no Exception (SystemExit from sys.exit, GeneratorExit, a BaseException subclass of
  a binding's own). KeyboardInterrupt alone goes through: it is the user's Ctrl-C.
- `attribute(adapter, name, default)`: the adapter's attribute; reading one that raises
  anything but AttributeError (a property, a __getattr__) is a ValidateError naming it.
- `watching(watch)`: while on, `watch(label, row)` is told each time the adapter's code starts
  running (label "forward()", "importing x.py"; row: the report row in flight, `in_row`) and
  `watch(None, None)` when it is done. `kdtree validate` streams that to the parent process,
  which times each call and names the one in flight when the child dies (supervise.py).
- `describe(exc)`: an exception in one line, even when its own str() raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from ..reports.report import Check, Status, ValidateError

T = TypeVar("T")


@dataclass(frozen=True)
class Row:
    """The report row whose checks are calling the adapter: its section, its name, where in it."""

    section: str
    name: str
    where: str = ""


Watch = Callable[[str | None, Row | None], None]
_WATCH: ContextVar[Watch | None] = ContextVar("kdtree_watch", default=None)
_ROW: ContextVar[Row | None] = ContextVar("kdtree_row", default=None)


class AdapterFault(Exception):
    """An adapter method raised (`raised` True), or returned what the protocol forbids."""

    def __init__(self, method: str, problem: str, raised: bool = False) -> None:
        self.method, self.problem, self.raised = method, problem, raised
        super().__init__(f"{method}() {problem}")

    def check(self, section: str, name: str, needs: tuple[str, ...] = (), where: str = "") -> Check:
        """The FAIL row of the check this fault interrupted."""
        at = f" ({where})" if where else ""
        return Check(section, name, Status.FAIL, detail=f"{self}{at}", needs=tuple(needs))


def describe(exc: BaseException) -> str:
    """`Type: message` on one line (`Type` alone for an empty message; `Type (its str() raised
    ...)` when printing it raises)."""
    text, failure = _text(exc)
    if failure is not None:
        inner, _ = _text(failure)
        return f"{type(exc).__name__} (its str() raised {type(failure).__name__}{f': {inner}' if inner else ''})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _text(exc: BaseException) -> tuple[str, BaseException | None]:
    """-> (str(exc) on one line, None), or ("", what printing it raised)."""
    try:
        return " ".join(str(exc).split()), None
    except KeyboardInterrupt:
        raise
    except BaseException as failure:
        return "", failure


@contextmanager
def watching(watch: Watch) -> Iterator[None]:
    """Tell `watch` about the adapter's code from here to the end of the block (module docstring)."""
    token = _WATCH.set(watch)
    try:
        yield
    finally:
        _WATCH.reset(token)


@contextmanager
def in_row(section: str, name: str, where: str = "") -> Iterator[None]:
    """The adapter calls of this block are the checks of this row."""
    token = _ROW.set(Row(section, name, where))
    try:
        yield
    finally:
        _ROW.reset(token)


@contextmanager
def watched(label: str) -> Iterator[None]:
    """The block runs the adapter's code (`label` says which): the watcher, if any, is told when
    it starts and when it ends, but not when a Ctrl-C ends it: the run then stops inside it, and
    the report names it."""
    watch = _WATCH.get()
    if watch is None:
        yield
        return
    watch(label, _ROW.get())
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if not interrupted:
            watch(None, None)


def call(method: str, function: Callable[..., T], *args: Any) -> T:
    """function(*args) as the adapter's `method`; anything but a return or a Ctrl-C -> AdapterFault."""
    with watched(f"{method}()"):
        try:
            return function(*args)
        except (KeyboardInterrupt, AdapterFault):
            raise
        except BaseException as exc:
            raise AdapterFault(method, f"raised {describe(exc)}", raised=True) from exc


def attribute(adapter: Any, name: str, default: Any = None) -> Any:
    """getattr(adapter, name, default); ValidateError naming the attribute when reading it raises."""
    try:
        return getattr(adapter, name, default)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        who = type(adapter).__name__ if name == "name" else adapter_name(adapter)
        raise ValidateError(f"adapter {who}: reading its `{name}` raised {describe(exc)}") from None


def adapter_name(adapter: Any) -> str:
    """The adapter's `name` quoted, else its type's name."""
    name = attribute(adapter, "name")
    return repr(name) if isinstance(name, str) else type(adapter).__name__
