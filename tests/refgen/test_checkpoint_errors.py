"""Bad checkpoints get one clear error naming the tensor (or key, or file), never a skip.

Each row starts from a good small checkpoint (FP8 or INT4, written by tests/synthetic_checkpoint.py),
breaks one thing, and names the text the CheckpointError must contain. The CLI turns the same errors
into one line and exit status 2, with nothing written.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from refgen.checkpoint import CheckpointError, load, open_checkpoint, plan_import
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, edit_config, edit_index, edit_tensors, write_checkpoint

TINY = dataclasses.replace(SMALL, num_hidden_layers=2, n_routed_experts=4, n_group=1)
L0, L1 = "model.layers.0.", "model.layers.1."


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Callable[[str], Path]:
    made = {}

    def get(quant: str) -> Path:
        if quant not in made:
            made[quant] = tmp_path_factory.mktemp(f"good-{quant}")
            write_checkpoint(made[quant], TINY, init_weights(TINY, 1), Layout(quant=quant))
        return made[quant]
    return get


def tensors_edit(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    return lambda directory: edit_tensors(directory, change)


def config_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda directory: edit_config(directory, change)


def index_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda directory: edit_index(directory, change)


def _drop(*names: str):
    return lambda t: [t.pop(n) for n in names]


def _add(name: str, value: torch.Tensor):
    return lambda t: t.update({name: value})


def _replace(name: str, make: Callable[[torch.Tensor], torch.Tensor]):
    return lambda t: t.update({name: make(t[name])})


def _quant(key: str, value):
    def change(config: dict) -> None:
        config["quantization_config"][key] = value
    return change


def _group(key: str, value):
    def change(config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_0"][key] = value
    return change


def _group_weights(key: str, value):
    def change(config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    return change


Q_A = L0 + "self_attn.q_a_proj.weight"
EXPERT = L1 + "mlp.experts.2.up_proj.weight"
ROWS = [
    # (id, base, mutation, fragments the error must contain)
    ("fp8 scale missing", "fp8", tensors_edit(_drop(Q_A + "_scale_inv")), [Q_A, "without its scale"]),
    ("fp8 scale without weight", "fp8", tensors_edit(_drop(Q_A)), [Q_A + "_scale_inv", "without its weight"]),
    ("fp8 scale shape", "fp8", tensors_edit(_replace(Q_A + "_scale_inv", lambda s: torch.ones(3, 2))),
     [Q_A + "_scale_inv", "[3, 2]", "[1, 2]"]),
    ("fp8 weight dtype", "fp8", tensors_edit(_replace(Q_A, lambda q: q.view(torch.int8))), [Q_A, "I8"]),
    ("shape vs config.json", "fp8", config_edit(lambda c: c.update(intermediate_size=300)),
     [L0 + "mlp.down_proj.weight", "disagrees with config.json", "[192, 300]"]),
    ("unknown dtype", "fp8", tensors_edit(_replace("model.norm.weight", lambda w: w.double())),
     ["model.norm.weight", "F64"]),
    ("unknown quant_method", "fp8", config_edit(_quant("quant_method", "awq")), ["quant_method", "awq"]),
    ("fp8 fmt", "fp8", config_edit(_quant("fmt", "e5m2")), ["fmt", "e5m2"]),
    ("fp8 without quantization_config", "fp8", config_edit(lambda c: c.pop("quantization_config")),
     ["_scale_inv", "'none'"]),
    ("unmapped tensor", "fp8", tensors_edit(_add(L0 + "mlp.extra_proj.weight", torch.ones(2, 2))),
     [L0 + "mlp.extra_proj.weight", "maps to no weight"]),
    ("experts in a dense layer", "fp8",
     tensors_edit(_add(L0 + "mlp.experts.0.gate_proj.weight", torch.ones(64, 192).bfloat16())),
     [L0 + "mlp.experts.0.gate_proj.weight", "dense"]),
    ("expert beyond n_routed_experts", "fp8",
     tensors_edit(_add(L1 + "mlp.experts.9.up_proj.weight", torch.ones(64, 192).bfloat16())),
     [L1 + "mlp.experts.9.up_proj.weight", "n_routed_experts 4"]),
    ("expert missing", "fp8", tensors_edit(_drop(EXPERT, EXPERT + "_scale_inv")),
     ["layers.1.moe.experts.w_up", "expert 2 is missing"]),
    ("fused and per expert", "fp8",
     tensors_edit(_add(L1 + "mlp.experts.down_proj", torch.ones(4, 192, 64).bfloat16())),
     ["both fused and per expert"]),
    ("layer beyond config", "fp8", tensors_edit(_add("model.layers.5.input_layernorm.weight", torch.ones(192))),
     ["model.layers.5.input_layernorm.weight", "num_nextn_predict_layers"]),
    ("head missing", "fp8", tensors_edit(_drop("lm_head.weight")), ["lm_head.weight", "no head"]),
    ("weight missing", "fp8", tensors_edit(_drop("model.norm.weight")), ["norm", "no tensor"]),
    ("index names a missing shard", "fp8",
     index_edit(lambda m: m.update({"model.norm.weight": "model-00009-of-00009.safetensors"})),
     ["model-00009-of-00009.safetensors", "missing"]),
    ("tensor not in index", "fp8", index_edit(lambda m: m.pop("model.norm.weight")),
     ["model.norm.weight", "not in model.safetensors.index.json"]),
    ("truncated shard", "fp8", lambda d: _truncate(sorted(d.glob("*.safetensors"))[0]),
     ["model-00001-of-", "not a readable safetensors file"]),
    ("config.json missing a field", "fp8", config_edit(lambda c: c.pop("kv_lora_rank")), ["kv_lora_rank"]),
    ("int4 scale missing", "int4", tensors_edit(_drop(EXPERT.replace("weight", "weight_scale"))),
     [EXPERT, "weight_scale"]),
    ("int4 weight_shape disagrees", "int4",
     tensors_edit(_replace(EXPERT.replace("weight", "weight_shape"), lambda s: torch.tensor([64, 160]))),
     [EXPERT.replace("weight", "weight_shape"), "[64, 160]", "[64, 192]"]),
    ("int4 ignored but packed", "int4", config_edit(_quant("ignore", ["lm_head", "re:.*"])),
     [EXPERT.split(".experts.")[0], "does not quantize"]),
    ("int4 quantized but stored plain", "int4", config_edit(_quant("ignore", ["lm_head"])),
     ["quantization_config quantizes model.layers.", "stores it unquantized"]),
    ("int4 asymmetric", "int4", config_edit(_group_weights("symmetric", False)), ["symmetric"]),
    ("int4 8 bits", "int4", config_edit(_group_weights("num_bits", 8)), ["num_bits", "8"]),
    ("int4 zero point", "int4",
     tensors_edit(_add(EXPERT.replace("weight", "weight_zero_point"), torch.zeros(8, 6, dtype=torch.int32))),
     ["weight_zero_point", "asymmetric"]),
    ("int4 quantized activations", "int4", config_edit(_group("input_activations", {"num_bits": 8, "type": "float"})),
     ["input_activations"]),
    ("ct fp8 static activations", "ct-fp8-block",
     config_edit(_group("input_activations", {"num_bits": 8, "type": "float", "strategy": "tensor"})),
     ["group_0.input_activations", "stored scales"]),
    ("ct fp8 strategy", "ct-fp8-block", config_edit(_group_weights("strategy", "tensor_group")),
     ["weights.strategy", "'tensor_group'", "'block'"]),
    ("ct fp8 block_structure", "ct-fp8-block", config_edit(_group_weights("block_structure", [128])),
     ["weights.block_structure", "[128]"]),
    ("ct fp4", "ct-fp8-block", config_edit(_group_weights("num_bits", 4)), ["weights.num_bits", "8", "4"]),
    ("ct format", "ct-fp8-block", config_edit(_quant("format", "nvfp4-pack-quantized")),
     ["format", "'nvfp4-pack-quantized'", "'float-quantized' (FP8)"]),
    ("ct kv cache", "ct-fp8-block", config_edit(_quant("kv_cache_scheme", {"num_bits": 8, "type": "float"})),
     ["kv_cache_scheme"]),
    ("ct fp8 scale shape", "ct-fp8-block",
     tensors_edit(_replace(Q_A.replace("weight", "weight_scale"), lambda s: torch.ones(3, 2))),
     [Q_A.replace("weight", "weight_scale"), "[3, 2]", "[1, 2]"]),
    ("ct fp8 ignored but scaled", "ct-fp8-block", config_edit(_quant("ignore", ["lm_head", "re:.*"])),
     [".weight_scale: an FP8 weight_scale, but quantization_config does not quantize model.layers."]),
    ("ct fp8 quantized but plain", "ct-fp8-channel",
     tensors_edit(lambda t: t.update({Q_A: t[Q_A].float().bfloat16()}) or t.pop(Q_A.replace("weight", "weight_scale"))),
     [Q_A, "quantizes", "float-quantized", "stores it unquantized"]),
]


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("base, mutate, fragments", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_checkpoint_names_the_problem(good, tmp_path, base, mutate, fragments):
    directory = tmp_path / "ckpt"
    shutil.copytree(good(base), directory)
    mutate(directory)
    with pytest.raises(CheckpointError) as error:
        load(plan_import(open_checkpoint(directory), layers=2))
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


def test_a_non_finite_fp8_value_is_an_error_naming_the_tensor(good, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(good("fp8"), directory)
    nan = torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    tensors_edit(_replace(Q_A, lambda q: torch.cat([nan.expand(1, q.shape[1]), q[1:]])))(directory)
    plan = plan_import(open_checkpoint(directory))          # headers are fine; the value is read at load
    with pytest.raises(CheckpointError, match=rf"{Q_A}: holds nan at \[0, 0\] \(F8_E4M3\)"):
        load(plan)


def test_a_product_beyond_float32_is_an_error_naming_the_weight(good, tmp_path):
    """A finite scale whose product with a weight overflows the stored float32: caught after dequantization."""
    directory = tmp_path / "ckpt"
    shutil.copytree(good("fp8"), directory)
    tensors_edit(_replace(Q_A + "_scale_inv", lambda s: torch.full_like(s, 3e38)))(directory)
    with pytest.raises(CheckpointError, match=rf"{Q_A}: dequantizes to a non-finite value at \["):
        load(plan_import(open_checkpoint(directory)))


@pytest.mark.parametrize("slice_, fragment", [({"layers": 3}, "--layers 3: the checkpoint has 2 layers"),
                                              ({"experts": 5}, "--experts 5: the checkpoint has 4"),
                                              ({"experts": 1}, "num_experts_per_tok")])
def test_an_impossible_slice_is_an_error(good, slice_, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        plan_import(open_checkpoint(good("fp8")), **slice_)


def test_text_config_and_top_level_quantization_must_agree(good, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(good("fp8"), directory)

    def nest(config: dict) -> None:
        text = dict(config)
        config.clear()
        config.update(text_config=text, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    config_edit(nest)(directory)
    with pytest.raises(CheckpointError, match="disagree"):
        open_checkpoint(directory)


def test_cli_reports_one_line_and_writes_nothing(good, tmp_path, refgen_process):
    directory = tmp_path / "ckpt"
    shutil.copytree(good("fp8"), directory)
    tensors_edit(_drop(Q_A + "_scale_inv"))(directory)
    out = tmp_path / "out"
    result = refgen_process("generate", "--checkpoint", directory, "--layers", 1, "--out", out)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"refgen: error: checkpoint {directory}: {Q_A}"), result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    for argv, fragment in ((["--layers", "2", "--preset", "tiny"], "give --checkpoint DIR"),
                           (["--checkpoint", tmp_path / "nowhere"], "does not exist")):
        result = refgen_process("generate", *argv, "--out", out)
        assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr
