"""The engine on fixtures made from checkpoints (refgen generate --checkpoint).

Two small synthetic checkpoints in shipped layouts (tests/synthetic_checkpoint.py): Kimi K2's FP8
blocks with an MTP layer, and Kimi K2.5's INT4 experts under text_config, each sliced to 2 layers and
4 experts. The fixtures hold no weights: they reference the checkpoint's tensors (kdtr_format.checkpoint_tensors).
Checked: the engine loads the fixture in its compute dtype and matches the references within the
fixture's tolerances; `kdtree validate --fixtures DIR` passes on them; what the engine decodes from the
references is, bit for bit, what refgen imported and what the checkpoint's tensors (read by
safetensors) dequantize to by docs/checkpoints.md's formulas in torch and compressed-tensors; a moved
or changed checkpoint is one line naming the tensor and the path.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import kdtr_format
from kdtr_format.checkpoint_tensors import KEY as CHECKPOINT_TENSORS
from kdtr_format.checkpoint_tensors import CheckpointTensorError, CheckpointTensors
from engine.adapter import TorchAdapter
from engine.cli import main
from engine.model import Transformer
from engine.validate import Status, validate
from engine.validate import fixtures as fixtures_module
from engine.validate.judging.regime import Regime
from engine.weights import ROUTER_WEIGHTS, load_fixture_weights
from refgen.checkpoint import checkpoint_fixture, load, open_checkpoint, plan_import
from refgen.files import write_fixture
from refgen.weights import init_weights, weight_shapes
from synthetic_checkpoint import SMALL, Layout, int4_dequantize, write_checkpoint

LAYOUTS = {"k2-fp8": Layout(quant="fp8", mtp=True), "k25-int4": Layout(quant="int4", multimodal=True)}
KEPT = [0, 1, 4, 5]     # --experts 4 of SMALL's 2 groups of 4: the first two of each
IMPORTED = {}           # layout -> refgen's import of its checkpoint (filled with its fixture)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """layout name -> the path of its model fixture, written once per module on demand, all in one
    directory (a layout whose packer is absent skips the tests that ask for it)."""
    out = tmp_path_factory.mktemp("checkpoint-fixtures")
    paths = {}

    def get(name: str) -> Path:
        if name not in paths:
            directory = tmp_path_factory.mktemp(name)
            write_checkpoint(directory, SMALL, init_weights(SMALL, 2), LAYOUTS[name])
            imported = load(plan_import(open_checkpoint(directory), layers=2, experts=4))
            paths[name] = out / f"{imported.name}.kdtr"
            write_fixture(paths[name], checkpoint_fixture(imported, seed=0))
            IMPORTED[name] = imported
        return paths[name]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_engine_matches_the_references_in_its_dtype(fixtures, layout, dtype):
    cfg, weights = load_fixture_weights(fixtures(layout), dtype)
    for name, w in weights.items():
        assert w.dtype == (torch.float32 if name.endswith(ROUTER_WEIGHTS) else dtype), name
    engine = Transformer(cfg, weights, dtype=dtype)
    with kdtr_format.open(fixtures(layout)) as fixture:
        regime = Regime.of(fixture.metadata, str(dtype).removeprefix("torch."))
        tolerances = regime.tolerances["logits"]
        for prompt in regime.metadata["prompts"]:
            tokens = fixture.torch(f"{regime.prefix}prompts/{prompt['name']}/tokens")[None]
            m = tokens.shape[1]
            logits = engine(tokens, torch.arange(m)[None], torch.ones(1, m, m, dtype=torch.bool).tril(),
                            torch.tensor([m]), torch.tensor([0]), engine.new_cache(1, m))[0].double().numpy()
            expected = np.asarray(fixture[f"{regime.prefix}prompts/{prompt['name']}/prefill_logits"])
            np.testing.assert_allclose(logits, expected, rtol=tolerances["rtol"], atol=tolerances["atol"])


def _kdtree(capsys, *args) -> tuple[int, str]:
    """`kdtree ARGS` in this process (it sets torch to one CPU thread: restored after) -> (exit status,
    stdout and stderr)."""
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return exit_info.value.code, out + err


def test_validate_passes_on_checkpoint_fixtures(fixtures, capsys):
    """The torch engine as an adapter: every model check of both fixtures (the built-in engine's run adds
    its batched decode loops and the invariant on random preset weights, which the engine tests cover).
    A directory of model fixtures exercises no kernel case, so it requires the model-level capabilities."""
    paths = [fixtures(layout) for layout in LAYOUTS]
    code, out = _kdtree(capsys, "validate", "--fixtures", paths[0].parent, "--impl", "engine.adapter:TorchAdapter",
                        "--require", "model,topk,tree,compile,accept,sample_accept")
    assert code == 0, out
    assert "PASSED" in out and "FAIL" not in out
    assert "prefill logits" in out and "verify logits" in out and "DDTree tokens" in out
    assert all(path.name in out for path in paths)


def test_validate_takes_one_fixture_file_and_holds_its_weights_once(fixtures, capsys, monkeypatch):
    """What docs/checkpoints.md tells a user to run on the fixture refgen wrote. The runner decodes each
    weight from the checkpoint once, and the engine's tensors share the runner's arrays' memory, in the
    per-request and in the batched checks alike: one copy of the weights."""
    decoded, shared = Counter(), []
    rebuild, load_weights = CheckpointTensors.array, TorchAdapter.load_weights

    def counted(self, name, *args, **kwargs):
        decoded[name] += 1
        return rebuild(self, name, *args, **kwargs)

    def watched(self, config, weights):
        load_weights(self, config, weights)
        (_, runner), = fixtures_module._WEIGHTS.values()        # the open fixture's arrays
        shared.append(all(self.weights[n].data_ptr() == runner[n].ctypes.data for n in runner)
                      and self.model.lm_head.data_ptr() == runner["lm_head"].ctypes.data)
    monkeypatch.setattr(CheckpointTensors, "array", counted)
    monkeypatch.setattr(TorchAdapter, "load_weights", watched)
    code, out = _kdtree(capsys, "validate", "--fixtures", fixtures("k2-fp8"), "--impl", "engine.adapter:TorchAdapter")
    assert code == 0 and "PASSED" in out, out
    report = validate(TorchAdapter(), fixtures("k2-fp8"))        # in this process (the CLI checks in a child)
    assert not [c for c in report.checks if c.status is Status.FAIL]
    assert set(decoded.values()) == {1} and len(decoded) == len(weight_shapes(IMPORTED["k2-fp8"].cfg)), decoded
    assert shared == [True, True]                       # per request, then batched


def test_demo_runs_on_a_checkpoint_fixture(fixtures, capsys):
    code, out = _kdtree(capsys, "demo", "--fixture", fixtures("k25-int4"), "--max-new-tokens", 6, "--budget", 8)
    assert code == 0, out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_decodes_what_refgen_imported_and_the_formulas_give(fixtures, layout):
    """The engine's weights from the fixture's references (load_fixture_weights, float32) == refgen's
    import bit for bit == the checkpoint's tensors as safetensors reads them, dequantized by
    docs/checkpoints.md's formulas in torch (FP8 in float32 arithmetic: one rounding of the exact
    product) and compressed-tensors (INT4), each weight cut to its slice."""
    _, weights = load_fixture_weights(fixtures(layout))
    imported = IMPORTED[layout]
    with kdtr_format.open(fixtures(layout)) as fixture:
        entries, checkpoint = fixture.metadata[CHECKPOINT_TENSORS], Path(fixture.metadata["checkpoint"]["path"])
    tensors = {}
    for file in checkpoint.glob("*.safetensors"):
        tensors.update(load_file(file))
    decodes = set()
    for name, value in weights.items():
        np.testing.assert_array_equal(value.numpy(), np.asarray(imported.weights[name], np.float32), err_msg=name)
        entry = entries[f"weights/{name}"]
        decodes.add(entry["decode"])
        parts = [_dequantize(tensors, part, entry) for part in entry.get("experts", [entry.get("tensors")])]
        formula = np.stack(parts) if "experts" in entry else parts[0]
        if "rows" in entry:
            formula = formula[..., slice(*entry["rows"]), :]
        np.testing.assert_array_equal(value.numpy(), formula.astype(np.float32), err_msg=name)
    assert decodes == {"plain", "fp8" if layout == "k2-fp8" else "int4"}


def _dequantize(tensors: dict[str, torch.Tensor], part: dict, entry: dict) -> np.ndarray:
    """One part of an entry from the safetensors-loaded tensors, as an engine would: FP8 in float32
    arithmetic (one rounding of the exact product, as the fixture's weights), INT4 by compressed-tensors."""
    def get(role: str) -> torch.Tensor:
        ref = part[role]
        value = tensors[ref["tensor"]]
        return value[KEPT] if list(value.shape) != ref["shape"] else value
    if entry["decode"] == "fp8":
        q, scale = get("data"), get("scale_inv")
        rows, cols = q.shape
        return (q.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]).numpy()
    if entry["decode"] == "int4":
        module = part["packed"]["tensor"].removesuffix(".weight_packed")
        return int4_dequantize({k: tensors[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")})
    return get("data").double().numpy()


def _copy_fixture_and_checkpoint(fixtures, tmp_path, layout: str) -> tuple[Path, Path]:
    """A copy of a layout's fixture whose metadata names a copy of its checkpoint -> (fixture, checkpoint)."""
    with kdtr_format.open(fixtures(layout)) as reader:
        metadata = reader.metadata
        tensors = {name: np.asarray(reader[name]) for name in reader.names()}
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(metadata["checkpoint"]["path"], checkpoint)
    metadata["checkpoint"]["path"] = str(checkpoint)
    path = tmp_path / "fixtures" / fixtures(layout).name
    path.parent.mkdir()
    kdtr_format.write(path, tensors, metadata=metadata)
    return path, checkpoint


def test_a_moved_or_changed_checkpoint_is_one_line_naming_the_tensor_and_path(fixtures, tmp_path, capsys):
    """Changed bytes (one FP8 value of an expert) and a missing file: load_fixture_weights raises, and
    `kdtree validate` prints one line naming the weight, the checkpoint tensor and its file; exit 1."""
    path, checkpoint = _copy_fixture_and_checkpoint(fixtures, tmp_path, "k2-fp8")
    with kdtr_format.open(path) as reader:
        ref = reader.metadata[CHECKPOINT_TENSORS]["weights/layers.1.moe.experts.w_up"]["experts"][2]["data"]
    file = checkpoint / ref["file"]
    with open(file, "r+b") as f:
        f.seek(ref["ranges"][0][0] + 5)
        byte = f.read(1)
        f.seek(ref["ranges"][0][0] + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    changed = rf"weights/layers.1.moe.experts.w_up: {re.escape(ref['tensor'])} in {re.escape(str(file))} has changed"
    with pytest.raises(CheckpointTensorError, match=changed):
        load_fixture_weights(path)
    code, out = _kdtree(capsys, "validate", "--fixtures", path, "--impl", "engine.adapter:TorchAdapter")
    lines = [line for line in out.splitlines() if "has changed" in line]
    assert code == 2 and len(lines) == 1 and ref["tensor"] in lines[0] and str(file) in lines[0], out
    file.unlink()
    missing = rf"references .* in {re.escape(str(checkpoint))}/.*, which does not exist"
    with pytest.raises(CheckpointTensorError, match=missing):
        load_fixture_weights(path)
