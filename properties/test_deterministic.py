"""``deterministic=True``: bitwise reproducible gradients on every path.

CPU: the flag routes the backward around the fused dQ (one more kernel
launch in the lowered vjp where the fusion applies, the same launches where
it does not) and is refused unless a bool.  GPU (marker ``gpu``): 100 reruns
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

from harness.numerics import strategies as hs
from harness.numerics.tolerance import run_to_run_bound
from kernel import api

RERUNS = 100


def _lowered_vjp_kernels(deterministic, *, is_causal=False, head_dim=64):
  sds = jax.ShapeDtypeStruct
  q = sds((1, 256, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out = api.dot_product_attention(q, k, v, is_causal=is_causal, deterministic=deterministic)
    return out.astype(jnp.float32).sum()

  with api.lowering_only():
    text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                             platforms=["cuda"])(q, q, q).mlir_module()
  return len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text))


def test_deterministic_takes_the_dq_kernel_where_the_fused_dq_applies():
  # forward + dK/dV with the fused dQ, against forward + dK/dV + dQ kernel
  assert _lowered_vjp_kernels(False) == 2
  assert _lowered_vjp_kernels(True) == 3


def test_deterministic_takes_the_dq_kernel_under_causal_at_head_dim_64():
  assert _lowered_vjp_kernels(False, is_causal=True) == 2
  assert _lowered_vjp_kernels(True, is_causal=True) == 3


def test_deterministic_changes_nothing_where_there_is_no_fused_dq():
  for kw in (dict(is_causal=True, head_dim=128), dict(head_dim=256)):
    assert _lowered_vjp_kernels(False, **kw) == _lowered_vjp_kernels(True, **kw), kw


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
  ran the gate's other workers out of memory on the H200, 2026-12-02)."""
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
