"""The MTP module of `refgen export --mtp` (refgen.mtp): its weights as the export stores them, and
its float64 reference written beside the checkpoint, so that an engine's MTP drafter can be checked
as a stage.

``mtp-reference.npz`` (`MTP_REFERENCE`, numpy's uncompressed archive: not a ``.safetensors`` file, which
vLLM would load as weights of the model) holds, for every prompt of the export's manifest
(the prompt followed by its AR tokens, what a greedy serving run computes), under ``<prompt>/``:
``tokens`` [n] int64, ``target_hidden`` [n, D] (the target's hidden state after its final norm, what
the MTP module takes), ``target_logits`` [n, V] and ``draft_logits`` [n - 1, V] (the first draft step
at positions 0 .. n-2: row i from tokens[i + 1] and target_hidden[i], predicting tokens[i + 2]), all
float64 but the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kdtr_format import ModelConfig

from .mtp import agreeing_weights, draft_reference

MTP_REFERENCE = "mtp-reference.npz"


def mtp_weights(cfg: ModelConfig, target: Callable[[str], np.ndarray], seed: int, dtype: str) -> dict[str, np.ndarray]:
    """refgen.mtp.agreeing_weights for the target's weights `target` (name -> the stored weight), as
    the export stores them in `dtype` (float32, or bfloat16 values held in float32): the module the
    reference computes is the one served."""
    weights = agreeing_weights(cfg, target, seed)
    if dtype == "bfloat16":
        return {name: w.astype(ml_dtypes.bfloat16).astype(np.float32) for name, w in weights.items()}
    return weights


def write_reference(path: Path, cfg: ModelConfig, target: Mapping[str, np.ndarray], mtp: Mapping[str, np.ndarray],
                    prompts: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The reference file (module docstring) of the manifest's `prompts` -> (its bytes, the manifest's
    "mtp" entry: the layer, the file, and per prompt how often the first draft step's argmax is the
    target's next AR token)."""
    tensors: dict[str, np.ndarray] = {}
    agreement: dict[str, list[int]] = {}
    for prompt in prompts:
        tokens = np.asarray(prompt["tokens"] + prompt["ar_tokens"], np.int64)
        reference = draft_reference(cfg, target, mtp, tokens)
        name = prompt["name"]
        tensors.update({f"{name}/tokens": reference.tokens, f"{name}/target_hidden": reference.target_hidden,
                        f"{name}/target_logits": reference.target_logits,
                        f"{name}/draft_logits": reference.draft_logits})
        agreement[name] = list(reference.agreement(len(prompt["tokens"]) - 1))
    with path.open("wb") as file:
        np.savez(file, **tensors)
    agreed, judged = (sum(pair[i] for pair in agreement.values()) for i in (0, 1))
    entry = {"layer": cfg.num_hidden_layers, "reference": MTP_REFERENCE,
             "agreement": {"agreeing": agreed, "judged": judged, "per_prompt": agreement}}
    return path.stat().st_size, entry
