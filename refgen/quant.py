"""A checkpoint's ``quantization_config``, parsed: which formats it stores its weights in.

`Quantization` says which method (``fp8`` with its block, ``compressed-tensors``), and for
compressed-tensors which modules are quantized (the config groups' targets, minus ``ignore``)
and how (`WeightScheme`: ``pack-quantized`` INT4, ``float-quantized`` FP8 with a strategy).
Anything kdtree does not model (another method, format, bit width or strategy, asymmetric
weights, activations quantized with stored scales, a quantized KV cache) is a `QuantError`
naming the key. Decoding the formats (FP8 blocks, packed INT4) is kdtr_format.dequant's, shared
with the engine; the formulas are docs/checkpoints.md's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from kdtr_format.dequant import QuantError

FORMATS = {"pack-quantized": "INT4", "float-quantized": "FP8"}      # compressed-tensors formats read
FP8_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class WeightScheme:
    """One compressed-tensors config group: the modules it targets and how their weights are
    stored: `format` "pack-quantized" (INT4, strategy "group") or "float-quantized" (FP8,
    strategy "tensor", "channel", "group" or "block")."""

    targets: tuple[str, ...]
    format: str
    strategy: str
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None

    def block(self, rows: int, cols: int) -> tuple[int, int]:
        """The (b0, b1) elements of a [rows, cols] weight that one scale covers."""
        return {"tensor": (rows, cols), "channel": (1, cols), "group": (1, self.group_size),
                "block": self.block_structure}[self.strategy]

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The shape compressed-tensors stores a [rows, cols] weight's ``weight_scale`` in."""
        if self.strategy == "tensor":
            return (1,)
        b0, b1 = self.block(rows, cols)
        return (math.ceil(rows / b0), math.ceil(cols / b1))


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization_config: method "none", "fp8" (with its block) or
    "compressed-tensors" (its weight schemes and the ignore list); `format` is what a
    fixture's metadata records ("none", "fp8", or compressed-tensors' format)."""

    method: str
    format: str
    block: tuple[int, int] | None = None
    schemes: tuple[WeightScheme, ...] = ()
    ignore: tuple[str, ...] = ()

    def scheme(self, module: str, linear: bool) -> WeightScheme | None:
        """How compressed-tensors stores `module` (a full checkpoint module name), None when the
        config does not quantize it. As compressed-tensors matches: a target is a class name
        ("Linear") or a module name, exact or "re:<regex>" (re.match); `ignore` entries the same way."""
        if self.method != "compressed-tensors" or any(_matches(module, linear, t) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_matches(module, linear, t) for t in s.targets)), None)


def _matches(module: str, linear: bool, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (target == "Linear" and linear)


def parse_quantization(config: Mapping[str, Any] | None) -> Quantization:
    """quantization_config (or None) -> Quantization; QuantError naming what kdtree does not model."""
    if config is None:
        return Quantization("none", "none")
    if not isinstance(config, Mapping):
        raise QuantError(f"quantization_config: expected an object, got {config!r}")
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise QuantError(f"quantization_config.fmt: only 'e4m3' is supported, got {config['fmt']!r}")
        block = config.get("weight_block_size")
        if not _two_positive(block):
            raise QuantError(f"quantization_config.weight_block_size: expected two positive integers, got {block!r}")
        return Quantization("fp8", "fp8", block=(block[0], block[1]))
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise QuantError(f"quantization_config.quant_method: {method!r} is not supported (supported: 'fp8' with "
                     "block scales, 'compressed-tensors' pack-quantized INT4 and float-quantized FP8)")


def _two_positive(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value))


def _compressed_tensors(config: Mapping[str, Any]) -> Quantization:
    if config.get("kv_cache_scheme") is not None:
        raise QuantError("quantization_config.kv_cache_scheme: a quantized KV cache is not modelled")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantError("quantization_config.config_groups: missing or empty")
    schemes = tuple(_scheme(f"quantization_config.config_groups.{name}", group, config.get("format"))
                    for name, group in groups.items())
    ignore = config.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(t, str) for t in ignore)):
        raise QuantError(f"quantization_config.ignore: expected a list of strings, got {ignore!r}")
    formats = {s.format for s in schemes}
    return Quantization("compressed-tensors", formats.pop() if len(formats) == 1 else "mixed-precision",
                        schemes=schemes, ignore=tuple(ignore))


def _scheme(where: str, group: Any, top_format: Any) -> WeightScheme:
    """One config group -> WeightScheme. Activations quantized at run time (``dynamic: true``,
    what FP8 schemes declare) are the engine's business, as an fp8 checkpoint's
    ``activation_scheme: dynamic`` is; activations with stored scales are refused."""
    if not isinstance(group, Mapping):
        raise QuantError(f"{where}: expected an object, got {group!r}")
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise QuantError(f"{where}.format: {fmt!r} is not supported (supported: "
                         + ", ".join(f"{f!r} ({kind})" for f, kind in FORMATS.items()) + ")")
    inputs = group.get("input_activations")
    if inputs is not None and not (isinstance(inputs, Mapping) and inputs.get("dynamic") is True):
        raise QuantError(f"{where}.input_activations: activations quantized with stored scales are not modelled "
                         "(the reference runs the weights it dequantizes on unquantized activations; dynamic "
                         "ones, quantized by the engine at run time, are accepted)")
    if group.get("output_activations") is not None:
        raise QuantError(f"{where}.output_activations: quantized outputs are not modelled")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise QuantError(f"{where}.weights: expected an object, got {weights!r}")
    int4 = fmt == "pack-quantized"
    expected = {"num_bits": 4, "type": "int"} if int4 else {"num_bits": 8, "type": "float"}
    for key, value in {**expected, "symmetric": True}.items():
        if weights.get(key) != value:
            raise QuantError(f"{where}.weights.{key}: only {value!r} is supported with format {fmt!r}, "
                             f"got {weights.get(key)!r}")
    for key in ("dynamic", "scale_dtype", "zp_dtype"):
        if weights.get(key) not in (None, False):
            raise QuantError(f"{where}.weights.{key}: only static weights with scales in the checkpoint's "
                             f"own dtype are supported, got {weights[key]!r}")
    strategy = weights.get("strategy")
    strategies = ("group",) if int4 else FP8_STRATEGIES
    if strategy not in strategies:
        raise QuantError(f"{where}.weights.strategy: {strategy!r} is not supported with format {fmt!r} "
                         f"(supported: {', '.join(map(repr, strategies))})")
    size, block = weights.get("group_size"), weights.get("block_structure")
    if strategy == "group" and not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        raise QuantError(f"{where}.weights.group_size: expected a positive integer, got {size!r}")
    if strategy == "block" and not _two_positive(block):
        raise QuantError(f"{where}.weights.block_structure: expected two positive integers, got {block!r}")
    targets = group.get("targets")
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise QuantError(f"{where}.targets: expected a list of strings, got {targets!r}")
    return WeightScheme(tuple(targets), fmt, strategy, size if strategy == "group" else None,
                        tuple(block) if strategy == "block" else None)
