"""The tensors of a checkpoint directory's safetensors files, read lazily.

A directory holds either ``model.safetensors.index.json`` (its ``weight_map``
names the shard of every tensor) and the shards it names, or one
``model.safetensors``. Each file is opened with safetensors' own reader
(``safe_open(..., framework="np")``), which validates the header (JSON, dtypes,
offsets, no holes or overlaps) and lists names, dtypes and shapes. Tensor data
is then a read-only memory map of the file at the header's offsets, so a tensor
costs nothing until its pages are touched and a slice of one (a few experts of a
fused tensor) reads only those pages. (safetensors' numpy path cannot return
float8 tensors, safetensors issue #682; the memory map serves every dtype.)

A shard the index names but the directory lacks (a partial download: the shards of
the layers a slice reads) is no error here: its tensors are `absent` (name -> shard),
and whoever reads the checkpoint refuses only those it needs. Every other mismatch
between the index and the files is a `CheckpointError` naming the tensor or the file.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from kdtr_format.checkpoint_tensors import SAFETENSORS_DTYPES as DTYPES

from .fixtures import FixtureError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_JSON_DEPTH = 32


class CheckpointError(FixtureError):
    """A checkpoint directory kdtree cannot read as asked; the message names the tensor or file."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it (dtype is the safetensors code, e.g. "BF16")."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int            # absolute byte offsets of the data in the file
    end: int


class SafetensorsDir:
    """`tensors` (name -> StoredTensor) of a directory's safetensors files; `absent` (name -> shard
    file) the tensors the index puts in shards the directory lacks; `array(name)` reads one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.weight_map = _weight_map(directory)
        named = sorted(set(self.weight_map.values())) if self.weight_map is not None else [SINGLE]
        files = [file for file in named if (directory / file).is_file()]
        self.absent: dict[str, str] = {name: file for name, file in (self.weight_map or {}).items()
                                        if file not in files}
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            for tensor in _read_header(directory / file):
                if tensor.name in self.tensors:
                    raise CheckpointError(f"{tensor.name}: stored twice, in {self.tensors[tensor.name].file} "
                                          f"and {file}")
                self.tensors[tensor.name] = tensor
        if self.weight_map is not None:
            for name, file in self.weight_map.items():
                if name in self.absent and name in self.tensors:
                    raise CheckpointError(f"{name}: {INDEX} puts it in {file}, which is missing from {directory}, "
                                          f"but {self.tensors[name].file} holds it")
                if name not in self.absent and (name not in self.tensors or self.tensors[name].file != file):
                    raise CheckpointError(f"{name}: {INDEX} puts it in {file}, which does not hold it")
            unlisted = sorted(set(self.tensors) - set(self.weight_map))
            if unlisted:
                raise CheckpointError(f"{unlisted[0]}: in {self.tensors[unlisted[0]].file} but not in "
                                      f"{INDEX} ({len(unlisted)} such tensor(s))")
        self._maps: dict[str, np.memmap] = {}

    def array(self, name: str) -> np.ndarray:
        """The tensor's data: a read-only, zero-copy view of the file's memory map."""
        tensor = self.tensors[name]
        if tensor.file not in self._maps:
            self._maps[tensor.file] = np.memmap(self.directory / tensor.file, dtype=np.uint8, mode="r")
        raw = self._maps[tensor.file][tensor.begin:tensor.end]
        return raw.view(DTYPES[tensor.dtype]).reshape(tensor.shape)


def _weight_map(directory: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor -> shard file), None for a single model.safetensors."""
    index = directory / INDEX
    if not index.is_file():
        if not (directory / SINGLE).is_file():
            raise CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE} is there")
        return None
    data = read_json(index)
    if not isinstance(data, dict) or "weight_map" not in data:
        raise CheckpointError(f"{INDEX}: expected a JSON object with a weight_map")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{INDEX}: weight_map must map tensor names to file names")
    for file in set(weight_map.values()):
        if Path(file).name != file or not file.endswith(".safetensors"):
            raise CheckpointError(f"{INDEX}: {file!r} is not a .safetensors file name in the directory")
    return weight_map


def read_json(path: Path) -> object:
    """A JSON file of the checkpoint (config.json, the index); CheckpointError naming the file when it
    cannot be read, is not JSON, or nests deeper than MAX_JSON_DEPTH (config.json goes into the
    fixture's metadata, which is JSON too; real configs nest a few levels)."""
    def too_deep(how: str) -> CheckpointError:
        return CheckpointError(f"{path.name}: arrays or objects nested {how}; kdtree reads at most {MAX_JSON_DEPTH} "
                               "(a checkpoint's JSON nests a few)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise too_deep(f"deeper than Python's JSON reader goes (about {sys.getrecursionlimit()} levels)") from None
    except (OSError, ValueError) as exc:       # ValueError: not JSON, not UTF-8, an integer of over 4300 digits
        raise CheckpointError(f"{path.name}: cannot read it ({type(exc).__name__}: {exc})") from None
    depth = _depth(data)
    if depth > MAX_JSON_DEPTH:
        raise too_deep(f"{depth} levels deep")
    return data


def _depth(data: object) -> int:
    """How deep arrays and objects nest in a JSON value (0 for a scalar), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in children]
    return deepest


def _read_header(path: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, validated by safetensors' reader; unknown dtypes refused."""
    try:
        with safe_open(path, framework="np") as f:
            specs = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                     for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path.name}: not a readable safetensors file ({exc})") from None
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    tensors = []
    for name, (dtype, shape) in specs.items():
        if dtype not in DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} (in {path.name}) is not one kdtree reads "
                                  f"({', '.join(DTYPES)})")
        begin, end = header[name]["data_offsets"]
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{name}: {end - begin} bytes in {path.name} for shape {list(shape)} {dtype}")
        tensors.append(StoredTensor(name, path.name, dtype, shape, start + begin, start + end))
    return tensors
