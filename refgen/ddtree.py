"""DDTree's discrete stages in numpy: top-k, tree build, compile, choose, accept, compact.

This is the oracle for the DDTree contract, docs/ddtree-semantics.md (with
worked examples). Every function is a direct transcription of one
contract section; none shares code with the engine or the CUDA kernels.

Shapes: L drafted depths, V vocabulary, K = min(k, V) top-k width, n non-root
tree nodes (node 0 is the root, so n + 1 tree tokens), a accepted nodes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

ROOT_UNSET = -1  # tokens[0] of a freshly built tree: the root token is the caller's


def _check_logits(logits: np.ndarray, name: str) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array [rows, V], got shape {logits.shape}")
    if not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"{name}: expected a floating dtype, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError(f"{name}: the vocabulary is empty (shape {logits.shape})")
    if np.isnan(logits).any():
        raise ValueError(f"{name}: contains NaN")
    if len(logits) and not np.isfinite(logits.max(axis=1)).all():
        raise ValueError(f"{name}: every row needs a finite maximum (no +inf, not all -inf)")
    return logits


def check_int(value: int, name: str, minimum: int = 0) -> int:
    """value as an int; a ValueError naming `name` unless it is an integer >= minimum."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[rows, V] any float -> [rows, V] float64: logits - logsumexp, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def topk_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Contract section 2. logits [L, V] -> (topk_lp float32 [L, K], topk_id int64 [L, K]).

    lp = logits - logsumexp(logits) in float64, rounded once to float32;
    K = min(k, V); each row descending in lp, equal float32 values ordered by
    the smaller token id first.
    """
    logits = _check_logits(logits, "logits")
    k = check_int(k, "k")
    lp = log_softmax(logits).astype(np.float32)                     # [L, V]
    K = min(k, lp.shape[1])
    topk_id = np.argsort(-lp, axis=1, kind="stable")[:, :K]        # stable: ties keep id order
    return np.take_along_axis(lp, topk_id, axis=1), topk_id.astype(np.int64)


def _check_parents(parents: np.ndarray) -> None:
    """parents int64 [n+1]: node 0 is the root (-1), every other parent comes first."""
    if len(parents) == 0 or parents[0] != -1:
        raise ValueError("Tree.parents: node 0 must be the root (parents[0] = -1)")
    if ((parents[1:] < 0) | (parents[1:] >= np.arange(1, len(parents)))).any():
        raise ValueError("Tree.parents: every node's parent must come before it (0 <= parents[i] < i)")


@dataclass(frozen=True)
class Tree:
    """A draft tree in pop order: node 0 is the root, parents[i] < i for i >= 1.

    parents, tokens, depths, ranks: int64 [n+1]; scores: float64 [n+1].
    parents[0] = -1, depths[0] = 0, ranks[0] = -1 (the root has no rank),
    scores[0] = 0; tokens[0] = ROOT_UNSET until `with_root` sets the root token.
    ranks[i] is node i's column in its depth's top-k row.
    """

    parents: np.ndarray
    tokens: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray
    scores: np.ndarray

    def __post_init__(self) -> None:
        size = len(self.parents)
        for name in ("parents", "tokens", "depths", "ranks", "scores"):
            dtype = np.float64 if name == "scores" else np.int64
            array = np.asarray(getattr(self, name), dtype=dtype)
            object.__setattr__(self, name, array)
            if array.ndim != 1 or len(array) != size:
                raise ValueError(f"Tree.{name}: expected shape [{size}], got {array.shape}")
        _check_parents(self.parents)
        if self.depths[0] != 0 or (self.depths[1:] != self.depths[self.parents[1:]] + 1).any():
            raise ValueError("Tree.depths: need depths[0] = 0 and depths[i] = depths[parents[i]] + 1")

    @property
    def n(self) -> int:
        """The number of non-root nodes."""
        return len(self.parents) - 1

    def with_root(self, token: int) -> "Tree":
        """The same tree with tokens[0] = token (the round's root, the last committed token)."""
        tokens = self.tokens.copy()
        tokens[0] = check_int(token, "root token")
        return replace(self, tokens=tokens)

    @classmethod
    def from_parents(cls, parents: np.ndarray, tokens: np.ndarray) -> "Tree":
        """A hand-made tree (tests, accept/compaction cases): depths derived from parents,
        ranks = order among siblings by index, scores NaN (no draft behind it)."""
        parents = np.asarray(parents, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        if parents.ndim != 1 or parents.shape != tokens.shape:
            raise ValueError(f"Tree.from_parents: parents {parents.shape} and tokens {tokens.shape} "
                             "must be 1-D of one length")
        _check_parents(parents)
        depths = np.zeros(len(parents), dtype=np.int64)
        ranks = np.full(len(parents), -1, dtype=np.int64)
        children_so_far = np.zeros(len(parents), dtype=np.int64)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
            ranks[i] = children_so_far[parents[i]]
            children_so_far[parents[i]] += 1
        scores = np.full(len(parents), np.nan)
        scores[0] = 0.0
        return cls(parents, tokens, depths, ranks, scores)


def max_nodes(depth: int, k: int) -> int:
    """All possible non-root nodes of a full K-ary tree of `depth` levels: sum of K^d."""
    return sum(k ** d for d in range(1, depth + 1))


def build_tree(topk_lp: np.ndarray, topk_id: np.ndarray, budget: int) -> Tree:
    """Contract section 3: the best-first heap. topk_lp float32 [L, K], topk_id [L, K] -> Tree.

    A candidate (parent, depth d, rank r) scores score(parent) + float64(topk_lp[d-1, r]).
    Pops the highest score; ties go to the lexicographically smaller rank path
    (ranks from depth 1 to d). Stops after `budget` nodes or when nothing is left.
    """
    topk_lp = np.asarray(topk_lp)
    topk_id = np.asarray(topk_id)
    if topk_lp.ndim != 2 or topk_lp.dtype != np.float32:
        raise ValueError(f"topk_lp: expected float32 [L, K], got {topk_lp.dtype} {topk_lp.shape}")
    if topk_id.shape != topk_lp.shape or not np.issubdtype(topk_id.dtype, np.integer):
        raise ValueError(f"topk_id: expected integers of shape {topk_lp.shape}, "
                         f"got {topk_id.dtype} {topk_id.shape}")
    if np.isnan(topk_lp).any() or (np.diff(topk_lp, axis=1) > 0).any():
        raise ValueError("topk_lp: each row must be non-increasing and free of NaN")
    if any(len(set(row.tolist())) != len(row) for row in topk_id):
        raise ValueError("topk_id: a row repeats a token id (siblings must be distinct)")
    budget = check_int(budget, "budget")
    L, K = topk_lp.shape
    lp64 = topk_lp.astype(np.float64)

    parents, tokens, depths, ranks, scores = [-1], [ROOT_UNSET], [0], [-1], [0.0]
    paths: list[tuple[int, ...]] = [()]
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []   # (-score, rank path, parent, d, r)

    def push(parent: int, d: int, r: int) -> None:
        heapq.heappush(heap, (-(scores[parent] + lp64[d - 1, r]), paths[parent] + (r,), parent, d, r))

    if L > 0 and K > 0:
        push(0, 1, 0)
    while heap and len(parents) - 1 < budget:
        neg_score, path, parent, d, r = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        tokens.append(int(topk_id[d - 1, r]))
        depths.append(d)
        ranks.append(r)
        scores.append(-neg_score)
        paths.append(path)
        if r + 1 < K:
            push(parent, d, r + 1)
        if d < L:
            push(node, d + 1, 0)
    return Tree(np.array(parents, dtype=np.int64), np.array(tokens, dtype=np.int64),
                np.array(depths, dtype=np.int64), np.array(ranks, dtype=np.int64),
                np.array(scores, dtype=np.float64))


@dataclass(frozen=True)
class CompiledTree:
    """Contract section 4: what verification needs, every encoding derived from parents.

    positions int64 [n+1] = start + depths; visibility bool [n+1, n+1] (row i sees
    column j iff j is i or an ancestor of i); visibility_bits uint32 [n+1, W],
    W = ceil((n+1)/32), bit b of word w of row i = visibility[i, 32w + b];
    additive_mask float32 [n+1, n+1] (0 where visible, -inf elsewhere);
    first_child, next_sibling int64 [n+1] (EAGLE linked list, -1 for none).
    """

    positions: np.ndarray
    visibility: np.ndarray
    visibility_bits: np.ndarray
    additive_mask: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray


def pack_bits(visibility: np.ndarray) -> np.ndarray:
    """bool [rows, cols] -> uint32 [rows, ceil(cols/32)]: bit b of word w = visibility[:, 32w + b]."""
    rows, cols = visibility.shape
    words = -(-cols // 32)
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :cols] = visibility
    packed = np.packbits(padded, axis=1, bitorder="little")          # [rows, 4 * words] bytes
    return packed.view("<u4").astype(np.uint32).reshape(rows, words)


def compile_tree(tree: Tree, start: int) -> CompiledTree:
    """Tree, cache length `start` -> CompiledTree (positions, masks, EAGLE lists)."""
    start = check_int(start, "start")
    size = tree.n + 1
    visibility = np.zeros((size, size), dtype=bool)
    first_child = np.full(size, -1, dtype=np.int64)
    next_sibling = np.full(size, -1, dtype=np.int64)
    last_child = np.full(size, -1, dtype=np.int64)
    visibility[0, 0] = True
    for i in range(1, size):
        p = tree.parents[i]
        visibility[i] = visibility[p]
        visibility[i, i] = True
        if first_child[p] == -1:
            first_child[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    return CompiledTree(
        positions=start + tree.depths,
        visibility=visibility,
        visibility_bits=pack_bits(visibility),
        additive_mask=np.where(visibility, 0.0, -np.inf).astype(np.float32),
        first_child=first_child,
        next_sibling=next_sibling,
    )


def visibility_over_cache(compiled: CompiledTree, start: int) -> np.ndarray:
    """bool [n+1, start+n+1]: every cached key (slots < start) visible, then the tree block."""
    start = check_int(start, "start")
    size = len(compiled.visibility)
    return np.concatenate([np.ones((size, start), dtype=bool), compiled.visibility], axis=1)


def greedy_choices(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [n, V] -> (choices int64 [n], margins float64 [n]).

    choices = argmax, ties to the smaller id; margins = top-1 minus top-2 logit
    (in float64; +inf when V = 1).
    """
    logits = _check_logits(logits, "logits").astype(np.float64)
    choices = np.argmax(logits, axis=1).astype(np.int64)
    if logits.shape[1] == 1:
        return choices, np.full(len(logits), np.inf)
    top2 = -np.partition(-logits, 1, axis=1)[:, :2]                 # [n, 2]: top-1, top-2
    return choices, top2[:, 0] - top2[:, 1]


def _sampling_cdf(logits: np.ndarray, temperature: float, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                          np.ndarray]:
    """Checked inputs -> (p float64 [n, V], cdf float64 [n, V], uniforms float64 [n])."""
    logits = _check_logits(logits, "logits")
    if not isinstance(temperature, (int, float, np.floating)) or not temperature > 0:
        raise ValueError(f"temperature: sampling needs temperature > 0, got {temperature!r}")
    uniforms = np.asarray(uniforms, dtype=np.float64)
    if uniforms.shape != (len(logits),):
        raise ValueError(f"uniforms: expected shape [{len(logits)}], got {uniforms.shape}")
    if ((uniforms < 0) | (uniforms >= 1)).any() or np.isnan(uniforms).any():
        raise ValueError("uniforms: every value must lie in [0, 1)")
    p = np.exp(log_softmax(np.asarray(logits, dtype=np.float64) / temperature))   # [n, V]
    return p, np.cumsum(p, axis=1), uniforms


def sample_choices(logits: np.ndarray, temperature: float, uniforms: np.ndarray) -> np.ndarray:
    """logits [n, V], uniforms [n] in [0, 1) -> choices int64 [n]. Inverse CDF in float64.

    p = softmax(logits / temperature); cdf = cumsum(p) over ids ascending;
    c = the smallest id with cdf[c] > u. If rounding leaves u >= cdf[V-1], c is
    the largest id with p > 0. A token with p = 0 is never chosen.
    """
    p, cdf, uniforms = _sampling_cdf(logits, temperature, uniforms)
    choices = (cdf <= uniforms[:, None]).sum(axis=1)                # cdf is non-decreasing
    last_positive = p.shape[1] - 1 - np.argmax(p[:, ::-1] > 0, axis=1)
    return np.minimum(choices, last_positive).astype(np.int64)


def sample_margins(logits: np.ndarray, temperature: float, uniforms: np.ndarray) -> np.ndarray:
    """logits [n, V], uniforms [n] -> margins float64 [n] of the sampled decisions, in logit units.

    With d the distance from u to the nearer end of the chosen token's CDF interval
    [cdf[c-1], cdf[c]), margin = 4 T d. A perturbation of at most delta in every
    logit moves every cdf value by at most delta / (2 T) (to first order), so, as
    for a greedy top-1 minus top-2 margin, no perturbation below margin / 2 can
    change the decision. 0 where rounding left u at or above cdf[V-1].
    """
    p, cdf, uniforms = _sampling_cdf(logits, temperature, uniforms)
    c = sample_choices(logits, temperature, uniforms)
    rows = np.arange(len(c))
    low = np.where(c > 0, cdf[rows, np.maximum(c - 1, 0)], 0.0)
    distance = np.minimum(uniforms - low, cdf[rows, c] - uniforms)
    return 4.0 * temperature * np.maximum(distance, 0.0)


def accept(tree: Tree, choices: np.ndarray) -> tuple[np.ndarray, int]:
    """Contract section 6. choices int64 [n+1] -> (accepted int64 [a], next_root).

    From the root, step to the child whose token equals the target's choice at
    the current node, while one exists; next_root is the choice at the last node.
    """
    choices = np.asarray(choices)
    if choices.shape != (tree.n + 1,) or not np.issubdtype(choices.dtype, np.integer):
        raise ValueError(f"choices: expected integers of shape [{tree.n + 1}], "
                         f"got {choices.dtype} {choices.shape}")
    children: dict[tuple[int, int], int] = {}
    for j in range(1, tree.n + 1):
        key = (int(tree.parents[j]), int(tree.tokens[j]))
        if key in children:
            raise ValueError(f"tree: nodes {children[key]} and {j} are siblings with the same token")
        children[key] = j
    accepted = [0]
    while (child := children.get((accepted[-1], int(choices[accepted[-1]])))) is not None:
        accepted.append(child)
    return np.array(accepted, dtype=np.int64), int(choices[accepted[-1]])


def compact(array: np.ndarray, start: int, accepted: np.ndarray) -> None:
    """Contract section 7, in place on one cache array [S, ...]:
    row start + k <- row start + accepted[k], for k = 0 .. a-1 in increasing k."""
    start = check_int(start, "start")
    accepted = np.asarray(accepted)
    if accepted.ndim != 1 or len(accepted) == 0 or accepted[0] != 0:
        raise ValueError(f"accepted: expected a 1-D path starting at node 0, got {accepted!r}")
    if (np.diff(accepted) <= 0).any():
        raise ValueError(f"accepted: node indices must increase, got {accepted.tolist()}")
    if start + accepted[-1] >= len(array):
        raise ValueError(f"accepted: slot {start + accepted[-1]} is beyond the cache's {len(array)} rows")
    for k, node in enumerate(accepted.tolist()):
        array[start + k] = array[start + node]
