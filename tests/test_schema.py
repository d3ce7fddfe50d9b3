"""The fixture schema: configs round-trip, HF configs load, impossible ones are refused by field."""

import json

import pytest

from kdtr_format import CONFIGS, PRESETS, ConfigError, DDTreeConfig, ModelConfig, YarnScaling

ALL_CONFIGS = {**PRESETS, **CONFIGS}

# A Kimi-K2-style HF config.json, trimmed to the fields the architecture reads plus HF extras.
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


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_config_round_trips_through_json(name):
    cfg = ALL_CONFIGS[name]
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_hf_config_loads_as_the_full_k2_config():
    cfg = ModelConfig.from_hf_dict(KIMI_K2_HF)
    assert cfg == CONFIGS["kimi-k2-full"]
    assert cfg.rope_style == "interleave"
    assert cfg.rope_scaling == YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                           beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                           mscale_all_dim=1.0)


def test_hf_rope_interleave_flag_selects_the_style():
    assert ModelConfig.from_hf_dict({**KIMI_K2_HF, "rope_interleave": False}).rope_style == "neox"
    assert ModelConfig.from_hf_dict({**KIMI_K2_HF, "rope_interleave": True}).rope_style == "interleave"


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
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {"type": "yarn", "factor": -1.0, "original_max_position_embeddings": 64}},
     "rope_scaling.factor"),
])
def test_impossible_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({**KIMI_K2_HF, **change})
    assert str(info.value).startswith(f"{field}:")


def test_missing_field_is_named():
    data = dict(KIMI_K2_HF)
    del data["kv_lora_rank"]
    with pytest.raises(ConfigError, match="^kv_lora_rank: required field is missing"):
        ModelConfig.from_dict(data)


def test_non_object_config_is_refused():
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_dict([1, 2, 3])


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
