"""engine.weights.load_fixture_weights on a slim fixture (the committed ones): one ValueError naming
the file and the two ways to its full form, never a list of missing weights; the full form loads."""

from __future__ import annotations

import re

import pytest
import torch

from engine.weights import load_fixture_weights


def test_a_slim_fixture_is_refused_naming_the_file_and_what_to_run(committed_golden):
    path = committed_golden / "tiny.kdtr"
    message = (f"{path}: a slim fixture: its 66 weights are drawn from its seed, not stored; "
               f"engine.validate.find_fixtures('{path}') gives the materialized copy `kdtree validate` uses, or "
               f"`refgen materialize {path} --out DIR` writes the full fixture")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_fixture_weights(path)


def test_the_full_form_loads(golden):
    cfg, weights = load_fixture_weights(golden / "tiny.kdtr", torch.bfloat16)
    assert len(weights) == 66 and weights["embed_tokens"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert weights["embed_tokens"].dtype == torch.bfloat16
