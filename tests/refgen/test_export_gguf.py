"""`refgen export --gguf`: the model as one GGUF file for llama.cpp. Read back with gguf's reader it
holds the export's weights under llama.cpp's deepseek2 names (kv_b split for the absorbed MLA, experts
stacked), a bfloat16 export's rounded to bfloat16, and a vocabulary whose text of a reply splits into
the export's tokenizer.json words; it is what llama.cpp's own converter writes for the same checkpoint,
float32 and bfloat16 (where the converter of the llama.cpp that scripts/engines installs is on this
machine); and llama.cpp's server, where built, loads it, maps ids to text and back as the exported
tokenizer does and serves the fixture's AR tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kdtr_format
from exports import exported_weights
from refgen.export import export
from refgen.export_gguf import GGUF_FILE

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (the test extra)")

LLAMA = Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree") / "engines" / "llama-cpp"
CONVERTER = LLAMA / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SERVER = LLAMA / "build" / "bin" / "llama-server"


def _tiny(committed_golden, tmp_path_factory, dtype: str):
    path = committed_golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader:
        return export(reader, path, tmp_path_factory.mktemp("gguf") / f"tiny-{dtype}", dtype=dtype, gguf=True)


@pytest.fixture(scope="module")
def tiny_gguf(committed_golden, tmp_path_factory):
    return _tiny(committed_golden, tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def tiny_gguf_bf16(committed_golden, tmp_path_factory):
    return _tiny(committed_golden, tmp_path_factory, "bfloat16")


def _tensors(directory) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(directory / GGUF_FILE).tensors}


def _fields(directory) -> dict:
    return {f.name: f.contents() for f in gguf.GGUFReader(directory / GGUF_FILE).fields.values()}


def test_the_gguf_holds_the_exports_weights_under_llama_cpps_names(tiny_gguf):
    tensors = {name: np.asarray(t.data) for name, t in _tensors(tiny_gguf.directory).items()}
    stored = exported_weights(tiny_gguf.directory)
    H, dn, dv, R = 4, 32, 32, 64
    kv_b = stored["model.layers.2.self_attn.kv_b_proj.weight"].reshape(H, dn + dv, R)
    assert np.array_equal(tensors["blk.2.attn_k_b.weight"], kv_b[:, :dn].transpose(0, 2, 1))
    assert np.array_equal(tensors["blk.2.attn_v_b.weight"], kv_b[:, dn:])
    assert np.array_equal(tensors["blk.1.ffn_up_exps.weight"][3], stored["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert np.array_equal(tensors["blk.1.exp_probs_b.bias"], stored["model.layers.1.mlp.gate.e_score_correction_bias"])
    for gguf_name, hf_name in (("token_embd.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight"),
                               ("blk.0.attn_q_a.weight", "model.layers.0.self_attn.q_a_proj.weight"),
                               ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")):
        assert np.array_equal(tensors[gguf_name], stored[hf_name]), gguf_name
    fields = _fields(tiny_gguf.directory)
    assert fields["general.architecture"] == "deepseek2" and fields["deepseek2.attention.head_count_kv"] == 1
    assert fields["deepseek2.attention.key_length"] == 64 + 16 and fields["deepseek2.attention.value_length_mla"] == 32
    assert fields["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)


def test_gguf_with_fp8_is_one_line_and_leaves_nothing(committed_golden, tmp_path, refgen_cli):
    result = refgen_cli("export", committed_golden / "tiny.kdtr", "--out", tmp_path / "out", "--gguf", "--dtype", "fp8")
    assert result.exit_code == 2 and "not with --dtype fp8" in result.output and len(result.output.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_replys_text_splits_into_the_exports_words(tiny_gguf):
    """llama.cpp's `rwkv` vocabulary detokenizes ids to their tokens' bytes one after another (a
    backslash would escape): those of a reply split, as the client splits a reply's text, into the
    words tokenizer.json gives the same ids. No special token: none ends generation."""
    fields = _fields(tiny_gguf.directory)
    tokens = fields["tokenizer.ggml.tokens"]
    words = json.loads((tiny_gguf.directory / "tokenizer.json").read_text())["model"]["vocab"]
    assert fields["tokenizer.ggml.model"] == "rwkv" and len(tokens) == len(words) == 1024
    assert not any("\\" in token for token in tokens)
    assert set(fields["tokenizer.ggml.token_type"]) == {gguf.TokenType.NORMAL}
    assert not [key for key in fields if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")]
    reply = [762, 465, 5, 1023, 17, 0, 100, 10]
    assert [words[word] for word in "".join(tokens[i] for i in reply).split()] == reply


def test_a_bfloat16_gguf_holds_the_float32_weights_rounded(tiny_gguf, tiny_gguf_bf16):
    """Each tensor of the bfloat16 export's GGUF, read back, is the float32 one's rounded to bfloat16,
    same shape (tiny's bfloat16 weights are its float32 ones rounded); BF16 but the vectors and the
    router, F32 as the converter keeps them."""
    f32, bf16 = _tensors(tiny_gguf.directory), _tensors(tiny_gguf_bf16.directory)
    assert sorted(f32) == sorted(bf16)
    for name, t in bf16.items():
        f32_kept = len(t.shape) == 1 or name.endswith("ffn_gate_inp.weight")
        kept = gguf.GGMLQuantizationType.F32 if f32_kept else gguf.GGMLQuantizationType.BF16
        assert t.tensor_type == kept, name
        value = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        want = np.asarray(f32[name].data).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert value.shape == want.shape and np.array_equal(value, want), name


@pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
                    reason="llama.cpp's converter is not on this machine (scripts/engines/install.py llama-cpp)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gguf_is_what_llama_cpps_converter_writes(dtype, request, tmp_path):
    """The converter of the llama.cpp scripts/engines builds, on the same checkpoint, its vocabulary
    step skipped (it refuses the word-level tokenizer): the same tensors (names, types, bytes) and the
    same model keys."""
    pytest.importorskip("torch")
    tiny_gguf = request.getfixturevalue({"float32": "tiny_gguf", "bfloat16": "tiny_gguf_bf16"}[dtype])
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    script = (f"import sys, runpy; sys.path[:0] = [{str(CONVERTER)!r}, {str(CONVERTER / 'gguf-py')!r}]\n"
              "import conversion.deepseek as d; d.DeepseekV2Model.set_vocab = lambda self: None\n"
              f"sys.argv = ['convert', {str(tiny_gguf.directory)!r}, '--outfile', {str(tmp_path / 'c.gguf')!r},"
              f" '--outtype', {outtype!r}]\n"
              f"runpy.run_path({str(CONVERTER / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs, ours = gguf.GGUFReader(tmp_path / "c.gguf"), gguf.GGUFReader(tiny_gguf.directory / GGUF_FILE)

    def model_fields(reader):
        return {f.name: f.contents() for f in reader.fields.values()
                if not f.name.startswith(("GGUF.", "general.", "tokenizer."))}

    assert model_fields(ours) == model_fields(theirs)
    mine = {t.name: np.asarray(t.data) for t in ours.tensors}
    assert sorted(mine) == sorted(t.name for t in theirs.tensors)
    types = {t.name: t.tensor_type for t in ours.tensors}
    for t in theirs.tensors:
        assert types[t.name] == t.tensor_type and np.array_equal(mine[t.name], np.asarray(t.data)), t.name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


@pytest.mark.skipif(not SERVER.is_file(), reason="llama.cpp is not built here (scripts/engines/install.py llama-cpp)")
def test_llama_cpp_serves_the_ar_tokens_of_a_model_without_yarn(tmp_path, refgen_process):
    """mla-small without YaRN (llama.cpp's YaRN differs from the reference's: docs/serving.md), generated
    here: llama-server loads the GGUF, detokenizes [5, 17, 1023] as " t5 t17 t1023" and tokenizes that
    back, and serves every prompt's AR tokens, greedy, float32 KV cache."""
    from kdtr_format import PRESETS
    from kdtr_format.hf_config import hf_config_dict

    config = hf_config_dict(PRESETS["mla-small"], "float32")
    del config["rope_scaling"]
    (tmp_path / "plain.json").write_text(json.dumps(config))
    assert refgen_process("generate", "--config-file", tmp_path / "plain.json", "--out", tmp_path).returncode == 0
    with kdtr_format.open(tmp_path / "plain.kdtr") as reader:
        written = export(reader, tmp_path / "plain.kdtr", tmp_path / "export", gguf=True)
    port = _free_port()
    server = subprocess.Popen([str(SERVER), "-m", str(written.directory / GGUF_FILE), "--host", "127.0.0.1",
                               "--port", str(port), "-t", "1", "-c", "512", "-np", "1", "-ctk", "f32", "-ctv", "f32"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "llama-server did not start"
                time.sleep(0.5)
        assert _post(port, "/detokenize", {"tokens": [5, 17, 1023]})["content"] == " t5 t17 t1023"
        assert _post(port, "/tokenize", {"content": " t5 t17 t1023"})["tokens"] == [5, 17, 1023]
        for prompt in written.manifest["prompts"]:
            reply = _post(port, "/completion", {"prompt": prompt["tokens"], "n_predict": len(prompt["ar_tokens"]),
                                                "temperature": 0, "return_tokens": True, "ignore_eos": True,
                                                "cache_prompt": False})
            assert reply["tokens"] == prompt["ar_tokens"], prompt["name"]
    finally:
        server.terminate()
        server.wait(timeout=30)
