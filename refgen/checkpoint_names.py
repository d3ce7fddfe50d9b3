"""Which checkpoint tensor is which weight, and how it is stored: the name map of
refgen/checkpoint.py (docs/checkpoints.md has it as a table).

A checkpoint *parameter* is a tensor name without its quantization suffix
(``_scale_inv``, ``_packed``, ``_scale``, ``_shape``, ``_zero_point``); its tensors
are its roles. `classify` maps a parameter to its project weight(s) (docs/fixtures.md
names) and says whether the slice keeps it; `check_storage` decides its storage
(plain, FP8 block, packed INT4) from its roles, dtypes and quantization_config, and
checks every shape against config.json. Both raise `CheckpointError` naming the tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .safetensors_dir import CheckpointError, StoredTensor

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

BODIES = ("model.", "language_model.model.", "model.language_model.")
HEADS = ("lm_head.weight", "language_model.lm_head.weight")
PLAIN = ("BF16", "F16", "F32")          # unquantized weights: widen exactly to float64

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
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


@dataclass(frozen=True)
class Target:
    """Where a checkpoint parameter goes: project weight `weight` (docs/fixtures.md names), as
    expert `expert` of it (None: the whole weight), rows `rows` of the parameter (a fused half)."""

    weight: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


@dataclass
class Param:
    """One checkpoint parameter (a weight and its scales): tensor names by role
    ("data", "scale_inv", "packed", "scale", "shape", "zero_point")."""

    name: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    kind: str = ""                      # "kept", "sliced", "mtp", "outside"
    targets: tuple[Target, ...] = ()
    storage: str = ""                   # "plain", "fp8", "int4"
    group_size: int = 0
    expert_axis: bool = False           # axis 0 indexes routed experts (router, fused experts): sliced to E

    @property
    def linear(self) -> bool:
        """An nn.Linear module's weight (what compressed-tensors' "Linear" target matches)."""
        return self.name.endswith("_proj.weight") or self.name.endswith("lm_head.weight")

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def param_and_role(name: str) -> tuple[str, str]:
    """A tensor name -> (its parameter, its role): "...q_a_proj.weight_scale_inv" -> ("...q_a_proj.weight",
    "scale_inv"); a name without a quantization suffix is its parameter's "data"."""
    for suffix, role in _ROLES:
        if name.endswith(suffix):
            return name[:-len(suffix)], role
    return name, "data"


def classify(ckpt: Checkpoint, param: Param, layers: int, experts: int) -> None:
    """Set param.kind and param.targets; CheckpointError for a name that maps to nothing."""
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
    match = _LAYER.fullmatch(rest)
    if match is None:
        raise CheckpointError(f"{name}: maps to no weight of a DeepseekV3 model")
    i, sub = int(match[1]), match[2]
    if cfg.num_hidden_layers <= i < cfg.num_hidden_layers + ckpt.mtp_layers:
        param.kind = "mtp"
        return
    if i >= cfg.num_hidden_layers:
        raise CheckpointError(f"{name}: layer {i} is beyond num_hidden_layers {cfg.num_hidden_layers} and "
                              f"config.json declares {ckpt.mtp_layers} MTP layer(s) (num_nextn_predict_layers)")
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
    sliced = i >= layers or any(t.expert is not None and t.expert >= experts for t in param.targets)
    param.kind = "sliced" if sliced else "kept"


def expected_shape(shapes: Mapping[str, tuple[int, ...]], param: Param) -> tuple[int, ...]:
    """The shape config.json implies for a mapped parameter, from the whole model's weight shapes."""
    target = param.targets[0]
    shape = shapes[target.weight]
    if target.expert is not None:
        return shape[1:]
    if target.rows is not None:
        return (shape[0], 2 * shape[1], shape[2])
    return shape


def check_storage(ckpt: Checkpoint, param: Param, shape: tuple[int, ...]) -> None:
    """Set param.storage; CheckpointError for a missing scale, a stray one, a wrong dtype or shape."""
    roles, quant, name = set(param.tensors), ckpt.quant, param.name
    t = param.tensors
    if "zero_point" in roles:
        raise CheckpointError(f"{t['zero_point'].name}: asymmetric INT4 (a zero point) is not supported")
    if roles == {"data"}:
        dtype = t["data"].dtype
        if dtype == "F8_E4M3":
            raise CheckpointError(f"{name}: an FP8 weight without its scale {name}_scale_inv")
        if dtype not in PLAIN:
            raise CheckpointError(f"{name}: dtype {dtype} is not a weight dtype kdtree reads "
                                  f"({', '.join(PLAIN)}, or F8_E4M3 with weight_scale_inv, or INT4 packed)")
        if param.linear and quant.int4_group_size(param.module, True) is not None:
            raise CheckpointError(f"{name}: quantization_config quantizes {param.module} (INT4, not in its ignore "
                                  "list) but the checkpoint stores it unquantized")
        _need_shape(t["data"], shape)
        param.storage = "plain"
        return
    if "data" in roles:
        if roles != {"data", "scale_inv"}:
            stray = sorted(roles - {"data", "scale_inv"})[0]
            raise CheckpointError(f"{t[stray].name}: a {stray} tensor beside the unpacked weight {name}")
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
        param.storage = "fp8"
        return
    if "packed" not in roles:
        raise CheckpointError(f"{t[sorted(roles)[0]].name}: a scale without its weight {name}")
    for role, suffix in (("scale", "_scale"), ("shape", "_shape")):
        if role not in roles:
            raise CheckpointError(f"{name}_packed: a packed INT4 weight without its {name}{suffix}")
    size = quant.int4_group_size(param.module, param.linear)
    if size is None:
        reason = ("quantization_config's method is " + repr(quant.method) if quant.method != "pack-quantized"
                  else f"quantization_config does not quantize {param.module} (no target, or ignored)")
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
    _need_shape(t["scale"], (shape[0], math.ceil(shape[1] / size)))
    param.storage, param.group_size = "int4", size


def _need_shape(tensor: StoredTensor, shape: tuple[int, ...]) -> None:
    if tensor.shape != tuple(shape):
        raise CheckpointError(f"{tensor.name}: shape {list(tensor.shape)} disagrees with config.json, which "
                              f"implies {list(shape)}")
