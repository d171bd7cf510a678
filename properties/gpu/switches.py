"""What the GPU tests of a kernel.experiments switch share: the launch a
case runs under (the heuristic config, or it one tile per block or
persistent) and the check that the switched kernel meets float64 and the
other path bit for bit (test_forward_gpu.py, test_fp8_gpu.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from harness.numerics.conformance import check_forward, poison_device_memory, run_kernel
from harness.tools.device_check import problem_of
from kernel.tiling import heuristics, plan

# Each switch's test runs the heuristic config, and its tiling one tile per
# block and persistent (longest-first).
LAUNCHES = pytest.mark.parametrize(
    "persistent,schedule", [(None, None), (False, "round-robin"), (True, "longest-first")],
    ids=["heuristic", "nonpersistent", "persistent-lf"])


def launch_config(call, persistent, schedule, untiled_copies=None):
  """None (the heuristic, as config=None), or the heuristic config of the
  call's problem as ``untiled_copies`` lays it out (None: as the API
  does), run ``persistent`` with ``schedule``; skips where it does not fit."""
  if persistent is None:
    return None
  problem = problem_of(call)
  if untiled_copies is not None:
    problem = problem.replace(untiled_copies=untiled_copies)
  cfg = dataclasses.replace(heuristics.get_heuristics_config(problem),
                            persistent=persistent, schedule=schedule)
  if not plan.config_fits(problem, cfg):
    pytest.skip(f"{cfg} does not fit for this case")
  return cfg


def assert_switch_matches(call, cfg, switch: dict, against: dict | None = None,
                          bitwise: bool = True):
  """run_kernel with ``switch``: within the rule of float64 and
  (``bitwise``) bit for bit run_kernel with ``against`` (None: the shipped
  path), on device memory poisoned first."""
  poison_device_memory(4 * call.query.nbytes)
  switched = run_kernel(call, config=cfg, **switch)
  report = check_forward(call, *switched)
  assert report.passed, report.summary()
  if not bitwise:
    return
  other = run_kernel(call, config=cfg, **(against or {}))
  for a, b, what in zip(switched, other, ("out", "m", "l")):
    assert np.array_equal(a, b, equal_nan=True), \
        f"{what}: {switch} differs from the {against or 'shipped'} path"
