"""The tensors a fixture takes from a checkpoint instead of storing them, and how to rebuild them.

A fixture made from a checkpoint (``refgen generate --checkpoint``) does not copy the checkpoint's
weights: its metadata's ``checkpoint_tensors`` maps every tensor it leaves out of the file to its
dtype, shape, the checkpoint tensors it is made of and how to decode them, and `CheckpointTensors`
rebuilds one when asked. The schema is data, so it lives with the format: refgen writes it (and
computes its references on the weights decoded from it), the engine loads with it, and neither
imports the other (docs/fixtures.md, "Checkpoint tensors"). Its vocabulary is the one of the
``seeded_tensors`` a slim fixture omits (name -> dtype, shape, sha256), with another source.

    checkpoint_tensors: {"<tensor name>": {"dtype": "float32", "shape": [...], "decode": ..., ...}}

    decode: "plain" | "fp8" | "int4"    from checkpoint tensors, in the checkpoint directory the
                                        metadata's ``checkpoint.path`` names (kdtr_format.dequant; the
                                        formulas are docs/checkpoints.md's): plain widened exactly,
                                        FP8 times its block scales, packed INT4
    block: [b0, b1]                     fp8: the elements one scale covers
    group_size: g                       int4: the elements one scale covers
    rows: [start, stop]                 only for a fused gate_up's half: those rows of the decoded
                                        part (an FP8 part's scale rows cut to match)
    tensors: {role: ref}                the one part, or
    experts: [{role: ref}, ...]         one part per slot, stacked along a new axis 0
    roles: "data" (plain, fp8), "scale_inv" or "scale" (fp8), "packed" and "scale" (int4)
    ref: {"file": checkpoint-relative file, "tensor": its safetensors name, "dtype": safetensors
          code ("F8_E4M3", "BF16", ...), "shape": [...] (the bytes referenced),
          "ranges": [[begin, end], ...] absolute byte offsets in the file, concatenated along
          axis 0 (the kept experts of a fused tensor or a router), "sha256": hex of those bytes}

    decode: "bf16", of: "<tensor name>" another checkpoint tensor of the fixture, one decoded from the
                                        checkpoint (not itself a rounding), rounded to bfloat16, to
                                        nearest, ties to even (ml_dtypes), as a bf16 engine holds it

Shapes are lists of integers >= 0; a stack is allocated only once its first part has decoded to the
entry's part shape, so an entry's word alone never sizes an allocation.

Every referenced byte range is hashed the first time `CheckpointTensors` reads it and compared
with its ``sha256``, so a checkpoint that moved or whose bytes changed is a `CheckpointTensorError`
naming the tensor and the path, never a wrong weight. That costs one sha256 pass over the
referenced bytes per `CheckpointTensors` (docs/scale_up_k2.md has the figure at K2's dims).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .dequant import QuantError, fp8_scaled, int4_packed
from .errors import KdtrError

KEY = "checkpoint_tensors"          # the metadata key
BF16 = np.dtype(ml_dtypes.bfloat16)
DECODES = ("plain", "fp8", "int4")      # from the checkpoint; and "bf16", of another tensor
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": BF16, "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}

Read = Callable[[str, Mapping[str, Any]], np.ndarray]      # (tensor name, ref) -> the referenced array


class CheckpointTensorError(KdtrError, ValueError):
    """A fixture's checkpoint tensor that cannot be rebuilt: its source is missing, changed or malformed."""


def decode_checkpoint(name: str, entry: Mapping[str, Any], read: Read, dtype: np.dtype | None = np.float32
                      ) -> np.ndarray:
    """An entry's tensor [entry shape] from its checkpoint parts, `read(name, ref)` giving each
    referenced array; in `dtype`, or with None a single plain part as stored (a view of `read`'s
    array: refgen keeps bf16 weights memory-mapped). CheckpointTensorError naming `name` for an
    entry that does not decode to its shape."""
    how, shape = entry.get("decode"), checked_shape(name, "its entry", entry.get("shape", ()))
    if how not in DECODES:
        raise CheckpointTensorError(f"{name}: decode {how!r} is not one of {', '.join(DECODES)}, bf16")
    stacked = "experts" in entry
    parts = entry["experts"] if stacked else [entry.get("tensors")]
    if not isinstance(parts, list) or not parts or not all(isinstance(p, Mapping) for p in parts) or \
            (stacked and (not shape or len(parts) != shape[0])):
        raise CheckpointTensorError(f"{name}: expected 'tensors' (one part) or 'experts' (one part per slot of "
                                    f"its shape {list(shape)})")
    part_shape = shape[1:] if stacked else shape
    out = None      # the stack, allocated once a part has decoded to its shape (never from the entry's word alone)
    for slot, part in enumerate(parts):
        arrays = {role: read(name, ref) for role, ref in part.items()}
        try:
            value = _decode_part(how, arrays, part_shape, entry, np.float32 if stacked else dtype)
        except QuantError as exc:
            raise CheckpointTensorError(f"{name}: {exc}") from None
        except (KeyError, TypeError, ValueError, ArithmeticError, IndexError) as exc:
            raise CheckpointTensorError(f"{name}: its {how} part {slot} does not decode "
                                        f"({type(exc).__name__}: {exc})") from None
        if value.shape != part_shape:
            raise CheckpointTensorError(f"{name}: part {slot} decodes to shape {list(value.shape)}, the entry "
                                        f"says {list(part_shape)}")
        if not stacked:
            return value
        if out is None:
            out = np.empty(shape, np.float32)
        out[slot] = value
    return out


def checked_shape(name: str, what: str, shape: Any) -> tuple[int, ...]:
    """`shape` as a tuple when it is a list of integers >= 0; else CheckpointTensorError naming `name`."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                       for n in shape):
        raise CheckpointTensorError(f"{name}: {what} has shape {shape!r}, not a list of integers >= 0")
    return tuple(shape)


def _decode_part(how: str, arrays: Mapping[str, np.ndarray], shape: tuple[int, ...], entry: Mapping[str, Any],
                 dtype: np.dtype | None) -> np.ndarray:
    """One part: arrays by role -> [shape] (docs/checkpoints.md's formulas)."""
    if how == "int4":
        return int4_packed(arrays["packed"], arrays["scale"], shape, int(entry["group_size"]), dtype or np.float32)
    data, rows = arrays["data"], entry.get("rows")
    if rows is not None:
        data = data[..., rows[0]:rows[1], :]
    if how == "plain":
        return data if dtype is None else np.asarray(data, dtype=dtype)
    b0, b1 = entry["block"]
    scale = arrays["scale_inv"] if "scale_inv" in arrays else arrays["scale"]
    if rows is not None:            # a fused gate_up: gate's row blocks, then up's
        first = math.ceil(rows[0] / b0)
        scale = scale[..., first:first + math.ceil((rows[1] - rows[0]) / b0), :]
    grid = (*data.shape[:-2], math.ceil(data.shape[-2] / b0), math.ceil(data.shape[-1] / b1))
    return fp8_scaled(data, scale.reshape(grid), (b0, b1), dtype or np.float32)


@dataclass(frozen=True)
class _Ref:
    """A checkpoint reference, read: file, tensor, dtype, shape, byte ranges, sha256."""

    file: str
    tensor: str
    dtype: np.dtype
    shape: tuple[int, ...]
    ranges: list[tuple[int, int]]
    sha256: str

    @classmethod
    def of(cls, name: str, ref: Mapping[str, Any]) -> "_Ref":
        try:
            file, tensor, code = str(ref["file"]), str(ref["tensor"]), str(ref["dtype"])
            shape, sha256 = ref["shape"], str(ref["sha256"])
            ranges = [(int(b), int(e)) for b, e in ref["ranges"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointTensorError(f"{name}: a malformed checkpoint reference ({type(exc).__name__}: "
                                        f"{exc})") from None
        if Path(file).name != file:
            raise CheckpointTensorError(f"{name}: checkpoint file {file!r} is not a file name in the checkpoint "
                                        "directory")
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointTensorError(f"{name}: {tensor} has dtype {code!r}, not a safetensors dtype kdtree reads")
        return cls(file, tensor, SAFETENSORS_DTYPES[code], checked_shape(name, tensor, shape), ranges, sha256)


class CheckpointTensors:
    """The checkpoint tensors of one fixture (its metadata), rebuilt on demand. checkpoint: the
    checkpoint directory (default: the metadata's ``checkpoint.path``). Files are read through
    memory maps; each referenced range is verified against its sha256 on first read."""

    def __init__(self, metadata: Mapping[str, Any], checkpoint: str | Path | None = None) -> None:
        entries = metadata.get(KEY) or {}
        if not isinstance(entries, Mapping):
            raise CheckpointTensorError(f"metadata.{KEY}: expected an object of tensor name -> entry")
        self.entries: dict[str, Mapping[str, Any]] = dict(entries)
        origin = metadata.get("checkpoint")
        default = origin.get("path") if isinstance(origin, Mapping) else None
        self.checkpoint = Path(checkpoint) if checkpoint is not None else Path(default) if default else None
        self._maps: dict[str, np.memmap] = {}
        self._verified: set[tuple[str, str]] = set()

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def names(self, prefix: str | None = None) -> list[str]:
        return sorted(n for n in self.entries if prefix is None or n.startswith(prefix))

    def array(self, name: str, as_stored: bool = False) -> np.ndarray:
        """Tensor `name` rebuilt, in its entry's dtype; with `as_stored`, a single plain part as the
        checkpoint stores it (a view of the memory-mapped file: refgen keeps bf16 weights so)."""
        entry = self.entries[name]
        if not isinstance(entry, Mapping):
            raise CheckpointTensorError(f"{name}: its {KEY} entry is not an object")
        if entry.get("decode") == "bf16":
            of = entry.get("of")
            if not isinstance(of, str) or of not in self.entries or of == name:
                raise CheckpointTensorError(f"{name}: rounds {of!r}, which is not another checkpoint tensor of "
                                            "this fixture")
            if not isinstance(self.entries[of], Mapping) or self.entries[of].get("decode") not in DECODES:
                raise CheckpointTensorError(f"{name}: rounds {of!r}, which is not decoded from the checkpoint "
                                            f"(decode one of {', '.join(DECODES)}); a rounding rounds such a tensor")
            value = self.array(of, as_stored=True)
            return value if value.dtype == BF16 else np.asarray(value, np.float32).astype(BF16)
        keep = as_stored and entry.get("decode") == "plain" and "experts" not in entry
        return decode_checkpoint(name, entry, self._read, None if keep else np.dtype(entry.get("dtype", "float32")))

    def _read(self, name: str, entry_ref: Mapping[str, Any]) -> np.ndarray:
        """The array a reference names (of tensor `name`), verified once against its sha256."""
        ref = _Ref.of(name, entry_ref)
        mapped, path = self._map(name, ref), self.checkpoint / ref.file
        if any(not 0 <= b <= e <= mapped.size for b, e in ref.ranges):
            raise CheckpointTensorError(f"{name}: {ref.tensor} in {path}: the referenced bytes {ref.ranges} do not "
                                        f"fit the file ({mapped.size} bytes); the checkpoint changed")
        held, needed = sum(e - b for b, e in ref.ranges), math.prod(ref.shape) * ref.dtype.itemsize
        if held != needed:
            raise CheckpointTensorError(f"{name}: {ref.tensor} in {path}: the referenced bytes {ref.ranges} hold "
                                        f"{held} bytes, its shape {list(ref.shape)} of {ref.dtype} needs {needed}; "
                                        "the fixture's reference is malformed")
        pieces = [mapped[b:e] for b, e in ref.ranges]
        if (ref.file, ref.tensor) not in self._verified:
            sha = hashlib.sha256()
            for piece in pieces:
                sha.update(piece)
            if sha.hexdigest() != ref.sha256:
                raise CheckpointTensorError(f"{name}: {ref.tensor} in {path} has changed since the fixture was made "
                                            f"(sha256 {sha.hexdigest()[:16]}..., the fixture recorded "
                                            f"{ref.sha256[:16]}...); regenerate the fixture")
            self._verified.add((ref.file, ref.tensor))
        raw = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return raw.view(ref.dtype).reshape(ref.shape)

    def _map(self, name: str, ref: _Ref) -> np.memmap:
        """The memory map of the reference's file (opened once)."""
        if self.checkpoint is None:
            raise CheckpointTensorError(f"{name}: references checkpoint tensor {ref.tensor}, but "
                                        "metadata.checkpoint.path is missing")
        if ref.file not in self._maps:
            path = self.checkpoint / ref.file
            if not path.is_file():
                raise CheckpointTensorError(f"{name}: references {ref.tensor} in {path}, which does not exist (the "
                                            "fixture holds no copy of the checkpoint's weights: keep the checkpoint "
                                            "where it was made, or regenerate the fixture)")
            if path.stat().st_size == 0:        # numpy cannot map an empty file
                raise CheckpointTensorError(f"{name}: references {ref.tensor} in {path}, which is empty (0 bytes); "
                                            "the checkpoint changed")
            try:
                self._maps[ref.file] = np.memmap(path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as exc:
                raise CheckpointTensorError(f"{name}: references {ref.tensor} in {path}, which cannot be read "
                                            f"({type(exc).__name__}: {exc})") from None
        return self._maps[ref.file]


def names(reader: Any, prefix: str | None = None) -> list[str]:
    """A fixture's tensor names, stored and taken from the checkpoint, with `prefix`, in name order."""
    found = set(reader.names(prefix)) | set(CheckpointTensors(reader.metadata).names(prefix))
    return sorted(found, key=lambda n: n.encode("utf-8"))
