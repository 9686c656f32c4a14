"""The finite check every request's input and output go through agrees with numpy's, on both paths."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mlpair.inference.validation import SMALL_ARRAY, all_finite

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=40), elements=FLOAT32))
def test_all_finite_is_numpys_answer_for_float32(x):
    assert all_finite(x) == bool(np.isfinite(x).all())


def test_extremes_that_a_float32_sum_would_overflow_are_still_finite():
    row = np.full((1, 30), np.finfo(np.float32).max, dtype=np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(row.sum(dtype=np.float32))  # a float32 sum would call this row non-finite
    assert all_finite(row) and all_finite(-row)


def test_wider_and_larger_arrays_take_numpys_path_and_agree():
    wide = np.array([[1e308, 1e308]])  # float64: a Python sum would overflow; numpy decides
    assert all_finite(wide)
    large = np.ones((SMALL_ARRAY + 1, 1), dtype=np.float32)
    assert all_finite(large)
    large[-1, 0] = np.nan
    assert not all_finite(large)
    assert not all_finite(np.array([[np.inf, -np.inf]], dtype=np.float32))  # inf + -inf is NaN, not finite
