"""The machinery under the Z3 model of the fused dQ's handoff between the
compute warpgroups (``harness/handoff_model.py`` holds the protocol): the
state layout, the named-barrier and epilogue actions, the exhaustive search
and the inductive check.  (A deferred schedule was also modelled with it; the
H200 measured it slower and it was removed on 2026-11-30.)

A model is a :class:`State` (per warpgroup: step ``t``, its ghost ``phase``
= t mod 2, program counter ``pc``, the generation ``need`` it waits for;
per buffer and warpgroup: the step whose tile it holds; per named barrier:
pending ``count`` and completed ``gen``; the epilogue barrier's) and a
function ``moves(s, w)`` giving warpgroup w's actions as (name, guard,
updates, bad) Z3 expressions: one definition that the search evaluates on
concrete values and the proof reasons about symbolically.

Named-barrier rule (as in ``harness/protocol_model.py``): a generation
completes when ``units`` warpgroups' threads have arrived (128 each);
surplus arrivals count toward the next generation; ``bar.sync`` returns once
the generation of its own arrival completed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import z3

from kernel import barriers

CW = barriers.COMPUTE_WARPGROUPS


def units_of(barrier_name: str, mutation: str | None, mutations: dict) -> int:
  """Warpgroups whose arrivals complete a generation of the named barrier
  (the epilogue barrier must count the same threads); refuses a mutation a
  model does not define."""
  if mutation is not None and mutation not in mutations:
    raise ValueError(f"unknown mutation {mutation!r}")
  bar = barriers.BY_NAME[barrier_name]
  if barriers.BY_NAME["epilogue"].num_threads != bar.num_threads:
    raise ValueError(f"{barrier_name} and the epilogue barrier count different threads")
  return bar.num_threads // barriers.WARPGROUP_THREADS


class State:
  def __init__(self, tag: str, buffers: int, ids: tuple[int, ...]):
    I = z3.Int
    self.t = [I(f"t{w}_{tag}") for w in range(CW)]
    self.phase = [I(f"phase{w}_{tag}") for w in range(CW)]   # t mod 2 (ghost)
    self.pc = [I(f"pc{w}_{tag}") for w in range(CW)]
    self.need = [I(f"need{w}_{tag}") for w in range(CW)]    # generation a waiter needs
    self.data = [[I(f"data{b}_{w}_{tag}") for w in range(CW)] for b in range(buffers)]
    self.count = {x: I(f"count{x}_{tag}") for x in ids}
    self.gen = {x: I(f"gen{x}_{tag}") for x in ids}
    self.ecount, self.egen = I(f"ecount_{tag}"), I(f"egen_{tag}")

  def flat(self) -> list:
    out = self.t + self.phase + self.pc + self.need + [v for row in self.data for v in row]
    out += [self.count[x] for x in sorted(self.count)] + [self.gen[x] for x in sorted(self.gen)]
    return out + [self.ecount, self.egen]

  def post(self, w: int, upd: dict) -> list:
    """The state after warpgroup w's action with updates ``upd``, in
    :meth:`flat` order."""
    out = [upd[name] if (name in upd and v == w) else getattr(self, name)[v]
           for name in ("t", "phase", "pc", "need") for v in range(CW)]
    data = upd.get("data", self.data)
    out += [data[b][v] for b in range(len(self.data)) for v in range(CW)]
    out += [upd.get("count", self.count)[x] for x in sorted(self.count)]
    out += [upd.get("gen", self.gen)[x] for x in sorted(self.gen)]
    return out + [upd.get("ecount", self.ecount), upd.get("egen", self.egen)]


def initial(start_pc: int, buffers: int, ids) -> tuple:
  """Both warpgroups at step 0 and ``start_pc``, buffers empty (-1)."""
  return tuple([0] * CW + [0] * CW + [start_pc] * CW + [0] * CW + [-1] * (buffers * CW)
               + [0] * (2 * len(ids)) + [0, 0])


def pick(options: dict, key):
  """options[key] for a symbolic key with values in options."""
  items = sorted(options.items())
  out = items[-1][1]
  for k, v in reversed(items[:-1]):
    out = z3.If(key == k, v, out)
  return out


def arrive(s: State, bar, units: int):
  """One warpgroup's arrival on named barrier ``bar`` (symbolic id): returns
  (completes, the generation it joins, new counts, new generations)."""
  ids = tuple(sorted(s.count))
  count, gen = pick(s.count, bar), pick(s.gen, bar)
  completes = count + 1 >= units
  return (completes, gen,
          {x: z3.If(bar == x, z3.If(completes, 0, count + 1), s.count[x]) for x in ids},
          {x: z3.If(z3.And(bar == x, completes), s.gen[x] + 1, s.gen[x]) for x in ids})


def epilogue_moves(s: State, w: int, units: int, k_read, *, at: int, waiting: int, done: int,
                   synced: bool = True) -> list:
  """``bar.sync`` on the epilogue barrier from pc ``at``, after which the K
  tiles are overwritten with dK: unsafe while the other warpgroup's product
  (``k_read``) reads them.  ``synced=False``: the defect without the sync."""
  pc = s.pc[w]
  if not synced:
    return [("epilogue", pc == at, {"pc": done}, k_read)]
  completes = s.ecount + 1 >= units
  return [("epilogue", pc == at,
           {"ecount": z3.If(completes, 0, s.ecount + 1),
            "egen": z3.If(completes, s.egen + 1, s.egen), "need": s.egen,
            "pc": z3.If(completes, done, waiting)},
           z3.And(completes, k_read)),
          ("epilogue wait", z3.And(pc == waiting, s.egen > s.need[w]), {"pc": done}, k_read)]


@dataclasses.dataclass
class Result:
  n: int | None               # steps (None: any number, the unbounded proof)
  safe: bool
  trace: list[str] | None     # the counterexample, when not safe
  seconds: float
  states: int = 0             # reachable states searched (bounded check)
  failures: tuple[str, ...] = ()   # the unbounded proof's failed queries


def search(s: State, moves: Callable, start: tuple, done_pc: int, apart: int | None = None):
  """Every state reachable from ``start`` by breadth-first search over
  ``moves(s, w)`` (evaluated by Z3 on concrete values).  Returns (parent,
  violation): parent maps every state reached to (previous state, action
  name), None for the start; violation is None or (state, action name,
  kind): an unsafe action, a deadlock (no action enabled short of every
  warpgroup at ``done_pc``) or, with ``apart``, warpgroups more than
  ``apart`` steps apart."""
  flat = s.flat()
  acts = [(f"wg{w} {name}", guard, bad, s.post(w, upd))
          for w in range(CW) for name, guard, upd, bad in moves(s, w)]
  value = lambda e, sub: (z3.simplify(z3.substitute(e, sub)) if z3.is_expr(e)
                          else z3.IntVal(e))
  parent, frontier = {start: None}, [start]
  while frontier:
    nxt = []
    for st in frontier:
      sub = [(v, z3.IntVal(x)) for v, x in zip(flat, st)]
      t = st[:CW]
      if apart is not None and max(t) - min(t) > apart:
        return parent, (st, None, f"warpgroups more than {apart} step apart")
      enabled = False
      for name, guard, bad, post in acts:
        if not z3.is_true(value(guard, sub)):
          continue
        enabled = True
        if z3.is_true(value(bad, sub)):
          return parent, (st, name, "UNSAFE")
        new = tuple(value(e, sub).as_long() for e in post)
        if new not in parent:
          parent[new] = (st, name)
          nxt.append(new)
      if not enabled and any(pc != done_pc for pc in st[2 * CW:3 * CW]):
        return parent, (st, None, "DEADLOCK")
    frontier = nxt
  return parent, None


def shapes(reachable: Callable[[int], tuple], key: Callable, steps: int) -> set:
  """``key(t, phase, pc)`` (tuples per warpgroup) of every state reachable
  with 1 .. ``steps`` steps: the positions an invariant may allow.  Raises
  ValueError on a violation (there is then nothing to prove)."""
  out = set()
  for n in range(1, steps + 1):
    states, violation = reachable(n)
    if violation is not None:
      raise ValueError(f"{n} steps: {violation}")
    for st in states:
      out.add(key(st[:CW], st[CW:2 * CW], st[2 * CW:3 * CW]))
  return out


def result_of(n: int, parent, violation, pc_names, started: float) -> Result:
  """A :func:`search` outcome as a Result, with the shortest trace to a
  violation."""
  if violation is None:
    return Result(n, True, None, time.perf_counter() - started, len(parent))
  st, name, kind = violation
  where = f"at steps {list(st[:CW])}, {[pc_names[x] for x in st[2 * CW:3 * CW]]}"
  trace, cur = [], st
  while parent.get(cur) is not None:
    cur, step = parent[cur]
    trace.append(step)
  last = f"{kind}: {name} {where}" if name else f"{kind} {where}"
  return Result(n, False, trace[::-1] + [last], time.perf_counter() - started, len(parent))


def check_inductive(invariant: Callable, moves: Callable, s: State, s2: State, init: list,
                    done_pc: int, extra: tuple = ()) -> list[str]:
  """The inductive proof's queries: ``invariant(state)`` (named conjuncts)
  holds in the initial state (``init``: constraints on s), every action of
  ``moves`` keeps it, no action from it is unsafe, some action is enabled
  until every warpgroup is at ``done_pc``; ``extra``: (name, expression over
  s) also implied by it.  Returns the failed queries."""
  failures = []

  def holds(assumptions, goal, what):
    solver = z3.Solver()
    solver.set(timeout=60_000)
    solver.add(*assumptions, z3.Not(goal))
    result = solver.check()
    if result != z3.unsat:
      failures.append(f"{what}: {result}")

  named = invariant(s)
  inv = z3.And([e for _, e in named])
  for name, e in named:
    holds(init, e, f"initiation of '{name}'")
  acts = [(f"wg{w} {name}", guard, upd, bad, w)
          for w in range(CW) for name, guard, upd, bad in moves(s, w)]
  inv2 = invariant(s2)
  for name, guard, upd, bad, w in acts:
    step = [a == b for a, b in zip(s2.flat(), s.post(w, upd))]
    holds([inv, guard], z3.Not(bad), f"{name} is safe")
    for what, e in inv2:
      holds([inv, guard, *step], e, f"{name} keeps '{what}'")
  for what, e in extra:
    holds([inv], e, what)
  all_done = z3.And([x == done_pc for x in s.pc])
  holds([inv, z3.Not(all_done)], z3.Or([g for _, g, _, _, _ in acts]), "no deadlock")
  return failures
