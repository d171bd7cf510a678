"""The deferred fused dQ's handoff (harness/deferred_handoff_model.py,
kernel/backward.py with dq_schedule="deferred", private until measured):
proved safe and deadlock-free for any number of steps, and each defect
refuted with a trace, among them the variant that hung on the H200."""

from __future__ import annotations

import dataclasses

import pytest
import z3

from harness import deferred_handoff_model as dh
from kernel import backward, barriers

KERNEL = dh.Protocol.from_kernel()


def test_the_deferred_handoff_is_proved_for_any_number_of_steps():
  result = dh.prove(KERNEL)
  assert result.safe, result.failures


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_every_interleaving_of_n_steps_is_safe(n):
  result = dh.check(KERNEL, n)
  assert result.safe, result.trace
  assert result.states == (6 if n == 0 else 37 * n - 4)   # repeats every step past the first


@pytest.mark.parametrize("mutation", sorted(dh.MUTATIONS))
def test_each_defect_has_a_counterexample_and_no_proof(mutation):
  p = dh.Protocol.from_kernel(mutation)
  traces = [dh.check(p, n).trace for n in (1, 2, 3)]
  trace = next((t for t in traces if t), None)
  assert trace is not None and trace[-1].startswith(("UNSAFE", "DEADLOCK")), traces
  assert not dh.prove(p).safe


def test_one_barrier_per_warpgroup_deadlocks_as_it_did_on_the_h200():
  """Session 4's first deferred kernel: a warpgroup a step ahead arrives
  twice on the other's barrier and completes a generation alone."""
  trace = dh.check(dh.Protocol.from_kernel("one_barrier_per_warpgroup"), 2).trace
  assert trace[-1].startswith("DEADLOCK"), trace
  assert trace.count("wg1 signal") == 2 and trace.index("wg1 signal", 4) < trace.index("wg0 sync")


def test_the_model_reads_the_kernels_schedule_and_barriers():
  assert [KERNEL.buffer_of(t) for t in range(4)] == [backward.ds_buffer(t) for t in range(4)]
  assert [KERNEL.owner_of(t) for t in range(4)] == [backward.dq_owner(t) for t in range(4)]
  ids = {KERNEL.barrier_of(w, t) for w in (0, 1) for t in (0, 1)}
  assert len(ids) == 4 and ids <= {b.id for b in barriers.NAMED_BARRIERS}
  assert "deferred" in backward.DQ_SCHEDULES


def test_the_invariant_is_not_vacuous():
  """It admits a deep state (warpgroup 0 forming step 1000's part at step
  1001 of 5000) and refuses an impossible one (at step 1000: step 999 is
  warpgroup 1's)."""
  s, n = dh._State(KERNEL, "a"), z3.Int("n")
  inv = z3.And([e for _, e in dh._invariant(KERNEL, s, n, dh._shapes(KERNEL))])
  for t0, expected in ((1001, z3.sat), (1000, z3.unsat)):
    solver = z3.Solver()
    solver.add(inv, n == 5000, s.t[0] == t0, s.pc[0] == dh.READ)
    assert solver.check() == expected, t0


def test_a_barrier_needing_a_third_warpgroup_deadlocks():
  trace = dh.check(dataclasses.replace(KERNEL, units=3), 1).trace
  assert trace is not None and trace[-1].startswith("DEADLOCK"), trace
