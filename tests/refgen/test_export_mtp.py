"""`refgen export --mtp`: DeepSeek-V3's multi-token-prediction module as layer num_hidden_layers of
the checkpoint, named as DeepSeek ships it, and refgen's float64 reference of its draft logits
(mtp-reference.npz) against two outside implementations: HF transformers' DeepseekV3 for the
target's hidden states and the module's decoder block, with the module's own math (masked embedding,
enorm / hnorm, eh_proj over [embedding, hidden], the shared head) written here in torch; and vLLM's
DeepSeekMultiTokenPredictorLayer itself where vLLM is installed. In the same run of vLLM's interpreter,
vLLM's rewrite of a draft export's config (test_export_draft.py's labels)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import kdtr_format
from exports import exported_weights, target_and_draft
from refgen.checkpoint import load, open_checkpoint, plan_import
from refgen.export import export
from refgen.export_mtp import MTP_REFERENCE
from terminal import in_terminal
from vllm_python import in_vllm

OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
# HF keeps float32 islands (router, rope angles, softmax, RMSNorm) in float64: about 2e-7 of the
# logit scale on the target (tests/refgen/test_model.py), the module adds one layer's worth.
HF_RTOL = 1e-6


@pytest.fixture(scope="module")
def exported(committed_golden, tmp_path_factory):
    """tiny (committed, slim) exported with its MTP module, float32."""
    path = committed_golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader:
        return export(reader, path, tmp_path_factory.mktemp("mtp") / "tiny-mtp", mtp=True)


def test_the_module_is_layer_L_under_deepseeks_names_and_the_target_is_unchanged(exported, committed_golden):
    directory, L = exported.directory, 4
    config = json.loads((directory / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == L
    # every *.safetensors of the directory is weights to vLLM's loader: the reference is not one
    assert sorted(p.name for p in directory.glob("*.safetensors")) == ["model.safetensors"]
    stored = exported_weights(directory)
    mtp = sorted(name for name in stored if name.startswith(f"model.layers.{L}."))
    assert [f"model.layers.{L}.{own}.weight" for own in OWN if f"model.layers.{L}.{own}.weight" not in mtp] == []
    block = {name.removeprefix(f"model.layers.{L}.") for name in mtp} - {f"{own}.weight" for own in OWN}
    last = {name.removeprefix(f"model.layers.{L - 1}.") for name in stored if name.startswith(f"model.layers.{L - 1}.")}
    assert block == last and "mlp.gate.e_score_correction_bias" in block   # an MoE decoder block, named as layer 3
    D, V = config["hidden_size"], config["vocab_size"]
    assert stored[f"model.layers.{L}.eh_proj.weight"].shape == (D, 2 * D)
    assert stored[f"model.layers.{L}.shared_head.head.weight"].shape == (V, D)
    plan = plan_import(open_checkpoint(directory))
    assert plan.counts["mtp"] == len(mtp)
    imported = load(plan)
    with kdtr_format.open(committed_golden / "tiny.kdtr") as reader:
        assert imported.cfg.num_hidden_layers == L and sorted(imported.weights) == sorted(
            n.removeprefix("weights/") for n in reader.metadata["seeded_tensors"] if n.startswith("weights/"))


def test_the_manifest_names_the_reference_and_counts_agreement(exported):
    entry = exported.manifest["mtp"]
    assert entry["layer"] == 4 and entry["reference"] == MTP_REFERENCE
    reference = np.load(exported.directory / MTP_REFERENCE)
    agreeing = judged = 0
    for prompt in exported.manifest["prompts"]:
        name, n = prompt["name"], len(prompt["tokens"]) + len(prompt["ar_tokens"])
        assert reference[f"{name}/tokens"].tolist() == prompt["tokens"] + prompt["ar_tokens"]
        assert reference[f"{name}/draft_logits"].shape == (n - 1, 1024)
        target = reference[f"{name}/target_logits"].argmax(-1)
        assert target[len(prompt["tokens"]) - 1:-1].tolist() == prompt["ar_tokens"]    # the target is the fixture's
        start = len(prompt["tokens"]) - 1
        draft = reference[f"{name}/draft_logits"][start:].argmax(-1)
        agreeing += int((draft == target[start + 1:]).sum())
        judged += n - 1 - start
    assert (entry["agreement"]["agreeing"], entry["agreement"]["judged"]) == (agreeing, judged)
    assert 0 < agreeing < judged                       # drafts both accepted and rejected


def _rms(torch, x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_the_reference_is_hf_transformers_with_the_module_math_written_here(exported, tmp_path):
    """The target's hidden state after its final norm from HF's DeepseekV3ForCausalLM on the export;
    the module written here in torch (position 0's embedding zeroed, [enorm(e), hnorm(h)] @ eh_proj.T)
    around HF's decoder layer as its block, with the shared head as the one-layer model's norm and
    head; positions 0 .. n-2."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed (the test extra)")
    torch = pytest.importorskip("torch")
    directory, L = exported.directory, 4
    target = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                               experts_implementation="eager",
                                                               attn_implementation="eager").eval()
    stored = exported_weights(directory)
    own = {o: torch.from_numpy(stored[f"model.layers.{L}.{o}.weight"].astype(np.float64)) for o in OWN}
    block_dir = tmp_path / "block"                       # the block as a one-layer model, its head the shared head
    block_dir.mkdir()
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)  # one MoE layer
    (block_dir / "config.json").write_text(json.dumps(config))
    state = {name.replace(f"model.layers.{L}.", "model.layers.0."): value for name, value in stored.items()
             if name.startswith(f"model.layers.{L}.") and name.removeprefix(f"model.layers.{L}.")[:-7] not in OWN}
    state.update({"model.embed_tokens.weight": stored[f"model.layers.{L}.embed_tokens.weight"],
                  "model.norm.weight": stored[f"model.layers.{L}.shared_head.norm.weight"],
                  "lm_head.weight": stored[f"model.layers.{L}.shared_head.head.weight"]})
    save_file(state, block_dir / "model.safetensors", metadata={"format": "pt"})
    block = transformers.AutoModelForCausalLM.from_pretrained(block_dir, dtype=torch.float64,
                                                              experts_implementation="eager",
                                                              attn_implementation="eager").eval()
    eps = config["rms_norm_eps"]
    reference = np.load(directory / MTP_REFERENCE)
    for prompt in exported.manifest["prompts"]:
        tokens = torch.tensor(prompt["tokens"] + prompt["ar_tokens"])
        with torch.no_grad():
            hidden = target.model(tokens[None]).last_hidden_state[0]                        # after the final norm
            embedding = own["embed_tokens"][tokens[1:]].clone()
            embedding[0] = 0.0                                                              # position 0 masked
            x = torch.cat([_rms(torch, embedding, own["enorm"], eps), _rms(torch, hidden[:-1], own["hnorm"], eps)],
                          -1) @ own["eh_proj"].T
            draft = block(inputs_embeds=x[None]).logits[0].numpy()
        want = reference[f"{prompt['name']}/draft_logits"]
        scale = np.abs(want).max()
        assert np.abs(draft - want).max() <= HF_RTOL * scale, prompt["name"]
        np.testing.assert_allclose(hidden.numpy(), reference[f"{prompt['name']}/target_hidden"],
                                   atol=HF_RTOL * np.abs(reference[f"{prompt['name']}/target_hidden"]).max())


@pytest.fixture(scope="module")
def vllm_run(exported, committed_golden, tmp_path_factory) -> dict:
    """One run of tests/refgen/vllm_side.py in vLLM's interpreter (importing vLLM is most of a run) for
    both vLLM tests: its MTP layer on `exported` (written to vllm-mtp.npz beside it), and its draft-config
    rewrite of tiny exported plain (a target) and with --layers 2 (a draft) -> {command: its result}."""
    target, draft = target_and_draft(committed_golden / "tiny.kdtr", tmp_path_factory.mktemp("vllm"))
    directory = exported.directory
    return in_vllm("tests/refgen/vllm_side.py", "mtp", str(directory), str(directory / "vllm-mtp.npz"),
                   "config", str(target), str(draft))


def test_vllms_mtp_layer_computes_the_reference(exported, vllm_run):
    """vLLM's own DeepSeekMultiTokenPredictorLayer.forward (the masking, the norms, the concatenation,
    eh_proj, the block's residual, the shared head's norm) on the reference's target hidden states,
    its block HF's decoder layer (tests/refgen/vllm_side.py); in vLLM's interpreter."""
    directory, result = exported.directory, vllm_run["mtp"]
    computed = np.load(directory / "vllm-mtp.npz")
    reference = np.load(directory / MTP_REFERENCE)
    for prompt in exported.manifest["prompts"]:
        want = reference[f"{prompt['name']}/draft_logits"]
        for form in ("logits", "logits_from_pre_norm"):
            got = computed[f"{prompt['name']}/{form}"]
            assert np.abs(got - want).max() <= HF_RTOL * np.abs(want).max(), (prompt["name"], form, result)


def test_vllm_keeps_the_draft_a_draft_model_and_would_make_the_target_an_mtp(vllm_run):
    """vLLM's SpeculativeConfig.hf_config_override, the rewrite every draft's config goes through (the
    labels of tests/refgen/test_export_draft.py)."""
    as_target, as_draft = vllm_run["config"]
    assert as_draft == {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "n_predict": None}
    assert as_target == {"architectures": ["DeepSeekMTPModel"], "model_type": "deepseek_mtp", "n_predict": 0}


def test_mtp_with_a_draft_or_fp8_is_one_line_and_leaves_nothing(committed_golden, tmp_path, refgen_cli):
    tiny = committed_golden / "tiny.kdtr"
    for extra, mentions in ((["--layers", "2"], "not with --layers"), (["--dtype", "fp8"], "not with --dtype fp8")):
        result = refgen_cli("export", tiny, "--out", tmp_path / "out", "--mtp", *extra)
        assert result.exit_code == 2 and mentions in result.output and len(result.output.splitlines()) == 1, \
            result.output
    assert list(tmp_path.iterdir()) == []


def test_a_bf16_export_references_the_bf16_module(committed_golden, tmp_path):
    """The module's weights stored in bf16, and the reference computed from the stored values."""
    path = committed_golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader:
        written = export(reader, path, tmp_path / "bf16", "bfloat16", mtp=True)
    stored = exported_weights(written.directory)
    eh_proj = stored["model.layers.4.eh_proj.weight"]
    assert str(eh_proj.dtype) == "bfloat16" and written.manifest["regime"] == "bfloat16"
    assert written.manifest["mtp"]["agreement"]["judged"] > 0


def test_the_cli_says_how_often_the_drafts_agree_at_80_columns(committed_golden, tmp_path):
    out = tmp_path / "tiny-mtp"
    result = in_terminal(["refgen", "export", str(committed_golden / "tiny.kdtr"), "--out", str(out), "--mtp"],
                         columns=80)
    assert result.returncode == 0, result.output
    manifest = json.loads((out / "kdtree-export.json").read_text())["mtp"]["agreement"]
    assert f"MTP layer 4: its drafts are the target's tokens at {manifest['agreeing']} of {manifest['judged']} AR " \
           "positions" in result.output
    assert all(len(line) <= 80 for line in result.screen_lines if str(out) not in line), result.output
