"""Gradients through the kernel's custom_vjp on the GPU (marker ``gpu``).

The forward kernel stores (out, m, l); the backward (the Pallas kernels of
kernel/backward/; kernel/backward/xla.py is their specification) reads
exactly those.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings

from harness.numerics import strategies as hs
from harness.numerics.conformance import gradient_reports
from harness.numerics.tolerance import run_to_run_bound
from kernel import api, experiments

pytestmark = pytest.mark.gpu
# The backward under test (a kernel.experiments.BACKWARDS name): the shipped one
# unless GRADIENT_BACKWARD names another, e.g. to run these properties on a
# private variant before it ships (GRADIENT_BACKWARD=<name>; ci/device/compare-backward.sh).
BACKWARD = os.environ.get("GRADIENT_BACKWARD", "pallas")
if BACKWARD not in experiments.BACKWARDS:
  raise ValueError(f"GRADIENT_BACKWARD: expected one of {sorted(experiments.BACKWARDS)}, "
                   f"got {BACKWARD!r}")


def kernel_grads(case, backward=BACKWARD, **switches):
  """(dq, dk, dv, dbias) of ``case`` through the kernels' custom_vjp;
  ``switches``: kernel.experiments' switches."""
  kw = case.kwargs
  j = lambda x: None if x is None else jnp.asarray(x)
  d_out = jnp.asarray(case.d_out, jnp.float32)

  def loss(q, k, v, bias):
    out = experiments.dot_product_attention(q, k, v, bias, j(case.mask), scale=kw["scale"],
                                    is_causal=kw["is_causal"], k_start=j(case.k_start),
                                    k_end=j(case.k_end), logits_soft_cap=kw["logits_soft_cap"],
                                    backward=backward, **switches)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  argnums = (0, 1, 2, 3) if case.bias is not None else (0, 1, 2)
  grads = jax.grad(loss, argnums=argnums)(j(case.query), j(case.key), j(case.value), j(case.bias))
  grads = [np.asarray(g.astype(jnp.float32), np.float64) for g in grads]
  return grads + [None] * (4 - len(grads))


@pytest.mark.parametrize("shard", range(hs.GPU_SHARDS))
@given(case=hs.attention_cases(max_batch=2, max_seq=700, max_head_dim=256, big=True,
                               max_logits=None))
@settings(max_examples=hs.per_shard(28))
def test_gradients_match_float64(shard, case):
  """dq, dk, dv (and dbias) are within the tolerance rule of float64."""
  note(case.describe())
  for r in gradient_reports(case, kernel_grads(case)):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


@pytest.mark.parametrize("shard", range(hs.GPU_SHARDS))
@given(case=hs.attention_cases(max_batch=2, max_seq=700, max_head_dim=256, big=True,
                               max_logits=None, allow_key_ranges=False))
@settings(max_examples=hs.per_shard(12))
def test_ranges_always_gradients_match_float64(shard, case):
  """kernel.experiments' ranges_always: a call without key ranges (none
  drawn, so the switch acts on every case) runs the backward kernels that
  read them (the whole keys as every row's range), within the tolerance
  rule of float64 as well."""
  note(case.describe())
  for r in gradient_reports(case, kernel_grads(case, ranges_always=True)):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


@pytest.mark.parametrize("shard", range(hs.GPU_SHARDS))
@given(case=hs.attention_cases(max_batch=2, max_seq=700, max_head_dim=128, big=True,
                               max_logits=None))
@settings(max_examples=hs.per_shard(12))
def test_deterministic_gradients_match_float64(shard, case):
  """deterministic=True's backward (the fused dQ summed in int32 fixed point
  where it applies: kernel.backward.fused_dq.FIXED_POINT_BITS) within the tolerance
  rule of float64 too."""
  note(case.describe())
  for r in gradient_reports(case, kernel_grads(case, backward="pallas-fixed-point")):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


def test_gradients_are_reproducible():
  """dk and dv are bitwise identical from run to run.  dq, summed over key
  tiles in float32 by reduce-adds in no fixed order (the fused dQ,
  kernel/backward/fused_dq.py), stays within harness.numerics.tolerance.run_to_run_bound of
  the first run; the two-kernel backward's dq and the fixed-point sum's
  (deterministic=True) are bitwise identical."""
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=2, T=300, N=4, H=128, S=700, K=2, Hv=128),
                     dtype="bfloat16", seed=12, is_causal=True)
  case = hs.build_case(spec)
  runs = [kernel_grads(case) for _ in range(4)]
  for run in runs[1:]:
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), runs[0], run):
      if name == "dq":
        assert run_to_run_bound(x, y, case.dtype) <= 1.0
      else:
        assert (x is None and y is None) or np.array_equal(x, y), name
  for backward in ("pallas-two-kernel", "pallas-fixed-point"):
    a, b = (kernel_grads(case, backward=backward) for _ in range(2))
    for x, y in zip(a, b):
      assert (x is None and y is None) or np.array_equal(x, y), backward


def _named_gradient_specs():
  """One case per path of the backward kernels (kernel/backward/)."""
  S = hs.AttentionShapes
  yield "gqa-d128", hs.CaseSpec(shapes=S(B=2, T=256, N=4, H=128, S=384, K=2, Hv=128),
                                dtype="bfloat16", seed=21)
  yield "ragged-causal-d72-dv96", hs.CaseSpec(
      shapes=S(B=1, T=113, N=2, H=72, S=203, K=1, Hv=96), dtype="bfloat16", seed=22,
      is_causal=True)
  # GQA through the dQ kernel (causal takes it over head dim 64:
  # kernel.tiling.backward_plan.blocks_for): the group's heads share a key/value head there too.
  yield "gqa-causal-dq-kernel", hs.CaseSpec(shapes=S(B=1, T=192, N=4, H=128, S=256, K=2, Hv=128),
                                            dtype="bfloat16", seed=33, is_causal=True)
  yield "causal-kv-longer", hs.CaseSpec(shapes=S(B=1, T=100, N=2, H=64, S=300, K=2, Hv=64),
                                        dtype="float16", seed=23, is_causal=True)
  yield "d256-head-split", hs.CaseSpec(shapes=S(B=1, T=200, N=2, H=256, S=150, K=1, Hv=256),
                                      dtype="bfloat16", seed=24)
  yield "d256-dv128-causal", hs.CaseSpec(shapes=S(B=1, T=130, N=1, H=256, S=260, K=1, Hv=128),
                                         dtype="bfloat16", seed=25, is_causal=True)
  # The head split of both backward kernels (head dims over 128) on each of
  # its paths: GQA under causal, a head dim of 192 (96 columns per
  # warpgroup), a bias (the dQ kernel writing dS), key ranges with a soft cap.
  yield "d256-gqa-causal", hs.CaseSpec(
      shapes=S(B=2, T=333, N=4, H=256, S=333, K=2, Hv=256), dtype="bfloat16", seed=34,
      is_causal=True)
  yield "d192-ragged", hs.CaseSpec(shapes=S(B=1, T=257, N=2, H=192, S=129, K=1, Hv=192),
                                   dtype="float16", seed=35)
  yield "d256-bias", hs.CaseSpec(
      shapes=S(B=1, T=200, N=2, H=256, S=300, K=1, Hv=256), dtype="bfloat16", seed=36,
      bias=hs.BiasSpec((1, 2, 200, 300), 1.0, 12))
  yield "d256-key-ranges-softcap", hs.CaseSpec(
      shapes=S(B=1, T=256, N=2, H=256, S=384, K=2, Hv=256), dtype="bfloat16", seed=37,
      logits_soft_cap=10.0, key_range=hs.KeyRangeSpec((1, 2, 256), 384, 13))
  # Head dims up to 64 without causal stream 128 query rows per dK/dV block
  # (kernel.tiling.backward_plan.blocks_for): the fused dQ with GQA at lengths no
  # multiple of 128, and with key ranges (their edge terms) as well.
  yield "d64-gqa-ragged-stream-128", hs.CaseSpec(
      shapes=S(B=1, T=300, N=4, H=64, S=200, K=2, Hv=64), dtype="bfloat16", seed=38)
  yield "d64-key-ranges-stream-128", hs.CaseSpec(
      shapes=S(B=2, T=333, N=4, H=64, S=517, K=2, Hv=64), dtype="float16", seed=39,
      key_range=hs.KeyRangeSpec((2, 4, 333), 517, 14))
  yield "bias-full-softcap", hs.CaseSpec(
      shapes=S(B=2, T=256, N=2, H=64, S=256, K=1, Hv=64), dtype="bfloat16", seed=26,
      logits_soft_cap=5.0, bias=hs.BiasSpec((2, 2, 256, 256), 1.0, 7))
  yield "bias-row-neg-inf", hs.CaseSpec(
      shapes=S(B=1, T=192, N=2, H=64, S=320, K=1, Hv=64), dtype="bfloat16", seed=27,
      bias=hs.BiasSpec((1, 1, 1, 320), 1.0, 8, neg_inf=0.1))
  yield "mask-empty-rows", hs.CaseSpec(
      shapes=S(B=1, T=256, N=2, H=64, S=256, K=1, Hv=64), dtype="bfloat16", seed=28,
      mask=hs.MaskSpec((1, 1, 256, 256), 0.6, 9, empty_rows=0.05))
  yield "key-ranges-bias", hs.CaseSpec(
      shapes=S(B=1, T=256, N=2, H=64, S=384, K=1, Hv=64), dtype="bfloat16", seed=29,
      key_range=hs.KeyRangeSpec((1, 2, 256), 384, 10), bias=hs.BiasSpec((1, 2, 256, 384), 1.0, 11))
  yield "f32-inputs-scale", hs.CaseSpec(shapes=S(B=1, T=64, N=1, H=64, S=64, K=1, Hv=64),
                                        dtype="float32", seed=30, scale=0.3)
  # Drawn on the H200: rows that see one key, where dP - delta is exactly 0,
  # from float32 inputs; the cotangent must be rounded as the forward's
  # output was (docs/decisions/cotangent-in-compute-dtype.md).
  yield "f32-one-key-rows", hs.CaseSpec(
      shapes=S(B=2, T=2, N=4, H=72, S=291, K=1, Hv=256), dtype="float32", seed=4499,
      is_causal=True, logits_soft_cap=30.0,
      bias=hs.BiasSpec(shape=(2, 4, 2, 291), std=1.0, seed=79381562, neg_inf=0.0),
      key_range=hs.KeyRangeSpec(shape=(2, 4, 1), S=291, seed=183517095, which="both"))


_NAMED_GRADIENTS = list(_named_gradient_specs())


@pytest.mark.parametrize("name,spec", _NAMED_GRADIENTS, ids=[n for n, _ in _NAMED_GRADIENTS])
def test_named_gradient_cases(name, spec):
  """Each path of the backward kernels (the head split for wide heads, GQA sums,
  dbias with broadcast and -inf entries, soft cap, key ranges, fully masked
  rows, ragged lengths) against float64."""
  case = hs.build_case(spec)
  grads = kernel_grads(case)
  assert all(np.isfinite(g).all() for g in grads if g is not None)
  for r in gradient_reports(case, grads):
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


# Lengths that are multiples of 8 but of no tile, where kernel.experiments'
# "pallas-unpadded" hands the kernels q, k, v and dO as they are: the fused
# dQ with GQA, the dQ kernel under causal, a bias (dS written), the head
# split, and the fixed-point dQ.
_UNPADDED = [
    ("d64-gqa-fused", dict(B=2, T=1000, N=4, H=64, S=520, K=2, Hv=64), {}, False),
    ("d128-gqa-causal", dict(B=1, T=1000, N=4, H=128, S=1000, K=2, Hv=128),
     dict(is_causal=True), False),
    ("d128-bias", dict(B=1, T=328, N=2, H=128, S=200, K=1, Hv=128), dict(bias=True), False),
    ("d256-head-split", dict(B=1, T=200, N=2, H=256, S=456, K=1, Hv=256), {}, False),
    ("d128-fixed-point", dict(B=1, T=1000, N=4, H=128, S=1000, K=2, Hv=128), {}, True),
]


@pytest.mark.parametrize("name,shapes,kw,deterministic", _UNPADDED,
                         ids=[n for n, *_ in _UNPADDED])
def test_the_unpadded_backward_matches_the_padded_one(name, shapes, kw, deterministic):
  """Read unpadded, past their ends as zeros, the kernels give dk, dv (and
  dbias) bitwise equal to the padded copies' and dq within the run-to-run
  bound (bitwise in fixed point), all within the float64 rule."""
  _matches_the_padded_backward("pallas-unpadded", shapes, kw, deterministic, seed=40)


def _matches_the_padded_backward(backward, shapes, kw, deterministic, *, seed):
  """The gradients of kernel.experiments' ``backward`` on a case of these
  shapes: dk, dv (and dbias) bitwise the shipped padded backward's, dq
  within the run-to-run bound (bitwise in fixed point), all within the
  float64 rule."""
  T, S = shapes["T"], shapes["S"]
  bias = hs.BiasSpec((1, shapes["N"], T, S), 1.0, seed + 1) if kw.get("bias") else None
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(**shapes), dtype="bfloat16", seed=seed,
                     is_causal=kw.get("is_causal", False), bias=bias)
  case = hs.build_case(spec)
  padded = kernel_grads(case, backward="pallas", deterministic=deterministic)
  other = kernel_grads(case, backward=backward, deterministic=deterministic)
  for grad, x, y in zip(("dq", "dk", "dv", "dbias"), padded, other):
    if grad == "dq" and not deterministic:
      assert run_to_run_bound(x, y, case.dtype) <= 1.0, grad
    else:
      assert (x is None and y is None) or np.array_equal(x, y), grad
  for r in gradient_reports(case, other):
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


# Lengths no multiple of 8, where kernel.experiments' "pallas-untiled" hands
# the kernels q, k, v and dO as they are, copied through untiled views in
# column parts: the fused dQ with GQA, the dQ kernel under causal, a bias
# (dS written), the head split, and the fixed-point dQ.
_UNTILED = [
    ("d64-gqa-fused", dict(B=2, T=1001, N=4, H=64, S=777, K=2, Hv=64), {}, False),
    ("d128-gqa-causal", dict(B=1, T=4001, N=4, H=128, S=4001, K=2, Hv=128),
     dict(is_causal=True), False),
    ("d128-bias", dict(B=1, T=329, N=2, H=128, S=201, K=1, Hv=128), dict(bias=True), False),
    ("d256-head-split", dict(B=1, T=1001, N=2, H=256, S=457, K=1, Hv=256), {}, False),
    ("d256-causal", dict(B=1, T=1001, N=2, H=256, S=1001, K=1, Hv=256), dict(is_causal=True),
     False),
    ("d128-fixed-point", dict(B=1, T=1001, N=4, H=128, S=1001, K=2, Hv=128), {}, True),
]


@pytest.mark.parametrize("name,shapes,kw,deterministic", _UNTILED, ids=[n for n, *_ in _UNTILED])
def test_the_untiled_backward_matches_the_padded_one(name, shapes, kw, deterministic):
  """Copied through untiled views in column parts, unpadded, the kernels
  give dk, dv (and dbias) bitwise equal to the padded copies' and dq within
  the run-to-run bound (bitwise in fixed point), all within the float64
  rule (docs/decisions/backward-untiled-copies.md)."""
  _matches_the_padded_backward("pallas-untiled", shapes, kw, deterministic, seed=42)


def test_causal_rows_padded_by_the_caller_match_the_unpadded_problem():
  """docs/contracts.md's tip for lengths that are no multiple of 8: under causal
  self-attention a caller who appends zero rows to q, k and v (cotangent 0
  on the padded rows) gets, for the real rows and keys, out, dq, dk and dv
  within the tolerance rule of the unpadded problem's float64 reference,
  and exactly zero dk and dv on the padded keys (only padded rows see them)."""
  import copy
  from harness.numerics import reference as ref_lib, tolerance
  from harness.numerics.conformance import compute_dtype
  T, pad = 1001, 7
  case = hs.build_case(hs.CaseSpec(shapes=hs.AttentionShapes(B=1, T=T, N=4, H=128, S=T, K=2,
                                                             Hv=128),
                                   dtype="bfloat16", seed=41, is_causal=True))
  widen = lambda x: np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
  padded = copy.copy(case)
  padded.query, padded.key, padded.value, padded.d_out = (
      widen(case.query), widen(case.key), widen(case.value), widen(case.d_out))
  out = api.dot_product_attention(jnp.asarray(padded.query), jnp.asarray(padded.key),
                                  jnp.asarray(padded.value), is_causal=True)
  out = np.asarray(out.astype(jnp.float32), np.float64)[:, :T]
  dt = compute_dtype(case.dtype)
  want = ref_lib.attention_reference(*case.args, **case.kwargs)
  naive_out = ref_lib.naive_attention(*case.args, dtype=dt, **case.kwargs)[0]
  r = tolerance.check_tolerance(out, want.out, naive_out, dt, rtol=case.rtol, name="out")
  assert r.passed, f"out: err {r.max_error} > bound {r.bound}"
  dq, dk, dv, _ = kernel_grads(padded)
  assert not dk[:, T:].any() and not dv[:, T:].any()
  for r in gradient_reports(case, [dq[:, :T], dk[:, :T], dv[:, :T], None]):
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


def test_the_kernels_agree_with_their_executable_specification():
  """The Pallas backward and kernel/backward/xla.py read the same residuals:
  their gradients agree to within the tolerance rule of each other's float64
  distance (a coarse cross-check that localises a failure to the kernels)."""
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=1, T=256, N=2, H=128, S=256, K=1, Hv=128),
                     dtype="bfloat16", seed=31, is_causal=True)
  case = hs.build_case(spec)
  pallas = gradient_reports(case, kernel_grads(case))
  xla = gradient_reports(case, kernel_grads(case, backward="xla"))
  for p, x in zip(pallas, xla):
    assert p.passed and x.passed
    assert p.max_error <= 4 * x.max_error + 1e-6, (p.name, p.max_error, x.max_error)


@pytest.mark.parametrize("backward", ["pallas", "pallas-fixed-point"])
def test_nan_in_the_cotangent_propagates_as_the_reference_says(backward):
  """NaN in one row t of dO (causal), with the float32 and the fixed-point
  sum of the fused dQ (whose row scale is NaN there): dq and dk are NaN exactly where the
  float64 reference's are (dq in row t; dk in the keys row t sees: dS is 0
  for masked pairs).  dv = P^T dO is NaN wherever the reference's is, and may
  also be NaN for keys row t cannot see that share a key tile with ones it
  can (0 * NaN inside the tile's matrix product; FlashAttention and cuDNN
  behave alike), never beyond that tile (128 keys: 2 warpgroups x 64)."""
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=1, T=256, N=2, H=64, S=256, K=1, Hv=64),
                     dtype="bfloat16", seed=32, is_causal=True)
  case = hs.build_case(spec)
  t = 40
  case.d_out[0, t, 1, 3] = np.nan
  from harness.numerics import reference as ref_lib
  want = ref_lib.attention_reference_vjp(*case.args, case.d_out, **case.kwargs)
  dq, dk, dv, _ = kernel_grads(case, backward=backward)
  for name, got in (("dq", dq), ("dk", dk)):
    assert np.array_equal(np.isnan(got), np.isnan(getattr(want, name))), name
  ref_nan, nan = np.isnan(want.dv), np.isnan(dv)
  assert ref_nan.any() and not (ref_nan & ~nan).any(), "dv: a NaN of the reference is missing"
  tile_end = -(-(t + 1) // 128) * 128
  assert not nan[:, tile_end:].any(), "dv: NaN beyond the key tile that row t sees"
