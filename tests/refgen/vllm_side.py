"""Runs inside vLLM's interpreter (tests/vllm_python.py), never imported by the suite: vLLM's own
code applied to `refgen export` directories. Takes one or more commands, each its name then its
arguments (absolute paths, never a command's name), so that one run serves several tests: importing
vLLM is most of a run (~10 s on 2 cores). Prints one JSON line, {command: its result}.

    python vllm_side.py config DIR...     vLLM's draft-config rewrite of each DIR's config.json
    python vllm_side.py mtp DIR OUT.npz   vLLM's MTP layer on an `export --mtp`'s reference inputs
    python vllm_side.py mtp DIR OUT.npz config DIR...    both, in one run
"""

from __future__ import annotations

import json
import sys


def draft_configs(directories: list[str]) -> list[dict]:
    """What vLLM makes of each directory as a speculative draft: SpeculativeConfig.hf_config_override
    (applied to every draft model's config) -> its architectures, model_type and n_predict."""
    from transformers import AutoConfig
    from vllm.config.speculative import SpeculativeConfig

    found = []
    for directory in directories:
        config = SpeculativeConfig.hf_config_override(AutoConfig.from_pretrained(directory))
        found.append({"architectures": list(config.architectures), "model_type": config.model_type,
                      "n_predict": getattr(config, "n_predict", None)})
    return found


def mtp_logits(directory: str, out: str) -> dict:
    """vLLM's DeepSeekMultiTokenPredictorLayer.forward, its own code, on every prompt of the export's
    mtp-reference.npz: input ids the tokens shifted by one, positions 0 .. n-2, the previous
    hidden states the reference's target_hidden[:-1], the embeddings those of the module's
    embed_tokens (what DeepSeekMultiTokenPredictor.forward passes). Its modules are vLLM's (RMSNorm,
    SharedHead, an nn.Linear eh_proj) with the export's weights, but the decoder block, which needs an
    engine's attention metadata: HF transformers' DeepseekV3 decoder layer stands in for it, giving back
    (output - input, input) as vLLM's DeepseekV2DecoderLayer gives (hidden, residual). Writes per
    prompt `logits` (the shared head on the normed output the layer returns) and
    `logits_from_pre_norm` (DeepSeekMultiTokenPredictor.compute_logits' path: the shared head's norm
    applied to the layer's pre-norm output) to `out`, float64."""
    import json
    import tempfile
    import types
    from pathlib import Path

    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMultiTokenPredictorLayer, SharedHead

    root = Path(directory)
    config = json.loads((root / "config.json").read_text())
    L, D, eps = config["num_hidden_layers"], config["hidden_size"], config["rms_norm_eps"]
    stored = {}
    for file in sorted(root.glob("model*.safetensors")):
        stored.update(load_file(file))
    layer = {name.removeprefix(f"model.layers.{L}."): value for name, value in stored.items()
             if name.startswith(f"model.layers.{L}.")}
    own = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
    weight = {o: torch.from_numpy(layer[f"{o}.weight"].astype(np.float64)) for o in own}

    with tempfile.TemporaryDirectory() as scratch:          # the block: a one-layer HF model, no final norm
        block_config = dict(config, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
        Path(scratch, "config.json").write_text(json.dumps(block_config))
        state = {f"model.layers.0.{name}": value for name, value in layer.items() if name[:-7] not in own}
        state.update({"model.embed_tokens.weight": layer["embed_tokens.weight"],
                      "model.norm.weight": layer["shared_head.norm.weight"],
                      "lm_head.weight": layer["shared_head.head.weight"]})
        save_file(state, Path(scratch, "model.safetensors"), metadata={"format": "pt"})
        hf = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float64, experts_implementation="eager",
                                                  attn_implementation="eager").eval()
    hf.model.norm = torch.nn.Identity()

    class Block(torch.nn.Module):
        use_sequence_parallel_moe = False

        def forward(self, positions, hidden_states, residual):
            assert residual is None and torch.equal(positions, torch.arange(len(positions)))
            output = hf.model(inputs_embeds=hidden_states[None]).last_hidden_state[0]
            return output - hidden_states, hidden_states

    with set_current_vllm_config(VllmConfig()):
        module = DeepSeekMultiTokenPredictorLayer.__new__(DeepSeekMultiTokenPredictorLayer)
        torch.nn.Module.__init__(module)
        module.enorm, module.hnorm = RMSNorm(D, eps=eps), RMSNorm(D, eps=eps)
        module.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        module.shared_head = SharedHead(types.SimpleNamespace(hidden_size=D, rms_norm_eps=eps), prefix="",
                                        defer_lm_head=True)
        module.mtp_block = Block()
        module.to(torch.float64)
        with torch.no_grad():
            module.enorm.weight.copy_(weight["enorm"])
            module.hnorm.weight.copy_(weight["hnorm"])
            module.eh_proj.weight.copy_(weight["eh_proj"])
            module.shared_head.norm.weight.copy_(weight["shared_head.norm"])
        reference = np.load(root / "mtp-reference.npz")
        found = {}
        for name in sorted({key.split("/")[0] for key in reference.files}):
            tokens = torch.from_numpy(reference[f"{name}/tokens"])
            hidden = torch.from_numpy(reference[f"{name}/target_hidden"])
            positions = torch.arange(len(tokens) - 1)
            with torch.no_grad():
                pre, post = module(tokens[1:], positions, hidden[:-1], weight["embed_tokens"][tokens[1:]])
                found[f"{name}/logits"] = (post @ weight["shared_head.head"].T).numpy()
                found[f"{name}/logits_from_pre_norm"] = (module.shared_head(pre) @ weight["shared_head.head"].T).numpy()
    np.savez(out, **found)
    return {"prompts": sorted({key.split("/")[0] for key in found}), "norm": type(module.enorm).__name__}


COMMANDS = {"config": draft_configs, "mtp": lambda args: mtp_logits(*args)}


def run(argv: list[str]) -> dict:
    """argv: commands, each its name then its arguments -> {name: its result}, run in order."""
    starts = [i for i, word in enumerate(argv) if word in COMMANDS]
    if not starts or starts[0] != 0:
        sys.exit(f"expected a command ({', '.join(COMMANDS)}) first, got {argv[:1]}")
    return {argv[i]: COMMANDS[argv[i]](argv[i + 1:end]) for i, end in zip(starts, starts[1:] + [len(argv)])}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
