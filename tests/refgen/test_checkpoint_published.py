"""Checkpoints as published carry what synthetic ones did not (issue 27), each built here in its
published structure (tests/synthetic_checkpoint.py) at tiny sizes:

- NVIDIA NeMo's bf16 conversion of DeepSeek-V3: the MTP layer converted with the rest, the config
  then declaring 0 MTP layers. Accepted, the layer recognized by its eh_proj and dropped with a note.
- DeepSeek-V3's grouped routing (n_group 8, topk_group 4, 8 experts a token): `--experts 8` is refused
  naming the smallest slice (16); a valid slice keeps experts group by group, so that the slice's
  groups are the checkpoint's.
- Moonlight-16B-A3B (bf16, no q LoRA: q_proj, plain rope) imports; DeepSeek-V3.2-Exp (its indexer)
  and Qwen3-MoE are refused naming a config key.

compressed-tensors' float-quantized FP8 is in test_checkpoint_import.py (with the INT4 layouts: both need
compressed-tensors, which imports transformers), Kimi K2's rotary buffers in test_checkpoint_hf.py (HF
transformers computes what they should hold).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from refgen.checkpoint import CheckpointError, load, open_checkpoint, plan_import
from refgen.model import KVCache, Model
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, edit_config, edit_tensors, write_checkpoint

# DeepSeek-V3's routing at tiny sizes: 8 groups of 4 experts, 4 groups chosen, 8 experts a token
V3 = dataclasses.replace(SMALL, n_routed_experts=32, n_group=8, topk_group=4, num_experts_per_tok=8,
                         moe_intermediate_size=32)
MOONLIGHT = dataclasses.replace(SMALL, q_lora_rank=None, n_group=1, topk_group=1, rope_scaling=None,
                                rope_theta=50000.0)
LAYOUTS = {"nemo-bf16": (SMALL, Layout(quant="bf16", mtp=True, declare_mtp=False)),
           "v3-fp8": (V3, Layout(quant="fp8", mtp=True)),
           "moonlight-bf16": (MOONLIGHT, Layout(quant="bf16"))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            cfg, layout = LAYOUTS[name]
            directory = tmp_path_factory.mktemp(name)
            made[name] = directory, write_checkpoint(directory, cfg, init_weights(cfg, 6), layout)
        return made[name]
    return get


def test_nemo_bf16_conversion_keeps_an_undeclared_mtp_layer(checkpoints):
    directory, written = checkpoints("nemo-bf16")
    assert written.config["num_nextn_predict_layers"] == 0
    mtp = [n for n in written.names if n.startswith(f"model.layers.{SMALL.num_hidden_layers}.")]
    plan = plan_import(open_checkpoint(directory), layers=2)
    imported = load(plan)
    assert plan.counts["mtp"] == len(mtp) > 0 and plan.mtp_names == sorted(mtp)
    assert imported.metadata["mtp"] == {"layers": [3], "declared": 0, "tensors": len(mtp), "kept": False}
    note = next(n for n in plan.notes if n.startswith("MTP"))
    assert "declares 0" in note and "3 recognized by eh_proj" in note and "NeMo" in note, note
    assert not any(".layers.3." in name for name in imported.referenced)


def test_a_layer_beyond_the_config_without_eh_proj_is_still_refused(checkpoints, tmp_path):
    """What makes an undeclared layer MTP is its eh_proj: drop it and the layer is an error again."""
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoints("nemo-bf16")[0], directory)
    edit_tensors(directory, lambda t: t.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.\S+: layer 3 is beyond num_hidden_layers 3, "
                                              r"config.json declares 0 MTP layer\(s\).*no eh_proj"):
        open_checkpoint(directory)


@pytest.mark.parametrize("experts", [8, 12])
def test_deepseek_v3_slice_below_its_groups_names_the_smallest(checkpoints, experts):
    ckpt = open_checkpoint(checkpoints("v3-fp8")[0])
    with pytest.raises(CheckpointError) as error:
        plan_import(ckpt, layers=2, experts=experts)
    message = str(error.value)
    assert f"--experts {experts}" in message and "the smallest --experts is 16, then any multiple of 8 up to 32" \
        in message, message
    assert plan_import(ckpt, layers=2, experts=16).cfg.n_routed_experts == 16      # the one it names works


def test_deepseek_v3_slice_keeps_experts_group_by_group(checkpoints):
    """16 of 32: experts 0, 1 of group 0, 4, 5 of group 1, ...: n_group and topk_group keep their meaning
    (the slice's group g is the checkpoint's group g); router rows and correction bias follow."""
    directory, written = checkpoints("v3-fp8")
    plan = plan_import(open_checkpoint(directory), layers=2, experts=16)
    imported = load(plan)
    kept = [4 * g + j for g in range(8) for j in range(2)]
    assert imported.metadata["kept_experts"] == kept
    assert (plan.cfg.n_routed_experts, plan.cfg.n_group, plan.cfg.topk_group) == (16, 8, 4)
    for name in ("layers.1.moe.gate", "layers.1.moe.e_score_correction_bias", "layers.1.moe.experts.w_up"):
        np.testing.assert_array_equal(np.asarray(imported.weights[name], np.float64),
                                      written.dequantized[name][kept].astype(np.float32), err_msg=name)
    dropped = set(range(32)) - set(kept)
    assert not any(f".experts.{e}." in name for name in imported.referenced for e in dropped)
    assert imported.referenced["model.layers.1.mlp.gate.weight"]["shape"] == [16, V3.hidden_size]
    assert "the first 2 of each of the 8 groups (n_group)" in next(n for n in plan.notes if n.startswith("routed"))
    floats = {n: (written.dequantized[n][kept] if ".experts." in n or n.endswith(("moe.gate", "correction_bias"))
                  else written.dequantized[n]).astype(np.float32) for n in imported.weights}
    prompt = np.arange(3, 30, 2)
    cfg = imported.cfg
    np.testing.assert_array_equal(Model(cfg, imported.weights).prefill(prompt, KVCache.new(cfg, len(prompt))),
                                  Model(cfg, floats).prefill(prompt, KVCache.new(cfg, len(prompt))))


def test_moonlight_without_q_lora_imports(checkpoints):
    directory, written = checkpoints("moonlight-bf16")
    imported = load(plan_import(open_checkpoint(directory)))
    assert imported.sources("layers.0.attn.wq") == ["model.layers.0.self_attn.q_proj.weight"]
    for name, value in imported.weights.items():
        np.testing.assert_array_equal(np.asarray(value, np.float64), written.dequantized[name], err_msg=name)


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
             "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
             "head_dim": 128, "num_key_value_heads": 4, "vocab_size": 151936}


@pytest.mark.parametrize("config, key", [
    (lambda c: c.update(index_n_heads=64, index_head_dim=128, index_topk=2048), "index_n_heads"),   # V3.2-Exp
    (lambda c: (c.clear(), c.update(QWEN3_MOE)), "decoder_sparse_step"),                           # Qwen3-MoE
], ids=["deepseek-v3.2-exp", "qwen3-moe"])
def test_other_architectures_are_refused_naming_a_key(checkpoints, tmp_path, config, key):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoints("v3-fp8")[0], directory)
    edit_config(directory, config)
    with pytest.raises(CheckpointError, match=f"config.json: {key}: not a DeepseekV3 / Kimi K2 config key"):
        open_checkpoint(directory)
