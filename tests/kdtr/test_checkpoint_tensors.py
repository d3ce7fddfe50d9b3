"""kdtr_format.checkpoint_tensors: tensors a fixture names instead of storing, rebuilt from a checkpoint's bytes.

A tiny safetensors file written by safetensors' own (torch) writer holds a bf16 weight, an FP8 weight with
its block scales, and a router whose rows 0-1 and 4-5 a slice keeps. Checked: each entry rebuilds to
what numpy computes from the tensors safetensors reads back (the bf16 rounding too); and every way
the source can go wrong (moved, changed, too short, a malformed entry) is one CheckpointTensorError line
naming the tensor and, where there is one, the path. The decoders' formulas against the outside
oracles (torch, compressed-tensors) are tests/refgen/test_checkpoint_import.py's; the engine's
decode against refgen's import, tests/engine/test_checkpoint_fixture.py's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kdtr_format.checkpoint_tensors import CheckpointTensorError, CheckpointTensors

KEEP = [0, 1, 4, 5]


def _offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute byte ranges of each tensor's data (the safetensors header, as the format defines it)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    return {name: (8 + length + v["data_offsets"][0], 8 + length + v["data_offsets"][1])
            for name, v in header.items() if name != "__metadata__"}


def _ref(path: Path, name: str, ranges: list[tuple[int, int]], dtype: str, shape: list[int]) -> dict:
    raw = path.read_bytes()
    data = b"".join(raw[b:e] for b, e in ranges)
    return {"file": path.name, "tensor": name, "dtype": dtype, "shape": shape, "ranges": [list(r) for r in ranges],
            "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture()
def checkpoint(tmp_path):
    """-> (metadata with three checkpoint weights and one bf16 rounding, the tensors safetensors reads back)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(6, 8, generator=generator).bfloat16(),
               "proj.weight": (torch.randn(5, 12, generator=generator) * 4).to(torch.float8_e4m3fn),
               "proj.weight_scale_inv": torch.rand(3, 2, generator=generator) + 0.5,
               "gate.weight": torch.randn(8, 8, generator=generator)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    at = _offsets(path)
    row = (at["gate.weight"][1] - at["gate.weight"][0]) // 8
    gate = [(at["gate.weight"][0] + a * row, at["gate.weight"][0] + b * row) for a, b in ((0, 2), (4, 6))]
    entries = {
        "weights/embed": {"dtype": "float32", "shape": [6, 8], "decode": "plain",
                          "tensors": {"data": _ref(path, "embed.weight", [at["embed.weight"]], "BF16", [6, 8])}},
        "weights/proj": {"dtype": "float32", "shape": [5, 12], "decode": "fp8",
                         "block": [2, 8],
                         "tensors": {"data": _ref(path, "proj.weight", [at["proj.weight"]], "F8_E4M3", [5, 12]),
                                     "scale_inv": _ref(path, "proj.weight_scale_inv", [at["proj.weight_scale_inv"]],
                                                       "F32", [3, 2])}},
        "weights/gate": {"dtype": "float32", "shape": [4, 8], "decode": "plain",
                         "tensors": {"data": _ref(path, "gate.weight", gate, "F32", [4, 8])}},
        "bf16/weights/proj": {"dtype": "bfloat16", "shape": [5, 12], "decode": "bf16", "of": "weights/proj"},
    }
    back = {name: value.double().numpy() for name, value in load_file(path).items()}
    return {"checkpoint_tensors": entries, "checkpoint": {"path": str(tmp_path)}}, back


def test_each_source_rebuilds_to_the_tensors_safetensors_reads(checkpoint):
    metadata, back = checkpoint
    rebuilt = CheckpointTensors(metadata)
    np.testing.assert_array_equal(rebuilt.array("weights/embed"), back["embed.weight"].astype(np.float32))
    assert rebuilt.array("weights/embed", as_stored=True).dtype == ml_dtypes.bfloat16
    q, s = back["proj.weight"], back["proj.weight_scale_inv"]
    expected = (q * np.repeat(np.repeat(s, 2, 0)[:5], 8, 1)[:, :12]).astype(np.float32)
    np.testing.assert_array_equal(rebuilt.array("weights/proj"), expected)
    np.testing.assert_array_equal(rebuilt.array("weights/gate"), back["gate.weight"][KEEP])
    rounded = rebuilt.array("bf16/weights/proj")
    assert rounded.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(rounded, expected.astype(ml_dtypes.bfloat16))
    assert rebuilt.names("weights/") == ["weights/embed", "weights/gate", "weights/proj"]


def test_a_changed_byte_is_named_with_its_tensor_and_path(checkpoint, tmp_path):
    metadata, _ = checkpoint
    path = tmp_path / "model.safetensors"
    begin, _ = metadata["checkpoint_tensors"]["weights/gate"]["tensors"]["data"]["ranges"][1]
    raw = bytearray(path.read_bytes())
    raw[begin + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    rebuilt = CheckpointTensors(metadata)
    np.testing.assert_array_equal(rebuilt.array("weights/embed").shape, (6, 8))      # other tensors still load
    changed = rf"^weights/gate: gate.weight in {path} has changed since the fixture was made"
    with pytest.raises(CheckpointTensorError, match=changed + r" \(sha256 [0-9a-f]{16}\.\.\., the fixture recorded"):
        rebuilt.array("weights/gate")


def test_a_moved_checkpoint_is_named_with_the_path(checkpoint, tmp_path):
    metadata, _ = checkpoint
    (tmp_path / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    missing = rf"^weights/proj: references proj.weight in {tmp_path}/model.safetensors, which does not exist"
    with pytest.raises(CheckpointTensorError, match=missing):
        CheckpointTensors(metadata).array("weights/proj")
    moved = CheckpointTensors(metadata, checkpoint=tmp_path / "gone")
    with pytest.raises(CheckpointTensorError, match="which does not exist"):
        moved.array("bf16/weights/proj")


@pytest.mark.parametrize("change, message", [
    (lambda e: e["tensors"]["data"].update(ranges=[[0, 10 ** 9]]), "do not fit the file"),
    (lambda e: e["tensors"]["data"].update(file="../model.safetensors"), "is not a file name"),
    (lambda e: e["tensors"]["data"].update(dtype="F4"), "not a safetensors dtype"),
    (lambda e: e["tensors"]["data"].pop("sha256"), "a malformed checkpoint reference"),
    (lambda e: e.update(decode="fp4"), "decode 'fp4' is not one of"),
    (lambda e: e.update(shape=[6, 9]), "decodes to shape"),
    (lambda e: e["tensors"]["data"].update(shape=[3, 8]),           # the bytes fit the file, not this shape
     r"embed.weight in .*/model.safetensors: the referenced bytes \[\(\d+, \d+\)\] hold 96 bytes, its shape "
     r"\[3, 8\] of bfloat16 needs 48"),
    (lambda e: e.update(shape=[-6, 8]), r"its entry has shape \[-6, 8\], not a list of integers >= 0"),
    (lambda e: e["tensors"]["data"].update(shape=[-6, -8]), r"embed.weight has shape \[-6, -8\], not a list"),
    (lambda e: e.update(decode="bf16", of="weights/nothing"), "rounds 'weights/nothing', which is not another"),
    (lambda e: e.pop("tensors"), "expected 'tensors'"),
])
def test_a_malformed_entry_is_one_line_naming_the_tensor(checkpoint, change, message):
    metadata, _ = checkpoint
    change(metadata["checkpoint_tensors"]["weights/embed"])
    with pytest.raises(CheckpointTensorError, match=rf"^weights/embed: .*{message}") as raised:
        CheckpointTensors(metadata).array("weights/embed")
    assert "\n" not in str(raised.value)


def test_rounding_needs_another_checkpoint_tensor(checkpoint):
    metadata, _ = checkpoint
    metadata["checkpoint_tensors"]["bf16/weights/proj"]["of"] = "bf16/weights/proj"
    with pytest.raises(CheckpointTensorError, match=r"^bf16/weights/proj: rounds 'bf16/weights/proj', which is not"):
        CheckpointTensors(metadata).array("bf16/weights/proj")


def test_a_stacked_shape_beyond_its_parts_is_refused_before_anything_is_allocated(checkpoint):
    """2^41 float32 elements (8 TiB) declared over two parts of 48 elements."""
    metadata, _ = checkpoint
    entries = metadata["checkpoint_tensors"]
    part = entries["weights/embed"]["tensors"]
    entries["weights/stacked"] = {"dtype": "float32", "shape": [2, 2 ** 20, 2 ** 20], "decode": "plain",
                                  "experts": [part, part]}
    with pytest.raises(CheckpointTensorError, match=r"^weights/stacked: part 0 decodes to shape \[6, 8\], the entry "
                                                    r"says \[1048576, 1048576\]$"):
        CheckpointTensors(metadata).array("weights/stacked")
    entries["weights/stacked"]["shape"] = [2, 6, 8]
    np.testing.assert_array_equal(CheckpointTensors(metadata).array("weights/stacked")[1],
                                  CheckpointTensors(metadata).array("weights/embed"))


def test_a_rounding_of_a_rounding_is_refused_not_followed(checkpoint):
    """Two roundings naming each other were a RecursionError."""
    metadata, _ = checkpoint
    entries = metadata["checkpoint_tensors"]
    entries["bf16/weights/embed"] = {"dtype": "bfloat16", "shape": [6, 8], "decode": "bf16", "of": "bf16/weights/proj"}
    entries["bf16/weights/proj"]["of"] = "bf16/weights/embed"
    with pytest.raises(CheckpointTensorError, match=r"^bf16/weights/proj: rounds 'bf16/weights/embed', which is not "
                                                    r"decoded from the checkpoint"):
        CheckpointTensors(metadata).array("bf16/weights/proj")


def test_an_emptied_checkpoint_file_is_named(checkpoint, tmp_path):
    metadata, _ = checkpoint
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointTensorError, match=rf"^weights/proj: references proj.weight in "
                                                    rf"{tmp_path}/model.safetensors, which is empty \(0 bytes\)"):
        CheckpointTensors(metadata).array("weights/proj")


def test_kdtr_cat_rebuilds_a_checkpoint_tensor_and_names_the_fixture_when_it_cannot(checkpoint, tmp_path):
    import kdtr_format
    from click.testing import CliRunner
    from kdtr_format.cli import main

    metadata, back = checkpoint
    fixture = tmp_path / "fixture.kdtr"
    kdtr_format.write(fixture, {"prompts/p0": np.zeros(2, np.int64)}, metadata=metadata)
    result = CliRunner().invoke(main, ["cat", "--values", str(fixture), "weights/gate"], prog_name="kdtr")
    assert result.exit_code == 0, result.output
    header, *values = result.stdout.splitlines()
    assert header == f"weights/gate: float32 [4, 8] (rebuilt from the checkpoint {tmp_path})"
    with np.printoptions(threshold=10 ** 9, linewidth=shutil.get_terminal_size((80, 24)).columns):
        assert "\n".join(values) == np.array2string(back["gate.weight"][KEEP].astype(np.float32))
    metadata["checkpoint_tensors"]["weights/gate"]["shape"] = [-4, 8]
    kdtr_format.write(fixture, {"prompts/p0": np.zeros(2, np.int64)}, metadata=metadata)
    result = CliRunner().invoke(main, ["cat", str(fixture), "weights/gate"], prog_name="kdtr")
    assert result.exit_code == 2 and result.stderr == (f"kdtr: error: {fixture}: weights/gate: its entry has shape "
                                                      "[-4, 8], not a list of integers >= 0\n"), result.output
