"""`refgen export` on every committed fixture, as committed: slim (the seeded weights omitted and
named by sha256). A model fixture is materialized on the way: its export holds the full fixture, and
its weights are the tensors the slim file names by sha256; a kernel fixture is refused in one line.
At 80 columns the summary never breaks the output path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kdtr_format
from refgen.checkpoint import load, open_checkpoint, plan_import
from refgen.export import export
from refgen.files import checksum, omitted, recorded_seeded, stored_hash_problem
from terminal import assert_clean_error, in_terminal, piped

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
COMMITTED = sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*.kdtr"))


@pytest.mark.parametrize("relative", COMMITTED)
def test_every_committed_fixture_exports_or_is_refused_in_one_line(committed_golden, relative, tmp_path):
    """The export's weights, imported back, are the tensors whose sha256 the slim file records."""
    path = committed_golden / relative
    with kdtr_format.open(path) as reader:
        metadata = reader.metadata
        if metadata["kind"] != "model":
            assert_clean_error(piped(["refgen", "export", str(path), "--out", str(tmp_path / "out")]),
                               "not a model fixture")
            assert list(tmp_path.iterdir()) == []
            return
        slim = omitted(reader)
        assert slim, f"{relative} is committed full: this test is about slim fixtures"
        written = export(reader, path, tmp_path / "out")
    recorded = recorded_seeded(metadata)
    imported = load(plan_import(open_checkpoint(written.directory)))
    assert sorted(f"weights/{name}" for name in imported.weights) == sorted(n for n in slim if n.startswith("weights/"))
    for name, value in imported.weights.items():
        want = recorded[f"weights/{name}"]
        assert checksum(np.asarray(value).astype(want["dtype"])) == want, name
    with kdtr_format.open(written.directory / written.fixture) as exported:
        assert omitted(exported) == [] and stored_hash_problem(exported) is None
    assert written.manifest["source"]["content_hash"] == metadata["content_hash"]
    assert sorted(p.name for p in written.directory.iterdir()) == sorted(written.files)


def test_a_slim_draft_export_leaves_no_materialized_fixture_behind(committed_golden, tmp_path):
    path = committed_golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader:
        written = export(reader, path, tmp_path / "draft", layers=1)
    assert written.fixture is None
    assert sorted(p.name for p in written.directory.iterdir()) == sorted(written.files)
    assert not any(name.endswith(".kdtr") for name in written.files)


def test_a_slim_fixture_whose_weights_draw_otherwise_is_one_line_and_leaves_nothing(committed_golden, tmp_path,
                                                                                       monkeypatch):
    """The seed's stream drawing other weights (another numpy): materialize's sha256 check names it."""
    import refgen.materialize

    real = refgen.materialize.init_weights
    monkeypatch.setattr(refgen.materialize, "init_weights", lambda cfg, seed: real(cfg, seed + 1))
    path = committed_golden / "tiny.kdtr"
    with kdtr_format.open(path) as reader, pytest.raises(Exception, match="is not the tensor the fixture records"):
        export(reader, path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_summary_never_breaks_the_path_at_80_columns(committed_golden, tmp_path):
    out = tmp_path / "a-directory-name-long-enough-to-pass-eighty-columns-with-the-command" / "tiny-f32"
    result = in_terminal(["refgen", "export", str(committed_golden / "tiny.kdtr"), "--out", str(out)], columns=80)
    assert result.returncode == 0, result.output
    with_path = [line for line in result.screen_lines if str(out) in line]
    assert len(with_path) == 2, result.output               # "written to PATH" and the validate command
    assert all(len(line) <= 80 for line in result.screen_lines if line not in with_path), result.output
