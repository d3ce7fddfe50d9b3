"""The tree-verify MLA kernel (kernels_cuda.mla_ops) against float64 references.

Two references, FlashInfer-style beside the implementation: `reference_attention` (torch
float64, here, fast enough for 32k contexts on the GPU) and refgen's numpy oracle
`refgen.model.absorbed_attention`; a CPU test ties the two together. GPU tests skip
without a CUDA device; argument checks and the bit packing run on the CPU.

Errors are ||out - ref|| / ||ref|| per output, with the reference computed from the very
inputs the kernel saw (bf16 inputs upcast), so only the kernel's arithmetic is measured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kdtr_format import PRESETS
from kernels_cuda import build
from kernels_cuda.mla_ops import (HOPPER_KERNELS, MlaInputError, mla_verify, pack_visibility,
                                  plan_splits, tensor_core_kernel, uses_tensor_cores)
from refgen.model import absorbed_attention

DIMS = {name: (PRESETS[name].num_attention_heads, PRESETS[name].kv_lora_rank, PRESETS[name].qk_rope_head_dim)
        for name in ("tiny", "tiny2", "kimi-k2")}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")


# ----------------------------------------------------------------------------- references

def reference_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                        visibility: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64. q_lat [n, H, R], q_pe [n, H, dr], c_kv [S, R], k_pe [S, dr], visibility [n, S] bool
    -> o_lat [n, H, R], lse [n, H]; a row that sees no key gives o_lat 0 and lse -inf."""
    q_lat, q_pe, c_kv, k_pe = (t.double() for t in (q_lat, q_pe, c_kv, k_pe))
    scores = (torch.einsum("nhr,sr->nhs", q_lat, c_kv) + torch.einsum("nhd,sd->nhs", q_pe, k_pe)) * scale
    scores = scores.masked_fill(~visibility[:, None, :], -math.inf)         # [n, H, S]
    lse = torch.logsumexp(scores, dim=-1)                                    # [n, H]
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("nhs,sr->nhr", p, c_kv), lse


def tree_visibility(parents: list[int]) -> torch.Tensor:
    """parents[0] = -1 -> bool [n, n]: row i sees i and its ancestors."""
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@dataclass
class Case:
    """A ragged batch in the kernel's layout, plus each request's dense visibility."""

    q_lat: torch.Tensor        # [T, H, R]
    q_pe: torch.Tensor         # [T, H, dr]
    c_kv: torch.Tensor         # [S, R]
    k_pe: torch.Tensor         # [S, dr]
    context: torch.Tensor      # [B] int32
    tree_sizes: torch.Tensor   # [B]
    q_offsets: torch.Tensor    # [B + 1]
    kv_offsets: torch.Tensor   # [B]
    bits: torch.Tensor         # [T, W] int32
    tree_vis: list[torch.Tensor]   # per request: bool [n, n]
    scale: float

    def run(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify(self.q_lat, self.q_pe, self.c_kv, self.k_pe, self.context, self.tree_sizes,
                          self.q_offsets, self.kv_offsets, self.bits, self.scale, **kwargs)

    def reference(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, n = int(self.context[b]), int(self.tree_sizes[b])
        q0, k0 = int(self.q_offsets[b]), int(self.kv_offsets[b])
        vis = torch.cat([torch.ones(n, ctx, dtype=torch.bool), self.tree_vis[b]], dim=1).to(self.q_lat.device)
        keys = slice(k0, k0 + ctx + n)
        return reference_attention(self.q_lat[q0:q0 + n], self.q_pe[q0:q0 + n], self.c_kv[keys], self.k_pe[keys],
                                   vis, self.scale)


def make_case(dims: tuple[int, int, int], requests: list[tuple[int, torch.Tensor]], dtype: torch.dtype,
              device: str, seed: int, gap: int = 3) -> Case:
    """requests: (context length, tree visibility bool [n, n]). Key blocks are `gap` rows apart,
    so kv_offsets are not a prefix sum."""
    heads, kv_lora, rope = dims
    gen = torch.Generator().manual_seed(seed)
    sizes = [vis.shape[0] for _, vis in requests]
    kv_offsets, rows = [], 0
    for (ctx, _), n in zip(requests, sizes):
        kv_offsets.append(rows)
        rows += ctx + n + gap
    total = sum(sizes)
    width = max(1, math.ceil(max(sizes) / 32))
    bits = torch.zeros(total, width, dtype=torch.int32)
    start = 0
    for (_, vis), n in zip(requests, sizes):
        bits[start:start + n, :math.ceil(n / 32)] = pack_visibility(vis)
        start += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    i32 = dict(dtype=torch.int32, device=device)
    return Case(rand(total, heads, kv_lora), rand(total, heads, rope), rand(rows, kv_lora), rand(rows, rope),
                torch.tensor([c for c, _ in requests], **i32), torch.tensor(sizes, **i32),
                torch.tensor([0, *np.cumsum(sizes).tolist()], **i32), torch.tensor(kv_offsets, **i32),
                bits.to(device), [vis for _, vis in requests], 1.5 / math.sqrt(kv_lora + rope))


def assert_close(case: Case, o_lat: torch.Tensor, lse: torch.Tensor, tol: float) -> None:
    assert not o_lat.isnan().any() and not lse.isnan().any(), "NaN in the kernel's output"
    for b in range(len(case.tree_vis)):
        q0, n = int(case.q_offsets[b]), int(case.tree_sizes[b])
        ref_o, ref_lse = case.reference(b)
        got_o, got_lse = o_lat[q0:q0 + n].double(), lse[q0:q0 + n].double()
        err_o = ((got_o - ref_o).norm() / ref_o.norm()).item()
        err_lse = ((got_lse - ref_lse).norm() / ref_lse.norm()).item()
        assert err_o < tol and err_lse < tol, f"request {b}: relative error o_lat {err_o:.2e}, lse {err_lse:.2e}"


# ----------------------------------------------------------------------------- CPU

def test_torch_reference_matches_refgen():
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_lora, rope, keys = 5, 3, 48, 8, 23
    q_lat, q_pe = torch.randn(n, heads, kv_lora, generator=gen), torch.randn(n, heads, rope, generator=gen)
    c_kv, k_pe = torch.randn(keys, kv_lora, generator=gen), torch.randn(keys, rope, generator=gen)
    vis = torch.cat([torch.ones(n, keys - n, dtype=torch.bool), tree_visibility([-1, 0, 0, 1, 3])], dim=1)
    o, lse = reference_attention(q_lat, q_pe, c_kv, k_pe, vis, 0.2)
    ref_o, ref_lse = absorbed_attention(*(t.double().numpy() for t in (q_lat, q_pe, c_kv, k_pe)), vis.numpy(), 0.2)
    np.testing.assert_allclose(o.numpy(), ref_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-12)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 70])
def test_pack_visibility_is_the_fixture_layout(n):
    vis = torch.rand(4, n, generator=torch.Generator().manual_seed(n)) < 0.5
    words = np.packbits(vis.numpy(), axis=1, bitorder="little")            # bytes, little-endian bits
    words = np.pad(words, ((0, 0), (0, -words.shape[1] % 4))).view("<u4")
    assert np.array_equal(pack_visibility(vis).numpy().view(np.uint32), words)


@pytest.mark.parametrize("batch,max_tree,heads,max_kv,fast", [
    (1, 1, 64, 32768, True), (8, 1, 64, 32768, True), (32, 128, 64, 32768, True), (1, 1, 4, 1, False),
    (3, 7, 3, 1000, False), (1, 16, 64, 100, True)])
def test_plan_splits_covers_every_key(batch, max_tree, heads, max_kv, fast):
    plan = plan_splits(batch, max_tree, heads, max_kv, fast, sm_count=132)
    assert plan.split_keys % 32 == 0 and 1 <= plan.num_splits <= 128
    assert (plan.num_splits - 1) * plan.split_keys < max_kv <= plan.num_splits * plan.split_keys


def test_adapter_views_a_strided_cache_without_copying():
    from engine.cuda_attention import _key_rows

    cache = torch.randn(2, 3, 10, 4)[1, :, :7]             # one layer of a stacked cache, 7 of 10 slots
    rows, stride = _key_rows(cache)
    assert stride == 10 and rows.data_ptr() == cache.data_ptr() and rows.is_contiguous()
    for b in range(3):
        assert torch.equal(rows[b * stride:b * stride + 7], cache[b])


def _bad_inputs():
    """(label, mutate(args) -> None, message fragment)."""
    def set_(key, value):
        return lambda a: a.__setitem__(key, value(a))
    return [
        ("q_pe shape", set_("q_pe", lambda a: a["q_pe"][:, :2]), "q_pe"),
        ("c_kv width", set_("c_kv", lambda a: a["c_kv"][:, :-1]), "c_kv"),
        ("k_pe rows", set_("k_pe", lambda a: a["k_pe"][:-1]), "k_pe"),
        ("q_lat dims", set_("q_lat", lambda a: a["q_lat"][0]), "q_lat"),
        ("dtype mix", set_("c_kv", lambda a: a["c_kv"].double()), "c_kv"),
        ("float64", lambda a: a.update({k: a[k].double() for k in ("q_lat", "q_pe", "c_kv", "k_pe")}), "float64"),
        ("visibility dtype", set_("visibility", lambda a: a["visibility"].long()), "visibility"),
        ("visibility rows", set_("visibility", lambda a: a["visibility"][1:]), "visibility"),
        ("not contiguous", set_("q_lat", lambda a: a["q_lat"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        ("tree_sizes length", set_("tree_sizes", lambda a: a["tree_sizes"][1:]), "tree_sizes"),
        ("q_offsets length", set_("q_offsets", lambda a: a["q_offsets"][1:]), "q_offsets"),
        ("index dtype", set_("kv_offsets", lambda a: a["kv_offsets"].float()), "kv_offsets"),
        ("scale", set_("scale", lambda a: float("nan")), "scale"),
        ("kernel name", set_("kernel", lambda a: "tensor"), "kernel: 'tensor' is not one of 'auto'"),
        ("invariant kernel", lambda a: a.update(kernel="wgmma", invariant=True), "invariant plan runs on the CUDA"),
        ("cpu tensors", lambda a: None, "CUDA"),
    ]


@pytest.mark.parametrize("label,mutate,message", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_is_named(label, mutate, message):
    case = make_case(DIMS["tiny"], [(5, tree_visibility([-1, 0, 1])), (2, tree_visibility([-1, 0]))],
                     torch.float32, "cpu", seed=1)
    args = dict(q_lat=case.q_lat, q_pe=case.q_pe, c_kv=case.c_kv, k_pe=case.k_pe, context=case.context,
                tree_sizes=case.tree_sizes, q_offsets=case.q_offsets, kv_offsets=case.kv_offsets,
                visibility=case.bits, scale=case.scale)
    mutate(args)
    with pytest.raises(MlaInputError, match=message):
        mla_verify(**args)


# ----------------------------------------------------------------------------- GPU

def _scenario(name: str, gen: torch.Generator) -> list[tuple[int, torch.Tensor]]:
    if name == "causal":        # a chain: the tree mask is the causal mask
        return [(37, torch.ones(9, 9, dtype=torch.bool).tril())]
    if name == "trees":         # random trees, contexts off every tile size, one empty context
        return [(0, tree_visibility(random_parents(7, gen))), (100, tree_visibility(random_parents(40, gen))),
                (1000, tree_visibility(random_parents(13, gen)))]
    if name == "root_only":     # AR decode: one token per request
        return [(c, tree_visibility([-1])) for c in (1, 33, 257, 2049)]
    if name == "fully_visible":
        return [(65, torch.ones(20, 20, dtype=torch.bool)), (3, torch.ones(70, 70, dtype=torch.bool))]
    raise ValueError(name)


SCENARIOS = ["causal", "trees", "root_only", "fully_visible"]
PATHS = [("tiny", torch.float32, "auto"), ("tiny", torch.bfloat16, "auto"), ("tiny2", torch.float32, "auto"),
         ("tiny2", torch.bfloat16, "auto"), ("kimi-k2", torch.float32, "auto"), ("kimi-k2", torch.bfloat16, "auto"),
         ("kimi-k2", torch.bfloat16, "cuda_cores"), ("kimi-k2", torch.bfloat16, "mma"),
         ("kimi-k2", torch.bfloat16, "mma_100k"), ("kimi-k2", torch.bfloat16, "wgmma"),
         ("kimi-k2", torch.bfloat16, "wgmma_pairs")]
PATH_IDS = [f"{d}-{str(t)[6:]}-{k}" for d, t, k in PATHS]


def skip_unless_runs(kernel: str) -> None:
    """Skip (naming why) a tensor-core kernel this GPU and library do not run."""
    here = tensor_core_kernel(torch.device("cuda", torch.cuda.current_device()))
    if kernel in HOPPER_KERNELS and here != "wgmma" or kernel.startswith("mma") and here is None:
        pytest.skip(f"kernel {kernel!r} does not run here: this GPU and library take {here or 'no tensor-core kernel'}")


@needs_gpu
def test_the_device_takes_its_tensor_core_kernel():
    """bf16 at K2 dims: wgmma on compute capability 9.0 when the library was built with sm_90a
    (build.py's default, or $KDTREE_CUDA_ARCHS naming it), mma.sync on any other GPU of 8.0 and later."""
    device = torch.device("cuda", torch.cuda.current_device())
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        pytest.skip(f"tensor-core MLA needs compute capability 8.0; this GPU is {capability}")
    archs = os.environ.get("KDTREE_CUDA_ARCHS") or build.DEFAULT_ARCHS
    want = "wgmma" if capability == (9, 0) and "sm_90a" in archs.split(",") else "mma"
    assert tensor_core_kernel(device) == want, f"compute capability {capability}, library built for {archs}"
    assert uses_tensor_cores(torch.bfloat16, 512, 64, device)
    assert not uses_tensor_cores(torch.float32, 512, 64, device)


@needs_gpu
@pytest.mark.parametrize("kernel", ["mma", "mma_100k", *HOPPER_KERNELS])
def test_each_tensor_core_kernel_computes_its_own_bits(kernel):
    """A kernel forced by name really runs: its bits differ from the CUDA cores' and from the
    other tensor-core kernels' that run here (other tiles, other summation orders), and it is
    right within bf16 rounding."""
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(17)
    case = make_case(DIMS["kimi-k2"], [(600, tree_visibility(random_parents(20, gen)))], torch.bfloat16, "cuda",
                     seed=18)
    others = ["cuda_cores", "mma", "mma_100k"] + (list(HOPPER_KERNELS) if tensor_core_kernel(case.q_lat.device) == "wgmma"
                                                  else [])
    o_lat, lse = case.run(kernel=kernel)
    for other in others:
        if other != kernel:
            assert not torch.equal(o_lat, case.run(kernel=other)[0]), f"{kernel!r} gave the bits of {other!r}"
    assert_close(case, o_lat, lse, TOLERANCE[torch.bfloat16])


@needs_gpu
@pytest.mark.parametrize("context", [600, 8000])
def test_auto_takes_the_one_scorer_kernel_at_every_split_length(context):
    """On Hopper, "auto" runs the one-scorer wgmma kernel, on short and long splits alike (the
    seesaw runs only when asked for by name): its bits are the forced kernel's, not the seesaw's.
    Four 128-token trees fill 512 row blocks, so the plan keeps 8000 keys in one or two splits."""
    skip_unless_runs("wgmma")
    gen = torch.Generator().manual_seed(23)
    case = make_case(DIMS["kimi-k2"], [(context, tree_visibility(random_parents(128, gen))) for _ in range(4)],
                     torch.bfloat16, "cuda", seed=24)
    o_auto = case.run(kernel="auto")[0]
    assert torch.equal(o_auto, case.run(kernel="wgmma")[0]), f"auto did not run the one-scorer kernel at {context}"
    assert not torch.equal(o_auto, case.run(kernel="wgmma_pairs")[0]), "auto gave the seesaw's bits"


@needs_gpu
@pytest.mark.parametrize("split_keys", [512, 4096])
def test_the_c_apis_auto_takes_the_one_scorer_kernel_at_every_split_length(split_keys):
    """A C caller's kernel 0 ("auto", resolved by the library, not by `mla_verify`) runs the
    one-scorer kernel too, on splits of 8 key tiles and of 64 alike."""
    skip_unless_runs("wgmma")
    gen = torch.Generator().manual_seed(23)
    case = make_case(DIMS["kimi-k2"], [(8000, tree_visibility(random_parents(128, gen)))], torch.bfloat16, "cuda",
                     seed=24)
    num_splits = math.ceil((8000 + 128) / split_keys)

    def run(kernel: str) -> torch.Tensor:
        o_lat, lse = torch.empty_like(case.q_lat), torch.empty(case.q_lat.shape[:2], device="cuda")
        torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, case.c_kv, case.k_pe, case.context, case.tree_sizes,
                                        case.q_offsets, case.kv_offsets, case.bits, case.scale, 128, num_splits,
                                        split_keys, kernel, o_lat, lse)
        return o_lat

    o_auto = run("auto")
    assert torch.equal(o_auto, run("wgmma")), f"the library's auto ran another kernel on {split_keys}-key splits"
    assert not torch.equal(o_auto, run("wgmma_pairs")), "the library's auto gave the seesaw's bits"


@needs_gpu
def test_a_kernel_that_cannot_run_the_inputs_is_named():
    tiny = make_case(DIMS["tiny"], [(5, tree_visibility([-1, 0]))], torch.bfloat16, "cuda", seed=19)
    with pytest.raises(MlaInputError, match="kernel 'mma' takes bfloat16 inputs at kv_lora 512, rope 64"):
        tiny.run(kernel="mma")
    k2 = make_case(DIMS["kimi-k2"], [(5, tree_visibility([-1, 0]))], torch.bfloat16, "cuda", seed=19)
    with pytest.raises(MlaInputError, match="kernel 'mma' needs q_lat, q_pe, c_kv and k_pe 16-byte aligned"):
        flat = k2.c_kv.view(-1)
        shifted = flat[4:4 + flat.numel() - 512].view(-1, 512)                 # 8 bytes off, one row fewer
        mla_verify(k2.q_lat, k2.q_pe, shifted, k2.k_pe[:-1], k2.context, k2.tree_sizes, k2.q_offsets,
                   k2.kv_offsets, k2.bits, k2.scale, kernel="mma")
    if tensor_core_kernel(k2.q_lat.device) != "wgmma":
        with pytest.raises(MlaInputError, match="kernel 'wgmma' runs on compute capability 9.0"):
            k2.run(kernel="wgmma")
    with pytest.raises(MlaInputError, match="invariant plan runs on the CUDA cores"):
        k2.run(kernel="mma", invariant=True)


@needs_gpu
@pytest.mark.parametrize("scale", [0.0, -0.125, math.inf, math.nan])
def test_the_c_api_refuses_a_scale_that_is_not_finite_and_positive(scale):
    """The kernels take a row's max of the unscaled scores, right only for a positive scale: the
    C API says so for callers that skip the Python checks."""
    from kernels_cuda._lib import KernelError
    case = make_case(DIMS["kimi-k2"], [(5, tree_visibility([-1, 0]))], torch.bfloat16, "cuda", seed=19)
    o_lat, lse = torch.empty_like(case.q_lat), torch.empty(case.q_lat.shape[:2], device="cuda")
    with pytest.raises(KernelError, match="a scalar argument is out of its range"):
        torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, case.c_kv, case.k_pe, case.context, case.tree_sizes,
                                        case.q_offsets, case.kv_offsets, case.bits, scale, 2, 1, 64, "auto", o_lat,
                                        lse)


@needs_gpu
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dims,dtype,kernel", PATHS, ids=PATH_IDS)
def test_matches_reference(scenario, dims, dtype, kernel):
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(7)
    case = make_case(DIMS[dims], _scenario(scenario, gen), dtype, "cuda", seed=11)
    o_lat, lse = case.run(kernel=kernel)
    assert o_lat.dtype == dtype and lse.dtype == torch.float32
    assert_close(case, o_lat, lse, TOLERANCE[dtype])


@needs_gpu
@pytest.mark.parametrize("dims,dtype,kernel", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("split_keys", [32, 96, 4096])
def test_every_split_and_output_written(dims, dtype, kernel, split_keys):
    """Splits of every size merge to the reference; NaN-poisoned outputs are fully overwritten;
    float32 output from bf16 inputs."""
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(3)
    case = make_case(DIMS[dims], [(300, tree_visibility(random_parents(17, gen))), (31, tree_visibility([-1]))],
                     dtype, "cuda", seed=5)
    total, heads, kv_lora = case.q_lat.shape
    o_lat = torch.full((total, heads, kv_lora), math.nan, dtype=torch.float32, device="cuda")
    lse = torch.full((total, heads), math.nan, dtype=torch.float32, device="cuda")
    num_splits = math.ceil(320 / split_keys)
    torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, case.c_kv, case.k_pe, case.context, case.tree_sizes,
                                    case.q_offsets, case.kv_offsets, case.bits, case.scale, 17, num_splits,
                                    split_keys, kernel, o_lat, lse)
    assert_close(case, o_lat, lse, TOLERANCE[dtype])


@needs_gpu
@pytest.mark.parametrize("dims,dtype,kernel", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("split_keys", [64, 96])
def test_cache_rows_outside_the_request_never_leak(dims, dtype, kernel, split_keys):
    """NaN in every cache row outside the requests' keys (an engine's unused slots) leaves the
    output finite and right: the tensor-core kernels load whole key tiles past a request's end."""
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(13)
    case = make_case(DIMS[dims], [(70, tree_visibility(random_parents(9, gen))), (3, tree_visibility([-1, 0]))],
                     dtype, "cuda", seed=14, gap=70)
    outside = torch.ones(case.c_kv.shape[0], dtype=torch.bool, device="cuda")
    for b in range(2):
        k0 = int(case.kv_offsets[b])
        outside[k0:k0 + int(case.context[b]) + int(case.tree_sizes[b])] = False
    case.c_kv[outside] = math.nan
    case.k_pe[outside] = math.nan
    o_lat = torch.empty(case.q_lat.shape, dtype=dtype, device="cuda")
    lse = torch.empty(case.q_lat.shape[:2], dtype=torch.float32, device="cuda")
    torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, case.c_kv, case.k_pe, case.context, case.tree_sizes,
                                    case.q_offsets, case.kv_offsets, case.bits, case.scale, 9,
                                    math.ceil(79 / split_keys), split_keys, kernel, o_lat, lse)
    assert_close(case, o_lat, lse, TOLERANCE[dtype])


@needs_gpu
@pytest.mark.parametrize("dims,dtype,kernel", PATHS, ids=PATH_IDS)
def test_hiding_one_ancestor_changes_only_that_row(dims, dtype, kernel):
    skip_unless_runs(kernel)
    parents = [-1, 0, 1, 2, 2, 0, 5]
    vis = tree_visibility(parents)
    hidden = vis.clone()
    hidden[4, 1] = False                                                     # node 4 loses ancestor 1
    full = make_case(DIMS[dims], [(5, vis)], dtype, "cuda", seed=21)           # same seed: same inputs
    cut = make_case(DIMS[dims], [(5, hidden)], dtype, "cuda", seed=21)
    (o_full, lse_full), (o_cut, lse_cut) = full.run(kernel=kernel), cut.run(kernel=kernel)
    assert_close(cut, o_cut, lse_cut, TOLERANCE[dtype])
    others = [i for i in range(len(parents)) if i != 4]
    assert torch.equal(o_full[others], o_cut[others]) and torch.equal(lse_full[others], lse_cut[others])
    change = ((o_full[4].double() - o_cut[4].double()).norm() / o_full[4].double().norm()).item()
    assert change > 10 * TOLERANCE[dtype], f"hiding an ancestor moved row 4 by only {change:.1e}"


@needs_gpu
@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "auto"), (torch.bfloat16, "cuda_cores"),
                                          (torch.bfloat16, "mma"), (torch.float32, "auto")])
def test_batch_mixing_context_1_and_32k(dtype, kernel):
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(9)
    case = make_case(DIMS["kimi-k2"], [(1, tree_visibility(random_parents(5, gen))),
                                       (32768, tree_visibility(random_parents(16, gen)))], dtype, "cuda", seed=2)
    o_lat, lse = case.run(kernel=kernel)
    assert_close(case, o_lat, lse, TOLERANCE[dtype])


@needs_gpu
@pytest.mark.parametrize("dims,dtype,kernel", PATHS, ids=PATH_IDS)
def test_run_to_run_bitwise_identical(dims, dtype, kernel):
    skip_unless_runs(kernel)
    gen = torch.Generator().manual_seed(4)
    case = make_case(DIMS[dims], [(5000, tree_visibility(random_parents(24, gen))), (7, tree_visibility([-1]))],
                     dtype, "cuda", seed=8)
    first = case.run(kernel=kernel)
    for _ in range(3):
        again = case.run(kernel=kernel)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@needs_gpu
def test_rows_that_see_nothing_are_zero_not_nan():
    vis = torch.zeros(3, 3, dtype=torch.bool)
    vis[1, 1] = True
    case = make_case(DIMS["kimi-k2"], [(0, vis)], torch.bfloat16, "cuda", seed=6)
    o_lat, lse = case.run()
    assert torch.equal(o_lat[[0, 2]], torch.zeros_like(o_lat[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_golden_cases(open_golden, dtype):
    """refgen's float32 cases; bf16 runs them on rounded inputs (K2 cases: the tensor cores)."""
    with open_golden("kernels/verify_attention.kdtr") as f:
        for spec in f.metadata["cases"]:
            name = spec["name"]

            def get(key: str) -> torch.Tensor:
                return torch.from_numpy(np.array(f[f"cases/{name}/{key}"])).cuda()

            o_lat, lse = mla_verify(*(get(k).to(dtype) for k in ("q_lat", "q_pe", "c_kv", "k_pe")),
                                    get("context"), get("tree_sizes"), get("q_offsets"), get("kv_offsets"),
                                    get("visibility_bits").view(torch.int32), spec["scale"])
            for got, key in ((o_lat, "o_lat"), (lse, "lse")):
                ref = get(key).double()
                err = ((got.double() - ref).norm() / ref.norm()).item()
                assert err < TOLERANCE[dtype], f"case {name}: {key} relative error {err:.2e}"


@needs_gpu
@pytest.mark.parametrize("dims,dtype", [("tiny", torch.float32), ("kimi-k2", torch.bfloat16)])
def test_engine_adapter_matches_torch_backend(dims, dtype):
    from engine.attention import torch_attention
    from engine.cuda_attention import CudaAttention

    heads, kv_lora, rope = DIMS[dims]
    gen = torch.Generator().manual_seed(12)
    batch, n, slots = 3, 6, 90
    starts, n_new = torch.tensor([0, 40, 77]), torch.tensor([6, 1, 4])   # padding rows in requests 1, 2
    vis = torch.stack([tree_visibility(random_parents(n, gen)) for _ in range(batch)])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    c_kv = rand(2, batch, slots + 10, kv_lora)[1, :, :slots]                # strided slices of a layer stack
    k_pe = rand(2, batch, slots + 10, rope)[1, :, :slots]
    args = (rand(batch, n, heads, kv_lora), rand(batch, n, heads, rope), c_kv, k_pe,
            starts.cuda(), n_new.cuda(), vis.cuda(), 0.1)
    got, want = CudaAttention()(*args), torch_attention(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < TOLERANCE[dtype], f"adapter vs torch backend: relative error {err:.2e}"
    assert torch.equal(got[1, 1:], torch.zeros_like(got[1, 1:]))
