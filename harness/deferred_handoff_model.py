"""Z3 model of the deferred fused dQ's handoff (``kernel/backward.py``,
``dq_schedule="deferred"``, private until measured on the H200).

The shipped fused dQ (``harness/handoff_model.py``) puts the step's product
on the other warpgroup's critical path.  The deferred schedule moves each
step's product one step later.  Warpgroup w, step t of n (t = 0 .. n-1):

* ``sync`` (t >= 1): ``bar.sync`` on ``dq_step_id(w, t - 1)``: the other
  warpgroup finished step t - 1 (its dS^T of t - 1 staged, its product of
  step t - 2 done reading);
* ``write``: store its dS^T of step t into buffer ``ds_buffer(t)``;
* ``read`` (only the owner of step t - 1, t >= 1): the product of step t - 1
  reads both halves of buffer ``ds_buffer(t - 1)`` until it completes;
* ``signal``: ``bar.arrive`` on ``dq_step_id(1 - w, t)`` (step t finished);
* after the loop (n >= 1): ``bar.sync`` on ``dq_step_id(w, n - 1)``, the
  owner of step n - 1 forms its product, then both meet at the epilogue
  barrier, after which K (the products' operand) is overwritten with dK.

Schedule and barrier ids are the kernel's (``backward.ds_buffer``,
``backward.dq_owner``, ``barriers.dq_step_id``), evaluated on Z3 integers.
Named-barrier rule as in the other models: a generation completes when 2
warpgroups' worth of threads arrived; surplus arrivals count toward the next.

Safety: no write into a buffer a product is reading; every product finds
both halves of its buffer holding its own step; K is not overwritten while a
product reads it.  Liveness: some action is enabled until both are done.

* :func:`check`: every reachable state for n steps (breadth-first search),
  with the shortest trace to a violation.
* :func:`prove`: any n, by an inductive invariant (the positions' shapes from
  the search up to :data:`SHAPE_STEPS` steps, and every barrier's arrivals
  and every buffer's contents as functions of the positions), checked by Z3.

:data:`MUTATIONS` are defects both must refute; ``one_barrier_per_warpgroup``
is the variant that hung on the H200 in session 4.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import z3

from harness import handoff_checking as hc
from kernel import backward, barriers

MUTATIONS = {
    "one_barrier_per_warpgroup": "dq_step_id ignores the step's parity (what hung on the H200)",
    "one_buffer": "every step stages dS^T in the same buffer",
    "signal_before_product": "the owner signals before its product has read the buffer",
    "no_final_sync": "the owner of the last step forms its product without waiting",
    "no_epilogue_sync": "dK overwrites the K tiles without the epilogue barrier",
}

(SYNC, SYNC_WAIT, WRITE, READ, SIGNAL, FSYNC, FSYNC_WAIT, FREAD, EPI, EPI_WAIT,
 DONE) = range(11)
PC_NAMES = ("sync", "sync wait", "write", "read", "signal", "final sync", "final sync wait",
            "final read", "epilogue", "epilogue wait", "done")
CW = hc.CW
SHAPE_STEPS = 6


@dataclasses.dataclass(frozen=True)
class Protocol:
  buffer_of: Callable       # step -> buffer
  owner_of: Callable        # step -> warpgroup
  barrier_of: Callable      # (warpgroup, step) -> named barrier id
  units: int                # warpgroups whose arrivals complete a generation
  mutation: str | None = None

  @classmethod
  def from_kernel(cls, mutation: str | None = None) -> "Protocol":
    units = hc.units_of("dq_step_wg0_even", mutation, MUTATIONS)
    buffer_of, barrier_of = backward.ds_buffer, barriers.dq_step_id
    if mutation == "one_buffer":
      buffer_of = lambda t: 0 * t
    if mutation == "one_barrier_per_warpgroup":
      barrier_of = lambda w, t: barriers.dq_step_id(w, 0 * t)
    for t in range(8):  # the model reads the schedule at t mod 2 only
      if (buffer_of(t) != buffer_of(t % 2) or backward.dq_owner(t) != backward.dq_owner(t % 2)
          or any(barrier_of(w, t) != barrier_of(w, t % 2) for w in range(CW))):
        raise ValueError(f"the deferred dQ's schedule is not 2-periodic at step {t}")
    return cls(buffer_of, backward.dq_owner, barrier_of, units, mutation)

  def ids(self) -> tuple[int, ...]:
    return tuple(sorted({int(self.barrier_of(w, t)) for w in range(CW) for t in (0, 1)}))


def _State(p: Protocol, tag: str) -> hc.State:
  return hc.State(tag, 2, p.ids())


def _moves(p: Protocol, s: hc.State, n, w: int):
  """(name, guard, updates, bad) of warpgroup w's actions from s."""
  o = 1 - w
  t, pc, ph = s.t[w], s.pc[w], s.phase[w]
  prev = 1 - ph                                  # (t - 1) mod 2, for t >= 1
  buf_prev, buf = p.buffer_of(prev), p.buffer_of(ph)
  owns_prev = p.owner_of(prev) == w
  product = z3.And(t >= 1, owns_prev)            # this step forms step t - 1's part
  early = p.mutation == "signal_before_product"

  def reading(v, b):
    """Warpgroup v's product reads buffer b (its step is t_v - 1)."""
    return z3.And(z3.Or(s.pc[v] == READ, s.pc[v] == FREAD), p.buffer_of(1 - s.phase[v]) == b)

  def fresh(data, b, step):
    return z3.And([hc.pick({x: data[x][v] for x in range(2)}, b) == step for v in range(CW)])

  arrive = lambda bar: hc.arrive(s, bar, p.units)

  advance = {"t": t + 1, "phase": 1 - ph, "pc": z3.If(t + 1 >= n, FSYNC, SYNC)}
  moves = []
  # sync: the other warpgroup finished step t - 1
  wait_bar = p.barrier_of(w, prev)
  done, gen, cnt, gns = arrive(wait_bar)
  moves.append(("sync", pc == SYNC, {"count": cnt, "gen": gns, "need": gen,
                                     "pc": z3.If(done, WRITE, SYNC_WAIT)}, z3.BoolVal(False)))
  moves.append(("sync wait", z3.And(pc == SYNC_WAIT, hc.pick(s.gen, wait_bar) > s.need[w]),
                {"pc": WRITE}, z3.BoolVal(False)))
  # write this step's dS^T; the owner of step t - 1 then issues its product
  data = [[z3.If(z3.And(buf == b, v == w), t, s.data[b][v]) for v in range(CW)]
          for b in range(2)]
  reads_next = z3.And(product, z3.BoolVal(not early))
  moves.append(("write", pc == WRITE, {"data": data, "pc": z3.If(reads_next, READ, SIGNAL)},
                z3.Or(reading(o, buf),
                      z3.And(reads_next, z3.Not(fresh(data, buf_prev, t - 1))))))
  # signal: step t finished (mutated: before the product is issued)
  done, _, cnt, gns = arrive(p.barrier_of(o, ph))
  if early:
    moves.append(("signal", pc == SIGNAL,
                  {"count": cnt, "gen": gns,
                   **{k: z3.If(product, v_, advance[k]) for k, v_ in
                      (("t", t), ("phase", ph), ("pc", READ))}},
                  z3.And(product, z3.Not(fresh(s.data, buf_prev, t - 1)))))
    moves.append(("read", pc == READ, advance, z3.BoolVal(False)))
  else:
    moves.append(("signal", pc == SIGNAL, {"count": cnt, "gen": gns, **advance},
                  z3.BoolVal(False)))
    moves.append(("read", pc == READ, {"pc": SIGNAL}, z3.BoolVal(False)))
  # after the loop (t == n): wait for the other's last step; its owner's product
  after = z3.If(owns_prev, FREAD, EPI)
  stale_final = z3.And(owns_prev, z3.Not(fresh(s.data, buf_prev, t - 1)))
  if p.mutation == "no_final_sync":
    moves.append(("final sync", pc == FSYNC, {"pc": after}, stale_final))
  else:
    done, gen, cnt, gns = arrive(wait_bar)
    moves.append(("final sync", pc == FSYNC,
                  {"count": cnt, "gen": gns, "need": gen,
                   "pc": z3.If(done, after, FSYNC_WAIT)}, z3.And(done, stale_final)))
    moves.append(("final sync wait",
                  z3.And(pc == FSYNC_WAIT, hc.pick(s.gen, wait_bar) > s.need[w]),
                  {"pc": after}, stale_final))
  moves.append(("final read", pc == FREAD, {"pc": EPI}, z3.BoolVal(False)))
  # epilogue: bar.sync (or nothing, mutated), then K is overwritten
  k_read = z3.Or(s.pc[o] == READ, s.pc[o] == FREAD)
  moves += hc.epilogue_moves(s, w, p.units, k_read, at=EPI, waiting=EPI_WAIT, done=DONE,
                             synced=p.mutation != "no_epilogue_sync")
  return moves


def _initial(p: Protocol, n) -> tuple:
  """Both warpgroups at step 0's write (no sync before the first step); an
  empty walk (n = 0) goes straight to the epilogue (the kernel skips the
  final sync when there are no steps)."""
  start = WRITE if not isinstance(n, int) or n >= 1 else EPI
  return hc.initial(start, 2, p.ids())


Result = hc.Result


def reachable(p: Protocol, n: int):
  """Every state reachable with n steps (:func:`harness.handoff_checking.search`)."""
  return hc.search(_State(p, "x"), lambda s, w: _moves(p, s, n, w), _initial(p, n), DONE)


def check(p: Protocol, n: int) -> Result:
  """Every interleaving of n steps; a violation comes back with the shortest
  trace to it."""
  start = time.perf_counter()
  return hc.result_of(n, *reachable(p, n), PC_NAMES, start)


# The unbounded proof.  The invariant, for n >= 1 steps (n = 0, the kernel's
# empty walk, is the bounded check's):
#   * positions: 0 <= t_w <= n, ph_w = t_w mod 2, the loop's program points
#     iff t_w < n;
#   * the pair (t_0 mod 2, t_1 - t_0, pc_0, pc_1, t_0 = 0, t_1 = 0) is one the
#     exhaustive search meets for 1 .. SHAPE_STEPS steps;
#   * every barrier's completed generations and pending count are what the
#     arrivals the positions imply make: warpgroup w's syncs on
#     dq_step_id(w, p) (one per step t >= 1 with t - 1 = p mod 2, and the
#     final one), the other's signals on it (one per finished step of
#     parity p); a waiting warpgroup waits for the generation of its own
#     arrival;
#   * buffer b holds, from warpgroup v, the last step = b (mod 2) v wrote.
# Z3 then shows: the initial state satisfies it, every action keeps it, no
# action from it is unsafe, and some action is enabled until both are done.


def _parity_count(m, ph_m, par):
  """How many s in [0, m) have s = par (mod 2), given ph_m = m mod 2."""
  return (m + ph_m) / 2 if par == 0 else (m - ph_m) / 2


def _shapes(p: Protocol) -> set[tuple]:
  return hc.shapes(lambda n: reachable(p, n),
                   lambda t, phase, pc: (phase[0], t[1] - t[0], pc[0], pc[1], t[0] == 0,
                                         t[1] == 0), SHAPE_STEPS)


def _invariant(p: Protocol, s: hc.State, n, shapes) -> list[tuple[str, z3.BoolRef]]:
  inv = [("n >= 1", n >= 1)]
  loop_pcs = (SYNC, SYNC_WAIT, WRITE, READ, SIGNAL)
  for w in range(CW):
    t, ph, pc = s.t[w], s.phase[w], s.pc[w]
    inv += [(f"wg{w} step range", z3.And(0 <= t, t <= n)),
            (f"wg{w} phase = t mod 2", z3.And(z3.Or(ph == 0, ph == 1), (t - ph) % 2 == 0)),
            (f"wg{w} pc range", z3.And(SYNC <= pc, pc <= DONE)),
            (f"wg{w} in the loop iff t < n", z3.Or([pc == x for x in loop_pcs]) == (t < n))]
  inv.append(("shape", z3.Or([
      z3.And(s.phase[0] == a, s.t[1] - s.t[0] == d, s.pc[0] == c0, s.pc[1] == c1,
             (s.t[0] == 0) == z0, (s.t[1] == 0) == z1)
      for a, d, c0, c1, z0, z1 in sorted(shapes)])))

  def at(w, *pcs):
    return z3.Or([s.pc[w] == x for x in pcs])

  def syncs(w, par):
    """w's arrivals on dq_step_id(w, par): steps t' in [1, t_w) whose t' - 1
    has parity par, its current step's once past the sync, the final one."""
    t, ph = s.t[w], s.phase[w]
    done = z3.If(t >= 1, _parity_count(t - 1, 1 - ph, par), 0)
    current = z3.And(t >= 1, t < n, 1 - ph == par, at(w, SYNC_WAIT, WRITE, READ, SIGNAL))
    final = z3.And(t == n, 1 - ph == par, at(w, FSYNC_WAIT, FREAD, EPI, EPI_WAIT, DONE))
    return done + z3.If(current, 1, 0) + z3.If(final, 1, 0)

  def signals(v, par):
    """v's arrivals when it finished steps s < t_v of parity par."""
    return _parity_count(s.t[v], s.phase[v], par)

  for w in range(CW):
    for par in (0, 1):
      x = p.barrier_of(w, par)
      total = syncs(w, par) + signals(1 - w, par)
      inv.append((f"dq_step_id({w}, {par}): generations and count",
                  z3.And(2 * s.gen[x] + s.count[x] == total,
                         z3.Or(s.count[x] == 0, s.count[x] == 1))))
    waiting_bar = 1 - s.phase[w]
    inv.append((f"wg{w} waits for the generation of its own arrival",
                z3.Implies(at(w, SYNC_WAIT, FSYNC_WAIT),
                           s.need[w] == z3.If(waiting_bar == 0, syncs(w, 0),
                                              syncs(w, 1)) - 1)))
    inv.append((f"wg{w} waits at the epilogue for generation 0",
                z3.Implies(at(w, EPI_WAIT), s.need[w] == 0)))
    written = s.t[w] - 1 + z3.If(at(w, READ, SIGNAL), 1, 0)
    for b in range(2):
      last = z3.If(written < 0, -1, z3.If(written % 2 == b, written, written - 1))
      inv.append((f"buffer {b} holds wg{w}'s last step = {b} mod 2", s.data[b][w] == last))
  past = sum(z3.If(at(w, EPI_WAIT, DONE), 1, 0) for w in range(CW))
  inv.append(("epilogue barrier", z3.And(2 * s.egen + s.ecount == past,
                                         z3.Or(s.ecount == 0, s.ecount == 1))))
  return inv


def prove(p: Protocol | None = None) -> Result:
  """The deferred handoff is safe and deadlock-free for any number of steps."""
  start = time.perf_counter()
  p = p or Protocol.from_kernel()
  failures: list[str] = []
  schedule = ([p.buffer_of(t) for t in range(4)], [p.owner_of(t) for t in range(4)])
  if schedule != ([0, 1, 0, 1], [0, 1, 0, 1]) or p.units != CW or len(p.ids()) != 2 * CW:
    failures.append(f"the invariant is written for buffer = owner = t mod 2 and one barrier "
                    f"per warpgroup and parity; got {schedule}, ids {p.ids()}")
    return Result(None, False, None, time.perf_counter() - start, failures=tuple(failures))
  try:
    shapes = _shapes(p)
  except ValueError as err:
    return Result(None, False, None, time.perf_counter() - start, failures=(str(err),))
  n = z3.Int("n")
  s, s2 = _State(p, "a"), _State(p, "b")
  init = [x == v for x, v in zip(s.flat(), _initial(p, n))] + [n >= 1]
  failures += hc.check_inductive(lambda st: _invariant(p, st, n, shapes),
                                 lambda st, w: _moves(p, st, n, w), s, s2, init, DONE)
  return Result(None, not failures, None, time.perf_counter() - start,
                failures=tuple(failures))
