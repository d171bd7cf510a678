"""CPU properties of the config heuristics (kernel/tiling/heuristics.py)."""

from __future__ import annotations

import itertools

import hypothesis
from hypothesis import strategies as st
import ml_dtypes
import numpy as np
import pytest

from kernel.tiling import heuristics, plan
from kernel.tiling.config import Config, SMEM_LIMIT_BYTES

DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


@st.composite
def problems(draw) -> plan.Problem:
  head_dim = draw(st.sampled_from((64, 128, 192, 256)))
  return plan.problem_for(
      dtype=draw(st.sampled_from(DTYPES)),
      head_dim=head_dim,
      head_dim_out=draw(st.sampled_from((head_dim, 64, 128, 256))),
      seq_q=draw(st.integers(1, 20_000)),
      seq_kv=draw(st.integers(1, 20_000)),
      is_causal=draw(st.booleans()),
      bias_2d=draw(st.booleans()),
      mask_2d=draw(st.booleans()),
      return_residuals=draw(st.booleans()),
  )


_fits = plan.config_fits


def _problem(head_dim=128, *, is_causal=False, bias_2d=False, mask_2d=False,
             seq_q=4096, seq_kv=4096, head_dim_out=None):
  return plan.problem_for(np.dtype(np.float16), head_dim, head_dim_out or head_dim,
                          seq_q, seq_kv, is_causal=is_causal, bias_2d=bias_2d, mask_2d=mask_2d)


@pytest.mark.parametrize("is_causal", [False, True])
def test_default_is_the_seeds_starting_point(is_causal):
  """A small problem gets block_q 64, block_kv 128, 2 stages, persistent unless causal."""
  config = heuristics.get_heuristics_config(_problem(64, is_causal=is_causal))
  assert config == Config(64, 128, 2, persistent=not is_causal)


@hypothesis.given(problems())
def test_heuristic_config_is_the_first_fallback_that_fits(problem):
  """The emitted config fits, and no earlier step of the fallback chain did."""
  chain = [Config(64, 128, 2, not problem.mask.causal),
           Config(64, 64, 2, not problem.mask.causal),
           Config(64, 64, 2, False)]
  fitting = [c for c in chain if _fits(problem, c)]
  hypothesis.note(f"estimates: {[plan.estimate_smem_bytes(problem, c) for c in chain]}")
  if not fitting:
    with pytest.raises(ValueError, match="estimated"):
      heuristics.get_heuristics_config(problem)
    return
  config = heuristics.get_heuristics_config(problem)
  assert config == fitting[0]
  assert plan.config_fits(problem, config)


def test_head_dim_256_persistent_stages_its_output_in_the_query_slot():
  """At head dim 256 a persistent 64x64 block fits only with each warpgroup's
  output staged in its query slot; d128 keeps separate buffers."""
  problem = _problem(256)
  assert not _fits(problem, Config(64, 128, 2, True))
  config = Config(64, 64, 2, True)
  assert _fits(problem, config)
  layout = plan.scratch_layout(problem, config)
  assert layout.overlay_q_with_output and layout.o is None
  assert "output copy" in plan.pipeline_plan(problem, config).mbarrier("q_consumed").why
  assert not plan.scratch_layout(problem, Config(64, 64, 2, False)).overlay_q_with_output
  assert not plan.scratch_layout(_problem(128), Config(64, 128, 2, True)).overlay_q_with_output
  assert heuristics.get_heuristics_config(problem) == config


def test_staged_bias_and_mask_fall_back_to_block_kv_64():
  problem = _problem(128, bias_2d=True, mask_2d=True)
  assert heuristics.get_heuristics_config(problem) == Config(64, 64, 2, True)


def test_nothing_fits_names_the_estimate():
  problem = _problem(256, bias_2d=True, mask_2d=True)
  with pytest.raises(ValueError, match=r"needs an estimated \d+ bytes"):
    heuristics.get_heuristics_config(problem)


@pytest.mark.parametrize("head_dim,head_dim_out", [(128, 128), (64, 128), (96, 64), (256, 256)])
def test_three_warpgroups_are_refused_where_their_registers_cannot_hold_the_heads(
    head_dim, head_dim_out):
  """160 registers per thread hold head dims up to 64 (kernel/tiling/plan.py): a
  wider problem refuses three compute warpgroups by name, config_fits says
  no, and the autotuner never offers them; at 64 they fit."""
  three = Config(64, 128, 2, True, compute_warpgroups=3)
  problem = _problem(head_dim, head_dim_out=head_dim_out)
  assert not plan.config_fits(problem, three)
  with pytest.raises(ValueError, match=r"^config.compute_warpgroups: 3 .* head_dim="
                                       rf"{head_dim}, head_dim_out={head_dim_out}"):
    plan.check_fits(problem, three)
  assert all(c.compute_warpgroups == 2 for c in heuristics.get_autotuning_configs(problem))
  assert plan.config_fits(_problem(64), three)
  assert plan.check_fits(_problem(64), three) > 0


@pytest.mark.parametrize("tiling", [(64, 64, 2), (64, 128, 3), (64, 128, 4), (128, 128, 2)])
def test_three_warpgroups_run_one_tiling_and_refuse_the_others_by_name(tiling):
  """Three compute warpgroups run block_q 64, block_kv 128, two stages: the
  others measured slower and are not proved, so they are refused, never
  offered."""
  bq, bkv, stages = tiling
  for persistent in (False, True):
    config = Config(bq, bkv, stages, persistent, compute_warpgroups=3)
    problem = _problem(64)
    assert not plan.config_fits(problem, config)
    with pytest.raises(ValueError, match=r"^config.compute_warpgroups: 3 compute warpgroups run "
                                         r"block_q=64, block_kv=128, num_stages=2 only .* got "
                                         rf"block_q={bq}, block_kv={bkv}, num_stages={stages}$"):
      plan.check_fits(problem, config)
  three = {c for c in heuristics.get_autotuning_configs(_problem(64, is_causal=True))
           if c.compute_warpgroups == 3}
  assert {(c.block_q, c.block_kv, c.num_stages) for c in three} == {(64, 128, 2)}
  assert len(three) == 4   # persistent or not, round-robin or longest-first


def _next_pow2(n):
  p = 1
  while p < n:
    p *= 2
  return p


@hypothesis.given(problems())
def test_autotuning_candidates_are_the_seeds_enumeration(problem):
  """Exactly the seed's grid, filtered by stage count and the estimate, each
  once; under causal each also with the longest-first schedule, without it
  each persistent one also with the split tail; at head dim
  64 the block_q 64, block_kv 128, two-stage ones also with three compute
  warpgroups."""
  configs = heuristics.get_autotuning_configs(problem)
  assert configs == heuristics.get_autotuning_configs(problem)  # deterministic
  assert len(set(configs)) == len(configs)
  expected = set()
  three = max(problem.head_dim, problem.head_dim_out) <= 64
  for bq, bkv, persistent, stages, cw in itertools.product(
      (64, 128), (64, 128, 256), (False, True), (2, 3, 4), (2, 3)):
    if cw == 3 and (not three or (bq, bkv, stages) != (64, 128, 2)):
      continue
    if bq == 128 and _next_pow2(problem.seq_q) <= 128:
      continue
    if bkv > 64 and bkv > _next_pow2(problem.seq_kv):
      continue
    if not persistent and stages > -(-problem.seq_kv // bkv):
      continue
    schedules = (("round-robin", "longest-first") if problem.mask.causal
                 else ("round-robin",) + (("split-tail",) if persistent else ()))
    for schedule in schedules:
      config = Config(bq, bkv, stages, persistent, schedule, compute_warpgroups=cw)
      if _fits(problem, config):
        expected.add(config)
  assert set(configs) == expected
  for config in configs:
    assert plan.config_fits(problem, config)


def test_autotuning_short_sequences():
  """Short keys: only block_kv 64, and non-persistent candidates stop at the block count."""
  configs = heuristics.get_autotuning_configs(_problem(64, seq_q=100, seq_kv=100))
  assert {c.block_q for c in configs} == {64}
  assert {c.block_kv for c in configs} == {64, 128}
  assert all(c.persistent or c.num_stages <= -(-100 // c.block_kv) for c in configs)
  assert Config(64, 64, 2, False) in configs
  assert Config(64, 64, 3, False) not in configs
  assert Config(64, 128, 4, True) in configs


def test_autotuning_long_sequences_offer_everything_that_fits():
  configs = heuristics.get_autotuning_configs(_problem(64, seq_q=8192, seq_kv=8192))
  assert {c.block_q for c in configs} == {64, 128}
  assert {c.block_kv for c in configs} == {64, 128, 256}
  assert {c.num_stages for c in configs} == {2, 3, 4}
  assert {c.persistent for c in configs} == {False, True}


def test_the_fit_boundary_is_inclusive_and_in_one_place():
  """A plan may use the whole 227 KiB; one byte more does not fit."""
  assert plan.fits_in_smem(SMEM_LIMIT_BYTES)
  assert not plan.fits_in_smem(SMEM_LIMIT_BYTES + 1)


@hypothesis.given(problems(), st.sampled_from(list(itertools.product(
    (64, 128), (64, 128, 256), (2, 3, 4), (False, True)))))
def test_no_forward_plan_lands_on_the_limit(problem, blocks):
  """The boundary's direction decides nothing: an estimate is an alignment
  multiple plus 8 bytes per mbarrier, never exactly the limit."""
  config = Config(*blocks)
  est = plan.estimate_smem_bytes(problem, config)
  hypothesis.note(f"estimate {est}")
  assert est != SMEM_LIMIT_BYTES
  assert est % plan.SMEM_ALIGNMENT != 0


def test_heuristics_cache_and_validation_share_the_limit(monkeypatch, tmp_path):
  """Lowering the one limit moves the heuristic, the cache check and the
  validation together (none of them keeps its own comparison)."""
  from harness.tools import autotune as tuner
  from kernel.tiling import autotune
  problem = _problem(128)
  default = heuristics.get_heuristics_config(problem)
  cache = tmp_path / "cache.json"
  tuner.record(problem, "NVIDIA H200", default, {}, path=cache)
  assert autotune.lookup(problem, "NVIDIA H200", path=cache) == default
  # Twice where a smaller layout of the same config (the output staged in
  # the query slot) fits under the first cut.
  while plan.config_fits(problem, default):
    monkeypatch.setattr(plan, "SMEM_LIMIT_BYTES", plan.estimate_smem_bytes(problem, default) - 1)
  assert heuristics.get_heuristics_config(problem) != default
  assert default not in heuristics.get_autotuning_configs(problem)
  assert autotune.lookup(problem, "NVIDIA H200", path=cache) is None
  with pytest.raises(ValueError, match="estimated"):
    plan.check_fits(problem, default)


def test_the_memoised_layout_and_estimate_are_the_problems_own():
  """kernel.tiling.plan memoises the scratch layout and the shared-memory
  estimate by the fields they read (plan._layout_problem): over problems
  of every head dim, dtype, staged operand, residuals, copy, causal and
  length, and every config the autotuner may time, each is what the
  problem's own computation gives."""
  from harness.proofs import prove as prove_cli
  checked = 0
  for problem in prove_cli.problem_grid(experiments=True)[::53]:
    for config in heuristics.get_autotuning_configs(problem):
      kp = plan.kernel_problem(problem, config)
      own = plan._layout(kp, config, overlay_q=plan.overlays_query_with_output(kp, config))
      assert plan.scratch_layout(problem, config) == own, (problem, config)
      assert plan.estimate_smem_bytes(problem, config) == plan._estimate(own, kp, config)
      checked += 1
  assert checked > 1000, checked
