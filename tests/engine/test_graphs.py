"""engine.graphs: CUDA graphs of the forward (bucketed widths), the AR step and the DDTree round.

On the GPU (skipped without one): a forward run under torch's sync debug mode "error" (any
host synchronization raises); replayed logits and the cache it writes bitwise equal to the
eager forward's, for decode (width 1) and tree verify (a bucket width), default and invariant
mode (the tiled forward and the fused layers' invariant form), float32 and bf16; decoding through a GraphedModel gives the eager run's tokens (and, in
invariant mode, its margins bit for bit; DDTree's too) and leaves the cache's lengths at the host's
count of cached tokens (the graphs advance them on the device). On the CPU: the bucket choice and the
refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.decode import ar_decode, ddtree_decode
from engine.drafters import OracleDrafter
from engine.graphs import BUCKETS, GraphedModel, bucket_width
from engine.model import Transformer
from kdtr_format import DDTreeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ["default", "invariant", "invariant-fused"]    # invariant: the tiled forward; -fused: the fused layers' form
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="CUDA variant: no CUDA GPU is visible (torch.cuda.is_available() is False)")


def test_buckets_cover_powers_of_two_and_one_more():
    assert bucket_width(1) == 1 and bucket_width(17) == 17 and bucket_width(18) == 32 and bucket_width(65) == 65
    assert bucket_width(66) == 128 and bucket_width(BUCKETS[-1]) == BUCKETS[-1]
    assert bucket_width(BUCKETS[-1] + 1) is None
    assert all(bucket_width(1 + 2**i) == 1 + 2**i for i in range(10))            # 1 + budget, budgets 2^i


def test_graphed_model_refuses_a_cpu_model(model_zoo):
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        GraphedModel(model_zoo.get("tiny").engine())


@pytest.fixture(scope="module")
def cuda_models(model_zoo):
    """-> get(preset, dtype, mode, page_size=None): (Transformer on CUDA with the kernels'
    attention, stages), its caches paged with a page size. mode: "default", "invariant" (the
    tiled forward) or "invariant-fused" (the fused layers' invariant form)."""
    from engine.adapter import cuda_backends

    stages, attention, notes = cuda_backends()
    if attention is None or stages is None:
        pytest.skip(f"kernels_cuda does not load: {notes}")
    built = {}

    def get(preset: str, dtype: str, mode: str, page_size: int | None = None):
        key = preset, dtype, mode, page_size
        if key not in built:
            case = model_zoo.get(preset)
            built[key] = Transformer(case.cfg, case.weights, device="cuda", dtype=DTYPES[dtype], attention=attention,
                                     invariant=mode != "default", fused={"invariant": False, "invariant-fused": True}.get(mode),
                                     page_size=page_size)
        return built[key], stages
    return get


def prefilled(model, batch: int, length: int, seed: int):
    """A cache of `batch` requests of different prompt lengths after an eager prefill -> (cache, starts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [length - 3 * b for b in range(batch)]
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, length), generator=g)
    cache = model.new_cache(batch, 128)
    causal = torch.ones(batch, length, length, dtype=torch.bool).tril()
    model.forward(tokens.cuda(), torch.arange(length).expand(batch, length).cuda(), causal.cuda(),
                  torch.tensor(lengths).cuda(), torch.zeros(batch, dtype=torch.int64).cuda(), cache)
    return cache, torch.tensor(lengths).cuda()


def tree_inputs(model, batch: int, width: int, starts: torch.Tensor, seed: int):
    """Random trees of up to `width` nodes (parents before children) as verify inputs."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, width)]
    depth = [0] * width
    visibility = torch.eye(width, dtype=torch.bool)
    for i in range(1, width):
        depth[i] = depth[parents[i]] + 1
        visibility[i] |= visibility[parents[i]]
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, width), generator=g).cuda()
    positions = starts[:, None] + torch.tensor(depth).cuda()[None]
    n_new = torch.tensor([width - 2 * b for b in range(batch)]).clamp(min=1).cuda()
    return tokens, positions, visibility.expand(batch, width, width).cuda(), n_new


@CUDA
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("preset", ["tiny", "kimi-k2"])
def test_forward_reads_nothing_back_to_the_host(cuda_models, preset, dtype, mode):
    model, _ = cuda_models(preset, dtype, mode)
    cache, starts = prefilled(model, 2, 12, seed=0)
    tokens, positions, visibility, n_new = tree_inputs(model, 2, 9, starts, seed=1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.forward(tokens, positions, visibility, n_new, starts, cache, check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@CUDA
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("preset", ["tiny", "kimi-k2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_logits_and_cache_bitwise_equal_to_eager(cuda_models, preset, dtype, mode, batch):
    """Decode (width 1) and verify (width 17, a bucket): the graph and the eager forward on
    the same inputs and copies of the same cache give the same bits, in the logits and the cache."""
    model, _ = cuda_models(preset, dtype, mode)
    graphed = GraphedModel(model)
    for width, seed in ((1, 2), (17, 3)):
        cache, starts = prefilled(model, batch, 12, seed=seed)
        before = clone_cache(cache)
        tokens, positions, visibility, n_new = tree_inputs(model, batch, width, starts, seed=seed + 10)
        eager_cache = clone_cache(before)
        eager = model.forward(tokens, positions, visibility, n_new, starts, eager_cache, check=False)
        real = torch.arange(width, device="cuda")[None] < n_new[:, None]
        for replay in range(2):                      # captured on the first call, replayed on both
            cache.c_kv.copy_(before.c_kv)
            cache.k_pe.copy_(before.k_pe)
            replayed = graphed.forward(tokens, positions, visibility, n_new, starts, cache, check=False)
            assert torch.equal(replayed[real], eager[real]), f"width {width}, call {replay}: logits differ"
            assert torch.equal(cache.c_kv, eager_cache.c_kv) and torch.equal(cache.k_pe, eager_cache.k_pe), \
                f"width {width}, call {replay}: the cache differs"


def graph_cache_lengths(graphed, kind: str) -> list[int]:
    """The lengths of the cache the (one) graph of `kind` ("ar" or "ddtree") advanced on the device."""
    return next(g for key, g in graphed._graphs.items() if key[0] == kind).cache.lengths.tolist()


def cached_tokens(prompts, result) -> list[int]:
    """Each request's cached tokens from the host's count: its prompt and every accepted token."""
    return [len(p) + sum(r.acceptance_lengths) for p, r in zip(prompts, result.requests)]


def clone_cache(cache):
    return type(cache)(c_kv=cache.c_kv.clone(), k_pe=cache.k_pe.clone(), lengths=cache.lengths.clone(),
                       block_table=cache.block_table)


@CUDA
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_graphed_decoding_matches_eager(cuda_models, dtype, mode, page_size):
    """AR through the step graph and DDTree through the round graphs: the eager AR tokens in
    float32 (margins within float32 rounding) and in invariant mode bit for bit, margins too;
    on a paged cache as on a contiguous one (the round graph compacts through the table)."""
    model, stages = cuda_models("tiny", dtype, mode, page_size)
    invariant = mode != "default"
    graphed = GraphedModel(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.cfg.vocab_size, m).tolist() for m in (4, 11, 7)]
    eager = ar_decode(model, prompts, 24, stages=stages)
    runs = {"AR graphs": ar_decode(graphed, prompts, 24, stages=stages)}
    assert graph_cache_lengths(graphed, "ar") == cached_tokens(prompts, runs["AR graphs"])
    truth = [p + r.tokens for p, r in zip(prompts, eager.requests)]
    drafter = OracleDrafter(truth, model.cfg.vocab_size, accuracy=0.7, seed=6, device="cuda")
    runs["DDTree graphs"] = ddtree_decode(graphed, drafter, prompts, DDTreeConfig(block_size=6, budget=16), 24,
                                          stages=stages)
    assert graph_cache_lengths(graphed, "ddtree") == cached_tokens(prompts, runs["DDTree graphs"])
    assert runs["DDTree graphs"].metrics.stage_seconds.get("host", 0.0) > 0        # the graphed round ran
    for name, result in runs.items():
        if invariant or dtype == "float32":
            assert result.tokens == eager.tokens, name
        if invariant:
            assert [r.margins for r in result.requests] == [r.margins for r in eager.requests], name
        elif dtype == "float32":
            np.testing.assert_allclose(np.concatenate([r.margins for r in result.requests]),
                                       np.concatenate([r.margins for r in eager.requests]), rtol=1e-4, atol=1e-4)
