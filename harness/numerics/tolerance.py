"""The tolerance rule, in one place.

The rule of the FlashAttention test suites (hopper and cute), applied to every
output we compare (out, the residuals m and l, dq, dk, dv, dbias)::

  max|actual - ref| <= rtol * max|naive - ref| + floor
  floor = 2 * max|(ref + 0.3 - 0.3) - ref|     evaluated in the low dtype,
          but at least one dtype ulp and 4 float32 ulps at max|ref|
          (so that it cannot vanish on small arrays; see noise_floor)

``ref`` is the float64 reference (``harness/numerics/reference.py``); ``naive`` is the
same maths done naively in the low dtype, every op rounded to it
(``naive_attention`` / ``naive_attention_vjp``). So a kernel may be at most
``rtol`` times as wrong as the textbook computation in its own dtype, plus a
floor of about two ulps of the dtype at the reference's magnitude (which keeps
the bound above zero where the naive computation happens to be exact).

``RTOL = 2.0``; ``RTOL_SOFT_CAP = 3.0`` when a logits soft cap is used (tanh
adds rounding that the naive computation does not mirror op for op).

FP8 (float8_e4m3fn inputs, FlashAttention-3's rule for its FP8 forward):
``ref`` is the float64 computation on the dequantised inputs, ``naive``
the textbook one in the same precision on the same hardware
(:func:`naive_forward`): e4m3 operands, P quantised to e4m3 as the kernel
does (at 2^8 times its value, saturating), both products, q k^T and P V,
summed as the hardware sums e4m3 products, every other op in float32, the
output rounded to the output dtype; the floor is evaluated in the output
dtype (:func:`floor_dtype`).  The products are the NumPy model of what the
H200's wgmma was measured to keep, on every host, GPU or not: a running sum
cut to ``FP8_SUM_BITS`` fraction bits after every ``FP8_SUM_PART`` products
(:func:`fp8_products_model`; XLA's FP8 dot on the H200 sums almost exactly,
so it is no yardstick of the tensor cores' sum: docs/decisions/fp8-yardstick.md).

Non-finite values:

* where ``ref`` is +inf or -inf (e.g. m = -inf on fully masked rows),
  ``actual`` must be the same infinity; those positions are left out of the
  max error;
* where ``ref`` is NaN, ``actual`` must be NaN too (NaN propagation is part
  of the contract) and the position is left out of the max error;
* a NaN or infinity in ``actual`` where ``ref`` is finite fails;
* non-finite entries of ``naive`` where ``ref`` is finite (a float16 overflow
  of the textbook computation) are left out of the naive error, so that they
  cannot inflate the bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
  "RTOL",
  "RTOL_SOFT_CAP",
  "FLOAT32_FLOOR_ULPS",
  "ToleranceReport",
  "noise_floor",
  "check_tolerance",
  "assert_within_tolerance",
  "rtol_for",
  "floor_dtype",
  "FP8_SUM_BITS",
  "FP8_SUM_PART",
  "naive_forward",
  "fp8_products_model",
]

RTOL = 2.0
RTOL_SOFT_CAP = 3.0
# How the H200's FP8 wgmma sums e4m3 products (docs/decisions/fp8-yardstick.md).
FP8_SUM_BITS = 12
FP8_SUM_PART = 32
# Lower bound of the floor, in float32 ulps of the largest |reference| value.
FLOAT32_FLOOR_ULPS = 4


def rtol_for(logits_soft_cap: float | None) -> float:
  """The rtol of the rule for a call with or without a soft cap."""
  return RTOL if logits_soft_cap is None else RTOL_SOFT_CAP


def floor_dtype(compute_dtype: Any, result_dtype: Any) -> np.dtype:
  """The dtype the floor is evaluated in: the compute dtype, but an 8-bit
  one's outputs are written in their output dtype (bfloat16 or float16)."""
  compute_dtype = np.dtype(compute_dtype)
  return np.dtype(result_dtype) if compute_dtype.itemsize == 1 else compute_dtype


@dataclasses.dataclass(frozen=True)
class ToleranceReport:
  """Outcome of one comparison. ratio = max_error / bound (<= 1 passes)."""

  name: str
  dtype: str
  rtol: float
  max_error: float
  naive_error: float
  noise_floor: float
  bound: float
  ratio: float
  passed: bool
  worst_index: tuple[int, ...] | None
  nonfinite_mismatches: int
  first_nonfinite_mismatch: tuple[int, ...] | None

  def __str__(self) -> str:
    verdict = "ok" if self.passed else "FAILED"
    text = (
      f"{self.name} [{self.dtype}] {verdict}: max error {self.max_error:.6g} "
      f"{'<=' if self.passed else '>'} bound {self.bound:.6g} "
      f"(= {self.rtol:g} * naive error {self.naive_error:.6g} + floor "
      f"{self.noise_floor:.6g}), ratio {self.ratio:.4g}, worst index "
      f"{self.worst_index}"
    )
    if self.nonfinite_mismatches:
      text += (
        f"; {self.nonfinite_mismatches} non-finite mismatch(es), first at "
        f"{self.first_nonfinite_mismatch}"
      )
    return text


def _round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  with np.errstate(over="ignore"):  # past the dtype's range: inf, left out by the callers
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


def _ulps_at(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Elementwise spacing of ``dtype``'s normal numbers at magnitudes ``x``
  (>= 0; below the smallest normal, the spacing there)."""
  info = ml_dtypes.finfo(dtype)
  _, exponent = np.frexp(np.maximum(np.asarray(x, np.float64), float(info.tiny)))
  return float(info.eps) * np.exp2(exponent - 1.0)


def _ulp_at(x: float, dtype: np.dtype) -> float:
  """The spacing of ``dtype``'s normal numbers at magnitude ``x`` (> 0)."""
  return float(_ulps_at(np.float64(x), dtype))


def noise_floor(ref: Any, dtype: Any) -> float:
  """The rule's floor for a reference array compared in ``dtype``.

  2 * max|(ref + 0.3 - 0.3) - ref| with every value rounded to ``dtype`` (the
  FlashAttention floor), but never below one ``dtype`` ulp nor
  FLOAT32_FLOOR_ULPS float32 ulps at max|ref|. Only finite entries count.

  Why the lower bounds: on a large array the realised round-trip error
  reaches one to two ulps at the largest magnitudes, which is what the floor
  is for; on a small array (a handful of row maxima) every value can survive
  the round trip exactly and the floor collapses to 0, turning the rule into
  a coin toss between two rounding errors of the same size. Every
  implementation here accumulates in float32, hence the float32 bound.
  """
  dtype = np.dtype(dtype)
  ref = np.asarray(ref, dtype=np.float64)
  ref = ref[np.isfinite(ref)]
  if ref.size == 0:
    return 0.0
  r = _round_to(ref, dtype)
  with np.errstate(over="ignore", invalid="ignore"):
    shifted = _round_to(_round_to(r + 0.3, dtype) - 0.3, dtype)
    err = np.abs(shifted - r)
  err = err[np.isfinite(err)]
  realised = 2.0 * float(err.max()) if err.size else 0.0
  biggest = float(np.abs(ref).max())
  if biggest == 0.0:
    return realised
  return max(realised, _ulp_at(biggest, dtype),
             FLOAT32_FLOOR_ULPS * _ulp_at(biggest, np.dtype(np.float32)))


def _max_abs(diff: np.ndarray, where: np.ndarray):
  if not where.any():
    return 0.0, None
  masked = np.where(where, diff, -1.0)
  flat = int(np.argmax(masked))
  return float(masked.flat[flat]), tuple(int(i) for i in np.unravel_index(flat, diff.shape))


def check_tolerance(
  actual: Any,
  reference_f64: Any,
  naive: Any,
  dtype: Any,
  *,
  rtol: float = RTOL,
  name: str = "out",
) -> ToleranceReport:
  """Apply the rule to one array; see the module docstring.

  ``actual``, ``reference_f64`` and ``naive`` must have the same shape (a
  shape mismatch is a ``ValueError``, not a tolerance failure).
  """
  dtype = np.dtype(dtype)
  actual = np.asarray(actual).astype(np.float64)
  ref = np.asarray(reference_f64, dtype=np.float64)
  naive = np.asarray(naive).astype(np.float64)
  if not (actual.shape == ref.shape == naive.shape):
    raise ValueError(
      f"{name}: shapes differ: actual {actual.shape}, reference {ref.shape}, "
      f"naive {naive.shape}"
    )

  ref_finite = np.isfinite(ref)
  ref_inf = np.isinf(ref)
  ref_nan = np.isnan(ref)
  act_finite = np.isfinite(actual)
  # Where ref is finite, actual must be finite; where ref is +-inf, the same
  # infinity; where ref is NaN, NaN.
  mismatch = (
    (ref_finite & ~act_finite)
    | (ref_inf & (actual != ref))
    | (ref_nan & ~np.isnan(actual))
  )
  n_mismatch = int(mismatch.sum())
  first_mismatch = None
  if n_mismatch:
    first_mismatch = tuple(int(i) for i in np.argwhere(mismatch)[0])

  with np.errstate(invalid="ignore", over="ignore"):
    diff = np.abs(actual - ref)
    naive_diff = np.abs(naive - ref)
  compared = ref_finite & act_finite
  max_error, worst = _max_abs(diff, compared)
  naive_error, _ = _max_abs(naive_diff, ref_finite & np.isfinite(naive))
  floor = noise_floor(ref, dtype)
  bound = rtol * naive_error + floor

  if n_mismatch:
    max_error = float("inf")
    worst = first_mismatch
  if bound > 0:
    ratio = max_error / bound
  else:
    ratio = 0.0 if max_error == 0 else float("inf")
  passed = n_mismatch == 0 and max_error <= bound
  return ToleranceReport(
    name=name, dtype=str(dtype), rtol=float(rtol), max_error=max_error,
    naive_error=naive_error, noise_floor=floor, bound=bound, ratio=ratio,
    passed=passed, worst_index=worst, nonfinite_mismatches=n_mismatch,
    first_nonfinite_mismatch=first_mismatch,
  )


def assert_within_tolerance(
  actual: Any,
  reference_f64: Any,
  naive: Any,
  dtype: Any,
  **options: Any,
) -> ToleranceReport:
  """:func:`check_tolerance` (``options``: its ``rtol`` and ``name``),
  raising ``AssertionError`` when it fails.

  The message names the array, the max error, the bound and its parts, the
  ratio, the worst index and the values there.
  """
  report = check_tolerance(actual, reference_f64, naive, dtype, **options)
  if not report.passed:
    message = str(report)
    if report.worst_index is not None:
      idx = report.worst_index
      a = np.asarray(actual).astype(np.float64)[idx]
      r = np.asarray(reference_f64, dtype=np.float64)[idx]
      n = np.asarray(naive).astype(np.float64)[idx]
      message += f"; at {idx}: actual {a!r}, reference {r!r}, naive {n!r}"
    raise AssertionError(message)
  return report


def run_to_run_bound(a: np.ndarray, b: np.ndarray, dtype: Any) -> float:
  """Largest |a - b| allowed between two runs of a gradient that the kernel
  accumulates in float32 across thread blocks in no fixed order (the fused
  dQ, kernel/backward/fused_dq.py), elementwise: one ``dtype`` ulp at the larger
  magnitude (two float32 sums that differ in their last bits can round to
  neighbouring ``dtype`` values), plus 2^-20 of max|a| for entries where the
  partial sums cancel.  Returns the worst ratio |a - b| / bound (<= 1 passes).
  """
  dtype = np.dtype(dtype)
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  both = np.isfinite(a) & np.isfinite(b)
  if not np.array_equal(np.isnan(a), np.isnan(b)):
    return float("inf")
  if not both.any():
    return 0.0
  big = np.maximum(np.abs(a), np.abs(b))[both]
  bound = _ulps_at(big, dtype) + 2.0 ** -20 * float(np.max(np.abs(a[both])))
  return float(np.max(np.abs(a[both] - b[both]) / bound))


# ---------------------------------------------------------------------------
# The naive yardstick of a forward.


def fp8_products_model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """``a @ b`` of e4m3 values (float32 arrays, batched over leading axes)
  summed as the H200 sums them: FP8_SUM_BITS fraction bits kept after
  every FP8_SUM_PART products.  The FP8 yardstick's products."""
  from harness.numerics.reference import tensor_core_products
  return tensor_core_products(a, b, FP8_SUM_BITS, FP8_SUM_PART)


def naive_forward(call, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The rule's naive (out, m, l) for a forward of ``call`` computed in
  ``dtype``: the textbook computation in that dtype (reference.
  naive_attention); for FP8 its two e4m3 products are summed as the
  H200's tensor cores sum them (:func:`fp8_products_model`), on every
  host, so a CPU and a GPU hold the kernel to the same bound."""
  from harness.numerics import reference as ref_lib
  if np.dtype(dtype).itemsize != 1:
    return ref_lib.naive_attention(call, dtype=dtype)
  return ref_lib.naive_attention(call, dtype=dtype, fp8_products=fp8_products_model)
