"""The fixture schema: model and DDTree configs as validated data classes.

Configs are data, so they live with the format and both the oracle (`refgen`)
and the implementations (`engine`, user adapters) read them from here.

Field names follow HF `DeepseekV3Config` / a Kimi `config.json`, plus two of
kdtree's own: `rope_style` (``interleave`` = pairs (x[2i], x[2i+1]), the
official layout; ``neox`` = pairs (x[i], x[i + d/2])) and `latent_norm_eps`
(the eps of the q_a / kv_a latent norms). The math each field feeds is in
``docs/model.md``.

`ModelConfig.to_dict` / `from_dict` are kdtree's own form (what fixtures
record); `kdtr_format.read_hf_config` reads an HF ``config.json``
(kdtr_format/hf_config.py). An impossible config raises `ConfigError` naming
the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import KdtrError

ROPE_STYLES = ("interleave", "neox")


class ConfigError(KdtrError, ValueError):
    """A config that cannot describe a model or a DDTree run."""


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def _positive_int(value: Any, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             field_name, f"must be a positive integer, got {value!r}")


def _non_negative_int(value: Any, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
             field_name, f"must be a non-negative integer, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(value: Any, field_name: str) -> None:
    _require(_number(value) and value > 0, field_name, f"must be a positive number, got {value!r}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling. Both mscale fields are always present: omitting
    them changes the math (a known trap with HF configs)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        _positive_number(self.factor, "rope_scaling.factor")
        _positive_int(self.original_max_position_embeddings,
                      "rope_scaling.original_max_position_embeddings")
        _positive_number(self.beta_fast, "rope_scaling.beta_fast")
        _positive_number(self.beta_slow, "rope_scaling.beta_slow")
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            _require(_number(value) and value >= 0, f"rope_scaling.{name}",
                     f"must be a number >= 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": "yarn", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Any) -> "YarnScaling | None":
        """The inverse of `to_dict` (None stays None): ``type`` "yarn" and every field."""
        if data is None:
            return None
        _require(isinstance(data, Mapping), "rope_scaling", f"expected an object or null, got {data!r}")
        _require(data.get("type") == "yarn", "rope_scaling.type",
                 f"only 'yarn' is supported, got {data.get('type')!r}")
        return cls(**_exact_fields(cls, {k: v for k, v in data.items() if k != "type"},
                                    "rope_scaling."))


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3 / Kimi-K2 architecture config (MLA + sigmoid MoE)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_style: str = "interleave"
    rms_norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6      # q_a / kv_a norms: 1e-6 in the reference code, whatever rms_norm_eps
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "intermediate_size", "n_group", "topk_group", "max_position_embeddings"):
            _positive_int(getattr(self, name), name)
        if self.q_lora_rank is not None:
            _positive_int(self.q_lora_rank, "q_lora_rank")
        _non_negative_int(self.n_shared_experts, "n_shared_experts")
        _non_negative_int(self.first_k_dense_replace, "first_k_dense_replace")
        _require(self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
                 f"{self.first_k_dense_replace} exceeds num_hidden_layers {self.num_hidden_layers}")
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
                 f"must be even (rotary pairs), got {self.qk_rope_head_dim}")
        _require(self.n_routed_experts % self.n_group == 0, "n_routed_experts",
                 f"{self.n_routed_experts} is not divisible by n_group {self.n_group}")
        _require(self.topk_group <= self.n_group, "topk_group",
                 f"{self.topk_group} exceeds n_group {self.n_group}")
        if self.n_group > 1:
            _require(self.n_routed_experts // self.n_group >= 2, "n_group",
                     "each group needs at least 2 experts (group score = sum of its top-2)")
        selectable = self.topk_group * (self.n_routed_experts // self.n_group)
        _require(self.num_experts_per_tok <= selectable, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} exceeds the {selectable} experts in the "
                 f"topk_group={self.topk_group} kept groups")
        _positive_number(self.routed_scaling_factor, "routed_scaling_factor")
        _positive_number(self.rope_theta, "rope_theta")
        _positive_number(self.rms_norm_eps, "rms_norm_eps")
        _positive_number(self.latent_norm_eps, "latent_norm_eps")
        _require(isinstance(self.norm_topk_prob, bool), "norm_topk_prob",
                 f"must be true or false, got {self.norm_topk_prob!r}")
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, YarnScaling),
                 "rope_scaling", f"must be a YarnScaling or None, got {self.rope_scaling!r}")
        _require(self.scoring_func == "sigmoid", "scoring_func",
                 f"only 'sigmoid' is supported, got {self.scoring_func!r}")
        _require(self.topk_method == "noaux_tc", "topk_method",
                 f"only 'noaux_tc' is supported, got {self.topk_method!r}")
        _require(self.rope_style in ROPE_STYLES, "rope_style",
                 f"must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        _require(not self.tie_word_embeddings, "tie_word_embeddings",
                 "tied embeddings are not part of this architecture")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_dense_layer(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `ModelConfig.from_dict` inverts it exactly."""
        out = dataclasses.asdict(self)
        out["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """The inverse of `to_dict`: every field present and no other key (a fixture's
        ``config``). An HF ``config.json`` goes through `read_hf_config`."""
        _require(isinstance(data, Mapping), "config", f"expected a JSON object, got {type(data).__name__}")
        kwargs = _exact_fields(cls, data, "")
        kwargs["rope_scaling"] = YarnScaling.from_dict(kwargs["rope_scaling"])
        return cls(**kwargs)


def _exact_fields(cls: type, data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """data's items when its keys are exactly the dataclass `cls`'s fields, else ConfigError
    naming the first missing or unknown one."""
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [name for name in names if name not in data]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: required field is missing")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: not a field of {cls.__name__} "
                          "(an HF config.json goes through kdtr_format.read_hf_config)")
    return dict(data)


@dataclass(frozen=True)
class DDTreeConfig:
    """One DDTree setting: L = block_size - 1 draft depths, a node budget B
    (the root not counted), and a temperature (0 means greedy)."""

    block_size: int
    budget: int
    temperature: float = 0.0

    def __post_init__(self) -> None:
        _positive_int(self.block_size, "block_size")
        _non_negative_int(self.budget, "budget")
        _require(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
                 "temperature", f"must be >= 0, got {self.temperature!r}")

    @property
    def depth(self) -> int:
        """L, the number of drafted depths."""
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DDTreeConfig":
        try:
            return cls(**{k: data[k] for k in ("block_size", "budget")},
                       temperature=data.get("temperature", 0.0))
        except KeyError as exc:
            raise ConfigError(f"{exc.args[0]}: required field is missing") from None


def _kimi_k2_attention() -> dict[str, Any]:
    return dict(num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                rope_theta=50000.0, rope_style="interleave",
                rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                         beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                         mscale_all_dim=1.0),
                max_position_embeddings=131072)


PRESETS: dict[str, ModelConfig] = {
    # The seed engine's size: q_lora, interleave rope with yarn, n_group 1, one dense layer first.
    # mscale != mscale_all_dim, so the YaRN cos/sin gain get_m(4, 1) / get_m(4, 0.707) is 1.037.
    "tiny": ModelConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        intermediate_size=384, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, rope_theta=10000.0, rope_style="interleave",
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707),
        rms_norm_eps=1e-6, max_position_embeddings=512),
    # Different everywhere: odd vocab, no q_lora, neox without yarn, grouped routing,
    # two shared experts, no dense layer, eps 1e-5 (the latent norms keep the reference's 1e-6).
    "tiny2": ModelConfig(
        vocab_size=777, hidden_size=192, num_hidden_layers=3, num_attention_heads=3,
        q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=48,
        intermediate_size=256, first_k_dense_replace=0, n_group=4, topk_group=2,
        routed_scaling_factor=1.5, rope_theta=50000.0, rope_style="neox", rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=512),
    # Kimi K2's exact attention and rope dims; few layers, experts and a small vocab.
    "kimi-k2": ModelConfig(
        vocab_size=2048, hidden_size=512, num_hidden_layers=2, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        intermediate_size=512, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rms_norm_eps=1e-6, **_kimi_k2_attention()),
    # Real MLA widths (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, the only latent width vLLM's CPU
    # MLA backend takes; its GPU kernels take 320, 512 or 576) on a model that generates in seconds:
    # K2's attention and rope dims with 4 heads, 2 layers, 8 experts, a small vocab.
    "mla-small": ModelConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=2, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        intermediate_size=384, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rms_norm_eps=1e-6,
        **{**_kimi_k2_attention(), "num_attention_heads": 4, "q_lora_rank": 128, "max_position_embeddings": 4096}),
}

# Shapes only (benchmarks, kernel dims); weights are never materialized.
CONFIGS: dict[str, ModelConfig] = {
    "kimi-k2-full": ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=61, n_routed_experts=384,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        intermediate_size=18432, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rms_norm_eps=1e-6, **_kimi_k2_attention()),
    # The GPU engine benchmark: hidden ~2k, a dozen layers, real K2 head dims.
    "k2-mid": ModelConfig(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=12, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=1024,
        intermediate_size=5632, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rms_norm_eps=1e-6, **_kimi_k2_attention()),
}
