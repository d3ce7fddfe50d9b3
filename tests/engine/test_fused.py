"""The fused layers (engine/fused) against torch references, kernel by kernel and whole.

Each kernel beside the torch ops it replaces, over sizes, dtypes and both rotary pairings; then
the fused forward against the unfused one and the float64 reference; then the invariant form:
each kernel whose tiling could follow the number of rows gives a row the same bits whatever rows
share its call, and the whole invariant forward gives a token the same logits in any batch. On a GPU the kernels are
compiled; without one they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so CI checks the same kernels' arithmetic on the CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="the fused layers are Triton kernels; Triton is not installed")

from engine.fused import heads, linear, moe as fused_moe, norms, tiles  # noqa: E402
from engine.model import Transformer, _use_fused, apply_rope, rms_norm, route  # noqa: E402
from engine.moe import RoutedExperts, swiglu  # noqa: E402
from kdtr_format import PRESETS  # noqa: E402
from refgen.weights import init_weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float = 2.0) -> None:
    """Within `ulps` units of the dtype's rounding at the expected tensor's scale."""
    scale = float(expected.float().abs().max()) or 1.0
    unit = torch.finfo(dtype).eps * scale
    error = float((actual.float() - expected.float()).abs().max())
    assert error <= ulps * unit, f"max error {error:.3g} > {ulps} ulps ({unit:.3g}) at scale {scale:.3g}"


def within_product_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out ~ x w^T [M, N] for x [M, K], w [N, K]: within the bound of float32 accumulation of K
    products in any order and grouping, gamma_K (|x| |w|^T) with gamma_K = K u / (1 - K u) (u =
    2^-23: a tensor core's adder may truncate), plus the output's rounding to its dtype, elementwise."""
    k = x.shape[1]
    unit = 2.0 ** -23
    exact = x.double() @ w.double().T
    bound = k * unit / (1 - k * unit) * (x.double().abs() @ w.double().abs().T) \
        + torch.finfo(out.dtype).eps / 2 * exact.abs()
    excess = ((out.double() - exact).abs() - bound).max()
    assert excess <= 0, f"error exceeds the float32 accumulation bound by {float(excess):.3g}"


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 256, 300])
def test_add_rms_norm_is_the_residual_add_then_rms_norm(dtype, width):
    x, delta = randn(5, width, dtype=dtype), randn(5, width, dtype=dtype, seed=1)
    weight = randn(width, seed=2).to(dtype).float()
    x_new, h, h32 = norms.add_rms_norm(x, weight, 1e-6, delta=delta, float32_copy=True)
    assert torch.equal(x_new, x + delta)
    close(h, rms_norm(x + delta, weight, 1e-6), dtype)
    assert torch.equal(h32, h.float())
    _, alone, _ = norms.add_rms_norm(x, weight, 1e-6)
    close(alone, rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_sums_the_slots_in_order_and_skips_padding_rows(dtype):
    x, slots = randn(4, 64, dtype=dtype), randn(4, 3, 64, seed=1)
    real = torch.tensor([1, 0, 1, 1], dtype=torch.uint8, device=DEVICE)
    slots[1] = float("nan")                              # a padding row's unwritten slots
    x_new, _, _ = norms.add_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, delta=slots, real=real)
    combined = slots[:, 0] + slots[:, 1] + slots[:, 2]
    expected = torch.where(real.bool()[:, None], x + combined.to(dtype), x)
    assert torch.equal(x_new, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["interleave", "neox"])
@pytest.mark.parametrize("q_lora", [96, None])
def test_latent_norms_rotates_and_writes_only_real_rows(dtype, style, q_lora):
    m, r, dr, q_cols = 6, 64, 16, q_lora or 40
    kv = randn(m, q_cols + r + dr, dtype=dtype)
    q_a_norm = randn(q_cols, seed=1).float() if q_lora else None
    kv_a_norm = randn(r, seed=2).float()
    cos, sin = randn(m, dr // 2, seed=3), randn(m, dr // 2, seed=4)
    rows = torch.tensor([7, 2, 0, 5, 9, 3], device=DEVICE)
    real = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.uint8, device=DEVICE)
    c_kv, k_pe = randn(10, r, dtype=dtype, seed=5), randn(10, dr, dtype=dtype, seed=6)
    c_kv_before, k_pe_before = c_kv.clone(), k_pe.clone()
    q_a = norms.latent(kv, q_cols, q_a_norm, kv_a_norm, 1e-6, cos, sin, style, rows, real, c_kv, k_pe)
    if q_lora:
        close(q_a, rms_norm(kv[:, :q_cols], q_a_norm, 1e-6), dtype)
    else:
        assert q_a is None
    written = rows[real.bool()]
    close(c_kv[written], rms_norm(kv[real.bool(), q_cols:q_cols + r], kv_a_norm, 1e-6), dtype)
    close(k_pe[written], apply_rope(kv[real.bool(), q_cols + r:], cos[real.bool()], sin[real.bool()], style), dtype)
    untouched = torch.ones(10, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(c_kv[untouched], c_kv_before[untouched]) and torch.equal(k_pe[untouched], k_pe_before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_head_bmm_absorbs_q_nope_and_rotates_q_pe(dtype, rows):
    heads_, d_nope, dr, r = 3, 32, 16, 80
    q = randn(rows, heads_, d_nope + dr, dtype=dtype)
    w_uk = randn(heads_, d_nope, r, dtype=dtype, seed=1)
    cos, sin = randn(rows, dr // 2, seed=2), randn(rows, dr // 2, seed=3)
    q_lat, q_pe = heads.head_bmm(q, w_uk, w_transposed=False, rope=(cos, sin, "neox"))
    close(q_lat, torch.einsum("mhd,hdr->mhr", q[..., :d_nope].float(), w_uk.float()), dtype, ulps=4)
    close(q_pe, apply_rope(q[..., d_nope:], cos[:, None], sin[:, None], "neox"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_bmm_takes_w_uv_as_stored(dtype):
    o_lat, w_uv = randn(9, 4, 64, dtype=dtype), randn(4, 24, 64, dtype=dtype, seed=1)
    o, q_pe = heads.head_bmm(o_lat, w_uv, w_transposed=True)
    assert q_pe is None
    close(o, torch.einsum("mhr,hvr->mhv", o_lat.float(), w_uv.float()), dtype, ulps=4)


@pytest.mark.parametrize("rows", [5, 40])               # logits in the kernel, or from one GEMM
@pytest.mark.parametrize("preset", ["tiny", "tiny2"])
def test_route_matches_the_engine_router(preset, rows):
    cfg = PRESETS[preset]
    e = cfg.n_routed_experts
    logits = randn(rows, e)
    logits[:4] = logits[:4].round()                      # ties (with no bias): to the lower index, as engine.model.route
    k = cfg.num_experts_per_tok
    for bias in (0.1 * randn(e, seed=1), torch.zeros(e, device=DEVICE)):
        idx, weight = fused_moe.route(cfg, logits, logits, torch.eye(e, device=DEVICE), bias)
        expected_idx, expected_weight = route(cfg, logits, torch.eye(e, device=DEVICE), bias)
        assert torch.equal(idx[:, :k].long(), expected_idx)
        torch.testing.assert_close(weight[:, :k], expected_weight, rtol=1e-6, atol=0)
    shared = torch.arange(e, e + cfg.n_shared_experts, dtype=torch.int32, device=DEVICE)
    assert torch.equal(idx[:, k:], shared.expand(rows, -1)) and bool((weight[:, k:] == 1).all())


@pytest.mark.parametrize("rows", [7, 30])
def test_route_groups_and_normalizes_as_deepseek_v3(rows):
    cfg = dataclasses.replace(PRESETS["tiny2"], n_routed_experts=32, n_group=8, topk_group=3,
                              num_experts_per_tok=6, norm_topk_prob=True)
    logits, bias = randn(rows, 32), 0.5 * randn(32, seed=1)
    idx, weight = fused_moe.route(cfg, logits, logits, torch.eye(32, device=DEVICE), bias)
    expected_idx, expected_weight = route(cfg, logits, torch.eye(32, device=DEVICE), bias)
    assert torch.equal(idx[:, :6].long(), expected_idx)
    torch.testing.assert_close(weight[:, :6], expected_weight, rtol=1e-6, atol=0)


# tiny2's router (16 experts, 4 groups of 4, 2 groups kept, 3 experts): each row's group 0 has its two
# best experts tied exactly. Its score is their sum, 2 sigmoid(1) = 1.4621 (rows 0, 2) and 2 sigmoid(2)
# = 1.7616 (row 1), which keeps it; a router that took best + the next *different* score would give
# it 1.4420, 0.9282 and 0.7490 and keep two other groups. Row 0 is closest to the line: groups 1 and 2
# score 1.4500 and 1.4447, between the two.
GROUP_TIES = [[1, 1, 0.9, -4, 1.5, 0.5427, -4, -4, 1.5, 0.52, -4, -4, -4, -4, -4, -4],
              [2, 2, -3, -3, 2.5, 0, 0, -3, 1, 1.2, -3, -3, -4, -4, -4, -4],
              [1, 1, 1, -4, 1.5, 0.5427, -4, -4, -4, -4, -4, -4, 1.2, 0.6, -4, -4]]
GROUP_TIES_EXPERTS = [[4, 0, 1], [0, 1, 9], [4, 0, 1]]


@pytest.mark.parametrize("rows, bias", [(3, 0.0), (3, 0.25),                 # the same bias everywhere keeps
                                        (fused_moe.ROUTER_ROWS + 1, 0.0)])   # the ties; logits from one GEMM
def test_route_scores_a_group_whose_two_best_experts_tie_by_their_sum(rows, bias):
    cfg = PRESETS["tiny2"]
    logits = torch.cat([torch.tensor(GROUP_TIES, device=DEVICE), randn(rows - 3, 16)])
    gate, bias = torch.eye(16, device=DEVICE), torch.full((16,), bias, device=DEVICE)
    idx, _ = fused_moe.route(cfg, logits, logits, gate, bias)
    expected_idx, _ = route(cfg, logits, gate, bias)
    assert expected_idx[:3].tolist() == GROUP_TIES_EXPERTS
    assert idx[:, :3].tolist() == expected_idx.tolist()


@pytest.mark.parametrize("rows, slots, experts, block", [(1, 5, 17, 16), (9, 3, 5, 16),   # one program
                                                         (300, 5, 17, 32),   # 6 programs of one chunk
                                                         (520, 4, 16, 64),   # 2080 pairs: chunks of 512
                                                         (2056, 9, 21, 64)])  # 25 programs of 3 chunks
def test_align_sorts_every_real_pair_by_expert_into_whole_blocks(rows, slots, experts, block):
    g = torch.Generator().manual_seed(rows)
    idx = torch.randint(0, experts, (rows, slots), generator=g, dtype=torch.int32).to(DEVICE)
    real = (torch.rand(rows, generator=g) < 0.8).to(torch.uint8).to(DEVICE)
    real[0] = 1
    sorted_pairs, block_expert, count = fused_moe.align(idx, real, experts, block)
    blocks = int(count)
    assert 0 < blocks <= block_expert.numel()
    pairs = sorted_pairs[:blocks * block].view(blocks, block).cpu()
    owners = block_expert[:blocks].cpu()
    assert bool((block_expert[blocks:] == -1).all()) and bool((owners[1:] >= owners[:-1]).all())
    flat_idx, flat_real = idx.flatten().cpu(), real.cpu().repeat_interleave(slots).bool()
    for b in range(blocks):
        members = pairs[b][pairs[b] >= 0]
        assert members.numel() > 0 and bool((flat_idx[members.long()] == owners[b]).all())
    listed = pairs[pairs >= 0]
    assert torch.equal(listed.sort().values, torch.nonzero(flat_real).flatten().to(listed.dtype))
    assert bool((sorted_pairs[blocks * block:] == -1).all())
    for e in range(experts):                             # stable: each expert's pairs in pair order
        mine = listed[flat_idx[listed.long()] == e]
        assert bool((mine[1:] > mine[:-1]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, tiling", [(1, None), (65, None), (8, None), (8, (16, 32)), (8, (32, 128))])
def test_experts_match_routed_and_shared_experts(dtype, rows, tiling):
    cfg = PRESETS["tiny2"]
    e, k, ns, inner, width = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, 48, 64
    w_gate, w_up = (randn(e + ns, inner, width, dtype=dtype, seed=s) / 8 for s in (1, 2))
    w_down = randn(e + ns, width, inner, dtype=dtype, seed=3) / 8
    h = randn(rows, width, dtype=dtype, seed=4)
    logits = randn(rows, e, seed=5)
    idx, weight = fused_moe.route(cfg, logits, logits, torch.eye(e, device=DEVICE), torch.zeros(e, device=DEVICE))
    real = torch.ones(rows, dtype=torch.uint8, device=DEVICE)
    if rows > 1:
        real[-1] = 0
    y = fused_moe.experts(h, idx, weight, real, w_gate, w_up, w_down, tiling)
    routed = RoutedExperts(w_gate[:e].float(), w_up[:e].float(), w_down[:e].float())
    expected = routed(h.float(), idx[:, :k].long(), weight[:, :k], real.bool(), "dense")
    for j in range(ns):
        expected = expected + swiglu(h.float(), w_gate[e + j].float(), w_up[e + j].float(), w_down[e + j].float())
    keep = real.bool()
    close(y.sum(1)[keep], expected[keep], dtype, ulps=8)


def forward_pair(cfg, weights, dtype, fused: bool, prompts: torch.Tensor, tree: torch.Tensor):
    """A prefill of `prompts` [B, P] then one forward of `tree` [B, N] (causal; request 1 with
    two padding rows) -> (logits [B, N, V], cache)."""
    model = Transformer(cfg, weights, device=DEVICE, dtype=dtype, fused=fused)
    batch, p = prompts.shape
    n = tree.shape[1]
    cache = model.new_cache(batch, 32)
    arange = torch.arange(32, device=DEVICE)
    causal = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril().expand(batch, n, n)
    model(prompts, arange[:p].expand(batch, p), torch.ones(p, p, dtype=torch.bool, device=DEVICE).tril()
          .expand(batch, p, p), torch.full((batch,), p, device=DEVICE), torch.zeros(batch, dtype=torch.int64,
                                                                                 device=DEVICE), cache)
    n_new = torch.tensor([n, n - 2], device=DEVICE)
    logits = model(tree, (p + arange[:n]).expand(batch, n), causal, n_new, torch.full((batch,), p, device=DEVICE),
                   cache)
    return logits, cache, n_new


# The whole-forward tests run each preset narrowed: its every feature (q_lora or none, the rotary
# pairing and YaRN, grouped routing, the shared experts, tiny's dense first layer followed by a MoE
# layer) in two layers at a fraction of its widths and vocabulary (200: not a whole number of the
# 64-column tiles). The interpreter's time follows the widths and layers, and what these tests
# check (the layers' composition, the cache, padding rows, batch invariance) does not; the kernels'
# arithmetic at other widths is the kernel tests' above.
NARROW = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 200,
          "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def narrow():
    """-> get(preset): (the preset narrowed to NARROW, its seeded float32 weights), built once."""
    built: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in built:
            cfg = dataclasses.replace(PRESETS[name], **NARROW)
            built[name] = cfg, init_weights(cfg, 1234)
        return built[name]
    return get


@pytest.mark.parametrize("name", ["tiny", "tiny2"])           # interleave + q_lora; neox, groups, no q_lora
def test_fused_forward_matches_the_unfused_forward(narrow, name):
    """float32: the same math to rounding (logits and the cache); padding rows write nothing."""
    cfg, weights = narrow(name)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (2, 2), generator=g).to(DEVICE)
    tree = torch.randint(0, cfg.vocab_size, (2, 4), generator=g).to(DEVICE)
    fused, fused_cache, n_new = forward_pair(cfg, weights, torch.float32, True, prompts, tree)
    plain, plain_cache, _ = forward_pair(cfg, weights, torch.float32, False, prompts, tree)
    real = torch.arange(4, device=DEVICE)[None] < n_new[:, None]
    close(fused[real], plain[real], torch.float32, ulps=64)
    close(fused_cache.c_kv, plain_cache.c_kv, torch.float32, ulps=64)
    assert torch.equal(fused_cache.c_kv[:, 1, 2 + 2:], plain_cache.c_kv[:, 1, 2 + 2:])   # zeros: never written


def test_fused_forward_in_bfloat16_stays_near_the_float64_reference(narrow):
    """bf16: within the spread of bf16 forwards around the float64 reference (the unfused bf16
    forward's own error, doubled)."""
    cfg, weights = narrow("tiny")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (2, 2), generator=g).to(DEVICE)
    tree = torch.randint(0, cfg.vocab_size, (2, 4), generator=g).to(DEVICE)
    exact, _, n_new = forward_pair(cfg, weights, torch.float32, False, prompts, tree)
    fused, _, _ = forward_pair(cfg, weights, torch.bfloat16, True, prompts, tree)
    plain, _, _ = forward_pair(cfg, weights, torch.bfloat16, False, prompts, tree)
    real = torch.arange(4, device=DEVICE)[None] < n_new[:, None]
    plain_error = float((plain[real] - exact[real]).abs().max())
    fused_error = float((fused[real] - exact[real]).abs().max())
    assert fused_error <= 2 * plain_error, f"fused bf16 error {fused_error:.3g}, unfused {plain_error:.3g}"


def test_fused_is_refused_where_it_cannot_run(narrow):
    cfg, weights = narrow("tiny")
    with pytest.raises(ValueError, match="moe='dense'"):
        Transformer(cfg, weights, device=DEVICE, moe="dense", fused=True)
    assert Transformer(cfg, weights, device="cpu").fused_forward is None


def test_the_fused_layers_are_the_default_for_bf16_on_cuda_only():
    cuda = torch.device("cuda")
    assert _use_fused(None, cuda, torch.bfloat16, False, None, None)
    assert not _use_fused(None, cuda, torch.float32, False, None, None)       # slower than cuBLAS there
    assert _use_fused(None, cuda, torch.bfloat16, True, None, None)           # invariant mode: its fused form
    assert not _use_fused(None, cuda, torch.float32, True, None, None)
    assert _use_fused(True, cuda, torch.bfloat16, True, None, None)
    assert not _use_fused(None, cuda, torch.bfloat16, False, None, "grouped")
    assert not _use_fused(None, torch.device("cpu"), torch.bfloat16, False, None, None)
    assert _use_fused(True, cuda, torch.float32, False, None, None)


# ---- the invariant form (invariant=True) ----

def rows_alone_and_among_others(run, x: torch.Tensor) -> None:
    """run(rows [M, ...]) -> [M, ...]: every probed row's output is bitwise the same in the whole
    call (M past every tiling threshold: 80 rows span two 64-row tiles), in a part of it (one that
    crosses a tile boundary), alone, and first among other rows."""
    whole = run(x)
    for part in (slice(7, 8), slice(16, 33), slice(60, 75)):
        assert torch.equal(run(x[part]), whole[part]), f"rows {part} differ from the call of {x.shape[0]} rows"
    among = torch.cat([x[5:6], randn(20, *x.shape[1:], dtype=x.dtype, seed=9)])
    assert torch.equal(run(among)[0], whole[5]), "row 5 among other rows differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_count", [None, 3])
def test_invariant_linear_is_the_product_and_row_invariant(dtype, split_count):
    x, w = randn(80, 300, dtype=dtype), randn(100, 300, dtype=dtype, seed=1) / 16
    within_product_bound(linear.linear(x, w, invariant=True, split_count=split_count), x, w)
    rows_alone_and_among_others(lambda rows: linear.linear(rows, w, invariant=True, split_count=split_count), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_adds_its_splits_alike_in_one_program_or_two(dtype):
    """Three K runs added in the tile's program or by the partials' kernel: the same bits, so a
    call may pick either by its number of rows (here: one program from 40 rows)."""
    x, w = randn(80, 300, dtype=dtype), randn(100, 300, dtype=dtype, seed=1) / 16
    assert torch.equal(linear.linear(x, w, invariant=True, split_count=3, in_program=True),
                       linear.linear(x, w, invariant=True, split_count=3, in_program=False))
    rows_alone_and_among_others(lambda rows: linear.linear(rows, w, invariant=True, split_count=3,
                                                           in_program=rows.shape[0] >= 40), x)


def test_invariant_linear_splits_follow_the_weight_alone():
    assert linear.splits(2048, 2048, torch.bfloat16) == (1 if linear.INTERPRETED else 8)
    assert linear.splits(32768, 2048, torch.bfloat16) == 1               # 512 column blocks stream alone
    assert linear.splits(2112, 128, torch.bfloat16) == 1                 # one K-block: nothing to split


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_head_bmm_is_row_invariant(dtype):
    q, w_uk = randn(80, 3, 48, dtype=dtype), randn(3, 32, 80, dtype=dtype, seed=1)
    cos, sin = randn(80, 8, seed=2), randn(80, 8, seed=3)

    def run(rows: torch.Tensor) -> torch.Tensor:
        m = rows.shape[0]
        q_lat, q_pe = heads.head_bmm(rows, w_uk, w_transposed=False, rope=(cos[:m], sin[:m], "neox"),
                                     invariant=True)
        return torch.cat([q_lat, q_pe], dim=2)
    close(run(q)[..., :80], torch.einsum("mhd,hdr->mhr", q[..., :32].float(), w_uk.float()), dtype, ulps=4)
    whole = run(q)
    for part in (slice(0, 1), slice(16, 33), slice(60, 75)):   # the rotation reads its own row's cos and sin
        q_lat, _ = heads.head_bmm(q[part], w_uk, w_transposed=False, rope=(cos[part], sin[part], "neox"),
                                  invariant=True)
        assert torch.equal(q_lat, whole[part, :, :80]), f"rows {part} differ"


def test_invariant_route_computes_logits_per_row_past_the_gemm_threshold():
    """Past ROUTER_ROWS rows the default mode takes the logits from one GEMM; invariant mode
    computes every row's logits in the kernel, as for one row."""
    cfg = PRESETS["tiny2"]
    e, width = cfg.n_routed_experts, 96
    h, gate, bias = randn(80, width), randn(e, width, seed=1) / 4, 0.1 * randn(e, seed=2)

    def run(rows: torch.Tensor) -> torch.Tensor:
        idx, weight = fused_moe.route(cfg, rows, None, gate, bias, invariant=True)
        return torch.cat([idx.float(), weight], dim=1)
    idx, weight = fused_moe.route(cfg, h, None, gate, bias, invariant=True)
    expected_idx, expected_weight = route(cfg, h @ gate.T, torch.eye(e, device=DEVICE), bias)
    k = cfg.num_experts_per_tok
    assert torch.equal(idx[:, :k].long(), expected_idx)
    torch.testing.assert_close(weight[:, :k], expected_weight, rtol=1e-5, atol=0)
    rows_alone_and_among_others(run, h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_experts_give_a_row_its_bits_whatever_its_block_partners(dtype):
    cfg = PRESETS["tiny2"]
    e, ns, inner, width = cfg.n_routed_experts, cfg.n_shared_experts, 48, 64
    w_gate, w_up = (randn(e + ns, inner, width, dtype=dtype, seed=s) / 8 for s in (1, 2))
    w_down = randn(e + ns, width, inner, dtype=dtype, seed=3) / 8
    gate = torch.eye(e, width, device=DEVICE)

    def run(rows: torch.Tensor) -> torch.Tensor:
        idx, weight = fused_moe.route(cfg, rows, None, gate, torch.zeros(e, device=DEVICE), invariant=True)
        real = torch.ones(rows.shape[0], dtype=torch.uint8, device=DEVICE)
        return fused_moe.experts(rows, idx, weight, real, w_gate, w_up, w_down, invariant=True)
    rows_alone_and_among_others(run, randn(80, width, dtype=dtype, seed=4))


@pytest.mark.skipif(DEVICE == "cpu", reason="the FMA lowering of exact float32 tiles is the GPU's "
                    "(the interpreter multiplies with numpy, whose order may follow the shape)")
def test_invariant_float32_products_give_the_same_bits_at_any_tile_rows(monkeypatch):
    """Each output element of an exact float32 tile product is one FMA chain over k in order,
    whatever the tile's rows, which is what lets float32's tiles follow a call's rows
    (`tiles.invariant_block_m`): the dense product, the per-head product and the experts give the
    same bits in tiles of 1, 4, 16 and 32 rows."""
    cfg = PRESETS["tiny2"]
    e, ns = cfg.n_routed_experts, cfg.n_shared_experts
    x, w = randn(80, 300), randn(100, 300, seed=1) / 16
    q, w_uk = randn(80, 3, 48, seed=2), randn(3, 48, 80, seed=3)
    w_gate, w_up = (randn(e + ns, 48, 64, seed=s) / 8 for s in (4, 5))
    w_down = randn(e + ns, 64, 48, seed=6) / 8
    h = randn(80, 64, seed=7)
    idx, weight = fused_moe.route(cfg, h, None, torch.eye(e, 64, device=DEVICE), torch.zeros(e, device=DEVICE),
                                  invariant=True)
    real = torch.ones(80, dtype=torch.uint8, device=DEVICE)

    def products(rows: int) -> list[torch.Tensor]:
        monkeypatch.setitem(tiles.INVARIANT_BLOCK_M, torch.float32, rows)
        return [linear.linear(x, w, invariant=True), heads.head_bmm(q, w_uk, False, invariant=True)[0],
                fused_moe.experts(h, idx, weight, real, w_gate, w_up, w_down, invariant=True)]
    first = products(1)
    for rows in (4, 16, 32):
        for name, a, b in zip(("linear", "head_bmm", "experts"), first, products(rows)):
            assert torch.equal(a, b), f"{name}: tiles of {rows} rows change the bits of tiles of 1"


# bf16 on a GPU only: in the interpreter the rounding to bf16 hides the float32-level differences
# a wrong tiling makes (the float32 run is the CPU's check), and each forward costs seconds there
FORWARD_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="bf16 invariant forward: on a GPU (in the interpreter bf16 rounding hides what float32 shows)"))]


@pytest.mark.parametrize("dtype", FORWARD_DTYPES)
def test_invariant_fused_forward_gives_a_token_its_logits_in_any_batch(narrow, dtype):
    """Request 0 (five tokens) prefilled in chunks of 4 and 1 beside request 1 (chunks of 1 and 2,
    its second forward with a padding row) gets bitwise the logits of its tokens fed one at a time
    alone; the logits stay near the unfused forward's (float32: to rounding; bf16: within twice
    the unfused bf16 error); tiny narrowed (a dense layer and a MoE layer: the interpreter runs every
    program)."""
    cfg, weights = narrow("tiny")
    model = Transformer(cfg, weights, device=DEVICE, dtype=dtype, invariant=True, fused=True)
    assert model.fused_forward is not None and model.fused_forward.invariant
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=g).to(DEVICE)
    arange = torch.arange(6, device=DEVICE)

    def forward(cache, chunk: torch.Tensor, starts: list[int], n_new: list[int]) -> torch.Tensor:
        n = chunk.shape[1]
        positions = torch.tensor(starts, device=DEVICE)[:, None] + arange[:n]
        causal = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril().expand(len(starts), n, n)
        return model(chunk, positions, causal, torch.tensor(n_new, device=DEVICE), torch.tensor(starts, device=DEVICE),
                     cache)
    batched = model.new_cache(2, 8)
    first = forward(batched, torch.stack([tokens[0, :4], tokens[1, :4]]), [0, 0], [4, 1])
    second = forward(batched, torch.stack([tokens[0, 4:6], tokens[1, 1:3]]), [4, 1], [1, 2])
    together = torch.cat([first[0, :4], second[0, :1]])
    alone_cache = model.new_cache(1, 8)
    alone = torch.cat([forward(alone_cache, tokens[:1, i:i + 1], [i], [1])[0] for i in range(5)])
    assert torch.equal(together, alone), "request 0's logits differ between the batch and one token at a time"

    def unfused(dtype_: torch.dtype) -> torch.Tensor:
        plain = Transformer(cfg, weights, device=DEVICE, dtype=dtype_)
        return plain(tokens[:1, :5], arange[None, :5], torch.ones(1, 5, 5, dtype=torch.bool, device=DEVICE).tril(),
                     torch.tensor([5], device=DEVICE), torch.tensor([0], device=DEVICE), plain.new_cache(1, 8))[0]
    if dtype == torch.float32:
        close(alone, unfused(torch.float32), torch.float32, ulps=64)
    else:
        exact = unfused(torch.float32)
        plain_error = float((unfused(torch.bfloat16) - exact).abs().max())
        error = float((alone - exact).abs().max())
        assert error <= 2 * plain_error, f"invariant fused bf16 error {error:.3g}, unfused {plain_error:.3g}"
