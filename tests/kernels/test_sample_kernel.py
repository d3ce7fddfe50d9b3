"""The sampling-choice kernel (kernels_cuda.tree_ops.sample_choices) against refgen's numpy oracle.

Reference beside the kernel: `refgen.ddtree.sample_choices` (inverse CDF in float64, numpy's
sequential cumsum) on the same logits (as float64 values of the given dtype), temperature and
uniforms; the chosen ids must be equal. Random uniforms, uniforms near every kind of boundary,
and the adversarial ones (exactly 0, exactly a CDF boundary, 1 - 2^-53, zero-probability ids
next to every boundary) where the boundaries are exact in float64, so every implementation of
the contract agrees on them. Where a boundary is not exact in float64, a uniform within NEAR of
it is a near tie (NOTES-tree.md: the kernel's cdf and numpy's sequential cumsum differ by
rounding, ~1e-13 at V = 163840): there the kernel may take the id on either side. GPU tests skip without a CUDA device; argument checks run on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_bench import capture_graph
from kernels_cuda import tree_ops
from refgen import ddtree as ref
from test_tree_kernels import poison_cuda_allocator

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none visible to torch")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TILE = 256                     # ids per tile in csrc/tree_sample.cu; a lane owns 8 consecutive ids
ONE_BELOW_1 = 1.0 - 2.0**-53   # the largest double below 1
NEAR = 1e-12                   # a uniform this close to a cdf boundary that float64 does not hold exactly


def refgen_choices(logits: torch.Tensor, temperature: float, uniforms: np.ndarray) -> np.ndarray:
    """logits [rows, V] of any dtype, uniforms float64 [rows] -> refgen's choices [rows]."""
    return ref.sample_choices(logits.double().cpu().numpy(), temperature, uniforms)


def kernel_choices(logits: torch.Tensor, temperature: float, uniforms: np.ndarray) -> np.ndarray:
    """The op on the GPU, its output over poisoned memory, rows reshaped to [2, rows / 2] when even."""
    rows, vocab = logits.shape
    shape = (2, rows // 2) if rows % 2 == 0 else (rows,)
    x = logits.cuda().reshape(*shape, vocab)
    u = torch.from_numpy(np.ascontiguousarray(uniforms, dtype=np.float64)).cuda().reshape(shape)
    poison_cuda_allocator()
    choices = tree_ops.sample_choices(x, temperature, u)
    assert choices.shape == shape and choices.dtype == torch.int64
    return choices.reshape(rows).cpu().numpy()


def cdf(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """The contract's cdf per row, float64 [rows, V] (to place uniforms near boundaries, and to
    tell near ties)."""
    return np.cumsum(np.exp(ref.log_softmax(logits.double().cpu().numpy() / temperature)), axis=1)


def assert_choices_match_refgen(logits: torch.Tensor, temperature: float, uniforms: np.ndarray) -> None:
    """The kernel's choices are refgen's, except at a near tie: a row whose uniform lies within NEAR
    of the two ends of the kernel's id's cdf interval may take that id, if its probability is > 0."""
    got, want = kernel_choices(logits, temperature, uniforms), refgen_choices(logits, temperature, uniforms)
    p = np.exp(ref.log_softmax(logits.double().cpu().numpy() / temperature))
    c = np.cumsum(p, axis=1)
    for r in np.flatnonzero(got != want):
        i, u = int(got[r]), float(uniforms[r])
        low = c[r, i - 1] if i > 0 else 0.0
        near = 0 <= i < c.shape[1] and p[r, i] > 0 and low - NEAR <= u < c[r, i] + NEAR
        assert near, f"row {r}: u {u!r}: kernel {i}, refgen {int(want[r])}, not a near tie"


# ----------------------------------------------------------------------------- random rows


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 4099, 163840])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_random_rows_match_refgen(dtype: torch.dtype, vocab: int, temperature: float) -> None:
    """16 rows: random uniforms and uniforms 1e-9 (relative) either side of a boundary of the cdf.
    V = 4099 and 7 take the scalar loads, 255 / 257 end in a partial tile."""
    rng = np.random.default_rng(vocab * 10 + int(temperature * 10))
    logits = torch.from_numpy(3.0 * rng.standard_normal((16, vocab))).to(dtype)
    uniforms = rng.random(16)
    boundaries = cdf(logits, temperature)
    for r in range(8, 16):                                  # near the cdf of a random id, both sides
        c = rng.integers(0, vocab)
        uniforms[r] = min(boundaries[r, c] * (1 + 1e-9 if r % 2 else 1 - 1e-9), ONE_BELOW_1)
    assert_choices_match_refgen(logits, temperature, uniforms)


@needs_gpu
@pytest.mark.parametrize("pattern", ["peaked", "masked tail", "masked head", "tiny", "huge / small T"])
def test_skewed_rows_match_refgen(pattern: str) -> None:
    """Rows whose mass sits in one place, rows with -inf runs (whole tiles of zero mass), logits
    of 1e4 at temperature 0.01 (x = 1e6: large arguments to exp)."""
    rng = np.random.default_rng(len(pattern))
    vocab, temperature = 163840, 0.01 if pattern == "huge / small T" else 1.0
    x = rng.standard_normal((12, vocab))
    if pattern == "peaked":
        x[:, rng.integers(0, vocab, 12)] = 40.0
    elif pattern == "masked tail":
        x[:, 1000:] = -np.inf
    elif pattern == "masked head":
        x[:, : vocab - 700] = -np.inf
    elif pattern == "tiny":
        x = x * 1e-3 - 500.0
    else:
        x = 1e4 + x
    logits = torch.from_numpy(x).float()
    uniforms = np.concatenate([rng.random(8), [0.0, 0.5, ONE_BELOW_1, 1e-300]])
    assert_choices_match_refgen(logits, temperature, uniforms)


# ----------------------------------------------------------------------------- adversarial uniforms


def dyadic_row(vocab: int, positives: list[int], zero: float) -> np.ndarray:
    """Logit 0 at `positives` (each p = 1 / len(positives), exact for 1, 2, 4 or 16 of them),
    `zero` (-inf, or finite but exp underflows: p = 0 exactly) everywhere else."""
    row = np.full(vocab, zero)
    row[positives] = 0.0
    return row


ADVERSARIAL = [
    # V, ids with p > 0 (at tile and lane starts and ends, and in the last tile)
    (300, [5]),
    (300, [0, 299]),
    (163840, [8, 255, 256, 4097]),
    (163840, [0, 7, 8, 255, 256, 257, 1000, 2047, 2048, 40000, 40001, 99999, 131072, 163583, 163584, 163839]),
    (4099, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 4096, 4098]),
]


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab, positives", ADVERSARIAL, ids=lambda v: str(v) if isinstance(v, int) else f"{len(v)}ids")
@pytest.mark.parametrize("zero", [-np.inf, -3000.0], ids=["-inf", "underflow"])
def test_adversarial_uniforms(dtype: torch.dtype, vocab: int, positives: list[int], zero: float) -> None:
    """u = 0 -> the first id with p > 0; u = c / k, exactly the cdf boundary after the c-th
    positive id -> the next positive id (never a zero-probability id between them: the `<=`
    bug); just below it -> the c-th; 1 - 2^-53 -> the last id with p > 0. Temperature 0.7."""
    k = len(positives)
    boundaries = [c / k for c in range(1, k)]
    uniforms = np.array([0.0, *boundaries, *(np.nextafter(b, 0.0) for b in boundaries), ONE_BELOW_1])
    want = np.array([positives[0], *positives[1:], *positives[:-1], positives[-1]])
    logits = torch.from_numpy(np.tile(dyadic_row(vocab, positives, zero), (len(uniforms), 1))).to(dtype)
    np.testing.assert_array_equal(refgen_choices(logits, 0.7, uniforms), want)     # the construction
    np.testing.assert_array_equal(kernel_choices(logits, 0.7, uniforms), want)


@needs_gpu
def test_tiny_positive_probability_is_chosen_at_zero() -> None:
    """p = e^-702 / 16 > 0 (a normal double): u = 0 takes that id, not the next one."""
    row = dyadic_row(5000, [100, 200, 300, 400], -np.inf)
    row[3] = -700.0
    logits = torch.from_numpy(np.tile(row, (4, 1)))
    uniforms = np.array([0.0, 1e-300, 0.25, ONE_BELOW_1])
    want = refgen_choices(logits, 1.0, uniforms)
    assert want.tolist() == [3, 100, 200, 400]
    np.testing.assert_array_equal(kernel_choices(logits, 1.0, uniforms), want)


@needs_gpu
def test_zero_probability_never_chosen_at_rounding_boundaries() -> None:
    """Every 8th id (each tile's and each lane's first) has p = 0. Uniforms sweep +-32 ulps
    around the cdf at every tile boundary and every lane boundary of the first tiles, where the
    kernel's prefix sums and its in-tile sums round differently: the chosen id always has p > 0
    and is the reference's or a neighbour (a rounding-level difference)."""
    rng = np.random.default_rng(3)
    vocab = 16 * TILE
    x = rng.standard_normal(vocab)
    x[::8] = -np.inf
    boundary_ids = [*range(TILE - 1, vocab - 1, TILE), *range(7, 2 * TILE, 8)]
    edges = cdf(torch.from_numpy(x[None]), 1.0)[0, boundary_ids]
    uniforms = np.concatenate([edges + s * np.spacing(edges) for s in range(-32, 33)])
    uniforms = uniforms[uniforms < 1.0]
    logits = torch.from_numpy(np.tile(x, (len(uniforms), 1))).float()
    got = kernel_choices(logits, 1.0, uniforms)
    assert np.isfinite(x[got]).all(), f"zero-probability ids chosen: {sorted(set(got[~np.isfinite(x[got])]))}"
    assert np.abs(got - refgen_choices(logits, 1.0, uniforms)).max() <= 2


@needs_gpu
def test_rows_the_contract_has_no_answer_for() -> None:
    """-1 for a NaN logit, +inf, all -inf, u = 1, u < 0, u NaN; the other rows of the launch are
    unaffected; u = -0.0 is a valid 0."""
    row = np.random.default_rng(0).standard_normal(1000)
    rows = np.tile(row, (8, 1))
    rows[0, 17] = np.nan
    rows[1, 500] = np.inf
    rows[2] = -np.inf
    uniforms = np.array([0.5, 0.5, 0.5, 1.0, -1e-300, np.nan, -0.0, 0.5])
    got = kernel_choices(torch.from_numpy(rows), 1.0, uniforms)
    assert got[:6].tolist() == [-1] * 6
    np.testing.assert_array_equal(got[6:], refgen_choices(torch.from_numpy(rows[6:]), 1.0, np.array([0.0, 0.5])))


# ----------------------------------------------------------------------------- as a torch op


@needs_gpu
def test_replays_in_a_cuda_graph_and_passes_opcheck() -> None:
    """Captured once, replayed on new logits and uniforms in place: equal to eager; opcheck
    covers the fake (meta) implementation and the schema."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(3, 5, 20000, device="cuda", generator=gen).bfloat16()
    uniforms = torch.rand(3, 5, device="cuda", dtype=torch.float64, generator=gen)
    graph, captured = capture_graph(lambda: tree_ops.sample_choices(logits, 0.8, uniforms))
    logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
    uniforms.copy_(torch.rand(uniforms.shape, device="cuda", dtype=torch.float64, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, tree_ops.sample_choices(logits, 0.8, uniforms))
    torch.library.opcheck(torch.ops.kdtree.sample_choices.default, (logits, 0.8, uniforms))


@needs_gpu
def test_cuda_stages_sample_with_the_kernel(monkeypatch) -> None:
    """CudaStages.sample_choices on the kernel equals TorchStages' torch path on the same GPU
    tensors, and reports a bad uniform as the torch path does."""
    from engine.cuda_stages import CudaStages
    from engine.stages import TorchStages

    monkeypatch.setattr(tree_ops, "SAMPLE_KERNEL", True)
    rng = np.random.default_rng(9)
    logits = torch.from_numpy(2 * rng.standard_normal((3, 7, 3000))).float().cuda()
    logits[1, 2, 100:] = -math.inf
    uniforms = torch.from_numpy(rng.random((3, 7))).cuda()
    uniforms[0, 0], uniforms[2, 6] = 0.0, ONE_BELOW_1
    got = CudaStages().sample_choices(logits, 0.7, uniforms)
    assert torch.equal(got, TorchStages().sample_choices(logits, 0.7, uniforms))
    uniforms[1, 1] = 1.0
    with pytest.raises(ValueError, match=r"uniforms: every value must lie in \[0, 1\)"):
        CudaStages().sample_choices(logits, 0.7, uniforms)


def test_errors_name_the_problem() -> None:
    u = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits: expected a CUDA tensor"):
        tree_ops.sample_choices(torch.zeros(2, 5), 1.0, u)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        tree_ops.sample_choices(torch.zeros(2, 5, dtype=torch.int32), 1.0, u)
    with pytest.raises(ValueError, match="logits: must be contiguous"):
        tree_ops.sample_choices(torch.zeros(5, 2).t(), 1.0, u)


@needs_gpu
@pytest.mark.parametrize("temperature, uniforms, message", [
    (0.0, torch.zeros(2, dtype=torch.float64), "temperature: sampling needs a finite temperature > 0"),
    (math.inf, torch.zeros(2, dtype=torch.float64), "temperature"),
    (math.nan, torch.zeros(2, dtype=torch.float64), "temperature"),
    (1.0, torch.zeros(2), "uniforms: expected dtype torch.float64"),
    (1.0, torch.zeros(3, dtype=torch.float64), r"uniforms: expected shape \[2\]"),
    (1.0, torch.zeros(1, 2, dtype=torch.float64), "uniforms: expected 1 dims"),
])
def test_bad_arguments_on_gpu(temperature: float, uniforms: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tree_ops.sample_choices(torch.zeros(2, 5, device="cuda"), temperature, uniforms.cuda())


@needs_gpu
def test_vocabulary_limit() -> None:
    with pytest.raises(ValueError, match="at most 1048576 ids"):
        tree_ops.sample_choices(torch.zeros(1, 2**20 + 1, device="cuda"), 1.0, torch.zeros(1, device="cuda").double())
