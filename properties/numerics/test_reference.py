"""Properties of the float64 reference (harness/numerics/reference.py).

The reference is what every other implementation is held to, so it is checked
against three independent things: jax.nn.dot_product_attention (x64), a plain
Python loop over rows and keys, and central finite differences.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, note, settings
from hypothesis import strategies as st

from harness.numerics.reference import (
  attention_reference,
  attention_reference_vjp,
  backward_from_residuals,
  key_visibility,
  naive_attention,
  naive_attention_vjp,
)
from harness.numerics import strategies as hs
from harness.numerics.strategies import AttentionCase, attention_cases
from kernel.call import AttentionShapes, Call, bfloat16, float16, float32

# ---------------------------------------------------------------------------
# Helpers.


@st.composite
def tiny_shapes(draw) -> AttentionShapes:
  """Shapes small enough for Python loops and finite differences."""
  K = draw(st.integers(1, 2))
  return AttentionShapes(
    B=draw(st.integers(1, 2)), T=draw(st.integers(1, 5)),
    N=K * draw(st.sampled_from((1, 2))), H=draw(st.integers(1, 4)),
    S=draw(st.integers(1, 6)), K=K, Hv=draw(st.integers(1, 3)))


def tiny_cases(**kwargs):
  return tiny_shapes().flatmap(
    lambda sh: attention_cases(shapes=sh, dtype=float32, **kwargs))


def as_f64(case: AttentionCase):
  """The case's arrays in float64 (so that finite differences are exact)."""
  f = lambda x: None if x is None else np.asarray(x).astype(np.float64)
  return f(case.query), f(case.key), f(case.value), f(case.bias), case.mask


def loop_attention(q, k, v, bias, mask, *, scale, is_causal, k_start, k_end,
                   logits_soft_cap):
  """Row-by-row, key-by-key attention with math.fsum: an independent oracle."""
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  G = N // K
  scale = 1 / math.sqrt(H) if scale is None else scale
  full = (B, N, T, S)
  bias = np.zeros(full) if bias is None else np.broadcast_to(bias, full)
  mask = np.ones(full, bool) if mask is None else np.broadcast_to(mask, full)
  lo = np.broadcast_to(-(10**9) if k_start is None else k_start, (B, N, T))
  hi = np.broadcast_to(10**9 if k_end is None else k_end, (B, N, T))
  out = np.zeros((B, T, N, Hv))
  m = np.full((B, N, T), -np.inf)
  l = np.zeros((B, N, T))
  for b in range(B):
    for n in range(N):
      kh = n // G
      for i in range(T):
        logits = {}
        for j in range(S):
          if not mask[b, n, i, j] or (is_causal and j > i):
            continue
          if not lo[b, n, i] <= j < hi[b, n, i]:
            continue
          u = scale * math.fsum(q[b, i, n, h] * k[b, j, kh, h] for h in range(H))
          u += bias[b, n, i, j]
          logits[j] = (logits_soft_cap * math.tanh(u / logits_soft_cap)
                       if logits_soft_cap else u)
        finite = [s for s in logits.values() if s > -math.inf]
        if not finite:
          continue
        mx = max(finite)
        w = {j: math.exp(s - mx) for j, s in logits.items()}
        m[b, n, i] = mx
        l[b, n, i] = math.fsum(w.values())
        for c in range(Hv):
          out[b, i, n, c] = math.fsum(w[j] * v[b, j, kh, c] for j in w) / l[b, n, i]
  return out, m, l


def to_4d(x):
  return None if x is None else np.reshape(x, (1,) * (4 - np.ndim(x)) + np.shape(x))


@functools.partial(jax.jit, static_argnames=("scale", "is_causal"))
def _jax_attention_and_vjp(q, k, v, bias, mask, d_out, *, scale, is_causal):
  def f(q, k, v, bias):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale,
                                        is_causal=is_causal,
                                        return_residual=True)
  (out, lse), vjp = jax.vjp(f, q, k, v, bias)
  return out, lse, vjp((d_out, jnp.zeros_like(lse)))


# ---------------------------------------------------------------------------
# Forward.


@given(tiny_cases())
def test_reference_matches_python_loops(case):
  """The reference equals a key-by-key Python loop to float64 accuracy, with
  every feature (GQA, bias, mask, causal, key ranges, soft cap, fully masked
  rows)."""
  note(case.describe())
  q, k, v, bias, mask = as_f64(case)
  ref = attention_reference(q, k, v, bias, mask, **case.kwargs)
  out, m, l = loop_attention(q, k, v, bias, mask, **case.kwargs)
  np.testing.assert_allclose(ref.out, out, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(ref.m, m, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(ref.l, l, rtol=1e-12, atol=1e-13)


@settings(max_examples=hs.examples(15))
@given(attention_cases(max_seq=64, max_head_dim=64, allow_soft_cap=False,
                       allow_fully_masked=False, same_head_dims=True))
def test_reference_matches_jax_dot_product_attention(case):
  """Where jax.nn.dot_product_attention applies (no soft cap, no key ranges,
  no fully masked row, Hv == H), the reference agrees with it in x64: output,
  natural-log logsumexp and gradients. (jax computes its softmax in float32,
  hence tolerances around 1e-5.)"""
  note(case.describe())
  q, k, v, bias, mask = as_f64(case)
  kw = dict(scale=case.spec.scale, is_causal=case.spec.is_causal)
  ref = attention_reference(q, k, v, bias, mask, **kw)
  grads = attention_reference_vjp(q, k, v, bias, mask, case.d_out, **kw)
  with jax.enable_x64(True):
    out, lse, (dq, dk, dv, db) = _jax_attention_and_vjp(
      q, k, v, to_4d(bias), to_4d(mask), case.d_out, **kw)
  scale_out = max(1.0, float(np.abs(ref.out).max()))
  np.testing.assert_allclose(np.asarray(out), ref.out, rtol=1e-5, atol=2e-5 * scale_out)
  # jax's residual is (B, T, N); ours is (B, N, T), natural log.
  np.testing.assert_allclose(np.swapaxes(np.asarray(lse), 1, 2), ref.lse,
                             rtol=1e-5, atol=2e-5)
  for name, ours, theirs in (("dq", grads.dq, dq), ("dk", grads.dk, dk),
                             ("dv", grads.dv, dv)):
    tol = 5e-5 * max(1.0, float(np.abs(ours).max()))
    np.testing.assert_allclose(np.asarray(theirs), ours, atol=tol, err_msg=name)
  if bias is not None:
    tol = 5e-5 * max(1.0, float(np.abs(grads.dbias).max()))
    np.testing.assert_allclose(np.asarray(db).reshape(bias.shape), grads.dbias,
                               atol=tol, err_msg="dbias")


@given(attention_cases(max_seq=128, max_head_dim=64))
def test_residual_identity(case):
  """out == sum_j exp(s - m) v_j / l and lse == log sum_j exp(s), with s
  recomputed independently (einsum, explicit GQA head map)."""
  note(case.describe())
  q, k, v, bias, mask = as_f64(case)
  ref = attention_reference(q, k, v, bias, mask, **case.kwargs)
  sh = case.shapes
  heads = np.arange(sh.N) // sh.group_size
  scale = case.spec.scale if case.spec.scale is not None else sh.H ** -0.5
  u = scale * np.einsum("btnh,bsnh->bnts", q, k[:, :, heads])
  if bias is not None:
    u = u + bias
  cap = case.spec.logits_soft_cap
  s = u if cap is None else cap * np.tanh(u / cap)
  visible = key_visibility(Call.of_shapes(sh, mask=mask, is_causal=case.spec.is_causal,
                                          k_start=case.k_start, k_end=case.k_end))
  s = np.where(visible, s, -np.inf)
  live = np.isfinite(ref.m)
  note(f"live rows: {int(live.sum())} of {live.size}")
  with np.errstate(invalid="ignore"):
    w = np.where(live[..., None], np.exp(s - np.where(live, ref.m, 0)[..., None]), 0)
  np.testing.assert_allclose(w.sum(-1), ref.l, rtol=1e-12)
  num = np.einsum("bnts,bsnd->btnd", w, v[:, :, heads])
  l_btn = np.swapaxes(np.where(live, ref.l, 1.0), 1, 2)[..., None]
  np.testing.assert_allclose(ref.out, num / l_btn, rtol=1e-10, atol=1e-12)
  # m is a natural-log max: the largest visible logit itself.
  smax = s.max(axis=-1)
  np.testing.assert_allclose(ref.m[live], smax[live], rtol=1e-13, atol=1e-13)
  with np.errstate(divide="ignore"):
    lse = np.log(np.exp(s - np.where(live, smax, 0)[..., None]).sum(-1)) + smax
  np.testing.assert_allclose(ref.lse[live], lse[live], rtol=1e-12)


# ---------------------------------------------------------------------------
# Gradients.


def finite_difference(f, x, eps=1e-6):
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    old = x[idx]
    x[idx] = old + eps
    plus = f()
    x[idx] = old - eps
    minus = f()
    x[idx] = old
    g[idx] = (plus - minus) / (2 * eps) if np.isfinite(old) else 0.0
  return g


@given(tiny_cases())
def test_gradients_match_finite_differences(case):
  """attention_reference_vjp equals central finite differences of
  sum(out * d_out) for q, k, v and bias (bias reduced to its own shape), with
  soft cap, causal, key ranges, GQA and fully masked rows."""
  note(case.describe())
  q, k, v, bias, mask = as_f64(case)
  kw = case.kwargs
  grads = attention_reference_vjp(q, k, v, bias, mask, case.d_out, **kw)

  def loss():
    return float(np.sum(attention_reference(q, k, v, bias, mask, **kw).out
                        * case.d_out))

  pairs = [("dq", grads.dq, q), ("dk", grads.dk, k), ("dv", grads.dv, v)]
  if bias is not None:
    pairs.append(("dbias", grads.dbias, bias))
  for name, analytic, x in pairs:
    assert analytic.shape == x.shape, name
    numeric = finite_difference(loss, x)
    note(f"{name}: max |analytic - numeric| = {np.abs(analytic - numeric).max():.3g}")
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5,
                               atol=1e-6 * max(1.0, float(np.abs(numeric).max())),
                               err_msg=name)


@given(attention_cases(max_seq=64, max_head_dim=64),
       st.floats(-5, 5, allow_nan=False))
def test_backward_reads_residuals_only_through_exp_s_minus_m_over_l(case, c):
  """Shifting m by c and scaling l by exp(-c) leaves the gradients unchanged,
  while m in base 2 (the seed's bug) changes them wherever m is far from 0."""
  note(case.describe())
  q, k, v, bias, mask = as_f64(case)
  kw = case.kwargs
  ref = attention_reference(q, k, v, bias, mask, **kw)
  want = attention_reference_vjp(q, k, v, bias, mask, case.d_out, **kw)
  shifted = backward_from_residuals(q, k, v, bias, mask, ref.out, ref.m + c,
                                    ref.l * np.exp(-c), case.d_out, **kw)
  for name in ("dq", "dk", "dv", "dbias"):
    a, b = getattr(want, name), getattr(shifted, name)
    if a is None:
      assert b is None
      continue
    np.testing.assert_allclose(b, a, rtol=1e-9,
                               atol=1e-9 * max(1.0, float(np.abs(a).max())),
                               err_msg=name)
  live = np.isfinite(ref.m)
  if live.any() and np.abs(ref.m[live]).max() > 1.0:
    base2 = backward_from_residuals(q, k, v, bias, mask, ref.out,
                                    ref.m * math.log2(math.e), ref.l,
                                    case.d_out, **kw)
    # Rows with a single visible key have zero dq either way; dv still moves.
    assert any(not np.allclose(getattr(base2, n), getattr(want, n), rtol=1e-3,
                               atol=1e-6) for n in ("dq", "dk", "dv"))


# ---------------------------------------------------------------------------
# The fully masked row contract.


@st.composite
def cases_with_empty_rows(draw):
  case = draw(attention_cases(max_seq=64, max_head_dim=64, allow_mask=False))
  sh = case.shapes
  rng = np.random.default_rng(case.spec.seed + 1)
  rows = rng.random((sh.B, sh.N, sh.T, 1)) < draw(st.sampled_from((0.2, 0.5, 1.0)))
  rows[0, 0, 0, 0] = True  # at least one row is fully masked
  return case, ~rows


@given(cases_with_empty_rows())
def test_fully_masked_rows_follow_the_contract(drawn):
  """A row where no key takes part has out 0, m -inf, l 0, no NaN anywhere,
  dq 0, and adds nothing to dk, dv, dbias: its query and d_out can be
  replaced by anything (huge values, NaN) without changing any other result."""
  case, mask = drawn
  note(case.describe())
  q, k, v, bias, _ = as_f64(case)
  kw = case.kwargs
  ref = attention_reference(q, k, v, bias, mask, **kw)
  empty = ~(ref.visible & (ref.logits > -np.inf)).any(axis=-1)
  note(f"fully masked rows: {int(empty.sum())} of {empty.size}")
  assert empty.any()
  np.testing.assert_array_equal(ref.m[empty], -np.inf)
  np.testing.assert_array_equal(ref.l[empty], 0.0)
  assert np.all(ref.out[np.swapaxes(empty, 1, 2)] == 0.0)
  assert not np.isnan(ref.out).any() and not np.isnan(ref.m).any()
  assert not np.isnan(ref.l).any()

  grads = attention_reference_vjp(q, k, v, bias, mask, case.d_out, **kw)
  empty_btn = np.swapaxes(empty, 1, 2)  # (B, T, N)
  assert np.all(grads.dq[empty_btn] == 0.0)

  # Poison the masked rows: their d_out, and the query of the rows that see
  # no key at all (a NaN query would turn the -inf logits of a row masked only
  # by a -inf bias into NaN, which IEEE arithmetic rightly propagates).
  d_out = case.d_out.copy()
  d_out[empty_btn] = 1e30
  unseen_btn = np.swapaxes(~ref.visible.any(axis=-1), 1, 2)
  q2 = q.copy()
  q2[unseen_btn] = np.nan
  ref2 = attention_reference(q2, k, v, bias, mask, **kw)
  grads2 = attention_reference_vjp(q2, k, v, bias, mask, d_out, **kw)
  np.testing.assert_array_equal(ref2.out, ref.out)
  np.testing.assert_array_equal(ref2.m, ref.m)
  np.testing.assert_array_equal(ref2.l, ref.l)
  for name in ("dk", "dv", "dbias"):
    a, b = getattr(grads, name), getattr(grads2, name)
    if a is not None:
      np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-300, err_msg=name)
  np.testing.assert_array_equal(grads2.dq[empty_btn], 0.0)
  np.testing.assert_allclose(grads2.dq[~empty_btn], grads.dq[~empty_btn],
                             rtol=1e-12, atol=1e-300)


def test_masked_keys_do_not_leak_nan():
  """NaN/inf in the key, value and bias entries of keys that take part in no
  row changes nothing; NaN in a key that takes part reaches exactly the rows
  that see it."""
  rng = np.random.default_rng(7)
  B, T, N, H, S, K = 1, 4, 2, 8, 6, 1
  q = rng.standard_normal((B, T, N, H))
  k = rng.standard_normal((B, S, K, H))
  v = rng.standard_normal((B, S, K, H))
  bias = rng.standard_normal((B, N, T, S))
  mask = np.ones((B, N, T, S), bool)
  mask[..., 5] = False  # key 5 takes part nowhere
  mask[0, :, 2, :] = False  # row 2 fully masked
  ref = attention_reference(q, k, v, bias, mask)
  k2, v2, b2 = k.copy(), v.copy(), bias.copy()
  k2[0, 5] = np.nan
  v2[0, 5] = np.inf
  b2[..., 5] = np.nan
  ref2 = attention_reference(q, k2, v2, b2, mask)
  np.testing.assert_array_equal(ref2.out, ref.out)
  np.testing.assert_array_equal(ref2.m, ref.m)
  g = attention_reference_vjp(q, k, v, bias, mask, np.ones_like(q))
  g2 = attention_reference_vjp(q, k2, v2, b2, mask, np.ones_like(q))
  for name in ("dq", "dv", "dbias"):
    np.testing.assert_allclose(getattr(g2, name), getattr(g, name), rtol=1e-12)
  np.testing.assert_allclose(g2.dk[:, :5], g.dk[:, :5], rtol=1e-12)
  # Key 0 takes part in every row except row 2: a NaN there reaches those rows.
  v3 = v.copy()
  v3[0, 0, 0, 0] = np.nan
  out3 = attention_reference(q, k, v3, bias, mask).out
  expect = np.ones((T,), bool)
  expect[2] = False
  np.testing.assert_array_equal(np.isnan(out3[0, :, :, 0]).all(axis=1), expect)
  assert not np.isnan(out3[..., 1:]).any()


# ---------------------------------------------------------------------------
# The naive same-dtype implementation (the tolerance rule's yardstick).


@given(attention_cases(max_seq=128, max_head_dim=64))
def test_naive_attention_is_a_sane_yardstick(case):
  """naive_attention follows the fully masked row contract, is as accurate as
  its dtype allows (within the rule against the reference, trivially with
  rtol 1, and close in float32), and is not exact in a low dtype."""
  note(case.describe())
  kw = case.kwargs
  ref = attention_reference(*case.args, **kw)
  out, m, l = naive_attention(*case.args, dtype=case.dtype, **kw)
  empty = ref.m == -np.inf
  np.testing.assert_array_equal(m[empty], -np.inf)
  np.testing.assert_array_equal(l[empty], 0.0)
  assert np.all(out[np.swapaxes(empty, 1, 2)] == 0.0)
  assert not np.isnan(out).any()
  if case.dtype == float32:
    tol = 1e-4 * max(1.0, float(np.abs(ref.out).max()))
    np.testing.assert_allclose(out, ref.out, atol=tol)
  grads = naive_attention_vjp(*case.args, case.d_out, dtype=case.dtype, **kw)
  want = attention_reference_vjp(*case.args, case.d_out, **kw)
  for name in ("dq", "dk", "dv", "dbias"):
    a, b = getattr(grads, name), getattr(want, name)
    if b is None:
      assert a is None
      continue
    assert a.shape == b.shape, name
    assert not np.isnan(a).any(), name
    if case.dtype == float32:
      tol = 1e-3 * max(1.0, float(np.abs(b).max()))
      np.testing.assert_allclose(a, b, atol=tol, err_msg=name)


def test_naive_attention_rounds_to_its_dtype():
  """In bfloat16 the naive error is well above float32's and below 5%: the
  yardstick measures a real low-precision computation."""
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, 64, 2, 64)).astype(bfloat16)
  k = rng.standard_normal((1, 96, 2, 64)).astype(bfloat16)
  v = rng.standard_normal((1, 96, 2, 64)).astype(bfloat16)
  ref = attention_reference(q, k, v)
  errors = {}
  for dt in (bfloat16, float16, float32):
    out, _, _ = naive_attention(q, k, v, dtype=dt)
    errors[str(dt)] = float(np.abs(out - ref.out).max())
  assert errors["float32"] < 1e-5
  assert errors["float16"] < errors["bfloat16"] < 0.05
  assert errors["bfloat16"] > 10 * errors["float32"]
