"""Z3 model of the fused dQ's dS^T handoff (``kernel/backward.py``).

In the dK/dV kernel with the fused dQ, the two compute warpgroups walk the
same steps t = 0 .. n-1.  At step t each stores its dS^T tile into staging
buffer ``ds_buffer(t)``; the step's owner ``dq_owner(t)`` then waits on the
named barrier ``ds_ready_id(owner)`` (``bar.sync``) while the other only
arrives there (``bar.arrive``), and the owner reads both tiles of the buffer
with its dQ product (a wgmma reading shared memory until it completes).
Between the rendezvous and the product the owner issues and waits for its
dK/dV products, and after the rendezvous the other goes on to its dK/dV
products and next step: they read no staging buffer and signal nothing,
so the model has no action for them (any delay is one of the
interleavings it covers).
After the last step both warpgroups meet at the "epilogue" barrier, after
which the K tiles the products read are overwritten with dK.

The schedule (``ds_buffer``, ``dq_owner``, ``DS_BUFFERS``) and the barrier
ids and thread counts are the kernel's own (``kernel.backward``,
``kernel.barriers``), called on Z3 integers, not retyped here.

Named-barrier rule (the one ``harness/protocol_model.py`` encodes for the
forward): a generation completes when ``num_threads`` threads have arrived;
each warpgroup arrives with 128; surplus arrivals count toward the next
generation; ``bar.sync`` returns once the generation of its own arrival
completed.

Actions per warpgroup, one at a time in any interleaving:

* ``write``: store this step's dS^T into ``ds_buffer(t)``;
* ``barrier``: the owner arrives and waits, the other arrives and moves on;
* ``wait``: the owner's wait returns (its generation completed);
* ``read``: the owner's product completes (it read both tiles from the
  moment its wait returned until now);
* ``epilogue``/``epilogue wait``: ``bar.sync`` on the epilogue barrier,
  then the K tiles are overwritten.

Safety: no write into a buffer while an owner's product reads it (slot
collision); the owner's product finds both tiles of its own step in the
buffer (no stale read); K is not overwritten while a product reads it; the
warpgroups are never more than one step apart.  Liveness: every state short
of both warpgroups done enables some action (no deadlock).

Two checks, both over the same actions (:func:`_moves`, Z3 expressions):

* :func:`check`: for a number of steps n, every reachable state, by
  breadth-first search (Z3 evaluates the actions on concrete values); a
  violation comes back with the shortest trace to it.  The reachable states
  grow by 18 per step (the schedule repeats every two steps).
* :func:`prove`: for any number of steps, an inductive invariant (written out
  above :func:`_invariant`) checked by Z3: it holds initially, every action
  keeps it, and under it no action is unsafe and some action is enabled
  until both warpgroups are done.

:data:`MUTATIONS` are defects both must refute
(properties/test_handoff_proof.py).  The state layout, the barrier actions,
the search and the proof's queries are ``harness/handoff_checking.py``'s,
kept apart from the protocol.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import z3

from harness import handoff_checking as hc
from kernel import backward, barriers

MUTATIONS = {
    "one_barrier": "both owners share one ds_ready barrier (a warpgroup's arrive of step t "
                   "and its own wait of step t + 1 complete a generation together)",
    "one_buffer": "every step stages dS^T in the same buffer",
    "owner_skips_wait": "the owner arrives without waiting for the other's dS^T",
    "no_epilogue_sync": "dK overwrites the K tiles without the epilogue barrier",
}

# Program counters of a warpgroup.
WRITE, BARRIER, WAIT, READ, EPILOGUE, EPILOGUE_WAIT, DONE = range(7)
PC_NAMES = ("write", "barrier", "wait", "read", "epilogue", "epilogue wait", "done")


@dataclasses.dataclass(frozen=True)
class HandoffProtocol:
  """The facts the check depends on, read from the kernel."""

  buffers: int
  buffer_of: Callable
  owner_of: Callable
  barrier_of: Callable      # owner -> named barrier id
  units: int                # warpgroups whose arrival completes a generation
  period: int               # buffer_of and owner_of depend on t mod period only
  mutation: str | None = None

  @classmethod
  def from_kernel(cls, mutation: str | None = None) -> "HandoffProtocol":
    units = hc.units_of("ds_ready_wg0", mutation, MUTATIONS)
    if barriers.ds_ready_id(1) == barriers.ds_ready_id(0):
      raise ValueError("both owners' ds_ready barriers have one id")
    buffer_of, barrier_of = backward.ds_buffer, barriers.ds_ready_id
    if mutation == "one_buffer":
      buffer_of = lambda t: 0 * t
    if mutation == "one_barrier":
      barrier_of = lambda owner: barriers.ds_ready_id(0) + 0 * owner
    period = math.lcm(backward.DS_BUFFERS, barriers.COMPUTE_WARPGROUPS)
    for t in range(4 * period):  # what lets the model track t mod period alone
      if (buffer_of(t) != buffer_of(t % period)
          or backward.dq_owner(t) != backward.dq_owner(t % period)):
        raise ValueError(f"the fused dQ's schedule is not {period}-periodic at step {t}")
    return cls(backward.DS_BUFFERS, buffer_of, backward.dq_owner, barrier_of, units,
               period, mutation)


def _State(p: HandoffProtocol, tag: str, ids: tuple[int, ...]) -> hc.State:
  return hc.State(tag, p.buffers, ids)


def _ids(p: HandoffProtocol) -> tuple[int, ...]:
  return tuple(sorted({int(z3.simplify(z3.IntVal(0) + p.barrier_of(z3.IntVal(o))).as_long())
                       for o in range(barriers.COMPUTE_WARPGROUPS)}))


def _moves(p: HandoffProtocol, s: hc.State, n: int, w: int):
  """(name, guard, updates, bad) for warpgroup w's next action from s."""
  cw = barriers.COMPUTE_WARPGROUPS
  others = [v for v in range(cw) if v != w]
  # The schedule is read at t mod period (checked in from_kernel): keeps the
  # arithmetic linear.
  t, pc, phase = s.t[w], s.pc[w], s.phase[w]
  buf, owner = p.buffer_of(phase), p.owner_of(phase)
  bar = p.barrier_of(owner)
  reading = lambda v, b: z3.And(s.pc[v] == READ, p.buffer_of(s.phase[v]) == b)
  after_step = lambda: {"t": t + 1, "pc": z3.If(t + 1 >= n, EPILOGUE, WRITE),
                        "phase": z3.If(phase + 1 >= p.period, 0, phase + 1)}
  fresh = z3.And([hc.pick({b: s.data[b][v] for b in range(p.buffers)}, buf) == t
                  for v in range(cw)])
  moves = []
  # write: this step's dS^T into its buffer.
  moves.append(("write", pc == WRITE,
                {"data": [[z3.If(z3.And(buf == b, v == w), t, s.data[b][v])
                           for v in range(cw)] for b in range(p.buffers)], "pc": BARRIER},
                z3.Or([reading(v, buf) for v in others])))
  # barrier: arrive on ds_ready(owner); the owner also waits (unless mutated).
  completes, gen, new_count, new_gen = hc.arrive(s, bar, p.units)
  is_owner = owner == w
  waits = z3.And(is_owner, z3.BoolVal(p.mutation != "owner_skips_wait"))
  nxt = after_step()
  moves.append(("barrier", pc == BARRIER,
                {"count": new_count, "gen": new_gen, "need": gen,
                 "pc": z3.If(waits, z3.If(completes, READ, WAIT),
                             z3.If(is_owner, READ, nxt["pc"])),
                 "t": z3.If(is_owner, t, nxt["t"]),
                 "phase": z3.If(is_owner, phase, nxt["phase"])},
                # an owner that proceeds to read must find both tiles fresh
                z3.And(is_owner, z3.Or(z3.Not(waits), completes), z3.Not(fresh))))
  moves.append(("wait", z3.And(pc == WAIT, gen > s.need[w]), {"pc": READ},
                z3.Not(fresh)))
  moves.append(("read", pc == READ, after_step(), z3.BoolVal(False)))
  # epilogue: bar.sync (or nothing, mutated), then K is overwritten.
  k_read = z3.Or([s.pc[v] == READ for v in others])
  moves += hc.epilogue_moves(s, w, p.units, k_read, at=EPILOGUE, waiting=EPILOGUE_WAIT,
                             done=DONE, synced=p.mutation != "no_epilogue_sync")
  return moves


def _initial(p: HandoffProtocol, ids) -> tuple:
  return hc.initial(WRITE, p.buffers, ids)


HandoffResult = hc.Result


def reachable(p: HandoffProtocol, n: int):
  """Every state reachable with n steps (:func:`harness.handoff_checking.search`
  over the actions of :func:`_moves`); the warpgroups must stay within one
  step of each other."""
  ids = _ids(p)
  return hc.search(_State(p, "x", ids), lambda s, w: _moves(p, s, n, w), _initial(p, ids),
                   DONE, apart=1)


def check(p: HandoffProtocol, n: int) -> HandoffResult:
  """Every interleaving of n steps (all reachable states); a violation comes
  back with the shortest trace to it."""
  start = time.perf_counter()
  return hc.result_of(n, *reachable(p, n), PC_NAMES, start)


# The unbounded proof.  The invariant relates every counter and buffer to
# the two warpgroups' positions (step t_w, program counter pc_w):
#   * arrivals: warpgroup w has arrived at owner o's barrier once for every
#     step t' < t_w that o owns, plus once more if w owns t_w and has passed
#     its barrier action (pc wait or read); each barrier's completed
#     generations and pending count are what those arrivals make
#     (2 gen + count = both warpgroups' arrivals, count 0 or 1);
#   * a waiting owner waits for the generation of its own arrival; a warpgroup
#     waiting at the epilogue for generation 0; the epilogue barrier counts the
#     warpgroups past its arrival;
#   * buffer b holds, from warpgroup v, the last step t' = b (mod 2) that v
#     has written (-1 before any);
#   * the pair (t_1 - t_0, pc_0, pc_1, t_0 mod 2) is one of the shapes that
#     the exhaustive search meets for 1..SHAPE_STEPS steps.
# It is written for the kernel's schedule (buffer = owner = t mod 2, one
# barrier per owner), which prove() checks first.  z3 then shows, for any
# number of steps n >= 1: the initial state satisfies it; every action keeps
# it; no action from a state satisfying it is unsafe; the warpgroups stay
# within one step; some action is enabled until both are done.

SHAPE_STEPS = 6


def _shapes(p: HandoffProtocol) -> set[tuple[int, int, int, int]]:
  return hc.shapes(lambda n: reachable(p, n),
                   lambda t, phase, pc: (phase[0], t[1] - t[0], pc[0], pc[1]), SHAPE_STEPS)


def _invariant(p: HandoffProtocol, s: hc.State, n, shapes) -> list[tuple[str, z3.BoolRef]]:
  cw = barriers.COMPUTE_WARPGROUPS
  inv = [("n >= 1", n >= 1)]
  for w in range(cw):
    t, ph, pc = s.t[w], s.phase[w], s.pc[w]
    inv += [(f"wg{w} step range", z3.And(0 <= t, t <= n)),
            (f"wg{w} phase = t mod 2", z3.And(z3.Or(ph == 0, ph == 1), (t - ph) % 2 == 0)),
            (f"wg{w} pc range", z3.And(WRITE <= pc, pc <= DONE)),
            (f"wg{w} in the loop iff t < n", (pc <= READ) == (t < n))]
  inv.append(("shape", z3.Or([z3.And(s.phase[0] == a, s.t[1] - s.t[0] == d, s.pc[0] == c0,
                                     s.pc[1] == c1) for a, d, c0, c1 in sorted(shapes)])))

  def arrivals(w, o):
    t, ph, pc = s.t[w], s.phase[w], s.pc[w]
    owned_before = (t + ph) / 2 if o == 0 else (t - ph) / 2   # steps t' < t with t' % 2 == o
    passed = z3.And(z3.Or(pc == WAIT, pc == READ), ph == o)
    return owned_before + z3.If(passed, 1, 0)

  for o in range(cw):
    x = p.barrier_of(o)
    total = sum(arrivals(w, o) for w in range(cw))
    inv.append((f"barrier of owner {o}: generations and count",
                z3.And(2 * s.gen[x] + s.count[x] == total,
                       z3.Or(s.count[x] == 0, s.count[x] == 1))))
  past_epilogue = sum(z3.If(z3.Or(s.pc[w] == EPILOGUE_WAIT, s.pc[w] == DONE), 1, 0)
                      for w in range(cw))
  inv.append(("epilogue barrier", z3.And(2 * s.egen + s.ecount == past_epilogue,
                                         z3.Or(s.ecount == 0, s.ecount == 1))))
  for w in range(cw):
    inv.append((f"wg{w} waits for its own generation",
                # (a waiting warpgroup owns its step: its phase is w)
                z3.Implies(s.pc[w] == WAIT, s.need[w] == arrivals(w, w) - 1)))
    inv.append((f"wg{w} waits at the epilogue for generation 0",
                z3.Implies(s.pc[w] == EPILOGUE_WAIT, s.need[w] == 0)))
    written = s.t[w] - 1 + z3.If(z3.And(BARRIER <= s.pc[w], s.pc[w] <= READ), 1, 0)
    for b in range(p.buffers):
      last = z3.If(written < 0, -1, z3.If(written % 2 == b, written, written - 1))
      inv.append((f"buffer {b} holds wg{w}'s last step = {b} mod 2", s.data[b][w] == last))
  return inv


def prove(p: HandoffProtocol | None = None) -> HandoffResult:
  """The handoff is safe and deadlock-free for any number of steps (the
  inductive invariant above, checked by z3)."""
  start = time.perf_counter()
  p = p or HandoffProtocol.from_kernel()
  cw = barriers.COMPUTE_WARPGROUPS
  failures = []
  schedule = ([p.buffer_of(t) for t in range(4)], [p.owner_of(t) for t in range(4)])
  if schedule != ([0, 1, 0, 1], [0, 1, 0, 1]) or p.units != cw:
    failures.append(f"the invariant is written for buffer = owner = t mod 2 with "
                    f"{cw} warpgroups per generation; got {schedule}, {p.units}")
    return HandoffResult(None, False, None, time.perf_counter() - start, failures=tuple(failures))
  ids = _ids(p)
  if len(ids) != cw:
    failures.append(f"one barrier per owner expected, got ids {ids}")
    return HandoffResult(None, False, None, time.perf_counter() - start, failures=tuple(failures))
  try:
    shapes = _shapes(p)
  except ValueError as err:
    return HandoffResult(None, False, None, time.perf_counter() - start, failures=(str(err),))
  n = z3.Int("n")
  s, s2 = _State(p, "a", ids), _State(p, "b", ids)
  init = [x == v for x, v in zip(s.flat(), _initial(p, ids))] + [n >= 1]
  within = z3.And([z3.And(s.t[a] - s.t[b] <= 1, s.t[b] - s.t[a] <= 1)
                   for a in range(cw) for b in range(cw)])
  failures += hc.check_inductive(lambda st: _invariant(p, st, n, shapes),
                                 lambda st, w: _moves(p, st, n, w), s, s2, init, DONE,
                                 extra=(("within one step", within),))
  return HandoffResult(None, not failures, None, time.perf_counter() - start,
                       failures=tuple(failures))
