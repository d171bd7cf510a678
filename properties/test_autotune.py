"""The autotuner's cache and selection logic (timing itself needs a GPU)."""

from __future__ import annotations

import ast
import dataclasses
import re

import numpy as np
import pytest

from harness.tools import autotune as tuner
from kernel import autotune, heuristics, plan
from kernel.config import Config

PROBLEM = plan.problem_for((4, 4096, 16, 128), (4, 4096, 16, 128), (4, 4096, 16, 128),
                           "bfloat16")


def test_signature_buckets_sequence_lengths_and_names_features():
  other = dataclasses.replace(PROBLEM, seq_q=3000, seq_kv=2100)
  assert autotune.signature(PROBLEM) == autotune.signature(other)
  assert autotune.signature(PROBLEM) != autotune.signature(dataclasses.replace(PROBLEM, seq_q=5000))
  assert autotune.signature(PROBLEM, has_bias=True).endswith("-bias")
  assert "causal" in autotune.signature(dataclasses.replace(PROBLEM, is_causal=True))


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
  big = dataclasses.replace(PROBLEM, head_dim=256, head_dim_out=256)
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


def test_choose_falls_back_to_the_heuristic():
  assert autotune.choose(PROBLEM, None) == heuristics.get_heuristics_config(PROBLEM)
  assert autotune.choose(PROBLEM, "a GPU nobody tuned") == heuristics.get_heuristics_config(PROBLEM)


def test_the_shipped_cache_is_well_formed():
  """The cache produced on the H200 ships with the package; every entry is a
  legal config and the fastest of the timings recorded with it (python -m
  harness autotune regenerates it)."""
  assert autotune.CACHE_PATH.exists(), "kernel/autotune_cache.json is missing"
  data = autotune.load_cache()
  assert data.get("NVIDIA H200"), "the shipped cache has no H200 entries"
  for device, entries in data.items():
    for sig, entry in entries.items():
      best = Config(**entry["config"])  # validates
      timed = {_config_of(c): t for c, t in entry["median_ms"].items() if isinstance(t, float)}
      assert timed[best] == min(timed.values()), (device, sig)


def _config_of(text: str) -> Config:
  """The Config a timing key names.  Keys are ``str(config)`` when it was
  tuned; a field added to Config since then takes its default."""
  fields = re.fullmatch(r"Config\((.*)\)", text).group(1)
  return Config(**{k: ast.literal_eval(v) for k, v in
                   (item.split("=", 1) for item in fields.split(", "))})


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
  problem = autotune.selection_problem(plan.problem_for(q.shape, kv.shape, kv.shape, q.dtype))
  tuned = Config(64, 64, 3, persistent=False)
  assert tuned != heuristics.get_heuristics_config(problem)
  tuner.record(problem, "NVIDIA H200", tuned, {str(tuned): 0.1})
  assert api.chosen_config(q, kv, kv, device_kind="NVIDIA H200") == tuned
  assert api.chosen_config(q, kv, kv, device_kind="NVIDIA H100") == \
      heuristics.get_heuristics_config(problem)
  # Another feature set is another signature: not tuned, so the heuristic.
  assert api.chosen_config(q, kv, kv, mask=q, device_kind="NVIDIA H200") != tuned
