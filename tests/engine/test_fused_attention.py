"""The batch-invariant tensor-core attention (engine/fused/attention.py) against the torch
reference, and the invariance it promises: a query row's output bitwise a function of its key
list, whatever tree, batch, cache size (number of splits) or cache layout surrounds it.

On a GPU the kernels are compiled; without one they run in Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the invariant attention is a Triton kernel; Triton is not installed")

from engine.attention import torch_attention  # noqa: E402
from engine.fused.attention import BLOCK_KEYS, InvariantAttention, key_lists  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, RANK, ROPE = 3, 24, 8          # fewer heads than a tile and widths that are not powers of two


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def tree_visibility(parents: list[int]) -> torch.Tensor:
    """parents[j] < j (or -1: a root) -> [N, N] bool: j sees itself and its ancestors."""
    n = len(parents)
    vis = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            vis[j] |= vis[p]
    return vis


def paged(cache: torch.Tensor, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [B, T, w] -> (pools [B T / page + 1, page, w]: its pages shuffled, one spare;
    table [B, T / page])."""
    batch, slots, width = cache.shape
    per = slots // page
    order = torch.randperm(batch * per + 1, generator=torch.Generator().manual_seed(seed))[:batch * per]
    pools = randn(batch * per + 1, page, width, dtype=cache.dtype, seed=seed)
    pools[order.to(DEVICE)] = cache.reshape(batch * per, page, width)
    return pools, order.view(batch, per).to(device=DEVICE, dtype=torch.int32)


def case(dtype: torch.dtype, slots: int = 100):
    """Two requests: request 0 a tree of 7 after 53 cached slots, request 1 a causal chunk of 4
    after 70 (rows 4.. are padding), over a cache of `slots` slots."""
    starts = torch.tensor([53, 70], device=DEVICE)
    n_new = torch.tensor([7, 4], device=DEVICE)
    vis = torch.zeros(2, 7, 7, dtype=torch.bool)
    vis[0] = tree_visibility([-1, 0, 0, 1, 2, 2, 4])
    vis[1, :4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    vis[1, 4:] = torch.rand(3, 7, generator=torch.Generator().manual_seed(5)) < 0.5    # padding rows: garbage
    q_lat, q_pe = randn(2, 7, HEADS, RANK, dtype=dtype), randn(2, 7, HEADS, ROPE, dtype=dtype, seed=1)
    c_kv, k_pe = randn(2, slots, RANK, dtype=dtype, seed=2), randn(2, slots, ROPE, dtype=dtype, seed=3)
    return q_lat, q_pe, c_kv, k_pe, starts, n_new, vis.to(DEVICE)


def test_key_lists_are_the_context_then_the_visible_new_tokens():
    starts, n_new = torch.tensor([5, 2]), torch.tensor([3, 1])
    vis = torch.zeros(2, 3, 3, dtype=torch.bool)
    vis[0] = tree_visibility([-1, 0, 0])
    vis[1] = True                                       # request 1: token 0 only is real
    new_index, length = key_lists(starts, n_new, vis)
    assert length.tolist() == [6, 7, 7, 3, 0, 0]
    assert new_index[1, :2].tolist() == [0, 1] and new_index[2, :2].tolist() == [0, 2]
    assert new_index[3, :1].tolist() == [0]             # j >= n_new is never in a list


@pytest.mark.parametrize("dtype, split_keys, layout", [
    (torch.float32, 512, "contiguous"), (torch.float32, BLOCK_KEYS, "paged"),     # one split; four
    (torch.bfloat16, BLOCK_KEYS, "contiguous"), (torch.bfloat16, 512, "paged")])
def test_matches_the_torch_reference(dtype, split_keys, layout):
    q_lat, q_pe, c_kv, k_pe, starts, n_new, vis = case(dtype, slots=120)
    expected = torch_attention(q_lat.double(), q_pe.double(), c_kv.double(), k_pe.double(), starts, n_new, vis, 0.3)
    attention = InvariantAttention(split_keys)
    if layout == "paged":
        (c_pool, table), (k_pool, _) = paged(c_kv, 8, seed=7), paged(k_pe, 8, seed=7)
        out = attention.bind_paged(starts, n_new, vis, table)(q_lat, q_pe, c_pool, k_pool, 0.3)
    else:
        out = attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, vis, 0.3)
    assert out.dtype == dtype and out.shape == q_lat.shape
    assert torch.equal(out[1, 4:], torch.zeros_like(out[1, 4:])), "padding rows are not 0"
    # float32: a few units of rounding over sums of ~60 terms; bf16: P rounded to bf16 (as the
    # default-mode kernel does) and the output rounded once
    tolerance = 2e-5 if dtype == torch.float32 else 2 ** -7
    error = float((out.double() - expected).abs().max())
    assert error <= tolerance * float(expected.abs().max()), f"max error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_bits_of_its_key_list_alone(dtype):
    """Node 6 of request 0's tree (ancestors 0, 2, 4) against: the same tree over a larger cache
    (more splits), paged, the row in a bigger tree beside other requests, and the AR layout
    (context and ancestors contiguous, node 6 the only new token)."""
    attention = InvariantAttention(BLOCK_KEYS)
    q_lat, q_pe, c_kv, k_pe, starts, n_new, vis = case(dtype)
    alone = attention(q_lat, q_pe, c_kv, k_pe, starts, n_new, vis, 0.3)[0, 6]

    big_c, big_k = randn(2, 160, RANK, dtype=dtype, seed=8), randn(2, 160, ROPE, dtype=dtype, seed=9)
    big_c[:, :100], big_k[:, :100] = c_kv, k_pe
    assert torch.equal(attention(q_lat, q_pe, big_c, big_k, starts, n_new, vis, 0.3)[0, 6], alone), \
        "a larger cache (more splits) changes the row"

    (c_pool, table), (k_pool, _) = paged(c_kv, 4, seed=3), paged(k_pe, 4, seed=3)
    assert torch.equal(attention.bind_paged(starts, n_new, vis, table)(q_lat, q_pe, c_pool, k_pool, 0.3)[0, 6],
                       alone), "the paged layout changes the row"

    # a tree of 20 whose node 15 has the path 0, 2, 12, 15 holding node 6's keys (0, 2, 4, 6),
    # beside a chunk of 4 and a causal chunk of 20
    parents = [-1, 0, 0, 1, 2, 2, 4, 3, 0, 8, 1, 9, 2, 12, 12, 12, 5, 6, 6, 16]
    grown_vis = torch.zeros(3, 20, 20, dtype=torch.bool)
    grown_vis[0] = tree_visibility(parents)
    grown_vis[1, :4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    grown_vis[2] = torch.ones(20, 20, dtype=torch.bool).tril()
    gq, gp = randn(3, 20, HEADS, RANK, dtype=dtype, seed=11), randn(3, 20, HEADS, ROPE, dtype=dtype, seed=12)
    gc, gk = randn(3, 100, RANK, dtype=dtype, seed=13), randn(3, 100, ROPE, dtype=dtype, seed=14)
    gq[0, 15], gp[0, 15] = q_lat[0, 6], q_pe[0, 6]
    gc[0, :53], gk[0, :53] = c_kv[0, :53], k_pe[0, :53]
    for ours, theirs in ((0, 0), (2, 2), (12, 4), (15, 6)):
        gc[0, 53 + ours], gk[0, 53 + ours] = c_kv[0, 53 + theirs], k_pe[0, 53 + theirs]
    grown = attention(gq, gp, gc, gk, torch.tensor([53, 70, 40], device=DEVICE),
                      torch.tensor([20, 4, 20], device=DEVICE), grown_vis.to(DEVICE), 0.3)
    assert torch.equal(grown[0, 15], alone), "the row in a tree of 20 beside two other requests differs"

    path = [0, 2, 4, 6]                                  # AR: context and path cached, node 6 new
    ar_c = torch.cat([c_kv[0, :53], c_kv[0, [53 + j for j in path]]])[None]
    ar_k = torch.cat([k_pe[0, :53], k_pe[0, [53 + j for j in path]]])[None]
    ar = attention(q_lat[:1, 6:7], q_pe[:1, 6:7], ar_c, ar_k, torch.tensor([56], device=DEVICE),
                   torch.tensor([1], device=DEVICE), torch.ones(1, 1, 1, dtype=torch.bool, device=DEVICE), 0.3)
    assert torch.equal(ar[0, 0], alone), "the AR layout of the same keys changes the row"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_list_within_the_first_split_is_written_there_and_a_longer_one_combined(dtype):
    """split_keys 64 over a cache of 100 slots (two splits): request 0's tree after 61 cached slots
    has rows of 62-64 keys, which the first split finishes (the bits of a one-split call), and
    node 6 with 65, which spans both (the combine: the reference's value)."""
    q_lat, q_pe, c_kv, k_pe, _, n_new, vis = case(dtype)
    starts = torch.tensor([61, 70], device=DEVICE)
    lengths = key_lists(starts, n_new, vis)[1].view(2, 7)[0].tolist()
    assert lengths == [62, 63, 63, 64, 64, 64, 65]
    split = InvariantAttention(64)(q_lat, q_pe, c_kv, k_pe, starts, n_new, vis, 0.3)
    whole = InvariantAttention(128)(q_lat, q_pe, c_kv, k_pe, starts, n_new, vis, 0.3)
    assert torch.equal(split[0, :6], whole[0, :6]), "a list within the first split is not that split's output"
    expected = torch_attention(q_lat.double(), q_pe.double(), c_kv.double(), k_pe.double(), starts, n_new, vis, 0.3)
    tolerance = 2e-5 if dtype == torch.float32 else 2 ** -7
    error = float((split[0, 6].double() - expected[0, 6]).abs().max())
    assert error <= tolerance * float(expected[0, 6].abs().max()), f"the combined row is off by {error:.3g}"
    assert torch.equal(split[1, 4:], torch.zeros_like(split[1, 4:])), "padding rows are not 0"


def test_split_keys_must_be_whole_blocks():
    with pytest.raises(ValueError, match="split_keys must be a positive multiple"):
        InvariantAttention(BLOCK_KEYS + 1)


def test_invariant_cuda_attention_binds_each_dtype_to_its_backend():
    """`CudaAttention().invariant_form()`: bf16 calls go to the tensor-core kernel, float32 calls to
    the CUDA-core plan, each bound once per forward with the forward's metadata."""
    pytest.importorskip("kernels_cuda.mla_ops", reason="engine.cuda_attention imports kernels_cuda.mla_ops")
    from engine.cuda_attention import CudaAttention, InvariantCudaAttention

    attention = CudaAttention().invariant_form()
    assert isinstance(attention, InvariantCudaAttention)
    assert isinstance(attention.by_dtype[torch.bfloat16], InvariantAttention)
    assert attention.by_dtype[torch.float32].invariant
    calls = []

    class Recording:
        def __init__(self, name):
            self.name = name

        def bind(self, *args, **options):
            calls.append((self.name, "bind", args, options))
            return lambda q_lat, *rest: calls.append((self.name, "call", q_lat.dtype)) or q_lat
    attention.by_dtype = {torch.bfloat16: Recording("tensor cores"), torch.float32: Recording("cuda cores")}
    attend = attention.bind("starts", "n_new", "visibility", 64, reuse_out=True)
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float32):
        attend(torch.zeros(1, dtype=dtype), None, None, None, 0.1)
    metadata = (("starts", "n_new", "visibility", 64), {"reuse_out": True})
    assert calls == [("tensor cores", "bind", *metadata), ("tensor cores", "call", torch.bfloat16),
                     ("tensor cores", "call", torch.bfloat16),
                     ("cuda cores", "bind", *metadata), ("cuda cores", "call", torch.float32)]
