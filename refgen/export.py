"""A model fixture's model as a Hugging Face checkpoint directory, for serving engines.

    written = export(reader, "tiny.kdtr", Path("/models/tiny-bf16"), dtype="bfloat16")

The directory is what DeepSeek-V3 ships and transformers, vLLM and SGLang read
(docs/serving.md):

- ``config.json``: the config in DeepseekV3's keys (kdtr_format.hf_config.hf_config_dict);
- ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` and
  ``model.safetensors.index.json``: the weights under their published names (the name
  map of refgen/checkpoint_names.py, read backwards), routed experts one tensor each;
- ``tokenizer.json`` and ``tokenizer_config.json``: a word-level vocabulary, token i
  spelled ``t<i>`` (`token_text`), so that a server starts as it does for any model and a
  reply's text maps back to token ids;
- the fixture the served tokens are judged against, and ``kdtree-export.json``
  (`MANIFEST`): where the export came from, its dtype, the regime to validate it in
  (`kdtree validate --dtype`), the fixture's file name, and every prompt with its
  expected AR tokens and their margins.

Weights by `dtype`:

- float32: the fixture's ``weights/`` bit for bit; the fixture is copied, regime float32.
- bfloat16: the bf16 cases' ``bf16/weights/`` bit for bit (the router's correction bias
  stored float32, as DeepSeek ships it, holding the same values); the fixture is copied,
  regime bfloat16.
- fp8: every ``*_proj`` weight of the layers e4m3 with a float32 ``weight_scale_inv``
  per block (`fp8_quantize`), DeepSeek's FP8 form; the rest bf16 (the correction bias
  float32 holding bf16 values). The scales are powers of two (as DeepSeek-V3.1's UE8M0
  scales), so each weight dequantizes exactly in bf16 and in float32, and the model's
  float32 and bf16 cases judge the same weights. This is not the fixture's model:
  its own fixture is generated from the export (refgen.checkpoint, exactly as
  `refgen generate --checkpoint` would), and its regime is bfloat16 (an FP8 engine
  computes its activations in bf16 at best).
- `layers` K (any dtype): the first K layers, the final norm and the head: a
  LayerSkip-style draft model for a serving engine's speculative decoding (the
  target's own early exit, as the engine's LayerSkipDrafter). No fixture, no prompts.
  Labelled DeepseekV2ForCausalLM (`DRAFT_LABEL`), the label vLLM and SGLang take as a draft.

A slim fixture (refgen/files.py: the seeded weights omitted, named by sha256) is
materialized on the way (refgen.materialize); the export holds the full fixture.

The directory is written all or nothing: into a staging directory beside it,
renamed into place when complete (an FP8 export's fixture and manifest follow, generated
from the final directory, which is removed again on a failure).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import kdtr_format
from kdtr_format import ModelConfig, weight_shapes
from kdtr_format.checkpoint_tensors import CheckpointTensors
from kdtr_format.dequant import FP8
from kdtr_format.hf_config import hf_config_dict

from .checkpoint_names import _ATTENTION, _DENSE, _MOE, _NORMS, BODIES, HEADS
from .export_gguf import GGUF_FILE, write_gguf
from .export_mtp import MTP_REFERENCE, mtp_weights, write_reference
from .files import omitted
from .fixtures import DEFAULT_PLAN, FixtureError
from .materialize import materialize
from .mtp import PREFIX as MTP_PREFIX, mtp_shapes

DTYPES = ("float32", "bfloat16", "fp8")
MANIFEST = "kdtree-export.json"
EXPORT_FORMAT = 1
FP8_MAX = 448.0                            # the largest finite e4m3fn value
# A draft model's label. Serving engines turn a DeepseekV3 draft into their MTP module: vLLM's
# SpeculativeConfig.hf_config_override rewrites model_type deepseek_v3 to deepseek_mtp with n_predict =
# num_nextn_predict_layers (0 here: ZeroDivisionError), SGLang's ModelConfig._config_draft_model
# rewrites architecture DeepseekV3ForCausalLM to DeepseekV3ForCausalLMNextN (one MTP layer asserted).
# Both serve DeepseekV2 with the same class as V3, reading scoring_func and topk_method.
DRAFT_LABEL = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
SHARD_BYTES = 4 << 30
INDEX = "model.safetensors.index.json"

# project weight name within a layer (docs/fixtures.md) -> HF parameter within the layer: the
# importer's tables (refgen/checkpoint_names.py) read backwards
LAYER_PARAMS = {project: hf for table in (_NORMS, _ATTENTION, _DENSE, _MOE) for hf, project in table.items()}
EXPERT_PARAM = "mlp.experts.{e}.{part}_proj.weight"     # the per-expert form checkpoints ship
TOP_PARAMS = {"embed_tokens": f"{BODIES[0]}embed_tokens.weight", "norm": f"{BODIES[0]}norm.weight",
              "lm_head": HEADS[0]}
BIAS = "e_score_correction_bias"

Progress = Callable[[int], None]


class ExportError(FixtureError):
    """A fixture or an export request refgen cannot turn into a checkpoint directory."""


def token_text(token: int) -> str:
    """The exported tokenizer's word for token id `token`."""
    return f"t{token}"


@dataclass(frozen=True)
class Written:
    """What `export` wrote: the directory, its files (name -> bytes), the fixture file (None
    for a draft model) and the manifest."""

    directory: Path
    files: dict[str, int]
    fixture: str | None
    manifest: dict[str, Any]


# ---------------------------------------------------------------------------- names and formats

def hf_tensors(cfg: ModelConfig, name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A project weight (docs/fixtures.md, or an MTP weight "mtp.*" of refgen.mtp) -> its HF parameters:
    renamed, never transposed; stacked routed experts [E, ...] -> one [...] tensor per expert."""
    if name in TOP_PARAMS:
        yield TOP_PARAMS[name], weight
        return
    if name.startswith(MTP_PREFIX):                   # the MTP module: layer num_hidden_layers, as DeepSeek ships it
        L, rest = cfg.num_hidden_layers, name.removeprefix(MTP_PREFIX)
        if rest.startswith("block."):
            yield from hf_tensors(cfg, f"layers.{L}.{rest.removeprefix('block.')}", weight)
        else:
            yield f"{BODIES[0]}layers.{L}.{rest}.weight", weight
        return
    _, i, rest = name.split(".", 2)
    prefix = f"{BODIES[0]}layers.{i}."
    if rest.startswith("moe.experts.w_"):
        part = rest.removeprefix("moe.experts.w_")
        for e in range(weight.shape[0]):
            yield prefix + EXPERT_PARAM.format(e=e, part=part), weight[e]
        return
    yield prefix + LAYER_PARAMS[rest], weight


def _stacked(cfg: ModelConfig, name: str, weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """hf_tensors, but routed experts stay stacked [E, ...] under model.layers.{i}.mlp.experts.{part}_proj.weight
    (what GGUF stores)."""
    if ".moe.experts.w_" in name:
        _, i, rest = name.split(".", 2)
        yield f"{BODIES[0]}layers.{i}.mlp.experts.{rest.removeprefix('moe.experts.w_')}_proj.weight", weight
    else:
        yield from hf_tensors(cfg, name, weight)


def fp8_quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [rows, cols] float32 -> (q e4m3fn [rows, cols], scale_inv float32 [ceil(rows / b0), ceil(cols / b1)]):
    per b0 x b1 block (the last of a dimension partial), scale_inv the smallest power of two with
    amax / scale_inv <= 448 (1 for an all-zero block) and q = w / scale_inv rounded to nearest
    (ties to even), so that q * scale_inv (kdtr_format.dequant.fp8_scaled) is exact in bf16 and float32."""
    b0, b1 = block
    rows, cols = w.shape
    R, C = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = np.zeros((R * b0, C * b1), dtype=np.float64)
    padded[:rows, :cols] = w
    amax = np.abs(padded.reshape(R, b0, C, b1)).max(axis=(1, 3))                           # [R, C]
    scale = np.exp2(np.ceil(np.log2(np.where(amax > 0, amax / FP8_MAX, 1.0))))
    scale = np.where(amax / scale > FP8_MAX, 2 * scale, scale)          # log2's rounding, at a power of two
    full = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[:rows, :cols]
    return (np.asarray(w, np.float64) / full).astype(FP8), scale.astype(np.float32)


def _stored(hf_name: str, weight: np.ndarray, dtype: str, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """One HF parameter's tensors as the export stores them in `dtype` (module docstring)."""
    if dtype == "float32":
        return {hf_name: np.ascontiguousarray(weight, dtype=np.float32)}
    if hf_name.endswith(BIAS):
        return {hf_name: np.asarray(weight, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)}
    if dtype == "fp8" and ".layers." in hf_name and hf_name.endswith("_proj.weight"):
        q, scale = fp8_quantize(np.asarray(weight, np.float32), block)
        return {hf_name: q, hf_name + "_scale_inv": scale}
    return {hf_name: np.ascontiguousarray(np.asarray(weight, np.float32).astype(ml_dtypes.bfloat16))}


def server_notes(cfg: ModelConfig) -> list[str]:
    """Where vLLM's and SGLang's DeepseekV3 compute this config otherwise than the reference (and
    transformers, which reads both settings): their served tokens then differ by design."""
    notes = []
    if cfg.rope_style != "interleave":
        notes.append(f"rope_style {cfg.rope_style}: vLLM's and SGLang's DeepseekV3 rotate interleaved pairs whatever "
                     "config.json says; served there, this model's tokens differ (transformers reads rope_interleave)")
    if cfg.latent_norm_eps != cfg.rms_norm_eps:
        notes.append(f"latent_norm_eps {cfg.latent_norm_eps:g} with rms_norm_eps {cfg.rms_norm_eps:g}: vLLM and SGLang "
                     "use rms_norm_eps in the q_a / kv_a latent norms; served there, this model's logits differ by that")
    return notes


def tokenizer_files(vocab_size: int, max_length: int) -> dict[str, Any]:
    """tokenizer.json (the `tokenizers` library's format: a word-level model split on
    whitespace, no decoder, so a decode joins tokens with spaces) and tokenizer_config.json."""
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": {token_text(i): i for i in range(vocab_size)},
                           "unk_token": token_text(0)}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


# ---------------------------------------------------------------------------- the export

@dataclass(frozen=True)
class Source:
    """The fixture an export reads: its config and the weights and cases of the chosen dtype."""

    cfg: ModelConfig
    metadata: Mapping[str, Any]
    weights: Callable[[str], np.ndarray]           # project name -> the weight the export stores
    regime: str                                     # "float32" | "bfloat16": whose prompts the manifest lists


def source(reader: Any, dtype: str) -> Source:
    """What `export` reads from a model fixture for `dtype`; ExportError naming what is missing."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    metadata = reader.metadata
    if metadata.get("kind") != "model":
        raise ExportError(f"not a model fixture (kind {metadata.get('kind')!r}); only a model fixture holds a model")
    try:
        cfg = ModelConfig.from_dict(metadata["config"])
    except (KeyError, ValueError) as exc:
        raise ExportError(f"no valid model config in its metadata ({exc})") from None
    prefix = "bf16/weights/" if dtype == "bfloat16" else "weights/"
    taken = CheckpointTensors(metadata)          # a checkpoint fixture's weights: from the checkpoint
    drawn = set(omitted(reader))                 # a slim fixture's: drawn again (`export` materializes it)
    missing = [name for name in weight_shapes(cfg)
               if prefix + name not in reader and prefix + name not in taken and prefix + name not in drawn]
    if missing:
        what = "bf16 cases (regenerate it with `refgen generate`)" if dtype == "bfloat16" else "weights"
        raise ExportError(f"{prefix}{missing[0]}: not in the fixture ({len(missing)} weight(s) missing: it holds "
                          f"no {what})")
    if dtype == "bfloat16" and "bf16" not in metadata:
        raise ExportError("the fixture holds no bf16 cases (metadata bf16); regenerate it with `refgen generate`")
    regime = "float32" if dtype == "float32" else "bfloat16"
    return Source(cfg, metadata, lambda name: np.asarray(reader[prefix + name]) if prefix + name in reader
                  else taken.array(prefix + name), regime)


def export(reader: Any, fixture_path: Path, out: Path, dtype: str = "float32", layers: int | None = None,
           block: tuple[int, int] = (128, 128), shard_bytes: int = SHARD_BYTES,
           progress: Progress | None = None, mtp: bool = False, gguf: bool = False) -> Written:
    """Write the checkpoint directory `out` (module docstring) from the fixture `reader`
    (read from `fixture_path`); `out` must not exist, or be an empty directory. progress(1)
    after each weight (`steps`), and after the FP8 fixture's steps. `mtp`: with the MTP module;
    `gguf`: with the model as one GGUF file for llama.cpp (refgen.export_gguf)."""
    step = progress or (lambda steps: None)
    origin = source(reader, dtype)
    cfg = _sliced(origin.cfg, layers)
    check_out(out, dtype, layers, mtp, gguf)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    fixture = fixture_path.name if layers is None and dtype != "fp8" else None
    try:
        staging.chmod(0o777 & ~_umask())
        with _full(reader, staging / (fixture or f".{fixture_path.name}")) as full:
            src = source(full, dtype)
            drafted = mtp_weights(cfg, src.weights, _seed(src), dtype) if mtp else {}
            files = _write_weights(staging, cfg, src, dtype, block, shard_bytes, step, drafted)
            if gguf:
                files[GGUF_FILE] = write_gguf(staging / GGUF_FILE, cfg, (pair for name in weight_shapes(cfg) for pair in
                                                                         _stacked(cfg, name, src.weights(name))),
                                              dtype, token_text)
            config = hf_config_dict(cfg, "bfloat16" if dtype == "fp8" else dtype) | (DRAFT_LABEL if layers else {})
            if dtype == "fp8":
                config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                                 "weight_block_size": list(block), "activation_scheme": "dynamic"}
            if mtp:
                config["num_nextn_predict_layers"] = 1
            written = {"config.json": config,
                       **tokenizer_files(cfg.vocab_size, cfg.max_position_embeddings)}
            for name, data in written.items():
                files[name] = _write_json(staging / name, data)
            if fixture is not None:
                if not (staging / fixture).exists():
                    shutil.copyfile(fixture_path, staging / fixture)
                files[fixture] = (staging / fixture).stat().st_size
            else:
                (staging / f".{fixture_path.name}").unlink(missing_ok=True)
            if dtype != "fp8" or layers is not None:
                manifest = _manifest(fixture_path, origin, dtype, layers, block, fixture, staging)
                if mtp:
                    target = {name: src.weights(name) for name in weight_shapes(cfg)}
                    files[MTP_REFERENCE], manifest["mtp"] = write_reference(staging / MTP_REFERENCE, cfg, target,
                                                                            drafted, manifest["prompts"])
                files[MANIFEST] = _write_json(staging / MANIFEST, manifest)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if MANIFEST in files:
        return Written(out, files, fixture, manifest)
    try:                                 # FP8: the fixture of the model now in `out`, then the manifest
        fixture = f"{out.name}.kdtr"
        files[fixture] = _fp8_fixture(out, fixture, origin, step)
        manifest = _manifest(fixture_path, origin, dtype, layers, block, fixture, out)
        files[MANIFEST] = _write_json(out / MANIFEST, manifest)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return Written(out, files, fixture, manifest)


@contextmanager
def _full(reader: Any, path: Path) -> Iterator[Any]:
    """`reader` when it holds every tensor; a slim fixture's full fixture (refgen.materialize: the
    seeded weights drawn again, each checked against its recorded sha256) written to `path`, open."""
    if not omitted(reader):
        yield reader
        return
    materialize(reader, path)
    with kdtr_format.open(path) as full:
        yield full


def steps(cfg: ModelConfig, dtype: str, layers: int | None, mtp: bool = False) -> int:
    """Progress steps of `export`: one per weight (the MTP module's too), and an FP8 export's fixture."""
    weights = len(weight_shapes(_sliced(cfg, layers)))
    return (weights + (len(mtp_shapes(cfg)) if mtp else 0)
            + (weights + DEFAULT_PLAN.steps if dtype == "fp8" and layers is None else 0))


def _sliced(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    if layers is None:
        return cfg
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ExportError(f"--layers {layers}: the model has {cfg.num_hidden_layers} layers")
    return dataclasses.replace(cfg, num_hidden_layers=layers,
                               first_k_dense_replace=min(cfg.first_k_dense_replace, layers))


def check_out(out: Path, dtype: str, layers: int | None, mtp: bool = False, gguf: bool = False) -> None:
    """ExportError unless `out` can take an export of `dtype` (`layers`, `mtp`, `gguf`)."""
    if gguf and dtype == "fp8":
        raise ExportError("--gguf: a GGUF file is written in float32 or bfloat16, not with --dtype fp8")
    if gguf and importlib.util.find_spec("gguf") is None:
        raise ExportError("--gguf needs the gguf package (pip install gguf)")
    if mtp and (layers is not None or dtype == "fp8"):
        raise ExportError(f"--mtp: the MTP module is exported with the whole model in float32 or bfloat16, "
                          f"not with {'--layers' if layers is not None else '--dtype fp8'}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty directory (an export writes a whole directory)")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: its parent directory {out.parent} does not exist")
    if dtype == "fp8" and layers is None:
        from kdtr_format import PRESETS

        if out.name in PRESETS:
            raise ExportError(f"--out {out}: an FP8 export's fixture is named after its directory, and {out.name!r} "
                              f"is a preset's name; choose another (e.g. {out.name}-fp8)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json(path: Path, data: Any) -> int:
    """JSON indented by 2, a list of numbers on one line."""
    text = re.sub(r"\[\s+([-+.\deE,\s]+?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]",
                  json.dumps(data, indent=2))
    path.write_text(text + "\n", encoding="utf-8")
    return path.stat().st_size


def _write_weights(directory: Path, cfg: ModelConfig, src: Source, dtype: str, block: tuple[int, int],
                   shard_bytes: int, step: Progress, extra: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Every weight, then the `extra` ones (the MTP module's), as safetensors shards of at most
    `shard_bytes` (one when they fit: model.safetensors, else numbered shards and their index) ->
    file name -> bytes."""
    shards: list[dict[str, np.ndarray]] = [{}]
    weights = ((name, src.weights(name)) for name in weight_shapes(cfg))
    for name, value in [*weights, *extra.items()]:
        for hf_name, weight in hf_tensors(cfg, name, value):
            tensors = _stored(hf_name, weight, dtype, block)
            size = sum(t.nbytes for t in tensors.values())
            if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + size > shard_bytes:
                shards.append({})
            shards[-1].update(tensors)
        step(1)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    files = {}
    for file, tensors in zip(names, shards):
        save_file(tensors, directory / file, metadata={"format": "pt"})
        (directory / file).chmod(0o666 & ~_umask())            # safetensors writes 0600
        files[file] = (directory / file).stat().st_size
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.values())},
                 "weight_map": {name: file for file, tensors in zip(names, shards) for name in tensors}}
        files[INDEX] = _write_json(directory / INDEX, index)
    return files


def _fp8_fixture(out: Path, fixture: str, src: Source, step: Progress) -> int:
    """The FP8 model's fixture, generated from the export as `refgen generate --checkpoint` would."""
    from .checkpoint import checkpoint_fixture, load, open_checkpoint, plan_import
    from .files import write_fixture

    write_fixture(out / fixture, checkpoint_fixture(load(plan_import(open_checkpoint(out)), step), _seed(src),
                                                    progress=step))
    return (out / fixture).stat().st_size


def _seed(src: Source) -> int:
    """The seed the fixture was generated with (0 when it records none)."""
    return int(src.metadata.get("generator", {}).get("seed", 0))


def _manifest(fixture_path: Path, src: Source, dtype: str, layers: int | None, block: tuple[int, int],
              fixture: str | None, directory: Path) -> dict[str, Any]:
    """kdtree-export.json: where the export came from and what to judge it against (the fixture
    read from `directory`)."""
    manifest: dict[str, Any] = {
        "kdtree_export": EXPORT_FORMAT, "dtype": dtype,
        "source": {"fixture": str(fixture_path.resolve()), "preset": src.metadata.get("preset"),
                   "content_hash": src.metadata.get("content_hash")},
        "fp8_block": list(block) if dtype == "fp8" else None,
        "layers": layers, "draft": layers is not None,
        "fixture": fixture, "regime": None if fixture is None else src.regime, "prompts": [],
    }
    if fixture is None:
        return manifest
    with kdtr_format.open(directory / fixture) as reader:
        cases = reader.metadata["bf16"] if src.regime == "bfloat16" else reader.metadata
        prefix = "bf16/" if src.regime == "bfloat16" else ""
        manifest["margin_threshold"] = cases["bf16_margin_threshold" if prefix else "margin_threshold"]
        for p in cases["prompts"]:
            at = f"{prefix}prompts/{p['name']}"
            manifest["prompts"].append({"name": p["name"], "tokens": np.asarray(reader[f"{at}/tokens"]).tolist(),
                                        "ar_tokens": np.asarray(reader[f"{at}/ar/tokens"]).tolist(),
                                        "ar_margins": np.asarray(reader[f"{at}/ar/margins"]).tolist()})
    return manifest
