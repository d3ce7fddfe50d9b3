"""Reading an HF ``config.json`` (DeepseekV3 / Kimi K2) into a `ModelConfig`, and writing one.

    config, notes = read_hf_config(json.load(open("config.json")))
    data = hf_config_dict(config, "bfloat16")          # what `refgen export` writes; read back exactly

The dict is the text model's own config: a caller reading a vision-language
checkpoint unwraps ``text_config`` first, and whoever reads quantized weights
handles ``quantization_config`` and removes it (both are refused here, since
this reads the architecture only). Every key is one of:

- read: the `ModelConfig` fields under their HF names; the rope settings in
  either form (transformers 4.x: ``rope_theta`` + ``rope_scaling``; 5.x, what
  ``save_pretrained`` writes: one ``rope_parameters`` dict), refused when both
  forms are present and disagree; ``rope_interleave`` (-> `rope_style`); and
  kdtree's own ``rope_style`` and ``latent_norm_eps``;
- checked: keys of which kdtree implements one value (``moe_layer_freq`` 1,
  ``hidden_act`` silu, ``attention_bias`` false, ``pretraining_tp`` 1) or
  which restate other fields (``num_key_value_heads`` = the heads, HF's
  ``head_dim`` = the rope dim, ``qk_head_dim`` = nope + rope): anything else
  is refused naming the key;
- noted: ``num_nextn_predict_layers`` (multi-token-prediction layers, not part
  of the target forward) is accepted with a note;
- inert: HF bookkeeping and training-only settings (`INERT`), accepted silently.

Any other key is refused: kdtree does not guess whether it changes the math.

Absent keys: HF's `DeepseekV3Config` defaults are DeepSeek-V3's sizes (an
absent ``n_group`` means 8 to HF), so every architecture field is required,
except ``scoring_func`` / ``topk_method`` (HF hard-codes sigmoid / noaux_tc and
transformers 5.x does not write them), ``rope_interleave`` (the official
interleave layout, noted), ``rope_scaling`` / ``rope_parameters`` (plain rope;
``rope_theta`` is still required in one of the forms) and ``latent_norm_eps``
(1e-6, the reference code's; noted when ``rms_norm_eps`` differs).

YaRN's cos/sin gain: HF applies get_m(factor, mscale) / get_m(factor,
mscale_all_dim) only when both are non-zero, else get_m(factor, 1); kdtree
always applies the ratio (docs/model.md). A config where the two readings
differ (one of them 0 or absent, unless mscale is 1 and mscale_all_dim 0) is
refused. So is ``attention_factor`` (an explicit gain), ``truncate`` false
and ``partial_rotary_factor`` other than 1.

`hf_config_dict` writes a config the way DeepSeek-V3 ships it: architecture
``DeepseekV3ForCausalLM``, the rope in the 4.x form (``rope_theta`` and a
``rope_scaling`` of type yarn, or null), ``scoring_func`` and ``topk_method``
spelled out (vLLM's DeepseekV3 defaults to softmax scoring without them),
``rope_interleave``, no bos / eos token (nothing stops a generation early), and
kdtree's ``latent_norm_eps``, which the other readers ignore.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

from .schema import ConfigError, ModelConfig, YarnScaling

INERT = frozenset({
    "_name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype",
    "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "output_attentions", "output_hidden_states", "output_router_logits",
    "return_dict", "problem_type", "id2label", "label2id", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "aux_loss_alpha", "seq_aux", "ep_size",
})
CHECKED = {"moe_layer_freq": 1, "hidden_act": "silu", "attention_bias": False, "pretraining_tp": 1}
REFUSED = {
    "quantization_config": "quantized weights are a checkpoint's storage format; the reader of the "
                           "checkpoint's weights handles this key and removes it before calling read_hf_config",
    "text_config": "a wrapper config (vision-language); pass its text_config",
}
ROPE_FORMS = ("rope_theta", "rope_scaling", "rope_parameters")
YARN_KEYS = tuple(f.name for f in dataclasses.fields(YarnScaling))
ROPE_KEYS = frozenset({"type", "rope_type", "rope_theta", "attention_factor", "truncate",
                       "partial_rotary_factor", *YARN_KEYS})
# Fields with a default when absent (the rest are required; see the module docstring).
OPTIONAL = ("rope_theta", "rope_scaling", "rope_style", "scoring_func", "topk_method", "latent_norm_eps")


class HFConfig(NamedTuple):
    """What `read_hf_config` returns."""

    config: ModelConfig
    notes: list[str]   # one line per decision worth telling the user (default taken, key not run)


def hf_config_dict(config: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """`config` as a config.json dict (module docstring) of a checkpoint stored in `torch_dtype`;
    `read_hf_config` reads it back as `config`, with no notes."""
    fields = config.to_dict()
    del fields["rope_style"]
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": torch_dtype,
            **fields, "rope_interleave": config.rope_style == "interleave",
            "num_key_value_heads": config.num_attention_heads, **CHECKED, "num_nextn_predict_layers": 0,
            "bos_token_id": None, "eos_token_id": None}


def _refuse(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


def read_hf_config(data: Mapping[str, Any]) -> HFConfig:
    """An HF config.json dict -> HFConfig(config, notes)."""
    if not isinstance(data, Mapping):
        _refuse("config", f"expected a JSON object, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    known = fields | INERT | set(CHECKED) | set(ROPE_FORMS) | {
        "rope_interleave", "num_key_value_heads", "head_dim", "qk_head_dim", "num_nextn_predict_layers"}
    for key in data:
        if key in REFUSED:
            _refuse(key, REFUSED[key])
        if key not in known:
            _refuse(key, "not a DeepseekV3 / Kimi K2 config key that kdtree knows; refusing rather "
                         "than guessing whether it changes the math")
    for key, value in CHECKED.items():
        if key in data and data[key] != value:
            _refuse(key, f"kdtree implements only {value!r}, got {data[key]!r}")
    missing = [name for name in sorted(fields - set(OPTIONAL)) if name not in data]
    if missing:
        _refuse(missing[0], "required field is missing")

    notes: list[str] = []
    kwargs = {name: data[name] for name in fields if name in data}
    kwargs["rope_theta"], kwargs["rope_scaling"] = _rope(data)
    kwargs["rope_style"] = _rope_style(data, notes)
    config = ModelConfig(**kwargs)
    for key, expected in (("num_key_value_heads", config.num_attention_heads),
                          ("head_dim", config.qk_rope_head_dim), ("qk_head_dim", config.qk_head_dim)):
        if key in data and data[key] != expected:
            _refuse(key, f"must be {expected} for this config (MLA), got {data[key]!r}")
    if "latent_norm_eps" not in data and config.rms_norm_eps != config.latent_norm_eps:
        notes.append(f"latent_norm_eps: absent; the q_a / kv_a latent norms use {config.latent_norm_eps:g} "
                     f"as DeepSeek's reference code and HF do, not rms_norm_eps {config.rms_norm_eps:g} "
                     "(vLLM and SGLang use rms_norm_eps: set latent_norm_eps to follow them)")
    mtp = data.get("num_nextn_predict_layers", 0)
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        _refuse("num_nextn_predict_layers", f"must be a non-negative integer, got {mtp!r}")
    if mtp:
        notes.append(f"num_nextn_predict_layers: {mtp} multi-token-prediction "
                     "layer(s) are not part of the target forward; their weights are not read")
    return HFConfig(config, notes)


def _rope_style(data: Mapping[str, Any], notes: list[str]) -> str:
    styles = {}
    if "rope_interleave" in data:
        if not isinstance(data["rope_interleave"], bool):
            _refuse("rope_interleave", f"must be true or false, got {data['rope_interleave']!r}")
        styles["rope_interleave"] = "interleave" if data["rope_interleave"] else "neox"
    if "rope_style" in data:
        styles["rope_style"] = data["rope_style"]
    if len(styles) == 2 and styles["rope_style"] != styles["rope_interleave"]:
        _refuse("rope_style", f"{data['rope_style']!r} disagrees with rope_interleave {data['rope_interleave']!r}")
    if not styles:
        notes.append("rope_interleave: absent; the official interleave pairing (x[2i], x[2i+1]) is used, "
                     "as in HF")
        return "interleave"
    return next(iter(styles.values()))


def _rope(data: Mapping[str, Any]) -> tuple[float, YarnScaling | None]:
    """-> (rope_theta, YaRN or None) from either rope form, refusing two forms that disagree."""
    thetas: dict[str, Any] = {}
    if data.get("rope_theta") is not None:
        thetas["rope_theta"] = data["rope_theta"]
    scalings: dict[str, YarnScaling | None] = {}
    for form in ("rope_parameters", "rope_scaling"):
        if form in data:
            theta, scalings[form] = _rope_dict(data[form], form)
            if theta is not None:
                thetas[f"{form}.rope_theta"] = theta
    if not thetas:
        _refuse("rope_theta", "required field is missing (at the top level or in rope_parameters)")
    (first, theta), *others = thetas.items()
    for name, value in others:
        if value != theta:
            _refuse(name, f"{value!r} disagrees with {first} {theta!r}")
    if len(scalings) == 2 and scalings["rope_parameters"] != scalings["rope_scaling"]:
        _refuse("rope_parameters", f"disagrees with rope_scaling ({scalings['rope_parameters']} vs "
                                   f"{scalings['rope_scaling']})")
    return theta, next(iter(scalings.values()), None)


def _rope_dict(rope: Any, form: str) -> tuple[Any, YarnScaling | None]:
    """One rope dict (rope_parameters, or rope_scaling) -> (its rope_theta or None, YaRN or None)."""
    if rope is None:
        return None, None
    if not isinstance(rope, Mapping):
        _refuse(form, f"expected an object or null, got {rope!r}")
    unknown = sorted(set(rope) - ROPE_KEYS)
    if unknown:
        _refuse(f"{form}.{unknown[0]}", "not a rope setting kdtree implements")
    kinds = [rope[key] for key in ("type", "rope_type") if key in rope]
    if len(kinds) == 2 and kinds[0] != kinds[1]:
        _refuse(f"{form}.rope_type", f"{rope['rope_type']!r} disagrees with {form}.type {rope['type']!r}")
    kind = kinds[0] if kinds else "default"
    if rope.get("attention_factor") is not None:
        _refuse(f"{form}.attention_factor", "an explicit cos/sin factor; kdtree derives it from mscale "
                                            "and mscale_all_dim")
    if rope.get("truncate", True) is not True:
        _refuse(f"{form}.truncate", "kdtree implements only the truncated (floor / ceil) correction range")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"{form}.partial_rotary_factor", "kdtree rotates the whole qk_rope_head_dim")
    theta = rope.get("rope_theta")
    given = {key: rope[key] for key in YARN_KEYS if rope.get(key) is not None}
    if kind == "default":
        if given:
            _refuse(f"{form}.{next(iter(given))}", "a YaRN setting under rope_type 'default'")
        return theta, None
    if kind != "yarn":
        _refuse(f"{form}.rope_type", f"only 'default' and 'yarn' are implemented, got {kind!r}")
    for required in ("factor", "original_max_position_embeddings"):
        if required not in given:
            _refuse(f"{form}.{required}", "required field is missing")
    try:
        yarn = YarnScaling(**given)
    except ConfigError as exc:                # YarnScaling names its fields rope_scaling.*
        raise ConfigError(f"{form}{str(exc)[len('rope_scaling'):]}") from None
    hf_falls_back = not (yarn.mscale and yarn.mscale_all_dim)
    if yarn.factor > 1 and hf_falls_back and not (yarn.mscale == 1 and yarn.mscale_all_dim == 0):
        _refuse(f"{form}.mscale", f"mscale {yarn.mscale} with mscale_all_dim {yarn.mscale_all_dim}: HF then "
                                  "scales cos/sin by get_m(factor, 1), kdtree by get_m(factor, mscale) / "
                                  "get_m(factor, mscale_all_dim); give both (docs/model.md)")
    return theta, yarn
