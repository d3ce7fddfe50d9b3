"""The weight formats DeepSeek-V3 / Kimi K2.x checkpoints ship, dequantized exactly.

Two formats besides plain bf16 / float16 / float32 (docs/checkpoints.md):

- FP8 block (DeepSeek-V3 / R1, Kimi K2; ``quant_method: fp8``): an e4m3fn weight
  q [..., rows, cols] and a float32 ``weight_scale_inv`` s [..., ceil(rows / b0), ceil(cols / b1)],
  (b0, b1) = ``weight_block_size``; the last block of a dimension may be partial:

      w[..., i, j] = float(q[..., i, j]) * s[..., i // b0, j // b1]

- compressed-tensors ``pack-quantized`` INT4 (Kimi K2 Thinking / K2.5 / K2.6 routed experts;
  ``quant_method: compressed-tensors``, symmetric, strategy ``group``): ``weight_packed`` int32
  [rows, ceil(cols / 8)], ``weight_scale`` [rows, ceil(cols / g)], ``weight_shape`` = (rows, cols):

      u = (packed[i, j // 8] >> 4 * (j % 8)) & 0xF        (element j of a row: nibble j % 8 of word j // 8,
      q = u - 8                                              the lowest nibble first; stored with offset 8)
      w[i, j] = q * scale[i, j // g]

Both products are exact in float64 (4 + 24 and 4 + 8 significant bits). `fp8_block`
and `int4_packed` compute them in float64 a slab of rows at a time, so temporaries
stay small, and return the result in `dtype`: float64 (exact), or float32 (what a
fixture stores: exact for INT4 with bf16 scales, rounded once for FP8 x float32).

`Quantization` is the checkpoint's ``quantization_config``, parsed: which method,
the FP8 block, and for compressed-tensors which modules are quantized (the config
groups' targets, minus ``ignore``) with which group size. Anything kdtree does not
model (another method, bit width, strategy, asymmetric weights, quantized
activations) is a `QuantError` naming the key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SLAB_ELEMENTS = 1 << 22            # rows dequantized at a time: about this many elements


class QuantError(ValueError):
    """A quantization_config or quantized tensor kdtree cannot dequantize."""


# ---------------------------------------------------------------------------- dequantization

def fp8_block(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
              dtype: np.dtype = np.float64) -> np.ndarray:
    """q [..., rows, cols] e4m3fn, scale_inv [..., ceil(rows/b0), ceil(cols/b1)] -> w [..., rows, cols]
    in `dtype`: w[..., i, j] = float(q[..., i, j]) * scale_inv[..., i // b0, j // b1], in float64."""
    b0, b1 = block
    if q.dtype != FP8:
        raise QuantError(f"weight dtype is {q.dtype}, expected float8_e4m3fn")
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(scale_inv.shape) != want:
        raise QuantError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} "
                         f"for a {list(q.shape)} weight in {b0}x{b1} blocks")
    out = np.empty(q.shape, dtype=dtype)
    step = b0 * max(1, SLAB_ELEMENTS // (b0 * cols * max(1, math.prod(q.shape[:-2]))))
    for r in range(0, rows, step):
        scale = np.repeat(np.asarray(scale_inv[..., r // b0:(r + step + b0 - 1) // b0, :], np.float64),
                          b0, axis=-2)
        scale = np.repeat(scale, b1, axis=-1)[..., :min(step, rows - r), :cols]
        out[..., r:r + step, :] = np.asarray(q[..., r:r + step, :], np.float64) * scale
    return _finite(out)


def int4_packed(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group_size: int,
                dtype: np.dtype = np.float64) -> np.ndarray:
    """packed int32 [rows, ceil(cols/8)], scale [rows, ceil(cols/g)], shape (rows, cols) -> w [rows, cols]
    in `dtype`: w[i, j] = (((packed[i, j // 8] >> 4 (j % 8)) & 0xF) - 8) * scale[i, j // g], in float64."""
    rows, cols = shape
    if packed.dtype != np.int32:
        raise QuantError(f"weight_packed dtype is {packed.dtype}, expected int32")
    if tuple(packed.shape) != (rows, math.ceil(cols / 8)):
        raise QuantError(f"weight_packed has shape {list(packed.shape)}, expected {[rows, math.ceil(cols / 8)]} "
                         f"for weight_shape {[rows, cols]} (8 INT4 values an int32)")
    if tuple(scale.shape) != (rows, math.ceil(cols / group_size)):
        raise QuantError(f"weight_scale has shape {list(scale.shape)}, expected "
                         f"{[rows, math.ceil(cols / group_size)]} for weight_shape {[rows, cols]} in groups "
                         f"of {group_size}")
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    out = np.empty((rows, cols), dtype=dtype)
    step = max(1, SLAB_ELEMENTS // max(1, cols))
    for r in range(0, rows, step):
        words = np.asarray(packed[r:r + step]).view(np.uint32)
        q = ((words[..., None] >> shifts) & 0xF).reshape(len(words), -1)[:, :cols].astype(np.float64) - 8.0
        s = np.repeat(np.asarray(scale[r:r + step], np.float64), group_size, axis=-1)[:, :cols]
        out[r:r + step] = q * s
    return _finite(out)


def _finite(w: np.ndarray) -> np.ndarray:
    if not np.isfinite(w).all():
        bad = np.unravel_index(int(np.argmin(np.isfinite(w))), w.shape)
        raise QuantError(f"dequantizes to a non-finite value at {[int(i) for i in bad]}")
    return w


# ---------------------------------------------------------------------------- quantization_config

@dataclass(frozen=True)
class Int4Group:
    """One compressed-tensors config group: the modules it targets and its group size."""

    targets: tuple[str, ...]
    group_size: int


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization_config: method "none", "fp8" (with its block) or
    "pack-quantized" (INT4 groups and the ignore list)."""

    method: str
    block: tuple[int, int] | None = None
    groups: tuple[Int4Group, ...] = ()
    ignore: tuple[str, ...] = ()

    def int4_group_size(self, module: str, linear: bool) -> int | None:
        """The group size of `module` (a full checkpoint module name) if the config
        quantizes it, else None. As compressed-tensors matches: a target is a class
        name ("Linear") or a module name, exact or "re:<regex>" (re.match); `ignore`
        entries the same way."""
        if self.method != "pack-quantized" or any(_matches(module, linear, t) for t in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(module, linear, t) for t in group.targets):
                return group.group_size
        return None


def _matches(module: str, linear: bool, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (target == "Linear" and linear)


def parse_quantization(config: Mapping[str, Any] | None) -> Quantization:
    """quantization_config (or None) -> Quantization; QuantError naming what kdtree does not model."""
    if config is None:
        return Quantization("none")
    if not isinstance(config, Mapping):
        raise QuantError(f"quantization_config: expected an object, got {config!r}")
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise QuantError(f"quantization_config.fmt: only 'e4m3' is supported, got {config['fmt']!r}")
        block = config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantError(f"quantization_config.weight_block_size: expected two positive integers, got {block!r}")
        return Quantization("fp8", block=(block[0], block[1]))
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise QuantError(f"quantization_config.quant_method: {method!r} is not supported "
                     "(supported: 'fp8' with block scales, 'compressed-tensors' pack-quantized INT4)")


def _compressed_tensors(config: Mapping[str, Any]) -> Quantization:
    top_format = config.get("format")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantError("quantization_config.config_groups: missing or empty")
    parsed = []
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise QuantError(f"{where}: expected an object, got {group!r}")
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise QuantError(f"{where}.format: only 'pack-quantized' is supported, got {fmt!r}")
        for activations in ("input_activations", "output_activations"):
            if group.get(activations) is not None:
                raise QuantError(f"{where}.{activations}: quantized activations are not modelled "
                                 "(the reference runs weight-only quantized models)")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise QuantError(f"{where}.weights: expected an object, got {weights!r}")
        expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for key, value in expected.items():
            if weights.get(key) != value:
                raise QuantError(f"{where}.weights.{key}: only {value!r} is supported, got {weights.get(key)!r}")
        if weights.get("dynamic") not in (None, False):
            raise QuantError(f"{where}.weights.dynamic: only static weights are supported, "
                             f"got {weights['dynamic']!r}")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise QuantError(f"{where}.weights.group_size: expected a positive integer, got {size!r}")
        targets = group.get("targets")
        if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise QuantError(f"{where}.targets: expected a list of strings, got {targets!r}")
        parsed.append(Int4Group(tuple(targets), size))
    ignore = config.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(t, str) for t in ignore)):
        raise QuantError(f"quantization_config.ignore: expected a list of strings, got {ignore!r}")
    return Quantization("pack-quantized", groups=tuple(parsed), ignore=tuple(ignore))
