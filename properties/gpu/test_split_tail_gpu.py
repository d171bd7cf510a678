"""The split tail on the GPU (marker ``gpu``; skipped, visibly, elsewhere).

Drawn shapes are small, so their tiles are fewer than the SMs and every
tile is cut into pieces (the split-KV end of the schedule); the named
cases of ``harness.tools.device_check`` (``split-tail-*``) add a launch
with whole waves before its pieces.  Forward against float64, gradients
through the merged residuals against float64.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, note, settings

from harness.numerics import strategies as hs
from harness.numerics.conformance import gradient_reports, run_and_check_forward
from kernel import api, experiments
from kernel.tiling import heuristics

pytestmark = pytest.mark.gpu

cases = hs.attention_cases(max_batch=2, max_seq=900, max_head_dim=256, max_kv_heads=2,
                           big=True, max_logits=None)


def _split_tail_config(case):
  """The first split-tail config the autotuner may time for ``case``, or
  None (causal, or none fits)."""
  problem = api.resolved_problem(
      jnp.asarray(case.query), jnp.asarray(case.key), jnp.asarray(case.value),
      None if case.bias is None else jnp.asarray(case.bias),
      None if case.mask is None else jnp.asarray(case.mask), is_causal=case.spec.is_causal)
  return next((c for c in heuristics.get_autotuning_configs(problem)
               if c.schedule == "split-tail"), None)


@given(case=cases)
@settings(max_examples=20)
def test_split_tail_forward_matches_float64(case):
  config = _split_tail_config(case)
  assume(config is not None and not case.variant_kwargs)
  note(f"{case.describe()} config={config}")
  fc = case.call
  report = run_and_check_forward(fc, config=config)
  note(report.summary())
  assert report.passed, report.summary()


def _split_tail_gradient_reports(case, config):
  """(dq, dk, dv, dbias) of ``case`` run under ``config`` against float64."""
  kw = case.kwargs
  j = lambda x: None if x is None else jnp.asarray(x)
  d_out = jnp.asarray(case.d_out, jnp.float32)

  def loss(q, k, v, bias):
    out = experiments.dot_product_attention(
        q, k, v, bias, j(case.mask), scale=kw["scale"], is_causal=kw["is_causal"],
        k_start=j(case.k_start), k_end=j(case.k_end), logits_soft_cap=kw["logits_soft_cap"],
        config=config)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  argnums = (0, 1, 2, 3) if case.bias is not None else (0, 1, 2)
  grads = jax.grad(loss, argnums=argnums)(j(case.query), j(case.key), j(case.value),
                                          j(case.bias))
  grads = [np.asarray(g.astype(jnp.float32), np.float64) for g in grads]
  return gradient_reports(case, grads + [None] * (4 - len(grads)))


@given(case=cases)
@settings(max_examples=12)
def test_gradients_through_the_split_tail_match_float64(case):
  """The backward reads the merged (m, l): dq, dk, dv (dbias) within the
  tolerance rule of float64."""
  config = _split_tail_config(case)
  assume(config is not None and not case.variant_kwargs)
  note(f"{case.describe()} config={config}")
  for r in _split_tail_gradient_reports(case, config):
    note(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}")
    assert r.passed, f"{r.name}: err {r.max_error} > bound {r.bound}"


# The drawn case whose dk broke the rule under the split tail on the H200 at
# d7b1b53 (1.95 times its bound), replayed under the split tail and under the
# same tiling round-robin, which config=None now runs in its place
# (docs/decisions/split-tail-off-the-default.md).
ONE_KEY = hs.CaseSpec(
    shapes=hs.AttentionShapes(B=2, T=1433, N=4, H=256, S=1, K=2, Hv=256), dtype="float16",
    seed=4294967294, scale=-0.2, logits_soft_cap=32.522261632380726,
    mask=hs.MaskSpec(shape=(2, 4, 1, 1), density=0.9, seed=14172),
    bias=hs.BiasSpec(shape=(2, 4, 1433, 1), std=1.0, seed=80827))


@pytest.mark.parametrize("schedule", [
    pytest.param("split-tail", marks=pytest.mark.xfail(
        strict=True, reason="dk at 1.95 times its bound on the H200 at d7b1b53; "
                            "docs/decisions/split-tail-off-the-default.md")),
    "round-robin"])
def test_gradients_at_one_key_under_the_split_tail_and_round_robin(schedule):
  """The case the split tail's gradient property drew at d7b1b53: dq, dk,
  dv, dbias within the rule of float64 under the split tail (known to
  break it: strict, so a fix shows) and round-robin (must pass)."""
  case = hs.build_case(ONE_KEY)
  config = _split_tail_config(case)
  assert config is not None and config.schedule == "split-tail"
  config = dataclasses.replace(config, schedule=schedule)
  reports = _split_tail_gradient_reports(case, config)
  assert all(r.passed for r in reports), "\n".join(str(r) for r in reports)
