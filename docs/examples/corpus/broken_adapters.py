"""The bugs other DDTree integrations shipped, one broken adapter each (docs/adapter.md, "The corpus").

Each class is the worked numpy example (docs/examples/numpy_adapter.py) with one
method broken the way an integration shipped it; `kdtree validate` fails it on
exactly the corpus case named in its docstring (kernels/corpus.kdtr), and on no
other corpus case:

    kdtree validate --impl docs/examples/corpus/broken_adapters.py:TokenZeroAsPadding   # exits 1

BROKEN maps each corpus case to its adapter (tests/engine/test_corpus.py runs them all).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from refgen.ddtree import Tree, compile_tree

_spec = importlib.util.spec_from_file_location("numpy_adapter",
                                               Path(__file__).resolve().parents[1] / "numpy_adapter.py")
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
NumpyAdapter = _example.NumpyAdapter


class TokenZeroAsPadding(NumpyAdapter):
    """token_zero: the tree's size is counted from its nonzero tokens, as if 0 were padding."""

    name = "broken: token id 0 treated as padding"

    def build_tree(self, topk_lp, topk_id, budget, root):
        parents, tokens, depths = super().build_tree(topk_lp, topk_id, budget, root)
        n = int(np.count_nonzero(tokens[1:]))
        return parents[:n + 1], tokens[:n + 1], depths[:n + 1]


class NanCarriedOn(NumpyAdapter):
    """nan_draft_logits: NaN is reported and masked like -inf, and the round carries on."""

    name = "broken: NaN in draft logits printed and carried on"

    def topk_logprobs(self, draft_logits, k):
        if np.isnan(draft_logits).any():
            print("warning: NaN in draft logits, masking it")
        return super().topk_logprobs(np.where(np.isnan(draft_logits), -np.inf, draft_logits), k)


class NegInfClamped(NumpyAdapter):
    """neg_inf_draft_logits: -inf clamped to the float32 minimum 'to keep the arithmetic finite',
    so a masked token gets a finite log-prob instead of -inf."""

    name = "broken: -inf draft logits clamped to a finite floor"

    def topk_logprobs(self, draft_logits, k):
        return super().topk_logprobs(np.maximum(draft_logits, np.finfo(np.float32).min), k)


class TokenIdsByValue(NumpyAdapter):
    """duplicate_siblings: top-k ids recovered by looking the log-prob up in the row, so two
    tokens with equal log-probs both get the first one's id: siblings with the same token."""

    name = "broken: top-k ids looked up by value"

    def topk_logprobs(self, draft_logits, k):
        lp, _ = super().topk_logprobs(draft_logits, k)
        every_lp, every_id = super().topk_logprobs(draft_logits, draft_logits.shape[1])
        by_token = np.empty_like(every_lp)
        np.put_along_axis(by_token, every_id, every_lp, axis=1)
        return lp, np.argmax(by_token[:, None, :] == lp[:, :, None], axis=2).astype(np.int64)


class PositionsFromIndex(NumpyAdapter):
    """star: positions taken as start + node index (true only for a chain), not start + depth."""

    name = "broken: tree positions from the node index"

    def compile_tree(self, parents, depths, start):
        compiled = compile_tree(Tree.from_parents(parents, np.zeros(len(parents), np.int64)), start)
        return (start + np.arange(len(parents)), compiled.visibility_bits, compiled.first_child,
                compiled.next_sibling)


class PaddedToBudget(NumpyAdapter):
    """budget_beyond_possible: the tree arrays sized by the budget, as if the heap always fills it;
    the rows past the last node are left as (parent 0, token 0, depth 1)."""

    name = "broken: tree padded to the budget"

    def build_tree(self, topk_lp, topk_id, budget, root):
        parents, tokens, depths = super().build_tree(topk_lp, topk_id, budget, root)
        pad = budget + 1 - len(parents)
        return (np.concatenate([parents, np.zeros(pad, np.int64)]), np.concatenate([tokens, np.zeros(pad, np.int64)]),
                np.concatenate([depths, np.ones(pad, np.int64)]))


class PopsBeforeBudgetCheck(NumpyAdapter):
    """budget_zero: the heap loop pops a node before it checks the budget (a do-while), so
    budget 0 still grows one node."""

    name = "broken: one node at budget 0"

    def build_tree(self, topk_lp, topk_id, budget, root):
        return super().build_tree(topk_lp, topk_id, max(budget, 1), root)


class ChainAccept(NumpyAdapter):
    """tree_below_chain: the accept walk of a chain decoder, which looks for the matching child
    at node cur + 1 only; where a sibling pops between the rank-0 chain's nodes it stops
    short of what the chain alone accepts."""

    name = "broken: accept looks only at the next node in tree order"

    def accept(self, parents, tokens, choices):
        current, accepted = 0, [0]
        while current + 1 < len(parents) and parents[current + 1] == current \
                and tokens[current + 1] == choices[current]:
            current += 1
            accepted.append(current)
        return np.array(accepted), int(choices[current])


class PrefixCompaction(NumpyAdapter):
    """compaction_non_prefix: compaction that only truncates, as if the accepted path were
    always the nodes 0 .. a-1 in tree order."""

    name = "broken: KV compaction assumes a prefix path"

    def compact(self, c_kv, k_pe, start, accepted):
        return c_kv, k_pe


BROKEN = {"token_zero": TokenZeroAsPadding, "nan_draft_logits": NanCarriedOn,
          "neg_inf_draft_logits": NegInfClamped, "duplicate_siblings": TokenIdsByValue,
          "star": PositionsFromIndex, "budget_beyond_possible": PaddedToBudget,
          "budget_zero": PopsBeforeBudgetCheck, "tree_below_chain": ChainAccept,
          "compaction_non_prefix": PrefixCompaction}
