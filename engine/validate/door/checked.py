"""The checking proxy: every adapter call is held to its declaration (protocol.METHODS)
before any comparison sees the result.

`CheckedAdapter(adapter)` forwards every attribute; a protocol method comes back
wrapped. The wrapper calls the adapter through the door (guard.py: whatever ends
the call but a return, an exit or a GeneratorExit included, is an `AdapterFault`
naming the method) and turns an output of the wrong arity, dtype class, shape or
finiteness into an `AdapterFault` naming the method and the output; what it
returns is normalized (numpy arrays, Python ints for scalars) and the runner's own
copy, so comparisons never zip away a missing item, compare a float array as if it
held token ids, or read a buffer the adapter has since overwritten. `intermediates`
and `deviations` pass the door unchecked. The checks catch the fault with
`fault_into`, which turns it into one FAIL row of the check it interrupted (and
tells the door which row is calling).

`CheckedV2` does the same for a protocol 2 adapter (protocol_v2.METHODS_V2): torch
tensors on the adapter's device (each cloned: the runner's own), ragged offsets that
index the outputs they come with, and, while `timing` is on, each call's own time,
CUDA-synchronized.
`checked_views` gives the runner both views of one adapter.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np
import torch

from ..reports.report import Check
from . import guard
from .guard import AdapterFault, describe
from .protocol import METHODS, Method, Output, protocol_version
from .protocol_v2 import METHODS_V2, Offsets, PerRequest, adapter_device

UNCHECKED = ("intermediates", "deviations")     # optional methods: through the door, outputs unchecked
_ABSENT = object()


class fault_into:
    """Run a block of adapter calls for one row; a fault ends the block and becomes a FAIL row in
    `rows` (`.fault` holds it afterwards; None when the block ran to its end)."""

    def __init__(self, rows: list[Check], section: str, name: str, where: str = "") -> None:
        self.rows, self.section, self.name, self.where = rows, section, name, where
        self.fault: AdapterFault | None = None
        self._row = guard.in_row(section, name, where)

    def __enter__(self) -> "fault_into":
        self._row.__enter__()
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        self._row.__exit__(None, None, None)
        if isinstance(exc, AdapterFault):
            self.fault = exc
            self.rows.append(exc.check(self.section, self.name, where=self.where))
            return True
        return False


class CheckedAdapter:
    """The adapter with every protocol method checked (module docstring). door: the adapter is
    the user's, called through the door; False for kdtree's own PerRequest over a checked v2
    adapter, whose calls pass the door there."""

    methods = METHODS

    def __init__(self, adapter: Any, door: bool = True) -> None:
        self.adapter = adapter
        self.door = door
        self.vocab_size: int | None = None          # from load_weights' config: forward's V

    def __getattr__(self, name: str) -> Any:
        if name in ("adapter", "door"):
            raise AttributeError(name)
        value = guard.attribute(self.adapter, name, _ABSENT)
        if value is _ABSENT:
            raise AttributeError(name)
        if name in self.methods and callable(value):
            return functools.partial(self._call, name, value)
        if name in UNCHECKED and callable(value) and self.door:
            return functools.partial(guard.call, name, value)
        return value

    def _call(self, name: str, method: Any, *args: Any) -> Any:
        result = guard.call(name, self._invoke, method, args) if self.door else self._invoke(method, args)
        spec = self.methods[name]
        if name == "load_weights":
            self.vocab_size = int(args[0].vocab_size)
        dims = spec.dims(*args)
        if name == "forward" and self.vocab_size is not None:
            dims["V"] = self.vocab_size
        return _conform(name, spec, result, dims, self._check)

    def _invoke(self, method: Any, args: tuple) -> Any:
        return method(*args)

    def _check(self, method: str, out: Output, value: Any, dims: dict[str, int]) -> Any:
        return _output(method, out, value, dims)


def _conform(method: str, spec: Method, result: Any, dims: dict[str, int], check: Callable[..., Any]) -> Any:
    """The result's arity held to the declaration, then each output to `check(method, output, value, dims)`."""
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
    checked = [check(method, out, value, dims) for out, value in zip(outputs, values)]
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
    """One v1 output checked against its declaration (binding free dims into `dims`), normalized."""
    what = f"output {out.name}"
    try:
        array = np.array(value)                     # a copy: the adapter may reuse its buffer
    except Exception as exc:
        raise AdapterFault(method, f"{what} cannot be read as a numpy array ({describe(exc)})") from None
    if not _dtype_ok(out.kind, array.dtype):
        raise AdapterFault(method, f"{what} has dtype {array.dtype}, expected {_KINDS[out.kind]}")
    _check_shape(method, out, tuple(array.shape), dims)
    if array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16:
        wide = array.astype(np.float64)
        _check_finite(method, out, int(np.isnan(wide).sum()), int(np.isinf(wide).sum()))
    return int(array) if not out.shape else array


def _check_shape(method: str, out: Output, shape: tuple[int, ...], dims: dict[str, int]) -> None:
    """The output's shape against its declared dims, binding the free ones into `dims`."""
    expected = []
    for dim in out.shape:
        if isinstance(dim, str) and dim not in dims and len(shape) == len(out.shape):
            dims[dim] = shape[len(expected)]
        expected.append(dims.get(dim, dim) if isinstance(dim, str) else dim)
    if list(shape) != expected:
        named = ", ".join(f"{d} = {dims[d]}" for d in out.shape if isinstance(d, str) and d in dims)
        raise AdapterFault(method, f"output {out.name} has shape {list(shape)}, expected "
                                   f"[{', '.join(map(str, expected))}]" + (f" ({named})" if named else ""))


def _check_finite(method: str, out: Output, nan: int, infinite: int) -> None:
    what = f"output {out.name}"
    if nan:
        raise AdapterFault(method, f"{what} holds {nan} NaN value{'s' * (nan != 1)}")
    if out.finite and infinite:
        raise AdapterFault(method, f"{what} holds {infinite} infinite value{'s' * (infinite != 1)}")


# ---- protocol v2 ----

class CheckedV2(CheckedAdapter):
    """A protocol 2 adapter with every method held to its declaration (protocol_v2.METHODS_V2):
    outputs must be torch tensors on the adapter's device, of the declared dtype class and
    shape, ragged offsets consistent with the outputs they index, no NaN (nor infinity where
    declared finite). While `timing` is on, each call's own time is measured."""

    methods = METHODS_V2

    def __init__(self, adapter: Any) -> None:
        super().__init__(adapter)
        self.device = adapter_device(adapter)
        self._timing: tuple[dict[str, float], str] | None = None

    @contextmanager
    def timing(self, seconds: dict[str, float], stage: str) -> Iterator[None]:
        """While on, each method call adds its seconds to seconds[stage]: wall time between a
        synchronize of the adapter's CUDA device before the call and one after (on the CPU,
        the wall time of the call). The output checks run after the clock stops."""
        self._timing = (seconds, stage)
        try:
            yield
        finally:
            self._timing = None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _invoke(self, method: Any, args: tuple) -> Any:
        if self._timing is None:
            return method(*args)
        seconds, stage = self._timing
        self._synchronize()
        began = time.perf_counter()
        result = method(*args)
        self._synchronize()
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - began
        return result

    def _check(self, method: str, out: Output, value: Any, dims: dict[str, int]) -> torch.Tensor:
        """One output held to its declaration (binding free dims into `dims`)."""
        what = f"output {out.name}"
        if not isinstance(value, torch.Tensor):
            raise AdapterFault(method, f"{what} is a {type(value).__module__}.{type(value).__name__}, expected a "
                                       f"torch.Tensor on {self.device}")
        if value.device != self.device:
            raise AdapterFault(method, f"{what} is on {value.device}, expected the adapter's device {self.device}")
        if not _torch_dtype_ok(out.kind, value.dtype):
            raise AdapterFault(method, f"{what} has dtype {value.dtype}, expected {_KINDS[out.kind]}")
        _check_shape(method, out, tuple(value.shape), dims)
        if isinstance(out, Offsets):
            _check_offsets(method, out, value.tolist(), dims)
        if value.is_floating_point():
            _check_finite(method, out, int(value.isnan().sum()), int(value.isinf().sum()))
        return value.clone()                        # the runner's own: the adapter may reuse its buffer


def _torch_dtype_ok(kind: str, dtype: torch.dtype) -> bool:
    if kind == "int":
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    if kind == "float":
        return dtype.is_floating_point
    if kind == "words":
        return dtype in (torch.int32, torch.uint32)
    return dtype == getattr(torch, kind)


def _check_offsets(method: str, out: Offsets, offsets: list[int], dims: dict[str, int]) -> None:
    """Ragged offsets: from 0, non-decreasing, ending at the length of the rows they index."""
    what = f"output {out.name}"
    if offsets[0] != 0:
        raise AdapterFault(method, f"{what} starts at {offsets[0]}, expected 0")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise AdapterFault(method, f"{what} decreases at request {b} ({offsets[b]}, then {offsets[b + 1]})")
    if out.total in dims and offsets[-1] != dims[out.total]:
        raise AdapterFault(method, f"{what} ends at {offsets[-1]}, expected {out.total} = {dims[out.total]} "
                                   f"(the rows of the outputs it indexes)")
    dims[out.total] = offsets[-1]


def checked_views(adapter: Any) -> tuple[CheckedAdapter, CheckedV2 | None]:
    """-> (the adapter as the per-request checks call it: v1, checked; the adapter as the
    batched checks call it: v2, checked, or None for a v1 adapter). A v2 adapter's per-request
    view is `PerRequest` over its checked v2 view, so each call is checked at both boundaries."""
    if protocol_version(adapter) == 1:
        return CheckedAdapter(adapter), None
    batched = CheckedV2(adapter)
    return CheckedAdapter(PerRequest(batched), door=False), batched
