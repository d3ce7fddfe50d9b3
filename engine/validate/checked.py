"""The checking proxy: every adapter call is held to its declaration (protocol.METHODS)
before any comparison sees the result.

`CheckedAdapter(adapter)` forwards every attribute; a protocol method comes back
wrapped. The wrapper turns an exception raised by the adapter, and an output of
the wrong arity, dtype class, shape or finiteness, into an `AdapterFault` naming
the method and the output; what it returns is normalized (numpy arrays, Python
ints for scalars), so comparisons never zip away a missing item or compare a
float array as if it held token ids. The checks catch the fault with
`fault_into`, which turns it into one FAIL row of the check it interrupted.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from .protocol import METHODS, Method, Output
from .report import Check, Status


class AdapterFault(Exception):
    """An adapter method raised (`raised` True), or returned what the protocol forbids."""

    def __init__(self, method: str, problem: str, raised: bool = False) -> None:
        self.method, self.problem, self.raised = method, problem, raised
        super().__init__(f"{method}() {problem}")

    def check(self, section: str, name: str, needs: Sequence[str] = (), where: str = "") -> Check:
        """The FAIL row of the check this fault interrupted."""
        at = f" ({where})" if where else ""
        return Check(section, name, Status.FAIL, detail=f"{self}{at}", needs=tuple(needs))


class fault_into:
    """Run a block of adapter calls; a fault ends the block and becomes a FAIL row in `rows`
    (`.fault` holds it afterwards; None when the block ran to its end)."""

    def __init__(self, rows: list[Check], section: str, name: str, where: str = "") -> None:
        self.rows, self.section, self.name, self.where = rows, section, name, where
        self.fault: AdapterFault | None = None

    def __enter__(self) -> "fault_into":
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, AdapterFault):
            self.fault = exc
            self.rows.append(exc.check(self.section, self.name, where=self.where))
            return True
        return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CheckedAdapter:
    """The adapter with every protocol method checked (module docstring)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.vocab_size: int | None = None          # from load_weights' config: forward's V

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.adapter, name)
        if name in METHODS and callable(value):
            return functools.partial(self._call, name, value)
        return value

    def _call(self, name: str, method: Any, *args: Any) -> Any:
        try:
            result = method(*args)
        except Exception as exc:
            raise AdapterFault(name, f"raised {_one_line(exc)}", raised=True) from exc
        spec = METHODS[name]
        if name == "load_weights":
            self.vocab_size = int(args[0].vocab_size)
        dims = spec.dims(*args)
        if name == "forward" and self.vocab_size is not None:
            dims["V"] = self.vocab_size
        return _conform(name, spec, result, dims)


def _conform(method: str, spec: Method, result: Any, dims: dict[str, int]) -> Any:
    outputs = spec.outputs
    if not outputs:
        return result
    names = ", ".join(o.name for o in outputs[:len(outputs) - spec.optional])
    if spec.optional:
        names += "".join(f"[, {o.name}]" for o in outputs[len(outputs) - spec.optional:])
    if len(outputs) == 1:
        if isinstance(result, tuple):
            raise AdapterFault(method, f"returned a tuple of {len(result)}, expected one array ({names})")
        values = [result]
    else:
        if not isinstance(result, (tuple, list)):
            raise AdapterFault(method, f"returned {type(result).__name__}, expected a tuple ({names})")
        fewest = len(outputs) - spec.optional
        if not fewest <= len(result) <= len(outputs):
            expected = f"{fewest}" if not spec.optional else f"{fewest} or {len(outputs)}"
            raise AdapterFault(method, f"returned {len(result)} output{'s' * (len(result) != 1)}, "
                                       f"expected {expected} ({names})")
        values = list(result)
    checked = [_output(method, out, value, dims) for out, value in zip(outputs, values)]
    return checked[0] if len(outputs) == 1 else tuple(checked)


_KINDS = {"int": "an integer dtype", "float": "a floating dtype", "float32": "float32", "float64": "float64",
          "words": "uint32 or int32 words"}


def _dtype_ok(kind: str, dtype: np.dtype) -> bool:
    if kind == "int":
        return dtype.kind in "iu"
    if kind == "float":
        return dtype.kind == "f" or dtype == ml_dtypes.bfloat16
    if kind == "words":
        return dtype in (np.dtype(np.uint32), np.dtype(np.int32))
    return dtype == np.dtype(kind)


def _output(method: str, out: Output, value: Any, dims: dict[str, int]) -> Any:
    """One output checked against its declaration (binding free dims into `dims`), normalized."""
    what = f"output {out.name}"
    try:
        array = np.asarray(value)
    except Exception as exc:
        raise AdapterFault(method, f"{what} cannot be read as a numpy array ({_one_line(exc)})") from None
    if not _dtype_ok(out.kind, array.dtype):
        raise AdapterFault(method, f"{what} has dtype {array.dtype}, expected {_KINDS[out.kind]}")
    expected = []
    for dim in out.shape:
        if isinstance(dim, str) and dim not in dims and array.ndim == len(out.shape):
            dims[dim] = array.shape[len(expected)]
        expected.append(dims.get(dim, dim) if isinstance(dim, str) else dim)
    if list(array.shape) != expected:
        named = ", ".join(f"{d} = {dims[d]}" for d in out.shape if isinstance(d, str) and d in dims)
        raise AdapterFault(method, f"{what} has shape {list(array.shape)}, expected "
                                   f"[{', '.join(map(str, expected))}]" + (f" ({named})" if named else ""))
    if array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16:
        wide = array.astype(np.float64)
        nan = int(np.isnan(wide).sum())
        if nan:
            raise AdapterFault(method, f"{what} holds {nan} NaN value{'s' * (nan != 1)}")
        infinite = int(np.isinf(wide).sum())
        if out.finite and infinite:
            raise AdapterFault(method, f"{what} holds {infinite} infinite value{'s' * (infinite != 1)}")
    return int(array) if not out.shape else array
