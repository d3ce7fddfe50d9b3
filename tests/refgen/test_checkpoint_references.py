"""A checkpoint fixture's references (metadata ``checkpoint_tensors``) broken after it was made:
`refgen export --dtype bfloat16`, which rebuilds every weight from them, refuses each in one line
naming the fixture, the tensor and, where one is read, the checkpoint file; exit 2, no traceback,
nothing written. (kdtr_format's own checks of each reference: tests/kdtr/test_checkpoint_tensors.py.)
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner

import kdtr_format
from refgen.cli import main
from refgen.weights import init_weights
from synthetic_checkpoint import SMALL, Layout, write_checkpoint
from terminal import assert_clean_error, piped

TINY = dataclasses.replace(SMALL, num_hidden_layers=2, n_routed_experts=4, n_group=1)
SHARD = "model-00001-of-00001.safetensors"
EMBED, NORM, EXPERTS = "weights/embed_tokens", "weights/norm", "weights/layers.1.moe.experts.w_down"
Entries = dict[str, Any]


def _cycle(entries: Entries) -> None:
    entries["bf16/" + EMBED]["of"] = "bf16/" + NORM
    entries["bf16/" + NORM]["of"] = "bf16/" + EMBED


def _stacked_2_40(entries: Entries) -> None:
    entries[EXPERTS]["shape"] = [len(entries[EXPERTS]["experts"]), 2 ** 19, 2 ** 19]


def _bytes_for_another_shape(entries: Entries) -> None:
    ref = entries[EMBED]["tensors"]["data"]
    ref["shape"] = [ref["shape"][0] // 2, ref["shape"][1]]


# id: (break the references, the checkpoint file emptied, fragments of the error line after "<fixture>: ")
CASES: dict[str, tuple[Callable[[Entries], None], bool, list[str]]] = {
    "bf16 cycle": (_cycle, False, [f"bf16/{EMBED}: rounds 'bf16/{NORM}', which is not decoded from the checkpoint"]),
    "stacked 2^40": (_stacked_2_40, False, [f"{EXPERTS}: part 0 decodes to shape [192, 64], the entry says "
                                            "[524288, 524288]"]),
    "negative dimension": (lambda e: e[EMBED].update(shape=[-512, 192]), False,
                           [f"{EMBED}: its entry has shape [-512, 192], not a list of integers >= 0"]),
    "bytes fit the file, not the shape": (_bytes_for_another_shape, False,
                                          [f"{EMBED}: model.embed_tokens.weight in ", SHARD,
                                           "hold 196608 bytes, its shape [256, 192] of bfloat16 needs 98304"]),
    "empty file": (lambda e: None, True, [f"{EMBED}: references model.embed_tokens.weight in ", SHARD,
                                          "which is empty (0 bytes)"]),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """-> (a small FP8 checkpoint, the fixture `refgen generate --checkpoint` makes of it)."""
    root = tmp_path_factory.mktemp("references")
    write_checkpoint(root / "ckpt", TINY, init_weights(TINY, 1), Layout(quant="fp8"))
    result = CliRunner().invoke(main, ["generate", "--checkpoint", str(root / "ckpt"), "--out", str(root / "out")])
    assert result.exit_code == 0, result.output
    return root / "ckpt", root / "out" / "ckpt.kdtr"


def broken(made: tuple[Path, Path], tmp_path: Path, case: str) -> Path:
    """A copy of the fixture (and, to empty a file, of the checkpoint) with the case's references."""
    checkpoint, fixture = made
    change, empty, _ = CASES[case]
    with kdtr_format.open(fixture) as reader:
        metadata = copy.deepcopy(reader.metadata)
        tensors = {name: reader[name] for name in reader.names()}
    change(metadata["checkpoint_tensors"])
    if empty:
        shutil.copytree(checkpoint, tmp_path / "ckpt")
        (tmp_path / "ckpt" / SHARD).write_bytes(b"")
        metadata["checkpoint"]["path"] = str(tmp_path / "ckpt")
    path = tmp_path / "broken.kdtr"
    kdtr_format.write(path, tensors, metadata=metadata)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_export_refuses_a_broken_reference_in_one_line(made, tmp_path, case):
    fixture, out = broken(made, tmp_path, case), tmp_path / "exported"
    result = CliRunner().invoke(main, ["export", str(fixture), "--dtype", "bfloat16", "--out", str(out)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"refgen: error: {fixture}: ") and "Traceback" not in result.output, lines
    for fragment in CASES[case][2]:
        assert fragment in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_the_cycle_is_one_line_piped(made, tmp_path):
    """As a script runs it (was: `internal error: RecursionError`, exit 3)."""
    fixture = broken(made, tmp_path, "bf16 cycle")
    result = piped(["refgen", "export", str(fixture), "--dtype", "bfloat16", "--out", str(tmp_path / "exported")])
    assert_clean_error(result, CASES["bf16 cycle"][2][0])
    assert result.returncode == 2
