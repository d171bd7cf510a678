"""The backward kernels' stage ring (harness/ring_model.py): proved for every
launch kernel/backward.py makes, and shown able to fail."""

from __future__ import annotations

import dataclasses

import pytest

from harness import ring_model as rm
from kernel import backward, plan

PROTOCOLS = rm.kernel_protocols()


def test_every_backward_launch_is_covered():
  """The prover's list is read from the kernel's plans: every launch of every
  head-dim class maps onto a proved protocol."""
  keys = {(p.num_stages, p.buffers, p.arrivals, p.consumers) for p in PROTOCOLS}
  for d, dv in ((64, 64), (128, 128), (72, 96), (256, 256), (256, 64)):
    for name, mbarriers in backward.launches(plan.padded_head_dim(d), plan.padded_head_dim(dv)):
      p = rm.RingProtocol.from_plan(name, mbarriers)
      assert (p.num_stages, p.buffers, p.arrivals, p.consumers) in keys, p.describe()
  assert {p.num_stages for p in PROTOCOLS} == {1, 2}


@pytest.mark.parametrize("proto", PROTOCOLS, ids=[p.describe() for p in PROTOCOLS])
def test_the_ring_is_proved_for_any_number_of_blocks(proto):
  result = rm.prove(proto)
  assert result.proven, result.failures


# The smallest ring (S = 1, two buffers) keeps the bounded searches short.
SMALL = min(PROTOCOLS, key=lambda p: (p.num_stages, len(p.buffers)))


@pytest.mark.parametrize("mutation", sorted(rm.MUTATIONS))
def test_each_mutant_has_a_counterexample(mutation):
  """Bounded model checking finds a slot collision or a stale read for each
  deliberate defect, and the invariant no longer proves it."""
  mutant = dataclasses.replace(SMALL, mutation=mutation)
  trace = rm.find_counterexample(mutant, n=SMALL.num_stages + 2, max_steps=16)
  assert trace is not None and trace[-1].startswith(("UNSAFE", "DEADLOCK")), trace
  assert not rm.prove(mutant).proven


def test_a_plan_whose_consumed_barrier_counts_one_arrival_is_refuted():
  """If the plan said one arrival completes "consumed" (one warpgroup's
  release), the producer could refill a slot the other still reads."""
  wrong = dataclasses.replace(SMALL, arrivals=1)
  assert not rm.prove(wrong).proven
  trace = rm.find_counterexample(wrong, n=SMALL.num_stages + 2, max_steps=16)
  assert trace is not None and trace[-1] == "UNSAFE: producer_copy", trace


def test_the_proof_is_not_vacuous():
  """The invariant holds in deep states (the producer several wraps in), and
  every action of the kernel's ring fires on some path from the start."""
  import z3
  p = max(PROTOCOLS, key=lambda q: (q.num_stages, len(q.buffers)))
  n = z3.Int("n")
  m = rm.State(p, "", consumers=p.consumers)
  s = z3.Solver()
  s.add(*[e for _, e in rm.invariant(m, n)])
  s.add(m.gp >= 3 * p.num_stages, m.acq, *[m.gc[c] < m.gp for c in range(p.consumers)])
  assert s.check() == z3.sat
  # Every action of a two-stage ring (both slots used) fires on some path.
  q = min((r for r in PROTOCOLS if r.num_stages == 2), key=lambda r: len(r.buffers))
  fired = rm.reachable_actions(q, n=3, max_steps=16)
  assert fired == {a.name for a in rm.actions(rm.State(q, "x", consumers=q.consumers),
                                              z3.IntVal(1))}
