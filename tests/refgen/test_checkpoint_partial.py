"""A partial download: config.json declares 61 layers, the directory holds the shards of the layers a
slice reads (the index names the rest). The slice is refused only for what it reads and lacks, naming
the tensor and its shard (or the layer no file or index names); what it does not need is one note."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from refgen.checkpoint import CheckpointError, load, open_checkpoint, plan_import
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, edit_config, write_checkpoint
from terminal import piped

FOUR = dataclasses.replace(SMALL, num_hidden_layers=4, n_routed_experts=4, n_group=1)
DECLARED = 61
INDEX = "model.safetensors.index.json"


def shard_layers(directory: Path) -> dict[str, set[int | None]]:
    """Shard file -> the layers it holds tensors of (None: the embedding, final norm or head)."""
    held: dict[str, set[int | None]] = {}
    for name, file in json.loads((directory / INDEX).read_text())["weight_map"].items():
        parts = name.split(".")
        held.setdefault(file, set()).add(int(parts[2]) if parts[1] == "layers" else None)
    return held


@pytest.fixture(scope="module")
def partial(tmp_path_factory) -> tuple[Path, list[str]]:
    """-> (a 4-layer FP8 checkpoint in 13 shards, config.json saying 61 layers, the shards holding only
    layers 2 and 3 deleted; those shards)."""
    directory = tmp_path_factory.mktemp("partial")
    write_checkpoint(directory, FOUR, init_weights(FOUR, 1), Layout(quant="fp8", shard_bytes=1 << 17),
                     keep_dequantized=False)
    deleted = sorted(file for file, layers in shard_layers(directory).items() if layers <= {2, 3})
    assert deleted and all(not ({0, 1, None} & shard_layers(directory)[f]) for f in deleted)
    for file in deleted:
        (directory / file).unlink()
    edit_config(directory, lambda config: config.update(num_hidden_layers=DECLARED))
    return directory, deleted


def test_a_slice_of_the_layers_held_imports_with_one_note(partial):
    directory, deleted = partial
    plan = plan_import(open_checkpoint(directory), layers=2)
    notes = [note for note in plan.notes if "partial" in note]
    assert notes == [f"a partial checkpoint: config.json declares {DECLARED} layers, the checkpoint holds 4 (0..3); "
                     f"{len(deleted)} shard(s) {INDEX} names are absent "
                     f"({sum(1 for f in json.loads((directory / INDEX).read_text())['weight_map'].values() if f in deleted)}"
                     " tensors); the slice (layers 0..1) reads none of what is missing"], plan.notes
    imported = load(plan)
    assert imported.cfg.num_hidden_layers == 2


def test_a_slice_reading_an_absent_shard_is_refused_naming_it(partial):
    directory, deleted = partial
    with pytest.raises(CheckpointError, match=rf"^model\.layers\.2\.\S+: in ({'|'.join(deleted)}), which {INDEX} "
                                              r"names but the directory lacks; the slice \(--layers 3\) reads it"):
        plan_import(open_checkpoint(directory), layers=3)


def test_a_slice_reading_a_layer_nothing_names_is_refused_naming_it(partial):
    directory, _ = partial
    with pytest.raises(CheckpointError, match=rf"^config\.json: num_hidden_layers is {DECLARED}, but the checkpoint "
                                              rf"holds no tensor of layer 4 \(4 of the {DECLARED} layers are there\); "
                                              r"the slice \(--layers 5\) reads layers 0\.\.4$"):
        plan_import(open_checkpoint(directory), layers=5)


def test_one_file_holding_the_slice_s_layers_imports(tmp_path):
    """No index: model.safetensors holds layers 0 and 1 of the 61 declared."""
    two = dataclasses.replace(FOUR, num_hidden_layers=2)
    write_checkpoint(tmp_path, two, init_weights(two, 1), Layout(quant="fp8", shard_bytes=1 << 30),
                     keep_dequantized=False)
    (tmp_path / INDEX).unlink()
    (tmp_path / "model-00001-of-00001.safetensors").rename(tmp_path / "model.safetensors")
    edit_config(tmp_path, lambda config: config.update(num_hidden_layers=DECLARED))
    plan = plan_import(open_checkpoint(tmp_path), layers=2)
    assert f"a partial checkpoint: config.json declares {DECLARED} layers, the checkpoint holds 2 (0..1); the slice " \
           "(layers 0..1) reads none of what is missing" in plan.notes
    with pytest.raises(CheckpointError, match="holds no tensor of layer 2"):
        plan_import(open_checkpoint(tmp_path))


def test_generate_slices_a_partial_download(partial, tmp_path):
    """As the issue ran it: `refgen generate --checkpoint DIR --layers 2`, piped."""
    directory, _ = partial
    result = piped(["refgen", "generate", "--checkpoint", str(directory), "--layers", "2", "--out", str(tmp_path)])
    assert result.returncode == 0, result.output
    assert "note: a partial checkpoint: config.json declares 61 layers" in result.stderr, result.stderr
    assert (tmp_path / f"{directory.name}-layers2.kdtr").is_file()
