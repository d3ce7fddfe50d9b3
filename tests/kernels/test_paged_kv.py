"""Paged KV in the CUDA kernels: tree-verify attention through a block table
(`mla_ops.mla_verify_paged`) and KV compaction through one (`tree_ops.compact_kv(...,
block_table)`), against torch references beside them and refgen's `paged_kv` fixture.

The layout (docs/fixtures.md, "paged_kv"): pools c_kv [P, page, R], k_pe [P, page, dr];
block_table int32 [B, W]; request b's slot s is row s % page of page block_table[b, s // page].
`gather` and `reference_compact` below are the torch references; CPU tests tie them to the
fixture (refgen's numpy oracle) and run the argument checks. GPU tests skip without a CUDA
device. Bitwise comparisons with the contiguous layout (`mla_verify`) run every path: the tile
contents (after the zeroing of keys past a split) and the split plan are the same, so the bits
must be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kernels_cuda import tree_ops
from kernels_cuda.mla_ops import (HOPPER_KERNELS, MlaInputError, mla_verify_paged, paged_tensor_cores,
                                  tensor_core_kernel, verify_kernel)
from test_mla_verify import (DIMS, TOLERANCE, Case, assert_close, make_case, random_parents, reference_attention,
                             tree_visibility)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")
PATHS = ("auto", "cuda_cores", "mma", "wgmma_pairs", "invariant")   # mla_verify's plans: default (the fastest
                                            # kernel that takes the inputs), three kernels forced, the invariant plan


def path_flags(path: str) -> dict:
    return {"invariant": True} if path == "invariant" else {"kernel": path}


def skip_unless_runs(path: str, page: int | None = None) -> None:
    here = tensor_core_kernel(torch.device("cuda", torch.cuda.current_device()))
    if path == "mma" and here is None:
        pytest.skip("the mma kernel needs compute capability 8.0")
    if path in HOPPER_KERNELS and here != "wgmma":
        pytest.skip(f"the {path} kernel needs compute capability 9.0 and sm_90a code; this GPU takes {here}")
    if path in HOPPER_KERNELS and page is not None and not paged_tensor_cores(page, path):
        pytest.skip(f"the {path} kernel does not read pages of {page} slots")


# ----------------------------------------------------------------------------- references

def slot_rows(table_row: torch.Tensor, page: int, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the pool viewed as [P * page, .] of a request's slots (int64)."""
    return table_row.long()[slots // page] * page + slots % page


def gather(pool: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """pool [P, page, w], one request's table row [W] -> its slots 0 .. n as [n, w]."""
    rows = slot_rows(table_row, pool.shape[1], torch.arange(n, device=pool.device))
    return pool.reshape(-1, pool.shape[-1])[rows]


def page_in(pool: torch.Tensor, table_row: torch.Tensor, logical: torch.Tensor) -> None:
    """pool [P, page, w] <- logical [n, w] at one request's slots 0 .. n."""
    rows = slot_rows(table_row, pool.shape[1], torch.arange(len(logical), device=pool.device))
    pool.view(-1, pool.shape[-1])[rows] = logical


def reference_compact(pool: torch.Tensor, table_row: torch.Tensor, start: int, path: list[int]) -> None:
    """In place, pool [P, page, w]: slot start + k <- slot start + path[k] for k in increasing order."""
    flat = pool.view(-1, pool.shape[-1])
    rows = slot_rows(table_row.cpu(), pool.shape[1], torch.tensor([start + k for k in range(len(path))] +
                                                                   [start + s for s in path]))
    for k, src in enumerate(path):
        if src > k:
            flat[rows[k]] = flat[rows[len(path) + k]]


def fixture_tensor(f, name: str, key: str) -> torch.Tensor:
    return torch.from_numpy(np.array(f[f"cases/{name}/{key}"]))


def fixture_visibility(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Packed rows [n, words] -> bool [n, n] (bit j % 32 of word j // 32)."""
    j = torch.arange(n)
    return ((bits.long()[:, j // 32] >> (j % 32)) & 1).bool()


def fixture_reference(f, spec: dict, dtype: torch.dtype) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per request of an attention case: (its query rows, o_lat, lse) in float64 from the fixture's
    inputs rounded to `dtype`, the keys gathered through the block table."""
    name, page = spec["name"], spec["page_size"]
    get = lambda key: fixture_tensor(f, name, key).to(dtype).double()   # noqa: E731
    context, sizes, q_off = (fixture_tensor(f, name, k) for k in ("context", "tree_sizes", "q_offsets"))
    table, bits = fixture_tensor(f, name, "block_table"), fixture_tensor(f, name, "visibility_bits").view(torch.int32)
    out = []
    for b in range(spec["batch"]):
        c, n = int(context[b]), int(sizes[b])
        q = slice(int(q_off[b]), int(q_off[b]) + n)
        vis = torch.cat([torch.ones(n, c, dtype=torch.bool), fixture_visibility(bits[q], n)], dim=1)
        keys = [gather(get(pool), table[b], c + n) for pool in ("c_kv_pages", "k_pe_pages")]
        out.append((q, *reference_attention(get("q_lat")[q], get("q_pe")[q], *keys, vis, spec["scale"])))
    return out


def assert_within(got: torch.Tensor, want: torch.Tensor, rule: dict, what: str) -> None:
    """|got - want| <= atol + rtol |want| everywhere (the fixture's rule), naming the worst element."""
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), f"{what}: NaN in the kernel's output"
    excess = (got - want).abs() - (rule["atol"] + rule["rtol"] * want.abs())
    excess = excess.nan_to_num(0.0)         # -inf == -inf (rows that see no key) gives NaN differences
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: element {np.unravel_index(worst, got.shape)} is {got.flatten()[worst]:.6g}, "
                               f"expected {want.flatten()[worst]:.6g} (atol {rule['atol']}, rtol {rule['rtol']})")


# ----------------------------------------------------------------------------- paged batches


@dataclass
class Paged:
    """A case's keys in pools of shuffled pages."""

    c_kv: torch.Tensor          # [P, page, R]
    k_pe: torch.Tensor          # [P, page, dr]
    block_table: torch.Tensor   # [B, W] int32, -1 past each request's last page

    def run(self, case: Case, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_verify_paged(case.q_lat, case.q_pe, self.c_kv, self.k_pe, case.context, case.tree_sizes,
                                case.q_offsets, self.block_table, case.bits, case.scale, **kwargs)


def page_case(case: Case, page: int, seed: int, fill: float = math.nan) -> Paged:
    """`case`'s keys paged: each request holds ceil(keys / page) pages drawn from a shuffled pool
    with 2 spare pages; every row no request holds (spare pages, the tails of last pages) is `fill`;
    each table row has one more column than the longest request needs (left -1)."""
    lengths = [int(c) + int(n) for c, n in zip(case.context.tolist(), case.tree_sizes.tolist())]
    need = [math.ceil(n / page) for n in lengths]
    pages = sum(need) + 2
    order = iter(torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist())
    table = torch.full((len(need), max(need) + 1), -1, dtype=torch.int32)
    for b, count in enumerate(need):
        table[b, :count] = torch.tensor([next(order) for _ in range(count)], dtype=torch.int32)
    device = case.c_kv.device
    table = table.to(device)
    pools = []
    for rows in (case.c_kv, case.k_pe):
        pool = torch.full((pages, page, rows.shape[1]), fill, dtype=rows.dtype, device=device)
        for b, n in enumerate(lengths):
            k0 = int(case.kv_offsets[b])
            page_in(pool, table[b], rows[k0:k0 + n])
        pools.append(pool)
    return Paged(*pools, table)


def mixed_requests(gen: torch.Generator) -> list[tuple[int, torch.Tensor]]:
    """Contexts on and off page and tile boundaries, an empty context, a root-only request."""
    return [(0, tree_visibility(random_parents(7, gen))), (100, tree_visibility(random_parents(40, gen))),
            (1000, tree_visibility(random_parents(13, gen))), (128, tree_visibility([-1]))]


# ----------------------------------------------------------------------------- CPU


def test_references_match_the_fixture(open_golden):
    """The torch references against refgen: attention through `gather` (float32 inputs, float64
    math) within 1e-6 of the fixture; `reference_compact` bit-exact on the whole pools."""
    with open_golden("kernels/paged_kv.kdtr") as f:
        for spec in f.metadata["cases"]:
            name = spec["name"]
            if spec["op"] == "attention":
                for q, o_lat, lse in fixture_reference(f, spec, torch.float32):
                    torch.testing.assert_close(o_lat, fixture_tensor(f, name, "o_lat")[q].double(), rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(lse, fixture_tensor(f, name, "lse")[q], rtol=1e-9, atol=1e-9)
                continue
            table, starts, paths = compact_inputs(f, name)
            for pool_key in ("c_kv", "k_pe"):
                pool = fixture_tensor(f, name, f"{pool_key}_pages")
                for b, path in enumerate(paths):
                    reference_compact(pool, table[b], int(starts[b]), path)
                assert torch.equal(pool, fixture_tensor(f, name, f"{pool_key}_after")), (name, pool_key)


@pytest.mark.parametrize("page,fast", [(1, False), (2, False), (4, False), (8, True), (16, True), (24, False),
                                       (32, True), (48, False), (64, True), (96, False), (128, True), (192, True)])
def test_page_sizes_the_tensor_cores_take(page, fast):
    """wgmma's TMA boxes read whole swizzle periods of one page; mma copies rows, any page."""
    assert paged_tensor_cores(page) is fast and paged_tensor_cores(page, "wgmma") is fast
    assert paged_tensor_cores(page, "mma") and paged_tensor_cores(page, "mma_100k")


def _paged_args(page: int = 4) -> dict:
    """A small valid paged call on the CPU (tiny dims): 2 requests, 7 and 3 keys."""
    case = make_case(DIMS["tiny"], [(4, tree_visibility([-1, 0, 1])), (2, tree_visibility([-1]))],
                     torch.float32, "cpu", seed=1)
    paged = page_case(case, page, seed=2, fill=0.0)
    return dict(q_lat=case.q_lat, q_pe=case.q_pe, c_kv=paged.c_kv, k_pe=paged.k_pe, context=case.context,
                tree_sizes=case.tree_sizes, q_offsets=case.q_offsets, block_table=paged.block_table,
                visibility=case.bits, scale=case.scale)


def _set_table(a: dict, b: int, j: int, value: int) -> None:
    table = a["block_table"].clone()
    table[b, j] = value
    a["block_table"] = table


def _bad_paged_inputs():
    """(label, mutate(args) -> None, message fragment)."""
    def set_(key, value):
        return lambda a: a.__setitem__(key, value(a))
    return [
        ("table int64", set_("block_table", lambda a: a["block_table"].long()), "block_table: dtype"),
        ("table float", set_("block_table", lambda a: a["block_table"].float()), "block_table: dtype"),
        ("table list", set_("block_table", lambda a: a["block_table"].tolist()), "block_table: expected a torch.Tensor"),
        ("table 1-D", set_("block_table", lambda a: a["block_table"][0]), "block_table: shape"),
        ("table rows", set_("block_table", lambda a: a["block_table"][:1]), "block_table: shape"),
        ("table no columns", set_("block_table", lambda a: a["block_table"][:, :0]), "block_table: shape"),
        ("table strided", set_("block_table", lambda a: a["block_table"].t().contiguous().t()), "block_table: must be contiguous"),
        ("c_kv rows", set_("c_kv", lambda a: a["c_kv"].flatten(0, 1)), "c_kv: expected 3 dims"),
        ("k_pe page", set_("k_pe", lambda a: a["k_pe"][:, :-1]), "k_pe: shape"),
        ("page size 0", lambda a: a.update(c_kv=a["c_kv"][:, :0], k_pe=a["k_pe"][:, :0]), "c_kv: a pool of"),
        ("too few columns", set_("block_table", lambda a: a["block_table"][:, :1].contiguous()), "need 2 pages"),
        ("entry -1", lambda a: _set_table(a, 0, 1, -1), r"block_table\[0, 1\] = -1"),
        ("entry past the pool", lambda a: _set_table(a, 1, 0, a["c_kv"].shape[0]), r"block_table\[1, 0\] = "),
        ("trusted maxima, too few columns", lambda a: a.update(max_tree=3, max_kv=4 * a["block_table"].shape[1] + 1),
         "pages per request cannot hold"),
        ("cpu tensors", lambda a: None, "CUDA"),
    ]


@pytest.mark.parametrize("label,mutate,message", _bad_paged_inputs(), ids=[b[0] for b in _bad_paged_inputs()])
def test_bad_paged_input_is_named(label, mutate, message):
    args = _paged_args()
    mutate(args)
    with pytest.raises(MlaInputError, match=message):
        mla_verify_paged(**args)


def test_entries_past_a_requests_pages_are_never_checked():
    """-1 (or any value) after a request's last page is legal: only the pages it needs are read."""
    args = _paged_args()
    _set_table(args, 1, args["block_table"].shape[1] - 1, 10**6)
    with pytest.raises(MlaInputError, match="CUDA"):          # past the value checks: the device is next
        mla_verify_paged(**args)


# ----------------------------------------------------------------------------- GPU: attention


@needs_gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_golden_attention_cases(open_golden, dtype, path):
    """Every attention case of the fixture (K2 dims at pages 64, 16, 1; tiny dims at page 16).
    float32: the fixture's o_lat / lse within its `tolerances`. bf16 (the tensor cores at K2
    dims): within `tolerances_bf16` of the float64 result on the rounded inputs (the fixture's
    values come from float32 inputs; the rounding alone moves o_lat up to 1.5x past
    tolerances_bf16, measured on the CPU), and within 1e-2 of the fixture's o_lat in relative norm.
    The mma and wgmma_pairs plans run the K2 bf16 cases only (the other cases take no tensor-core
    kernel), wgmma_pairs at the pages it reads."""
    if path in ("mma", *HOPPER_KERNELS) and dtype != torch.bfloat16:
        pytest.skip(f"the {path} kernel takes bf16 inputs")
    skip_unless_runs(path)
    with open_golden("kernels/paged_kv.kdtr") as f:
        meta = f.metadata
        for spec in (s for s in meta["cases"] if s["op"] == "attention"):
            pool = fixture_tensor(f, spec["name"], "c_kv_pages")
            if path in ("mma", *HOPPER_KERNELS) and (pool.shape[2] != 512 or not paged_tensor_cores(pool.shape[1], path)):
                continue            # tiny dims: no tensor-core kernel takes them; wgmma reads no page of 1
            name = spec["name"]
            get = lambda key: fixture_tensor(f, name, key).cuda()   # noqa: E731
            o_lat, lse = mla_verify_paged(*(get(k).to(dtype) for k in ("q_lat", "q_pe", "c_kv_pages", "k_pe_pages")),
                                          get("context"), get("tree_sizes"), get("q_offsets"), get("block_table"),
                                          get("visibility_bits").view(torch.int32), spec["scale"], **path_flags(path))
            if dtype == torch.float32:
                assert_within(o_lat, get("o_lat"), meta["tolerances"]["o_lat"], f"{name} o_lat")
                assert_within(lse, get("lse"), meta["tolerances"]["lse"], f"{name} lse")
                continue
            for b, (q, ref_o, ref_lse) in enumerate(fixture_reference(f, spec, dtype)):
                assert_within(o_lat[q], ref_o, meta["tolerances_bf16"]["o_lat"], f"{name} request {b} o_lat")
                assert_within(lse[q], ref_lse, meta["tolerances_bf16"]["lse"], f"{name} request {b} lse")
            want = get("o_lat").double()
            err = ((o_lat.double() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{name}: o_lat relative error {err:.2e} against the fixture"


BITWISE_CONFIGS = [("kimi-k2", torch.bfloat16), ("tiny", torch.float32), ("tiny", torch.bfloat16)]


@needs_gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page", [1, 8, 16, 32, 64, 128, 24])
@pytest.mark.parametrize("dims,dtype", BITWISE_CONFIGS, ids=[f"{d}-{str(t)[6:]}" for d, t in BITWISE_CONFIGS])
def test_paged_equals_contiguous_bitwise(dims, dtype, page, path):
    """The same logical keys, contiguous and in shuffled pages with NaN in every unread row: the
    same bits from the same kernel (with "auto", the one the paged call takes: wgmma for pages
    8 .. 128 on Hopper, mma for the others and on other GPUs, the CUDA cores off K2 bf16), and
    right against the reference."""
    if path in ("mma", *HOPPER_KERNELS) and (dims, dtype) != ("kimi-k2", torch.bfloat16):
        pytest.skip(f"the {path} kernel takes K2 dims in bf16")
    skip_unless_runs(path, page)
    gen = torch.Generator().manual_seed(page)
    case = make_case(DIMS[dims], mixed_requests(gen), dtype, "cuda", seed=page + 1)
    paged = page_case(case, page, seed=page + 2)
    flags = path_flags(path)
    kernel = verify_kernel(dtype, *DIMS[dims][1:], case.q_lat.device, page) if path == "auto" else path
    got = paged.run(case, **flags)
    want = case.run(**flags) if path == "invariant" else case.run(kernel=kernel)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"paged and contiguous bits differ ({kernel})"
    if kernel not in ("cuda_cores", "invariant"):   # the tensor cores really ran: other bits than the CUDA cores'
        assert not torch.equal(got[0], case.run(kernel="cuda_cores")[0]), f"page {page}: {kernel} gave the CUDA cores' bits"
    assert_close(case, *got, TOLERANCE[dtype])


LEAK_PATHS = [("kimi-k2", torch.bfloat16, "auto"), ("kimi-k2", torch.bfloat16, "mma"),
              ("kimi-k2", torch.bfloat16, "wgmma_pairs"), ("kimi-k2", torch.bfloat16, "cuda_cores"),
              ("tiny", torch.float32, "cuda_cores")]


@needs_gpu
@pytest.mark.parametrize("split_keys", [64, 192])
@pytest.mark.parametrize("page", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("dims,dtype,kernel", LEAK_PATHS,
                         ids=["k2-auto", "k2-mma", "k2-wgmma-pairs", "k2-cuda-cores", "tiny-cuda-cores"])
def test_unread_rows_never_leak(dims, dtype, kernel, page, split_keys):
    """NaN in every pool row no request reads (spare pages, last pages' tails) and splits that end
    inside pages: the outputs are finite and right; every split and output written (NaN-poisoned
    outputs). The tensor-core kernels load whole tiles past a split's end (wgmma: boxes whose first
    slot lies past it load the last key's page; mma: zero-filled rows)."""
    skip_unless_runs(kernel, page)
    gen = torch.Generator().manual_seed(31)
    case = make_case(DIMS[dims], [(70, tree_visibility(random_parents(9, gen))), (3, tree_visibility([-1, 0])),
                                  (250, tree_visibility([-1]))], dtype, "cuda", seed=32)
    paged = page_case(case, page, seed=33)
    total, heads, kv_lora = case.q_lat.shape
    o_lat = torch.full((total, heads, kv_lora), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((total, heads), math.nan, dtype=torch.float32, device="cuda")
    torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, paged.c_kv, paged.k_pe, case.context, case.tree_sizes,
                                    case.q_offsets, None, case.bits, case.scale, 9, math.ceil(251 / split_keys),
                                    split_keys, kernel, o_lat, lse, paged.block_table)
    assert_close(case, o_lat, lse, TOLERANCE[dtype])


@needs_gpu
def test_paged_argument_errors_on_the_gpu():
    case = make_case(DIMS["kimi-k2"], [(100, tree_visibility([-1, 0]))], torch.bfloat16, "cuda", seed=3)
    paged = page_case(case, 64, seed=4)
    with pytest.raises(MlaInputError, match="block_table: on cpu"):
        Paged(paged.c_kv, paged.k_pe, paged.block_table.cpu()).run(case)
    o_lat, lse = torch.empty_like(case.q_lat), torch.empty(case.q_lat.shape[:2], device="cuda")
    if tensor_core_kernel(case.q_lat.device) == "wgmma":
        from kernels_cuda._lib import KernelError      # a box of 64 rows would cross a page at slot 128
        with pytest.raises(KernelError, match="kdtree_mla_verify failed: bad shape"):
            torch.ops.kdtree.mla_verify_out(case.q_lat, case.q_pe, paged.c_kv, paged.k_pe, case.context,
                                            case.tree_sizes, case.q_offsets, None, case.bits, case.scale, 2, 2, 96,
                                            "wgmma", o_lat, lse, paged.block_table)
    else:
        with pytest.raises(MlaInputError, match="kernel 'wgmma' runs on compute capability 9.0"):
            paged.run(case, kernel="wgmma")


# ----------------------------------------------------------------------------- compaction


def compact_inputs(f, name: str) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A compaction case's block table, starts and per-request accepted paths."""
    flat, offsets = fixture_tensor(f, name, "accepted").tolist(), fixture_tensor(f, name, "accept_offsets").tolist()
    paths = [flat[offsets[b]:offsets[b + 1]] for b in range(len(offsets) - 1)]
    return fixture_tensor(f, name, "block_table"), fixture_tensor(f, name, "starts"), paths


def padded_paths(paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> accepted int64 [B, a_max] (padding -1), accept_len int64 [B]."""
    accepted = torch.full((len(paths), max(map(len, paths))), -1, dtype=torch.int64)
    for b, path in enumerate(paths):
        accepted[b, :len(path)] = torch.tensor(path)
    return accepted, torch.tensor([len(p) for p in paths])


def untouchable_pages(table: torch.Tensor, pages: int) -> dict[int, str]:
    """Pages compaction must leave alone, with why: held by two requests, or by none."""
    held = table[table >= 0].tolist()
    counts = {p: held.count(p) for p in set(held)}
    return {p: ("shared" if counts.get(p, 0) > 1 else "unused") for p in range(pages) if counts.get(p, 0) != 1}


def assert_pages_unchanged(before: torch.Tensor, after: torch.Tensor, pages: dict[int, str], what: str) -> None:
    """before / after [layers, P, page, w]: every listed page bit-identical in every layer."""
    changed = [f"{why} page {p}" for p, why in pages.items() if not torch.equal(before[:, p], after[:, p])]
    assert not changed, f"{what}: compaction wrote {', '.join(changed)}"


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_golden_compaction_cases(open_golden, dtype):
    """Every compaction case (pages 1, 16, 64; shared prefix pages; non-prefix paths) in one
    launch over two layers: layer 0 the fixture's pools, bit-exact with its pools after; layer 1
    other data, bit-exact with `reference_compact`; shared and unused pages unchanged, named."""
    with open_golden("kernels/paged_kv.kdtr") as f:
        for spec in (s for s in f.metadata["cases"] if s["op"] == "compact"):
            name = spec["name"]
            table, starts, paths = compact_inputs(f, name)
            accepted, accept_len = padded_paths(paths)
            gen = torch.Generator().manual_seed(len(name))
            caches, wants = [], []
            for key in ("c_kv", "k_pe"):
                pool = fixture_tensor(f, name, f"{key}_pages").to(dtype)
                other = torch.randn(pool.shape, generator=gen).to(dtype)
                cache = torch.stack([pool, other])                      # [2, P, page, w]
                want = torch.stack([fixture_tensor(f, name, f"{key}_after").to(dtype), other.clone()])
                for b, path in enumerate(paths):
                    reference_compact(want[1], table[b], int(starts[b]), path)
                caches.append(cache)
                wants.append(want)
            got = [c.cuda() for c in caches]
            tree_ops.compact_kv(*got, starts.cuda(), accepted.cuda(), accept_len.cuda(), block_table=table.cuda())
            for key, before, g, want in zip(("c_kv", "k_pe"), caches, got, wants):
                assert_pages_unchanged(before, g.cpu(), untouchable_pages(table, before.shape[1]), f"{name} {key}")
                assert torch.equal(g.cpu(), want), f"{name} {key}: pools after compaction differ"


def shared_prefix_batch(page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], int]:
    """4 requests in shuffled pages; 0 and 1 share their first 2 pages, 2 and 3 their first one
    (context slots only); trees of 20 tokens after each context; random increasing paths from
    the root (non-prefix). -> (block_table [4, W], starts [4], paths, P)."""
    rng = np.random.default_rng(seed)
    starts = [2 * page + 5, 2 * page + 1, page + 3, page]
    need = [math.ceil((s + 20) / page) for s in starts]
    shared = {1: (0, 2), 3: (2, 1)}                       # request -> (sharing with, pages)
    pages = sum(need) - 3 + 2                             # 2 spare pages
    order = iter(rng.permutation(pages).tolist())
    table = torch.full((4, max(need) + 2), -1, dtype=torch.int32)
    for b, count in enumerate(need):
        other, n_shared = shared.get(b, (b, 0))
        for j in range(count):
            table[b, j] = table[other, j] if j < n_shared else next(order)
    paths = []
    for _ in starts:
        nodes = sorted(rng.choice(np.arange(1, 20), size=int(rng.integers(0, 8)), replace=False).tolist())
        paths.append([0, *nodes])
    return table, torch.tensor(starts), paths, pages


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_compaction_writes_only_its_own_tree_slots(page, dtype):
    """Shared prefix pages and pages out of order, 3 layers: the only rows that change are each
    request's destination slots start + k (k with accepted[k] > k), through its own table; every
    other row, every shared and every unused page stays bit-identical (a page another request
    reads is never written). As a CUDA graph replay too (the op reads nothing back to the host)."""
    table, starts, paths, pages = shared_prefix_batch(page, seed=page)
    accepted, accept_len = padded_paths(paths)
    gen = torch.Generator().manual_seed(page)
    before = [torch.randn(3, pages, page, w, generator=gen).to(dtype) for w in (64, 16)]
    want = [c.clone() for c in before]
    written = torch.zeros(pages * page, dtype=torch.bool)
    for b, path in enumerate(paths):
        for cache in want:
            for layer in range(3):
                reference_compact(cache[layer], table[b], int(starts[b]), path)
        moved = [k for k, src in enumerate(path) if src > k]
        written[slot_rows(table[b], page, torch.tensor([int(starts[b]) + k for k in moved], dtype=torch.long))] = True
    args = (starts.cuda(), accepted.cuda(), accept_len.cuda())
    for mode in ("eager", "graph"):
        got = [c.cuda() for c in before]
        if mode == "eager":
            tree_ops.compact_kv(*got, *args, block_table=table.cuda())
        else:
            graph = torch.cuda.CUDAGraph()
            side = [c.clone() for c in got]
            tree_ops.compact_kv(*side, *args, block_table=table.cuda())       # warm-up outside the capture
            table_dev = table.cuda()
            with torch.cuda.graph(graph):
                tree_ops.compact_kv(*got, *args, block_table=table_dev)
            graph.replay()
        for key, b4, g, w in zip(("c_kv", "k_pe"), before, got, want):
            g = g.cpu()
            assert_pages_unchanged(b4, g, untouchable_pages(table, pages), f"{mode} {key}")
            changed = (g != b4).any(-1).any(0).flatten()                               # [P * page] rows
            stray = (changed & ~written).nonzero().flatten().tolist()
            assert not stray, f"{mode} {key}: rows {[(r // page, r % page) for r in stray]} (page, slot) written"
            assert torch.equal(g, w), f"{mode} {key}: pools after compaction differ from the reference"


@needs_gpu
def test_paged_compaction_argument_errors():
    pools = torch.zeros(1, 4, 16, 8, device="cuda"), torch.zeros(1, 4, 16, 2, device="cuda")
    two = torch.tensor([1, 2], device="cuda")
    accepted = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="block_table: expected dtype"):
        tree_ops.compact_kv(*pools, two, accepted, two, block_table=table.long())
    with pytest.raises(ValueError, match="block_table: expected 2 dims"):
        tree_ops.compact_kv(*pools, two, accepted, two, block_table=table[0])
    with pytest.raises(ValueError, match="block_table: expected a CUDA tensor"):
        tree_ops.compact_kv(*pools, two, accepted, two, block_table=table.cpu())
    with pytest.raises(ValueError, match=r"block_table: expected \[B, W >= 1\]"):
        tree_ops.compact_kv(*pools, two, accepted, two, block_table=table[:, :0].contiguous())
    with pytest.raises(ValueError, match="starts: expected shape"):
        tree_ops.compact_kv(*pools, two, accepted, two, block_table=table[:1].contiguous())
    with pytest.raises(ValueError, match="c_kv: pages of 0 slots"):
        tree_ops.compact_kv(pools[0][:, :, :0], pools[1][:, :, :0], two, accepted, two, block_table=table)
