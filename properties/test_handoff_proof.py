"""The fused dQ's dS^T handoff between the compute warpgroups
(harness/handoff_model.py): safe and deadlock-free over every interleaving,
and each deliberate defect refuted with a trace."""

from __future__ import annotations

import pytest

from harness import handoff_model as hm
from kernel import backward, barriers

KERNEL = hm.HandoffProtocol.from_kernel()


@pytest.mark.parametrize("n", [1, 2])
def test_the_kernels_handoff_is_safe_for_every_interleaving(n):
  result = hm.check(KERNEL, n)
  assert result.safe, result.trace


@pytest.mark.parametrize("mutation", sorted(hm.MUTATIONS))
def test_each_defect_has_a_counterexample(mutation):
  p = hm.HandoffProtocol.from_kernel(mutation)
  traces = [hm.check(p, n).trace for n in (1, 2)]
  trace = next((t for t in traces if t), None)
  assert trace is not None and trace[-1].startswith(("UNSAFE", "DEADLOCK")), traces


def test_the_model_reads_the_kernels_schedule():
  """Buffer, owner and barrier ids are the kernel's: two buffers used
  alternately, owners alternating, one barrier per owner."""
  assert KERNEL.buffers == backward.DS_BUFFERS == 2
  assert [KERNEL.buffer_of(t) for t in range(4)] == [0, 1, 0, 1]
  assert [KERNEL.owner_of(t) for t in range(4)] == [0, 1, 0, 1]
  assert KERNEL.barrier_of(0) != KERNEL.barrier_of(1)
  assert {KERNEL.barrier_of(o) for o in (0, 1)} <= {b.id for b in barriers.NAMED_BARRIERS}
  assert KERNEL.units == barriers.COMPUTE_WARPGROUPS


def test_a_run_of_the_model_reaches_the_end():
  """Not vacuous: with one step the model is safe, and a deadlock is
  reported when the epilogue barrier would need a third warpgroup."""
  import dataclasses
  assert hm.check(KERNEL, 1).safe
  three = dataclasses.replace(KERNEL, units=3)
  trace = hm.check(three, 1).trace
  assert trace is not None and trace[-1].startswith("DEADLOCK"), trace
