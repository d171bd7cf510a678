"""The tolerance rule (harness/numerics/tolerance.py) does what its docstring says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from harness.numerics.tolerance import (
  RTOL,
  RTOL_SOFT_CAP,
  assert_within_tolerance,
  check_tolerance,
  noise_floor,
  rtol_for,
)
from kernel.call import bfloat16, float16, float32

DTYPES = (bfloat16, float16, float32)


def test_constants():
  assert (RTOL, RTOL_SOFT_CAP) == (2.0, 3.0)
  assert rtol_for(None) == RTOL and rtol_for(5.0) == RTOL_SOFT_CAP


@given(st.sampled_from(DTYPES), st.integers(0, 2**32 - 1),
       st.floats(0.0, 0.999), st.sampled_from((1.0, 2.0, 3.0)))
def test_bound_is_rtol_times_naive_error_plus_floor(dtype, seed, fraction, rtol):
  """An error at fraction <= 1 of the bound passes, just above it fails, and
  the report's numbers are the rule's."""
  rng = np.random.default_rng(seed)
  ref = rng.standard_normal((3, 5, 7))
  naive = ref.astype(dtype).astype(np.float64)
  naive_error = float(np.abs(naive - ref).max())
  floor = noise_floor(ref, dtype)
  bound = rtol * naive_error + floor
  idx = tuple(rng.integers(0, s) for s in ref.shape)
  actual = ref.copy()
  actual[idx] += fraction * bound
  report = check_tolerance(actual, ref, naive, dtype, rtol=rtol)
  note(str(report))
  assert report.naive_error == naive_error
  assert report.noise_floor == floor
  assert report.bound == bound
  assert report.passed
  actual[idx] = ref[idx] + bound * 1.01 + 1e-300
  report = check_tolerance(actual, ref, naive, dtype, rtol=rtol)
  assert not report.passed and report.worst_index == idx
  assert report.ratio > 1


def test_noise_floor_is_two_ulps_of_the_dtype_near_the_value():
  """2 * max|(ref + 0.3 - 0.3) - ref| in the dtype: larger for coarser dtypes,
  zero for an empty or non-finite reference."""
  ref = np.linspace(-3, 3, 101)
  floors = [noise_floor(ref, dt) for dt in (float32, float16, bfloat16)]
  assert 0 < floors[0] < floors[1] < floors[2]
  assert floors[2] <= 2 * 2 ** -6  # ~two bf16 ulps at 3.3
  assert noise_floor(np.array([np.inf, -np.inf, np.nan]), bfloat16) == 0.0


def test_noise_floor_does_not_vanish_on_small_arrays():
  """A few values that survive the +0.3 - 0.3 round trip exactly still get a
  floor of one dtype ulp at their largest magnitude."""
  for dtype, ulp in ((bfloat16, 2.0 ** -7), (float16, 2.0 ** -10)):
    ref = np.array([1.0, 1.5])
    assert noise_floor(ref, dtype) >= ulp


def test_infinities_must_match_exactly():
  ref = np.array([1.0, -np.inf, np.inf])
  ok = check_tolerance(ref.copy(), ref, ref, bfloat16, name="m")
  assert ok.passed and ok.max_error == 0.0
  for bad in ([1.0, -1e30, np.inf], [1.0, np.inf, np.inf], [1.0, np.nan, np.inf],
              [1.0, -np.inf, -np.inf]):
    report = check_tolerance(np.array(bad), ref, ref, bfloat16, name="m")
    assert not report.passed and report.nonfinite_mismatches == 1, bad


def test_nan_in_actual_fails_and_nan_in_reference_must_propagate():
  ref = np.array([[1.0, 2.0], [np.nan, 4.0]])
  actual = ref.copy()
  assert check_tolerance(actual, ref, ref, float16).passed
  actual[0, 1] = np.nan
  report = check_tolerance(actual, ref, ref, float16)
  assert not report.passed and report.first_nonfinite_mismatch == (0, 1)
  actual = ref.copy()
  actual[1, 0] = 3.0  # the reference says NaN
  assert not check_tolerance(actual, ref, ref, float16).passed


def test_non_finite_naive_entries_do_not_inflate_the_bound():
  ref = np.array([1.0, 2.0, 3.0])
  naive = np.array([1.0, np.inf, 3.0])
  report = check_tolerance(ref + 0.5, ref, naive, bfloat16)
  assert report.naive_error == 0.0 and not report.passed


def test_assert_within_tolerance_message():
  ref = np.zeros((2, 3))
  actual = ref.copy()
  actual[1, 2] = 0.5
  with pytest.raises(AssertionError) as info:
    assert_within_tolerance(actual, ref, ref, bfloat16, name="dq")
  message = str(info.value)
  for part in ("dq", "max error 0.5", "bound", "ratio", "(1, 2)"):
    assert part in message, (part, message)
  assert assert_within_tolerance(ref, ref, ref, bfloat16).passed


def test_shape_mismatch_is_a_value_error():
  with pytest.raises(ValueError, match="out: shapes differ"):
    check_tolerance(np.zeros(3), np.zeros(4), np.zeros(4), bfloat16)
