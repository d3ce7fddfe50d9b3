"""`refgen export`: a fixture's model as an HF checkpoint directory. Imported back (`refgen generate
--checkpoint`'s reader) it is the fixture's weights bit for bit, float32 and bf16; HF transformers'
greedy `generate` on it gives the fixture's AR tokens; FP8 blocks dequantize as DeepSeek's format says,
to a model whose own fixture is generated beside it; bad requests are one-line errors that leave
nothing behind."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import kdtr_format
from kdtr_format.checkpoint_tensors import CheckpointTensors
from kdtr_format import PRESETS, ModelConfig, read_hf_config
from kdtr_format.hf_config import hf_config_dict
from refgen.checkpoint import load, open_checkpoint, plan_import
from refgen.export import MANIFEST, export, fp8_quantize, hf_tensors, token_text
from terminal import assert_clean_error, in_terminal, piped


@pytest.fixture(scope="module")
def exported(golden, tmp_path_factory):
    """(fixture, dtype) -> the export's directory: tiny float32 (two shards) and bf16, tiny2 float32."""
    out = {}
    for name, dtype, shard in (("tiny", "float32", 6 << 20), ("tiny", "bfloat16", 1 << 30),
                               ("tiny2", "float32", 1 << 30)):
        path = (golden / f"{name}.kdtr")
        with kdtr_format.open(path) as reader:
            directory = tmp_path_factory.mktemp("export") / f"{name}-{dtype}"
            out[name, dtype] = export(reader, path, directory, dtype, shard_bytes=shard).directory
    return out


def _tensors(directory) -> dict[str, str]:
    """Every stored tensor -> its safetensors dtype."""
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            found.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return found


@pytest.mark.parametrize("name, dtype", [("tiny", "float32"), ("tiny", "bfloat16"), ("tiny2", "float32")])
def test_import_gives_back_the_fixture_weights_bit_for_bit(golden, exported, name, dtype):
    directory = exported[name, dtype]
    imported = load(plan_import(open_checkpoint(directory)))
    prefix = "bf16/weights/" if dtype == "bfloat16" else "weights/"
    with kdtr_format.open((golden / f"{name}.kdtr")) as reader:
        assert imported.cfg == ModelConfig.from_dict(reader.metadata["config"])
        assert sorted(imported.weights) == sorted(n[len(prefix):] for n in reader.names(prefix))
        for weight, value in imported.weights.items():
            want = np.asarray(reader[prefix + weight]).astype(np.float32)
            assert np.array_equal(np.asarray(value, np.float32), want), weight
    stored = set(_tensors(directory).values())
    assert stored == ({"F32"} if dtype == "float32" else {"BF16", "F32"})
    assert (directory / "model.safetensors.index.json").is_file() == ((name, dtype) == ("tiny", "float32"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_config_reads_back_exactly_without_notes(name):
    data = json.loads(json.dumps(hf_config_dict(PRESETS[name], "bfloat16")))
    assert read_hf_config(data) == (PRESETS[name], [])
    assert data["architectures"] == ["DeepseekV3ForCausalLM"] and data["topk_method"] == "noaux_tc"


def test_the_names_are_the_published_ones(golden):
    """Per-expert experts, DeepSeek's attention names: as the checkpoints ship them."""
    cfg = ModelConfig.from_dict(kdtr_format.open((golden / "tiny.kdtr")).metadata["config"])
    w = np.zeros((cfg.n_routed_experts, 2, 3), np.float32)
    assert [n for n, _ in hf_tensors(cfg, "layers.1.moe.experts.w_up", w)][:2] == \
        ["model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"]
    assert next(hf_tensors(cfg, "layers.0.attn.wkv_a", w[0]))[0] == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert next(hf_tensors(cfg, "lm_head", w[0]))[0] == "lm_head.weight"


@pytest.mark.slow
def test_hf_greedy_generate_gives_the_ar_tokens(golden, exported):
    """transformers' DeepseekV3ForCausalLM.from_pretrained on the export, float32, greedy."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed (the test extra)")
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(exported["tiny", "float32"], dtype=torch.float32,
                                                                  experts_implementation="eager",
                                                                  attn_implementation="eager")
        with kdtr_format.open((golden / "tiny.kdtr")) as reader:
            for p in reader.metadata["prompts"]:
                prompt = torch.tensor(np.asarray(reader[f"prompts/{p['name']}/tokens"]))[None]
                want = np.asarray(reader[f"prompts/{p['name']}/ar/tokens"]).tolist()
                with torch.no_grad():
                    out = model.generate(prompt, max_new_tokens=len(want), do_sample=False)
                assert out[0, prompt.shape[1]:].tolist() == want, p["name"]
    finally:
        torch.set_num_threads(threads)


def test_manifest_and_tokenizer(golden, exported):
    directory = exported["tiny", "bfloat16"]
    manifest = json.loads((directory / MANIFEST).read_text())
    assert (manifest["dtype"], manifest["regime"], manifest["fixture"]) == ("bfloat16", "bfloat16", "tiny.kdtr")
    with kdtr_format.open(directory / "tiny.kdtr") as reader:
        assert manifest["source"]["content_hash"] == reader.metadata["content_hash"]
        assert manifest["margin_threshold"] == reader.metadata["bf16"]["bf16_margin_threshold"]
        for p in manifest["prompts"]:
            assert p["tokens"] == np.asarray(reader[f"bf16/prompts/{p['name']}/tokens"]).tolist()
            assert p["ar_tokens"] == np.asarray(reader[f"bf16/prompts/{p['name']}/ar/tokens"]).tolist()
    config = json.loads((directory / "config.json").read_text())
    assert config["scoring_func"] == "sigmoid" and config["eos_token_id"] is None
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed (the test extra)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [0, 5, 1023, 17]
    assert tokenizer.decode(ids) == " ".join(map(token_text, ids))
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


def test_fp8_blocks_dequantize_exactly_to_the_fp8_model(golden, tmp_path):
    """DeepSeek's FP8 form, partial edge blocks (tiny's 96 / 80 / 64 rows at block 64): q * scale_inv,
    computed here from the stored bits, is what the importer gives and what the generated fixture holds;
    every scale a power of two, every weight within e4m3's rounding of the fixture's."""
    path = (golden / "tiny.kdtr")
    with kdtr_format.open(path) as reader:
        written = export(reader, path, tmp_path / "tiny-fp8", "fp8", block=(64, 64))
        fixture_weights = {n[len("weights/"):]: np.asarray(reader[n]) for n in reader.names("weights/")}
    directory = written.directory
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64],
                                             "activation_scheme": "dynamic"}
    raw, checked = _stored_arrays(directory / "model.safetensors"), 0
    imported = load(plan_import(open_checkpoint(directory)))
    cfg = imported.cfg
    for weight, value in imported.weights.items():
        for hf_name, _ in hf_tensors(cfg, weight, np.asarray(value)):
            if hf_name + "_scale_inv" not in raw:
                continue
            q, scale = raw[hf_name].astype(np.float64), raw[hf_name + "_scale_inv"].astype(np.float64)
            assert np.all(np.exp2(np.round(np.log2(scale))) == scale)
            rows, cols = q.shape
            full = np.repeat(np.repeat(scale, 64, axis=0), 64, axis=1)[:rows, :cols]
            part = np.asarray(value)[int(hf_name.split(".experts.")[1].split(".")[0])] if ".experts." in hf_name \
                else np.asarray(value)
            assert np.array_equal(part.astype(np.float64), q * full), hf_name
            checked += 1
    assert checked == sum(1 for name in raw if name.endswith("_scale_inv")) > 0
    for weight, value in imported.weights.items():
        original = fixture_weights[weight]
        assert np.all(np.abs(np.asarray(value) - original) <= 2 ** -4 * np.abs(original) + 2 ** -9 * np.abs(original).max())
    with kdtr_format.open(directory / written.fixture) as reader:
        assert reader.metadata["checkpoint"]["format"] == "fp8"
        taken = CheckpointTensors(reader.metadata)         # a checkpoint fixture names its weights
        for weight, value in imported.weights.items():
            assert np.array_equal(taken.array(f"weights/{weight}"), np.asarray(value, np.float32))
            assert np.array_equal(taken.array(f"bf16/weights/{weight}").astype(np.float32),
                                  np.asarray(value, np.float32))
    assert written.manifest["regime"] == "bfloat16" and written.manifest["prompts"]


def _stored_arrays(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, read from its header here (safetensors' numpy reader cannot
    return float8, safetensors issue #682)."""
    dtypes = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return {name: np.frombuffer(data[8 + length + spec["data_offsets"][0]:8 + length + spec["data_offsets"][1]],
                                dtypes[spec["dtype"]]).reshape(spec["shape"]) for name, spec in header.items()}


def test_fp8_quantize_rounds_each_block_to_nearest():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(70, 130)).astype(np.float32)
    w[:, 128:] = 0.0                                      # an all-zero edge block: scale 1
    q, scale = fp8_quantize(w, (64, 128))
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and scale.shape == (2, 2) and scale[0, 1] == 1.0
    full = np.repeat(np.repeat(scale, 64, 0), 128, 1)[:70, :130].astype(np.float64)
    assert float(np.abs(q.astype(np.float64)).max()) <= 448.0
    assert np.array_equal(q.astype(np.float64), (w / full).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    for r, c in ((0, 0), (1, 0)):                         # the smallest power of two: amax / scale in (224, 448]
        ratio = float(np.abs(w[64 * r:64 * (r + 1), :128]).max() / scale[r, c])
        assert 224.0 < ratio <= 448.0 and math.log2(scale[r, c]).is_integer()


def test_draft_model_is_the_first_layers(golden, tmp_path):
    path = (golden / "tiny.kdtr")
    with kdtr_format.open(path) as reader:
        written = export(reader, path, tmp_path / "draft", layers=2)
        imported = load(plan_import(open_checkpoint(written.directory)))
        assert imported.cfg.num_hidden_layers == 2 and written.fixture is None and written.manifest["draft"]
        for weight, value in imported.weights.items():
            assert np.array_equal(np.asarray(value), np.asarray(reader[f"weights/{weight}"])), weight


def test_cli_errors_are_one_line_and_leave_nothing(golden, tmp_path, refgen_cli):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    tiny = str((golden / "tiny.kdtr"))
    for args, mentions in (([tiny, "--out", full], "is not an empty directory"),
                           ([tiny, "--out", tmp_path / "a", "--layers", "9"], "--layers 9"),
                           ([tiny, "--out", tmp_path / "b", "--fp8-block", "16"], "--fp8-block"),
                           ([tiny, "--out", tmp_path / "tiny", "--dtype", "fp8"], "a preset's name"),
                           ([(golden / "kernels/corpus.kdtr"), "--out", tmp_path / "c"], "not a model fixture")):
        result = refgen_cli("export", *args)
        assert result.exit_code == 2 and mentions in result.output and len(result.output.splitlines()) == 1, \
            result.output
    assert_clean_error(piped(["refgen", "export", tiny, "--out", str(full)]), "is not an empty directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_failed_write_leaves_nothing(golden, tmp_path, monkeypatch):
    import refgen.export

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(refgen.export, "save_file", broken)
    path = (golden / "tiny.kdtr")
    with kdtr_format.open(path) as reader, pytest.raises(OSError):
        export(reader, path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_in_a_terminal(golden, tmp_path):
    out = tmp_path / "t2"
    result = in_terminal(["refgen", "export", str((golden / "tiny2.kdtr")), "--out", str(out)], columns=80)
    assert result.returncode == 0, result.output
    assert f"kdtree validate --server URL --fixtures {out}" in result.output
    assert all(len(line) <= 80 for line in result.screen_lines if str(out) not in line), result.output
    assert "rope_style neox" in result.output                     # what vLLM and SGLang compute otherwise
