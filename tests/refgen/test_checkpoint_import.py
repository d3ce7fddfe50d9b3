"""Importing checkpoints in the layouts DeepSeek-V3 / Kimi K2.x ship (refgen/checkpoint.py).

The checkpoints are written by tests/synthetic_checkpoint.py, independently of refgen: torch
quantizes DeepSeek's FP8 blocks, compressed-tensors packs INT4 and quantizes float-quantized FP8,
and the same module computes what each weight dequantizes to with its own formulas (compressed-
tensors' own decompressor for float-quantized). Checked: every tensor is accounted for (kept, sliced
away, MTP, outside the language model); the dequantized weights equal the independent formulas
bit for bit (float64 from kdtr_format.dequant, float32 as stored); the slice keeps the first layers and
experts and the router rows to match; the reference on the imported weights gives the logits of
the reference on the float weights, and its lazy path the numbers of the eager one; and
`refgen generate --checkpoint` writes a fixture that references the checkpoint's tensors (and
holds no weight) and that `refgen verify` regenerates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import kdtr_format
from kdtr_format import ModelConfig
from refgen import model as reference
from refgen.checkpoint import load, open_checkpoint, plan_import
from refgen.model import KVCache, Model
from kdtr_format.checkpoint_tensors import KEY as CHECKPOINT_TENSORS
from kdtr_format.checkpoint_tensors import CheckpointTensors
from kdtr_format.dequant import fp8_scaled, int4_packed
from refgen.quant import WeightScheme
from refgen.regen import REGEN_REL, tensor_drift
from refgen.weights import init_weights, weight_shapes
from synthetic_checkpoint import (SMALL, Layout, ct_fp8_compress, ct_fp8_dequantize, needs_compressed_tensors,
                                  write_checkpoint)
from terminal import in_terminal

LAYOUTS = {
    "fp8": Layout(quant="fp8", mtp=True),                           # DeepSeek-V3 / Kimi K2, MTP layer
    "fp8-fused": Layout(quant="fp8", experts="fused"),              # transformers 5.x save of an FP8 model
    "int4-k25": Layout(quant="int4", multimodal=True),              # Kimi K2.5: text_config, vision tower
    "bf16-fused": Layout(experts="fused", shard_bytes=200_000),
    "ct-fp8-block": Layout(quant="ct-fp8-block"),                   # llm-compressor FP8_BLOCK: 128 x 128, float32
    "ct-fp8-channel": Layout(quant="ct-fp8-channel"),               # FP8_DYNAMIC: a bf16 scale a row
}
SLICE = {"layers": 2, "experts": 4}
# SMALL routes over n_group 2 groups of 4: the slice keeps the first 2 experts of each group
GROUP = SMALL.n_routed_experts // SMALL.n_group
KEPT = [g * GROUP + j for g in range(SMALL.n_group) for j in range(SLICE["experts"] // SMALL.n_group)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """layout name -> (directory, Written); written once per module, on demand."""
    made = {}

    def get(name: str):
        if name not in made:
            directory = tmp_path_factory.mktemp(f"ckpt-{name}")
            made[name] = directory, write_checkpoint(directory, SMALL, init_weights(SMALL, 5), LAYOUTS[name])
        return made[name]
    return get


def _kept(name: str, value: np.ndarray) -> np.ndarray:
    """A full-model weight cut to SLICE: the kept experts and their router rows."""
    if ".experts." in name or name.endswith(("moe.gate", "moe.e_score_correction_bias")):
        return value[KEPT]
    return value


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_tensor_is_accounted_for(checkpoints, layout):
    directory, written = checkpoints(layout)
    plan = plan_import(open_checkpoint(directory), **SLICE)
    imported = load(plan)
    assert sum(plan.counts.values()) == len(written.names)
    mtp = [n for n in written.names if f"layers.{SMALL.num_hidden_layers}." in n]
    outside = [n for n in written.names if n.startswith(("vision_tower.", "mm_projector."))]
    assert plan.counts["mtp"] == len(mtp) and (len(mtp) > 0) == LAYOUTS[layout].mtp
    assert plan.mtp_names == sorted(mtp)
    assert plan.counts["outside"] == len(outside) == (2 if LAYOUTS[layout].multimodal else 0)
    kept = {n for n in written.names if n not in mtp and n not in outside
            and ".layers.2." not in n and not any(f".experts.{e}." in n for e in set(range(8)) - set(KEPT))}
    assert set(imported.referenced) | {n for n in kept if n.endswith("weight_shape")} == kept
    assert plan.counts["kept"] == len(kept)
    assert set(imported.weights) == set(weight_shapes(plan.cfg))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dequantized_weights_equal_the_independent_formulas(checkpoints, layout):
    """float32 as stored: the independent float64 value rounded once; bf16 views exact."""
    directory, written = checkpoints(layout)
    imported = load(plan_import(open_checkpoint(directory), **SLICE))
    for name, value in imported.weights.items():
        expected = _kept(name, written.dequantized[name])
        assert np.asarray(value).dtype in (np.float32, reference.NARROW[2]), name
        np.testing.assert_array_equal(np.asarray(value, np.float64), expected.astype(np.float32), err_msg=name)


def test_fp8_scaled_dequant_is_exact_in_float64(checkpoints):
    """kdtr_format.dequant.fp8_scaled in float64 == torch's e4m3 decode times the expanded scales, for every FP8
    tensor (partial row and column blocks among them: 80 x 192, 96 x 192, 256 x 64)."""
    directory, _ = checkpoints("fp8")
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    scaled = [n for n in tensors if n.endswith(".weight_scale_inv")]
    assert len(scaled) > 20
    shapes = {tuple(tensors[n.removesuffix("_scale_inv")].shape) for n in scaled}
    assert any(r % 128 and c % 128 for r, c in shapes), shapes
    for name in scaled:
        q, s = tensors[name.removesuffix("_scale_inv")], tensors[name]
        r, c = q.shape
        independent = (q.double() * s.double().repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c])
        ours = fp8_scaled(q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), s.numpy(), (128, 128))
        np.testing.assert_array_equal(ours, independent.numpy(), err_msg=name)


def test_int4_dequant_is_exact_in_float64(checkpoints):
    """kdtr_format.dequant.int4_packed in float64 == compressed-tensors' own unpack times the group scales."""
    directory, _ = checkpoints("int4-k25")             # skips where compressed-tensors is absent
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    packed = [n for n in tensors if n.endswith(".weight_packed")]
    assert len(packed) == 3 * 2 * SMALL.n_routed_experts
    for name in packed:
        module = name.removesuffix(".weight_packed")
        shape = tuple(tensors[module + ".weight_shape"].tolist())
        scale = tensors[module + ".weight_scale"]
        q = unpack_from_int32(tensors[name], 4, torch.Size(shape))
        independent = q.double() * scale.double().repeat_interleave(32, -1)
        ours = int4_packed(tensors[name].numpy(), scale.float().numpy(), shape, 32)
        np.testing.assert_array_equal(ours, independent.numpy(), err_msg=name)


@pytest.mark.parametrize("layout", ["ct-fp8-block", "ct-fp8-channel"])
def test_float_quantized_fp8_is_read_as_float_quantized(checkpoints, layout):
    """The formats recorded, and bf16 scales (FP8_DYNAMIC) giving float32 weights that are the exact
    products compressed-tensors' decompressor computes in float64 (4 + 8 significant bits)."""
    directory, written = checkpoints(layout)
    imported = load(plan_import(open_checkpoint(directory), **SLICE))
    assert imported.metadata["format"] == "float-quantized"
    assert {entry["decode"] for entry in imported.entries.values()} == {"plain", "fp8"}
    scale = imported.referenced["model.layers.0.self_attn.q_a_proj.weight_scale"]
    assert (scale["dtype"], scale["shape"]) == (("BF16", [96, 1]) if layout == "ct-fp8-channel" else ("F32", [1, 2]))
    if layout == "ct-fp8-channel":
        for name in ("layers.0.attn.wq_a", "layers.1.moe.experts.w_down"):
            np.testing.assert_array_equal(np.asarray(imported.weights[name], np.float64),
                                          _kept(name, written.dequantized[name]), err_msg=name)


STRATEGIES = {  # strategy -> (compressed-tensors' QuantizationArgs extras, refgen's WeightScheme)
    "tensor": ({}, WeightScheme(("Linear",), "float-quantized", "tensor")),
    "channel": ({}, WeightScheme(("Linear",), "float-quantized", "channel")),
    "group": ({"group_size": 32}, WeightScheme(("Linear",), "float-quantized", "group", group_size=32)),
    "block": ({"block_structure": [64, 128]},
              WeightScheme(("Linear",), "float-quantized", "block", block_structure=(64, 128))),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fp8_scales_of_every_strategy_match_the_decompressor(strategy):
    """kdtr_format.dequant.fp8_scaled in float64 == compressed-tensors' decompressor in float64, for each FP8
    strategy: the scale shape it stores and the products (200 x 320: partial blocks under 64 x 128)."""
    needs_compressed_tensors()
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    extras, ours = STRATEGIES[strategy]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy=strategy, **extras))
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(200, 320, generator=generator) * torch.rand(200, 1, generator=generator) * 4
    compressed = ct_fp8_compress(w, scheme)
    q = compressed["weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    scale = compressed["weight_scale"].numpy()
    assert scale.shape == ours.scale_shape(200, 320)
    b0, b1 = ours.block(200, 320)
    got = fp8_scaled(q, scale.reshape(-(-200 // b0), -(-320 // b1)), (b0, b1))
    np.testing.assert_array_equal(got, ct_fp8_dequantize(compressed, scheme))


def test_int4_nibble_order_and_offset():
    """A hand-packed word: element j of a row is nibble j % 8 of word j // 8, lowest first, stored + 8."""
    values = np.array([-8, -1, 0, 1, 7, 3, -5, 2], dtype=np.int64)
    word = sum(int(v + 8) << (4 * j) for j, v in enumerate(values))
    packed = np.array([[word]], dtype=np.uint32).view(np.int32)
    got = int4_packed(packed, np.array([[0.5]], np.float32), (1, 8), 8)
    np.testing.assert_array_equal(got, values[None] * 0.5)


def test_slice_keeps_the_first_layers_and_experts(checkpoints):
    directory, written = checkpoints("fp8")
    ckpt = open_checkpoint(directory)
    plan = plan_import(ckpt, **SLICE)
    imported = load(plan)
    assert dataclasses.replace(SMALL, num_hidden_layers=2, n_routed_experts=4) == plan.cfg
    gate = np.asarray(imported.weights["layers.1.moe.gate"], np.float64)
    np.testing.assert_array_equal(gate, written.dequantized["layers.1.moe.gate"][KEPT])
    router = imported.referenced["model.layers.1.mlp.gate.weight"]
    assert router["shape"] == [4, SMALL.hidden_size] and len(router["ranges"]) == SMALL.n_group   # runs 0-1, 4-5
    assert imported.metadata["layers"] == 2 and imported.metadata["num_hidden_layers"] == 3
    assert imported.metadata["kept_experts"] == KEPT == [0, 1, 4, 5]
    mtp = [n for n in written.names if ".layers.3." in n]
    assert imported.metadata["mtp"] == {"layers": [3], "declared": 1, "tensors": len(mtp), "kept": False}
    assert ckpt.config_notes and set(ckpt.config_notes) < set(plan.notes)     # read_hf_config's, then the import's
    assert [n.split()[0] for n in plan.notes[len(ckpt.config_notes):]] == ["layers", "routed", "MTP"]
    full = plan_import(ckpt)                               # no slice: every layer and expert, MTP still out
    assert full.cfg == SMALL and full.counts["sliced"] == 0 and full.counts["mtp"] == len(mtp)
    dense = plan_import(ckpt, layers=1)                    # only the dense layer: no router, no experts
    assert dense.cfg.first_k_dense_replace == 1 and not any(".moe." in name for name in dense.weights)


def test_fused_experts_are_split_into_gate_and_up(checkpoints):
    directory, written = checkpoints("bf16-fused")
    imported = load(plan_import(open_checkpoint(directory), **SLICE))
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    fused = tensors["model.layers.1.mlp.experts.gate_up_proj"][KEPT].float().numpy()
    I = SMALL.moe_intermediate_size
    np.testing.assert_array_equal(np.asarray(imported.weights["layers.1.moe.experts.w_up"], np.float32),
                                  fused[:, I:])
    entry = imported.entries["weights/layers.1.moe.experts.w_up"]
    assert (entry["decode"], entry["rows"], entry["tensors"]["data"]["shape"]) == \
        ("plain", [I, 2 * I], [4, 2 * I, SMALL.hidden_size])


@pytest.mark.parametrize("layout", ["fp8", "int4-k25"])
def test_reference_on_imported_weights_is_the_reference_on_the_float_weights(checkpoints, layout):
    directory, written = checkpoints(layout)
    imported = load(plan_import(open_checkpoint(directory), **SLICE))
    floats = {name: _kept(name, written.dequantized[name]).astype(np.float32) for name in imported.weights}
    prompt = np.arange(3, 40, 3)
    ours = Model(imported.cfg, imported.weights).prefill(prompt, KVCache.new(imported.cfg, len(prompt)))
    expected = Model(imported.cfg, floats).prefill(prompt, KVCache.new(imported.cfg, len(prompt)))
    np.testing.assert_array_equal(ours, expected)


def _same_numbers(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal to the rounding of a BLAS block: 1e-13 of the largest value, within what a regeneration
    allows of logits (REGEN_REL of their spread)."""
    assert actual.dtype == expected.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-13 * np.abs(expected).max())
    assert tensor_drift(expected, actual, REGEN_REL * float(np.std(expected))) is None


def test_float64_weights_widen_exactly_by_rows_and_blocks(monkeypatch):
    """The lazy accessors against plain numpy widening: rows and whole tensors bit for bit; products
    a block of rows at a time (blocks of 7 rows of 50, the last partial), for bf16 and float32 storage,
    to the rounding of a BLAS block."""
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", 7 * 24)
    rng = np.random.default_rng(0)
    stored = {"bf16": rng.standard_normal((50, 24)).astype(ml_dtypes.bfloat16),
              "f32": rng.standard_normal((3, 50, 24)).astype(np.float32)}
    w = reference.Float64Weights(stored, budget=0)
    x = rng.standard_normal((5, 24))
    wide = {name: np.asarray(value, np.float64) for name, value in stored.items()}
    _same_numbers(w.project(x, "bf16"), x @ wide["bf16"].T)
    _same_numbers(w.project(x[:1], "f32", 2), x[:1] @ wide["f32"][2].T)
    np.testing.assert_array_equal(w.rows("bf16", np.array([4, 4, 49])), wide["bf16"][[4, 4, 49]])
    np.testing.assert_array_equal(w.rows("f32", 1), wide["f32"][1])
    np.testing.assert_array_equal(w["f32"], wide["f32"])
    assert w.rows("f32", 1).dtype == w.project(x, "bf16").dtype == np.float64
    within = reference.Float64Weights(stored, budget=50 * 24 * 8)       # room for the smaller one only
    assert within._stored["bf16"].dtype == np.float64 and within._stored["f32"].dtype == np.float32


def test_lazy_widening_gives_the_numbers_of_eager_widening(checkpoints, monkeypatch):
    """Every weight kept narrow and widened where used, 100 rows at a time: the logits of every
    weight widened up front, to the rounding of a BLAS block; on two threads, the same bits."""
    directory, _ = checkpoints("fp8")
    imported = load(plan_import(open_checkpoint(directory), **SLICE))
    monkeypatch.setattr(reference, "BLOCK_ELEMENTS", 100 * SMALL.hidden_size)
    prompt = np.arange(5, 30)
    cfg = imported.cfg
    lazy = Model(cfg, imported.weights, widen_budget=0)
    assert all(lazy.w._stored[n].dtype != np.float64 for n in imported.weights)
    eager = Model(cfg, {n: np.asarray(w, np.float64) for n, w in imported.weights.items()})
    for positions in (np.arange(len(prompt)), np.array([7])):
        tokens = prompt[:len(positions)]
        visibility = reference.causal_visibility(len(tokens), 0)
        a = lazy.forward(tokens, positions, visibility, KVCache.new(cfg, 32), 0)
        b = eager.forward(tokens, positions, visibility, KVCache.new(cfg, 32), 0)
        _same_numbers(a, b)
        reference.set_threads(2)
        try:
            threaded = lazy.forward(tokens, positions, visibility, KVCache.new(cfg, 32), 0)
        finally:
            reference.set_threads(1)
        np.testing.assert_array_equal(threaded, a)


def test_generate_references_the_checkpoint_and_verify_regenerates(checkpoints, refgen_process, tmp_path):
    """Run in a terminal 80 columns wide: two progress bars (reading, by bytes; the cases) with the time
    left, within the width. The fixture holds the references and no weight: each weights/<name> is a
    checkpoint_tensors entry that kdtr_format rebuilds from the checkpoint's own bytes (their sha256
    recorded) to the independent dequantization, and bf16/weights/<name> its bf16 rounding."""
    directory, written = checkpoints("int4-k25")
    result = in_terminal(["refgen", "generate", "--checkpoint", str(directory), "--layers", "2", "--experts", "4",
                          "--out", str(tmp_path)], columns=80)
    assert result.returncode == 0, result.output
    assert "MTP" not in result.output and "outside the language model" in result.output
    bars = [line for line in result.screen_lines if re.search(r" left +(\d+:\d\d:\d\d|-:--:--)", line)]
    assert any("reading the checkpoint" in line for line in bars) and any(".kdtr" in line for line in bars), bars
    assert result.widest <= 80, result.screen_lines
    path = tmp_path / f"{directory.name}-layers2-experts4.kdtr"
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    with kdtr_format.open(path) as fixture:
        meta = fixture.metadata
        assert (meta["kind"], meta["source"], meta["preset"]) == ("model", "checkpoint", path.stem)
        assert ModelConfig.from_dict(meta["config"]) == dataclasses.replace(SMALL, num_hidden_layers=2,
                                                                             n_routed_experts=4)
        origin = meta["checkpoint"]
        assert origin["format"] == "pack-quantized" and origin["quantization_config"]["format"] == "pack-quantized"
        assert origin["config"] == written.config["text_config"]
        assert not fixture.names("weights/") and not fixture.names("bf16/weights/") and fixture.names("prompts/")
        rebuilt = CheckpointTensors(meta)
        names = weight_shapes(ModelConfig.from_dict(meta["config"]))
        assert rebuilt.names() == sorted([f"weights/{n}" for n in names] + [f"bf16/weights/{n}" for n in names])
        for name in names:
            value = rebuilt.array(f"weights/{name}")
            assert value.dtype == np.float32, name
            expected = _kept(name, written.dequantized[name]).astype(np.float32)
            np.testing.assert_array_equal(value, expected, err_msg=name)
            np.testing.assert_array_equal(rebuilt.array(f"bf16/weights/{name}"), expected.astype(ml_dtypes.bfloat16))
        experts = meta[CHECKPOINT_TENSORS]["weights/layers.1.moe.experts.w_gate"]
        assert experts["decode"] == "int4" and [part["packed"]["tensor"] for part in experts["experts"]] == [
            f"language_model.model.layers.1.mlp.experts.{e}.gate_proj.weight_packed" for e in KEPT]
        for part in experts["experts"]:
            for ref in part.values():
                original = tensors[ref["tensor"]].contiguous().view(torch.uint8).numpy().tobytes()
                assert hashlib.sha256(original).hexdigest() == ref["sha256"], ref["tensor"]
    verify = refgen_process("verify", path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
