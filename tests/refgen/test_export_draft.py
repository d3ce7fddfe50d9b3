"""Draft exports (`refgen export --layers K`) as vLLM and SGLang take them. Both engines turn a
DeepseekV3-labelled draft into their MTP module (vLLM: model_type deepseek_v3 -> deepseek_mtp with
n_predict = num_nextn_predict_layers, 0 for a plain export, then a division by it; SGLang:
DeepseekV3ForCausalLM -> DeepseekV3ForCausalLMNextN), so a draft carries DeepseekV2's label, which
both serve with the same code. Checked against vLLM's own rewrite where vLLM is installed, in
test_export_mtp.py (one run of vLLM's interpreter serves its MTP test and this)."""

from __future__ import annotations

import json

from exports import target_and_draft
from refgen.export import DRAFT_LABEL


def test_a_draft_is_labelled_deepseek_v2_and_the_target_v3(committed_golden, tmp_path):
    target, draft = target_and_draft(committed_golden / "tiny.kdtr", tmp_path)
    config = json.loads((draft / "config.json").read_text())
    assert {k: config[k] for k in DRAFT_LABEL} == DRAFT_LABEL == \
        {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    assert json.loads((target / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
