"""A checkpoint saved by HF transformers' own `DeepseekV3ForCausalLM.save_pretrained` imports, and
refgen's logits on it match HF's.

HF is the outside oracle here: its model (run in float64) keeps RMSNorm, router, rope angles and
softmax in float32, so agreement is about 1e-6 relative, not 1e-12. Both of transformers 5.x's
expert layouts are read: per expert (`save_pretrained()`, the default) and fused
(`save_original_format=False`: `mlp.experts.gate_up_proj` / `down_proj`).

Kimi K2 as published stores `model.layers.{i}.self_attn.rotary_emb.inv_freq` (bf16) beside its FP8
weights: HF computes those buffers itself (YaRN-scaled) and ignores stored ones; refgen compares
them with its own rope and drops them, with a note that says how far they are.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from kdtr_format import YarnScaling
from refgen.checkpoint import load, open_checkpoint, plan_import
from refgen.model import KVCache, Model, rope_inv_freq
from refgen.weights import init_weights
from engine.adapters.hf_mapping import TRANSFORMERS_MIN, deepseek_v3_kwargs, hf_state_dict
from synthetic_checkpoint import SMALL, Layout, edit_tensors, hf_inv_freq, write_checkpoint

transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN, reason=(
    f"HF transformers >= {TRANSFORMERS_MIN} is not installed (pip install -e '.[test]' from a checkout): the save_pretrained "
    "round trip needs it"))
torch = pytest.importorskip("torch")

PROMPT = [5, 17, 200, 3, 99, 511, 42, 8, 8, 250, 1, 64]
# The default rope and rms_norm_eps 1e-6.
PLAIN = dataclasses.replace(SMALL, rope_scaling=None, rms_norm_eps=1e-6)
# Kimi K2.5-like: YaRN, rope_theta 50000, rms_norm_eps 1e-5 (transformers 5.x writes rope_parameters).
K25 = dataclasses.replace(SMALL, rope_theta=50000.0, rms_norm_eps=1e-5, rope_scaling=YarnScaling(
    factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
    mscale_all_dim=1.0))


def hf_model(cfg):
    """transformers' DeepseekV3ForCausalLM of `cfg` holding refgen's seeded float32 weights (the config
    and state dict as the HF adapter builds them: engine/adapters/hf_mapping.py)."""
    config = transformers.DeepseekV3Config(**deepseek_v3_kwargs(cfg), experts_implementation="eager",
                                           attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config)
    weights = init_weights(cfg, 11)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf_state_dict(cfg, weights).items()}, strict=True)
    return model, weights


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.double()(input_ids=torch.tensor([PROMPT])).logits[0].numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory per layout, HF float64 logits, the float32 weights) of PLAIN."""
    model, weights = hf_model(PLAIN)
    directories = {"per-expert": tmp_path_factory.mktemp("hf-per-expert"),
                   "fused": tmp_path_factory.mktemp("hf-fused")}
    model.save_pretrained(directories["per-expert"], max_shard_size="200KB")
    model.save_pretrained(directories["fused"], save_original_format=False)
    return directories, hf_logits(model), weights


def refgen_logits(directory) -> tuple[np.ndarray, dict]:
    imported = load(plan_import(open_checkpoint(directory)))
    model = Model(imported.cfg, imported.weights)
    return model.prefill(np.array(PROMPT), KVCache.new(imported.cfg, len(PROMPT))), imported


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_save_pretrained_imports_and_matches_hf_logits(saved, layout):
    directories, expected, weights = saved
    files = {p.name for p in directories[layout].iterdir()}
    assert ("model.safetensors.index.json" in files) == (layout == "per-expert")   # sharded, with an index
    logits, imported = refgen_logits(directories[layout])
    sources = imported.sources("layers.1.moe.experts.w_up")
    assert sources == ([f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(PLAIN.n_routed_experts)]
                       if layout == "per-expert" else ["model.layers.1.mlp.experts.gate_up_proj"])
    assert imported.cfg == PLAIN
    for name, w in weights.items():
        np.testing.assert_array_equal(np.asarray(imported.weights[name], np.float32), w, err_msg=name)
    error = np.abs(logits - expected).max() / np.abs(expected).max()
    assert error < 1e-5, f"refgen vs HF: max relative error {error:.2e}"
    assert np.array_equal(logits.argmax(-1), expected.argmax(-1))


def test_rope_parameters_yarn_and_eps_1e5_match_hf(tmp_path):
    """transformers 5.x's rope_parameters form with YaRN, and rms_norm_eps 1e-5 (the latent norms keep
    HF's 1e-6: latent_norm_eps)."""
    model, _ = hf_model(K25)
    model.save_pretrained(tmp_path)
    expected = hf_logits(model)
    logits, imported = refgen_logits(tmp_path)
    assert imported.cfg.rope_scaling == K25.rope_scaling and imported.cfg.rope_theta == K25.rope_theta
    error = np.abs(logits - expected).max() / np.abs(expected).max()
    assert error < 1e-5, f"refgen vs HF: max relative error {error:.2e}"


K2 = dataclasses.replace(SMALL, n_group=1, topk_group=1)             # Kimi K2 routes over one group
BUFFERS = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(K2.num_hidden_layers)]


@pytest.fixture(scope="module")
def kimi_k2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi-k2")
    write_checkpoint(directory, K2, init_weights(K2, 12), Layout(quant="fp8", rotary_buffers=True))
    return directory


def test_refgen_rope_is_the_inv_freq_hf_computes():
    """The tolerance's arithmetic part: HF's float32 YaRN inv_freq is refgen's float64 one to well
    within 2^-20 relative (rotary_emb buffers are then compared at their dtype's rounding plus that)."""
    hf = hf_inv_freq(K2).double().numpy()
    ours = rope_inv_freq(K2)
    assert np.max(np.abs(hf - ours) / ours) <= 2.0 ** -20
    unscaled = rope_inv_freq(dataclasses.replace(K2, rope_scaling=None))
    assert np.max(np.abs(unscaled - ours) / ours) > 0.5               # the YaRN-scaled one, not the plain one


def test_kimi_k2_rotary_buffers_agree_and_are_dropped(kimi_k2):
    plan = plan_import(open_checkpoint(kimi_k2), layers=2)
    imported = load(plan)
    assert plan.counts["buffer"] == len(BUFFERS)
    note = next(n for n in plan.notes if n.startswith("rotary_emb.inv_freq"))
    assert note.startswith(f"rotary_emb.inv_freq: 3 of 3 buffers equal the inv_freq kdtree computes from "
                           f"config.json (YaRN rope, factor 4) to their rounding"), note
    assert not any("inv_freq" in name for name in imported.referenced)


@pytest.mark.parametrize("stored, fragment", [
    ("unscaled", "3 of 3 buffers differ from the inv_freq kdtree computes from config.json (YaRN rope, factor 4) "
                 "by up to"),
    ("short", "1 of 3 buffers not compared (not [8] floats), e.g. model.layers.1.self_attn.rotary_emb.inv_freq "
              "(BF16 [4])"),
])
def test_kimi_k2_rotary_buffers_that_disagree_are_a_note(kimi_k2, tmp_path, stored, fragment):
    """Stale buffers (the rope before YaRN, as a plain RotaryEmbedding holds them) or malformed ones:
    a note with the size of the difference, never a refusal."""
    directory = tmp_path / "ckpt"
    shutil.copytree(kimi_k2, directory)
    plain = hf_inv_freq(dataclasses.replace(K2, rope_scaling=None)).bfloat16()

    def change(tensors):
        if stored == "unscaled":
            tensors.update({name: plain.clone() for name in BUFFERS})
        else:
            tensors[BUFFERS[1]] = tensors[BUFFERS[1]][:4].clone()
    edit_tensors(directory, change)
    plan = plan_import(open_checkpoint(directory), layers=2)
    load(plan)
    note = next(n for n in plan.notes if fragment in n)
    if stored == "unscaled":
        assert "they are the rope without its YaRN scaling" in note, note
