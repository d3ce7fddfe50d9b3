"""Opening a checkpoint directory: its config.json (``text_config`` unwrapped), quantization_config,
every safetensors header, and where its language model lives (refgen/checkpoint.py's first step)."""

from __future__ import annotations

from pathlib import Path

from kdtr_format import KdtrError, read_hf_config

from .checkpoint_names import BODIES, HEADS, Checkpoint, layers_named, mtp_layers
from .quant import QuantError, parse_quantization
from .safetensors_dir import CheckpointError, SafetensorsDir, read_json


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read config.json and every safetensors header of `directory` (no tensor data), and check
    the MTP layers the files hold against config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError("config.json: expected a JSON object")
    multimodal = "text_config" in data
    if multimodal and not isinstance(data["text_config"], dict):
        raise CheckpointError("config.json: text_config must be an object")
    text = dict(data["text_config"] if multimodal else data)
    found = [q for q in (text.pop("quantization_config", None),
                         data.get("quantization_config") if multimodal else None) if q is not None]
    if len(found) == 2 and found[0] != found[1]:
        raise CheckpointError("config.json: text_config.quantization_config and quantization_config disagree")
    quantization_config = found[0] if found else None
    try:
        quant = parse_quantization(quantization_config)
        cfg, config_notes = read_hf_config(text)
    except (QuantError, KdtrError) as exc:
        raise CheckpointError(f"config.json: {exc}") from None
    mtp = text.get("num_nextn_predict_layers") or 0
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        raise CheckpointError(f"config.json: num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    files = SafetensorsDir(directory)
    names = files.tensors.keys() | files.absent.keys()
    bodies = [b for b in BODIES if b + "embed_tokens.weight" in names]
    heads = [h for h in HEADS if h in names]
    if len(bodies) != 1 or len(heads) != 1:
        embeddings = " or ".join(b + "embed_tokens.weight" for b in BODIES)
        raise CheckpointError(f"{directory}: expected one embedding ({embeddings}) and one head "
                              f"({' or '.join(HEADS)}); found {bodies or 'no embedding'}, {heads or 'no head'}")
    held = mtp_layers(layers_named(files.tensors, bodies[0]), bodies[0], cfg, mtp)
    regular = frozenset(i for i in layers_named(names, bodies[0]) if i < cfg.num_hidden_layers)
    return Checkpoint(directory, text, quantization_config, quant, cfg, config_notes, mtp, held, regular, multimodal,
                      files, bodies[0], heads[0])
