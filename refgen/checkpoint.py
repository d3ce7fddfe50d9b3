"""Model fixtures from a real DeepSeek-V3 / Kimi K2.x checkpoint directory, sliced to fit one machine.

    ckpt = open_checkpoint(directory)                     config.json, quantization_config, every tensor's header
    plan = plan_import(ckpt, layers=2, experts=8)         every name mapped, shapes and scales checked, the slice
    imported = load(plan, progress)                       the kept weights, dequantized (reads only the slice)
    fixture = checkpoint_fixture(imported, seed)          references as for every model fixture, plus the bits

What is supported, the name map and the dequant formulas are docs/checkpoints.md.
In short: HF tensor names (``model.`` / ``language_model.model.`` / ``model.language_model.``
bodies; per-expert ``mlp.experts.{e}.*_proj`` or HF 5.x fused ``mlp.experts.gate_up_proj`` /
``down_proj``), plain bf16 / float16 / float32, FP8 blocks with ``weight_scale_inv``,
compressed-tensors pack-quantized INT4 (refgen/quant.py), ``text_config`` nesting,
and an MTP layer (``model.layers.{num_hidden_layers}``), recognized and dropped.

Every tensor of the checkpoint is accounted for: kept, sliced away (layers >= K,
experts >= E), MTP, or outside the language model of a multimodal checkpoint; a
tensor that maps to nothing, a quantized weight without its scale, a shape that
disagrees with config.json or an unknown dtype is a `CheckpointError` naming it.

Weights are held as the reference needs them (refgen/model.py widens them to
float64 where used): bf16 / float16 / float32 tensors as zero-copy views of the
files, dequantized ones (FP8, INT4, stacked experts) as float32. The fixture
stores ``weights/<name>`` as float32 (converted while it is written) and the
checkpoint's own tensors, sliced, under ``checkpoint/<HF name>``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kdtr_format import PRESETS, KdtrError, ModelConfig

from .checkpoint_names import BODIES, HEADS, Param, check_storage, classify, expected_shape, param_and_role
from .fixtures import DEFAULT_PLAN, Fixture, FixturePlan, model_fixture
from .quant import QuantError, Quantization, fp8_block, int4_packed, parse_quantization
from .safetensors_dir import CheckpointError, SafetensorsDir, StoredTensor
from .weights import weight_shapes

__all__ = ["Checkpoint", "CheckpointError", "Imported", "ImportPlan", "checkpoint_fixture", "fixture_name",
           "load", "open_checkpoint", "plan_import"]

Progress = Callable[[int], None]


# ---------------------------------------------------------------------------- the directory

@dataclass
class Checkpoint:
    """An opened checkpoint directory: its language-model config (``text_config`` unwrapped),
    quantization, tensor headers, and where its language model lives."""

    directory: Path
    hf_config: dict[str, Any]           # the language model's config.json object, quantization_config removed
    quantization_config: dict[str, Any] | None
    quant: Quantization
    cfg: ModelConfig                    # the whole model
    config_notes: list[str]             # what ModelConfig.from_hf_dict decided (defaults taken, keys noted)
    mtp_layers: int                     # num_nextn_predict_layers
    multimodal: bool                    # config.json nests the language model in text_config
    files: SafetensorsDir
    body: str                           # "model." or a multimodal prefix
    head: str


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read config.json and every safetensors header of `directory` (no tensor data)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"config.json: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError("config.json: expected a JSON object")
    multimodal = "text_config" in data
    if multimodal and not isinstance(data["text_config"], dict):
        raise CheckpointError("config.json: text_config must be an object")
    text = dict(data["text_config"] if multimodal else data)
    found = [q for q in (text.pop("quantization_config", None),
                         data.get("quantization_config") if multimodal else None) if q is not None]
    if len(found) == 2 and found[0] != found[1]:
        raise CheckpointError("config.json: text_config.quantization_config and quantization_config disagree")
    quantization_config = found[0] if found else None
    try:
        quant = parse_quantization(quantization_config)
        cfg, config_notes = ModelConfig.from_hf_dict(text)
    except (QuantError, KdtrError) as exc:
        raise CheckpointError(f"config.json: {exc}") from None
    mtp = text.get("num_nextn_predict_layers") or 0
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise CheckpointError(f"config.json: num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    files = SafetensorsDir(directory)
    bodies = [b for b in BODIES if b + "embed_tokens.weight" in files.tensors]
    heads = [h for h in HEADS if h in files.tensors]
    if len(bodies) != 1 or len(heads) != 1:
        embeddings = " or ".join(b + "embed_tokens.weight" for b in BODIES)
        raise CheckpointError(f"{directory}: expected one embedding ({embeddings}) and one head "
                              f"({' or '.join(HEADS)}); found {bodies or 'no embedding'}, {heads or 'no head'}")
    return Checkpoint(directory, text, quantization_config, quant, cfg, config_notes, mtp, multimodal, files,
                      bodies[0], heads[0])


# ---------------------------------------------------------------------------- the plan

@dataclass
class ImportPlan:
    """What `load` reads: the sliced config, every kept parameter by project weight, and
    the accounting of the rest."""

    ckpt: Checkpoint
    cfg: ModelConfig                    # the slice
    layers: int
    experts: int
    weights: dict[str, list[Param]]     # project weight -> the kept parameters it is built from
    counts: dict[str, int]              # tensors: kept, sliced, mtp, outside
    mtp_names: list[str]
    notes: list[str]

    @property
    def steps(self) -> int:
        """Progress steps of `load`: one per project weight."""
        return len(self.weights)


def plan_import(ckpt: Checkpoint, layers: int | None = None, experts: int | None = None) -> ImportPlan:
    """Map every tensor, check shapes and scales against config.json, and choose the slice:
    the first `layers` layers (all by default) with the first `experts` routed experts."""
    full = ckpt.cfg
    layers = full.num_hidden_layers if layers is None else layers
    experts = full.n_routed_experts if experts is None else experts
    if not 1 <= layers <= full.num_hidden_layers:
        raise CheckpointError(f"--layers {layers}: the checkpoint has {full.num_hidden_layers} layers")
    if not 1 <= experts <= full.n_routed_experts:
        raise CheckpointError(f"--experts {experts}: the checkpoint has {full.n_routed_experts} routed experts")
    try:
        cfg = dataclasses.replace(full, num_hidden_layers=layers, n_routed_experts=experts,
                                  first_k_dense_replace=min(full.first_k_dense_replace, layers))
    except KdtrError as exc:
        raise CheckpointError(f"--layers {layers} --experts {experts}: the slice is no valid config "
                              f"({exc})") from None
    params: dict[str, Param] = {}
    for stored in ckpt.files.tensors.values():
        name, role = param_and_role(stored.name)
        params.setdefault(name, Param(name)).tensors[role] = stored
    shapes = weight_shapes(full)
    counts = {"kept": 0, "sliced": 0, "mtp": 0, "outside": 0}
    weights: dict[str, list[Param]] = {name: [] for name in weight_shapes(cfg)}
    mtp_names = []
    for param in params.values():
        classify(ckpt, param, layers, experts)
        counts[param.kind] += len(param.tensors)
        if param.kind == "mtp":
            mtp_names += [t.name for t in param.tensors.values()]
        if param.kind in ("kept", "sliced"):
            check_storage(ckpt, param, expected_shape(shapes, param))
        if param.kind == "kept":
            for target in param.targets:
                weights[target.weight].append(param)
    for weight, found in weights.items():
        _check_complete(weight, found, cfg)
    return ImportPlan(ckpt, cfg, layers, experts, weights, counts, sorted(mtp_names),
                      _notes(ckpt, cfg, counts, mtp_names))


def _check_complete(weight: str, found: list[Param], cfg: ModelConfig) -> None:
    """Every kept project weight is built from one parameter, or one per routed expert kept."""
    fused = [p for p in found if p.targets[0].expert is None]
    per_expert = {t.expert for p in found for t in p.targets if t.weight == weight and t.expert is not None}
    if fused and per_expert:
        raise CheckpointError(f"{fused[0].name}: stored both fused and per expert ({weight})")
    if ".experts." in weight and not fused:
        missing = sorted(set(range(cfg.n_routed_experts)) - per_expert)
        if missing:
            raise CheckpointError(f"{weight}: expert {missing[0]} is missing from the checkpoint "
                                  f"({len(missing)} of the {cfg.n_routed_experts} kept experts)")
    elif len(fused) != 1:
        raise CheckpointError(f"{weight}: no tensor of the checkpoint provides it" if not fused else
                              f"{weight}: provided twice ({fused[0].name}, {fused[1].name})")


def _notes(ckpt: Checkpoint, cfg: ModelConfig, counts: Mapping[str, int], mtp_names: list[str]) -> list[str]:
    full, notes = ckpt.cfg, list(ckpt.config_notes)
    if cfg.num_hidden_layers < full.num_hidden_layers:
        notes.append(f"layers 0..{cfg.num_hidden_layers - 1} of {full.num_hidden_layers} kept, then the final "
                     "norm and the head: a different (shallower) model than the checkpoint's")
    if cfg.n_routed_experts < full.n_routed_experts:
        notes.append(f"routed experts 0..{cfg.n_routed_experts - 1} of {full.n_routed_experts} kept per MoE layer "
                     "(router rows sliced to match): a different model, routing over fewer experts")
    if ckpt.mtp_layers:
        notes.append(f"MTP layer(s) {full.num_hidden_layers}..{full.num_hidden_layers + ckpt.mtp_layers - 1}: "
                     f"{len(mtp_names)} tensors recognized and dropped (kdtree has no MTP drafter)")
    if counts["outside"]:
        notes.append(f"{counts['outside']} tensors outside the language model (vision tower, projector) dropped")
    return notes


def fixture_name(plan: ImportPlan) -> str:
    """The directory's name, with the slice: e.g. Kimi-K2-Instruct-layers2-experts8."""
    ckpt = plan.ckpt
    name = ckpt.directory.resolve().name
    if plan.layers < ckpt.cfg.num_hidden_layers:
        name += f"-layers{plan.layers}"
    if plan.experts < ckpt.cfg.n_routed_experts:
        name += f"-experts{plan.experts}"
    if name in PRESETS:
        raise CheckpointError(f"{ckpt.directory}: its fixture would be named {name!r}, a preset's name; "
                              "rename the directory")
    return name


# ---------------------------------------------------------------------------- loading

@dataclass
class Imported:
    """The slice, read: `weights` as the reference holds them (views or float32), `bits`
    (``checkpoint/<HF name>`` -> the checkpoint's own tensors, sliced), and `metadata`
    (the fixture's ``checkpoint`` entry)."""

    name: str
    cfg: ModelConfig
    weights: dict[str, np.ndarray]
    bits: dict[str, np.ndarray]
    metadata: dict[str, Any]


def load(plan: ImportPlan, progress: Progress | None = None) -> Imported:
    """Read and dequantize the slice, one project weight at a time (`progress(1)` after each)."""
    step = progress or (lambda steps: None)
    ckpt, cfg = plan.ckpt, plan.cfg
    shapes = weight_shapes(cfg)
    weights, bits, sources = {}, {}, {}
    for weight, params in plan.weights.items():
        try:
            weights[weight] = _assemble(ckpt, plan, weight, params, shapes[weight])
        except QuantError as exc:
            raise CheckpointError(f"{params[0].name}: {exc}") from None
        for param in params:
            for tensor in param.tensors.values():
                bits[f"checkpoint/{tensor.name}"] = _sliced(ckpt, plan, param, tensor)
        sources[weight] = _source(params, weight)
        step(1)
    metadata = {
        "path": str(ckpt.directory.resolve()),
        "config": ckpt.hf_config,
        "quantization_config": ckpt.quantization_config,
        "format": ckpt.quant.method,
        "layers": plan.layers, "num_hidden_layers": ckpt.cfg.num_hidden_layers,
        "experts": plan.experts, "n_routed_experts": ckpt.cfg.n_routed_experts,
        "tensors": dict(plan.counts),
        "mtp": {"layers": list(range(ckpt.cfg.num_hidden_layers, ckpt.cfg.num_hidden_layers + ckpt.mtp_layers)),
                "tensors": len(plan.mtp_names), "kept": False} if ckpt.mtp_layers else None,
        "weights": sources,
        "notes": plan.notes,
    }
    return Imported(fixture_name(plan), cfg, weights, bits, metadata)


def _assemble(ckpt: Checkpoint, plan: ImportPlan, weight: str, params: list[Param],
              shape: tuple[int, ...]) -> np.ndarray:
    """One project weight [shape] from its parameters: a view when one plain tensor
    gives it, else float32 (dequantized and / or stacked experts)."""
    first = params[0]
    target = next(t for t in first.targets if t.weight == weight)
    if target.expert is None:
        return _dequantize(ckpt, plan, first, target.rows, None if first.storage == "plain" else np.float32)
    out = np.empty(shape, dtype=np.float32)
    for param in params:
        out[param.targets[0].expert] = _dequantize(ckpt, plan, param, None, np.float32)
    return out


def _dequantize(ckpt: Checkpoint, plan: ImportPlan, param: Param, rows: tuple[int, int] | None,
                dtype: type | None) -> np.ndarray:
    """A kept parameter, sliced to the kept experts and to `rows` (a fused half), in `dtype`
    (None: the stored dtype, a zero-copy view of a plain tensor)."""
    t, files = param.tensors, ckpt.files
    if param.storage == "int4":
        shape = tuple(int(v) for v in files.array(t["shape"].name).reshape(-1))
        return int4_packed(files.array(t["packed"].name), files.array(t["scale"].name), shape,
                           param.group_size, dtype)
    data = _sliced(ckpt, plan, param, t["data"])
    row_slice = slice(*rows) if rows is not None else slice(None)
    if param.storage == "plain":
        value = data[..., row_slice, :] if rows is not None else data
        return value if dtype is None else np.asarray(value, dtype=dtype)
    b0, _ = ckpt.quant.block
    scale = _sliced(ckpt, plan, param, t["scale_inv"])
    if rows is not None:
        first, count = math.ceil(rows[0] / b0), math.ceil((rows[1] - rows[0]) / b0)
        scale = scale[..., first:first + count, :]
    return fp8_block(data[..., row_slice, :], scale, ckpt.quant.block, dtype or np.float32)


def _sliced(ckpt: Checkpoint, plan: ImportPlan, param: Param, tensor: StoredTensor) -> np.ndarray:
    """A tensor of a kept parameter; the first `experts` along axis 0 when that axis indexes experts."""
    array = ckpt.files.array(tensor.name)
    return array[:plan.experts] if param.expert_axis else array


def _source(params: list[Param], weight: str) -> dict[str, Any]:
    """Where a project weight came from, for the fixture's metadata (docs/checkpoints.md)."""
    first = params[0]
    target = next(t for t in first.targets if t.weight == weight)
    name = first.name if target.expert is None else re.sub(r"\.experts\.\d+\.", ".experts.{e}.", first.name)
    source: dict[str, Any] = {"tensor": name, "format": first.storage}
    if target.rows is not None:
        source["rows"] = list(target.rows)
    return source


# ---------------------------------------------------------------------------- the fixture

class _FixtureTensors(Mapping):
    """A model fixture's tensors with ``weights/*`` converted to float32 when read (one at a
    time, while the file is written) and the checkpoint's bits beside them."""

    def __init__(self, tensors: Mapping[str, np.ndarray], bits: Mapping[str, np.ndarray]) -> None:
        self._tensors, self._bits = tensors, bits

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._bits:
            return self._bits[name]
        value = self._tensors[name]
        return np.asarray(value, dtype=np.float32) if name.startswith("weights/") else value

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._bits

    def __len__(self) -> int:
        return len(self._tensors) + len(self._bits)


def checkpoint_fixture(imported: Imported, seed: int = 0, plan: FixturePlan = DEFAULT_PLAN,
                       progress: Progress | None = None) -> Fixture:
    """The model fixture of an imported slice: references from its weights exactly as for
    every model fixture (refgen/fixtures.py), ``source: "checkpoint"``, the import's
    ``checkpoint`` metadata, and the checkpoint's own tensors under ``checkpoint/``."""
    fixture = model_fixture(imported.cfg, imported.name, seed, plan, progress, source="checkpoint",
                            weights=imported.weights)
    fixture.tensors = _FixtureTensors(fixture.tensors, imported.bits)
    fixture.metadata["checkpoint"] = imported.metadata
    return fixture
