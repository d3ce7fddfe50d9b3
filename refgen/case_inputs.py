"""Random inputs the kernel-case modules share (kernel_cases, paged_cases): placeholder
tree shapes, random walks down a tree, the junk value of rows no kernel may read, and the
bf16 rounding of attention inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .ddtree import Tree, build_tree, topk_logprobs
from .fixtures import FixtureError

JUNK = 1e4                   # rows no kernel may read hold this: one that reads them is visibly wrong
SCORE_STD = 2.0              # random attention inputs give scores of about this spread


def tree_shape(shape: str, nodes: int, rng: np.random.Generator) -> Tree:
    """A tree of `nodes` non-root nodes; tokens are placeholders (attention ignores them)."""
    if shape == "root":
        parents = np.array([-1])
    elif shape == "chain":
        parents = np.arange(-1, nodes)
    elif shape == "star":
        parents = np.array([-1] + [0] * nodes)
    elif shape == "random":
        logits = rng.standard_normal((6, 8))
        return build_tree(*topk_logprobs(logits, 4), nodes)
    else:
        raise FixtureError(f"unknown tree shape {shape!r} (root, chain, star, random)")
    return Tree.from_parents(parents, np.zeros(len(parents), dtype=np.int64))


def random_walk(tree: Tree, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Choices [n+1] that follow a random path down `tree` (at each node: a random
    child with odds 4:1, else a token no child has); off the path, random tokens."""
    choices = rng.integers(0, vocab, size=tree.n + 1)
    node = 0
    while True:
        children = np.flatnonzero(tree.parents == node)
        taken = set(tree.tokens[children].tolist())
        if children.size and rng.random() < 0.8:
            node_next = int(rng.choice(children))
            choices[node] = tree.tokens[node_next]
            node = node_next
            continue
        choices[node] = next(int(t) for t in rng.permutation(vocab) if int(t) not in taken)
        return choices.astype(np.int64)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32: what a bf16
    kernel loads from them. Attention cases' bf16 expectations are computed from these."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
