"""GPU properties of the FP8 forward (marker ``gpu``; skipped, visibly, elsewhere).

float8_e4m3fn query, key and value with their descales, against the float64
reference on the dequantised inputs under the tolerance rule, whose naive
yardstick quantises P as the kernel does (harness/numerics/tolerance.py):
Hypothesis draws (e4m3 values with outliers, descales over orders of
magnitude, every feature) and named cases under every schedule.  The CPU
half is properties/numerics/test_fp8.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics import tolerance
from harness.numerics.conformance import (check_forward, poison_device_memory,
                                          run_and_check_forward, run_kernel)
from harness.numerics.fp8_cases import FP8_NAMED, fp8_case
from harness.tools.device_check import emitted_configs, problem_of
from kernel.tiling import heuristics, plan
from kernel.tiling.config import Config
from properties.gpu.switches import LAUNCHES, assert_switch_matches, launch_config

pytestmark = pytest.mark.gpu

gpu_cases = hs.fp8_cases(max_batch=2, max_seq=1100, max_head_dim=256, max_kv_heads=2, big=True,
                         max_logits=None)


@pytest.mark.parametrize("shard", range(hs.GPU_SHARDS))
@settings(max_examples=hs.per_shard(settings.default.max_examples))
@given(case=gpu_cases, threshold=hs.thresholds(), normalize=st.booleans(), data=st.data())
def test_fp8_forward_matches_float64(shard, case, threshold, normalize, data):
  """FP8 output and natural-log residuals (m, l) are within the tolerance
  rule of float64 on the dequantised inputs, for any drawn shape, feature
  mix, descales, threshold and emitted config."""
  call = case.call.replace(rescale_threshold=threshold, normalize_output=normalize)
  cfg = data.draw(st.sampled_from(emitted_configs(call)), label="config")
  note(f"{case.describe()} threshold={threshold} normalize={normalize} config={cfg}")
  report = run_and_check_forward(call, config=cfg)
  note(report.summary())
  assert report.passed, report.summary()


@given(case=gpu_cases, data=st.data())
@settings(max_examples=10)
def test_fp8_forward_is_bitwise_deterministic(case, data):
  """Two runs on the same inputs give bit-identical output and residuals."""
  cfg = data.draw(st.sampled_from(emitted_configs(case.call)), label="config")
  note(f"{case.describe()} config={cfg}")
  first = run_kernel(case.call, config=cfg)
  poison_device_memory(4 * case.call.query.nbytes)
  second = run_kernel(case.call, config=cfg)
  for a, b, name in zip(first, second, ("out", "m", "l")):
    assert np.array_equal(a, b, equal_nan=True), f"{name} differs between runs"


_NAMED = list(FP8_NAMED)


@pytest.mark.parametrize("name", _NAMED, ids=_NAMED)
@pytest.mark.parametrize("persistent,schedule", [(None, None), (False, "round-robin"),
                                                 (True, "round-robin"), (True, "longest-first")],
                         ids=["heuristic", "nonpersistent", "persistent", "persistent-lf"])
def test_fp8_named_cases(name, persistent, schedule):
  """The named FP8 cases against float64, under every schedule."""
  call = fp8_case(name, **FP8_NAMED[name])
  cfg = None
  if persistent is not None:
    base = heuristics.get_heuristics_config(problem_of(call))
    cfg = dataclasses.replace(base, persistent=persistent, schedule=schedule)
    if not plan.config_fits(problem_of(call), cfg):
      pytest.skip(f"{cfg} does not fit for this case")
  report = run_and_check_forward(call, config=cfg)
  assert report.passed, report.summary()


@pytest.mark.parametrize("block_kv,num_stages", [(64, 4), (128, 3), (256, 2), (256, 3)])
def test_fp8_wide_key_blocks_and_deep_rings(block_kv, num_stages):
  """The tilings one-byte rows make room for (wider key blocks, more
  stages) at head dim 64 and 128, persistent, against float64."""
  ran = []
  for head_dim in (64, 128):
    call = fp8_case(f"wide-{head_dim}", seq_q=512, seq_kv=2048, head_dim=head_dim)
    cfg = Config(64, block_kv, num_stages, persistent=True)
    if not plan.config_fits(problem_of(call), cfg):
      continue   # (256, 3) at head dim 128: past shared memory even in one byte
    ran.append(head_dim)
    out, m, l = run_kernel(call, config=cfg)
    report = check_forward(call, out, m, l)
    assert report.passed, (head_dim, report.summary())
  assert 64 in ran, f"({block_kv}, {num_stages}) no longer fits at head dim 64 in FP8"


@pytest.mark.parametrize("persistent", [False, True])
def test_fp8_fully_masked_rows_follow_the_contract(persistent):
  """A row that sees no key: output 0, m = -inf, l = 0, and no NaN anywhere."""
  call = fp8_case("masked-rows", batch=2, seq_q=200, seq_kv=300, mask=(2, 1, 200, 300),
                  key_range=(2, 2, 200))
  mask = call.mask.copy()
  mask[:, :, ::7, :] = False
  call = call.replace(mask=mask)
  cfg = dataclasses.replace(heuristics.get_heuristics_config(problem_of(call)),
                            persistent=persistent)
  out, m, l = run_kernel(call, config=cfg)
  assert not np.isnan(out).any() and not np.isnan(m).any() and not np.isnan(l).any()
  empty = m == -np.inf
  assert empty[:, :, ::7].all()
  assert np.all(np.transpose(out, (0, 2, 1, 3))[empty] == 0) and np.all(l[empty] == 0)
  report = check_forward(call, out, m, l)
  assert report.passed, report.summary()


def test_fp8_per_head_descales_reach_their_heads():
  """Per (batch, kv head) descales: scaling one kv head's v_descale by 2
  doubles exactly that head group's output and leaves the others' bits."""
  call = fp8_case("per-head", batch=2, heads=4, kv_heads=2,
                  fp8=hs.Fp8Spec(layout="head", spread=1.0))
  out, _, _ = run_kernel(call)
  v_descale = np.array(call.v_descale, np.float32)
  v_descale[1, 0] *= 2
  doubled, _, _ = run_kernel(call.replace(v_descale=v_descale))
  heads = np.arange(4) // 2
  for b in range(2):
    for h in range(4):
      want = 2 * out[b, :, h] if (b, heads[h]) == (1, 0) else out[b, :, h]
      assert np.array_equal(doubled[b, :, h], want), (b, h)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_yardstick_sums_fp8_as_coarsely_as_the_kernels_wgmma(head_dim):
  """The FP8 yardstick's products (tolerance.fp8_products_model, on every
  host) are no exact sums: on each kind of operand their error against
  float64 is within a factor of 4 of the kernel's own wgmma's on the same
  e4m3 values (harness/tools/fp8_accumulation.py), so the rule holds the
  kernel to what its hardware sums.  XLA's FP8 dot, once the GPU's
  yardstick, is shown beside them: it summed almost exactly on the H200
  (docs/decisions/fp8-yardstick.md)."""
  import jax.numpy as jnp
  from harness.tools import fp8_accumulation as acc
  rng = np.random.default_rng(head_dim)
  for kind in ("normal", "one-hot", "wide"):
    q8, k8 = acc.operands(kind, head_dim, rng)
    exact = q8.astype(np.float64) @ k8.astype(np.float64).T
    wgmma = np.asarray(acc.qk_whole(jnp.asarray(q8), jnp.asarray(k8)), np.float64)
    yardstick = tolerance.fp8_products_model(q8.astype(np.float32), k8.astype(np.float32).T)
    xla = np.asarray(acc.qk_xla(jnp.asarray(q8), jnp.asarray(k8)), np.float64)
    e_wgmma, e_yard, e_xla = (float(np.abs(x - exact).max()) for x in (wgmma, yardstick, xla))
    assert e_yard > 0 and e_wgmma / 4 <= e_yard <= 4 * e_wgmma, (
        f"{kind}: max error against float64, wgmma {e_wgmma:.4g}, yardstick {e_yard:.4g}, "
        f"XLA's FP8 dot {e_xla:.4g}")


# Lengths no multiple of 8 in FP8, queries and keys copied through untiled
# views in column parts of one-byte swizzle atoms, V^T whole, the output in
# 16-bit parts (kernel.experiments' untiled_copies): head dims 64 (one part
# of 64 bytes), 128 (one of 128), 256 (two), 72/96 (three of 32), the
# value's parts unlike the queries', GQA with per-head descales, causal.
_UNTILED = [
    ("d64-1001x777-causal", dict(seq_q=1001, seq_kv=777, is_causal=True)),
    ("d128-gqa-head-1001", dict(batch=2, seq_q=1001, seq_kv=1001, heads=4, kv_heads=2,
                                head_dim=128, fp8=hs.Fp8Spec(layout="head", spread=2.0))),
    ("d256-300x457", dict(seq_q=300, seq_kv=457, head_dim=256)),
    ("d72-dv96-113x203", dict(seq_q=113, seq_kv=203, head_dim=72, head_dim_out=96)),
    ("d64-dv256-300x1001-causal", dict(seq_q=300, seq_kv=1001, head_dim_out=256,
                                       is_causal=True)),
]


@pytest.mark.parametrize("name,kwargs", _UNTILED, ids=[n for n, _ in _UNTILED])
@LAUNCHES
def test_fp8_untiled_copies_match_float64_and_the_padded_path(name, kwargs, persistent,
                                                              schedule):
  """kernel.experiments' untiled_copies in FP8: within the rule of float64,
  and bit for bit the padded path's results (the same products: QK^T's
  wgmma over the parts of a row issue one wgmma's instructions, and each
  part of the output takes its columns of V^T)."""
  call = fp8_case(name, **kwargs)
  cfg = launch_config(call, persistent, schedule, untiled_copies=True)
  assert_switch_matches(call, cfg, {"untiled_copies": True}, against={"untiled_copies": False})
