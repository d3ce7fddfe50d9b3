"""The weight formats DeepSeek-V3 / Kimi K2.x checkpoints ship, decoded exactly (docs/checkpoints.md,
"Dequantization, exactly"). Format decoding, not model math: refgen (importing a checkpoint) and the
engine (loading a fixture that references a checkpoint's tensors, kdtr_format.checkpoint_tensors) share it.

- FP8 with scales, one per block of (b0, b1) elements: an e4m3fn weight q [..., rows, cols] and a
  scale s [..., ceil(rows / b0), ceil(cols / b1)]; the last block of a dimension may be partial:

      w[..., i, j] = float(q[..., i, j]) * s[..., i // b0, j // b1]

  DeepSeek-V3 / R1, Kimi K2: s is the float32 ``weight_scale_inv``, (b0, b1) ``weight_block_size``;
  compressed-tensors ``float-quantized``: s is ``weight_scale``, its block set by the strategy.

- compressed-tensors ``pack-quantized`` INT4 (symmetric, strategy ``group``): ``weight_packed``
  int32 [rows, ceil(cols / 8)], ``weight_scale`` [rows, ceil(cols / g)], shape (rows, cols):

      u = (packed[i, j // 8] >> 4 * (j % 8)) & 0xF        (element j of a row: nibble j % 8 of word j // 8,
      q = u - 8                                              the lowest nibble first; stored with offset 8)
      w[i, j] = q * scale[i, j // g]

Both products are exact in float64 (4 + 24 and 4 + 8 significant bits). `fp8_scaled` and
`int4_packed` compute them in float64 a slab of rows at a time, so temporaries stay small, and
return the result in `dtype`: float64 (exact), or float32 (what a fixture's weights are: exact for
bf16 scales, rounded once for float32 scales).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SLAB_ELEMENTS = 1 << 22            # rows dequantized at a time: about this many elements


class QuantError(ValueError):
    """A quantized tensor (or a quantization_config) kdtree cannot dequantize."""


def fp8_scaled(q: np.ndarray, scale: np.ndarray, block: tuple[int, int],
               dtype: np.dtype = np.float64) -> np.ndarray:
    """q [..., rows, cols] e4m3fn, scale [..., ceil(rows/b0), ceil(cols/b1)] -> w [..., rows, cols]
    in `dtype`: w[..., i, j] = float(q[..., i, j]) * scale[..., i // b0, j // b1], in float64."""
    b0, b1 = block
    if q.dtype != FP8:
        raise QuantError(f"weight dtype is {q.dtype}, expected float8_e4m3fn")
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(scale.shape) != want:
        raise QuantError(f"the scale has shape {list(scale.shape)}, expected {list(want)} "
                         f"for a {list(q.shape)} weight in {b0}x{b1} blocks")
    out = np.empty(q.shape, dtype=dtype)
    step = max(1, SLAB_ELEMENTS // max(1, cols * math.prod(q.shape[:-2])))
    column_block = np.arange(cols) // b1
    with np.errstate(over="ignore", invalid="ignore"):        # a product beyond `dtype`: _finite names it
        for r in range(0, rows, step):
            row_block = np.arange(r, min(r + step, rows)) // b0
            s = np.asarray(scale[..., row_block, :], np.float64)[..., column_block]
            out[..., r:r + step, :] = np.asarray(q[..., r:r + step, :], np.float64) * s
    return _finite(out)


def int4_packed(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group_size: int,
                dtype: np.dtype = np.float64) -> np.ndarray:
    """packed int32 [rows, ceil(cols/8)], scale [rows, ceil(cols/g)], shape (rows, cols) -> w [rows, cols]
    in `dtype`: w[i, j] = (((packed[i, j // 8] >> 4 (j % 8)) & 0xF) - 8) * scale[i, j // g], in float64."""
    rows, cols = shape
    if packed.dtype != np.int32:
        raise QuantError(f"weight_packed dtype is {packed.dtype}, expected int32")
    if tuple(packed.shape) != (rows, math.ceil(cols / 8)):
        raise QuantError(f"weight_packed has shape {list(packed.shape)}, expected {[rows, math.ceil(cols / 8)]} "
                         f"for weight_shape {[rows, cols]} (8 INT4 values an int32)")
    if tuple(scale.shape) != (rows, math.ceil(cols / group_size)):
        raise QuantError(f"weight_scale has shape {list(scale.shape)}, expected "
                         f"{[rows, math.ceil(cols / group_size)]} for weight_shape {[rows, cols]} in groups "
                         f"of {group_size}")
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    out = np.empty((rows, cols), dtype=dtype)
    step = max(1, SLAB_ELEMENTS // max(1, cols))
    with np.errstate(over="ignore", invalid="ignore"):
        for r in range(0, rows, step):
            words = np.asarray(packed[r:r + step]).view(np.uint32)
            q = ((words[..., None] >> shifts) & 0xF).reshape(len(words), -1)[:, :cols].astype(np.float64) - 8.0
            s = np.repeat(np.asarray(scale[r:r + step], np.float64), group_size, axis=-1)[:, :cols]
            out[r:r + step] = q * s
    return _finite(out)


def _finite(w: np.ndarray) -> np.ndarray:
    if not np.isfinite(w).all():
        bad = np.unravel_index(int(np.argmin(np.isfinite(w))), w.shape)
        raise QuantError(f"dequantizes to a non-finite value at {[int(i) for i in bad]}")
    return w
