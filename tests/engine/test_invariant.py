"""Invariant mode (`Transformer(..., invariant=True)`): a token's logits are bitwise the same
whatever the number of rows in its forward and whatever else is in the batch, so DDTree greedy
equals AR greedy bit for bit, margins included (docs/precision.md, section 3).

- Property-based (hypothesis): random requests, each cut into random prefill chunks and run
  in lockstep with random companions, against each request alone one token per forward.
- A verified tree's every node against AR decoding of that node's path.
- ar_decode == ddtree_decode, tokens and margins, in float32 and bf16.
- The CUDA variants of the first two, with the tiled forward and with the fused layers'
  invariant form (skipped without a GPU), and the verify-attention
  kernel's invariant plan: one query row's output bitwise across tree sizes, batches and the
  AR layout of its keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.decode import ar_decode, ddtree_decode
from engine.drafters import OracleDrafter
from engine.model import Transformer
from kdtr_format import DDTreeConfig
from refgen import ddtree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="CUDA variant: no CUDA GPU is visible (torch.cuda.is_available() is False)")
# (device, forward): the tiled forward everywhere; the fused layers' invariant form on a GPU (on the
# CPU it runs in Triton's interpreter, too slow for these properties: tests/engine/test_fused.py)
FORWARDS = [("cpu", "tiled"), pytest.param("cuda", "tiled", marks=CUDA), pytest.param("cuda", "fused", marks=CUDA)]
HYPOTHESIS = settings(max_examples=6, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def engines(model_zoo):
    """-> get(preset, dtype name, device, forward): the invariant Transformer, built once (with the
    CUDA attention kernel's invariant form when kernels_cuda loads); forward "fused": the fused
    layers' invariant form."""
    built = {}

    def get(preset: str, dtype: str, device: str, forward: str = "tiled") -> Transformer:
        if (preset, dtype, device, forward) not in built:
            case = model_zoo.get(preset)
            attention = None
            if device == "cuda":
                from engine.adapter import cuda_backends
                attention = cuda_backends()[1]
            built[preset, dtype, device, forward] = Transformer(
                case.cfg, case.weights, device=device, dtype=DTYPES[dtype], attention=attention, invariant=True,
                fused=forward == "fused")
        return built[preset, dtype, device, forward]
    return get


def lockstep(engine: Transformer, requests: list[list[list[int]]], garbage: np.random.Generator) -> list[torch.Tensor]:
    """requests[r]: request r's prompt cut into chunks. Round t runs every request's chunk t
    (n_new 0 once its chunks are done) in one causal forward; padding holds garbage.
    -> per request, its tokens' logits [m_r, V] in order."""
    batch, device = len(requests), engine.device
    total = [sum(len(c) for c in chunks) for chunks in requests]
    cache = engine.new_cache(batch, max(total) + 1)
    starts = [0] * batch
    out: list[list[torch.Tensor]] = [[] for _ in requests]
    for t in range(max(len(chunks) for chunks in requests)):
        chunks = [chunks[t] if t < len(chunks) else [] for chunks in requests]
        width = max(1, max(len(c) for c in chunks))
        tokens = torch.tensor(garbage.integers(0, engine.cfg.vocab_size, (batch, width)))
        positions = torch.tensor(garbage.integers(0, 100, (batch, width)))
        visibility = torch.tensor(garbage.random((batch, width, width)) < 0.5)
        for b, c in enumerate(chunks):
            n = len(c)
            tokens[b, :n] = torch.tensor(c, dtype=torch.int64)
            positions[b, :n] = starts[b] + torch.arange(n)
            visibility[b, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        logits = engine.forward(tokens.to(device), positions.to(device), visibility.to(device),
                                torch.tensor([len(c) for c in chunks], device=device),
                                torch.tensor(starts, device=device), cache)
        for b, c in enumerate(chunks):
            out[b].append(logits[b, :len(c)].cpu())
            starts[b] += len(c)
    return [torch.cat(parts) for parts in out]


@st.composite
def chunked_requests(draw, vocab: int) -> list[list[list[int]]]:
    """1 to 3 requests of 1 to 14 tokens, each cut into random consecutive chunks."""
    requests = []
    for _ in range(draw(st.integers(1, 3))):
        tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=14))
        cuts = sorted(draw(st.sets(st.integers(1, len(tokens)), max_size=4)) | {len(tokens)})
        requests.append([tokens[a:b] for a, b in zip([0] + cuts[:-1], cuts)])
    return requests


@pytest.mark.parametrize("device, forward", FORWARDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
@HYPOTHESIS
@given(data=st.data())
def test_logits_bitwise_whatever_the_rows_and_the_batch(engines, preset, dtype, device, forward, data):
    engine = engines(preset, dtype, device, forward)
    requests = data.draw(chunked_requests(engine.cfg.vocab_size))
    together = lockstep(engine, requests, np.random.default_rng(0))
    for r, chunks in enumerate(requests):
        tokens = [t for c in chunks for t in c]
        (alone,) = lockstep(engine, [[[t] for t in tokens]], np.random.default_rng(1))
        assert torch.equal(together[r], alone), f"request {r} of {requests}: logits differ from one token at a time"


def random_tree(rng: np.random.Generator, vocab: int, start: int, budget: int, depth: int):
    """A best-first tree from random draft logits (refgen) -> (tree, compiled)."""
    topk_lp, topk_id = ddtree.topk_logprobs(rng.normal(size=(depth, vocab)) * 3, 4)
    tree = ddtree.build_tree(topk_lp, topk_id, budget).with_root(int(rng.integers(vocab)))
    return tree, ddtree.compile_tree(tree, start)


def causal_forward(engine: Transformer, cache, tokens: list[int], start: int) -> torch.Tensor:
    n, device = len(tokens), engine.device
    return engine.forward(torch.tensor([tokens], device=device), (start + torch.arange(n, device=device))[None],
                          torch.ones(1, n, n, dtype=torch.bool, device=device).tril(), torch.tensor([n], device=device),
                          torch.tensor([start], device=device), cache)[0].cpu()


def clone_cache(cache):
    return type(cache)(c_kv=cache.c_kv.clone(), k_pe=cache.k_pe.clone(), lengths=cache.lengths.clone())


@pytest.mark.parametrize("device, forward", FORWARDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@HYPOTHESIS
@given(seed=st.integers(0, 2**31 - 1), prompt=st.integers(1, 12), budget=st.integers(1, 12),
       depth=st.integers(1, 5))
def test_tree_verify_rows_equal_ar_decode_of_their_paths(engines, dtype, device, forward, seed, prompt, budget,
                                                         depth):
    """Each node of a verified tree (its ancestors at scattered slots, siblings beside it) gets
    the logits of AR decoding its path one token at a time after the prompt."""
    engine = engines("tiny", dtype, device, forward)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, engine.cfg.vocab_size, prompt).tolist()
    cache = engine.new_cache(1, prompt + budget + depth + 2)
    causal_forward(engine, cache, tokens, 0)
    after_prompt = clone_cache(cache)
    tree, compiled = random_tree(rng, engine.cfg.vocab_size, prompt, budget, depth)
    n, dev = len(tree.tokens), engine.device
    put = lambda a: torch.tensor(a, device=dev)[None]  # noqa: E731
    verified = engine.forward(put(tree.tokens), put(compiled.positions), put(compiled.visibility),
                              torch.tensor([n], device=dev), torch.tensor([prompt], device=dev), cache)[0].cpu()
    for node in range(n):
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(int(tree.parents[path[-1]]))
        ar_cache = clone_cache(after_prompt)
        for d, i in enumerate(reversed(path)):
            logits = causal_forward(engine, ar_cache, [int(tree.tokens[i])], prompt + d)
        assert torch.equal(logits[0], verified[node]), f"node {node} (path {path[::-1]}) differs from AR"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ddtree_greedy_equals_ar_bit_for_bit(engines, dtype):
    """Tokens and every decision's top-1/top-2 margin identical: the same logits bits."""
    engine = engines("tiny", dtype, "cpu")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, engine.cfg.vocab_size, m).tolist() for m in (3, 9)]
    ar = ar_decode(engine, prompts, 14)
    drafter = OracleDrafter([p + r.tokens for p, r in zip(prompts, ar.requests)], engine.cfg.vocab_size,
                            accuracy=0.6, seed=4)
    dd = ddtree_decode(engine, drafter, prompts, DDTreeConfig(block_size=5, budget=8), 14)
    assert dd.tokens == ar.tokens
    assert [r.margins for r in dd.requests] == [r.margins for r in ar.requests]
    assert dd.metrics.rounds < ar.metrics.rounds                 # the trees did accept tokens


# ---- the verify-attention kernel's invariant plan (GPU) ----

@CUDA
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mla_invariant_plan_row_bitwise_across_tree_sizes_and_layouts(dtype):
    """Kimi K2 dims. One query row (node 5 of a tree, ancestors 0, 2, 5) at context 318, so that
    its 321-key list splits (64 keys a split) between node 2 and node 5, at list position 320 but
    slot 323: (a) in a tree of 6 nodes, (b) in the same tree grown to 40 nodes beside another
    request of 900 keys, (c) in the AR layout (its keys contiguous after the context, tree of
    one) give bitwise the same o_lat and lse under the invariant plan."""
    from kernels_cuda import available
    ok, why = available()
    if not ok:
        pytest.skip(f"kernels_cuda does not load: {why}")
    from kernels_cuda.mla_ops import mla_verify, pack_visibility

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, rank, rope, context, scale = 64, 512, 64, 318, 0.07
    dt = DTYPES[dtype]
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(dt)  # noqa: E731
    q_lat, q_pe = rand(1, heads, rank), rand(1, heads, rope)
    keys_c, keys_k = rand(context + 40, rank), rand(context + 40, rope)       # context, then tree slots
    row, ancestors = 5, [0, 2, 5]                                             # node 5's path: root, 2, itself

    def run(tree: int, other: int, c_rows, k_rows, visible_row, row_index) -> tuple[torch.Tensor, torch.Tensor]:
        """Request 0: `tree` queries (query `row_index` is ours) over c_rows; request 1: `other` queries."""
        sizes = [tree] + ([other] if other else [])
        total = sum(sizes)
        ql, qp = rand(total, heads, rank), rand(total, heads, rope)
        ql[row_index], qp[row_index] = q_lat[0], q_pe[0]
        vis = torch.eye(max(sizes), dtype=torch.bool, device="cuda")[None].repeat(len(sizes), 1, 1)
        vis[0, row_index, :len(visible_row)] = torch.tensor(visible_row, device="cuda")
        bits = torch.cat([pack_visibility(vis[b, :n]) for b, n in enumerate(sizes)])
        other_c, other_k = rand(900 + other, rank), rand(900 + other, rope)
        c = torch.cat([c_rows, other_c]) if other else c_rows
        k = torch.cat([k_rows, other_k]) if other else k_rows
        ctx = torch.tensor([context] + ([900] if other else []), device="cuda")
        offsets = torch.tensor([0] + ([tree] if other else []) + [total], device="cuda")
        kv_offsets = torch.tensor([0] + ([len(c_rows)] if other else []), device="cuda")
        o, lse = mla_verify(ql, qp, c, k, ctx, torch.tensor(sizes, device="cuda"), offsets, kv_offsets, bits, scale,
                            invariant=True)
        return o[row_index].clone(), lse[row_index].clone()

    seen = [j in ancestors for j in range(6)]
    small = run(6, 0, keys_c[:context + 6], keys_k[:context + 6], seen, row)
    grown = run(40, 25, keys_c, keys_k, seen + [False] * 34, row)
    path = torch.tensor(list(range(context)) + [context + a for a in ancestors], device="cuda")
    ar_c, ar_k = keys_c[path], keys_k[path]                   # the same keys, contiguous, in the same order
    # AR decoding node 5: the prompt, the root and node 2 are cached (context + 2), node 5 is the new token
    index = lambda *v: torch.tensor(v, device="cuda")  # noqa: E731
    ar = mla_verify(q_lat, q_pe, ar_c, ar_k, index(context + 2), index(1), index(0, 1), index(0),
                    pack_visibility(torch.ones(1, 1, dtype=torch.bool, device="cuda")), scale, invariant=True)
    for name, (o, lse) in (("tree of 40 beside another request", grown), ("AR layout", (ar[0][0], ar[1][0]))):
        assert torch.equal(o, small[0]) and torch.equal(lse, small[1]), f"{name}: differs from the tree of 6"


# ---- the CLIs' --invariant ----

def test_demo_invariant_runs_bitwise_invariant(capsys, monkeypatch):
    """`kdtree demo --invariant`: the engine in invariant mode, every DDTree run's tokens equal
    AR's (exit 0); `validate --invariant` refuses an adapter (the mode is the built-in engine's)."""
    import engine.adapter
    from engine.adapter import TorchAdapter
    from engine.cli import main

    made = []
    monkeypatch.setattr(engine.adapter, "TorchAdapter", lambda *a, **k: made.append(TorchAdapter(*a, **k)) or made[-1])

    threads = torch.get_num_threads()
    try:
        for args, code in ((["demo", "--invariant", "--max-new-tokens", "10", "--budget", "6", "--block-size", "4"], 0),
                           (["validate", "--invariant", "--impl", "docs/examples/numpy_adapter.py:NumpyAdapter"], 2)):
            with pytest.raises(SystemExit) as exit_info:
                main(args)
            assert exit_info.value.code == code
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert [a.model.invariant for a in made] == [True]
    assert out.count("yes") == 3 and "NO" not in out
    assert "--invariant is a mode of the built-in engine" in err
