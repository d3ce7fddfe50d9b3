"""The CUDA tree kernels (kernels_cuda.tree_ops) against refgen's numpy oracle.

Reference beside each implementation: `expected_batch` lays refgen's build_tree +
compile_tree out in the batched engine layout (padding -1 / -inf, a padding visibility row
sees itself only), and every integer output and every float64 score must be equal.
Outputs are allocated over poisoned memory (poison_cuda_allocator), so an element
a kernel never writes fails the comparison. GPU tests skip without a CUDA device; the
argument checks run on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_bench import capture_graph
from kernels_cuda import tree_ops
from refgen import ddtree as ref

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")
POISON_BYTE = 0x5A
VERSIONS = [3, 4]              # the top-k kernels (NOTES-tree.md); every top-k test runs both


def poison_cuda_allocator() -> None:
    """Fill both pools of torch's CUDA caching allocator with 0x5A bytes and free them, so the next
    `torch.empty` outputs start as garbage (int64 0x5A5A..., float64 ~1e127; never -1, 0 or -inf)
    and an element a kernel forgets to write fails an exact comparison. 1 MiB blocks serve
    requests <= 1 MiB, the 256 MiB block larger ones."""
    blocks = [torch.full((1 << 20,), POISON_BYTE, dtype=torch.uint8, device="cuda") for _ in range(32)]
    blocks.append(torch.full((256 << 20,), POISON_BYTE, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    del blocks

# ----------------------------------------------------------------------------- references


def expected_batch(topk_lp: np.ndarray, topk_id: np.ndarray, budgets: list[int], roots: list[int],
                   starts: list[int], width: int) -> dict[str, np.ndarray]:
    """topk_lp float32 [B, L, K], topk_id [B, L, K] -> refgen's trees in the batched layout, [B, width]."""
    words = -(-width // 32)
    out = {name: np.full((len(budgets), width), -1, dtype=np.int64)
           for name in ("parents", "tokens", "depths", "positions", "first_child", "next_sibling")}
    out["scores"] = np.full((len(budgets), width), -np.inf)
    out["visibility_bits"] = np.zeros((len(budgets), width, words), dtype=np.uint32)
    out["n"] = np.zeros(len(budgets), dtype=np.int64)
    for b, (budget, root, start) in enumerate(zip(budgets, roots, starts)):
        tree = ref.build_tree(topk_lp[b], topk_id[b], budget).with_root(root) if root >= 0 else \
            ref.build_tree(topk_lp[b], topk_id[b], budget)
        compiled = ref.compile_tree(tree, start)
        size = tree.n + 1
        out["n"][b] = tree.n
        for name in ("parents", "tokens", "depths", "scores"):
            out[name][b, :size] = getattr(tree, name)
        for name in ("positions", "first_child", "next_sibling"):
            out[name][b, :size] = getattr(compiled, name)
        visibility = np.eye(width, dtype=bool)
        visibility[:size, :size] = compiled.visibility
        out["visibility_bits"][b] = ref.pack_bits(visibility)
    return out


def random_topk(rng: np.random.Generator, batch: int, depth: int, k: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Valid top-k rows: lp non-increasing multiples of 1/4 (many exact path-sum ties), distinct ids."""
    steps = np.sort(rng.integers(0, 6, size=(batch, depth, k)), axis=-1)
    topk_lp = (-0.25 * (steps + 1)).astype(np.float32)
    topk_id = np.stack([np.stack([rng.permutation(vocab)[:k] for _ in range(depth)]) if depth else
                        np.zeros((0, k), dtype=np.int64) for _ in range(batch)]).reshape(batch, depth, k)
    return topk_lp, topk_id.astype(np.int64)


def cuda(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).cuda()


def vec(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cuda")


def run_build(topk_lp: np.ndarray, topk_id: np.ndarray, budgets: list[int], roots: list[int], starts: list[int],
              width: int) -> dict[str, np.ndarray]:
    """The fused build + compile op over poisoned memory -> numpy outputs keyed like expected_batch."""
    poison_cuda_allocator()
    out = tree_ops.build_compiled_trees(cuda(topk_lp), cuda(topk_id), vec(budgets), vec(roots), vec(starts), width)
    names = ("n", "parents", "tokens", "depths", "scores", "positions", "visibility_bits", "first_child",
             "next_sibling")
    got = {name: t.cpu().numpy() for name, t in zip(names, out)}
    got["visibility_bits"] = got["visibility_bits"].view(np.uint32)
    return got


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, expected in want.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


# ----------------------------------------------------------------------------- tree build: golden


def golden_tree_cases(open_golden):
    f = open_golden("kernels/tree_build.kdtr")
    return f, f.metadata["cases"]


@needs_gpu
@pytest.mark.parametrize("padding", [0, 37])
def test_build_golden_cases(padding: int, open_golden) -> None:
    """Every committed case, from its own top-k, at the exact width and with 37 padding columns."""
    f, cases = golden_tree_cases(open_golden)
    for case in cases:
        prefix = f"cases/{case['name']}/"
        topk_lp, topk_id = f[prefix + "topk_lp"], f[prefix + "topk_id"]
        width = case["nodes"] + padding
        got = run_build(topk_lp[None], topk_id[None], [case["budget"]], [-1], [case["start"]], width)
        want = expected_batch(topk_lp[None], topk_id[None], [case["budget"]], [-1], [case["start"]], width)
        size = case["nodes"]
        for name in ("parents", "tokens", "depths", "scores", "positions", "first_child", "next_sibling"):
            np.testing.assert_array_equal(got[name][0, :size], f[prefix + name], err_msg=f"{case['name']}: {name}")
        np.testing.assert_array_equal(got["visibility_bits"][0, :size, :f[prefix + "visibility_bits"].shape[1]],
                                      f[prefix + "visibility_bits"], err_msg=f"{case['name']}: visibility_bits")
        assert_same(got, want)


@needs_gpu
@pytest.mark.parametrize("version", VERSIONS)
def test_topk_golden_cases(version: int, open_golden) -> None:
    """draft_logits -> top-k: ids equal to the fixture's, log-probs within one float32 ulp."""
    f, cases = golden_tree_cases(open_golden)
    for case in cases:
        prefix = f"cases/{case['name']}/"
        if prefix + "draft_logits" not in f:
            continue
        topk_lp, topk_id = tree_ops.topk_logprobs(cuda(f[prefix + "draft_logits"]), case["budget"], version)
        np.testing.assert_array_equal(topk_id.cpu().numpy(), f[prefix + "topk_id"], err_msg=case["name"])
        assert_within_ulp(topk_lp.cpu().numpy(), f[prefix + "topk_lp"])


def assert_within_ulp(got: np.ndarray, want: np.ndarray, ulps: int = 1) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])
    gap = np.abs(got[finite].view(np.int32).astype(np.int64) - want[finite].view(np.int32).astype(np.int64))
    assert gap.max(initial=0) <= ulps, f"log-probs differ by up to {gap.max()} ulps"


# ----------------------------------------------------------------------------- tree build: random and edges


@needs_gpu
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 5), depth=st.integers(0, 9), k=st.integers(0, 12),
       extra=st.integers(0, 40))
def test_build_random_batches(seed: int, batch: int, depth: int, k: int, extra: int) -> None:
    """Mixed budgets (0 up to beyond every possible node), roots, starts in one launch."""
    rng = np.random.default_rng(seed)
    topk_lp, topk_id = random_topk(rng, batch, depth, k, vocab=max(k, 1) + 5)
    budgets = rng.integers(0, 70, size=batch).tolist()
    roots = rng.integers(0, 1000, size=batch).tolist()
    starts = rng.integers(0, 5000, size=batch).tolist()
    width = max(budgets) + 1 + extra
    assert_same(run_build(topk_lp, topk_id, budgets, roots, starts, width),
                expected_batch(topk_lp, topk_id, budgets, roots, starts, width))


@needs_gpu
@pytest.mark.parametrize("depth, k, budgets", [
    (1, 40, [12, 40, 100]),                 # L = 1: stars, K caps the budget
    (15, 512, [512, 1, 300]),               # the paper's block size, mixed budgets
    (15, 1024, [1024, 0]),                  # the largest budget
    (32, 64, [1024, 17]),                   # the deepest trees
    (3, 2, [100]),                          # budget beyond every possible node (2 + 4 + 8)
])
def test_build_large_and_edge(depth: int, k: int, budgets: list[int]) -> None:
    rng = np.random.default_rng(depth * 1000 + k)
    topk_lp, topk_id = random_topk(rng, len(budgets), depth, k, vocab=k + 100)
    width = max(budgets) + 1
    roots, starts = list(range(len(budgets))), [7 * b for b in range(len(budgets))]
    assert_same(run_build(topk_lp, topk_id, budgets, roots, starts, width),
                expected_batch(topk_lp, topk_id, budgets, roots, starts, width))


@needs_gpu
def test_build_all_equal_scores() -> None:
    """Every lp equal: the order is decided by rank paths alone, at every depth."""
    topk_lp = np.full((2, 6, 4), -1.0, dtype=np.float32)
    topk_id = np.tile(np.arange(4, dtype=np.int64), (2, 6, 1))
    topk_lp[1] = 0.0                                       # zero log-probs: every node ties with its parent
    assert_same(run_build(topk_lp, topk_id, [200, 90], [5, 6], [0, 3], 201),
                expected_batch(topk_lp, topk_id, [200, 90], [5, 6], [0, 3], 201))


@needs_gpu
def test_compile_hand_made_trees() -> None:
    """compile_trees from parents alone (a tree not built by the heap), ragged batch."""
    trees = [[-1, 0, 0, 1, 1, 2, 2, 5], [-1], [-1, 0, 1, 2, 3]]
    width, starts = 9, [6, 3, 11]
    parents = np.full((3, width), -1, dtype=np.int64)
    depths = np.full((3, width), -1, dtype=np.int64)
    want_positions = np.full((3, width), -1, dtype=np.int64)
    for b, p in enumerate(trees):
        tree = ref.Tree.from_parents(np.array(p), np.zeros(len(p), dtype=np.int64))
        parents[b, :len(p)], depths[b, :len(p)] = tree.parents, tree.depths
        compiled = ref.compile_tree(tree, starts[b])
        want_positions[b, :len(p)] = compiled.positions
    poison_cuda_allocator()
    positions, bits, first_child, next_sibling = tree_ops.compile_trees(
        cuda(parents), cuda(depths), vec([len(p) - 1 for p in trees]), vec(starts))
    np.testing.assert_array_equal(positions.cpu().numpy(), want_positions)
    for b, p in enumerate(trees):
        compiled = ref.compile_tree(ref.Tree.from_parents(np.array(p), np.zeros(len(p), dtype=np.int64)), 0)
        visibility = np.eye(width, dtype=bool)
        visibility[:len(p), :len(p)] = compiled.visibility
        np.testing.assert_array_equal(bits[b].cpu().numpy().view(np.uint32), ref.pack_bits(visibility))
        np.testing.assert_array_equal(first_child[b, :len(p)].cpu().numpy(), compiled.first_child)
        np.testing.assert_array_equal(next_sibling[b, :len(p)].cpu().numpy(), compiled.next_sibling)
        assert (first_child[b, len(p):] == -1).all() and (next_sibling[b, len(p):] == -1).all()


@needs_gpu
@pytest.mark.parametrize("version, vocab", [(3, 3000), (4, 3000), (4, 20000)])
def test_ops_replay_in_a_cuda_graph(version: int, vocab: int) -> None:
    """Launches go on torch's current stream: captured once, replayed on new inputs, equal to eager
    (v4 at V = 20000: its workspace, split CTAs, merge and v3 fallback launches in the graph)."""
    logits = torch.randn(3, 5, vocab, device="cuda")
    budgets, roots, starts = vec([20, 0, 33]), vec([1, 2, 3]), vec([4, 5, 6])

    def stages():
        lp, ids = tree_ops.topk_logprobs(logits, 33, version)
        out = tree_ops.build_compiled_trees(lp, ids, budgets, roots, starts, 34)
        return [lp, ids, *out, *tree_ops.accept_greedy(out[1], out[2], out[0], out[2].roll(-1, 1), 6)]

    graph, captured = capture_graph(stages)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, stages()):
        assert torch.equal(got, want)


@needs_gpu
def test_empty_batch() -> None:
    empty = torch.empty(0, 3, 4, device="cuda")
    n, parents, *_ = tree_ops.build_trees(empty, empty.long(), vec([]), vec([]), 5)
    assert n.shape == (0,) and parents.shape == (0, 5)


# ----------------------------------------------------------------------------- top-k


def quantized_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """float32 multiples of 2^-10 (as the fixtures): lp values are equal or far apart, never near-tied."""
    return (np.round(2.0 * rng.standard_normal((rows, vocab)) * 1024) / 1024).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, k", [(1, 4), (7, 3), (1000, 64), (4099, 1024), (163840, 16), (163840, 512),
                                      (20000, 100), (163840, 1024)])
def test_topk_random(version: int, dtype: torch.dtype, vocab: int, k: int) -> None:
    """Ids equal to refgen's, log-probs within one ulp; V = 4099 takes the unvectorized path;
    6 rows: v4 splits each over CTAs (k <= 256), k = 1024 is beyond v4 (v3 serves it)."""
    rng = np.random.default_rng(vocab + k)
    logits = torch.from_numpy(quantized_logits(rng, 6, vocab)).to(dtype)
    want_lp, want_id = ref.topk_logprobs(logits.float().numpy(), k)
    poison_cuda_allocator()
    got_lp, got_id = tree_ops.topk_logprobs(logits.cuda().reshape(2, 3, vocab), k, version)
    assert got_lp.shape == (2, 3, min(k, vocab))
    np.testing.assert_array_equal(got_id.reshape(6, -1).cpu().numpy(), want_id)
    assert_within_ulp(got_lp.reshape(6, -1).cpu().numpy(), want_lp)


@needs_gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("pattern", ["zeros", "integers", "ascending", "descending", "masked"])
@pytest.mark.parametrize("k", [1, 64, 512, 1024])
def test_topk_ties_and_skew(version: int, pattern: str, k: int) -> None:
    """Massive exact ties (the refinement and tie paths), sorted rows, and -inf (masked) logits."""
    vocab = 163840
    rng = np.random.default_rng(k)
    logits = {
        "zeros": lambda: np.zeros((2, vocab), np.float32),
        "integers": lambda: rng.integers(0, 4, size=(2, vocab)).astype(np.float32),
        "ascending": lambda: np.tile(np.arange(vocab, dtype=np.float32) / 1024, (2, 1)),
        "descending": lambda: np.tile(-np.arange(vocab, dtype=np.float32) / 1024, (2, 1)),
        "masked": lambda: np.where(rng.random((2, vocab)) < 0.999, -np.inf, quantized_logits(rng, 2, vocab)),
    }[pattern]().astype(np.float32)
    want_lp, want_id = ref.topk_logprobs(logits, k)
    got_lp, got_id = tree_ops.topk_logprobs(cuda(logits), k, version)
    np.testing.assert_array_equal(got_id.cpu().numpy(), want_id)
    assert_within_ulp(got_lp.cpu().numpy(), want_lp)


def tie_below_the_bound(layout: str) -> np.ndarray:
    """-1e-30 and 0 are different logits with one float32 lp; rows where the bound comes from the
    0s and excludes the -1e-30s, which have the smaller ids and must win the tie (-5 elsewhere).
    "v3": v3's prefilter chunk holds both. "v4 row" (200 rows, one CTA each): 0 at the first
    element of threads 100..199's first vector, -1e-30 in threads 0..99's. "v4 split" (1 row of
    V = 8704 over 8 CTAs): both in the last CTA's first batch, the -1e-30s at its smaller ids."""
    if layout == "v3":
        logits = np.full((1, 20000), -5.0, dtype=np.float32)
        logits[0, :100], logits[0, 100:200] = -1e-30, 0.0
    elif layout == "v4 row":
        logits = np.full((200, 20000), -5.0, dtype=np.float32)
        logits[:, 4 * np.arange(100, 200)], logits[:, 4 * np.arange(100) + 1] = 0.0, -1e-30
    else:
        logits = np.full((1, 8704), -5.0, dtype=np.float32)
        logits[0, 4 * np.arange(960, 1024)], logits[0, 4 * np.arange(448, 512)] = 0.0, -1e-30
    return logits


@needs_gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", ["v3", "v4 row", "v4 split"])
def test_topk_lp_tie_below_the_bound(version: int, layout: str) -> None:
    logits = tie_below_the_bound(layout)
    want_lp, want_id = ref.topk_logprobs(logits, 64)
    assert (logits[0, want_id[0]] == np.float32(-1e-30)).all()
    got_lp, got_id = tree_ops.topk_logprobs(cuda(logits), 64, version)
    np.testing.assert_array_equal(got_id.cpu().numpy(), want_id)
    assert_within_ulp(got_lp.cpu().numpy(), want_lp)


@needs_gpu
@pytest.mark.parametrize("version", VERSIONS)
def test_topk_k_zero_and_no_rows(version: int) -> None:
    lp, ids = tree_ops.topk_logprobs(torch.randn(2, 3, 10, device="cuda"), 0, version)
    assert lp.shape == ids.shape == (2, 3, 0)
    lp, ids = tree_ops.topk_logprobs(torch.randn(4, 0, 10, device="cuda"), 5, version)
    assert lp.shape == ids.shape == (4, 0, 5)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, k", [(15, 64), (15, 16), (15, 100), (15, 256), (40, 64), (200, 64), (200, 512),
                                     (960, 64)])
def test_topk_v4_is_v3_bit_for_bit(dtype: torch.dtype, rows: int, k: int) -> None:
    """N(0, 4) logits at V = 163840, the benchmark's: v4 (split over 8, 4, 2 CTAs or one a row)
    gives v3's log-probs and ids exactly; both within one ulp of refgen on the first rows."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + k)
    logits = (2 * torch.randn(rows, 163840, device="cuda", generator=gen)).to(dtype)
    poison_cuda_allocator()
    v3, v4 = tree_ops.topk_logprobs(logits, k, 3), tree_ops.topk_logprobs(logits, k, 4)
    assert torch.equal(v4[1], v3[1]) and torch.equal(v4[0], v3[0])
    want_lp, want_id = ref.topk_logprobs(logits[:3].float().cpu().numpy(), k)
    np.testing.assert_array_equal(v4[1][:3].cpu().numpy(), want_id)
    assert_within_ulp(v4[0][:3].cpu().numpy(), want_lp)


@needs_gpu
def test_topk_v4_mixed_rows_in_one_launch() -> None:
    """Rows v4 finishes and rows it hands to v3 (all-equal, sorted, masked) in one launch."""
    rng = np.random.default_rng(4)
    logits = quantized_logits(rng, 8, 163840)
    logits[1] = 0.0
    logits[3] = np.arange(163840, dtype=np.float32) / 1024
    logits[5] = np.where(rng.random(163840) < 0.999, -np.inf, logits[5])
    for k in (64, 512):
        want_lp, want_id = ref.topk_logprobs(logits, k)
        for rows in (slice(0, 8), slice(0, 3)):
            got_lp, got_id = tree_ops.topk_logprobs(cuda(logits[rows]), k, 4)
            np.testing.assert_array_equal(got_id.cpu().numpy(), want_id[rows])
            assert_within_ulp(got_lp.cpu().numpy(), want_lp[rows])


@needs_gpu
def test_logits_to_tree_matches_refgen() -> None:
    """The whole GPU path (top-k op, then build + compile) against refgen on quantized logits."""
    rng = np.random.default_rng(5)
    logits = quantized_logits(rng, 3 * 15, 5000).reshape(3, 15, 5000)
    budgets, roots, starts = [64, 16, 200], [1, 2, 3], [10, 20, 30]
    topk_lp, topk_id = tree_ops.topk_logprobs(cuda(logits), max(budgets))
    want = [ref.topk_logprobs(logits[b], max(budgets)) for b in range(3)]
    np.testing.assert_array_equal(topk_id.cpu().numpy(), np.stack([w[1] for w in want]))
    lp = topk_lp.cpu().numpy()
    assert_same(run_build(lp, topk_id.cpu().numpy(), budgets, roots, starts, 201),
                expected_batch(lp, np.stack([w[1] for w in want]), budgets, roots, starts, 201))


# ----------------------------------------------------------------------------- accept and compaction


def golden_accept_batch(open_golden):
    """Every accept_compact case as one ragged batch -> (f, cases, parents, tokens, choices, n) padded to width."""
    f = open_golden("kernels/accept_compact.kdtr")
    cases = f.metadata["cases"]
    width = max(c["nodes"] for c in cases)
    parents = np.full((len(cases), width), -1, dtype=np.int64)
    tokens, choices = parents.copy(), parents.copy()
    for b, case in enumerate(cases):
        prefix, size = f"cases/{case['name']}/", case["nodes"]
        parents[b, :size], tokens[b, :size], choices[b, :size] = (f[prefix + x] for x in ("parents", "tokens", "choices"))
    n = np.array([c["nodes"] - 1 for c in cases], dtype=np.int64)
    return f, cases, parents, tokens, choices, n


@needs_gpu
def test_accept_golden_cases(open_golden) -> None:
    f, cases, parents, tokens, choices, n = golden_accept_batch(open_golden)
    cols = parents.shape[1]
    poison_cuda_allocator()
    accepted, accept_len, next_root = tree_ops.accept_greedy(cuda(parents), cuda(tokens), cuda(n), cuda(choices), cols)
    for b, case in enumerate(cases):
        want = f[f"cases/{case['name']}/accepted"]
        assert accept_len[b].item() == len(want), case["name"]
        np.testing.assert_array_equal(accepted[b, :len(want)].cpu().numpy(), want, err_msg=case["name"])
        assert (accepted[b, len(want):] == -1).all(), case["name"]
        assert next_root[b].item() == int(f[f"cases/{case['name']}/next_root"]), case["name"]


@needs_gpu
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 6))
def test_accept_random_walks(seed: int, batch: int) -> None:
    """Trees built by refgen, choices that follow a random path (or stray), vs ref.accept."""
    rng = np.random.default_rng(seed)
    topk_lp, topk_id = random_topk(rng, batch, 6, 5, vocab=9)
    budgets = rng.integers(0, 60, size=batch).tolist()
    width = max(budgets) + 1
    trees = expected_batch(topk_lp, topk_id, budgets, [0] * batch, [0] * batch, width)
    choices = rng.integers(0, 9, size=(batch, width))
    for b in range(batch):                                  # follow the tree most of the way down
        node = 0
        while (kids := np.flatnonzero(trees["parents"][b] == node)).size and rng.random() < 0.85:
            node_next = int(rng.choice(kids))
            choices[b, node] = trees["tokens"][b, node_next]
            node = node_next
    accepted, accept_len, next_root = tree_ops.accept_greedy(
        cuda(trees["parents"]), cuda(trees["tokens"]), cuda(trees["n"]), cuda(choices), 7)
    for b in range(batch):
        size = trees["n"][b] + 1
        tree = ref.Tree.from_parents(trees["parents"][b, :size], trees["tokens"][b, :size])
        want, want_root = ref.accept(tree, choices[b, :size])
        assert accept_len[b].item() == len(want)
        np.testing.assert_array_equal(accepted[b, :len(want)].cpu().numpy(), want)
        assert next_root[b].item() == want_root


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_golden_cases(dtype: torch.dtype, open_golden) -> None:
    """All layers and requests in one launch; each (layer, request) slice holds different data."""
    f, cases, *_ = golden_accept_batch(open_golden)
    by_dims: dict[tuple[int, int], list[dict]] = {}
    for case in cases:
        by_dims.setdefault(f[f"cases/{case['name']}/c_kv"].shape[1:] + f[f"cases/{case['name']}/k_pe"].shape[1:],
                           []).append(case)
    layers, rng = 3, np.random.default_rng(0)
    for group in by_dims.values():
        slots = max(f[f"cases/{c['name']}/c_kv"].shape[0] for c in group)
        accepted = [f[f"cases/{c['name']}/accepted"] for c in group]
        paths = np.full((len(group), max(map(len, accepted))), -1, dtype=np.int64)
        for b, a in enumerate(accepted):
            paths[b, :len(a)] = a
        caches = []
        for name in ("c_kv", "k_pe"):
            dim = f[f"cases/{group[0]['name']}/{name}"].shape[1]
            data = rng.standard_normal((layers, len(group), slots, dim)).astype(np.float32)
            data = torch.from_numpy(data).to(dtype)
            for b, c in enumerate(group):                  # layer 0 carries the fixture's own rows
                rows = np.array(f[f"cases/{c['name']}/{name}"])
                data[0, b, :len(rows)] = torch.from_numpy(rows).to(dtype)
            caches.append(data)
        want = [c.clone() for c in caches]
        for cache in want:
            for layer in range(layers):
                for b, c in enumerate(group):
                    ref.compact(cache[layer, b].view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy(),
                                c["start"], accepted[b])
        got = [c.cuda() for c in caches]
        tree_ops.compact_kv(got[0], got[1], vec([c["start"] for c in group]), cuda(paths),
                            vec([len(a) for a in accepted]))
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)
        for b, c in enumerate(group):                      # the fixture's expected rows, layer 0
            for name, g in zip(("c_kv", "k_pe"), got):
                after = torch.from_numpy(np.array(f[f"cases/{c['name']}/{name}_after"])).to(dtype)
                assert torch.equal(g[0, b, :len(after)].cpu(), after), (c["name"], name)


# ----------------------------------------------------------------------------- CudaStages against TorchStages


@needs_gpu
def test_cuda_stages_match_torch_stages() -> None:
    from engine.cache import KVCache
    from engine.cuda_stages import CudaStages
    from engine.stages import TorchStages, TreeBatch
    from kdtr_format import PRESETS

    rng = np.random.default_rng(11)
    logits = cuda(quantized_logits(rng, 4 * 15, 3000).reshape(4, 15, 3000))
    budgets, roots, starts = vec([64, 0, 16, 200]), vec([1, 2, 3, 4]), vec([5, 9, 0, 40])
    cuda_stages, torch_stages = CudaStages(), TorchStages()
    lp, ids = cuda_stages.topk_logprobs(logits, 200)
    lp_t, ids_t = torch_stages.topk_logprobs(logits, 200)
    assert torch.equal(ids, ids_t)
    trees, trees_t = cuda_stages.build_trees(lp, ids, budgets, roots), torch_stages.build_trees(lp, ids, budgets, roots)
    for name in ("n", "parents", "tokens", "depths", "scores"):
        assert torch.equal(getattr(trees, name), getattr(trees_t, name)), name
    # TorchStages compiles on the CPU here: on CUDA its scatter_reduce_("amin") gave first_child 0
    # for leaves (torch 2.11, H200), where the contract and refgen say -1.
    compiled = cuda_stages.compile_trees(trees, starts)
    cpu_trees = TreeBatch(**{name: getattr(trees, name).cpu() for name in ("n", "parents", "tokens", "depths",
                                                                          "scores")}, depth=trees.depth)
    compiled_t = torch_stages.compile_trees(cpu_trees, starts.cpu())
    for name in ("positions", "visibility", "visibility_bits", "first_child", "next_sibling"):
        assert torch.equal(getattr(compiled, name).cpu(), getattr(compiled_t, name)), name
    choices = torch.where(torch.rand(trees.tokens.shape, device="cuda") < 0.5, trees.tokens.roll(-1, 1), 3)
    got, want = cuda_stages.accept(trees, choices), torch_stages.accept(trees, choices)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    cfg = PRESETS["tiny"]
    cache = KVCache.allocate(cfg, 4, 400, device="cuda")
    cache.c_kv.normal_()
    cache.k_pe.normal_()
    twin = KVCache(cache.c_kv.clone(), cache.k_pe.clone(), cache.lengths.clone())
    cuda_stages.compact_kv(cache, starts, got[0], got[1])
    torch_stages.compact_kv(twin, starts, want[0], want[1])
    assert torch.equal(cache.c_kv, twin.c_kv) and torch.equal(cache.k_pe, twin.k_pe)


# ----------------------------------------------------------------------------- argument errors (CPU)


def test_errors_name_the_problem() -> None:
    lp, ids = torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits: expected a CUDA tensor"):
        tree_ops.topk_logprobs(torch.zeros(2, 3, 5), 3)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        tree_ops.topk_logprobs(torch.zeros(2, 5, dtype=torch.float64), 3)
    with pytest.raises(ValueError, match="logits: must be contiguous"):
        tree_ops.topk_logprobs(torch.zeros(5, 4).t(), 3)
    with pytest.raises(ValueError, match="topk_lp: expected a CUDA tensor"):
        tree_ops.build_trees(lp, ids, one, one, 4)
    with pytest.raises(ValueError, match="topk_lp: expected dtype"):
        tree_ops.build_trees(lp.double(), ids, one, one, 4)
    with pytest.raises(ValueError, match="topk_lp: expected 3 dims"):
        tree_ops.build_trees(lp[0], ids, one, one, 4)
    with pytest.raises(ValueError, match="parents: must be contiguous"):
        tree_ops.compile_trees(ids[0].t(), ids[0], one, one)
    with pytest.raises(ValueError, match="parents: expected dtype"):
        tree_ops.accept_greedy(ids[0].int(), ids[0], one, ids[0], 3)
    with pytest.raises(ValueError, match="c_kv: expected dtype"):
        tree_ops.compact_kv(torch.zeros(1, 1, 4, 2, dtype=torch.int32), torch.zeros(1, 1, 4, 2), one, ids[0], one)


@needs_gpu
def test_shape_errors_on_gpu() -> None:
    lp = torch.zeros(2, 3, 4, device="cuda")
    ids = torch.zeros(2, 3, 4, dtype=torch.int64, device="cuda")
    two = vec([1, 2])
    with pytest.raises(ValueError, match="topk_id: shape"):
        tree_ops.build_trees(lp, ids[:, :2].contiguous(), two, two, 4)
    with pytest.raises(ValueError, match="budgets: expected shape"):
        tree_ops.build_trees(lp, ids, vec([1]), two, 4)
    with pytest.raises(ValueError, match="width: expected an integer in"):
        tree_ops.build_trees(lp, ids, two, two, 5000)
    with pytest.raises(ValueError, match="at most 32 depths"):
        tree_ops.build_trees(torch.zeros(1, 33, 2, device="cuda"), torch.zeros(1, 33, 2, dtype=torch.int64,
                                                                                device="cuda"), vec([1]), vec([1]), 4)
    with pytest.raises(ValueError, match="k_pe: leading dims"):
        tree_ops.compact_kv(torch.zeros(1, 2, 4, 8, device="cuda"), torch.zeros(1, 2, 5, 8, device="cuda"),
                            two, torch.zeros(2, 1, dtype=torch.int64, device="cuda"), two)


def test_cuda_stages_host_side_helpers() -> None:
    """CudaStages' host-side pieces: the node cap, the bit unpacking, the budget check (CPU)."""
    from engine.cuda_stages import CudaStages, _possible_nodes, unpack_visibility

    assert [_possible_nodes(3, 2, 100), _possible_nodes(15, 64, 64), _possible_nodes(0, 5, 10)] == [14, 64, 0]
    rows = np.array([[0b101, 0], [0, 1 << 31]], dtype=np.uint32)
    want = np.zeros((2, 64), dtype=bool)
    want[0, [0, 2]] = want[1, 63] = True
    np.testing.assert_array_equal(unpack_visibility(torch.from_numpy(rows.view(np.int32)), 64).numpy(), want)
    with pytest.raises(ValueError, match="budgets: must be >= 0"):
        CudaStages().build_trees(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64), torch.tensor([-1]),
                                 torch.tensor([0]))
