"""Which checkpoint tensor is which weight, and how it is stored: the name map of
refgen/checkpoint.py (docs/checkpoints.md has it as a table).

A checkpoint *parameter* is a tensor name without its quantization suffix
(``_scale_inv``, ``_packed``, ``_scale``, ``_shape``, ``_zero_point``); its tensors
are its roles. `classify` maps a parameter to its project weight(s) (docs/fixtures.md
names) and says whether the slice keeps it; `check_storage` decides its storage
(plain, FP8 with ``weight_scale_inv`` or compressed-tensors' ``weight_scale``, packed
INT4) from its roles, dtypes and quantization_config, and checks every shape against
config.json. Both raise `CheckpointError` naming the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kdtr_format import ModelConfig

from .quant import Quantization, WeightScheme
from .safetensors_dir import CheckpointError, SafetensorsDir, StoredTensor
from .weights import weight_shapes

BODIES = ("model.", "language_model.model.", "model.language_model.")
HEADS = ("lm_head.weight", "language_model.lm_head.weight")
PLAIN = ("BF16", "F16", "F32")          # unquantized weights: widen exactly to float64
INDEX = r"(0|[1-9]\d{0,8})"             # a layer or expert index as written: no sign, no leading zero
ROTARY_BUFFER = "self_attn.rotary_emb.inv_freq"      # recomputed from config.json, never read as a weight
MTP_MARK = "eh_proj."                   # a tensor only an MTP layer has (DeepSeek-V3's, Kimi's)

LAYER = re.compile(rf"layers\.{INDEX}\.(.+)")
_EXPERT = re.compile(rf"mlp\.experts\.{INDEX}\.(gate|up|down)_proj\.weight")
_NORMS = {"input_layernorm.weight": "input_layernorm",
          "post_attention_layernorm.weight": "post_attention_layernorm"}
_ATTENTION = {"self_attn.q_proj.weight": "attn.wq", "self_attn.q_a_proj.weight": "attn.wq_a",
              "self_attn.q_a_layernorm.weight": "attn.q_a_norm", "self_attn.q_b_proj.weight": "attn.wq_b",
              "self_attn.kv_a_proj_with_mqa.weight": "attn.wkv_a",
              "self_attn.kv_a_layernorm.weight": "attn.kv_a_norm", "self_attn.kv_b_proj.weight": "attn.wkv_b",
              "self_attn.o_proj.weight": "attn.wo"}
_DENSE = {f"mlp.{p}_proj.weight": f"mlp.w_{p}" for p in ("gate", "up", "down")}
_MOE = {"mlp.gate.weight": "moe.gate", "mlp.gate.e_score_correction_bias": "moe.e_score_correction_bias",
        **{f"mlp.shared_experts.{p}_proj.weight": f"moe.shared.w_{p}" for p in ("gate", "up", "down")}}
_FUSED = {"mlp.experts.gate_up_proj": ("moe.experts.w_gate", "moe.experts.w_up"),
          "mlp.experts.down_proj": ("moe.experts.w_down",)}
_ROUTER = ("moe.gate", "moe.e_score_correction_bias")
# a tensor name's quantization suffix -> its role in the parameter (the name without the suffix)
_ROLES = (("_scale_inv", "scale_inv"), ("_packed", "packed"), ("_scale", "scale"), ("_shape", "shape"),
          ("_zero_point", "zero_point"))


@dataclass
class Checkpoint:
    """An opened checkpoint directory: its language-model config (``text_config`` unwrapped),
    quantization, tensor headers, and where its language model lives."""

    directory: Path
    hf_config: dict[str, Any]           # the language model's config.json object, quantization_config removed
    quantization_config: dict[str, Any] | None
    quant: Quantization
    cfg: ModelConfig                    # the whole model
    config_notes: list[str]             # what read_hf_config decided (defaults taken, keys noted)
    mtp_declared: int                   # num_nextn_predict_layers
    mtp_held: tuple[int, ...]           # the MTP layers the files hold (beyond num_hidden_layers)
    layers: frozenset[int]              # the layers 0..num_hidden_layers-1 the files or the index name a tensor of
    multimodal: bool                    # config.json nests the language model in text_config
    files: SafetensorsDir
    body: str                           # "model." or a multimodal prefix
    head: str


@dataclass(frozen=True)
class Target:
    """Where a checkpoint parameter goes: project weight `weight` (docs/fixtures.md names), as
    routed expert `expert` of it (the checkpoint's index; None: the whole weight), rows `rows`
    of the parameter (a fused half)."""

    weight: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


@dataclass
class Param:
    """One checkpoint parameter (a weight and its scales): tensor names by role
    ("data", "scale_inv", "packed", "scale", "shape", "zero_point")."""

    name: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    kind: str = ""                      # "kept", "sliced", "mtp", "buffer", "outside"
    targets: tuple[Target, ...] = ()
    storage: str = ""                   # "plain", "fp8", "float-quantized", "int4"
    group_size: int = 0                 # int4: elements a scale covers
    block: tuple[int, int] = (0, 0)     # fp8, float-quantized: the (b0, b1) elements a scale covers
    expert_axis: bool = False           # axis 0 indexes routed experts (router, fused experts): sliced to E

    @property
    def linear(self) -> bool:
        """An nn.Linear module's weight (what compressed-tensors' "Linear" target matches)."""
        return self.name.endswith("_proj.weight") or self.name.endswith("lm_head.weight")

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


@dataclass(frozen=True)
class ExpertSlice:
    """The routed experts a slice keeps: the first `per_group` of each of the `groups` groups of
    `group_size` consecutive experts (DeepSeek's n_group), in order. Slot s of the slice is
    expert (s // per_group) * group_size + s % per_group of the checkpoint; with one group (Kimi
    K2) or every expert kept, the slots are experts 0..E-1."""

    groups: int
    group_size: int
    per_group: int

    @property
    def count(self) -> int:
        return self.groups * self.per_group

    @property
    def contiguous(self) -> bool:
        return self.groups == 1 or self.per_group == self.group_size

    def slot(self, expert: int) -> int | None:
        """The slice's slot of checkpoint expert `expert`, None when the slice drops it."""
        group, j = divmod(expert, self.group_size)
        return group * self.per_group + j if j < self.per_group and group < self.groups else None

    def expert(self, slot: int) -> int:
        group, j = divmod(slot, self.per_group)
        return group * self.group_size + j

    def index(self) -> slice | np.ndarray:
        """What selects the kept experts along an expert axis: a slice (a view) when contiguous."""
        if self.contiguous:
            return slice(0, self.count)
        return np.array([self.expert(s) for s in range(self.count)])


class ShapeTemplates:
    """The shape config.json implies for any project weight of the whole model, read off one
    dense and one MoE layer: a cost independent of num_hidden_layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        self._cfg = cfg
        self._shapes = weight_shapes(dataclasses.replace(cfg, num_hidden_layers=2, first_k_dense_replace=1))

    def __getitem__(self, weight: str) -> tuple[int, ...]:
        match = LAYER.fullmatch(weight)
        if match is None:
            return self._shapes[weight]
        template = 0 if self._cfg.is_dense_layer(int(match[1])) else 1
        return self._shapes[f"layers.{template}.{match[2]}"]


def param_and_role(name: str) -> tuple[str, str]:
    """A tensor name -> (its parameter, its role): "...q_a_proj.weight_scale_inv" -> ("...q_a_proj.weight",
    "scale_inv"); a name without a quantization suffix is its parameter's "data"."""
    for suffix, role in _ROLES:
        if name.endswith(suffix):
            return name[:-len(suffix)], role
    return name, "data"


def classify(ckpt: Checkpoint, param: Param, layers: int, experts: ExpertSlice) -> None:
    """Set param.kind and param.targets; CheckpointError for a name that maps to nothing.
    Layers beyond num_hidden_layers are MTP (open_checkpoint checked them)."""
    cfg, name = ckpt.cfg, param.name
    if name == ckpt.head:
        param.kind, param.targets = "kept", (Target("lm_head"),)
        return
    if not name.startswith(ckpt.body):
        if ckpt.multimodal:                 # a vision tower, a projector: not the language model
            param.kind = "outside"
            return
        raise CheckpointError(f"{name}: maps to no weight of a DeepseekV3 model (its body is {ckpt.body}*)")
    rest = name[len(ckpt.body):]
    top = {"embed_tokens.weight": "embed_tokens", "norm.weight": "norm"}
    if rest in top:
        param.kind, param.targets = "kept", (Target(top[rest]),)
        return
    match = LAYER.fullmatch(rest)
    if match is None:
        raise CheckpointError(f"{name}: maps to no weight of a DeepseekV3 model")
    i, sub = int(match[1]), match[2]
    if i >= cfg.num_hidden_layers:
        param.kind = "mtp"
        return
    if sub == ROTARY_BUFFER:
        param.kind = "buffer"
        return
    dense = cfg.is_dense_layer(i)
    table = {**_NORMS, **_ATTENTION, **(_DENSE if dense else _MOE)}
    p = f"layers.{i}."
    expert = _EXPERT.fullmatch(sub)
    if sub in table:
        param.targets = (Target(p + table[sub]),)
        param.expert_axis = table[sub] in _ROUTER
    elif expert is not None and not dense:
        e = int(expert[1])
        if e >= cfg.n_routed_experts:
            raise CheckpointError(f"{name}: expert {e} is beyond n_routed_experts {cfg.n_routed_experts}")
        param.targets = (Target(f"{p}moe.experts.w_{expert[2]}", expert=e),)
    elif sub in _FUSED and not dense:
        I = cfg.moe_intermediate_size
        halves = [(0, I), (I, 2 * I)] if len(_FUSED[sub]) == 2 else [None]
        param.targets = tuple(Target(p + w, rows=rows) for w, rows in zip(_FUSED[sub], halves))
        param.expert_axis = True
    else:
        kind = (f"dense (first_k_dense_replace {cfg.first_k_dense_replace})" if dense else "MoE")
        raise CheckpointError(f"{name}: maps to no weight of layer {i}, a {kind} layer of a DeepseekV3 model")
    sliced = i >= layers or any(t.expert is not None and experts.slot(t.expert) is None for t in param.targets)
    param.kind = "sliced" if sliced else "kept"


def expected_shape(shapes: ShapeTemplates, param: Param) -> tuple[int, ...]:
    """The shape config.json implies for a mapped parameter."""
    target = param.targets[0]
    shape = shapes[target.weight]
    if target.expert is not None:
        return shape[1:]
    if target.rows is not None:
        return (shape[0], 2 * shape[1], shape[2])
    return shape


def check_storage(ckpt: Checkpoint, param: Param, shape: tuple[int, ...]) -> None:
    """Set param.storage (and its scales' block); CheckpointError for a missing scale, a stray one,
    a wrong dtype or shape, or storage that quantization_config does not declare."""
    roles, name, t = set(param.tensors), param.name, param.tensors
    scheme = ckpt.quant.scheme(param.module, param.linear)
    if "zero_point" in roles:
        raise CheckpointError(f"{t['zero_point'].name}: asymmetric INT4 (a zero point) is not supported")
    if roles == {"data"}:
        _check_plain(param, scheme, shape)
    elif roles == {"data", "scale_inv"}:
        _check_fp8_block(ckpt, param, shape)
    elif roles == {"data", "scale"}:
        _check_float_quantized(param, scheme, shape)
    elif "data" in roles:
        stray = sorted(roles - {"data"})[0]
        raise CheckpointError(f"{t[stray].name}: a {stray} tensor beside the unpacked weight {name}")
    elif "packed" in roles:
        _check_int4(ckpt, param, scheme, shape)
    else:
        raise CheckpointError(f"{t[sorted(roles)[0]].name}: a scale without its weight {name}")


def _check_plain(param: Param, scheme: WeightScheme | None, shape: tuple[int, ...]) -> None:
    name, data = param.name, param.tensors["data"]
    if data.dtype == "F8_E4M3":
        raise CheckpointError(f"{name}: an FP8 weight without its scale ({name}_scale_inv, or "
                              f"{param.module}.weight_scale)")
    if data.dtype not in PLAIN:
        raise CheckpointError(f"{name}: dtype {data.dtype} is not a weight dtype kdtree reads "
                              f"({', '.join(PLAIN)}, or F8_E4M3 with its scale, or INT4 packed)")
    if scheme is not None:
        raise CheckpointError(f"{name}: quantization_config quantizes {param.module} ({scheme.format}, not in "
                              "its ignore list) but the checkpoint stores it unquantized")
    _need_shape(data, shape)
    param.storage = "plain"


def _check_fp8_block(ckpt: Checkpoint, param: Param, shape: tuple[int, ...]) -> None:
    """DeepSeek's FP8: an F8_E4M3 weight and its weight_scale_inv per weight_block_size block."""
    t, quant, name = param.tensors, ckpt.quant, param.name
    if quant.method != "fp8":
        raise CheckpointError(f"{t['scale_inv'].name}: an FP8 scale, but quantization_config's method is "
                              f"{quant.method!r}")
    if t["data"].dtype != "F8_E4M3":
        raise CheckpointError(f"{name}: dtype {t['data'].dtype} beside a weight_scale_inv (expected F8_E4M3)")
    if t["scale_inv"].dtype not in ("F32", "BF16"):
        raise CheckpointError(f"{t['scale_inv'].name}: dtype {t['scale_inv'].dtype} (expected F32)")
    _need_shape(t["data"], shape)
    b0, b1 = quant.block
    rows, cols = shape[-2:]
    # a fused gate_up is two weights: gate and up each have their own row blocks
    row_blocks = 2 * math.ceil(rows // 2 / b0) if param.targets[0].rows is not None else math.ceil(rows / b0)
    _need_shape(t["scale_inv"], (*shape[:-2], row_blocks, math.ceil(cols / b1)))
    param.storage, param.block = "fp8", (b0, b1)


def _check_float_quantized(param: Param, scheme: WeightScheme | None, shape: tuple[int, ...]) -> None:
    """compressed-tensors' float-quantized FP8: an F8_E4M3 weight and its weight_scale, one per
    block of the config group's strategy."""
    t, name = param.tensors, param.name
    if scheme is None or scheme.format != "float-quantized":
        how = (f"stores {param.module} {scheme.format}" if scheme is not None else
               f"does not quantize {param.module} (not a compressed-tensors target, or ignored)")
        raise CheckpointError(f"{t['scale'].name}: an FP8 weight_scale, but quantization_config {how}")
    if t["data"].dtype != "F8_E4M3":
        raise CheckpointError(f"{name}: dtype {t['data'].dtype} beside a weight_scale (expected F8_E4M3)")
    if t["scale"].dtype not in PLAIN:
        raise CheckpointError(f"{t['scale'].name}: dtype {t['scale'].dtype} (expected one of {', '.join(PLAIN)})")
    if len(shape) != 2:
        raise CheckpointError(f"{name}: float-quantized FP8 is supported for 2-D weights, not fused experts")
    _need_shape(t["data"], shape)
    _need_shape(t["scale"], scheme.scale_shape(*shape))
    param.storage, param.block = "float-quantized", scheme.block(*shape)


def _check_int4(ckpt: Checkpoint, param: Param, scheme: WeightScheme | None, shape: tuple[int, ...]) -> None:
    """compressed-tensors' pack-quantized INT4: weight_packed, weight_scale and weight_shape."""
    t, roles, name = param.tensors, set(param.tensors), param.name
    for role, suffix in (("scale", "_scale"), ("shape", "_shape")):
        if role not in roles:
            raise CheckpointError(f"{name}_packed: a packed INT4 weight without its {name}{suffix}")
    if scheme is None or scheme.format != "pack-quantized":
        reason = (f"quantization_config's method is {ckpt.quant.method!r}" if ckpt.quant.method != "compressed-tensors"
                  else f"quantization_config does not quantize {param.module} (no target, or ignored)"
                  if scheme is None else f"quantization_config stores {param.module} {scheme.format}")
        raise CheckpointError(f"{name}_packed: a packed INT4 weight, but {reason}")
    if len(shape) != 2:
        raise CheckpointError(f"{name}_packed: packed INT4 is supported for 2-D weights, not fused experts")
    stored = tuple(int(v) for v in ckpt.files.array(t["shape"].name).reshape(-1))
    if t["shape"].dtype not in ("I64", "I32") or stored != shape:
        raise CheckpointError(f"{t['shape'].name}: says {list(stored)} ({t['shape'].dtype}), config.json "
                              f"implies {list(shape)}")
    if t["packed"].dtype != "I32" or t["scale"].dtype not in PLAIN:
        raise CheckpointError(f"{name}: packed dtype {t['packed'].dtype} / scale dtype {t['scale'].dtype} "
                              f"(expected I32 / one of {', '.join(PLAIN)})")
    _need_shape(t["packed"], (shape[0], math.ceil(shape[1] / 8)))
    _need_shape(t["scale"], (shape[0], math.ceil(shape[1] / scheme.group_size)))
    param.storage, param.group_size = "int4", scheme.group_size


def _need_shape(tensor: StoredTensor, shape: tuple[int, ...]) -> None:
    if tensor.shape != tuple(shape):
        raise CheckpointError(f"{tensor.name}: shape {list(tensor.shape)} disagrees with config.json, which "
                              f"implies {list(shape)}")


def layers_named(names: Iterable[str], body: str) -> dict[int, list[str]]:
    """Layer index -> what follows ``layers.{i}.`` in each of `names` under `body` (a cost bounded by
    the names, whatever num_hidden_layers says)."""
    held: dict[int, list[str]] = {}
    for name in names:
        match = LAYER.fullmatch(name[len(body):]) if name.startswith(body) else None
        if match is not None:
            held.setdefault(int(match[1]), []).append(match[2])
    return held


def mtp_layers(held: Mapping[int, list[str]], body: str, cfg: ModelConfig, declared: int) -> tuple[int, ...]:
    """The MTP layers among the layers the files hold (`layers_named`): each layer beyond
    num_hidden_layers, declared by num_nextn_predict_layers, or holding an ``eh_proj`` (a conversion
    that kept the MTP layer and set num_nextn_predict_layers to 0, as NVIDIA NeMo's bf16 recipe
    does). CheckpointError naming the layer otherwise."""
    N = cfg.num_hidden_layers
    beyond = sorted(i for i in held if i >= N)
    for i in beyond:
        if i >= N + declared and not any(sub.startswith(MTP_MARK) for sub in held[i]):
            raise CheckpointError(f"{body}layers.{i}.{min(held[i])}: layer {i} is beyond num_hidden_layers {N}, "
                                  f"config.json declares {declared} MTP layer(s) (num_nextn_predict_layers), "
                                  f"and it holds no {MTP_MARK}* (an MTP layer's)")
    return tuple(beyond)
