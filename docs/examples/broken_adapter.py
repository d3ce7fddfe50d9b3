"""What a failure looks like: the example adapter with the wrong tie rule in its
tree build (equal scores pop the LARGER rank path first).

    kdtree validate --impl docs/examples/broken_adapter.py:BrokenTieAdapter    # exits 1

Random logits almost never tie, so only the fixtures built to tie exactly
(kernels/tree_build.kdtr: tied_*) and the corpus cases whose path scores tie
(kernels/corpus.kdtr: token_zero, budget_beyond_possible) catch it: those rows
fail and name the case.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("numpy_adapter", Path(__file__).with_name("numpy_adapter.py"))
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)


class BrokenTieAdapter(_example.NumpyAdapter):
    name = "broken example adapter (tree-build ties to the larger rank path)"

    def tie_key(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(-r for r in ranks)
