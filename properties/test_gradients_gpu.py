"""Gradients through the kernel's custom_vjp on the GPU (marker ``gpu``).

The forward kernel stores (out, m, l); the backward (kernel/backward_xla.py
today, the Pallas backward kernels when they land) reads exactly those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings

from harness import strategies as hs
from harness.conformance import gradient_reports
from kernel import mutants
from kernel import api

pytestmark = pytest.mark.gpu


def kernel_grads(case, mutant=None):
  kw = case.kwargs
  j = lambda x: None if x is None else jnp.asarray(x)
  d_out = jnp.asarray(case.d_out, jnp.float32)

  def loss(q, k, v, bias):
    out = api.dot_product_attention(q, k, v, bias, j(case.mask), scale=kw["scale"],
                                    is_causal=kw["is_causal"], k_start=j(case.k_start),
                                    k_end=j(case.k_end), logits_soft_cap=kw["logits_soft_cap"],
                                    _mutant=mutant)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  argnums = (0, 1, 2, 3) if case.bias is not None else (0, 1, 2)
  grads = jax.grad(loss, argnums=argnums)(j(case.query), j(case.key), j(case.value), j(case.bias))
  grads = [np.asarray(g.astype(jnp.float32), np.float64) for g in grads]
  return grads + [None] * (4 - len(grads))


@given(case=hs.attention_cases(max_batch=2, max_seq=700, max_head_dim=256, big=True,
                               max_logits=None))
@settings(max_examples=25)
def test_gradients_match_float64(case):
  """dq, dk, dv (and dbias) are within the tolerance rule of float64."""
  note(case.describe())
  for r in gradient_reports(case, kernel_grads(case)):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


def test_base2_residual_variant_passes_forward_and_fails_gradients():
  """The forward that leaves m in base 2 keeps its output right (checked on
  the GPU by test_forward_gpu) and gets the gradients wrong."""
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=1, T=256, N=2, H=64, S=384, K=1, Hv=64),
                     dtype="bfloat16", seed=9, input_std=2.0)
  case = hs.build_case(spec)
  assert all(r.passed for r in gradient_reports(case, kernel_grads(case)))
  bad = gradient_reports(case, kernel_grads(case, mutant=mutants.RESIDUAL_M_BASE2))
  assert not all(r.passed for r in bad)


def test_gradients_are_bitwise_deterministic():
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=2, T=300, N=4, H=128, S=500, K=2, Hv=128),
                     dtype="bfloat16", seed=12, is_causal=True)
  case = hs.build_case(spec)
  a, b = kernel_grads(case), kernel_grads(case)
  for x, y in zip(a, b):
    assert (x is None and y is None) or np.array_equal(x, y)
