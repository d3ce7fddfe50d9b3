"""Synthetic checkpoints in the layouts DeepSeek-V3 / Kimi K2.x ship, for the tests (and the K2-shaped
measurement script), written independently of refgen: torch and safetensors.torch write the files,
torch quantizes DeepSeek's FP8 blocks, compressed-tensors' own compressors pack INT4 and quantize
float-quantized FP8, HF transformers computes the rotary buffers.

    written = write_checkpoint(directory, cfg, weights, Layout(quant="fp8", experts="fused"))
    written.dequantized      project name -> float64, what the checkpoint holds (independent formulas)
    edit_tensors(directory, lambda tensors: tensors.pop(name))      then break it, as the error tests do
    edit_config(directory, lambda config: config.update(num_hidden_layers=10**8))

`weights` are project-named float32 arrays (docs/fixtures.md; e.g. refgen.weights.init_weights),
any Mapping (the script's makes each on demand). Layouts:

- quant "bf16": every weight bf16 (the router's correction bias float32, as DeepSeek ships it).
- quant "fp8" (DeepSeek-V3, Kimi K2): every ``*_proj`` weight of the layers e4m3fn with a float32
  ``weight_scale_inv`` per 128 x 128 block (amax / 448; edge blocks partial); the rest bf16.
  A fused gate_up holds gate and up quantized separately, as transformers does.
- quant "int4" (Kimi K2 Thinking / K2.5): routed experts compressed-tensors pack-quantized (symmetric,
  group 32, bf16 scales), K2 Thinking's ignore list, the rest bf16.
- quant "ct-fp8-block" / "ct-fp8-channel" (llm-compressor's FP8_BLOCK / FP8_DYNAMIC schemes of DeepSeek
  and Kimi): every ``*_proj`` weight of the layers compressed-tensors float-quantized (an e4m3fn
  ``weight`` and a ``weight_scale`` per 128 x 128 block, float32; or per row, bf16), dynamic FP8 input
  activations declared, ``lm_head`` and the router ignored, the rest bf16.
- experts "per-expert" (``mlp.experts.{e}.gate_proj.weight``, what checkpoints ship) or "fused"
  (``mlp.experts.gate_up_proj`` [E, 2I, D] and ``mlp.experts.down_proj``, what transformers 5.x writes).
- multimodal: the language model under ``language_model.`` with config.json's ``text_config`` (Kimi
  K2.5), a vision tower and projector beside it; quantization_config at the top level.
- mtp: an MTP layer ``model.layers.{N}`` (its embed_tokens, enorm, hnorm, eh_proj, shared_head, its own
  block), declared by num_nextn_predict_layers unless declare_mtp is False (NVIDIA NeMo's bf16 recipe:
  DeepSeek's fp8_cast_bf16.py converts every shard, layer 61 included, then the config says 0).
- rotary_buffers (Kimi K2 as published): ``model.layers.{i}.self_attn.rotary_emb.inv_freq`` of every layer,
  bf16, the inv_freq HF transformers' DeepseekV3RotaryEmbedding computes for the config (YaRN-scaled).
- shard_bytes: shards of at most about this size, with model.safetensors.index.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kdtr_format import ModelConfig, YarnScaling

BLOCK = 128
GROUP = 32
K2_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                      r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [BLOCK, BLOCK]}


# The tests' model: dimensions off the 128-block grid (hidden 192, q_lora 96, kv_a 80 rows, experts 64
# rows), so FP8 edge blocks are partial; grouped routing; YaRN.
SMALL = ModelConfig(
    vocab_size=512, hidden_size=192, num_hidden_layers=3, num_attention_heads=3, q_lora_rank=96,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, intermediate_size=320,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_theta=10000.0,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=512)


@dataclass(frozen=True)
class Layout:
    quant: str = "bf16"                 # "bf16" | "fp8" | "int4" | "ct-fp8-block" | "ct-fp8-channel"
    experts: str = "per-expert"         # "per-expert" | "fused"
    multimodal: bool = False
    mtp: bool = False
    declare_mtp: bool = True
    rotary_buffers: bool = False
    shard_bytes: int = 1 << 20


@dataclass
class Written:
    config: dict
    names: list[str]                                        # every tensor written
    dequantized: dict[str, np.ndarray] = field(default_factory=dict)


# ---------------------------------------------------------------------------- formats (independent of refgen)

def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., r, c] -> (q e4m3fn [..., r, c], scale_inv float32 [..., ceil(r/128), ceil(c/128)]), amax / 448."""
    r, c = w.shape[-2:]
    R, C = math.ceil(r / BLOCK), math.ceil(c / BLOCK)
    padded = torch.zeros(*w.shape[:-2], R * BLOCK, C * BLOCK, dtype=torch.float32)
    padded[..., :r, :c] = w
    blocks = padded.unflatten(-2, (R, BLOCK)).unflatten(-1, (C, BLOCK))        # [..., R, B, C, B]
    scale = (blocks.abs().amax(dim=(-3, -1)) / 448.0).clamp(min=1e-12)           # [..., R, C]
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :r, :c]
    q = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> np.ndarray:
    r, c = q.shape[-2:]
    full = scale_inv.double().repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :r, :c]
    return (q.double() * full).numpy()


def needs_compressed_tensors() -> None:
    """Skip, naming the package, where compressed-tensors (the test extra) is absent: the INT4
    and float-quantized FP8 layouts are written and read back by its own code."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install "
                        "-e '.[test]' from a checkout): its own code writes and reads these checkpoints")


def int4_compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [r, c] -> compressed-tensors' weight_packed / weight_scale (bf16) / weight_shape."""
    needs_compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    groups = w.unflatten(-1, (-1, GROUP))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), int4_scheme().weights)
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.bfloat16()}, int4_scheme())


def int4_dequantize(packed: dict[str, torch.Tensor]) -> np.ndarray:
    needs_compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    q = unpack_from_int32(packed["weight_packed"], 4, torch.Size(packed["weight_shape"].tolist()))
    return (q.double() * packed["weight_scale"].double().repeat_interleave(GROUP, -1)).numpy()


def ct_fp8_scheme(quant: str):
    """llm-compressor's FP8_BLOCK ("ct-fp8-block") or FP8_DYNAMIC ("ct-fp8-channel") scheme on Linear modules."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme({"ct-fp8-block": "FP8_BLOCK", "ct-fp8-channel": "FP8_DYNAMIC"}[quant], ["Linear"])


def ct_fp8_compress(w: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """w [r, c] -> compressed-tensors' float-quantized weight (e4m3fn) and weight_scale (w's dtype): the
    scale from the library's calculate_qparams over each block (padded), row, group or the whole
    tensor, the weight from its compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = scheme.weights
    if args.strategy == "block":
        b0, b1 = args.block_structure
        r, c = w.shape
        padded = torch.nn.functional.pad(w, (0, -c % b1, 0, -r % b0))
        blocks = padded.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1))            # [R, b0, C, b1]
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    elif args.strategy == "group":
        groups = w.unflatten(-1, (-1, args.group_size))
        low, high = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, _ = calculate_qparams(low, high, args)
    return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


def ct_fp8_dequantize(compressed: dict[str, torch.Tensor], scheme) -> np.ndarray:
    """compressed-tensors' own decompressor, in float64 (the scale widened first: the exact products)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    state = {"weight": compressed["weight"], "weight_scale": compressed["weight_scale"].double()}
    return FloatQuantizationCompressor.decompress(state, scheme)["weight"].numpy()


def ct_fp8_config(quant: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": ct_fp8_scheme(quant)}, format="float-quantized",
                              ignore=["lm_head", r"re:.*mlp\.gate$"], quant_method="compressed-tensors",
                              quantization_status="compressed").model_dump()


def hf_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The inv_freq buffer HF transformers' DeepseekV3RotaryEmbedding computes for `cfg` (float32)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from engine.adapters.hf_mapping import deepseek_v3_kwargs

    return DeepseekV3RotaryEmbedding(transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg))).inv_freq


def int4_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))


def int4_config(multimodal: bool) -> dict:
    """K2 Thinking's quantization_config; a multimodal checkpoint names its head language_model.lm_head
    and ignores its vision parts."""
    from compressed_tensors.quantization import QuantizationConfig

    ignore = (["language_model.lm_head", "re:vision_tower.*", "re:mm_projector.*", *K2_THINKING_IGNORE[1:]]
              if multimodal else K2_THINKING_IGNORE)
    return QuantizationConfig(config_groups={"group_0": int4_scheme()}, format="pack-quantized", ignore=ignore,
                              quant_method="compressed-tensors", quantization_status="compressed").model_dump()


# ---------------------------------------------------------------------------- config.json

def hf_config(cfg: ModelConfig, layout: Layout) -> dict:
    """An HF config.json for `cfg` (rope_scaling + rope_theta, as shipped checkpoints have it)."""
    text = {k: v for k, v in cfg.to_dict().items() if k not in ("rope_style", "rope_scaling", "latent_norm_eps")}
    text.update(architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", torch_dtype="bfloat16",
                rope_interleave=cfg.rope_style == "interleave",
                num_nextn_predict_layers=int(layout.mtp and layout.declare_mtp))
    text["rope_scaling"] = cfg.rope_scaling.to_dict() if cfg.rope_scaling is not None else None
    quant = (FP8_CONFIG if layout.quant == "fp8" else int4_config(layout.multimodal) if layout.quant == "int4"
             else ct_fp8_config(layout.quant) if layout.quant.startswith("ct-fp8") else None)
    if not layout.multimodal:
        return {**text, **({"quantization_config": quant} if quant else {})}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "vision_config": {"hidden_size": 12, "patch_size": 14},
            **({"quantization_config": quant} if quant else {})}


# ---------------------------------------------------------------------------- tensors

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}


def hf_param(name: str, body: str, multimodal: bool) -> str:
    """The HF parameter of a project weight; routed experts: with "{e}" for the expert index."""
    if name in ("embed_tokens", "norm"):
        return f"{body}{name}.weight"
    if name == "lm_head":
        return ("language_model." if multimodal else "") + "lm_head.weight"
    _, i, part, *rest = name.split(".")
    leaf, p = ".".join(rest), f"{body}layers.{i}."
    if part in ("input_layernorm", "post_attention_layernorm"):
        return f"{p}{part}.weight"
    if part == "attn":
        return f"{p}self_attn.{_ATTENTION[leaf]}.weight"
    if part == "mlp":
        return f"{p}mlp.{leaf[2:]}_proj.weight"
    if leaf == "gate":
        return f"{p}mlp.gate.weight"
    if leaf == "e_score_correction_bias":
        return f"{p}mlp.gate.e_score_correction_bias"
    if leaf.startswith("shared."):
        return f"{p}mlp.shared_experts.{leaf[9:]}_proj.weight"
    return f"{p}mlp.experts.{{e}}.{leaf[10:]}_proj.weight"


def _store(param: str, w: torch.Tensor, layout: Layout, halves: tuple | None = None
           ) -> tuple[dict[str, torch.Tensor], Callable[[], np.ndarray]]:
    """One parameter's tensors as stored, and a function giving the float64 value they dequantize to."""
    if layout.quant == "fp8" and ".layers." in param and "_proj" in param:
        parts = [fp8_quantize(h) for h in (halves or (w,))]
        q, s = (torch.cat(t, dim=-2) for t in zip(*parts))
        scale = param.removesuffix(".weight") + (".weight_scale_inv" if param.endswith(".weight") else "_scale_inv")
        return {param: q, scale: s}, lambda: np.concatenate([fp8_dequantize(*p) for p in parts], axis=-2)
    if layout.quant.startswith("ct-fp8") and ".layers." in param and param.endswith("_proj.weight"):
        scheme = ct_fp8_scheme(layout.quant)
        compressed = ct_fp8_compress(w if layout.quant == "ct-fp8-block" else w.bfloat16(), scheme)
        return ({f"{param.removesuffix('.weight')}.{k}": v for k, v in compressed.items()},
                lambda: ct_fp8_dequantize(compressed, scheme))
    if layout.quant == "int4" and ".mlp.experts." in param and param.endswith("_proj.weight"):
        packed = int4_compress(w)
        return ({f"{param.removesuffix('.weight')}.{k}": v for k, v in packed.items()},
                lambda: int4_dequantize(packed))
    stored = w.float() if param.endswith("e_score_correction_bias") else w.bfloat16()
    return {param: stored}, lambda: stored.double().numpy()


def _weight_tensors(name: str, weights: Mapping[str, np.ndarray], layout: Layout, body: str, keep: bool
                    ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The HF tensors of project weight `name` and (`keep`) the project weights they dequantize
    to (a fused w_gate brings w_up along; w_up then gives nothing)."""
    def get(n: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(weights[n], dtype=np.float32))

    param = hf_param(name, body, layout.multimodal)
    if "{e}" not in param:
        tensors, value = _store(param, get(name), layout)
        return tensors, {name: value()} if keep else {}
    if layout.experts == "per-expert":
        w, tensors, values = get(name), {}, []
        for e in range(w.shape[0]):
            stored, value = _store(param.format(e=e), w[e], layout)
            tensors.update(stored)
            values.append(value)
        return tensors, {name: np.stack([v() for v in values])} if keep else {}
    fused = param.replace("{e}.", "").removesuffix(".weight")          # mlp.experts.down_proj
    if name.endswith("w_down"):
        tensors, value = _store(fused, get(name), layout)
        return tensors, {name: value()} if keep else {}
    if name.endswith("w_up"):
        return {}, {}
    up = name.removesuffix("w_gate") + "w_up"
    gate_w, up_w = get(name), get(up)
    fused = fused.replace("gate_proj", "gate_up_proj")
    tensors, value = _store(fused, torch.cat([gate_w, up_w], dim=-2), layout, halves=(gate_w, up_w))
    if not keep:
        return tensors, {}
    both, half = value(), gate_w.shape[-2]
    return tensors, {name: both[..., :half, :], up: both[..., half:, :]}


def write_checkpoint(directory: str | Path, cfg: ModelConfig, weights: Mapping[str, np.ndarray],
                     layout: Layout = Layout(), progress: Callable[[str], None] = lambda name: None,
                     keep_dequantized: bool = True) -> Written:
    """Write config.json, the safetensors shards (model-0000i-of-0000n) and their index into `directory`,
    one shard in memory at a time; `written.dequantized` only with `keep_dequantized`."""
    if layout.quant == "int4" or layout.quant.startswith("ct-fp8"):
        needs_compressed_tensors()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg, layout)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    body = "language_model.model." if layout.multimodal else "model."
    written = Written(config, [])
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []

    def flush() -> None:
        save_file(shard, directory / f"shard-{len(files)}.tmp", metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    def add(tensors: Mapping[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + size > layout.shard_bytes:
            flush()
        shard.update({k: v.contiguous() for k, v in tensors.items()})
        written.names += list(tensors)

    for name in weights:
        progress(name)
        tensors, values = _weight_tensors(name, weights, layout, body, keep_dequantized)
        add(tensors)
        written.dequantized.update(values)
    add(_extras(cfg, layout, body))
    flush()
    index = {}
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (directory / f"shard-{i}.tmp").rename(directory / final)
        index.update(dict.fromkeys(names, final))
    total = sum((directory / f).stat().st_size for f in set(index.values()))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    return written


def _extras(cfg: ModelConfig, layout: Layout, body: str) -> dict[str, torch.Tensor]:
    """The MTP layer, the rotary buffers and a multimodal checkpoint's vision parts (never loaded by kdtree)."""
    generator = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    if layout.rotary_buffers:
        inv_freq = hf_inv_freq(cfg).bfloat16()
        for i in range(cfg.num_hidden_layers + int(layout.mtp)):
            tensors[f"{body}layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    if layout.mtp:
        D, V, p = cfg.hidden_size, cfg.vocab_size, f"{body}layers.{cfg.num_hidden_layers}."
        for leaf, shape in (("embed_tokens.weight", (V, D)), ("shared_head.head.weight", (V, D)),
                            ("enorm.weight", (D,)), ("hnorm.weight", (D,)), ("eh_proj.weight", (D, 2 * D)),
                            ("shared_head.norm.weight", (D,)), ("input_layernorm.weight", (D,)),
                            ("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
                            ("self_attn.o_proj.weight", (D, cfg.num_attention_heads * cfg.v_head_dim))):
            tensors.update(_store(p + leaf, torch.randn(shape, generator=generator), layout)[0])
    if layout.multimodal:
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(12, 3, 2, 2, generator=generator).bfloat16()
        tensors["mm_projector.proj.0.weight"] = torch.randn(cfg.hidden_size, 12, generator=generator).bfloat16()
    return tensors


# ---------------------------------------------------------------------------- edits (the error tests')

def edit_tensors(directory: str | Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite the checkpoint as one model.safetensors after `change` edits its tensors in place."""
    directory = Path(directory)
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    change(tensors)
    save_file(tensors, directory / "model.safetensors")


def edit_config(directory: str | Path, change: Callable[[dict], None]) -> None:
    """`change` edits config.json's object in place."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def edit_index(directory: str | Path, change: Callable[[dict[str, str]], None]) -> None:
    """`change` edits model.safetensors.index.json's weight_map in place."""
    path = Path(directory) / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))
