"""compare_exact (engine/validate/judging/compare.py): equal values of another kind are a FAIL
(True is not 1, nor 1 1.0); integers of other widths, and floats of other widths, compare by value."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.validate.judging.compare import compare_exact
from engine.validate.reports.report import Status


@pytest.mark.parametrize("actual, expected, kinds", [
    (True, 1, "got bool values (bool), expected integer (int64)"),
    (np.array([1, 0, 1], dtype=bool), np.array([1, 0, 1], dtype=np.int32), "got bool values (bool), expected integer"),
    (np.array([1, 2], dtype=np.int64), np.array([1.0, 2.0], dtype=np.float32), "got integer values (int64), expected float"),
    (np.array([1.0, 2.0]), np.array([1, 2], dtype=np.uint32), "got float values (float64), expected integer"),
])
def test_equal_values_of_another_kind_fail(actual, expected, kinds):
    check = compare_exact("s", "next root", actual, expected, "trace t0 round 1")
    assert check.status is Status.FAIL and check.detail.startswith(kinds), check.detail
    assert check.detail.endswith(" (trace t0 round 1)")


@pytest.mark.parametrize("actual, expected", [
    (np.array([3, 4], dtype=np.int32), np.array([3, 4], dtype=np.int64)),
    (np.array([3, 4], dtype=np.uint32), np.array([3, 4], dtype=np.int32)),
    (np.array([0.5, 2.0], dtype=ml_dtypes.bfloat16), np.array([0.5, 2.0], dtype=np.float32)),
    (np.array([True, False]), np.array([True, False])),
    (np.zeros(0), np.zeros(0, dtype=np.int64)),                 # nothing of either kind: an empty path
])
def test_equal_values_of_one_kind_pass(actual, expected):
    assert compare_exact("s", "accepted", actual, expected).status is Status.EXACT
