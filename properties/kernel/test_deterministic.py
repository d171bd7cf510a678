"""``deterministic=True``: bitwise reproducible gradients on every path.

CPU: the flag keeps the fused dQ where it applies and sums it in int32
fixed point (the same launches, an int32 accumulator), changes nothing where
it does not apply, and is refused unless a bool; the fixed point's bound
holds every partial sum of a row inside int32 (Hypothesis, float64), and
its rounding by float adds is exact.  GPU (marker ``gpu``): 100 reruns
of forward and backward are bitwise identical (out, m, l, dq, dk, dv, dbias)
over causal, GQA, bias, ragged and head-dim-256 cases, while other
allocations move every rerun's buffers; with the default, dq stays within
``harness.numerics.tolerance.run_to_run_bound`` and everything else is bitwise.
"""

from __future__ import annotations

import os

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypothesis import given, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics.reference import attention_reference
from harness.numerics.tolerance import run_to_run_bound
from kernel import api
from kernel.backward import fused_dq

RERUNS = 100


def _lowered_vjp(deterministic, *, is_causal=False, head_dim=64):
  """(kernel launches of the vjp lowered for CUDA, the vjp's jaxpr)."""
  sds = jax.ShapeDtypeStruct
  q = sds((1, 256, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out = api.dot_product_attention(q, k, v, is_causal=is_causal, deterministic=deterministic)
    return out.astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))
  with api.lowering_only():
    text = jax.export.export(jax.jit(grad), platforms=["cuda"])(q, q, q).mlir_module()
    jaxpr = str(jax.make_jaxpr(grad)(q, q, q))
  return len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)), jaxpr


@pytest.mark.parametrize("is_causal,head_dim", [(False, 64), (True, 64), (False, 128)])
def test_deterministic_sums_the_fused_dq_in_fixed_point(is_causal, head_dim):
  """Where the fused dQ applies, deterministic=True keeps its launches
  (forward, then dK/dV with dQ) and accumulates dQ in int32, the default in
  float32: the accumulator has q's shape."""
  acc = f"[1,256,2,{head_dim}]"
  launches, default = _lowered_vjp(False, is_causal=is_causal, head_dim=head_dim)
  assert launches == 2 and "f32" + acc in default and "i32" + acc not in default
  launches, fixed = _lowered_vjp(True, is_causal=is_causal, head_dim=head_dim)
  assert launches == 2 and "i32" + acc in fixed


def test_deterministic_changes_nothing_where_there_is_no_fused_dq():
  for kw in (dict(is_causal=True, head_dim=128), dict(head_dim=256)):
    assert _lowered_vjp(False, **kw)[0] == _lowered_vjp(True, **kw)[0] == 3, kw


def test_rounding_by_float_adds_is_exact():
  """kernel.backward.fused_dq._round_by_adds is round-half-even to int32 for |y| <
  2^30.  Evaluated op by op: XLA's CPU compiler reassociates the adds under
  jit (the kernel's Mosaic GPU lowering does not)."""
  rng = np.random.default_rng(0)
  y = rng.standard_normal(20000) * 2.0 ** rng.integers(-8, 30, 20000)
  y = np.concatenate([y, [0.5, 1.5, -2.5, 127.5, 128.0, -128.5, 255.5, 2.0 ** 29 + 0.5,
                          -(2.0 ** 30) + 1, 2.0 ** 30 - 64]])
  y = np.clip(y, -(2.0 ** 30) + 1, 2.0 ** 30 - 64).astype(np.float32)
  with jax.disable_jit():
    got = np.asarray(fused_dq._round_by_adds(jnp.asarray(y)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.rint(y.astype(np.float64)).astype(np.int64))


def test_fixed_point_leaves_headroom():
  """A row's sum, within 2^FIXED_POINT_BITS of the a-priori bound (the
  property below), grown by bfloat16's rounding of dS (2^-8) and one unit
  per part (up to 2^13 key tiles), stays inside the rounding's range (2^30),
  and so inside int32."""
  assert 2.0 ** fused_dq.FIXED_POINT_BITS * (1 + 2.0 ** -7) + 2 ** 13 < 2 ** 30


_scales = jax.jit(fused_dq.fixed_point_scales, static_argnums=4)


@st.composite
def _fixed_point_problems(draw):
  group, kv_heads = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
  # few shapes (each a compilation of the scales), lengths of 1, ragged, and
  # over one 128-key tile
  t, s = draw(st.sampled_from([1, 37, 96])), draw(st.sampled_from([1, 130, 300]))
  d = draw(st.sampled_from([8, 64]))
  scales = [10.0 ** draw(st.integers(-3, 3)) for _ in range(4)]
  return dict(group=group, kv_heads=kv_heads, t=t, s=s, d=d, scales=scales,
              causal=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
              zero_rows=draw(st.booleans()))


@settings(deadline=None)
@given(_fixed_point_problems())
def test_fixed_point_bound_holds_every_partial_sum_in_int32(p):
  """c_i (kernel.backward.fused_dq.fixed_point_scales) times any partial sum of row
  i's dQ parts over 128-key tiles stays within 2^FIXED_POINT_BITS, so the
  int32 reduce-adds never overflow: dP, delta and dS from the float64
  reference's probabilities and output, for bfloat16 inputs of mixed magnitudes, GQA, causal, zero cotangent rows."""
  rng = np.random.default_rng(p["seed"])
  n, kh, t, s, d = p["group"] * p["kv_heads"], p["kv_heads"], p["t"], p["s"], p["d"]
  bf = lambda shape, sc: np.asarray(
      jnp.asarray(rng.standard_normal(shape) * sc, jnp.bfloat16), np.float64)
  q, k, v, do = (bf((1, t, n, d), p["scales"][0]), bf((1, s, kh, d), p["scales"][1]),
                 bf((1, s, kh, d), p["scales"][2]), bf((1, t, n, d), p["scales"][3]))
  if p["zero_rows"]:
    do[:, ::3] = 0.0
  kv = lambda x: np.repeat(x, p["group"], axis=2)
  ref = attention_reference(q, k, v, None, None, is_causal=p["causal"])
  dp = np.einsum("btnd,bsnd->bnts", do, kv(v))
  delta = np.einsum("btnd,btnd->bnt", do, ref.out)
  ds = ref.probs * (dp - delta[..., None])
  rows = np.stack([np.zeros_like(delta), delta], axis=2).astype(np.float32)
  c = np.asarray(_scales(
      jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
      jnp.asarray(do, jnp.bfloat16), jnp.asarray(rows), p["group"]), np.float64)
  assert np.all(np.isfinite(c)) and np.all(c > 0)
  parts = [np.einsum("bnts,bsnd->bntd", ds[..., j:j + 128], kv(k)[:, j:j + 128])
           for j in range(0, s, 128)]
  limit = 2.0 ** fused_dq.FIXED_POINT_BITS
  for sums in (np.cumsum(parts, axis=0), np.cumsum(parts[::-1], axis=0)):
    worst = np.max(np.abs(sums) * c[None, ..., None])
    assert worst <= limit, f"{worst / limit:.3f} of 2^{fused_dq.FIXED_POINT_BITS}"
  # and c_i is the largest power of two that keeps the a-priori bound U_i
  # (the notes above FIXED_POINT_BITS) within the limit
  bound = ((np.linalg.norm(do, axis=3).transpose(0, 2, 1)
            * kv(np.max(np.linalg.norm(v, axis=3), axis=1)[:, None])[:, 0, :, None]
            + np.abs(delta)) * kv(np.max(np.abs(k), axis=(1, 3))[:, None])[:, 0, :, None])
  live = bound > 0
  assert np.all(c[live] * bound[live] <= limit * (1 + 1e-5))
  assert np.all(c[live] * bound[live] > limit / 2 * (1 - 1e-5))


def test_deterministic_must_be_a_bool():
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with api.lowering_only(), pytest.raises(ValueError, match="deterministic"):
    api.dot_product_attention(q, q, q, deterministic="yes")


def _specs():
  S = hs.AttentionShapes
  yield "gqa-d128", hs.CaseSpec(shapes=S(B=2, T=300, N=4, H=128, S=700, K=2, Hv=128),
                                dtype="bfloat16", seed=51)
  yield "causal-ragged-d64", hs.CaseSpec(shapes=S(B=1, T=1000, N=2, H=64, S=777, K=1, Hv=64),
                                         dtype="bfloat16", seed=52, is_causal=True)
  yield "bias-d64", hs.CaseSpec(shapes=S(B=2, T=256, N=2, H=64, S=384, K=1, Hv=64),
                                dtype="bfloat16", seed=53,
                                bias=hs.BiasSpec((2, 2, 256, 384), 1.0, 54))
  yield "d256-causal", hs.CaseSpec(shapes=S(B=1, T=200, N=2, H=256, S=300, K=1, Hv=256),
                                   dtype="bfloat16", seed=55, is_causal=True)


_SPECS = list(_specs())


def _runner(case, deterministic):
  """A jitted function of the case's arrays returning every output and
  gradient the contract covers, as a flat list."""
  kw = case.kwargs
  j = lambda x: None if x is None else jnp.asarray(x)
  with_bias = case.bias is not None

  def run(q, k, v, bias, d_out):
    def attention(q, k, v, bias):
      return api.dot_product_attention(
          q, k, v, bias, j(case.mask), scale=kw["scale"], is_causal=kw["is_causal"],
          k_start=j(case.k_start), k_end=j(case.k_end), logits_soft_cap=kw["logits_soft_cap"],
          return_residuals=True, deterministic=deterministic)
    args = (q, k, v, bias) if with_bias else (q, k, v)
    f = attention if with_bias else (lambda q, k, v: attention(q, k, v, bias))
    (out, (m, l)), pullback = jax.vjp(f, *args)
    grads = pullback((d_out, (jnp.zeros_like(m), jnp.zeros_like(l))))
    return [out, m, l, *grads]

  args = (j(case.query), j(case.key), j(case.value), j(case.bias),
          jnp.asarray(case.d_out).astype(case.query.dtype))
  return jax.jit(run), args


NAMES = ("out", "m", "l", "dq", "dk", "dv", "dbias")


def _reruns(case, deterministic, reruns):
  """``reruns`` results of the same call, each computed while a differently
  sized allocation holds memory, so that the call's buffers (and XLA's
  workspaces) land at other addresses, beside one large allocation of most
  of the memory this process may use for the whole loop: half of what the
  allocator has free, shared among the xdist workers on this GPU (each of
  them sees the whole GPU as its limit; holding half of it in every worker
  runs the gate's other workers out of memory)."""
  fn, args = _runner(case, deterministic)
  device = jax.devices("gpu")[0]
  stats = device.memory_stats() or {}
  free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
  workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
  gpus = max(len([g for g in os.environ.get("FLASH_HOST_GPUS", "").split(",") if g]), 1)
  sharing = -(-workers // gpus)   # properties/conftest.py deals workers to GPUs in turn
  hold = jnp.zeros((max(free // (2 * sharing), 1),), jnp.uint8) if free > 0 else None
  results = []
  for i in range(reruns):
    shift = jnp.zeros(((i % 7) * (1 << 20) + 1,), jnp.uint8)
    results.append([np.asarray(x) for x in jax.block_until_ready(fn(*args))])
    del shift
  del hold
  return results


@pytest.mark.gpu
@pytest.mark.parametrize("name,spec", _SPECS, ids=[n for n, _ in _SPECS])
def test_deterministic_reruns_are_bitwise_identical(name, spec):
  """With deterministic=True, 100 reruns give the same bits in every output
  and gradient."""
  case = hs.build_case(spec)
  first, *rest = _reruns(case, True, RERUNS)
  for i, run in enumerate(rest, 1):
    for label, a, b in zip(NAMES, first, run):
      assert a.tobytes() == b.tobytes(), f"{name}: {label} of rerun {i} differs from rerun 0"


@pytest.mark.gpu
def test_default_reruns_stay_within_the_run_to_run_bound():
  """Without it, the fused dQ's dq stays within run_to_run_bound of the
  first run and every other output is bitwise identical."""
  name, spec = _SPECS[0]
  case = hs.build_case(spec)
  first, *rest = _reruns(case, False, 20)
  for run in rest:
    for label, a, b in zip(NAMES, first, run):
      if label == "dq":
        assert run_to_run_bound(a.astype(np.float64), b.astype(np.float64), case.dtype) <= 1.0
      else:
        assert a.tobytes() == b.tobytes(), label
