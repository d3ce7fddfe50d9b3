"""refgen.ddtree against docs/ddtree-semantics.md: each check beside an independent reference
(brute-force enumeration, ancestor walks, direct CDF walks, hand-made trees)."""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refgen.ddtree import (ROOT_UNSET, CompiledTree, Tree, accept, build_tree, compact, compile_tree,
                           greedy_choices, max_nodes, sample_choices, sample_margins, topk_logprobs,
                           visibility_over_cache)
from refgen.kernel_cases import SIBLING_ROUNDING_TOPK

# ------------------------------------------------------------------ top-k log-probabilities


def reference_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row by row with math.fsum and Python's sort on (-lp, id)."""
    lps, ids = [], []
    for row in logits.astype(np.float64):
        lse = row.max() + math.log(math.fsum(math.exp(x - row.max()) for x in row))
        lp = [np.float32(x - lse) for x in row]
        order = sorted(range(len(row)), key=lambda t: (-lp[t], t))[:k]
        lps.append([lp[t] for t in order])
        ids.append(order)
    K = min(k, logits.shape[1])
    return (np.array(lps, dtype=np.float32).reshape(len(logits), K),
            np.array(ids, dtype=np.int64).reshape(len(logits), K))


@pytest.mark.parametrize("L,V,k", [(1, 1, 1), (3, 7, 4), (5, 50, 50), (2, 9, 20), (4, 300, 16),
                                   (0, 5, 3), (3, 6, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_matches_reference(L: int, V: int, k: int, dtype: type) -> None:
    logits = (np.random.default_rng(L * 100 + V).standard_normal((L, V)) * 3).astype(dtype)
    topk_lp, topk_id = topk_logprobs(logits, k)
    ref_lp, ref_id = reference_topk(logits, k)
    assert topk_lp.dtype == np.float32 and topk_id.dtype == np.int64
    assert topk_lp.shape == (L, min(k, V))                       # K capped by V
    np.testing.assert_array_equal(topk_id, ref_id)
    np.testing.assert_allclose(topk_lp, ref_lp, rtol=0, atol=np.spacing(np.float32(8)))


def test_topk_equal_float32_lp_goes_to_smaller_id() -> None:
    # Ids 3 and 1 have different float64 logits (3 is larger) that round to the same float32 lp;
    # id 5 is exactly tied with id 2.
    logits = np.array([[0.0, 1.0, 0.5, 1.0 + 1e-12, -2.0, 0.5]])
    topk_lp, topk_id = topk_logprobs(logits, 6)
    assert topk_lp[0, 0] == topk_lp[0, 1]
    assert topk_id.tolist() == [[1, 3, 2, 5, 0, 4]]


@pytest.mark.parametrize("logits,k,message", [
    (np.zeros(4), 2, "2-D"),
    (np.zeros((2, 4), dtype=np.int64), 2, "floating"),
    (np.zeros((2, 0)), 2, "empty"),
    (np.array([[0.0, np.nan]]), 1, "NaN"),
    (np.array([[0.0, 1.0], [-np.inf, -np.inf]]), 1, "finite maximum"),
    (np.array([[0.0, np.inf]]), 1, "finite maximum"),
    (np.zeros((2, 4)), -1, ">= 0"),
])
def test_topk_bad_input(logits: np.ndarray, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        topk_logprobs(logits, k)


# ------------------------------------------------------------------ tree build


def brute_force_tree(topk_lp: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Every rank path of depth 1..L, scored by the contract's left-to-right sum, sorted
    best first (ties: smaller rank path), the first `budget` kept."""
    L, K = topk_lp.shape
    scored = []
    for d in range(1, L + 1):
        for path in itertools.product(range(K), repeat=d):
            score = 0.0
            for depth, r in enumerate(path):
                score = score + float(topk_lp[depth, r])
            scored.append((-score, path))
    return [path for _, path in sorted(scored)[:budget]]


@st.composite
def topk_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """Small top-k tables whose log-probs come from a coarse grid (many exact ties)."""
    L = draw(st.integers(0, 3))
    K = draw(st.integers(1, 3))
    V = draw(st.integers(K, 6))
    grid = st.sampled_from([0.0, -0.25, -0.5, -1.0, -1.5, -2.0, -3.0])
    rows = [sorted(draw(st.lists(grid, min_size=K, max_size=K)), reverse=True) for _ in range(L)]
    topk_lp = np.array(rows, dtype=np.float32).reshape(L, K)
    perms = [draw(st.permutations(range(V)))[:K] for _ in range(L)]
    topk_id = np.array(perms, dtype=np.int64).reshape(L, K)
    budget = draw(st.integers(0, max_nodes(L, K) + 2))
    return topk_lp, topk_id, budget


@settings(max_examples=150, deadline=None)
@given(topk_inputs())
def test_tree_is_the_best_prefixes_in_pop_order(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    topk_lp, topk_id, budget = case
    tree = build_tree(topk_lp, topk_id, budget)
    expected = brute_force_tree(topk_lp, budget)
    assert tree.n == min(budget, max_nodes(*topk_lp.shape)) == len(expected)
    # Rebuild each node's rank path from the tree's own parents and ranks.
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.n + 1):
        paths.append(paths[tree.parents[i]] + (int(tree.ranks[i]),))
    assert paths[1:] == expected                                   # same set, same pop order
    assert len(set(paths)) == len(paths)


@settings(max_examples=100, deadline=None)
@given(topk_inputs())
def test_tree_structure(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    topk_lp, topk_id, budget = case
    tree = build_tree(topk_lp, topk_id, budget)
    assert tree.parents[0] == -1 and tree.tokens[0] == ROOT_UNSET and tree.depths[0] == 0
    assert tree.scores[0] == 0.0
    node_set = set()
    for i in range(1, tree.n + 1):
        p, d, r = tree.parents[i], tree.depths[i], tree.ranks[i]
        assert 0 <= p < i                                           # parents before children
        assert d == tree.depths[p] + 1
        assert tree.tokens[i] == topk_id[d - 1, r]
        # score is the parent's plus one widened float32 log-prob, bit for bit
        assert tree.scores[i] == tree.scores[p] + np.float64(topk_lp[d - 1, r])
        node_set.add((int(p), int(tree.tokens[i])))
    assert len(node_set) == tree.n                                   # distinct sibling tokens


def test_scores_are_not_incremental_sibling_updates() -> None:
    # Found by search: one sibling score where (p + a) - a + b != p + b in float64.
    topk_lp, topk_id = SIBLING_ROUNDING_TOPK
    tree = build_tree(topk_lp, topk_id, 39)
    assert tree.n == 39
    lp64 = topk_lp.astype(np.float64)
    for i in range(1, tree.n + 1):
        p, d, r = tree.parents[i], tree.depths[i], tree.ranks[i]
        assert tree.scores[i] == tree.scores[p] + lp64[d - 1, r]


def test_exact_ties_follow_rank_path_order() -> None:
    # Every candidate at one depth ties: pop order is breadth by rank path.
    topk_lp = np.full((2, 2), -1.0, dtype=np.float32)
    topk_id = np.array([[7, 3], [2, 9]])
    tree = build_tree(topk_lp, topk_id, 6)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.ranks.tolist() == [-1, 0, 1, 0, 1, 0, 1]
    assert tree.tokens.tolist() == [ROOT_UNSET, 7, 3, 2, 9, 2, 9]
    # A deep path ties a shallow one: (0, 0) = -1 + -1 = (1,) = -2; the smaller path (0, 0) first.
    topk_lp = np.array([[-1.0, -2.0], [-1.0, -3.0]], dtype=np.float32)
    tree = build_tree(topk_lp, topk_id, 3)
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.depths.tolist() == [0, 1, 2, 1]


@pytest.mark.parametrize("L,K,budget,n", [
    (3, 2, 0, 0),        # B = 0: the root alone
    (0, 4, 8, 0),        # L = 0: the root alone
    (1, 3, 1, 1),        # L = 1
    (1, 3, 10, 3),       # B larger than possible: all nodes
    (3, 2, 100, 14),     # 2 + 4 + 8
])
def test_edge_cases(L: int, K: int, budget: int, n: int) -> None:
    topk_lp = np.tile(np.linspace(-0.5, -2.0, K, dtype=np.float32), (L, 1))
    topk_id = np.tile(np.arange(K), (L, 1))
    tree = build_tree(topk_lp, topk_id, budget)
    assert tree.n == n


def test_k_capped_by_vocab_end_to_end() -> None:
    logits = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    topk_lp, topk_id = topk_logprobs(logits, 64)
    assert topk_lp.shape == (2, 3)
    assert build_tree(topk_lp, topk_id, 64).n == 3 + 9


@pytest.mark.parametrize("topk_lp,topk_id,budget,message", [
    (np.zeros((2, 2)), np.zeros((2, 2), dtype=np.int64), 1, "float32"),
    (np.zeros((2, 2), dtype=np.float32), np.zeros((2, 3), dtype=np.int64), 1, "topk_id"),
    (np.array([[-2.0, -1.0]], dtype=np.float32), np.array([[0, 1]]), 1, "non-increasing"),
    (np.array([[-1.0, -2.0]], dtype=np.float32), np.array([[4, 4]]), 1, "repeats"),
    (np.array([[-1.0, -2.0]], dtype=np.float32), np.array([[0, 1]]), -1, "budget"),
])
def test_build_tree_bad_input(topk_lp: np.ndarray, topk_id: np.ndarray, budget: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tree(topk_lp, topk_id, budget)


def test_tree_rejects_malformed_parents() -> None:
    with pytest.raises(ValueError, match="before it"):
        Tree.from_parents([-1, 0, 3, 1], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="before it"):
        Tree.from_parents([-1, 0, 9], [0, 1, 2])
    with pytest.raises(ValueError, match="root"):
        Tree.from_parents([0, 0], [0, 1])
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        Tree.from_parents([-1, 0], [0, 1, 2])
    with pytest.raises(ValueError, match="depths"):
        Tree([-1, 0], [5, 6], [0, 2], [-1, 0], [0.0, -1.0])


# ------------------------------------------------------------------ compile


def ancestors(parents: np.ndarray, i: int) -> set[int]:
    out = {i}
    while parents[i] != -1:
        i = int(parents[i])
        out.add(i)
    return out


@settings(max_examples=60, deadline=None)
@given(topk_inputs(), st.integers(0, 40))
def test_every_encoding_agrees_with_parents(case: tuple[np.ndarray, np.ndarray, int], start: int) -> None:
    tree = build_tree(*case)
    compiled = compile_tree(tree, start)
    size = tree.n + 1
    for i in range(size):
        sees = ancestors(tree.parents, i)
        assert set(np.flatnonzero(compiled.visibility[i]).tolist()) == sees
        assert set(np.flatnonzero(compiled.additive_mask[i] == 0).tolist()) == sees
        assert np.isneginf(compiled.additive_mask[i]).sum() == size - len(sees)
        words = compiled.visibility_bits[i]
        assert len(words) == math.ceil(size / 32) and compiled.visibility_bits.dtype == np.uint32
        assert {32 * w + b for w in range(len(words)) for b in range(32)
                if int(words[w]) >> b & 1} == sees
        children = [j for j in range(size) if tree.parents[j] == i]
        assert compiled.first_child[i] == (children[0] if children else -1)
        for a, b in zip(children, children[1:] + [-1]):
            assert compiled.next_sibling[a] == b
    assert compiled.next_sibling[0] == -1
    np.testing.assert_array_equal(compiled.positions, start + tree.depths)
    over_cache = visibility_over_cache(compiled, start)
    assert over_cache.shape == (size, start + size)
    assert over_cache[:, :start].all()
    np.testing.assert_array_equal(over_cache[:, start:], compiled.visibility)


def test_visibility_bits_cross_word_boundaries() -> None:
    chain = Tree.from_parents(np.arange(-1, 69), np.zeros(70, dtype=np.int64))   # a 70-token chain
    bits = compile_tree(chain, 0).visibility_bits
    assert bits.shape == (70, 3)
    assert bits[0].tolist() == [1, 0, 0]
    assert bits[31].tolist() == [0xFFFFFFFF, 0, 0]
    assert bits[32].tolist() == [0xFFFFFFFF, 1, 0]
    assert bits[69].tolist() == [0xFFFFFFFF, 0xFFFFFFFF, 0x3F]


# ------------------------------------------------------------------ target choices


def test_greedy_choices_ties_and_margins() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [0.5, -1.0, 2.0, 1.75], [-4.0, -4.0, -4.0, -4.0]])
    choices, margins = greedy_choices(logits)
    assert choices.tolist() == [1, 2, 0]
    assert margins.tolist() == [0.0, 0.25, 0.0]
    choices, margins = greedy_choices(np.array([[2.0]]))
    assert choices.tolist() == [0] and margins.tolist() == [np.inf]


def direct_cdf_walk(row: np.ndarray, temperature: float, u: float) -> int:
    z = row / temperature
    weights = [math.exp(x - z.max()) for x in z]
    p = [w / sum(weights) for w in weights]
    cumulative = 0.0
    for token, pt in enumerate(p):
        cumulative += pt
        if cumulative > u:
            return token
    return max(t for t, pt in enumerate(p) if pt > 0)


@pytest.mark.parametrize("V,temperature", [(2, 1.0), (17, 0.7), (300, 1.3)])
def test_sampling_is_a_cdf_walk_and_reproducible(V: int, temperature: float) -> None:
    rng = np.random.default_rng(V)
    logits = rng.standard_normal((64, V)) * 2
    uniforms = rng.random(64)
    choices = sample_choices(logits, temperature, uniforms)
    assert choices.tolist() == [direct_cdf_walk(row, temperature, u) for row, u in zip(logits, uniforms)]
    np.testing.assert_array_equal(sample_choices(logits, temperature, uniforms.copy()), choices)


def test_sampling_edges() -> None:
    logits = np.array([[-np.inf, 0.0, 0.0, -np.inf]] * 4)
    uniforms = np.array([0.0, 0.4999, 0.5, np.nextafter(1.0, 0.0)])
    assert sample_choices(logits, 1.0, uniforms).tolist() == [1, 1, 2, 2]


def test_sampling_frequencies_follow_softmax() -> None:
    logits = np.array([[0.0, 1.0, -1.0, 2.0]])
    n = 20000
    uniforms = np.random.default_rng(0).random(n)
    counts = np.bincount(sample_choices(np.repeat(logits, n, axis=0), 0.5, uniforms), minlength=4)
    p = np.exp(logits[0] / 0.5) / np.exp(logits[0] / 0.5).sum()
    assert np.abs(counts / n - p).max() < 4 * np.sqrt(p.max() / n)


def test_sample_margins_by_hand() -> None:
    """p = (1/4, 1/4, 1/2): u = 0.3 picks token 1 of [0.25, 0.5), 0.05 from its lower end:
    margin 4 T 0.05; u = 0.9 picks token 2 of [0.5, 1), 0.1 from its upper end."""
    logits = np.log(np.array([[1.0, 1.0, 2.0]] * 2))
    margins = sample_margins(logits, 1.0, np.array([0.3, 0.9]))
    np.testing.assert_allclose(margins, [4 * 0.05, 4 * 0.1], rtol=1e-12)
    np.testing.assert_allclose(sample_margins(logits * 0.5, 0.5, np.array([0.3, 0.9])), [2 * 0.05, 2 * 0.1],
                               rtol=1e-12)                                   # the same law at T = 0.5
    assert sample_margins(np.array([[0.0, 0.0]]), 1.0, np.array([0.5]))[0] == 0.0     # on a boundary


def test_no_perturbation_below_half_the_margin_flips_a_sampled_decision() -> None:
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((400, 12)) * 2
    uniforms = rng.random(400)
    for temperature in (0.5, 1.0, 2.0):
        choices = sample_choices(logits, temperature, uniforms)
        margins = sample_margins(logits, temperature, uniforms)
        perturbed = logits + 0.45 * margins[:, None] * rng.choice([-1.0, 1.0], size=logits.shape)
        np.testing.assert_array_equal(sample_choices(perturbed, temperature, uniforms), choices)
        flipped = logits + 3.0 * margins[:, None] * np.where(np.arange(12) < choices[:, None], 1.0, -1.0)
        assert (sample_choices(flipped, temperature, uniforms) != choices).any()   # the margin is not loose


@pytest.mark.parametrize("temperature,uniforms,message", [
    (0.0, [0.5], "temperature"),
    (1.0, [1.0], r"\[0, 1\)"),
    (1.0, [0.5, 0.5], "shape"),
])
def test_sampling_bad_input(temperature: float, uniforms: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_choices(np.zeros((1, 3)), temperature, np.array(uniforms))


# ------------------------------------------------------------------ accept and compact

#           0 (root 40)
#         /   \
#      1:5     2:7
#       |      /  \
#      3:9   4:3   5:4
#                   |
#                  6:8
HAND_TREE = Tree.from_parents([-1, 0, 0, 1, 2, 2, 5], [40, 5, 7, 9, 3, 4, 8])


@pytest.mark.parametrize("choices,accepted,next_root", [
    ([7, 0, 4, 0, 0, 8, 11], [0, 2, 5, 6], 11),      # non-prefix path, to a leaf
    ([7, 0, 4, 0, 0, 2, 11], [0, 2, 5], 2),          # non-prefix path, stops inside
    ([5, 9, 0, 1, 0, 0, 0], [0, 1, 3], 1),
    ([6, 5, 7, 9, 3, 4, 8], [0], 6),                 # no child matches the root's choice
    ([3, 0, 0, 0, 0, 0, 0], [0], 3),                 # a grandchild's token does not count
])
def test_accept_walk(choices: list[int], accepted: list[int], next_root: int) -> None:
    got, root = accept(HAND_TREE, np.array(choices))
    assert got.tolist() == accepted and root == next_root


def test_accept_bad_input() -> None:
    with pytest.raises(ValueError, match="choices"):
        accept(HAND_TREE, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="same token"):
        accept(Tree.from_parents([-1, 0, 0], [1, 2, 2]), np.zeros(3, dtype=np.int64))


@pytest.mark.parametrize("accepted", [[0, 2, 5], [0, 1, 2], [0], [0, 3, 4, 7]])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
def test_compaction_in_place(accepted: list[int], trailing: tuple[int, ...]) -> None:
    start, size = 4, 16
    cache = np.random.default_rng(len(accepted)).standard_normal((size, *trailing))
    before = cache.copy()
    compact(cache, start, np.array(accepted))
    for k, node in enumerate(accepted):
        np.testing.assert_array_equal(cache[start + k], before[start + node])
    untouched = [s for s in range(size) if not start <= s < start + len(accepted)]
    np.testing.assert_array_equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("accepted,message", [
    ([1, 2], "node 0"), ([0, 2, 2], "increase"), ([0, 12], "beyond"), ([], "node 0"),
])
def test_compaction_bad_input(accepted: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compact(np.zeros((10, 2)), 0, np.array(accepted, dtype=np.int64))


# ------------------------------------------------------------------ docs/ddtree-semantics.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "ddtree-semantics.md"


def doc_inputs(text: str) -> dict[str, object]:
    """The `name = literal` lines of the doc's ```python input blocks."""
    values: dict[str, object] = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if match := re.fullmatch(r"(\w+) = (.+)", line.strip()):
                values[match[1]] = ast.literal_eval(match[2])
    return values


def render_outline(tree: Tree, first_child: np.ndarray, next_sibling: np.ndarray) -> str:
    """The tree as an outline: `index: token  (score)`, children by the EAGLE lists."""
    lines = [f"0: {tree.tokens[0]}  (root, score 0)"]

    def walk(node: int, prefix: str) -> None:
        child = first_child[node]
        while child != -1:
            last = next_sibling[child] == -1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{child}: {tree.tokens[child]}  "
                         f"({tree.scores[child]})")
            walk(child, prefix + ("    " if last else "│   "))
            child = next_sibling[child]

    walk(0, "")
    return "\n".join(lines)


def render_table(tree: Tree, compiled: CompiledTree) -> str:
    rows = ["node  parent  depth  rank  token  score   position  visibility  bits (word 0)"]
    for i in range(tree.n + 1):
        dense = " ".join("1" if v else "." for v in compiled.visibility[i])
        rows.append(f"{i:>4}  {tree.parents[i]:>6}  {tree.depths[i]:>5}  {tree.ranks[i]:>4}  "
                    f"{tree.tokens[i]:>5}  {tree.scores[i]:<6}  {compiled.positions[i]:>8}  "
                    f"{dense}   0x{compiled.visibility_bits[i, 0]:08x}")
    return "\n".join(rows)


def render_lists(compiled: CompiledTree, row: int) -> str:
    mask = " ".join(f"{v:g}" for v in compiled.additive_mask[row])
    return (f"first_child  = {compiled.first_child.tolist()}\n"
            f"next_sibling = {compiled.next_sibling.tolist()}\n"
            f"additive_mask[{row}] = [{mask}]")


def render_accept(tree: Tree, choices: np.ndarray, start: int) -> str:
    accepted, next_root = accept(tree, choices)
    cache = np.arange(start + tree.n + 1)                      # row s holds its own slot number
    compact(cache, start, accepted)
    moves = ", ".join(f"slot {start + k} <- slot {start + a}" for k, a in enumerate(accepted.tolist()))
    return (f"accepted       = {accepted.tolist()}\n"
            f"next_root      = {next_root}\n"
            f"committed      = {[*tree.tokens[accepted[1:]].tolist(), next_root]}\n"
            f"compaction_src = {(start + accepted).tolist()}\n"
            f"moves          : {moves}\n"
            f"cache slots {start}..{start + len(accepted) - 1} now hold the KV written at slots "
            f"{cache[start:start + len(accepted)].tolist()}")


def doc_blocks() -> list[str]:
    """Every block of the doc's worked example, re-derived from its inputs by the code."""
    text = DOC.read_text()
    inputs = doc_inputs(text)
    tree = build_tree(np.array(inputs["topk_lp"], dtype=np.float32), np.array(inputs["topk_id"]),
                      inputs["budget"]).with_root(inputs["root"])
    compiled = compile_tree(tree, inputs["start"])
    lp, ids = topk_logprobs(np.array(inputs["draft_logits"], dtype=np.float32), 3)
    return [f"topk_lp = {lp.tolist()}\ntopk_id = {ids.tolist()}",
            render_outline(tree, compiled.first_child, compiled.next_sibling),
            render_table(tree, compiled),
            render_lists(compiled, 5),
            render_accept(tree, np.array(inputs["choices"]), inputs["start"])]


def test_doc_example_matches_the_code() -> None:
    text = DOC.read_text()
    for block in doc_blocks():
        assert block in text, f"docs/ddtree-semantics.md is out of date; expected:\n{block}"
