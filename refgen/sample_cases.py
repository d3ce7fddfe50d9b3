"""The adversarial sampling cases of every model fixture (docs/fixtures.md): uniforms at
exactly 0, exactly on a CDF boundary and at 1 - 2^-53, beside tokens of probability 0,
on one hand-made tree. The expected choices, accepted paths and next roots come from
refgen.ddtree; tests/refgen/test_fixtures.py states them by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .ddtree import Tree, accept, sample_choices


@dataclass(frozen=True)
class SampleCase:
    """A sampling case on the hand-made tree below: rows maps a node to (the token ids of
    equal logit 0, every other logit -inf; its uniform); other nodes get OTHER_ROW. Every
    probability is exact in float64 (1/2, 1/4 of equal logits) or the case holds whatever
    the rounding of its CDF (u_max), so no correct implementation can disagree."""

    name: str
    temperature: float
    rows: dict[int, tuple[tuple[int, ...], float]]
    note: str


#                0 (root 7)
#      /    /    |    \    \
#   1:0  2:1   3:2   4:9  5:10
#         |
#        6:3
SAMPLE_TREE = (np.array([-1, 0, 0, 0, 0, 0, 2]), np.array([7, 0, 1, 2, 9, 10, 3]))
OTHER_ROW = ((4, 5), 0.75)
SAMPLE_CASES = (
    SampleCase("u_zero", 1.0, {0: ((1, 2), 0.0), 2: ((3, 5, 6, 8), 0.3)},
               "u = 0 and token 0 has probability 0: the root chooses 1 (node 2), never 0 (node 1)"),
    SampleCase("u_boundary", 0.5, {0: ((0, 2, 9, 11), 0.5), 4: ((0, 2, 9, 11), 0.75)},
               "u exactly on a CDF boundary: the next token of nonzero probability (cdf > u, strictly), "
               "skipping token 10 of probability 0"),
    SampleCase("u_max", 1.3, {0: (tuple(range(10)), 1.0 - 2.0 ** -53), 4: ((3,), 1.0 - 2.0 ** -53)},
               "u = 1 - 2^-53 above the rounded cdf of ten tokens of 1/10: the largest token of nonzero "
               "probability (9, node 4), never 10 (node 5, probability 0)"),
)


def sample_cases(vocab_size: int) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """SAMPLE_CASES over a vocabulary of `vocab_size` (>= 12) -> (tensors under
    sample_cases/{name}/, their metadata), the expected outputs from refgen.ddtree."""
    parents, tokens = SAMPLE_TREE
    tensors, meta = {}, []
    for case in SAMPLE_CASES:
        logits = np.full((len(parents), vocab_size), -np.inf)
        uniforms = np.empty(len(parents))
        for node in range(len(parents)):
            allowed, uniforms[node] = case.rows.get(node, OTHER_ROW)
            logits[node, list(allowed)] = 0.0
        choices = sample_choices(logits, case.temperature, uniforms)
        accepted, next_root = accept(Tree.from_parents(parents, tokens), choices)
        prefix = f"sample_cases/{case.name}"
        tensors.update({f"{prefix}/parents": parents, f"{prefix}/tokens": tokens, f"{prefix}/logits": logits,
                        f"{prefix}/uniforms": uniforms, f"{prefix}/choices": choices,
                        f"{prefix}/accepted": accepted, f"{prefix}/next_root": np.array(next_root, dtype=np.int64)})
        meta.append({"name": case.name, "temperature": case.temperature, "note": case.note})
    return tensors, meta
