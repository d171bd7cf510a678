"""Z3 model of the fused dQ's dS^T handoff (``kernel/backward.py``).

In the dK/dV kernel with the fused dQ, the two compute warpgroups walk the
same steps t = 0 .. n-1.  At step t each stores its dS^T tile into staging
buffer ``ds_buffer(t)``; the step's owner ``dq_owner(t)`` then waits on the
named barrier ``ds_ready_id(owner)`` (``bar.sync``) while the other only
arrives there (``bar.arrive``), and the owner reads both tiles of the buffer
with its dQ product (a wgmma reading shared memory until it completes).
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

The check is bounded model checking with Z3 (:func:`check`): for a number
of steps n, every interleaving of at most :func:`max_actions` actions — the
longest a run of n steps can take, so every reachable state — is searched
for a violation or a deadlock.  Why small n suffice: buffer and owner depend
on t mod 2 only and the warpgroups stay within one step of each other, so a
state at step t >= 2 behaves like its image two steps earlier; the end of
the loop is reached at both parities by n in 1..6.  :data:`MUTATIONS` are
defects the check must refute (properties/test_handoff_proof.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import z3

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
    if mutation is not None and mutation not in MUTATIONS:
      raise ValueError(f"unknown mutation {mutation!r}")
    ready = barriers.BY_NAME["ds_ready_wg0"]
    epilogue = barriers.BY_NAME["epilogue"]
    units = ready.num_threads // barriers.WARPGROUP_THREADS
    if epilogue.num_threads != ready.num_threads:
      raise ValueError("ds_ready and epilogue barriers count different threads")
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


class _State:
  def __init__(self, p: HandoffProtocol, tag: str, ids: tuple[int, ...]):
    I = z3.Int
    cw = barriers.COMPUTE_WARPGROUPS
    self.t = [I(f"t{w}_{tag}") for w in range(cw)]
    self.phase = [I(f"phase{w}_{tag}") for w in range(cw)]   # t mod period (ghost)
    self.pc = [I(f"pc{w}_{tag}") for w in range(cw)]
    self.need = [I(f"need{w}_{tag}") for w in range(cw)]   # generation a waiter needs
    self.data = [[I(f"data{b}_{w}_{tag}") for w in range(cw)] for b in range(p.buffers)]
    self.count = {x: I(f"count{x}_{tag}") for x in ids}
    self.gen = {x: I(f"gen{x}_{tag}") for x in ids}
    self.ecount, self.egen = I(f"ecount_{tag}"), I(f"egen_{tag}")

  def flat(self) -> list:
    out = self.t + self.phase + self.pc + self.need + [v for row in self.data for v in row]
    out += [self.count[x] for x in sorted(self.count)] + [self.gen[x] for x in sorted(self.gen)]
    return out + [self.ecount, self.egen]


def _ids(p: HandoffProtocol) -> tuple[int, ...]:
  return tuple(sorted({int(z3.simplify(z3.IntVal(0) + p.barrier_of(z3.IntVal(o))).as_long())
                       for o in range(barriers.COMPUTE_WARPGROUPS)}))


def _pick(options: dict, key):
  """options[key] for a symbolic key with values in options."""
  items = sorted(options.items())
  out = items[-1][1]
  for k, v in reversed(items[:-1]):
    out = z3.If(key == k, v, out)
  return out


def _moves(p: HandoffProtocol, s: _State, n: int, w: int):
  """(name, guard, updates, bad) for warpgroup w's next action from s."""
  cw = barriers.COMPUTE_WARPGROUPS
  others = [v for v in range(cw) if v != w]
  # The schedule is read at t mod period (checked in from_kernel): keeps the
  # arithmetic linear.
  t, pc, phase = s.t[w], s.pc[w], s.phase[w]
  buf, owner = p.buffer_of(phase), p.owner_of(phase)
  ids = tuple(sorted(s.count))
  bar = p.barrier_of(owner)
  reading = lambda v, b: z3.And(s.pc[v] == READ, p.buffer_of(s.phase[v]) == b)
  after_step = lambda: {"t": t + 1, "pc": z3.If(t + 1 >= n, EPILOGUE, WRITE),
                        "phase": z3.If(phase + 1 >= p.period, 0, phase + 1)}
  fresh = z3.And([_pick({b: s.data[b][v] for b in range(p.buffers)}, buf) == t
                  for v in range(cw)])
  moves = []
  # write: this step's dS^T into its buffer.
  moves.append(("write", pc == WRITE,
                {"data": [[z3.If(z3.And(buf == b, v == w), t, s.data[b][v])
                           for v in range(cw)] for b in range(p.buffers)], "pc": BARRIER},
                z3.Or([reading(v, buf) for v in others])))
  # barrier: arrive on ds_ready(owner); the owner also waits (unless mutated).
  count = _pick({x: s.count[x] for x in ids}, bar)
  gen = _pick({x: s.gen[x] for x in ids}, bar)
  completes = count + 1 >= p.units
  new_count = {x: z3.If(bar == x, z3.If(completes, 0, count + 1), s.count[x]) for x in ids}
  new_gen = {x: z3.If(z3.And(bar == x, completes), s.gen[x] + 1, s.gen[x]) for x in ids}
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
  ecompletes = s.ecount + 1 >= p.units
  if p.mutation == "no_epilogue_sync":
    moves.append(("epilogue", pc == EPILOGUE, {"pc": DONE}, k_read))
  else:
    moves.append(("epilogue", pc == EPILOGUE,
                  {"ecount": z3.If(ecompletes, 0, s.ecount + 1),
                   "egen": z3.If(ecompletes, s.egen + 1, s.egen), "need": s.egen,
                   "pc": z3.If(ecompletes, DONE, EPILOGUE_WAIT)},
                  z3.And(ecompletes, k_read)))
    moves.append(("epilogue wait", z3.And(pc == EPILOGUE_WAIT, s.egen > s.need[w]),
                  {"pc": DONE}, k_read))
  return moves


def _apply(s: _State, s2: _State, w: int, upd: dict) -> list:
  cw = barriers.COMPUTE_WARPGROUPS
  eqs = []
  for v in range(cw):
    for name in ("t", "phase", "pc", "need"):
      new = upd[name] if (name in upd and v == w) else getattr(s, name)[v]
      eqs.append(getattr(s2, name)[v] == new)
  data = upd.get("data", s.data)
  eqs += [s2.data[b][v] == data[b][v] for b in range(len(s.data)) for v in range(cw)]
  for x in s.count:
    eqs.append(s2.count[x] == upd.get("count", s.count)[x])
    eqs.append(s2.gen[x] == upd.get("gen", s.gen)[x])
  eqs.append(s2.ecount == upd.get("ecount", s.ecount))
  eqs.append(s2.egen == upd.get("egen", s.egen))
  return eqs


def max_actions(n: int) -> int:
  """The longest run of n steps: per warpgroup and step at most write,
  barrier, wait and read; then two epilogue actions."""
  return barriers.COMPUTE_WARPGROUPS * (4 * n + 2)


@dataclasses.dataclass
class HandoffResult:
  n: int
  safe: bool
  trace: list[str] | None      # the counterexample, when not safe
  seconds: float


def check(p: HandoffProtocol, n: int) -> HandoffResult:
  """Bounded model check of n steps over every interleaving (see the module
  doc); returns the shortest-found counterexample trace when one exists."""
  start = time.perf_counter()
  cw = barriers.COMPUTE_WARPGROUPS
  ids = _ids(p)
  depth = max_actions(n)
  states = [_State(p, str(i), ids) for i in range(depth + 1)]
  s0 = states[0]
  solver = z3.Solver()
  solver.add(*[x == 0 for x in s0.t + s0.phase], *[x == (WRITE if n > 0 else EPILOGUE) for x in s0.pc],
             *[x == 0 for x in s0.need], *[v == -1 for row in s0.data for v in row],
             *[s0.count[x] == 0 for x in ids], *[s0.gen[x] == 0 for x in ids],
             s0.ecount == 0, s0.egen == 0)
  choice = [z3.Int(f"choice_{i}") for i in range(depth)]
  bad_at = []
  for i in range(depth):
    s, s2 = states[i], states[i + 1]
    options, guards, bads = [], [], []
    k = 0
    for w in range(cw):
      for name, guard, upd, bad in _moves(p, s, n, w):
        options.append(z3.And(choice[i] == k, guard, *_apply(s, s2, w, upd)))
        guards.append(guard)
        bads.append(z3.And(choice[i] == k, guard, bad))
        k += 1
    # Stutter once nothing is enabled (done, or deadlocked: checked at the end).
    stuck = z3.Not(z3.Or(guards))
    options.append(z3.And(choice[i] == -1, stuck, *[a == b for a, b in zip(s2.flat(), s.flat())]))
    solver.add(z3.Or(options))
    apart = z3.Or([z3.Or(s.t[a] - s.t[b] > 1, s.t[b] - s.t[a] > 1)
                   for a in range(cw) for b in range(a + 1, cw)])
    bad_at.append(z3.Or(z3.Or(bads), apart))
  last = states[-1]
  done = z3.And([x == DONE for x in last.pc])
  solver.add(z3.Or(z3.Or(bad_at), z3.Not(done)))
  if solver.check() == z3.unsat:
    return HandoffResult(n, True, None, time.perf_counter() - start)
  model = solver.model()
  names = [f"wg{w} {name}" for w in range(cw) for name, *_ in _moves(p, s0, n, w)]
  trace = []
  for i in range(depth):
    c = model.eval(choice[i], model_completion=True).as_long()
    if model.eval(bad_at[i], model_completion=True):
      trace.append(f"UNSAFE: {names[c] if c >= 0 else 'stutter'} at step "
                   f"{[model.eval(x).as_long() for x in states[i].t]}")
      break
    if c < 0:
      pcs = [PC_NAMES[model.eval(x).as_long()] for x in states[i].pc]
      trace.append(f"DEADLOCK: warpgroups at {pcs}")
      break
    trace.append(names[c])
  return HandoffResult(n, False, trace, time.perf_counter() - start)


STEP_COUNTS = tuple(range(1, 7))


def check_all(p: HandoffProtocol | None = None, step_counts=STEP_COUNTS) -> list[HandoffResult]:
  p = p or HandoffProtocol.from_kernel()
  return [check(p, n) for n in step_counts]
