"""Slim and full fixtures: the committed files omit exactly the seeded tensors and record
their checksums; `refgen materialize` draws them again into the full fixture (a directory
keeps its layout, a full file is copied), which `refgen verify` accepts as it accepts the
slim one; a checksum that does not match, a stale hash, a file that is no fixture, two
sources for one destination: one line, exit 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import kdtr_format
from kdtr_format import PRESETS
from refgen.bf16 import bf16_weights
from refgen.files import SEEDED_INPUTS, checksum, content_hash, omitted, stored_hash_problem
from refgen.regen import compare
from refgen.weights import init_weights


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refgen: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def rewritten(source: Path, destination: Path, change) -> Path:
    """A copy of a fixture with its metadata changed by `change`, the content hash recomputed."""
    with kdtr_format.open(source) as reader:
        tensors = {n: np.array(reader[n]) for n in reader.names()}
        metadata = reader.metadata
    change(metadata)
    metadata["content_hash"] = content_hash(metadata, tensors)
    kdtr_format.write(destination, tensors, metadata)
    return destination


def test_the_committed_files_omit_exactly_the_seeded_tensors(committed_golden, golden):
    for relative in ("tiny.kdtr", "tiny2.kdtr", *(f"kernels/{kind}.kdtr" for kind in SEEDED_INPUTS)):
        with kdtr_format.open(committed_golden / relative) as slim, kdtr_format.open(golden / relative) as full:
            recorded = slim.metadata.get("seeded_tensors", {})
            assert set(slim.names()) | set(recorded) == set(full.names()), relative
            assert omitted(slim) == list(recorded) and omitted(full) == []
            for name in recorded:
                assert not name.startswith(("prompts/", "traces/")) and not name.endswith(("o_lat", "lse", "_after"))
                assert checksum(np.asarray(full[name])) == recorded[name], name
            assert {k: v for k, v in full.metadata.items() if k != "content_hash"} == \
                {k: v for k, v in slim.metadata.items() if k != "content_hash"}
            assert compare(slim, full) == [] and compare(full, slim) == []
    with kdtr_format.open(committed_golden / "kernels/corpus.kdtr") as corpus:
        assert "seeded_tensors" not in corpus.metadata


def test_materialize_draws_the_weights_and_inputs_again(committed_golden, refgen_cli, tmp_path):
    sources = tmp_path / "slim"
    (sources / "kernels").mkdir(parents=True)
    shutil.copy(committed_golden / "tiny2.kdtr", sources)
    shutil.copy(committed_golden / "kernels/accept_compact.kdtr", sources / "kernels")
    result = refgen_cli("materialize", sources, "--out", tmp_path / "full")
    assert result.exit_code == 0, result.output
    full = tmp_path / "full"
    assert files_under(full) == [full / "kernels/accept_compact.kdtr", full / "tiny2.kdtr"]
    weights = init_weights(PRESETS["tiny2"], 0)
    with kdtr_format.open(tmp_path / "full/tiny2.kdtr") as full:
        assert stored_hash_problem(full) is None and omitted(full) == []
        for name, w in weights.items():
            assert np.asarray(full[f"weights/{name}"]).tobytes() == w.tobytes()
        rounded = bf16_weights(weights)["lm_head"]
        assert np.asarray(full["bf16/weights/lm_head"]).tobytes() == rounded.tobytes()
    again = refgen_cli("materialize", tmp_path / "full/tiny2.kdtr", "--out", tmp_path / "copy")   # a full file: copied
    assert again.exit_code == 0 and (tmp_path / "copy/tiny2.kdtr").read_bytes() == \
        (tmp_path / "full/tiny2.kdtr").read_bytes()


def test_a_seeded_tensor_that_does_not_draw_again_is_an_error_naming_it(committed_golden, refgen_cli, tmp_path):
    def wrong_checksum(metadata):
        metadata["seeded_tensors"]["weights/lm_head"]["sha256"] = "0" * 64

    source = rewritten(committed_golden / "tiny2.kdtr", tmp_path / "tiny2.kdtr", wrong_checksum)
    result = refgen_cli("materialize", source, "--out", tmp_path / "out")
    assert_one_line_error(result, "tiny2.kdtr: weights/lm_head: drawn again from seed 0", "numpy's random stream")
    assert files_under(tmp_path / "out") == []
    verify = refgen_cli("verify", source)
    assert verify.exit_code == 1 and "weights/lm_head: the seeded tensor regenerates as" in verify.stdout


@pytest.mark.parametrize("case", ["stale-hash", "no-fixture", "one-destination", "empty-directory"])
def test_bad_sources_are_one_line_and_write_nothing(committed_golden, refgen_cli, tmp_path, case):
    out = tmp_path / "out"
    if case == "stale-hash":
        source = tmp_path / "accept_compact.kdtr"
        shutil.copy(committed_golden / "kernels/accept_compact.kdtr", source)
        with kdtr_format.open(source) as reader:
            tensors = {n: np.array(reader[n]) for n in reader.names()}
            metadata = reader.metadata
        tensors["cases/non_prefix/c_kv_after"].flat[0] += 1.0
        kdtr_format.write(source, tensors, metadata)
        args, fragments = [source], ("accept_compact.kdtr: content_hash: stored",)
    elif case == "no-fixture":
        kdtr_format.write(tmp_path / "weights.kdtr", {"w": np.ones(2)})
        args, fragments = [tmp_path / "weights.kdtr"], ("not a refgen fixture",)
    elif case == "one-destination":
        (tmp_path / "a").mkdir()
        shutil.copy(committed_golden / "tiny2.kdtr", tmp_path / "a")
        args, fragments = [committed_golden / "tiny2.kdtr", tmp_path / "a"], ("would both be written to",)
    else:
        (tmp_path / "empty").mkdir()
        args, fragments = [tmp_path / "empty"], ("no .kdtr fixtures found",)
    assert_one_line_error(refgen_cli("materialize", *args, "--out", out), *fragments)
    assert not out.exists() or files_under(out) == []
