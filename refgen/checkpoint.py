"""Model fixtures from a real DeepSeek-V3 / Kimi K2.x checkpoint directory, sliced to fit one machine.

    ckpt = open_checkpoint(directory)                     config.json, quantization_config, every tensor's header
    plan = plan_import(ckpt, layers=2, experts=8)         every name mapped, shapes and scales checked, the slice
    imported = load(plan, progress)                       the kept weights, dequantized (reads only the slice)
    fixture = checkpoint_fixture(imported, seed)          references as for every model fixture, no weights

What is supported, the name map and the dequant formulas are docs/checkpoints.md.
In short: HF tensor names (``model.`` / ``language_model.model.`` / ``model.language_model.``
bodies; per-expert ``mlp.experts.{e}.*_proj`` or HF 5.x fused ``mlp.experts.gate_up_proj`` /
``down_proj``), plain bf16 / float16 / float32, FP8 with ``weight_scale_inv`` blocks or
compressed-tensors float-quantized, compressed-tensors pack-quantized INT4 (refgen/quant.py),
``text_config`` nesting, MTP layers (declared or not), recognized and dropped, and the
``rotary_emb.inv_freq`` buffers Kimi K2 stores, compared with kdtree's rope and dropped.

Every tensor of the checkpoint is accounted for: kept, sliced away (layers >= K,
experts the slice drops), MTP, a recomputed buffer, or outside the language model of a
multimodal checkpoint; a tensor that maps to nothing, a quantized weight without its
scale, a shape that disagrees with config.json, an unknown dtype or a non-finite value
in a kept tensor is a `CheckpointError` naming it. The layers a slice reads are checked against
the names of the files and the index before anything is built per layer; a partial download
(shards the index names, absent) serves every slice that reads none of what is missing.

Each kept weight is described as data first, a kdtr_format.checkpoint_tensors entry (the checkpoint
tensors it is made of: file, name, byte ranges, sha256 of those bytes, and how to decode them),
then decoded from that entry by kdtr_format's decoder, which the engine uses on the fixture: the
weights the references are computed on are the ones the engine loads. Weights are held as the
reference needs them (refgen/model.py widens them to float64 where used): bf16 / float16 /
float32 tensors as zero-copy views of the files, dequantized ones (FP8, INT4, stacked experts)
as float32. The fixture stores no weight: its metadata's ``checkpoint_tensors`` stand for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from kdtr_format import PRESETS, KdtrError, ModelConfig
from kdtr_format.checkpoint_tensors import KEY as CHECKPOINT_TENSORS
from kdtr_format.checkpoint_tensors import CheckpointTensorError, decode_checkpoint

from .checkpoint_dir import open_checkpoint
from .checkpoint_names import (PLAIN, Checkpoint, ExpertSlice, Param, ShapeTemplates, check_storage, classify,
                               expected_shape, param_and_role)
from .fixtures import DEFAULT_PLAN, Fixture, FixturePlan, model_fixture
from .model import rope_inv_freq
from .safetensors_dir import DTYPES, INDEX, CheckpointError, StoredTensor
from .weights import weight_shapes

__all__ = ["Checkpoint", "CheckpointError", "Imported", "ImportPlan", "checkpoint_fixture", "fixture_name",
           "load", "open_checkpoint", "plan_import"]

Progress = Callable[[int], None]
FINITE_CHUNK = 1 << 24              # elements checked for NaN / Inf at a time
# HF transformers computes inv_freq in float32 (a power, a division and YaRN's blend, each
# rounded: a few 2^-24 relative); a stored buffer adds its own dtype's rounding to this.
INV_FREQ_ARITHMETIC = 2.0 ** -20
WEIGHT_PREFIXES = ("weights/", "bf16/weights/")   # a checkpoint fixture's, taken from the checkpoint


# ---------------------------------------------------------------------------- the plan

@dataclass
class ImportPlan:
    """What `load` reads: the sliced config, every kept parameter by project weight, and
    the accounting of the rest."""

    ckpt: Checkpoint
    cfg: ModelConfig                    # the slice
    layers: int
    experts: ExpertSlice
    weights: dict[str, list[Param]]     # project weight -> the kept parameters it is built from
    counts: dict[str, int]              # tensors: kept, sliced, mtp, buffer, outside
    mtp_names: list[str]
    notes: list[str]

    @property
    def bytes(self) -> int:
        """What `load` reads, its progress: every kept tensor's bytes in the slice, once."""
        sizes = {}
        for param in (p for params in self.weights.values() for p in params):
            for role, tensor in param.tensors.items():
                if role == "shape":             # an INT4 weight_shape: the entry's shape says it
                    continue
                size = tensor.end - tensor.begin
                sizes[tensor.name] = size // tensor.shape[0] * self.experts.count if param.expert_axis else size
        return sum(sizes.values())


def plan_import(ckpt: Checkpoint, layers: int | None = None, experts: int | None = None) -> ImportPlan:
    """Map every tensor, check shapes and scales against config.json, and choose the slice:
    the first `layers` layers (all by default) and `experts` routed experts (all by default),
    taken group by group (`ExpertSlice`)."""
    full = ckpt.cfg
    layers = full.num_hidden_layers if layers is None else layers
    if not 1 <= layers <= full.num_hidden_layers:
        raise CheckpointError(f"--layers {layers}: the checkpoint has {full.num_hidden_layers} layers")
    kept_experts, cfg = _slice(full, layers, full.n_routed_experts if experts is None else experts)
    _check_layers_named(ckpt, layers)
    _check_absent_unneeded(ckpt, layers, kept_experts)
    params: dict[str, Param] = {}
    for stored in ckpt.files.tensors.values():
        name, role = param_and_role(stored.name)
        params.setdefault(name, Param(name)).tensors[role] = stored
    shapes = ShapeTemplates(full)
    counts = {"kept": 0, "sliced": 0, "mtp": 0, "buffer": 0, "outside": 0}
    weights: dict[str, list[Param]] = {name: [] for name in weight_shapes(cfg)}
    mtp_names, buffers = [], []
    for param in params.values():
        classify(ckpt, param, layers, kept_experts)
        counts[param.kind] += len(param.tensors)
        if param.kind == "mtp":
            mtp_names += [t.name for t in param.tensors.values()]
        if param.kind == "buffer":
            buffers += param.tensors.values()
        if param.kind in ("kept", "sliced"):
            check_storage(ckpt, param, expected_shape(shapes, param))
        if param.kind == "kept":
            for target in param.targets:
                weights[target.weight].append(param)
    for weight, found in weights.items():
        _check_complete(weight, found, kept_experts)
    notes = _notes(ckpt, cfg, kept_experts, counts, mtp_names) + _partial_notes(ckpt, layers) + \
        _rotary_notes(ckpt, buffers)
    return ImportPlan(ckpt, cfg, layers, kept_experts, weights, counts, sorted(mtp_names), notes)


def _check_layers_named(ckpt: Checkpoint, layers: int) -> None:
    """The slice's layers 0..layers-1 each have a tensor in the files or the index (a cost bounded
    by the names, whatever num_hidden_layers says); CheckpointError naming the first that has none."""
    N = ckpt.cfg.num_hidden_layers
    if sum(1 for i in ckpt.layers if i < layers) < layers:
        missing = next(i for i in range(layers) if i not in ckpt.layers)     # at most len(ckpt.layers) + 1 steps
        raise CheckpointError(f"config.json: num_hidden_layers is {N}, but the checkpoint holds no tensor of "
                              f"layer {missing} ({len(ckpt.layers)} of the {N} layers are there)"
                              + (f"; the slice (--layers {layers}) reads layers 0..{layers - 1}" if layers < N else ""))


def _check_absent_unneeded(ckpt: Checkpoint, layers: int, experts: ExpertSlice) -> None:
    """CheckpointError naming the first tensor the slice reads that sits in a shard the index names
    and the directory lacks."""
    for name, file in sorted(ckpt.files.absent.items()):
        param = Param(param_and_role(name)[0])
        classify(ckpt, param, layers, experts)
        if param.kind == "kept":
            raise CheckpointError(f"{name}: in {file}, which {INDEX} names but the directory lacks; "
                                  f"the slice (--layers {layers}) reads it: download that shard")


def _slice(full: ModelConfig, layers: int, experts: int) -> tuple[ExpertSlice, ModelConfig]:
    """The experts kept and the slice's config; CheckpointError naming the smallest --experts
    that routing allows when `experts` is not a valid slice."""
    if not 1 <= experts <= full.n_routed_experts:
        raise CheckpointError(f"--experts {experts}: the checkpoint has {full.n_routed_experts} routed experts")
    G, group_size = full.n_group, full.n_routed_experts // full.n_group
    try:
        cfg = dataclasses.replace(full, num_hidden_layers=layers, n_routed_experts=experts,
                                  first_k_dense_replace=min(full.first_k_dense_replace, layers))
    except KdtrError as exc:
        # a group's score is the sum of its top 2 (n_group > 1); the topk_group groups hold the top-k
        per_group = max(2 if G > 1 else 1, math.ceil(full.num_experts_per_tok / full.topk_group))
        routing = f"n_group {G}, topk_group {full.topk_group}, num_experts_per_tok {full.num_experts_per_tok}"
        raise CheckpointError(f"--layers {layers} --experts {experts}: the slice is no valid config ({exc}); with "
                              f"{routing}, the smallest --experts is {G * per_group}"
                              + (f", then any multiple of {G} up to {full.n_routed_experts}" if G > 1 else "")
                              ) from None
    return ExpertSlice(G, group_size, experts // G), cfg


def _check_complete(weight: str, found: list[Param], experts: ExpertSlice) -> None:
    """Every kept project weight is built from one parameter, or one per routed expert kept."""
    fused = [p for p in found if p.targets[0].expert is None]
    slots = {experts.slot(t.expert) for p in found for t in p.targets if t.weight == weight and t.expert is not None}
    if fused and slots:
        raise CheckpointError(f"{fused[0].name}: stored both fused and per expert ({weight})")
    if ".experts." in weight and not fused:
        if len(slots) < experts.count:
            missing = next(s for s in range(experts.count) if s not in slots)     # at most len(slots) + 1 steps
            raise CheckpointError(f"{weight}: expert {experts.expert(missing)} is missing from the checkpoint "
                                  f"({experts.count - len(slots)} of the {experts.count} kept experts)")
    elif len(fused) != 1:
        raise CheckpointError(f"{weight}: no tensor of the checkpoint provides it" if not fused else
                              f"{weight}: provided twice ({fused[0].name}, {fused[1].name})")


def _notes(ckpt: Checkpoint, cfg: ModelConfig, experts: ExpertSlice, counts: Mapping[str, int],
           mtp_names: list[str]) -> list[str]:
    full, notes = ckpt.cfg, list(ckpt.config_notes)
    if cfg.num_hidden_layers < full.num_hidden_layers:
        notes.append(f"layers 0..{cfg.num_hidden_layers - 1} of {full.num_hidden_layers} kept, then the final "
                     "norm and the head: a different (shallower) model than the checkpoint's")
    if cfg.n_routed_experts < full.n_routed_experts:
        which = (f"0..{experts.count - 1} of {full.n_routed_experts}" if experts.contiguous else
                 f"{experts.count} of {full.n_routed_experts}, the first {experts.per_group} of each of the "
                 f"{experts.groups} groups (n_group), so that routing chooses among the checkpoint's own groups;")
        notes.append(f"routed experts {which} kept per MoE layer (router rows sliced to match): a different "
                     "model, routing over fewer experts")
    undeclared = [i for i in ckpt.mtp_held if i >= full.num_hidden_layers + ckpt.mtp_declared]
    if ckpt.mtp_held:
        notes.append(f"MTP layer(s) {', '.join(map(str, ckpt.mtp_held))}: {len(mtp_names)} tensors recognized and "
                     "dropped (kdtree has no MTP drafter)"
                     + (f"; config.json declares {ckpt.mtp_declared} (num_nextn_predict_layers): "
                        f"{', '.join(map(str, undeclared))} recognized by eh_proj, as NVIDIA NeMo's bf16 "
                        "conversion leaves DeepSeek-V3 (layer 61 kept, 0 declared)" if undeclared else ""))
    if ckpt.mtp_declared > len(ckpt.mtp_held):
        notes.append(f"config.json declares {ckpt.mtp_declared} MTP layer(s) (num_nextn_predict_layers), the files "
                     f"hold {len(ckpt.mtp_held)}: nothing is missing for kdtree, which runs no MTP layer")
    if counts["outside"]:
        notes.append(f"{counts['outside']} tensors outside the language model (vision tower, projector) dropped")
    return notes


def _partial_notes(ckpt: Checkpoint, layers: int) -> list[str]:
    """One line for a partial checkpoint the slice does not need more of: the layers config.json
    declares that the files and the index do not name, the shards the index names that are absent."""
    N, absent = ckpt.cfg.num_hidden_layers, ckpt.files.absent
    parts = []
    if len(ckpt.layers) < N:
        parts.append(f"config.json declares {N} layers, the checkpoint holds {len(ckpt.layers)}"
                     + (f" (0..{len(ckpt.layers) - 1})" if max(ckpt.layers) == len(ckpt.layers) - 1 else ""))
    if absent:
        shards = len(set(absent.values()))
        parts.append(f"{shards} shard(s) {INDEX} names are absent ({len(absent)} tensors)")
    if not parts:
        return []
    return [f"a partial checkpoint: {'; '.join(parts)}; the slice (layers 0..{layers - 1}) reads none of what "
            "is missing"]


def _rotary_notes(ckpt: Checkpoint, buffers: list[StoredTensor]) -> list[str]:
    """What the checkpoint's ``rotary_emb.inv_freq`` buffers (Kimi K2: one a layer, bf16) say
    against the inv_freq kdtree computes from config.json (refgen.model.rope_inv_freq: YaRN-scaled
    under rope_scaling, as HF transformers computes it): equal to their dtype's rounding plus
    HF's float32 arithmetic, or different by how much. Never read, never refused: the rope is
    config.json's (HF recomputes it the same way and ignores stored buffers)."""
    if not buffers:
        return []
    cfg, files = ckpt.cfg, ckpt.files
    want = rope_inv_freq(cfg)
    unscaled = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    rope = "rope" if cfg.rope_scaling is None else f"YaRN rope, factor {cfg.rope_scaling.factor:g}"
    agree, differ, skipped = [], [], []
    for tensor in sorted(buffers, key=lambda t: t.name):
        if tensor.dtype not in (*PLAIN, "F64") or tensor.shape != want.shape:
            skipped.append(f"{tensor.name} ({tensor.dtype} {list(tensor.shape)})")
            continue
        stored = np.asarray(files.array(tensor.name), np.float64)
        allowed = float(ml_dtypes.finfo(DTYPES[tensor.dtype]).eps) / 2 + INV_FREQ_ARITHMETIC
        with np.errstate(invalid="ignore"):
            relative = np.nan_to_num(np.abs(stored - want) / want, nan=np.inf)
        pair = int(np.argmax(relative))
        (agree if relative[pair] <= allowed else differ).append((float(relative[pair]), allowed, tensor, pair))
    n, notes = len(buffers), []
    if agree:
        worst = max(agree, key=lambda row: row[0])
        notes.append(f"rotary_emb.inv_freq: {len(agree)} of {n} buffers equal the inv_freq kdtree computes from "
                     f"config.json ({rope}) to their rounding (largest relative difference {worst[0]:.1e}, "
                     f"allowed {worst[1]:.1e}); dropped")
    if differ:
        size, allowed, tensor, pair = max(differ, key=lambda row: row[0])
        unscaled_too = cfg.rope_scaling is not None and all(
            np.allclose(np.asarray(files.array(t.name), np.float64), unscaled, rtol=a, atol=0) for _, a, t, _ in differ)
        notes.append(f"rotary_emb.inv_freq: {len(differ)} of {n} buffers differ from the inv_freq kdtree computes "
                     f"from config.json ({rope}) by up to {size:.3g} relative ({tensor.name}, pair {pair}; "
                     f"{tensor.dtype} rounding allows {allowed:.1e})"
                     + ("; they are the rope without its YaRN scaling" if unscaled_too else "")
                     + "; dropped: kdtree's rope is config.json's, as HF transformers' is")
    if skipped:
        notes.append(f"rotary_emb.inv_freq: {len(skipped)} of {n} buffers not compared (not {list(want.shape)} "
                     f"floats), e.g. {skipped[0]}; dropped")
    return notes


def fixture_name(plan: ImportPlan) -> str:
    """The directory's name, with the slice: e.g. Kimi-K2-Instruct-layers2-experts8."""
    ckpt = plan.ckpt
    name = ckpt.directory.resolve().name
    if plan.layers < ckpt.cfg.num_hidden_layers:
        name += f"-layers{plan.layers}"
    if plan.experts.count < ckpt.cfg.n_routed_experts:
        name += f"-experts{plan.experts.count}"
    if name in PRESETS:
        raise CheckpointError(f"{ckpt.directory}: its fixture would be named {name!r}, a preset's name; "
                              "rename the directory")
    return name


# ---------------------------------------------------------------------------- loading

@dataclass
class Imported:
    """The slice, read: `weights` as the reference holds them (views or float32), `entries`
    (``weights/<name>`` -> the kdtr_format.checkpoint_tensors entry that rebuilds it from the checkpoint's
    tensors), and `metadata` (the fixture's ``checkpoint`` entry)."""

    name: str
    cfg: ModelConfig
    weights: dict[str, np.ndarray]
    entries: dict[str, dict[str, Any]]
    metadata: dict[str, Any]

    def sources(self, weight: str) -> list[str]:
        """The checkpoint tensors project weight `weight` is made of, its parts in slot order."""
        entry = self.entries[f"weights/{weight}"]
        return [ref["tensor"] for part in entry.get("experts", [entry.get("tensors")]) for ref in part.values()]

    @property
    def referenced(self) -> dict[str, dict[str, Any]]:
        """Every checkpoint tensor the slice is made of -> its reference (kdtr_format.checkpoint_tensors)."""
        return {ref["tensor"]: ref for entry in self.entries.values()
                for part in entry.get("experts", [entry.get("tensors")]) for ref in part.values()}


def load(plan: ImportPlan, progress: Progress | None = None) -> Imported:
    """Read and dequantize the slice, one project weight at a time (`progress(n)` after each, n the
    bytes of the checkpoint it read: ImportPlan.bytes in all):
    each weight's kdtr_format.checkpoint_tensors entry (the checkpoint tensors it is made of, their bytes'
    sha256) and the weight decoded from it, as the engine decodes it. CheckpointError naming a
    kept tensor that holds a NaN or an infinity, or a weight that dequantizes to one."""
    step = progress or (lambda steps: None)
    ckpt, cfg = plan.ckpt, plan.cfg
    shapes = weight_shapes(cfg)
    refs: dict[str, dict[str, Any]] = {}
    weights, entries = {}, {}
    for weight, params in plan.weights.items():
        known = set(refs)
        entry = _entry(ckpt, plan, weight, params, shapes[weight], refs)
        plain = entry["decode"] == "plain" and "experts" not in entry
        try:
            weights[weight] = decode_checkpoint(weight, entry, lambda _, ref: _referenced(ckpt, plan, ref),
                                                None if plain else np.float32)
        except CheckpointTensorError as exc:
            raise CheckpointError(f"{params[0].name}: {str(exc).split(': ', 1)[1]}") from None
        entries[f"weights/{weight}"] = entry
        step(sum(e - b for name in set(refs) - known for b, e in refs[name]["ranges"]))
    experts = plan.experts
    metadata = {
        "path": str(ckpt.directory.resolve()),
        "config": ckpt.hf_config,
        "quantization_config": ckpt.quantization_config,
        "format": ckpt.quant.format,
        "layers": plan.layers, "num_hidden_layers": ckpt.cfg.num_hidden_layers,
        "experts": experts.count, "n_routed_experts": ckpt.cfg.n_routed_experts,
        "kept_experts": [experts.expert(s) for s in range(experts.count)],
        "tensors": dict(plan.counts),
        "mtp": {"layers": list(ckpt.mtp_held), "declared": ckpt.mtp_declared, "tensors": len(plan.mtp_names),
                "kept": False} if ckpt.mtp_held else None,
        "notes": plan.notes,
    }
    return Imported(fixture_name(plan), cfg, weights, entries, metadata)


def _entry(ckpt: Checkpoint, plan: ImportPlan, weight: str, params: list[Param], shape: tuple[int, ...],
           refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The kdtr_format.checkpoint_tensors entry of one project weight [shape]: one part, or one per kept expert
    (stacked in the slice's slots); `refs` caches each tensor's reference (a fused gate_up is read
    for two weights)."""
    first = params[0]
    target = next(t for t in first.targets if t.weight == weight)
    entry: dict[str, Any] = {"dtype": "float32", "shape": list(shape),
                             "decode": "fp8" if first.storage == "float-quantized" else first.storage}
    if first.storage in ("fp8", "float-quantized"):
        entry["block"] = list(first.block)
    if first.storage == "int4":
        entry["group_size"] = first.group_size
    if target.rows is not None:
        entry["rows"] = list(target.rows)

    def part(param: Param) -> dict[str, Any]:
        return {role: _reference(ckpt, plan, param, tensor, refs)
                for role, tensor in sorted(param.tensors.items()) if role != "shape"}
    if target.expert is None:
        entry["tensors"] = part(first)
    else:
        slots = sorted(params, key=lambda p: plan.experts.slot(p.targets[0].expert))
        entry["experts"] = [part(p) for p in slots]
    return entry


def _reference(ckpt: Checkpoint, plan: ImportPlan, param: Param, tensor: StoredTensor,
               refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A kept tensor's reference (kdtr_format.checkpoint_tensors): its file, the byte ranges of the slice (the
    kept experts' runs along an expert axis) and their sha256, after checking the bytes are finite."""
    if tensor.name in refs:
        return refs[tensor.name]
    if param.expert_axis:
        stride = (tensor.end - tensor.begin) // tensor.shape[0]
        kept = [plan.experts.expert(s) for s in range(plan.experts.count)]
        runs: list[list[int]] = []
        for e in kept:
            if runs and runs[-1][1] == tensor.begin + e * stride:
                runs[-1][1] += stride
            else:
                runs.append([tensor.begin + e * stride, tensor.begin + (e + 1) * stride])
        shape = [len(kept), *tensor.shape[1:]]
    else:
        runs, shape = [[tensor.begin, tensor.end]], list(tensor.shape)
    ref = {"file": tensor.file, "tensor": tensor.name, "dtype": tensor.dtype, "shape": shape, "ranges": runs}
    array = _finite(tensor, _referenced(ckpt, plan, ref))
    ref["sha256"] = hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()
    refs[tensor.name] = ref
    return ref


def _referenced(ckpt: Checkpoint, plan: ImportPlan, ref: Mapping[str, Any]) -> np.ndarray:
    """The array a reference names, read through the checkpoint's memory map: the kept experts
    along axis 0 when its shape keeps fewer rows than the tensor has."""
    array = ckpt.files.array(ref["tensor"])
    if len(ref["ranges"]) == 1 and list(array.shape) == ref["shape"]:
        return array
    return array[plan.experts.index()]


_FINITE_MASKS = {"BF16": (np.uint16, 0x7F80, 0x7F80), "F16": (np.uint16, 0x7C00, 0x7C00),
                 "F8_E4M3": (np.uint8, 0x7F, 0x7F)}     # bits that are all ones in a NaN or an infinity


def _finite(tensor: StoredTensor, array: np.ndarray) -> np.ndarray:
    """`array` (a kept tensor as stored), after checking that a float one holds no NaN or infinity
    (by its exponent bits: e4m3fn has no infinity, its NaN is S.1111.111)."""
    if tensor.dtype not in (*PLAIN, "F64", "F8_E4M3"):
        return array
    flat = array.reshape(-1)
    for start in range(0, flat.size, FINITE_CHUNK):
        chunk = flat[start:start + FINITE_CHUNK]
        if tensor.dtype in _FINITE_MASKS:
            bits, mask, bad = _FINITE_MASKS[tensor.dtype]
            finite = (chunk.view(bits) & mask) != bad
        else:
            finite = np.isfinite(chunk)
        if not finite.all():
            at = start + int(np.argmin(finite))
            index = [int(i) for i in np.unravel_index(at, array.shape)]
            raise CheckpointError(f"{tensor.name}: holds {float(flat[at])} at {index} ({tensor.dtype}); "
                                  "kdtree refuses non-finite weights")
    return array


# ---------------------------------------------------------------------------- the fixture

class _FixtureTensors(Mapping):
    """A model fixture's tensors without its weights (``weights/*``, ``bf16/weights/*``): the
    metadata's ``checkpoint_tensors`` rebuild them from the checkpoint."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self._names = [n for n in tensors if not n.startswith(WEIGHT_PREFIXES)]
        self._tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        if name.startswith(WEIGHT_PREFIXES):
            raise KeyError(name)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._names

    def __len__(self) -> int:
        return len(self._names)


def checkpoint_fixture(imported: Imported, seed: int = 0, plan: FixturePlan = DEFAULT_PLAN,
                       progress: Progress | None = None) -> Fixture:
    """The model fixture of an imported slice: references from its weights exactly as for every
    model fixture (refgen/fixtures.py), ``source: "checkpoint"``, the import's ``checkpoint``
    metadata, and no weights: ``checkpoint_tensors`` names each (``weights/<name>`` from the
    checkpoint's tensors, ``bf16/weights/<name>`` its bf16 rounding), so the file holds the
    references alone."""
    fixture = model_fixture(imported.cfg, imported.name, seed, plan, progress, source="checkpoint",
                            weights=imported.weights)
    entries = dict(imported.entries)
    if "bf16" in fixture.metadata:
        entries.update({f"bf16/{name}": {"dtype": "bfloat16", "shape": entry["shape"], "decode": "bf16", "of": name}
                        for name, entry in imported.entries.items()})
    fixture.tensors = _FixtureTensors(fixture.tensors)
    fixture.metadata["checkpoint"] = imported.metadata
    fixture.metadata[CHECKPOINT_TENSORS] = dict(sorted(entries.items()))
    return fixture
