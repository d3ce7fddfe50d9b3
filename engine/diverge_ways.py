"""The ways of `kdtree diverge`: the same tokens computed by one implementation in two kinds of
call, teacher-forced after the same prompt, every capture point of every compared token kept
(engine/diverge.py compares them).

- decode: the prompt's prefill, then one forward per token (M = 1): AR.
- chunk: the prompt's prefill, then every token in one causal forward
  (M = n): the verify of an accepted path, or a prefill chunk.
- tree: the prompt's prefill, then a whole tree in one forward (M = n + 1,
  ancestor-only mask); the compared rows are one root-to-node path, whose
  decode counterpart is the path's tokens one at a time.
- batch (built-in engine only): decode alone against decode in a ragged batch
  with other requests (prefill included).

Implementations come through the validation protocol: `model` plus the optional
`intermediates` capability (engine/validate/door/protocol.py), one request at a time (a protocol 2
adapter through its per-request view); the built-in engine is `TorchAdapter`, whose
`intermediates` reads `Transformer.capture`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .capture import capturing
from .model import Transformer
from .validate.door.protocol_v2 import per_request


@dataclass
class Way:
    """One way of computing the compared tokens. Per compared token, in order (prompt first):
    its position, the rows (M) of the forward that computed it, the requests in that forward,
    the keys it sees and the cache slots its forward spans; values[key] [T, ...] holds every
    captured point (protocol keys), expert_counts[layer] [T, E] the rows each expert computed
    in the token's forward (when the implementation says)."""

    label: str
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    expert_counts: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, out: Mapping[str, np.ndarray], select: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
            visibility: np.ndarray, slots: int, batch: int = 1) -> None:
        """One forward's intermediates `out` (rows = its new tokens); keep rows `select`."""
        self.tokens += [int(t) for t in tokens[select]]
        self.positions += [int(p) for p in positions[select]]
        self.rows += [len(tokens)] * len(select)
        self.batch += [batch] * len(select)
        self.keys += [int(k) for k in visibility[select].sum(1)]
        self.slots += [slots] * len(select)
        for key, value in out.items():
            if key.endswith(".expert_counts"):
                layer = int(key.split(".")[1])
                counts = np.repeat(np.asarray(value)[None], len(select), axis=0)
                self.expert_counts[layer] = _append(self.expert_counts.get(layer), counts)
            else:
                self.values[key] = _append(self.values.get(key), np.asarray(value)[select])


def _append(old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    return new if old is None else np.concatenate([old, new])


def _prefill(adapter: Any, way: Way, prompt: np.ndarray) -> np.ndarray:
    m = len(prompt)
    causal = np.tri(m, dtype=bool)
    out = adapter.intermediates(prompt, np.arange(m), causal, 0)
    way.add(out, np.arange(m), prompt, np.arange(m), causal, m)
    return out["logits"]


def decode_way(adapter: Any, prompt: Sequence[int], tokens: Sequence[int] | None, count: int = 0,
               max_len: int | None = None) -> Way:
    """The prompt's prefill, then one forward per token: `tokens` teacher-forced, or (tokens None)
    `count` greedy tokens, the first being the prefill's argmax."""
    prompt = np.asarray(prompt, dtype=np.int64)
    m = len(prompt)
    count = len(tokens) if tokens is not None else count
    adapter = per_request(adapter)
    adapter.reset(max_len or m + count)
    way = Way("AR decode", m)
    logits = _prefill(adapter, way, prompt)
    for k in range(count):
        token = int(tokens[k]) if tokens is not None else int(np.argmax(np.asarray(logits[-1], dtype=np.float64)))
        start = m + k
        step = np.array([token]), np.array([start]), np.ones((1, start + 1), dtype=bool)
        out = adapter.intermediates(*step, start)
        way.add(out, np.arange(1), *step, start + 1)
        logits = out["logits"]
    return way


def chunk_way(adapter: Any, prompt: Sequence[int], tokens: Sequence[int], max_len: int | None = None) -> Way:
    """The prompt's prefill, then every token in one causal forward (M = len(tokens)): a tree that
    is one chain, every row compared."""
    n = len(tokens)
    return _tree_forward(adapter, prompt, tokens, np.arange(n) - 1, np.arange(n), f"chunk of {n} rows", max_len)


def tree_visibility(parents: Sequence[int]) -> np.ndarray:
    """parents [n+1] (parents[0] = -1, parents before children) -> bool [n+1, n+1]: j is i or its ancestor."""
    size = len(parents)
    visibility = np.eye(size, dtype=bool)
    for i in range(1, size):
        visibility[i] |= visibility[parents[i]]
    return visibility


def tree_way(adapter: Any, prompt: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
             path: Sequence[int], max_len: int | None = None) -> Way:
    """The prompt's prefill, then the whole tree in one forward; the rows of `path` (node indices,
    root first) are compared. Its decode counterpart: decode_way(prompt, tree_tokens[path])."""
    return _tree_forward(adapter, prompt, tree_tokens, parents, path, f"tree verify of {len(tree_tokens)} rows",
                         max_len)


def _tree_forward(adapter: Any, prompt: Sequence[int], tree_tokens: Sequence[int], parents: Sequence[int],
                  rows: Sequence[int], label: str, max_len: int | None) -> Way:
    """The prompt's prefill, then the tree (parents [n], -1 for a root) in one forward, at
    positions prompt length + depth; `rows` compared."""
    prompt, tree_tokens = np.asarray(prompt, dtype=np.int64), np.asarray(tree_tokens, dtype=np.int64)
    m, size = len(prompt), len(tree_tokens)
    adapter = per_request(adapter)
    adapter.reset(max_len or m + size)
    way = Way(label, m)
    _prefill(adapter, way, prompt)
    tree = tree_visibility(parents)
    positions = m + tree.sum(1) - 1
    visibility = np.concatenate([np.ones((size, m), dtype=bool), tree], axis=1)
    out = adapter.intermediates(tree_tokens, positions, visibility, m)
    way.add(out, np.asarray(rows), tree_tokens, positions, visibility, m + size)
    return way


def batch_way(model: Transformer, prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]],
              request: int = 0) -> Way:
    """Every request's prompt prefilled in one ragged forward, then one batched decode step per
    token (each request teacher-forced on its own tokens; one that has none left sits out);
    request `request`'s rows are kept. The built-in engine only (it batches the model itself)."""
    device = model.device
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    steps = max(len(t) for t in tokens)
    cache = model.new_cache(batch, max(lengths) + steps)
    width = max(lengths)
    grid = torch.zeros(batch, width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        grid[b, :len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(batch, width, width)
    way = Way(f"batch of {batch} requests", lengths[request])
    calls = [(grid, torch.arange(width).expand(batch, width), causal, torch.tensor(lengths),
              torch.zeros(batch, dtype=torch.int64))]
    for k in range(steps):
        alive = [k < len(t) for t in tokens]
        step = torch.tensor([[int(t[k]) if a else 0] for t, a in zip(tokens, alive)])
        starts = torch.tensor([m + k for m in lengths])
        calls.append((step, starts[:, None], torch.ones(batch, 1, 1, dtype=torch.bool),
                      torch.tensor([int(a) for a in alive]), starts))
    for call_tokens, positions, visibility, n_new, starts in calls:
        with capturing(model, n_new.tolist(), request) as captured:
            model.forward(*(t.to(device) for t in (call_tokens, positions, visibility.contiguous(), n_new, starts)),
                          cache)
        n, start = int(n_new[request]), int(starts[request])
        counts = {f"layers.{layer}.expert_counts": c for layer, c in captured.expert_counts.items()}
        mine = visibility[request, :n, :n].numpy()
        seen = np.concatenate([np.ones((n, start), dtype=bool), mine], axis=1)
        way.add({**captured.values, **counts}, np.arange(n), call_tokens[request, :n].numpy(),
                positions[request, :n].numpy(), seen, int((starts + n_new).max()), batch=int((n_new > 0).sum()))
    return way
