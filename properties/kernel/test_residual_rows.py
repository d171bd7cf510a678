"""The per-row inputs the backward kernels stream (kernel.backward.launch.residual_rows):
lse in base 2 from the forward's natural-log m and l, and delta = rowsum(dO * O),
against float64, with padded and fully masked rows.  CPU: the function is
plain JAX that runs before the kernels."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from kernel.backward import launch as bwd_launch


@st.composite
def row_inputs(draw):
  B, N = draw(st.integers(1, 2)), draw(st.integers(1, 3))
  T = draw(st.integers(1, 150))
  D = draw(st.sampled_from([8, 64, 72, 128]))
  t_pad = T + draw(st.integers(0, 70))
  dtype = draw(st.sampled_from([jnp.bfloat16, jnp.float16]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  out = rng.normal(size=(B, T, N, D)).astype(np.float32)
  d_out = rng.normal(scale=draw(st.sampled_from([1e-3, 1.0, 50.0])),
                     size=(B, T, N, D)).astype(np.float32)
  m = rng.normal(scale=10.0, size=(B, N, T)).astype(np.float32)
  l = rng.uniform(1.0, 500.0, size=(B, N, T)).astype(np.float32)
  l[rng.random(size=l.shape) < 0.2] = 0.0     # fully masked rows
  return jnp.asarray(m), jnp.asarray(l), jnp.asarray(out, dtype), jnp.asarray(d_out, dtype), t_pad


@given(row_inputs())
def test_rows_match_float64(args):
  m, l, out, d_out, t_pad = args
  rows = np.asarray(jax.jit(bwd_launch.residual_rows, static_argnums=4)(m, l, out, d_out, t_pad))
  B, T, N, D = out.shape
  assert rows.shape == (B, N, 2, t_pad) and rows.dtype == np.float32
  lse2, delta = rows[:, :, 0], rows[:, :, 1]
  m64, l64 = np.asarray(m, np.float64), np.asarray(l, np.float64)
  o64, do64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (out, d_out))

  live = l64 > 0
  want_lse2 = np.where(live, m64 / math.log(2) + np.log2(np.where(live, l64, 1.0)), np.inf)
  np.testing.assert_array_equal(np.isinf(lse2[..., :T]), ~live)
  np.testing.assert_allclose(lse2[..., :T][live], want_lse2[live], rtol=1e-6, atol=1e-5)
  assert np.all(lse2[..., T:] == np.inf)            # padded rows: P = 0

  want_delta = np.einsum("btnd,btnd->bnt", do64, o64)
  # f32 accumulation of D products: error below D * eps32 * sum |dO * O|.
  bound = D * np.finfo(np.float32).eps * np.einsum("btnd,btnd->bnt", np.abs(do64), np.abs(o64))
  assert np.all(np.abs(delta[..., :T] - want_delta) <= bound + 1e-30)
  assert np.all(delta[..., T:] == 0.0)              # padded rows add nothing
