"""A worked example adapter (docs/adapter.md): DDTree stages in plain numpy,
the model forward from refgen's float64 numpy model standing in for your engine.

    kdtree validate --impl docs/examples/numpy_adapter.py:NumpyAdapter

Replace the bodies with calls into your own engine. `attention` is left out on
purpose: validate reports its check as "skipped (not implemented by adapter)".
"""

from __future__ import annotations

import heapq
from typing import Mapping

import numpy as np

from kdtr_format import ModelConfig
from refgen.model import KVCache, Model


class NumpyAdapter:
    name = "numpy example adapter (refgen model, numpy stages)"

    # ---- model: your engine's forward over its own cache ----
    def load_weights(self, config: ModelConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.config = config
        self.model = Model(config, weights)

    def reset(self, max_len: int) -> None:
        self.cache = KVCache.new(self.config, max_len)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, visibility: np.ndarray,
                start: int) -> np.ndarray:
        """tokens [n], positions [n], visibility [n, start+n] bool -> logits [n, V]."""
        return self.model.forward(tokens, positions, visibility, self.cache, start)

    # ---- DDTree stages ----
    def topk_logprobs(self, draft_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """[L, V] -> (topk_lp float32 [L, K], topk_id int64 [L, K]); equal lp: smaller id first.
        -inf is a masked token (lp -inf); NaN is refused (docs/adapter.md, "The corpus")."""
        if np.isnan(draft_logits).any():
            raise ValueError("draft_logits: contains NaN")
        x = draft_logits.astype(np.float64)
        peak = x.max(axis=-1, keepdims=True)
        lp = (x - (peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True)))).astype(np.float32)
        ids = np.broadcast_to(np.arange(lp.shape[-1]), lp.shape)
        order = np.lexsort((ids, -lp), axis=-1)[:, :min(k, lp.shape[-1])]
        return np.take_along_axis(lp, order, -1), order.astype(np.int64)

    def tie_key(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Equal scores pop the smaller rank path first (docs/ddtree-semantics.md, section 3)."""
        return ranks

    def build_tree(self, topk_lp: np.ndarray, topk_id: np.ndarray, budget: int,
                   root: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Best-first heap under a node budget -> parents, tokens, depths [n+1] in pop order."""
        depth, k = topk_lp.shape
        lp = topk_lp.astype(np.float64)
        parents, tokens, depths, scores, ranks = [-1], [root], [0], [0.0], [()]
        heap = [(-lp[0, 0], self.tie_key((0,)), 0, 1, 0)] if depth and k else []
        while heap and len(parents) <= budget:
            neg_score, _, parent, d, r = heapq.heappop(heap)
            node = len(parents)
            path = ranks[parent] + (r,)
            parents.append(parent)
            tokens.append(int(topk_id[d - 1, r]))
            depths.append(d)
            scores.append(-neg_score)
            ranks.append(path)
            if r + 1 < k:
                sibling = ranks[parent] + (r + 1,)
                heapq.heappush(heap, (-(scores[parent] + lp[d - 1, r + 1]), self.tie_key(sibling), parent, d, r + 1))
            if d < depth:
                heapq.heappush(heap, (-(scores[node] + lp[d, 0]), self.tie_key(path + (0,)), node, d + 1, 0))
        return np.array(parents), np.array(tokens), np.array(depths)

    def accept(self, parents: np.ndarray, tokens: np.ndarray, choices: np.ndarray) -> tuple[np.ndarray, int]:
        """Follow the target's choices down the tree -> (accepted [a], next_root)."""
        current, accepted = 0, [0]
        while True:
            child = np.flatnonzero((parents == current) & (tokens == choices[current]))
            if child.size == 0:
                return np.array(accepted), int(choices[current])
            current = int(child[0])
            accepted.append(current)

    def compact(self, c_kv: np.ndarray, k_pe: np.ndarray, start: int,
                accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row start + k <- row start + accepted[k], in increasing k (safe in place)."""
        for k, node in enumerate(accepted):
            c_kv[start + k] = c_kv[start + node]
            k_pe[start + k] = k_pe[start + node]
        return c_kv, k_pe
