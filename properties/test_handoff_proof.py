"""The fused dQ's dS^T handoff between the compute warpgroups
(harness/handoff_model.py): proved safe and deadlock-free for any number of
steps, and each deliberate defect refuted with a trace."""

from __future__ import annotations

import dataclasses

import pytest
import z3

from harness import handoff_model as hm
from kernel import backward, barriers

KERNEL = hm.HandoffProtocol.from_kernel()


def test_the_kernels_handoff_is_proved_for_any_number_of_steps():
  result = hm.prove(KERNEL)
  assert result.safe, result.failures


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_interleaving_of_n_steps_is_safe(n):
  result = hm.check(KERNEL, n)
  assert result.safe, result.trace
  assert result.states == 2 + 18 * n   # the schedule repeats every two steps


@pytest.mark.parametrize("mutation", sorted(hm.MUTATIONS))
def test_each_defect_has_a_counterexample_and_no_proof(mutation):
  p = hm.HandoffProtocol.from_kernel(mutation)
  traces = [hm.check(p, n).trace for n in (1, 2)]
  trace = next((t for t in traces if t), None)
  assert trace is not None and trace[-1].startswith(("UNSAFE", "DEADLOCK")), traces
  assert not hm.prove(p).safe


def test_the_model_reads_the_kernels_schedule():
  """Buffer, owner and barrier ids are the kernel's: two buffers used
  alternately, owners alternating, one barrier per owner."""
  assert KERNEL.buffers == backward.DS_BUFFERS == 2
  assert [KERNEL.buffer_of(t) for t in range(4)] == [0, 1, 0, 1]
  assert [KERNEL.owner_of(t) for t in range(4)] == [0, 1, 0, 1]
  assert KERNEL.barrier_of(0) != KERNEL.barrier_of(1)
  assert {KERNEL.barrier_of(o) for o in (0, 1)} <= {b.id for b in barriers.NAMED_BARRIERS}
  assert KERNEL.units == barriers.COMPUTE_WARPGROUPS


def test_the_invariant_is_not_vacuous():
  """It admits deep states (an owner reading at step 1000 of 5000) and
  refuses impossible ones (warpgroup 0 reading a step warpgroup 1 owns)."""
  ids = hm._ids(KERNEL)
  s, n = hm._State(KERNEL, "a", ids), z3.Int("n")
  inv = z3.And([e for _, e in hm._invariant(KERNEL, s, n, hm._shapes(KERNEL))])
  for t0, expected in ((1000, z3.sat), (1001, z3.unsat)):
    solver = z3.Solver()
    solver.add(inv, n == 5000, s.t[0] == t0, s.pc[0] == hm.READ)
    assert solver.check() == expected, t0


def test_a_barrier_needing_a_third_warpgroup_deadlocks():
  three = dataclasses.replace(KERNEL, units=3)
  trace = hm.check(three, 1).trace
  assert trace is not None and trace[-1].startswith("DEADLOCK"), trace
  assert not hm.prove(three).safe
