"""Blocks above a warpgroup's causal diagonal on the GPU (marker ``gpu``;
skipped, visibly, elsewhere): the forward that skips their softmax
(kernel/forward.py's ``softmax``, the shipped kernel) gives the same bits as
the one that computes it (kernel.experiments' ``dead_blocks="compute"``),
and both are within the tolerance rule of float64, on every config whose
tiles have such blocks (forward.tiles_reach_past_a_warpgroup)."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, note, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics.conformance import (ForwardCase, check_forward, poison_device_memory,
                                          run_kernel)
from kernel import api, forward, plan
from kernel.config import Config

pytestmark = pytest.mark.gpu

# Three warpgroups against 128-key blocks, two against 64-key blocks, and
# 128-row warpgroups: persistent or not, each schedule.
CONFIGS = (Config(64, 128, 2, True, "longest-first", 3),
           Config(64, 128, 2, False, "round-robin", 3),
           Config(64, 64, 2, False, "longest-first"),
           Config(64, 64, 2, True, "longest-first"),
           Config(128, 128, 2, False))
assert all(forward.tiles_reach_past_a_warpgroup(c) for c in CONFIGS)


@given(case=hs.attention_cases(max_batch=2, max_seq=700, max_head_dim=256, max_kv_heads=2,
                               big=True, max_logits=None),
       config=st.sampled_from(CONFIGS), threshold=st.sampled_from([1.0, 0.5, 0.0]))
@settings(max_examples=24)
def test_skipping_dead_blocks_changes_no_bit(case, config, threshold):
  assume(not case.variant_kwargs)
  fc = ForwardCase(query=case.query, key=case.key, value=case.value, bias=case.bias,
                   mask=case.mask, scale=case.spec.scale, is_causal=True,
                   k_start=case.k_start, k_end=case.k_end,
                   logits_soft_cap=case.spec.logits_soft_cap, rescale_threshold=threshold)
  j = lambda x: None if x is None else jnp.asarray(x)
  problem = api.resolved_problem(j(fc.query), j(fc.key), j(fc.value), j(fc.bias), j(fc.mask),
                                 is_causal=True)
  assume(plan.config_fits(problem, config))
  note(f"{case.describe()} config={config} threshold={threshold}")
  poison_device_memory(4 * fc.query.nbytes)
  skipped = run_kernel(fc, config=config)
  computed = run_kernel(fc, config=config, dead_blocks="compute")
  for name, a, b in zip(("out", "m", "l"), skipped, computed):
    assert np.array_equal(a, b, equal_nan=True), name
  report = check_forward(fc, *skipped)
  note(report.summary())
  assert report.passed, report.summary()
