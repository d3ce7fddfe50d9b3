"""Pieces the fused kernels share: the tile product and the rotary pair.

`INTERPRETED`: the kernels run in Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
Two of its bf16 operations differ from the GPU's (Triton 3.9): its tile product is garbage,
and its float32 -> bf16 conversion truncates. There `dot` multiplies bf16 tiles as float32
(the same arithmetic: a product of two bf16 values is exact in float32) and `cast` rounds to
nearest even by hand, as the GPU's conversion does.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_BY_HAND = tl.constexpr(INTERPRETED)

# Rows a tile in invariant mode's products (linear, head_bmm, the experts' pair blocks): bf16's for
# every call, float32's the most a call's tiles take (`invariant_block_m`). bf16: 64, one wgmma M, so
# a large M streams each weight a quarter as often as 16-row tiles would, at no cost for a decode
# (bandwidth-bound either way); float32: 16, as exact float32 tiles are FMA loops whose cost follows
# the tile.
INVARIANT_BLOCK_M = {torch.bfloat16: 64, torch.float32: 16}


def invariant_block_m(rows: float, dtype: torch.dtype) -> int:
    """Rows a tile of invariant mode's products in a call of `rows` rows (the experts: pairs an
    expert, on average). bf16: INVARIANT_BLOCK_M whatever the call, since the order in which the
    tensor cores add a tile product's terms is theirs, fixed only by a fixed tile. float32: Triton
    lowers an exact float32 tile product to one FMA chain per output element, over k in order,
    whatever the tile, so the rows of a tile change no bit and follow the call: the smallest power
    of two holding its rows, at most INVARIANT_BLOCK_M (the GPU tests check every row count gives
    a row the same bits). In the interpreter (numpy's products) float32 keeps INVARIANT_BLOCK_M."""
    most = INVARIANT_BLOCK_M[dtype]
    if dtype != torch.float32 or INTERPRETED:
        return most
    return min(most, triton.next_power_of_2(max(math.ceil(rows), 1)))


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a b with float32 accumulation; IEEE: float32 tiles as exact float32 (no TF32)."""
    if _BY_HAND:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE or _BY_HAND:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def rope_pair(base, half_idx, inside, cos, sin, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rotary embedding's pairs at base (interleave: 2i, 2i+1; neox: i, i + HALF), rotated
    -> (first offsets, first values, second offsets, second values), float32."""
    if INTERLEAVE:
        first = 2 * half_idx
        second = first + 1
    else:
        first = half_idx
        second = half_idx + HALF
    a = tl.load(base + first, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(base + second, mask=inside, other=0.0).to(tl.float32)
    return first, a * cos - b * sin, second, a * sin + b * cos


@triton.jit
def cast(x, dtype: tl.constexpr):
    """float32 x -> dtype, rounded to nearest even."""
    if _BY_HAND:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)
