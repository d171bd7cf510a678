"""Properties of the executable model of the kernel's online softmax.

The model (harness/numerics/online_softmax_model.py) does the kernel's blocked
arithmetic -- exp2, a base-2 running max, the pending scale m_scale and
rescale_threshold -- in the kernel's precisions. These tests hold it to the
float64 reference under the tolerance rule, for outputs, residuals and the
gradients a backward pass would compute from those residuals, and show that
the seed's base-2 residual bug passes the forward check and fails the other
two.

The model runs in the kernel's compute dtype (compute_dtype: float32 inputs are
computed in bfloat16), and so does the naive yardstick. (Run in float32
itself, the exp2 arithmetic is one or two float32 ulps behind a naive float32
computation, which the rule's rtol of 2 does not always absorb; the kernel
never computes in float32.)
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import note as _note
from hypothesis.control import currently_in_test_context

from harness.numerics.conformance import compute_dtype
from harness.numerics.online_softmax_model import online_softmax_attention
from harness.numerics.reference import (
  attention_reference,
  attention_reference_vjp,
  backward_from_residuals,
  naive_attention,
  naive_gradient_yardstick,
  dbias_is_noise,
)
from harness.numerics.strategies import (
  THRESHOLDS,
  AttentionCase,
  BiasSpec,
  CaseSpec,
  attention_cases,
  block_kvs,
  build_case,
  thresholds,
)
from harness.numerics.tolerance import ToleranceReport, check_tolerance
from kernel.call import AttentionShapes, bfloat16, float16, float32

MODEL_CASES = attention_cases(max_seq=300, max_head_dim=128, max_logits=1_000_000)


def note(text: str) -> None:
  """hypothesis.note inside a property; ignored in a plain pytest test."""
  if currently_in_test_context():
    _note(text)


class Expected:
  """Reference and naive results of one case, computed on first use.

  ``dtype`` is the precision the kernel computes in: the input dtype, except
  float32 inputs, which the kernel computes in bfloat16 (compute_dtype). The
  model and the naive yardstick both run in it.
  """

  def __init__(self, case: AttentionCase):
    self.case = case
    self.dtype = compute_dtype(case.dtype)

  @functools.cached_property
  def ref(self):
    return attention_reference(*self.case.args, **self.case.kwargs)

  @functools.cached_property
  def naive(self):
    return naive_attention(*self.case.args, dtype=self.dtype, **self.case.kwargs)

  @functools.cached_property
  def grads(self):
    return attention_reference_vjp(*self.case.args, self.case.d_out,
                                   **self.case.kwargs)

  @functools.cached_property
  def naive_grads(self) -> dict:
    """harness.numerics.reference.naive_gradient_yardstick, in the compute dtype."""
    c = self.case
    return naive_gradient_yardstick(*c.args, c.d_out, dtype=self.dtype, **c.kwargs)


def output_report(exp: Expected, out) -> ToleranceReport:
  c = exp.case
  return check_tolerance(out, exp.ref.out, exp.naive[0], exp.dtype, rtol=c.rtol,
                         name="out")


def residual_reports(exp: Expected, m, l) -> list[ToleranceReport]:
  c = exp.case
  return [
    check_tolerance(m, exp.ref.m, exp.naive[1], exp.dtype, rtol=c.rtol, name="m"),
    check_tolerance(l, exp.ref.l, exp.naive[2], exp.dtype, rtol=c.rtol, name="l"),
  ]


def gradient_reports(exp: Expected, out, m, l) -> list[ToleranceReport]:
  """Gradients a backward pass computes from the given residuals, against the
  reference's gradients, under the rule (yardstick: Expected.naive_grads)."""
  c = exp.case
  got = backward_from_residuals(*c.args, out, m, l, c.d_out, **c.kwargs)
  reports = []
  for name in ("dq", "dk", "dv", "dbias"):
    want = getattr(exp.grads, name)
    if want is None:
      continue
    if name == "dbias" and dbias_is_noise(np.shape(c.bias)):
      continue
    reports.append(check_tolerance(getattr(got, name), want,
                                   exp.naive_grads[name], exp.dtype,
                                   rtol=c.rtol, name=name))
  return reports


def run_model(case: AttentionCase, **kwargs):
  stats = {}
  result = online_softmax_attention(*case.args, **case.kwargs,
                                    dtype=compute_dtype(case.dtype),
                                    _stats=stats, **kwargs)
  note(f"model {kwargs}: {stats}")
  if currently_in_test_context():
    event("key blocks", "1" if stats["blocks"] == 1 else ">1")
    event("rescales deferred", str(stats["deferred"] > 0))
  return result, stats


def reject_overflowed_p(case: AttentionCase, stats: dict) -> None:
  """p is cast to dtype before the second matrix product; with a threshold
  below 1/max(dtype) a pending p can overflow (a property of the algorithm,
  pinned by test_float16_threshold_below_inverse_max_overflows_p)."""
  assume(stats["max_p"] <= float(ml_dtypes.finfo(compute_dtype(case.dtype)).max))


def assert_all(reports):
  for r in reports:
    note(str(r))
  failed = [str(r) for r in reports if not r.passed]
  assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------
# The model against the reference.


@given(MODEL_CASES, thresholds(), block_kvs())
def test_model_matches_reference(case, threshold, block_kv):
  """For any rescale_threshold in [0, 1] and block_kv, the model's output and
  its residuals m (natural log) and l (relative to the true max) are within
  the tolerance rule of the float64 reference: masks, biases, key ranges,
  soft cap, GQA, fully masked rows included."""
  note(case.describe())
  (out, m, l), stats = run_model(case, block_kv=block_kv,
                                 rescale_threshold=threshold)
  reject_overflowed_p(case, stats)
  exp = Expected(case)
  assert_all([output_report(exp, out), *residual_reports(exp, m, l)])


@given(MODEL_CASES, thresholds(), block_kvs())
def test_gradients_from_model_residuals_match_reference(case, threshold, block_kv):
  """A backward pass fed with the model's (out, m, l) computes the reference's
  gradients within the tolerance rule (naive same-dtype backward as yardstick)."""
  note(case.describe())
  (out, m, l), stats = run_model(case, block_kv=block_kv,
                                 rescale_threshold=threshold)
  reject_overflowed_p(case, stats)
  assert_all(gradient_reports(Expected(case), out, m, l))


@given(MODEL_CASES, thresholds(), block_kvs())
def test_unnormalised_output_over_l_is_the_normalised_output(case, threshold,
                                                             block_kv):
  """With normalize_output=False the model returns sum_j exp(s - m) v_j; times
  1/l it is the attention output (rule against the reference), and it matches
  ref.out * ref.l itself; m and l are those of the normalised run."""
  note(case.describe())
  kw = dict(block_kv=block_kv, rescale_threshold=threshold)
  (out_n, m_n, l_n), stats = run_model(case, **kw)
  reject_overflowed_p(case, stats)
  (out_u, m_u, l_u), _ = run_model(case, normalize_output=False, **kw)
  np.testing.assert_array_equal(m_u, m_n)
  np.testing.assert_array_equal(l_u, l_n)
  exp = Expected(case)
  l_btn = np.swapaxes(l_u, 1, 2)[..., None]
  with np.errstate(invalid="ignore", divide="ignore"):
    over_l = np.where(l_btn == 0, 0.0, out_u / l_btn)
  ref_l = np.swapaxes(exp.ref.l, 1, 2)[..., None]
  naive_l = np.swapaxes(exp.naive[2], 1, 2)[..., None]
  assert_all([
    check_tolerance(over_l, exp.ref.out, exp.naive[0], exp.dtype,
                    rtol=case.rtol, name="out_unnormalised / l"),
    check_tolerance(out_u, exp.ref.out * ref_l, exp.naive[0] * naive_l,
                    exp.dtype, rtol=case.rtol, name="out_unnormalised"),
  ])


@given(MODEL_CASES, block_kvs())
def test_threshold_just_below_one_agrees_with_the_textbook_branch(case, block_kv):
  """A threshold that rounds to 1.0 in float32 takes the guarded branch, which
  skips only the rescales whose alpha rounds to exactly 1: it agrees with the
  textbook (== 1.0) branch to float32 rounding (m, l) and to one rounding of
  the dtype (out). Bitwise equality does not hold: when the max moves by less
  than an ulp's worth, exp2 rounds alpha to 1 and only the textbook branch
  moves m_scale."""
  note(case.describe())
  textbook, _ = run_model(case, block_kv=block_kv, rescale_threshold=1.0)
  guarded, _ = run_model(case, block_kv=block_kv,
                         rescale_threshold=float(np.nextafter(1.0, 0.0)))
  eps = float(ml_dtypes.finfo(compute_dtype(case.dtype)).eps)
  (out_t, m_t, l_t), (out_g, m_g, l_g) = textbook, guarded
  np.testing.assert_array_equal(np.isfinite(m_t), np.isfinite(m_g))
  live = np.isfinite(m_t)
  np.testing.assert_allclose(m_g[live], m_t[live], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(l_g, l_t, rtol=1e-6)
  np.testing.assert_allclose(out_g, out_t, rtol=2 * eps,
                             atol=2 * eps * max(1.0, float(np.abs(out_t).max())))


@given(MODEL_CASES, thresholds(), block_kvs())
def test_pending_scale_keeps_p_at_most_inverse_threshold(case, threshold, block_kv):
  """A row is rescaled as soon as alpha = exp2(m_scale - m_ij) drops below the
  threshold, so every p = exp2(s2 - m_scale) is at most 1 / threshold (and at
  most 1 in the textbook branch)."""
  note(case.describe())
  _, stats = run_model(case, block_kv=block_kv, rescale_threshold=threshold)
  if threshold == 1.0:
    assert stats["max_p"] <= 1.0
  elif threshold > 0:
    assert stats["max_p"] <= (1.0 / threshold) * (1 + 1e-6)


# ---------------------------------------------------------------------------
# Deliberate bugs: what each property can and cannot see.


def residual_case(seed: int = 11, dtype=bfloat16) -> AttentionCase:
  """A case whose row maxima are far from 0 (|m| ~ 2..5), so the base of m
  matters, and whose max moves across key blocks, so rescales are deferred."""
  shapes = AttentionShapes(B=1, T=64, N=2, H=64, S=203, K=1, Hv=64)
  return build_case(CaseSpec(
    shapes=shapes, dtype=str(np.dtype(dtype)), seed=seed, scale=0.25,
    bias=BiasSpec(shape=(1, 2, 64, 203), std=1.0, seed=seed + 1)))


def classify(case: AttentionCase, **model_kwargs) -> dict[str, bool]:
  """Which of the three properties (output, residuals, gradients) pass."""
  exp = Expected(case)
  (out, m, l), _ = run_model(case, **model_kwargs)
  verdicts = {
    "output": output_report(exp, out),
    "residuals": residual_reports(exp, m, l),
    "gradients": gradient_reports(exp, out, m, l),
  }
  result = {}
  for name, reports in verdicts.items():
    reports = reports if isinstance(reports, list) else [reports]
    for r in reports:
      note(f"{name}: {r}")
    result[name] = all(r.passed for r in reports)
  return result


@pytest.mark.parametrize("dtype", [bfloat16, float16, float32])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_base2_residual_passes_forward_and_fails_residuals_and_gradients(
    dtype, threshold):
  """Seed 000: leaving m in base 2 keeps the forward output exactly right
  while the residual and the gradients computed from it are wrong. The output
  property passes, the residual and gradient properties fail; the correct
  model passes all three on the same case."""
  case = residual_case(dtype=dtype)
  assert classify(case, rescale_threshold=threshold) == dict(
    output=True, residuals=True, gradients=True)
  assert classify(case, rescale_threshold=threshold,
                  _residual_m_base2=True) == dict(
    output=True, residuals=False, gradients=False)


@given(MODEL_CASES.filter(lambda c: c.spec.logits_soft_cap is None or
                          c.spec.logits_soft_cap > 2), thresholds(), block_kvs())
def test_base2_residual_is_caught_on_drawn_cases(case, threshold, block_kv):
  """On any drawn case where some row max is far from 0 (|m| > 1.5), the
  base-2 residual passes the output property and fails the residual property."""
  note(case.describe())
  exp = Expected(case)
  live = np.isfinite(exp.ref.m)
  assume(live.any() and np.abs(exp.ref.m[live]).max() > 1.5)
  (out, m, l), stats = run_model(case, block_kv=block_kv,
                                 rescale_threshold=threshold,
                                 _residual_m_base2=True)
  reject_overflowed_p(case, stats)
  assert output_report(exp, out).passed
  reports = residual_reports(exp, m, l)
  for r in reports:
    note(str(r))
  assert not reports[0].passed, "base-2 m passed the residual property"


def test_l_without_epilogue_alpha_is_caught():
  """The sibling bug: storing l_i relative to the pending m_scale (no alpha
  in the epilogue) leaves the output right and the residual l and gradients
  wrong -- visible only when rescales were deferred (threshold < 1)."""
  case = residual_case()
  _, stats = run_model(case, rescale_threshold=0.5, block_kv=16)
  assert stats["deferred"] > 0, "vacuous: no rescale was deferred"
  assert classify(case, rescale_threshold=0.5, block_kv=16,
                  _residual_l_pending=True) == dict(
    output=True, residuals=False, gradients=False)
  # With the textbook branch nothing is pending, so the same bug is harmless.
  assert classify(case, rescale_threshold=1.0, block_kv=16,
                  _residual_l_pending=True) == dict(
    output=True, residuals=True, gradients=True)


def test_thresholds_below_one_defer_rescales():
  """Vacuity check: the pending path is exercised by the thresholds drawn."""
  case = residual_case()
  deferred = {}
  for threshold in THRESHOLDS:
    _, stats = run_model(case, rescale_threshold=threshold, block_kv=16)
    deferred[threshold] = stats["deferred"]
  assert deferred[0.0] > 0 and deferred[0.5] > 0
  assert deferred[1.0] == 0


def test_float16_threshold_below_inverse_max_overflows_p():
  """A hazard of the algorithm, pinned: p is cast to the input dtype for the
  second matrix product and may reach 1 / threshold, so in float16 a
  threshold below 1/65504 lets a late large logit overflow p to inf and the
  output to NaN/inf, while thresholds >= 2**-15 stay finite and correct.
  (The kernel must clamp the threshold for float16 or document the limit.)"""
  rng = np.random.default_rng(0)
  T, S, H = 4, 256, 64
  q = rng.standard_normal((1, T, 1, H)).astype(np.float16)
  k = rng.standard_normal((1, S, 1, H)).astype(np.float16)
  v = rng.standard_normal((1, S, 1, H)).astype(np.float16)
  bias = np.zeros((1, 1, T, S), np.float16)
  bias[..., 200] = 20.0  # the max jumps by ~20 nats = ~29 bits after block 0
  ref = attention_reference(q, k, v, bias)
  naive = naive_attention(q, k, v, bias, dtype=np.float16)
  out, _, _ = online_softmax_attention(q, k, v, bias, dtype=np.float16,
                                       block_kv=64, rescale_threshold=0.0)
  assert not np.isfinite(out).all()
  for threshold in (2.0 ** -15, 1e-3, 0.5):
    stats = {}
    out, _, _ = online_softmax_attention(q, k, v, bias, dtype=np.float16,
                                         block_kv=64, rescale_threshold=threshold,
                                         _stats=stats)
    assert stats["max_p"] <= 1 / threshold
    assert check_tolerance(out, ref.out, naive[0], np.float16).passed, threshold
