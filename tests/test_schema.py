"""The fixture schema: configs round-trip, HF configs (both rope forms, transformers' own
output) load, and impossible or unimplemented ones are refused naming the key."""

import dataclasses
import json
import math

import pytest

from engine.adapters.hf_mapping import TRANSFORMERS_MIN, deepseek_v3_kwargs
from kdtr_format import CONFIGS, PRESETS, ConfigError, DDTreeConfig, ModelConfig, YarnScaling, read_hf_config

ALL_CONFIGS = {**PRESETS, **CONFIGS}

# A Kimi-K2-style HF config.json (transformers 4.x rope form), trimmed to the fields the
# architecture reads plus HF extras.
KIMI_K2_HF = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
}
# The same rope settings as transformers 5.x writes them.
K2_ROPE_PARAMETERS = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096}
KIMI_K2_HF5 = {**{k: v for k, v in KIMI_K2_HF.items() if k not in ("rope_theta", "rope_scaling")},
               "rope_parameters": K2_ROPE_PARAMETERS}


def hf_config(data):
    """read_hf_config's config alone."""
    return read_hf_config(data).config


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_config_round_trips_through_json(name):
    cfg = ALL_CONFIGS[name]
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_hf_config_loads_as_the_full_k2_config():
    cfg, notes = read_hf_config(KIMI_K2_HF)
    assert cfg == CONFIGS["kimi-k2-full"]
    assert cfg.rope_style == "interleave" and cfg.latent_norm_eps == 1e-6
    assert cfg.rope_scaling == YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                           beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                           mscale_all_dim=1.0)
    assert [note.split(":")[0] for note in notes] == ["rope_interleave"]


def test_hf_rope_interleave_flag_selects_the_style():
    assert hf_config({**KIMI_K2_HF, "rope_interleave": False}).rope_style == "neox"
    loaded = read_hf_config({**KIMI_K2_HF, "rope_interleave": True})
    assert loaded.config.rope_style == "interleave" and loaded.notes == []
    assert hf_config({**KIMI_K2_HF, "rope_interleave": False, "rope_style": "neox"}).rope_style == "neox"


def test_hf_rope_parameters_form_reads_like_the_rope_scaling_form():
    assert hf_config(KIMI_K2_HF5) == CONFIGS["kimi-k2-full"]
    # transformers 5.x turning a 4.x config into rope_parameters keeps "type" beside "rope_type".
    assert hf_config({**KIMI_K2_HF5, "rope_parameters": {**K2_ROPE_PARAMETERS, "type": "yarn"}}) == \
        CONFIGS["kimi-k2-full"]
    both = {**KIMI_K2_HF, "rope_parameters": K2_ROPE_PARAMETERS}       # both forms, agreeing
    assert hf_config(both) == CONFIGS["kimi-k2-full"]
    plain = {**KIMI_K2_HF5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert hf_config(plain) == dataclasses.replace(CONFIGS["kimi-k2-full"], rope_theta=5e5, rope_scaling=None)
    # No theta anywhere is refused: HF would fall back to 10000.
    with pytest.raises(ConfigError, match="^rope_theta: required"):
        hf_config({**KIMI_K2_HF5, "rope_parameters": {"rope_type": "default"}})


@pytest.mark.parametrize("change, key", [
    ({"rope_theta": 10000.0}, "rope_parameters.rope_theta"),
    ({"rope_scaling": None}, "rope_parameters"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "factor": 64.0}}, "rope_parameters"),
    ({"rope_parameters": {**K2_ROPE_PARAMETERS, "rope_theta": 10000.0}}, "rope_parameters.rope_theta"),
], ids=["theta", "yarn-vs-none", "factor", "theta-inside"])
def test_hf_rope_forms_that_disagree_are_refused(change, key):
    data = {**KIMI_K2_HF, "rope_parameters": K2_ROPE_PARAMETERS, **change}
    with pytest.raises(ConfigError) as info:
        read_hf_config(data)
    assert str(info.value).startswith(f"{key}:") and "disagrees" in str(info.value)


@pytest.mark.parametrize("change, key", [
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"text_config": {}}, "text_config"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"head_dim": 128}, "head_dim"),
    ({"qk_head_dim": 128}, "qk_head_dim"),
    ({"index_topk": 2048}, "index_topk"),                          # DeepSeek-V3.2's sparse attention
    ({"rope_interleave": "yes"}, "rope_interleave"),
    ({"rope_interleave": False, "rope_style": "interleave"}, "rope_style"),
    ({"latent_norm_eps": 0.0}, "latent_norm_eps"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "yarn", "rope_type": "dynamic", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "attention_factor": 1.2}}, "rope_scaling.attention_factor"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "truncate": False}}, "rope_scaling.truncate"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "partial_rotary_factor": 0.5}},
     "rope_scaling.partial_rotary_factor"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "low_freq_factor": 1.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"type": "default", "factor": 2.0}}, "rope_scaling.factor"),
    # mscale without mscale_all_dim: HF's gain is get_m(factor, 1), kdtree's get_m(factor, mscale).
    ({"rope_scaling": {"type": "yarn", "factor": 40.0, "mscale": 0.707,
                       "original_max_position_embeddings": 4096}}, "rope_scaling.mscale"),
    ({"rope_scaling": {**KIMI_K2_HF["rope_scaling"], "mscale": 0.0}}, "rope_scaling.mscale"),
    ({"rope_parameters": {**K2_ROPE_PARAMETERS, "factor": -1.0}}, "rope_parameters.factor"),
    ({"rope_parameters": {**K2_ROPE_PARAMETERS, "rope_type": "longrope"}}, "rope_parameters.rope_type"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_hf_keys_kdtree_does_not_implement_are_refused_by_name(change, key):
    data = {**KIMI_K2_HF, **change}
    if any(k.startswith("rope_parameters") for k in change):
        data = {**KIMI_K2_HF5, **change}
    with pytest.raises(ConfigError) as info:
        read_hf_config(data)
    assert str(info.value).startswith(f"{key}:")


def test_hf_keys_that_keep_the_math_are_accepted_with_notes():
    inert = {"num_key_value_heads": 64, "head_dim": 64, "qk_head_dim": 192, "moe_layer_freq": 1,
             "hidden_act": "silu", "attention_bias": False, "ep_size": 1, "aux_loss_alpha": 0.001,
             "seq_aux": True, "auto_map": {"AutoConfig": "x"}, "rope_interleave": True}
    cfg, notes = read_hf_config({**KIMI_K2_HF, **inert})
    assert cfg == CONFIGS["kimi-k2-full"] and notes == []
    cfg, notes = read_hf_config({**KIMI_K2_HF, **inert, "num_nextn_predict_layers": 1})
    assert cfg == CONFIGS["kimi-k2-full"]
    assert len(notes) == 1 and notes[0].startswith("num_nextn_predict_layers: 1 multi-token-prediction")
    # mscale 1 without mscale_all_dim: HF's gain get_m(factor, 1) is kdtree's too.
    no_all_dim = {k: v for k, v in KIMI_K2_HF["rope_scaling"].items() if k != "mscale_all_dim"}
    assert hf_config({**KIMI_K2_HF, "rope_scaling": no_all_dim}).rope_scaling.mscale_all_dim == 0.0


def test_hf_latent_norm_eps_defaults_to_the_reference_and_is_selectable():
    k25 = {**KIMI_K2_HF, "rms_norm_eps": 1e-5, "rope_interleave": True}
    cfg, notes = read_hf_config(k25)
    assert (cfg.rms_norm_eps, cfg.latent_norm_eps) == (1e-5, 1e-6)
    assert len(notes) == 1 and notes[0].startswith("latent_norm_eps: absent; the q_a / kv_a latent norms use 1e-06")
    cfg, notes = read_hf_config({**k25, "latent_norm_eps": 1e-5})   # vLLM / SGLang's convention
    assert (cfg.rms_norm_eps, cfg.latent_norm_eps) == (1e-5, 1e-5) and notes == []


HOSTILE_VALUES = ([1], {"a": 1}, None, "x", -1, 1.5, True, float("nan"), float("inf"))


@pytest.mark.parametrize("base", ["hf4", "hf5", "kdtree"])
def test_hostile_values_are_config_errors_never_crashes(base):
    """Every key (rope sub-keys too) set to each hostile value: a config or a ConfigError."""
    data, load = {"hf4": (KIMI_K2_HF, read_hf_config), "hf5": (KIMI_K2_HF5, read_hf_config),
                  "kdtree": (PRESETS["tiny"].to_dict(), ModelConfig.from_dict)}[base]
    rope = next(key for key in ("rope_parameters", "rope_scaling") if key in data)
    variants = [{**data, key: value} for key in [*data, "rope_interleave", "rope_style", "num_nextn_predict_layers"]
                for value in HOSTILE_VALUES]
    variants += [{**data, rope: {**data[rope], key: value}}
                 for key in [*data[rope], "type", "rope_type", "attention_factor", "truncate"] for value in HOSTILE_VALUES]
    for variant in variants:
        try:
            cfg = load(variant)
        except ConfigError:
            continue
        cfg = cfg.config if base != "kdtree" else cfg
        numbers = [v for part in (cfg, cfg.rope_scaling) if part is not None
                   for v in vars(part).values() if isinstance(v, float)]
        assert all(math.isfinite(v) for v in numbers), variant


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
@pytest.mark.parametrize("how", ["to_dict", "save_pretrained"])
def test_transformers_own_deepseek_v3_config_round_trips(name, how, tmp_path):
    """transformers' DeepseekV3Config built from a preset, written by transformers itself,
    reads back as the same ModelConfig (the latent eps is HF's hard-coded 1e-6)."""
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN,
                                       reason=f"transformers >= {TRANSFORMERS_MIN} is an optional outside reference")
    cfg = ALL_CONFIGS[name]
    hf_cfg = transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg))
    if how == "save_pretrained":
        hf_cfg.save_pretrained(tmp_path)
        data = json.loads((tmp_path / "config.json").read_text())
    else:
        data = hf_cfg.to_dict()
    assert "rope_parameters" in data and "rope_scaling" not in data
    loaded, notes = read_hf_config(data)
    assert loaded == cfg
    assert all(note.startswith(("num_nextn_predict_layers", "latent_norm_eps")) for note in notes)


def test_from_dict_takes_exactly_the_fields():
    data = PRESETS["tiny"].to_dict()
    assert data["latent_norm_eps"] == 1e-6
    with pytest.raises(ConfigError, match="^latent_norm_eps: required field is missing"):
        ModelConfig.from_dict({k: v for k, v in data.items() if k != "latent_norm_eps"})
    with pytest.raises(ConfigError, match="^rope_interleave: not a field of ModelConfig"):
        ModelConfig.from_dict({**data, "rope_interleave": True})
    with pytest.raises(ConfigError, match="^rope_scaling.beta_fast: required field is missing"):
        ModelConfig.from_dict({**data, "rope_scaling": {k: v for k, v in data["rope_scaling"].items()
                                                         if k != "beta_fast"}})
    with pytest.raises(ConfigError, match="^norm_topk_prob: must be true or false"):
        ModelConfig.from_dict({**data, "norm_topk_prob": "yes"})


def test_presets_really_differ():
    tiny, tiny2, k2 = PRESETS["tiny"], PRESETS["tiny2"], PRESETS["kimi-k2"]
    assert tiny.q_lora_rank is not None and tiny2.q_lora_rank is None
    assert tiny.rope_style == "interleave" and tiny2.rope_style == "neox"
    assert tiny.rope_scaling is not None and tiny2.rope_scaling is None
    assert tiny.n_group == 1 and tiny2.n_group == 4
    assert tiny.first_k_dense_replace == 1 and tiny2.first_k_dense_replace == 0
    assert (k2.num_attention_heads, k2.kv_lora_rank, k2.qk_rope_head_dim) == (64, 512, 64)


@pytest.mark.parametrize("change, field", [
    ({"n_group": 5}, "n_routed_experts"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"kv_lora_rank": -4}, "kv_lora_rank"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 1000}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"rope_style": "gptj"}, "rope_style"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
    ({"hidden_size": 12.5}, "hidden_size"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {"type": "yarn", "factor": -1.0, "original_max_position_embeddings": 64}},
     "rope_scaling.factor"),
])
def test_impossible_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError) as info:
        read_hf_config({**KIMI_K2_HF, **change})
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize("name", ["kv_lora_rank", "n_group", "rms_norm_eps", "q_lora_rank"])
def test_missing_hf_field_is_named(name):
    # HF's defaults are DeepSeek-V3's (n_group 8, q_lora_rank 1536): an absent field is refused.
    data = {k: v for k, v in KIMI_K2_HF.items() if k != name}
    with pytest.raises(ConfigError, match=f"^{name}: required field is missing"):
        read_hf_config(data)


def test_non_object_config_is_refused():
    for load in (ModelConfig.from_dict, read_hf_config):
        with pytest.raises(ConfigError, match="expected a JSON object"):
            load([1, 2, 3])


def test_ddtree_config():
    cfg = DDTreeConfig(block_size=16, budget=256)
    assert cfg.depth == 15 and cfg.temperature == 0.0
    assert DDTreeConfig.from_dict(cfg.to_dict()) == cfg
    assert DDTreeConfig(block_size=1, budget=0).depth == 0
    with pytest.raises(ConfigError, match="^budget:"):
        DDTreeConfig(block_size=16, budget=-1)
    with pytest.raises(ConfigError, match="^block_size:"):
        DDTreeConfig(block_size=0, budget=4)
    with pytest.raises(ConfigError, match="^temperature:"):
        DDTreeConfig(block_size=4, budget=4, temperature=-0.5)
    with pytest.raises(ConfigError, match="^budget: required"):
        DDTreeConfig.from_dict({"block_size": 4})
