"""The bf16 cases' routing (refgen.bf16.routing_tensors) against the committed fixture's.

routing_tensors takes each round's cached prefix from the rows of the prompt's one causal prefill
instead of prefilling the prefix again for every round. The committed tiny fixture was made by
prefilling every round: the same experts, and margins to BLAS's rounding of blocks of other shapes.
"""

from __future__ import annotations

import numpy as np

from kdtr_format import ModelConfig
from refgen.bf16 import bf16_weights, routing_tensors
from refgen.model import Model
from refgen.weights import init_weights


def test_routing_from_the_one_prefill_is_the_committed_routing(open_golden):
    with open_golden("tiny.kdtr") as fixture:
        meta = fixture.metadata
        cfg = ModelConfig.from_dict(meta["config"])
        tensors = {name[len("bf16/"):]: np.asarray(fixture[name]) for name in fixture.names("bf16/")}
    model = Model(cfg, bf16_weights(init_weights(cfg, meta["generator"]["seed"])))
    checked = 0
    for prompt in meta["bf16"]["prompts"]:
        traces = [t for t in meta["bf16"]["traces"] if t["prompt"] == prompt["name"]]
        for name, value in routing_tensors(model, tensors, prompt["name"], traces).items():
            if name.endswith("router_experts"):
                np.testing.assert_array_equal(value, tensors[name], err_msg=name)
            else:
                np.testing.assert_allclose(value, tensors[name], rtol=0, atol=1e-13, err_msg=name)
            checked += 1
    assert checked > 2 * len(meta["bf16"]["prompts"]) * 2      # the prompts', the AR rows' and the rounds'
