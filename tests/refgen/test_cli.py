"""The `refgen` command: verify passes on the committed fixtures and fails on one
changed tensor; generate from an HF-style config.json; an impossible config or a
failed write is one line and leaves nothing half-written. (Hostile arguments,
terminals and pipes: tests/test_cli_terminal.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
import kdtr_format.writer
from kdtr_format import WriterError
from refgen.files import content_hash

TAMPERED = "cases/non_prefix/c_kv_after"


def hf_config(**changes) -> dict:
    """A small HF-style DeepseekV3 config.json: neox rope via rope_interleave, yarn
    with both mscale fields, HF extras that refgen ignores."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "torch_dtype": "bfloat16",
        "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 64, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.0, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 50000.0,
        "rope_interleave": False, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False,
    }
    config.update(changes)
    return config


def rewrite(path: Path, name: str, rehash: bool) -> None:
    """Change one value of tensor `name` in a fixture file (the content hash
    recomputed, so that only a regeneration can tell, or left stale)."""
    with kdtr_format.open(path) as reader:
        tensors = {n: np.array(reader[n]) for n in reader.names()}
        metadata = reader.metadata
    tensors[name].flat[3] += 0.5
    if rehash:
        metadata["content_hash"] = content_hash(metadata, tensors)
    kdtr_format.write(path, tensors, metadata)


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refgen: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output


# ---------------------------------------------------------------------------- verify

def test_verify_passes_on_the_committed_fixtures(refgen_process):
    done = refgen_process("verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed: 7 of 7" in done.stdout


@pytest.mark.parametrize("rehash", [True, False], ids=["hash-recomputed", "hash-stale"])
def test_verify_fails_naming_the_one_changed_tensor(committed_golden, refgen_cli, tmp_path, rehash):
    copy = tmp_path / "accept_compact.kdtr"
    shutil.copy(committed_golden / "kernels/accept_compact.kdtr", copy)
    assert refgen_cli("verify", copy).exit_code == 0
    rewrite(copy, TAMPERED, rehash)
    result = refgen_cli("verify", copy)
    assert result.exit_code == 1
    drift = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("cases/")]
    assert len(drift) == 1 and drift[0].startswith(f"{TAMPERED}: 1 of ")
    assert ("content_hash: stored" in result.stdout) is not rehash


def test_verify_checks_what_a_directory_holds(committed_golden, refgen_cli, tmp_path, monkeypatch):
    """A user's directory: the fixtures it holds. This checkout's tests/golden: every
    committed fixture must be there too."""
    (tmp_path / "kernels").mkdir()
    shutil.copy(committed_golden / "kernels/tree_build.kdtr", tmp_path / "kernels")
    (tmp_path / "kernels" / "x.kdtr").mkdir()                       # a directory, not a fixture
    result = refgen_cli("verify", tmp_path)
    assert result.exit_code == 0, result.output
    assert "MISSING" not in result.stdout and "passed: 1 of 1" in result.stdout
    monkeypatch.setattr("refgen.cli.COMMITTED_DIR", tmp_path)
    result = refgen_cli("verify", tmp_path)
    assert result.exit_code == 1
    assert result.stdout.count("MISSING") == 6 and "tiny.kdtr" in result.stdout
    assert "ok" in result.stdout and "tree_build.kdtr" in result.stdout


def test_verify_fails_on_a_kdtr_file_that_is_no_fixture(refgen_cli, tmp_path):
    kdtr_format.write(tmp_path / "weights.kdtr", {"w": np.ones(2)})
    result = refgen_cli("verify", tmp_path)
    assert result.exit_code == 1 and "not a refgen fixture" in result.stdout


# ---------------------------------------------------------------------------- generate

def test_generate_from_an_hf_config_file_and_verify_it(refgen_cli, tmp_path):
    model_dir = tmp_path / "my-k2-mini"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(num_nextn_predict_layers=1)))
    out = tmp_path / "out"
    result = refgen_cli("generate", "--config-file", model_dir / "config.json", "--out", out)
    assert result.exit_code == 0, result.output
    assert "refgen: note: config file" in result.stderr and "num_nextn_predict_layers: 1" in result.stderr
    assert "my-k2-mini.kdtr" in result.stdout
    with kdtr_format.open(out / "my-k2-mini.kdtr") as f:
        meta = f.metadata
        assert meta["source"] == "config-file" and meta["preset"] == "my-k2-mini"
        assert meta["config"]["rope_style"] == "neox" and meta["config"]["q_lora_rank"] is None
        assert meta["config"]["rope_scaling"]["mscale_all_dim"] == 1.0
        assert "weights/embed_tokens" not in f.names()                           # slim: drawn from the seed
        assert meta["seeded_tensors"]["weights/embed_tokens"]["shape"] == [160, 64]
    assert sorted(p.name for p in out.iterdir()) == ["my-k2-mini.kdtr"]
    assert refgen_cli("verify", out / "my-k2-mini.kdtr").exit_code == 0
    assert refgen_cli("materialize", out, "--out", tmp_path / "full").exit_code == 0
    with kdtr_format.open(tmp_path / "full" / "my-k2-mini.kdtr") as f:
        assert f["weights/embed_tokens"].shape == (160, 64)


@pytest.mark.parametrize("config, fragment", [
    (hf_config(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (hf_config(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling.original_max_position_embeddings"),
    ({k: v for k, v in hf_config().items() if k != "kv_lora_rank"}, "kv_lora_rank: required field is missing"),
    (hf_config(max_position_embeddings=32), "max_position_embeddings"),
    (hf_config(vocab_size=163840, hidden_size=7168), "GiB"),
], ids=["odd-rope", "yarn-field", "missing-field", "positions", "too-big"])
def test_an_impossible_config_file_fails_naming_the_field(refgen_cli, tmp_path, config, fragment):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    result = refgen_cli("generate", "--config-file", path, "--out", tmp_path / "out")
    assert_one_line_error(result, fragment)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [path]


def test_a_failed_write_leaves_nothing_behind(refgen_cli, tmp_path, monkeypatch):
    real_add, calls = kdtr_format.writer.Writer.add, []

    def failing_add(self, name, array):
        calls.append(name)
        if len(calls) == 20:
            raise WriterError("disk full (planted)")
        real_add(self, name, array)

    monkeypatch.setattr(kdtr_format.writer.Writer, "add", failing_add)
    result = refgen_cli("generate", "--kernels", "--out", tmp_path)
    assert_one_line_error(result, "kernels/tree_build.kdtr", "disk full")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------------- list, show

def test_list_names_presets_and_kinds(refgen_cli):
    result = refgen_cli("list")
    assert result.exit_code == 0
    for word in ("tiny", "tiny2", "kimi-k2", "model", "tree_build", "verify_attention", "accept_compact"):
        assert word in result.stdout
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    assert rows["tiny"][-1] == "tests/golden" and rows["tiny2"][-1] == "tests/golden"
    assert rows["kimi-k2"][-2:] == ["not", "committed"] and rows["mla-small"][-2:] == ["not", "committed"]
    assert "not committed: `refgen generate --preset NAME --out DIR` writes it" in result.stdout, result.stdout


def test_show_a_model_and_a_kernel_fixture(committed_golden, refgen_cli):
    model = refgen_cli("show", committed_golden / "tiny.kdtr")
    assert model.exit_code == 0
    for word in ("kind model", "matches", "p2", "t6", "oracle 0.9", "random", "min margin",
                 "slim: omits", "weights", "refgen materialize"):
        assert word in model.stdout, word
    kernels = refgen_cli("show", committed_golden / "kernels/verify_attention.kdtr")
    assert kernels.exit_code == 0 and "k2_ragged" in kernels.stdout
