"""The JAX backward (kernel/backward/xla.py) from the forward's residuals
matches the float64 gradients under the tolerance rule, and catches a
forward that leaves m in base 2.  CPU only: the residuals come from the
float64 reference, rounded the way the kernel stores them."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from hypothesis import given, note, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics.conformance import compute_dtype, gradient_reports
from harness.numerics.reference import attention_reference
from kernel import api
from kernel.backward.xla import xla_backward


def _grads(case, m_transform=lambda m: m, chunk=64):
  kw = case.kwargs
  dt = compute_dtype(case.query.dtype)
  # The residuals the kernel would store: computed from the inputs rounded to
  # its compute dtype (f32 inputs run in bf16).
  rounded = [None if x is None else (x.astype(dt) if x.dtype.kind == "f" else x)
             for x in case.args]
  ref = attention_reference(*rounded, **kw)
  out = ref.out.astype(dt)  # the kernel stores out in its dtype, m and l in f32
  m = m_transform(ref.m).astype(np.float32)
  j = lambda x: None if x is None else jnp.asarray(x)
  low = lambda x: None if x is None else jnp.asarray(x).astype(dt)  # as the API does
  return xla_backward(
      api.problem_of(case.call), low(case.query), low(case.key), low(case.value), low(case.bias),
      j(case.mask),
      j(case.k_start), j(case.k_end), jnp.asarray(out), jnp.asarray(m),
      jnp.asarray(ref.l.astype(np.float32)), jnp.asarray(case.d_out, jnp.float32), chunk=chunk)




@given(case=hs.attention_cases(max_seq=200, max_logits=300_000),
       chunk=st.sampled_from([16, 64, 512]))
@settings(max_examples=hs.examples(12))
def test_backward_from_natural_log_residuals_matches_float64(case, chunk):
  """dq, dk, dv, dbias from (out, m, l) are within the tolerance rule."""
  note(case.describe())
  for r in gradient_reports(case, _grads(case, chunk=chunk)):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


def test_base2_m_gives_wrong_gradients():
  """m left in base 2 (the forward bug the output check misses) fails here."""
  from harness.numerics.strategies import AttentionShapes, CaseSpec, build_case
  spec = CaseSpec(shapes=AttentionShapes(B=1, T=64, N=2, H=64, S=96, K=1, Hv=64),
                  dtype="bfloat16", seed=4, input_std=2.0)
  case = build_case(spec)
  good = gradient_reports(case, _grads(case))
  assert all(r.passed for r in good)
  bad = gradient_reports(case, _grads(case, m_transform=lambda m: m * math.log2(math.e)))
  assert not all(r.passed for r in bad)
