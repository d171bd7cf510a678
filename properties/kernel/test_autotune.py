"""The autotuner's cache and selection logic (timing itself needs a GPU)."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools import autotune as tuner
from kernel.tiling import autotune, heuristics, plan
from kernel.tiling.config import Config

PROBLEM = plan.problem_of_shapes((4, 4096, 16, 128), (4, 4096, 16, 128),
                                 (4, 4096, 16, 128), "bfloat16")


def test_signature_buckets_sequence_lengths_and_names_features():
  other = PROBLEM.replace(seq_q=3000, seq_kv=2100)
  assert autotune.signature(PROBLEM) == autotune.signature(other)
  assert autotune.signature(PROBLEM) != autotune.signature(PROBLEM.replace(seq_q=5000))
  assert autotune.signature(PROBLEM, has_bias=True).endswith("-bias")
  assert "causal" in autotune.signature(PROBLEM.replace(is_causal=True))
  # nearest() reads signatures back: every one signature() writes.
  for p, features in itertools.product(
      (PROBLEM, PROBLEM.replace(seq_q=100, seq_kv=70_000, is_causal=True),
       PROBLEM.replace(dtype=np.dtype("float16"), head_dim=64, head_dim_out=192)),
      ({}, {"has_bias": True}, {"has_mask": True, "has_key_ranges": True})):
    parts = autotune._SIGNATURE.fullmatch(autotune.signature(p, **features))
    assert parts is not None
    assert int(parts["q"]) >= p.seq_q and int(parts["kv"]) >= p.seq_kv
    assert parts["head"] == f"d{p.head_dim}-dv{p.head_dim_out}"


def test_record_then_lookup_round_trips(tmp_path):
  cache = tmp_path / "cache.json"
  assert autotune.lookup(PROBLEM, "NVIDIA H200", path=cache) is None
  best = Config(64, 128, 2, persistent=True)
  tuner.record(PROBLEM, "NVIDIA H200", best, {str(best): 0.9}, path=cache)
  assert autotune.lookup(PROBLEM, "NVIDIA H200", path=cache) == best
  assert autotune.lookup(PROBLEM, "NVIDIA H100", path=cache) is None
  assert autotune.lookup(PROBLEM, "NVIDIA H200", path=cache, has_mask=True) is None


def test_a_cached_config_that_no_longer_fits_is_ignored(tmp_path):
  cache = tmp_path / "cache.json"
  big = PROBLEM.replace(head_dim=256, head_dim_out=256)
  tuner.record(big, "NVIDIA H200", Config(128, 256, 4, persistent=True), {}, path=cache)
  assert autotune.lookup(big, "NVIDIA H200", path=cache) is None


def test_tune_keeps_the_fastest_and_skips_candidates_that_fail():
  candidates = heuristics.get_autotuning_configs(PROBLEM)
  assert len(candidates) > 3
  target = candidates[2]

  def run(config):
    if config == candidates[0]:
      raise RuntimeError("does not compile")
    return 1.0 if config == target else 2.0 + candidates.index(config)

  best, timings = tuner.tune(PROBLEM, run)
  assert best == target
  assert isinstance(timings[str(candidates[0])], str)


def test_a_fast_candidate_with_wrong_results_is_never_chosen():
  """The fastest candidates fail the results check: the fastest that passes
  is chosen, and the losers' timings say why."""
  candidates = heuristics.get_autotuning_configs(PROBLEM)
  run = lambda config: 1.0 + candidates.index(config)   # the first is the fastest
  wrong = set(candidates[:2])
  best, timings = tuner.tune(PROBLEM, run, verify=lambda c: "out off by 3x" if c in wrong else None)
  assert best == candidates[2]
  assert timings[str(candidates[0])] == timings[str(candidates[1])] == "wrong: out off by 3x"
  assert timings[str(candidates[2])] == 3e3
  with pytest.raises(RuntimeError, match="no candidate gave right results"):
    tuner.tune(PROBLEM, run, candidates=candidates[:2],
               verify=lambda c: "out off by 3x" if c in wrong else None)


def test_the_cache_never_holds_a_config_that_failed_the_check(tmp_path):
  cache = tmp_path / "cache.json"
  job = tuner.Job(4, 4096, 16, 128, False)
  candidates = heuristics.get_autotuning_configs(job.problem())
  planned = tuner.plan_jobs([job], {}, "NVIDIA H200", resume=False)
  checked = []

  def make_verify(j):
    assert j == job
    def verify(config):
      checked.append(config)
      return "NaN rows" if config == candidates[0] else None
    return verify

  tuner.run_plan(planned, "NVIDIA H200", lambda j: lambda c: 1.0 + candidates.index(c),
                 cache_path=cache, out=lambda line: None, make_verify=make_verify,
                 meta=lambda: {})
  assert checked == list(candidates[:2])     # the fastest, then the next
  assert autotune.lookup(job.problem(), "NVIDIA H200", path=cache) == candidates[1]


def _at(problem, *, dtype=None, seq=None, causal=None, head_dim=None):
  """``problem`` in another dtype, sequence bucket, mask or head dim."""
  out = problem
  if dtype is not None:
    out = out.replace(dtype=np.dtype(dtype))
  if seq is not None:
    out = out.replace(seq_q=seq, seq_kv=seq)
  if causal is not None:
    out = out.replace(is_causal=causal)
  if head_dim is not None:
    out = out.replace(head_dim=head_dim, head_dim_out=head_dim)
  return out


def test_a_signature_the_cache_lacks_takes_the_nearest_tuned_entry(tmp_path):
  """Nearest: fewest doublings between the buckets, then the same dtype;
  only entries of the same mask and features, either 16-bit dtype, and of
  the same head dims or wider ones (test below); the exact entry first
  (lookup)."""
  cache = tmp_path / "cache.json"
  causal = _at(PROBLEM, causal=True)
  near_1k, near_16k = Config(64, 128, 2, True, "longest-first"), Config(64, 64, 2, False)
  tuner.record(_at(causal, seq=1024), "NVIDIA H200", near_1k, {}, path=cache)
  tuner.record(_at(causal, seq=16384), "NVIDIA H200", near_16k, {}, path=cache)
  pick = lambda p, **kw: autotune.nearest(p, "NVIDIA H200", path=cache, **kw)
  assert pick(_at(causal, seq=2048))[1] == near_1k                      # 2 steps against 6
  assert pick(_at(causal, seq=8192))[1] == near_16k                     # 6 against 2
  assert pick(_at(causal, seq=2048, dtype="float16"))[1] == near_1k     # the other 16-bit dtype
  assert pick(_at(causal, seq=2048, dtype="float16"))[0] == autotune.signature(
      _at(causal, seq=1024))
  assert pick(_at(causal, seq=2048, head_dim=256)) is None              # only narrower ones
  assert pick(_at(PROBLEM, seq=2048)) is None                           # not causal
  assert pick(_at(causal, seq=2048), has_mask=True) is None             # another feature
  assert autotune.nearest(_at(causal, seq=2048), "NVIDIA H100", path=cache) is None
  # At equal distance the entry of the call's own dtype wins.
  own = Config(64, 128, 3, True, "longest-first")
  tuner.record(_at(causal, seq=16384, dtype="float16"), "NVIDIA H200", own, {}, path=cache)
  assert pick(_at(causal, seq=8192, dtype="float16"))[1] == own
  assert pick(_at(causal, seq=8192))[1] == near_16k


def test_a_head_dim_without_entries_reads_the_narrowest_wider_one(tmp_path):
  """Entries of the call's own head dims come first, at any distance in
  sequence; without them, the narrowest head dims at least as wide in both
  query and value (192 reads 256, never 128); a narrower one is never read.
  The shipped cache has no 192: config=None there runs the 256's pick,
  which is not the heuristic's under causal."""
  cache = tmp_path / "cache.json"
  wide = lambda d, dv: PROBLEM.replace(head_dim=d, head_dim_out=dv, is_causal=True)
  c128, c256, c512 = (Config(64, 128, 2, True, "longest-first"),
                      Config(64, 64, 2, False, "longest-first"),
                      Config(64, 64, 2, False, "round-robin"))
  tuner.record(wide(128, 128), "NVIDIA H200", c128, {}, path=cache)
  tuner.record(_at(wide(256, 256), seq=16384), "NVIDIA H200", c256, {}, path=cache)
  pick = lambda p: autotune.nearest(p, "NVIDIA H200", path=cache)
  assert pick(wide(192, 192)) == (autotune.signature(_at(wide(256, 256), seq=16384)), c256)
  assert pick(wide(192, 128))[1] == c256          # value 128 fits 256 too; query 192 not 128
  assert pick(wide(64, 128))[1] == c128           # the narrowest wider: 128 before 256
  assert pick(wide(128, 192))[1] == c256
  assert pick(_at(wide(128, 128), seq=1024))[1] == c128   # its own head dims first
  assert pick(wide(256, 128))[1] == c256
  assert pick(wide(320, 320)) is None             # nothing as wide
  tuner.record(_at(wide(256, 256), seq=4096, dtype="float16"), "NVIDIA H200", c512, {},
               path=cache)
  assert pick(wide(192, 192))[1] == c512          # the nearer bucket among the 256's
  q = jax.ShapeDtypeStruct((2, 4096, 8, 192), jnp.bfloat16)
  from kernel import api
  config, source = api.chosen_config_source(q, q, q, is_causal=True, device_kind="NVIDIA H200")
  assert source.startswith("autotune cache, nearest: bfloat16-d256-dv256-")
  assert config != heuristics.get_heuristics_config(wide(192, 192))


def test_an_entry_this_kernel_cannot_run_is_skipped(tmp_path):
  """A cache written by another version of the kernel (a Config field or
  value unknown here) makes config=None fall back, never fail."""
  cache = tmp_path / "cache.json"
  causal = _at(PROBLEM, causal=True)
  tuner.record(causal, "NVIDIA H200", Config(64, 128, 2, True, "longest-first"), {}, path=cache)
  data = json.loads(cache.read_text())
  entry = data["NVIDIA H200"][autotune.signature(causal)]
  for bad in ({**entry["config"], "warp_specialised_epilogue": True},
              {**entry["config"], "block_kv": 100}):
    entry["config"] = bad
    cache.write_text(json.dumps(data))
    assert autotune.lookup(causal, "NVIDIA H200", path=cache) is None
    assert autotune.nearest(_at(causal, seq=2048), "NVIDIA H200", path=cache) is None


def test_a_nearer_entry_that_does_not_fit_is_passed_over(tmp_path):
  cache = tmp_path / "cache.json"
  big = _at(PROBLEM, head_dim=256, causal=True)
  too_big, fits = Config(128, 256, 4, persistent=True), Config(64, 64, 2, False, "longest-first")
  assert not plan.config_fits(big, too_big) and plan.config_fits(big, fits)
  tuner.record(_at(big, seq=8192), "NVIDIA H200", too_big, {}, path=cache)
  tuner.record(_at(big, seq=1024), "NVIDIA H200", fits, {}, path=cache)
  assert autotune.nearest(big, "NVIDIA H200", path=cache)[1] == fits


def test_choose_takes_the_nearest_entry_before_the_heuristic(tmp_path, monkeypatch):
  cache = tmp_path / "cache.json"
  monkeypatch.setattr(autotune, "CACHE_PATH", cache)
  causal = _at(PROBLEM, causal=True)
  tuned = Config(64, 128, 2, True, "longest-first")
  assert tuned != heuristics.get_heuristics_config(causal)
  tuner.record(_at(causal, seq=1024), "NVIDIA H200", tuned, {}, path=cache)
  assert autotune.choose(causal, "NVIDIA H200") == tuned
  assert autotune.choose(causal, None) == heuristics.get_heuristics_config(causal)
  assert autotune.choose(PROBLEM, "NVIDIA H200") == heuristics.get_heuristics_config(PROBLEM)
  # Where it came from, as the golden files record it.
  tuner.record(causal, "NVIDIA H200", tuned, {}, path=cache)
  assert autotune.choice(causal, "NVIDIA H200") == (tuned, "autotune cache")
  near = autotune.choice(_at(causal, seq=8192), "NVIDIA H200")
  assert near == (tuned, f"autotune cache, nearest: {autotune.signature(causal)}")
  assert autotune.choice(PROBLEM, "NVIDIA H200")[1] == "heuristic"
  from kernel import api
  q = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
  assert api.chosen_config_source(q, q, q, is_causal=True, device_kind="NVIDIA H200") == (
      api.chosen_config(q, q, q, is_causal=True, device_kind="NVIDIA H200"), near[1])


def test_float16_causal_runs_what_bfloat16_was_tuned_to():
  """The shipped cache holds bfloat16 entries only: a float16 causal call
  runs the tuned config of its bfloat16 twin, not the heuristic."""
  for head_dim in (64, 128, 256):
    twin = autotune.selection_problem(_at(PROBLEM, causal=True, head_dim=head_dim))
    f16 = _at(twin, dtype="float16")
    tuned = autotune.lookup(twin, "NVIDIA H200")
    assert tuned is not None and autotune.lookup(f16, "NVIDIA H200") is None
    assert autotune.choose(f16, "NVIDIA H200") == tuned


def test_choose_falls_back_to_the_heuristic():
  """Without a device, or where neither the device's entries nor the
  H200's (which a GPU nobody tuned reads) hold the signature or a near one."""
  assert autotune.choose(PROBLEM, None) == heuristics.get_heuristics_config(PROBLEM)
  f32 = _at(PROBLEM, dtype="float32")   # no float32 entries, none near
  assert autotune.choice(f32, "a GPU nobody tuned") == (
      heuristics.get_heuristics_config(f32), "heuristic")
  assert autotune.choice(PROBLEM, "a GPU nobody tuned") == (
      autotune.choose(PROBLEM, "NVIDIA H200"), "autotune cache (NVIDIA H200)")
  assert autotune.tuned_device_kind("a GPU nobody tuned") == autotune.REFERENCE_DEVICE_KIND
  assert autotune.tuned_device_kind("NVIDIA H200") == "NVIDIA H200"
  assert autotune.tuned_device_kind(None) is None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_ranges_without_a_cache_entry_run_the_heuristic_longest_first_on_one_tile(causal):
  """Uncached calls with key ranges: the heuristic's config, its schedule
  longest-first where the heuristic runs one tile per block (causal); a
  persistent heuristic config is kept as it is."""
  problem = PROBLEM.replace(is_causal=causal)
  heuristic = heuristics.get_heuristics_config(problem)
  got = autotune.choose(problem, "a GPU nobody tuned", has_key_ranges=True)
  assert heuristic.persistent != causal
  if causal:
    assert got == dataclasses.replace(heuristic, schedule="longest-first")
  else:
    assert got == heuristic
  assert autotune.choose(problem, None, has_key_ranges=False) == heuristic


def test_the_shipped_cache_is_well_formed():
  """The cache produced on the H200 ships with the package; every entry is a
  legal config and the fastest of the timings recorded with it (python -m
  harness autotune regenerates it)."""
  assert autotune.CACHE_PATH.exists(), "kernel/tiling/autotune_cache.json is missing"
  data = autotune.load_cache()
  assert data.get("NVIDIA H200"), "the shipped cache has no H200 entries"
  for device, entries in data.items():
    for sig, entry in entries.items():
      best = Config(**entry["config"])  # validates
      timed = {_config_of(c): t for c, t in entry["median_ms"].items() if isinstance(t, float)}
      assert timed[best] == min(timed.values()), (device, sig)


def _config_of(text: str) -> Config:
  return tuner.config_of_key(text)


def test_a_timing_key_reads_back_as_its_config():
  config = Config(128, 64, 3, persistent=True)
  assert _config_of(str(config)) == config
  assert _config_of("Config(block_q=64, block_kv=128, num_stages=2, persistent=False)") == \
      Config(64, 128, 2, persistent=False)


def test_what_the_tuner_records_is_what_config_none_finds(tmp_path, monkeypatch):
  """The tuner records under selection_problem's signature and the API looks
  up through the same function: a recorded config is the one config=None runs."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  cache = tmp_path / "cache.json"
  monkeypatch.setattr(autotune, "CACHE_PATH", cache)
  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  problem = autotune.selection_problem(plan.problem_of_shapes(q.shape, kv.shape, kv.shape,
                                                                 q.dtype))
  tuned = Config(64, 64, 3, persistent=False)
  assert tuned != heuristics.get_heuristics_config(problem)
  tuner.record(problem, "NVIDIA H200", tuned, {str(tuned): 0.1})
  assert api.chosen_config(q, kv, kv, device_kind="NVIDIA H200") == tuned
  # A GPU the cache has no entries for reads the H200's, and says so.
  assert api.chosen_config_source(q, kv, kv, device_kind="NVIDIA H100") == (
      tuned, "autotune cache (NVIDIA H200)")
  # Another feature set is another signature: not tuned, so the heuristic.
  assert api.chosen_config(q, kv, kv, mask=jax.ShapeDtypeStruct((2, 1, 1000, 1000), jnp.bool_),
                            device_kind="NVIDIA H200") != tuned
  # Once the H100 has entries of its own it reads only those: this signature
  # from its entry, another one (with a mask) not from the H200's.
  own = Config(64, 128, 2, persistent=False)
  tuner.record(problem, "NVIDIA H100", own, {str(own): 0.1})
  assert api.chosen_config_source(q, kv, kv, device_kind="NVIDIA H100") == (
      own, "autotune cache")
  assert api.chosen_config(q, kv, kv, device_kind="NVIDIA H200") == tuned
  masked = api.chosen_config_source(q, kv, kv, mask=jax.ShapeDtypeStruct((2, 1, 1000, 1000), jnp.bool_),
                                    device_kind="NVIDIA H100")
  assert masked[1] != "autotune cache (NVIDIA H200)"


# --- coverage tuning: the set, the order, resume, the budget, the dry run ----

DEVICE = "NVIDIA H200"


def test_the_coverage_set_is_the_issues_list():
  """Issue #15's set: head dims 64/96/128/192/256 (head_dim_out = head_dim),
  seq 512..32k with seq_q = seq_kv, causal and not, bf16 and f16, each at 16k
  tokens per batch (at least one sequence) and heads * head_dim = 2048."""
  from harness.tools.bench_grid import Point
  jobs = tuner.coverage_jobs()
  assert len(jobs) == 5 * 7 * 2 * 2 == 140
  wanted = set(itertools.product((64, 96, 128, 192, 256),
                                 (512, 1024, 2048, 4096, 8192, 16384, 32768),
                                 (False, True), ("bfloat16", "float16")))
  assert {(j.head_dim, j.seq, j.causal, j.dtype) for j in jobs} == wanted
  for job in jobs:
    assert job.batch == max(1, 16384 // job.seq)
    assert job.heads == 2048 // job.head_dim
    assert (job.batch, job.heads) == (Point(job.head_dim, job.seq, job.causal).batch,
                                      Point(job.head_dim, job.seq, job.causal).heads)
    problem = job.problem()
    assert problem.seq_q == problem.seq_kv == job.seq
    assert problem.head_dim == problem.head_dim_out == plan.padded_head_dim(job.head_dim)
    assert problem.return_residuals  # tuned as config=None looks up
    assert str(problem.dtype) == job.dtype
  # Every head dim of the list is computed at its own width (96 in 32-column
  # rows): 140 signatures.
  sigs = {j.signature() for j in jobs}
  padded = {(j.dtype, plan.padded_head_dim(j.head_dim), j.seq, j.causal) for j in jobs}
  assert len(sigs) == len(padded) == 140


def test_the_likely_order_puts_the_common_calls_first():
  jobs = tuner.coverage_jobs()
  ordered = tuner.likely_order(jobs)
  assert sorted(map(str, ordered)) == sorted(map(str, jobs))
  dtypes = [j.dtype for j in ordered]
  assert dtypes == sorted(dtypes, key=("bfloat16", "float16").index)
  bf16 = [j.head_dim for j in ordered if j.dtype == "bfloat16"]
  last_common = max(i for i, d in enumerate(bf16) if d in (64, 128))
  first_rare = min(i for i, d in enumerate(bf16) if d in (96, 192))
  assert last_common < first_rare
  assert (ordered[0].head_dim, ordered[0].dtype) == (128, "bfloat16")
  # A head dim the kernel pads (72 -> 96) shares the padded dim's
  # signature: tuned once, at the shape that comes first.
  d96, d72 = (tuner.Job(4, 4096, 2048 // d, d, True, "bfloat16") for d in (96, 72))
  first, second = tuner.plan_jobs([d96, d72], {}, DEVICE, resume=True)
  assert (first.status, second.status, second.same_as) == ("tune", "same", d96)


def _small_jobs():
  """Coverage jobs with few candidates (head dim 256), to keep fakes quick."""
  return [j for j in tuner.coverage_jobs() if j.head_dim == 256 and j.dtype == "bfloat16"]


def _fake_run_maker(clock, calls, seconds_per_candidate=1.0):
  """``make_run`` without a GPU: each config 'takes' seconds on ``clock``,
  and the last candidate of each job is the fastest."""
  def make_run(job):
    candidates = heuristics.get_autotuning_configs(job.problem())
    calls.append(job)

    def run(config):
      clock.now += seconds_per_candidate(job) if callable(seconds_per_candidate) \
          else seconds_per_candidate
      return 1e-3 * (len(candidates) - candidates.index(config))
    return run
  return make_run


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_resume_skips_signatures_cached_with_the_same_candidates(tmp_path):
  cache = tmp_path / "cache.json"
  jobs = _small_jobs()
  done, partial = jobs[0], jobs[1]
  full = heuristics.get_autotuning_configs(done.problem())
  tuner.record(done.problem(), DEVICE, full[0], {str(c): 1.0 for c in full}, path=cache)
  some = heuristics.get_autotuning_configs(partial.problem())[:1]
  tuner.record(partial.problem(), DEVICE, some[0], {str(c): 1.0 for c in some}, path=cache)
  status = {p.job: p.status for p in
            tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE, resume=True)}
  assert status[done] == "cached"
  assert status[partial] == "retune"  # tuned over fewer candidates than now
  assert all(status[j] == "tune" for j in jobs[2:])
  kept = {p.job: p.status for p in tuner.plan_jobs(
      jobs, autotune.load_cache(cache), DEVICE, resume=True, keep_cached=True)}
  assert kept[done] == kept[partial] == "cached"   # --keep-cached: whatever it was tuned over
  assert all(kept[j] == "tune" for j in jobs[2:])
  off = tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE, resume=False)
  assert all(p.tunes for p in off)
  other = tuner.plan_jobs(jobs, autotune.load_cache(cache), "NVIDIA H100", resume=True)
  assert all(p.status == "tune" for p in other)

  clock, calls = _Clock(), []
  planned = tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE, resume=True)
  result = tuner.run_plan(planned, DEVICE, _fake_run_maker(clock, calls), cache_path=cache,
                          clock=clock, out=lambda line: None)
  assert done not in calls and partial in calls and len(calls) == len(jobs) - 1
  assert not result["left"] and not result["failed"]
  data = autotune.load_cache(cache)[DEVICE]
  for job in jobs:
    entry = data[job.signature()]
    if job != done:
      candidates = heuristics.get_autotuning_configs(job.problem())
      assert Config(**entry["config"]) == candidates[-1]  # the fake's fastest
      assert entry["shape"] == [job.batch, job.seq, job.heads, job.head_dim]
  again = tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE, resume=True)
  assert all(p.status == "cached" for p in again)


def test_the_budget_stops_starting_signatures_it_would_overrun(tmp_path):
  cache = tmp_path / "cache.json"
  jobs = _small_jobs()
  planned = tuner.plan_jobs(jobs, {}, DEVICE, resume=True)
  clock, calls, lines = _Clock(), [], []
  budget = 17.0
  result = tuner.run_plan(planned, DEVICE, _fake_run_maker(clock, calls), cache_path=cache,
                          budget_s=budget, clock=clock, out=lines.append)
  tuned, left = result["tuned"], result["left"]
  assert tuned and left, "a budget this small must stop part way"
  assert [p.job for p in tuned] == calls == jobs[:len(tuned)]
  assert [p.job for p in left] == jobs[len(tuned):]
  assert clock.now <= budget
  # It stopped because the next one would overrun (1 s per candidate here),
  # not earlier.
  assert clock.now + len(left[0].candidates) * 1.0 > budget
  assert set(autotune.load_cache(cache)[DEVICE]) == {p.signature for p in tuned}
  text = "\n".join(lines)
  assert f"{len(left)} left" in text
  assert all(p.signature in text for p in left)


def test_the_budget_estimate_takes_the_slowest_candidate_time_so_far(tmp_path):
  """Candidates that take 5 s, then 1 s: the next job is still estimated at
  5 s a candidate (the slowest so far, not the last)."""
  full = [j for j in _small_jobs() if not j.causal]
  causal = [j for j in _small_jobs() if j.causal]
  jobs = [full[0], full[1], causal[0], causal[1]]
  planned = tuner.plan_jobs(jobs, {}, DEVICE, resume=True)
  n = [len(p.candidates) for p in planned]
  cost = {jobs[0]: 5.0, jobs[1]: 1.0, jobs[2]: 1.0, jobs[3]: 1.0}
  # The second fits when estimated at 5 s a candidate; the third would fit
  # at its true 1 s a candidate, not at 5 s.
  budget = 5.0 * n[0] + 5.0 * n[1]
  spent = 5.0 * n[0] + 1.0 * n[1]
  assert spent + 1.0 * n[2] <= budget < spent + 5.0 * n[2]
  clock, calls = _Clock(), []
  result = tuner.run_plan(planned, DEVICE, _fake_run_maker(clock, calls, cost.get),
                          cache_path=tmp_path / "c.json", budget_s=budget, clock=clock,
                          out=lambda line: None)
  assert calls == jobs[:2]
  assert clock.now == spent
  assert [p.job for p in result["left"]] == jobs[2:]


def test_the_first_signature_starts_whatever_the_budget(tmp_path):
  planned = tuner.plan_jobs(_small_jobs()[:3], {}, DEVICE, resume=True)
  clock, calls = _Clock(), []
  result = tuner.run_plan(planned, DEVICE, _fake_run_maker(clock, calls),
                          cache_path=tmp_path / "c.json", budget_s=0.0, clock=clock,
                          out=lambda line: None)
  assert len(result["tuned"]) == 1 and len(result["left"]) == 2


def test_the_command_fills_the_cache_over_repeated_budgeted_runs(tmp_path, monkeypatch, capsys):
  """``--coverage --budget-s`` end to end with a fake GPU and a fake clock:
  each run tunes what fits, and the next picks up where it stopped."""
  from kernel import api
  clock, calls = _Clock(), []
  monkeypatch.setattr(api, "sm90_device", lambda: types.SimpleNamespace(device_kind=DEVICE))
  monkeypatch.setattr(tuner, "_gpu_run_maker", lambda: _fake_run_maker(clock, calls, 0.1))
  verified = []
  monkeypatch.setattr(tuner, "_gpu_verify_maker",
                      lambda: lambda job: lambda config: verified.append(job) or None)
  monkeypatch.setattr(tuner, "time", types.SimpleNamespace(monotonic=clock))
  cache = tmp_path / "cache.json"
  argv = ["--coverage", "--budget-s", "90", "--cache", str(cache)]
  signatures = len({j.signature() for j in tuner.coverage_jobs()})
  seen = []
  for _ in range(100):
    assert tuner.main(argv) == 0
    seen.append(len(autotune.load_cache(cache).get(DEVICE, {})))
    if seen[-1] == signatures:
      break
  assert len(seen) > 2, "a 90 s budget must take several runs"
  assert seen == sorted(seen) and len(set(seen)) == len(seen)  # every run adds
  assert len(calls) == signatures  # nothing tuned twice
  assert len(verified) == signatures  # every winner checked once
  out = capsys.readouterr().out
  assert "run the command again to continue" in out
  assert out.rstrip().endswith("0 left (0 candidates)")
  entry = next(iter(autotune.load_cache(cache)[DEVICE].values()))
  import jax
  assert entry["jax"] == jax.__version__
  datetime.date.fromisoformat(entry["date"])
  assert tuner.main(["--coverage", "--dry-run", "--cache", str(cache)]) == 0
  assert f"{signatures} cached, 0 to tune" in capsys.readouterr().out


def test_keep_cached_without_resume_is_refused(tmp_path):
  with pytest.raises(SystemExit, match="--keep-cached"):
    tuner.main(["--coverage", "--no-resume", "--keep-cached", "--dry-run",
                "--cache", str(tmp_path / "cache.json")])


def test_dry_run_lists_what_would_be_tuned_and_what_is_cached(tmp_path, capsys):
  cache = tmp_path / "cache.json"
  job = tuner.likely_order(tuner.coverage_jobs())[3]
  full = heuristics.get_autotuning_configs(job.problem())
  tuner.record(job.problem(), DEVICE, full[0], {str(c): 1.0 for c in full}, path=cache)
  before = cache.read_text()
  assert tuner.main(["--coverage", "--dry-run", "--cache", str(cache),
                     "--device-kind", DEVICE]) == 0
  out = capsys.readouterr().out.splitlines()
  rows = [line.split() for line in out if line.startswith("  ")]
  assert len(rows) == 140
  assert [r[1] for r in rows] == [j.signature() for j in tuner.likely_order(tuner.coverage_jobs())]
  status = {}
  for r in rows:
    status.setdefault(r[1], r[0])
  assert status[job.signature()] == "cached"
  assert sum(s == "tune" for s in status.values()) == 139
  assert sum(r[0] == "same" for r in rows) == 0
  assert "140 jobs, 140 signatures, 1 cached, 139 to tune" in "\n".join(out)
  assert cache.read_text() == before  # a dry run writes nothing
  assert tuner.main(["--coverage", "--dry-run", "--order", "listed", "--cache", str(cache),
                     "--device-kind", DEVICE]) == 0
  listed = [line.split()[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ")]
  assert listed == [j.signature() for j in tuner.coverage_jobs()]


def test_only_tunes_the_named_signatures_and_refuses_a_name_it_does_not_know(tmp_path, capsys):
  names = ["bfloat16-d64-dv64-q16384-kv16384-full", "bfloat16-d64-dv64-q4096-kv4096-full"]
  assert tuner.main(["--coverage", "--dry-run", "--only", ",".join(names), "--cache",
                     str(tmp_path / "c.json"), "--device-kind", DEVICE]) == 0
  rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
  assert sorted(r[1] for r in rows) == sorted(names) and {r[0] for r in rows} == {"tune"}
  with pytest.raises(SystemExit, match="--only names no job.*d64-dv64-q4096-kv4096-ful'"):
    tuner.main(["--coverage", "--dry-run", "--only", "bfloat16-d64-dv64-q4096-kv4096-ful",
                "--device-kind", DEVICE])


def test_without_a_gpu_only_the_dry_run_runs(tmp_path):
  from kernel import api
  if api.sm90_device() is not None:
    pytest.skip("this machine has an sm90 GPU: the command would tune")
  with pytest.raises(SystemExit, match="needs an sm90 GPU"):
    tuner.main(["--coverage", "--cache", str(tmp_path / "c.json")])
  assert not (tmp_path / "c.json").exists()


def test_entries_written_before_the_date_and_jax_fields_are_still_read(tmp_path):
  """An entry as the cache held them before coverage tuning: no date, jax or
  shape, timing keys without the schedule field.  config=None still finds
  it; the tuner reads its candidate set and, since that is not today's,
  tunes it again under --resume."""
  cache = tmp_path / "cache.json"
  old_best = Config(64, 128, 2, persistent=True)
  cache.write_text(json.dumps({DEVICE: {autotune.signature(PROBLEM): {
      "config": {"block_q": 64, "block_kv": 128, "num_stages": 2, "persistent": True},
      "median_ms": {
          "Config(block_q=64, block_kv=128, num_stages=2, persistent=True)": 0.2,
          "Config(block_q=64, block_kv=64, num_stages=2, persistent=False)": 0.3}}}}))
  assert autotune.lookup(PROBLEM, DEVICE, path=cache) == old_best
  entry = autotune.load_cache(cache)[DEVICE][autotune.signature(PROBLEM)]
  assert tuner.timed_candidates(entry) == {old_best, Config(64, 64, 2, persistent=False)}
  job = tuner.Job(4, 4096, 16, 128, False)
  assert job.signature() == autotune.signature(PROBLEM)
  [planned] = tuner.plan_jobs([job], autotune.load_cache(cache), DEVICE, resume=True)
  assert planned.status == "retune"
  # Rewritten, the entry gains the fields and is read the same way.
  tuner.record(PROBLEM, DEVICE, old_best, {str(old_best): 0.2}, path=cache)
  entry = autotune.load_cache(cache)[DEVICE][autotune.signature(PROBLEM)]
  assert {"date", "jax", "config", "median_ms"} <= set(entry)
  assert autotune.lookup(PROBLEM, DEVICE, path=cache) == old_best


def test_every_shipped_entry_is_read_by_config_none():
  for device, entries in autotune.load_cache().items():
    for sig, entry in entries.items():
      assert tuner.timed_candidates(entry), (device, sig)
      Config(**entry["config"])


def test_split_tail_twins_time_the_pick_beside_its_split_tail(tmp_path):
  """``--split-tail-twins``: per non-causal signature, the config
  config=None runs (the cache's entry, else the nearest or the heuristic)
  and the same with the persistent split tail; causal signatures keep
  their entry untouched; a run records the faster of the two."""
  cache = tmp_path / "cache.json"
  jobs = [j for j in tuner.coverage_jobs() if j.head_dim == 128 and j.dtype == "bfloat16"
          and j.seq in (4096, 16384)]
  full = next(j for j in jobs if not j.causal and j.seq == 4096)
  entry_config = Config(64, 128, 2, persistent=False)
  tuner.record(full.problem(), DEVICE, entry_config, {str(entry_config): 1.0}, path=cache)
  planned = {p.job: p for p in tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE,
                                                resume=True, twins=True)}
  assert planned[full].candidates == (entry_config,
                                      Config(64, 128, 2, True, "split-tail"))
  assert planned[full].tunes
  for job in jobs:
    if job.causal:
      assert planned[job].status == "cached" and planned[job].candidates == ()
    else:
      pick, twin = planned[job].candidates
      assert twin == dataclasses.replace(pick, persistent=True, schedule="split-tail")
      assert plan.config_fits(job.problem(), twin)

  def make_run(job):
    return lambda config: 0.5 if config.schedule == "split-tail" else 1.0
  tuner.run_plan(list(planned.values()), DEVICE, make_run, cache_path=cache,
                 clock=_Clock(), out=lambda line: None)
  data = autotune.load_cache(cache)[DEVICE]
  assert Config(**data[full.signature()]["config"]).schedule == "split-tail"
  assert all(j.signature() not in data for j in jobs if j.causal)
  again = tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE, resume=True, twins=True)
  # The split tail won everywhere: the picks are their own twins, kept.
  assert {p.status for p in again} == {"cached"}


def test_a_split_tail_borrowed_from_the_nearest_entry_is_timed_beside_its_sibling(tmp_path):
  """``--split-tail-twins`` on a signature without an entry whose nearest
  entry picked the split tail: its round-robin sibling and the split tail
  are timed there, not kept unmeasured."""
  cache = tmp_path / "cache.json"
  jobs = [j for j in tuner.coverage_jobs() if j.head_dim == 128 and j.dtype == "bfloat16"
          and not j.causal and j.seq in (4096, 16384)]
  long = next(j for j in jobs if j.seq == 16384)
  split = Config(64, 128, 2, True, "split-tail")
  tuner.record(long.problem(), DEVICE, split, {str(split): 1.0}, path=cache)
  planned = {p.job: p for p in tuner.plan_jobs(jobs, autotune.load_cache(cache), DEVICE,
                                                resume=True, twins=True)}
  short = next(j for j in jobs if j.seq == 4096)
  assert planned[short].candidates == (Config(64, 128, 2, True, "round-robin"), split)
  assert planned[short].tunes
  assert planned[long].status == "cached"


def test_config_none_runs_no_split_tail_the_cache_picked():
  """Where the shipped cache's entry picked the split tail, config=None runs
  the same tiling round-robin and says so in its source: the split tail is
  off the default path (docs/decisions/split-tail-off-the-default.md)."""
  from kernel import api
  picked = [(sig, Config(**e["config"]))
            for sig, e in autotune.load_cache()[autotune.REFERENCE_DEVICE_KIND].items()
            if e["config"].get("schedule") == "split-tail"]
  assert picked
  for sig, split in picked:
    got = autotune._SIGNATURE.fullmatch(sig)
    assert got["rest"] == "full", sig
    d, dv = autotune._head_dims(got["head"])
    sds = lambda s, h: jax.ShapeDtypeStruct((1, s, 2, h), jnp.dtype(got["dtype"]))
    config, source = api.chosen_config_source(
        sds(int(got["q"]), d), sds(int(got["kv"]), d), sds(int(got["kv"]), dv),
        device_kind=autotune.REFERENCE_DEVICE_KIND)
    assert config == dataclasses.replace(split, schedule="round-robin"), sig
    assert source == "autotune cache, its split tail run round-robin", (sig, source)
