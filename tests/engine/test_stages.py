"""engine.stages.TorchStages against refgen.ddtree (the contract's numpy oracle).

Batched calls (requests with different budgets, trees and starts) are checked
request by request against the reference: top-K and tree build bit-exact
(float64 scores included), every compile encoding, accept and KV compaction
on non-prefix paths, greedy and sampled choices; plus bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import KVCache
from engine.stages import TorchStages, TreeBatch, top2_margins
from kdtr_format import PRESETS
from refgen import ddtree
from refgen.kernel_cases import SIBLING_ROUNDING_TOPK

STAGES = TorchStages()


def random_topk(rng: np.random.Generator, batch: int, depth: int, vocab: int, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Reference top-K of random draft logits -> topk_lp float32 [B, L, K], topk_id [B, L, K]."""
    pairs = [ddtree.topk_logprobs(rng.normal(size=(max(depth, 1), vocab)) * 2.5, k) for _ in range(batch)]
    return np.stack([p[0][:depth] for p in pairs]), np.stack([p[1][:depth] for p in pairs])


def wide_range_topk(rng: np.random.Generator, batch: int, depth: int, vocab: int, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made top-K with log-probs from -1e-12 to -100: float64 scores then round, so only
    parent score + one log-prob (never an incremental sibling update) reproduces them."""
    topk_lp = -np.sort(10.0 ** rng.uniform(-12, 2, (batch, depth, k)), axis=-1).astype(np.float32)
    topk_id = np.argsort(rng.random((batch, depth, vocab)), axis=-1)[..., :k]
    return topk_lp, topk_id


def tied_topk(batch: int, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made top-K whose log-probs tie exactly within and across depths."""
    lp = np.repeat(np.float32([-1.0, -1.0, -1.0, -2.0, -2.0, -3.0])[:k][None], depth, 0)
    ids = np.stack([np.roll(np.arange(k) * 7 + 3, d) for d in range(depth)])
    return np.broadcast_to(lp, (batch, depth, k)).copy(), np.broadcast_to(ids, (batch, depth, k)).copy()


def build_batch(topk_lp: np.ndarray, topk_id: np.ndarray, budgets: list[int], roots: list[int],
                device: str) -> TreeBatch:
    return STAGES.build_trees(torch.tensor(topk_lp, device=device), torch.tensor(topk_id, device=device),
                              torch.tensor(budgets, device=device), torch.tensor(roots, device=device))


def reference_trees(topk_lp: np.ndarray, topk_id: np.ndarray, budgets: list[int],
                    roots: list[int]) -> list[ddtree.Tree]:
    return [ddtree.build_tree(topk_lp[b], topk_id[b], budgets[b]).with_root(roots[b]) for b in range(len(budgets))]


def unpadded(t: torch.Tensor, b: int, size: int) -> np.ndarray:
    return t[b, :size].cpu().numpy()


# top-k source, depth L, vocab V, top-k k, budgets per request (0, 1, small, more than the tree can hold)
TREE_CASES = {
    "random": (random_topk, 4, 50, 8, [0, 1, 6, 33, 200]),
    "L=1": (random_topk, 1, 50, 8, [0, 1, 3, 8, 20]),
    "L=0": (random_topk, 0, 50, 8, [0, 5]),
    "small vocab, budget beyond every node": (random_topk, 3, 3, 8, [2, 13, 39, 500]),
    "K=1 chain": (random_topk, 6, 40, 1, [0, 3, 6, 10]),
    "wide: visibility spans 3 words": (random_topk, 5, 300, 16, [70, 5, 0]),
    "log-probs from -1e-12 to -100": (wide_range_topk, 8, 60, 6, [40, 120, 300]),
}


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_build_and_compile_match_reference(case, device):
    make_topk, depth, vocab, k, budgets = TREE_CASES[case]
    rng = np.random.default_rng(len(case))
    topk_lp, topk_id = make_topk(rng, len(budgets), depth, vocab, k)
    roots = rng.integers(0, vocab, len(budgets)).tolist()
    starts = rng.integers(0, 100, len(budgets))
    trees = build_batch(topk_lp, topk_id, budgets, roots, device)
    compiled = STAGES.compile_trees(trees, torch.tensor(starts, device=device))
    expected = reference_trees(topk_lp, topk_id, budgets, roots)
    assert trees.n.tolist() == [t.n for t in expected]
    assert trees.width == max(t.n for t in expected) + 1 and trees.depth == depth
    for b, tree in enumerate(expected):
        size = tree.n + 1
        for name in ("parents", "tokens", "depths", "scores"):
            np.testing.assert_array_equal(unpadded(getattr(trees, name), b, size), getattr(tree, name), err_msg=name)
        assert (trees.parents[b, size:] == -1).all() and (trees.tokens[b, size:] == -1).all()
        ref = ddtree.compile_tree(tree, int(starts[b]))
        np.testing.assert_array_equal(unpadded(compiled.positions, b, size), ref.positions)
        np.testing.assert_array_equal(compiled.visibility[b, :size, :size].cpu().numpy(), ref.visibility)
        words = ref.visibility_bits.shape[1]
        bits = compiled.visibility_bits[b, :size, :words].cpu().numpy().view(np.uint32)
        np.testing.assert_array_equal(bits, ref.visibility_bits)
        assert (compiled.visibility_bits[b, :size, words:] == 0).all()
        np.testing.assert_array_equal(unpadded(compiled.first_child, b, size), ref.first_child)
        np.testing.assert_array_equal(unpadded(compiled.next_sibling, b, size), ref.next_sibling)
        padding = compiled.visibility[b, size:].cpu().numpy()                 # padding rows: self only
        np.testing.assert_array_equal(padding, np.eye(trees.width, dtype=bool)[size:])
        assert (compiled.visibility[b, :size, size:] == 0).all()


@pytest.mark.parametrize("depth,k", [(3, 6), (4, 4), (1, 5)])
def test_build_breaks_exact_ties_like_reference(depth, k, device):
    """Equal scores pop by the smaller rank path: exact float ties, many budgets at once."""
    budgets = [0, 1, 2, 3, 5, 9, 17, 40, 1000]
    topk_lp, topk_id = tied_topk(len(budgets), depth, k)
    trees = build_batch(topk_lp, topk_id, budgets, list(range(len(budgets))), device)
    for b, tree in enumerate(reference_trees(topk_lp, topk_id, budgets, list(range(len(budgets))))):
        size = tree.n + 1
        np.testing.assert_array_equal(unpadded(trees.parents, b, size), tree.parents)
        np.testing.assert_array_equal(unpadded(trees.tokens, b, size), tree.tokens)
        np.testing.assert_array_equal(unpadded(trees.scores, b, size), tree.scores)


def test_build_scores_each_sibling_from_its_parent(device):
    """refgen's hand-found top-k (refgen.kernel_cases.SIBLING_ROUNDING_TOPK): there a sibling's
    score updated from the previous sibling's, s + (lp[r] - lp[r-1]) or (s - lp[r-1]) + lp[r],
    rounds differently from parent + lp[r]; the build must match refgen bit for bit."""
    topk_lp, topk_id = SIBLING_ROUNDING_TOPK
    expected = ddtree.build_tree(topk_lp, topk_id, 39)
    lp = topk_lp.astype(np.float64)
    node = {(p, r): i for i, (p, r) in enumerate(zip(expected.parents.tolist(), expected.ranks.tolist()))}
    differs = set()
    for i in range(1, expected.n + 1):
        p, d, r = expected.parents[i], expected.depths[i], expected.ranks[i]
        if r > 0:
            s = expected.scores[node[p, r - 1]]
            differs |= {form for form, score in (("delta", s + (lp[d - 1, r] - lp[d - 1, r - 1])),
                                                 ("undo", (s - lp[d - 1, r - 1]) + lp[d - 1, r]))
                        if score != expected.scores[i]}
    assert differs == {"delta", "undo"}                  # the example catches both incremental forms
    trees = build_batch(topk_lp[None], topk_id[None], [39], [0], device)
    assert int(trees.n[0]) == 39
    for name in ("parents", "depths", "scores"):
        np.testing.assert_array_equal(unpadded(getattr(trees, name), 0, 40), getattr(expected, name), err_msg=name)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), depth=st.integers(0, 5), vocab=st.integers(1, 30),
       k=st.integers(1, 8), quantized=st.booleans())
def test_build_compile_accept_match_reference_on_random_batches(data, batch, depth, vocab, k, quantized):
    """Random shapes and budgets; quantized draft logits make many exact log-prob ties."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(size=(batch, max(depth, 1), vocab)) * 2
    if quantized:
        logits = np.round(logits)
    pairs = [ddtree.topk_logprobs(logits[b], k) for b in range(batch)]
    topk_lp = np.stack([p[0][:depth] for p in pairs])
    topk_id = np.stack([p[1][:depth] for p in pairs])
    budgets = data.draw(st.lists(st.integers(0, 60), min_size=batch, max_size=batch))
    roots = rng.integers(0, vocab, batch).tolist()
    trees = build_batch(topk_lp, topk_id, budgets, roots, "cpu")
    compiled = STAGES.compile_trees(trees, torch.zeros(batch, dtype=torch.int64))
    choices = choices_along_paths(rng, trees, vocab)
    accepted, accept_len, next_root = STAGES.accept(trees, choices)
    for b, tree in enumerate(reference_trees(topk_lp, topk_id, budgets, roots)):
        size = tree.n + 1
        assert int(trees.n[b]) == tree.n
        for name in ("parents", "tokens", "depths", "scores"):
            np.testing.assert_array_equal(unpadded(getattr(trees, name), b, size), getattr(tree, name), err_msg=name)
        ref = ddtree.compile_tree(tree, 0)
        np.testing.assert_array_equal(compiled.visibility[b, :size, :size].numpy(), ref.visibility)
        np.testing.assert_array_equal(unpadded(compiled.next_sibling, b, size), ref.next_sibling)
        ref_accepted, ref_next = ddtree.accept(tree, choices[b, :size].numpy())
        np.testing.assert_array_equal(accepted[b, :int(accept_len[b])].numpy(), ref_accepted)
        assert int(next_root[b]) == ref_next


def test_empty_batch():
    trees = STAGES.build_trees(torch.zeros(0, 3, 4), torch.zeros(0, 3, 4, dtype=torch.int64),
                               torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert trees.n.shape == (0,) and trees.parents.shape == (0, 1)
    compiled = STAGES.compile_trees(trees, torch.zeros(0, dtype=torch.int64))
    assert compiled.visibility_bits.shape == (0, 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_reference(dtype, device):
    rng = np.random.default_rng(5)
    logits = torch.tensor(rng.normal(size=(3, 4, 300)) * 3).to(dtype)
    logits[1, 2] = torch.tensor(rng.integers(-2, 3, 300), dtype=dtype)      # exact ties: smaller id first
    for k in (1, 8, 300, 1000):
        topk_lp, topk_id = STAGES.topk_logprobs(logits.to(device), k)
        assert topk_lp.dtype == torch.float32 and topk_id.dtype == torch.int64
        assert topk_lp.shape == (3, 4, min(k, 300))
        for b in range(3):
            ref_lp, ref_id = ddtree.topk_logprobs(logits[b].float().numpy(), k)
            np.testing.assert_array_equal(topk_lp[b].cpu().numpy(), ref_lp)
            np.testing.assert_array_equal(topk_id[b].cpu().numpy(), ref_id)


def choices_along_paths(rng: np.random.Generator, trees: TreeBatch, vocab: int) -> torch.Tensor:
    """Random target choices, except along the path from the root to a random node of each
    tree (often not a prefix of tree order), where each choice names the next node's token."""
    parents, tokens = trees.parents.cpu().numpy(), trees.tokens.cpu().numpy()
    choices = rng.integers(0, vocab, parents.shape)
    for b, n in enumerate(trees.n.tolist()):
        node = int(rng.integers(0, n + 1))
        while node > 0:
            choices[b, parents[b, node]] = tokens[b, node]
            node = parents[b, node]
    return torch.tensor(choices, device=trees.parents.device)


def test_accept_and_compact_match_reference(device):
    rng = np.random.default_rng(6)
    depth, vocab, budgets = 5, 12, [0, 1, 7, 30, 60, 90]
    topk_lp, topk_id = random_topk(rng, len(budgets), depth, vocab, 4)
    roots = rng.integers(0, vocab, len(budgets)).tolist()
    trees = build_batch(topk_lp, topk_id, budgets, roots, device)
    choices = choices_along_paths(rng, trees, vocab)
    accepted, accept_len, next_root = STAGES.accept(trees, choices)
    assert accepted.shape == (len(budgets), depth + 1)

    cfg = PRESETS["tiny2"]
    starts = torch.tensor(rng.integers(0, 20, len(budgets)), device=device)
    cache = KVCache.allocate(cfg, len(budgets), 20 + max(budgets) + 1, device=device)
    cache.c_kv.copy_(torch.randn(cache.c_kv.shape))
    cache.k_pe.copy_(torch.randn(cache.k_pe.shape))
    before = (cache.c_kv.cpu().numpy().copy(), cache.k_pe.cpu().numpy().copy())
    STAGES.compact_kv(cache, starts, accepted, accept_len)

    non_prefix = 0
    for b, tree in enumerate(reference_trees(topk_lp, topk_id, budgets, roots)):
        ref_accepted, ref_next = ddtree.accept(tree, choices[b, :tree.n + 1].cpu().numpy())
        a = len(ref_accepted)
        assert int(accept_len[b]) == a and int(next_root[b]) == ref_next
        np.testing.assert_array_equal(accepted[b, :a].cpu().numpy(), ref_accepted)
        assert (accepted[b, a:] == -1).all()
        non_prefix += not np.array_equal(ref_accepted, np.arange(a))
        for array, after in zip(before, (cache.c_kv, cache.k_pe)):
            for layer in range(cfg.num_hidden_layers):
                expected = array[layer, b].copy()
                ddtree.compact(expected, int(starts[b]), ref_accepted)
                np.testing.assert_array_equal(after[layer, b].cpu().numpy(), expected)
    assert non_prefix >= 2, "the case must exercise non-prefix accepted paths"


def test_greedy_and_sampled_choices_match_reference(device):
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(2, 5, 40)) * 2
    logits[0, 1, [3, 9]] = 50.0                                                # a tie: smaller id wins
    logits[1, 2, 10:] = -np.inf                                                 # zero-probability tail
    t = torch.tensor(logits, dtype=torch.float32, device=device)
    greedy = STAGES.greedy_choices(t).cpu().numpy()
    uniforms = rng.random((2, 5))
    uniforms[1, 2] = 1 - 1e-12
    sampled = STAGES.sample_choices(t, 0.7, torch.tensor(uniforms, device=device)).cpu().numpy()
    for b in range(2):
        ref_greedy, _ = ddtree.greedy_choices(logits[b].astype(np.float32))
        np.testing.assert_array_equal(greedy[b], ref_greedy)
        np.testing.assert_array_equal(sampled[b], ddtree.sample_choices(logits[b].astype(np.float32), 0.7, uniforms[b]))
    assert greedy[0, 1] == 3 and sampled[1, 2] < 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 2, 7, 40, 4099])
def test_top2_margins_match_a_sort(dtype, vocab, device):
    """top1 - top2 of each row as a full sort gives it: 0 at a tie for the top (rows of small
    integers tie often), inf at V = 1; of chosen rows alone, the same."""
    rng = np.random.default_rng(vocab)
    rows = np.concatenate([rng.normal(size=(6, vocab)) * 3, rng.integers(-2, 3, (6, vocab))])
    t = torch.tensor(rows, dtype=dtype, device=device).reshape(3, 4, vocab)
    values = t.float().cpu().numpy().reshape(12, vocab).astype(np.float64)
    ordered = -np.sort(-values, axis=-1)
    expected = ordered[:, 0] - ordered[:, 1] if vocab > 1 else np.full(12, np.inf)
    margins = top2_margins(t)
    assert margins.dtype == torch.float64 and margins.shape == (3, 4)
    np.testing.assert_array_equal(margins.cpu().numpy().reshape(12), expected)
    rows = torch.tensor([[3, 0], [1, 1], [2, 0]], device=device)              # [B, P] rows of each request
    assert torch.equal(top2_margins(t, rows), margins.gather(1, rows))
    assert vocab < 7 or (expected[6:] == 0).any(), "the integer rows must tie for the top"


# ---- bad input ----

def _valid_build() -> dict:
    lp, ids = random_topk(np.random.default_rng(8), 2, 3, 20, 4)
    return dict(topk_lp=torch.tensor(lp), topk_id=torch.tensor(ids), budgets=torch.tensor([3, 4]),
                roots=torch.tensor([1, 2]))


BAD_BUILDS = {
    "negative budget": (lambda c: c.update(budgets=torch.tensor([3, -1])), "budgets: must be >= 0"),
    "float64 log-probs": (lambda c: c.update(topk_lp=c["topk_lp"].double()), "topk_lp: expected dtype"),
    "ids shape": (lambda c: c.update(topk_id=c["topk_id"][:, :2]), "topk_id: shape"),
    "roots length": (lambda c: c.update(roots=torch.tensor([1])), r"roots: expected shape \[2\]"),
    "budgets on meta": (lambda c: c.update(budgets=c["budgets"].to("meta")), "budgets: on meta"),
    "increasing log-probs": (lambda c: c["topk_lp"].__setitem__((0, 0, 1), 0.5), "non-increasing"),
}


@pytest.mark.parametrize("bad", list(BAD_BUILDS))
def test_build_rejects_bad_input(bad):
    STAGES.build_trees(**_valid_build())
    call = _valid_build()
    mutate, message = BAD_BUILDS[bad]
    mutate(call)
    with pytest.raises(ValueError, match=message):
        STAGES.build_trees(**call)


def test_other_stages_reject_bad_input():
    trees = STAGES.build_trees(**_valid_build())
    with pytest.raises(ValueError, match="draft_logits: expected 3 dims"):
        STAGES.topk_logprobs(torch.zeros(4, 10), 2)
    with pytest.raises(ValueError, match="k: expected an integer >= 0"):
        STAGES.topk_logprobs(torch.zeros(1, 4, 10), -1)
    with pytest.raises(ValueError, match="starts: must be >= 0"):
        STAGES.compile_trees(trees, torch.tensor([0, -2]))
    with pytest.raises(ValueError, match="choices: expected shape"):
        STAGES.accept(trees, torch.zeros(2, trees.width + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        STAGES.sample_choices(torch.zeros(1, 2, 5), 0.0, torch.zeros(1, 2))
    cache = KVCache.allocate(PRESETS["tiny2"], 2, 8)
    accepted = torch.tensor([[0, 2, -1], [0, -1, -1]])
    with pytest.raises(ValueError, match=r"accept_len: must lie in \[1, 3\]"):
        STAGES.compact_kv(cache, torch.tensor([0, 0]), accepted, torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="beyond the cache"):
        STAGES.compact_kv(cache, torch.tensor([6, 0]), accepted, torch.tensor([2, 1]))


# ---- golden kernel cases (tests/golden/kernels/, written by `refgen generate`) ----

def test_golden_tree_build_cases(golden):
    import kdtr_format

    with kdtr_format.open(golden / "kernels/tree_build.kdtr") as fixture:
        for case in fixture.metadata["cases"]:
            get = lambda name: torch.as_tensor(np.array(fixture[f"cases/{case['name']}/{name}"]))  # noqa: E731
            topk_lp, topk_id = get("topk_lp"), get("topk_id")
            if f"cases/{case['name']}/draft_logits" in fixture:
                lp, ids = STAGES.topk_logprobs(get("draft_logits")[None], topk_lp.shape[-1])
                assert torch.equal(lp[0], topk_lp) and torch.equal(ids[0], topk_id), case["name"]
            trees = STAGES.build_trees(topk_lp[None], topk_id[None], torch.tensor([case["budget"]]),
                                       torch.tensor([-1]))
            compiled = STAGES.compile_trees(trees, torch.tensor([case["start"]]))
            for name, actual in (("parents", trees.parents), ("tokens", trees.tokens), ("depths", trees.depths),
                                 ("scores", trees.scores), ("positions", compiled.positions),
                                 ("first_child", compiled.first_child), ("next_sibling", compiled.next_sibling)):
                assert torch.equal(actual[0], get(name)), f"{case['name']}: {name}"
            bits = get("visibility_bits").numpy()
            assert (compiled.visibility_bits[0].numpy().view(np.uint32) == bits).all(), case["name"]


def tree_from_parents(parents: torch.Tensor, tokens: torch.Tensor) -> TreeBatch:
    """A one-request TreeBatch from a hand-made tree (depths derived from parents)."""
    depths = [0]
    for p in parents.tolist()[1:]:
        depths.append(depths[p] + 1)
    return TreeBatch(n=torch.tensor([len(depths) - 1]), parents=parents[None], tokens=tokens[None],
                     depths=torch.tensor([depths]), scores=torch.zeros(1, len(depths), dtype=torch.float64),
                     depth=max(depths))


def test_golden_accept_compact_cases(golden):
    import kdtr_format

    with kdtr_format.open(golden / "kernels/accept_compact.kdtr") as fixture:
        for case in fixture.metadata["cases"]:
            get = lambda name: torch.as_tensor(np.array(fixture[f"cases/{case['name']}/{name}"]))  # noqa: E731
            trees = tree_from_parents(get("parents"), get("tokens"))
            accepted, accept_len, next_root = STAGES.accept(trees, get("choices")[None])
            assert torch.equal(accepted[0, :int(accept_len[0])], get("accepted")), case["name"]
            assert int(next_root[0]) == int(get("next_root")), case["name"]
            c_kv, k_pe = get("c_kv"), get("k_pe")
            cache = KVCache(c_kv=c_kv[None, None].clone(), k_pe=k_pe[None, None].clone(),
                            lengths=torch.zeros(1, dtype=torch.int64))
            STAGES.compact_kv(cache, torch.tensor([case["start"]]), accepted, accept_len)
            assert torch.equal(cache.c_kv[0, 0], get("c_kv_after")), case["name"]
            assert torch.equal(cache.k_pe[0, 0], get("k_pe_after")), case["name"]
