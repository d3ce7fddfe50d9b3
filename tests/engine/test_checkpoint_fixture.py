"""The engine on fixtures made from checkpoints (refgen generate --checkpoint).

Two small synthetic checkpoints in shipped layouts (tests/synthetic_checkpoint.py): Kimi K2's FP8
blocks with an MTP layer, and Kimi K2.5's INT4 experts under text_config, each sliced to 2 layers and
4 experts. Checked: the engine loads the fixture in its compute dtype and matches the references within
the fixture's tolerances; `kdtree validate --fixtures DIR` passes on them; and the checkpoint's own
bits stored beside the weights dequantize, by the formulas docs/checkpoints.md gives (torch and
compressed-tensors here), to exactly the fixture's float32 weights, so an engine can load either.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kdtr_format
from engine.cli import main
from engine.model import Transformer
from engine.validate.regime import Regime
from engine.weights import ROUTER_WEIGHTS, load_fixture_weights
from refgen.checkpoint import checkpoint_fixture, load, open_checkpoint, plan_import
from refgen.files import write_fixture
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, int4_dequantize, write_checkpoint

LAYOUTS = {"k2-fp8": Layout(quant="fp8", mtp=True), "k25-int4": Layout(quant="int4", multimodal=True)}


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


def test_validate_takes_one_fixture_file(fixtures, capsys):
    """What docs/checkpoints.md tells a user to run on the fixture refgen wrote."""
    code, out = _kdtree(capsys, "validate", "--fixtures", fixtures("k2-fp8"), "--impl", "engine.adapter:TorchAdapter")
    assert code == 0 and "PASSED" in out, out


def test_demo_runs_on_a_checkpoint_fixture(fixtures, capsys):
    code, out = _kdtree(capsys, "demo", "--fixture", fixtures("k25-int4"), "--max-new-tokens", 6, "--budget", 8)
    assert code == 0, out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_bits_dequantize_to_the_fixture_weights(fixtures, layout):
    """metadata.checkpoint.weights names each weight's source; its bits under checkpoint/ give weights/."""
    with kdtr_format.open(fixtures(layout)) as fixture:
        sources = fixture.metadata["checkpoint"]["weights"]
        experts = fixture.metadata["checkpoint"]["kept_experts"]
        formats = set()
        for name, source in sources.items():
            formats.add(source["format"])
            names = ([source["tensor"].format(e=e) for e in experts] if "{e}" in source["tensor"]
                     else [source["tensor"]])
            value = np.stack([_dequantize(fixture, n, source["format"]) for n in names]) if len(names) > 1 \
                else _dequantize(fixture, names[0], source["format"])
            if "rows" in source:
                value = value[..., slice(*source["rows"]), :]
            np.testing.assert_array_equal(np.asarray(fixture[f"weights/{name}"]), value.astype(np.float32),
                                          err_msg=name)
    assert formats == {"plain", "fp8" if layout == "k2-fp8" else "int4"}


def _dequantize(fixture, tensor: str, how: str) -> np.ndarray:
    """As an engine would: FP8 in float32 arithmetic (one rounding of the exact product, as weights/)."""
    get = fixture.torch
    if how == "fp8":
        q, scale = get(f"checkpoint/{tensor}"), get(f"checkpoint/{tensor}_scale_inv")
        rows, cols = q.shape
        return (q.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]).numpy()
    if how == "int4":
        module = tensor.removesuffix(".weight")
        return int4_dequantize({k: get(f"checkpoint/{module}.{k}") for k in
                                ("weight_packed", "weight_scale", "weight_shape")})
    return get(f"checkpoint/{tensor}").double().numpy()
