"""GPU properties of the forward kernel (marker ``gpu``; skipped, visibly, elsewhere).

Each example compiles a kernel for its shape and config, so the ``gpu``
profile keeps the example count modest; ``thorough`` draws many more.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics.conformance import (check_forward, poison_device_memory,
                                          run_and_check_forward, run_kernel)
from harness.tools.device_check import emitted_configs, extra_cases, fixed_cases, problem_of
from properties.gpu.switches import LAUNCHES, assert_switch_matches, launch_config
from kernel.call import Call
from kernel.tiling import heuristics, plan

pytestmark = pytest.mark.gpu


def _forward_case(case: hs.AttentionCase, threshold: float, normalize: bool) -> Call:
  return case.call.replace(rescale_threshold=threshold, normalize_output=normalize)


gpu_cases = hs.attention_cases(max_batch=2, max_seq=1100, max_head_dim=256,
                               max_kv_heads=2, big=True, max_logits=None)


@pytest.mark.parametrize("shard", range(hs.GPU_SHARDS))
@settings(max_examples=hs.per_shard(settings.default.max_examples))
@given(case=gpu_cases, threshold=hs.thresholds(), normalize=st.booleans(), data=st.data())
def test_forward_matches_float64(shard, case, threshold, normalize, data):
  """Output and natural-log residuals (m, l) are within the tolerance rule of
  float64, for any drawn shape, feature mix, threshold and emitted config."""
  fc = _forward_case(case, threshold, normalize)
  cfg = data.draw(st.sampled_from(emitted_configs(fc)), label="config")
  note(f"{case.describe()} threshold={threshold} normalize={normalize} config={cfg}")
  report = run_and_check_forward(fc, config=cfg)
  note(report.summary())
  assert report.passed, report.summary()


@given(case=gpu_cases, data=st.data())
@settings(max_examples=15)
def test_forward_is_bitwise_deterministic(case, data):
  """Two runs on the same inputs give bit-identical output and residuals."""
  fc = _forward_case(case, 1.0, True)
  cfg = data.draw(st.sampled_from(emitted_configs(fc)), label="config")
  note(f"{case.describe()} config={cfg}")
  first = run_kernel(fc, config=cfg)
  poison_device_memory(4 * fc.query.nbytes)
  second = run_kernel(fc, config=cfg)
  for a, b, name in zip(first, second, ("out", "m", "l")):
    assert np.array_equal(a, b, equal_nan=True), f"{name} differs between runs"


@pytest.mark.parametrize("persistent", [False, True])
def test_fully_masked_rows_follow_the_contract(persistent):
  """A row that sees no key: output 0, m = -inf, l = 0, and no NaN anywhere."""
  rng = np.random.default_rng(7)
  from harness.numerics.conformance import random_case
  fc = random_case(rng, batch=2, seq_q=200, seq_kv=300, heads=2, kv_heads=1, head_dim=64)
  fc = fc.replace(mask=rng.random((2, 1, 200, 300)) < 0.6)
  fc.mask[:, :, ::7, :] = False
  fc = fc.replace(k_start=np.full((2, 2, 200), 0, np.int32))
  fc = fc.replace(k_end=np.full((2, 2, 200), 300, np.int32))
  fc.k_end[:, :, 3::11] = 0  # empty key ranges too
  cfg = dataclasses.replace(heuristics.get_heuristics_config(problem_of(fc)),
                            persistent=persistent)
  out, m, l = run_kernel(fc, config=cfg)
  empty = ~fc.mask[:, 0].any(-1)[:, None, :] | (fc.k_end <= fc.k_start)
  assert empty.any()
  assert not np.isnan(out).any() and not np.isnan(m).any() and not np.isnan(l).any()
  out_rows = np.transpose(out, (0, 2, 1, 3))  # (B, N, T, Hv)
  assert np.all(out_rows[empty] == 0)
  assert np.all(m[empty] == -np.inf) and np.all(l[empty] == 0)
  assert np.all(np.isfinite(m[~empty]))
  assert check_forward(fc, out, m, l).passed


def test_nan_in_one_query_row_stays_in_that_row():
  """NaN in query row t poisons exactly output row t (the reference's rule)."""
  rng = np.random.default_rng(11)
  from harness.numerics.conformance import random_case
  fc = random_case(rng, seq_q=256, seq_kv=256, heads=1, kv_heads=1, head_dim=64)
  fc.query[0, 17, 0, 5] = np.nan
  out, m, l = run_kernel(fc)
  nan_rows = np.isnan(out[0, :, 0, :]).any(-1)
  assert nan_rows[17] and nan_rows.sum() == 1
  report = check_forward(fc, out, m, l)
  assert report.passed, report.summary()


_CARRY = ("3-blocks-per-tile", "causal-1-to-16", "causal-3-stages",
          "key-ranges-with-empty-tiles")


@pytest.mark.parametrize("name", _CARRY)
def test_persistent_ring_carry_cases(name):
  """Persistent blocks walking several tiles whose key-block counts vary, are
  not multiples of the stage count, and include zero (harness.tools.mutant_run's
  carry cases): the ring position and the handoffs must survive every tile
  boundary (the prev_iters carry, the empty tile's token pass and query
  release)."""
  from harness.tools.mutant_run import carry_cases
  ((_, fc, cfg),) = [c for c in carry_cases() if c[0] == name]
  report = run_and_check_forward(fc, config=cfg)
  assert report.passed, report.summary()


def test_float16_deferred_rescale_does_not_overflow():
  """float16, rescale_threshold 0, logits rising by ~90 (base 2) across the
  keys: without the API's floor on the threshold (2^-14) the deferred
  probabilities exceed float16's range and the output turns inf/NaN; with
  it the output is within the rule."""
  rng = np.random.default_rng(14)
  from harness.numerics.conformance import random_case
  fc = random_case(rng, seq_q=128, seq_kv=1024, heads=1, kv_heads=1, head_dim=64,
                   dtype="float16", rescale_threshold=0.0)
  ramp = np.linspace(0.0, 8.0, 1024, dtype=np.float64)[None, :, None, None]
  fc = fc.replace(query=np.ones_like(fc.query),
                  key=(ramp + 0.05 * rng.standard_normal(fc.key.shape)).astype(np.float16))
  out, m, l = run_kernel(fc)
  assert np.isfinite(out).all() and np.isfinite(l).all()
  report = check_forward(fc, out, m, l)
  assert report.passed, report.summary()


_NAMED = [(n, kw, c) for n, kw, c in fixed_cases()]


@pytest.mark.parametrize("name,kwargs,cfg", _NAMED, ids=[n for n, _, _ in _NAMED])
@pytest.mark.parametrize("persistent,schedule", [(None, None), (False, "round-robin"),
                                                 (True, "round-robin"), (True, "longest-first")],
                         ids=["heuristic", "nonpersistent", "persistent", "persistent-lf"])
def test_named_cases(name, kwargs, cfg, persistent, schedule):
  """The named ragged/feature cases of harness.tools.device_check, every schedule."""
  from harness.numerics.conformance import random_case
  fc = random_case(np.random.default_rng(zlib.crc32(name.encode())), **kwargs)
  if persistent is not None:
    base = cfg or heuristics.get_heuristics_config(problem_of(fc))
    cfg = dataclasses.replace(base, persistent=persistent, schedule=schedule)
    if not plan.config_fits(problem_of(fc), cfg):
      pytest.skip(f"{cfg} does not fit for this case")
  out, m, l = run_kernel(fc, config=cfg)
  report = check_forward(fc, out, m, l)
  assert report.passed, report.summary()


_EXTRA = extra_cases(np.random.default_rng(2026))


@pytest.mark.parametrize("name,fc,cfg", _EXTRA, ids=[n for n, _, _ in _EXTRA])
def test_named_feature_cases(name, fc, cfg):
  """Bias, mask and key-range cases of harness.tools.device_check."""
  out, m, l = run_kernel(fc, config=cfg)
  report = check_forward(fc, out, m, l)
  assert report.passed, report.summary()


def test_vmap_and_jit_match_the_unbatched_calls():
  """jax.vmap over a leading axis and jax.jit give, bit for bit, the
  unbatched kernel's results."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((3, 1, 200, 2, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((3, 1, 150, 1, 64)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((3, 1, 150, 1, 64)), jnp.bfloat16)
  f = lambda q, k, v: api.dot_product_attention(q, k, v, is_causal=True, return_residuals=True)
  batched = jax.jit(jax.vmap(f))(q, k, v)
  for i in range(3):
    single = f(q[i], k[i], v[i])
    for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(single)):
      assert np.array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))


_STAGED = [(n, fc, cfg) for n, fc, cfg in _EXTRA
           if any(x is not None and np.ndim(x) == 4 and np.shape(x)[2] > 1 and np.shape(x)[3] > 1
                  for x in (fc.bias, fc.mask))]


@pytest.mark.parametrize("persistent", [False, True], ids=["nonpersistent", "persistent"])
@pytest.mark.parametrize("name,fc,cfg", _STAGED, ids=[n for n, _, _ in _STAGED])
def test_staged_2d_bias_and_mask(name, fc, cfg, persistent):
  """The staging of 2-D bias/mask through the ring (the default) gives
  results within the rule, bit-identical to the unstaged kernel's (the
  private _stage_2d=False, reading them from global memory)."""
  base = cfg or heuristics.get_heuristics_config(problem_of(fc))
  cfg = dataclasses.replace(base, persistent=persistent)
  staged = run_kernel(fc, config=cfg, stage_2d=True)
  report = check_forward(fc, *staged)
  assert report.passed, report.summary()
  plain = run_kernel(fc, config=cfg, stage_2d=False)
  for a, b, what in zip(staged, plain, ("out", "m", "l")):
    assert np.array_equal(a, b, equal_nan=True), f"{what}: staged differs from unstaged"


def _switch_matches_float64_and_shipped(name, kwargs, persistent, schedule, bitwise=True,
                                       against=None, **switch):
  """A case of a kernel.experiments ``switch`` (one of run_kernel's): within
  the rule of float64, and (``bitwise``) bit for bit the shipped path's
  results, or those of run_kernel with the switches ``against``."""
  from harness.numerics.conformance import random_case
  fc = random_case(np.random.default_rng(zlib.crc32(name.encode())), **kwargs)
  # the problem as the switch plans it (untiled copies change the layout)
  cfg = launch_config(fc, persistent, schedule, switch.get("untiled_copies"))
  assert_switch_matches(fc, cfg, switch, against, bitwise)


# Lengths no multiple of 8, which the padded path pads (kernel/padding.py)
# and the untiled copies read unpadded, in each head dim's
# column parts (kernel.tiling.plan.copy_parts): MHA and GQA, causal, the last query
# tile nearly empty, a key length shorter than one block, unnormalised; head
# dims 64 (one part), 128 (two), 96 (three of 32), 256 (four), and the
# value's parts unlike the queries'.
_UNTILED = [
    ("d64-1001x777-causal-gqa", dict(batch=2, seq_q=1001, seq_kv=777, heads=4, kv_heads=2,
                                     is_causal=True)),
    ("d64-4001-causal", dict(seq_q=4001, seq_kv=4001, heads=2, kv_heads=2, is_causal=True)),
    ("d64-129x1999-f16", dict(seq_q=129, seq_kv=1999, heads=3, kv_heads=1, dtype="float16")),
    ("d64-300x77-unnormalised", dict(seq_q=300, seq_kv=77, normalize_output=False)),
    ("d128-1001-causal-gqa", dict(batch=2, seq_q=1001, seq_kv=1001, heads=4, kv_heads=2,
                                  head_dim=128, is_causal=True)),
    ("d96-777x1001", dict(seq_q=777, seq_kv=1001, head_dim=96)),
    ("d256-1001-causal", dict(seq_q=1001, seq_kv=1001, head_dim=256, is_causal=True)),
    ("d64-dv256-300x1001", dict(seq_q=300, seq_kv=1001, head_dim_out=256)),
    ("d128-dv64-1001-unnormalised", dict(seq_q=1001, seq_kv=1001, head_dim=128,
                                         head_dim_out=64, normalize_output=False)),
]


# Calls without lengths, window or segments, which the shipped path runs with
# the kernels that read no key ranges and kernel.experiments' ranges_always
# with the ones that read them (the kernels the proof traces, docs/proof.md):
# aligned and ragged lengths, causal, GQA, float16, the head dims' column
# parts, a value head dim wider than the queries'.
_WHOLE_KEYS = [
    ("d64-1024", dict(seq_q=1024, seq_kv=1024, heads=2, kv_heads=2)),
    ("d64-1001x777-causal-gqa", dict(batch=2, seq_q=1001, seq_kv=777, heads=4, kv_heads=2,
                                     is_causal=True)),
    ("d128-4001-causal", dict(seq_q=4001, seq_kv=4001, head_dim=128, is_causal=True)),
    ("d256-300x1999", dict(seq_q=300, seq_kv=1999, head_dim=256)),
    ("d96-777x1001-f16", dict(seq_q=777, seq_kv=1001, head_dim=96, dtype="float16")),
    ("d64-dv256-1000", dict(seq_q=1000, seq_kv=1000, head_dim_out=256)),
]


@pytest.mark.parametrize("name,kwargs", _WHOLE_KEYS, ids=[n for n, _ in _WHOLE_KEYS])
@LAUNCHES
def test_ranges_always_matches_float64(name, kwargs, persistent, schedule):
  """kernel.experiments' ranges_always: within the rule of float64.  Not bit
  for bit the plain path's: at the non-causal ragged lengths the last bits
  of out or l differ (docs/decisions/ranges-always-not-shipped.md)."""
  _switch_matches_float64_and_shipped(name, kwargs, persistent, schedule, bitwise=False,
                                      ranges_always=True)


@pytest.mark.parametrize("name,kwargs", _UNTILED, ids=[n for n, _ in _UNTILED])
@LAUNCHES
def test_untiled_copies_match_float64_and_the_padded_path(name, kwargs, persistent, schedule):
  """The untiled copies (shipped at these lengths: kernel.tiling.plan.untiled_copies_pay):
  within the rule of float64, and bit for bit the padded path's results,
  which pads q, k and v to whole tiles (the same values; each product's
  wgmma over the parts of a row issue the instructions one wgmma over the
  row does)."""
  _switch_matches_float64_and_shipped(name, kwargs, persistent, schedule, untiled_copies=True,
                                      against={"untiled_copies": False})
