"""Hostile checkpoints: JSON nested past Python's reader, configs declaring 10^8 layers or 10^9 MTP
layers, NaN and infinity in kept weights. Each is refused in one line naming the file or tensor, at
a cost bounded by the directory's own size, or (declared MTP layers the files do not hold) accepted
with a note, never run.

The checkpoints have published structures (tests/synthetic_checkpoint.py): DeepSeek-V3's FP8 blocks
with its MTP layer, and NVIDIA NeMo's bf16 conversion of it (the MTP layer kept, declared 0).
The CLI runs as a user runs it, in a pty at 80 columns and piped: one line, exit 2, no traceback, no
fixture written.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from refgen.checkpoint import CheckpointError, load, open_checkpoint, plan_import
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, edit_config, edit_index, edit_tensors, write_checkpoint
from terminal import assert_clean_error, in_terminal, piped

TINY = dataclasses.replace(SMALL, num_hidden_layers=2, n_routed_experts=4, n_group=1, topk_group=1)
LAYOUTS = {"v3-fp8": Layout(quant="fp8", mtp=True),
           "nemo-bf16": Layout(quant="bf16", mtp=True, declare_mtp=False)}
DEEP = 100_000


def nested(directory: Path, file: str, depth: int = DEEP) -> None:
    """`file` holding arrays `depth` deep: in place of the index's weight_map, or as config.json's
    id2label (an inert key)."""
    path = directory / file
    if file == "config.json":
        path.write_text(path.read_text().rstrip().removesuffix("}") + ', "id2label": ' + "[" * depth + "]" * depth
                        + "}")
    else:
        path.write_text('{"weight_map": ' + "[" * depth + "]" * depth + "}")


def nan_at(name: str, index: tuple[int, ...], value: float = float("nan")) -> Callable[[Path], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name][index] = value
    return lambda directory: edit_tensors(directory, change)


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"
SCALE = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
CASES = {
    # id: (base, break it, fragments of the one error line)
    "config.json nested": ("v3-fp8", lambda d: nested(d, "config.json"),
                           ["config.json: arrays or objects nested deeper than Python's JSON reader goes", "at most 32"]),
    "index nested": ("v3-fp8", lambda d: nested(d, "model.safetensors.index.json"),
                     ["model.safetensors.index.json: arrays or objects nested deeper than"]),
    # deep enough to load, too deep for the fixture's metadata (JSON too) to hold
    "config.json 900 deep": ("v3-fp8", lambda d: nested(d, "config.json", 900),
                             ["config.json: arrays or objects nested 901 levels deep"]),
    "10^8 layers": ("v3-fp8", lambda d: edit_config(d, lambda c: c.update(num_hidden_layers=10**8)),
                    ["num_hidden_layers is 100000000", "no tensor of layer 3 (3 of the 100000000"]),
    "10^6 layers": ("nemo-bf16", lambda d: edit_config(d, lambda c: c.update(num_hidden_layers=10**6)),
                    ["num_hidden_layers is 1000000", "no tensor of layer 3 (3 of the 1000000"]),
    "nan embedding": ("nemo-bf16", nan_at("model.embed_tokens.weight", (7, 3)),
                      ["model.embed_tokens.weight: holds nan at [7, 3] (BF16)"]),
    "inf norm": ("nemo-bf16", nan_at("model.norm.weight", (5,), float("inf")),
                 ["model.norm.weight: holds inf at [5] (BF16)"]),
    "nan expert": ("nemo-bf16", nan_at(EXPERT, (3, 5)), [f"{EXPERT}: holds nan at [3, 5]"]),
    "nan correction bias": ("nemo-bf16", nan_at(BIAS, (1,)), [f"{BIAS}: holds nan at [1] (F32)"]),
    "inf fp8 scale": ("v3-fp8", nan_at(SCALE, (0, 0), float("inf")), [f"{SCALE}: holds inf at [0, 0] (F32)"]),
}
RUN_CLI = ["config.json nested", "10^8 layers", "nan correction bias", "inf fp8 scale"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Callable[[str], Path]:
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            write_checkpoint(made[name], TINY, init_weights(TINY, 4), LAYOUTS[name])
        return made[name]
    return get


@pytest.fixture
def hostile(base, tmp_path) -> Callable[[str], Path]:
    def make(case: str) -> Path:
        directory = tmp_path / case.replace(" ", "-").replace("^", "")
        shutil.copytree(base(CASES[case][0]), directory)
        CASES[case][1](directory)
        return directory
    return make


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_checkpoint_is_refused_naming_the_problem(hostile, case):
    directory = hostile(case)
    with pytest.raises(CheckpointError) as error:
        load(plan_import(open_checkpoint(directory)))
    for fragment in CASES[case][2]:
        assert fragment in str(error.value), str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["terminal", "piped"])
@pytest.mark.parametrize("case", RUN_CLI)
def test_cli_refuses_in_one_line_and_writes_nothing(hostile, tmp_path, case, run):
    """About 1.5 s a run: 8 fresh interpreters (the error itself is found in milliseconds)."""
    directory, out = hostile(case), tmp_path / "out"
    argv = ["refgen", "generate", "--checkpoint", str(directory), "--out", str(out)]
    result = (in_terminal(argv, columns=80) if run == "terminal" else piped(argv))
    assert_clean_error(result, CASES[case][2][0])
    assert result.returncode == 2, result.output
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_declared_mtp_layers_the_files_lack_are_a_note(base, tmp_path):
    """num_nextn_predict_layers 10^9 and one MTP layer held: nothing per declared layer is built; the
    metadata lists the layer held, a note the difference (kdtree runs no MTP layer, so none is missing)."""
    directory = tmp_path / "ckpt"
    shutil.copytree(base("v3-fp8"), directory)
    edit_config(directory, lambda c: c.update(num_nextn_predict_layers=10**9))
    plan = plan_import(open_checkpoint(directory))
    imported = load(plan)
    assert imported.metadata["mtp"] == {"layers": [2], "declared": 10**9, "tensors": plan.counts["mtp"], "kept": False}
    assert plan.counts["mtp"] > 0
    assert any("declares 1000000000 MTP layer(s)" in note and "hold 1" in note for note in plan.notes), plan.notes
