"""The bf16 error model: tolerances and near-tie thresholds for engines that compute in bfloat16;
and the float32 engines' logits tolerance (FLOAT32_LOGIT_*: the model fixtures' `tolerances`).

Measured on 2026-12-01 (this project's 2-core CPU machine; docs/precision.md has the
table, tests/bf16_error_model.py reruns it) with the built-in engine in bfloat16 against
the float64 reference on the same bf16-rounded weights, seeded weights and prompts, the
tiny and tiny2 presets at 1 to 8 layers and Kimi K2's attention dims at 1 and 2 layers:

- logits: beyond the final rounding of each logit to bf16 (2^-8 relative), the error of
  a row whose routing cannot have flipped is at most BF16_LOGIT_ERROR x logit_scale x
  sqrt(layers) (largest measured: 0.0209; it grows like the square root of the depth
  and in proportion to the logit scale);
- routing: the engine's gap between the two experts at the reference's selection
  boundary is off by at most BF16_ROUTING_GAP_ERROR (7.67e-3 measured; no growth with
  depth seen from MoE layer 0 to 7).

Tolerances are BF16_TOLERANCE_MULTIPLE times those bounds. A greedy decision can flip
only when its margin is below twice the logit tolerance (top-1 and top-2 each off by
it); a routing decision only when its gap is below the routing-gap tolerance.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

BF16_UNIT_ROUNDOFF = 2.0 ** -8       # the relative error of one rounding to bf16
BF16_LOGIT_ERROR = 0.021             # max logit error / (logit_scale sqrt(layers)), beyond the final rounding
BF16_ROUTING_GAP_ERROR = 7.7e-3      # max error of a selection-score gap
BF16_TOLERANCE_MULTIPLE = 2.0
FLOAT32_LOGIT_ATOL = 1e-4            # float32 logits: atol = FLOAT32_LOGIT_ATOL x logit_scale
FLOAT32_LOGIT_RTOL = 1e-5


@dataclass(frozen=True)
class Bf16Bounds:
    """A bf16 model case's tolerances. Logits pass when |actual - expected| <= logits_atol +
    logits_rtol |expected|; a greedy divergence whose reference margin is below margin_threshold,
    and any row reached by a routing decision whose gap is below routing_threshold, is a near-tie."""

    logits_atol: float
    logits_rtol: float
    margin_threshold: float
    routing_threshold: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bf16_bounds(logit_scale: float, layers: int, largest_logit: float) -> Bf16Bounds:
    """The bounds of a model of `layers` layers whose logits have standard deviation `logit_scale`
    and magnitudes up to `largest_logit` (the top-1 logits the margins are taken at)."""
    atol = BF16_TOLERANCE_MULTIPLE * BF16_LOGIT_ERROR * logit_scale * math.sqrt(layers)
    rtol = BF16_TOLERANCE_MULTIPLE * BF16_UNIT_ROUNDOFF
    return Bf16Bounds(logits_atol=atol, logits_rtol=rtol, margin_threshold=2 * (atol + rtol * abs(largest_logit)),
                      routing_threshold=BF16_TOLERANCE_MULTIPLE * BF16_ROUTING_GAP_ERROR)
