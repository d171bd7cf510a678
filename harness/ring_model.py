"""Z3 model of the backward kernels' stage ring (``kernel/backward.py``).

Each backward launch (dK/dV, dQ) has one producer (warp 0 of the memory
warpgroup) and ``C`` consumers (the compute warpgroups) around a ring of
``S`` slots.  Block ``g`` of the stream goes to slot
``PipelineState.at(S, g).index`` (``Ring.position(g)``); it consists of ``B`` buffers, each copied
by its own TMA completing its own "produced" mbarrier; every consumer waits on
the ``B`` produced barriers of its slot in order, reads, and arrives once on
the slot's "consumed" mbarrier (``C`` arrivals a phase); the producer waits on
"consumed" before every fill from ``g = S`` on.  This is the forward's ring
without the pingpong (``harness/protocol_model.py`` has that one); the
numbers (S, the buffers, the arrival counts) are read from the very mbarrier
plan the kernel allocates (``kernel.backward.launches``), none retyped.

Actors and actions (one step each), named after the verbs of
kernel/ring.py's ``Ring`` that the kernels call:

* producer ``producer_acquire``: before block gp (if gp >= S) wait
  ``consumed[slot]``; ``producer_copy``: one TMA per buffer, in order (the
  block is issued once all are);
* ``tma`` ``land(s, b)``: an issued copy lands at any later time, writing the
  slot's buffer and completing the phase of its produced barrier;
* consumer ``consumer_wait``: wait produced[slot][b] for its next buffer b,
  then read it; ``consumer_release``: arrive on consumed[slot] once all B
  are read.

Hardware rule: an mbarrier with c completed phases passes
``try_wait.parity(p)`` iff ``p != c mod 2``; Mosaic GPU keeps one parity bit
per (actor, mbarrier), flipped by each of its waits.

Not modelled: the stationary tiles (per compute warpgroup one TMA into its
own buffer and one wait, before the ring starts: single-phase barriers with
one waiter each) and the epilogue's output copies, which touch no ring slot.

Safety, checked at every step: a TMA is never issued into a slot that a
consumer has not released (no slot collision), and a consumer's wait never
passes onto another block's data (no stale or early read).  Liveness: in
every state short of "all blocks consumed" some action is enabled (no
deadlock).

:func:`prove` is an unbounded proof for a symbolic number of blocks ``n``:
a hand-written inductive invariant in linear integer arithmetic (slot index
and wrap counters like ``PipelineState``: ``g = S * wraps + index``, parity
bits as ghosts flipped on wrap; no div/mod) checked by separate queries
(initiation, consecution per action, safety per action, deadlock freedom).
:func:`find_counterexample` unrolls the same actions for a concrete ``n``
(bounded model checking), which is how the mutants in :data:`MUTATIONS` are
shown to be caught.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import z3

MUTATIONS = {
    "producer_skips_wait": "the producer refills a slot without waiting on consumed",
    "release_after_first_buffer": "a consumer releases its slot after reading the first buffer",
    "wait_from_2S": "the producer starts waiting on consumed only from block 2S",
}


@dataclasses.dataclass(frozen=True)
class RingProtocol:
  """What the proof depends on, read from a kernel launch's mbarrier plan."""

  name: str
  num_stages: int
  buffers: tuple[str, ...]
  arrivals: int                   # the consumed barrier's arrivals per phase (the plan's)
  consumers: int                  # compute warpgroups, each releasing every slot once
  mutation: str | None = None

  @classmethod
  def from_plan(cls, name: str, mbarriers, *, mutation: str | None = None) -> "RingProtocol":
    if mutation is not None and mutation not in MUTATIONS:
      raise ValueError(f"unknown mutation {mutation!r}")
    by_name = {b.name: b for b in mbarriers}
    consumed = by_name["consumed"]
    buffers = tuple(b.name[: -len("_produced")] for b in mbarriers
                    if b.name.endswith("_produced"))
    for b in buffers:
      produced = by_name[f"{b}_produced"]
      if produced.num_barriers != consumed.num_barriers or produced.num_arrivals != 1:
        raise ValueError(f"{name}: {b}_produced has {produced.num_barriers} barriers of "
                         f"{produced.num_arrivals} arrivals; the ring needs "
                         f"{consumed.num_barriers} of 1")
    from kernel import barriers
    return cls(name, consumed.num_barriers, buffers, consumed.num_arrivals,
               barriers.COMPUTE_WARPGROUPS, mutation)

  def describe(self) -> str:
    out = (f"{self.name}: S={self.num_stages}, {'+'.join(self.buffers)}, "
           f"{self.consumers} consumers, consumed completes on {self.arrivals} arrivals")
    return out + (f", mutant {self.mutation}" if self.mutation else "")


class State:
  """One state's variables (``tag`` names them apart in unrollings)."""

  def __init__(self, p: RingProtocol, tag: str, *, consumers: int):
    S, B = p.num_stages, len(p.buffers)
    I, Bo = z3.Int, z3.Bool
    self.p, self.S, self.B, self.C = p, S, B, consumers
    self.gp, self.ip, self.wp = I(f"gp{tag}"), I(f"ip{tag}"), I(f"wp{tag}")
    self.wp_odd, self.acq, self.jb = Bo(f"wpodd{tag}"), Bo(f"acq{tag}"), I(f"jb{tag}")
    self.pbit = [Bo(f"pbit{s}{tag}") for s in range(S)]
    self.cons_cnt = [I(f"ccnt{s}{tag}") for s in range(S)]
    self.cons_par = [Bo(f"cpar{s}{tag}") for s in range(S)]
    self.pending = [[Bo(f"pend{s}_{b}{tag}") for b in range(B)] for s in range(S)]
    self.pblock = [[I(f"pblk{s}_{b}{tag}") for b in range(B)] for s in range(S)]
    self.data = [[I(f"data{s}_{b}{tag}") for b in range(B)] for s in range(S)]
    self.prod_par = [[Bo(f"ppar{s}_{b}{tag}") for b in range(B)] for s in range(S)]
    self.gc = [I(f"gc{c}{tag}") for c in range(consumers)]
    self.ic = [I(f"ic{c}{tag}") for c in range(consumers)]
    self.wc = [I(f"wc{c}{tag}") for c in range(consumers)]
    self.wc_odd = [Bo(f"wcodd{c}{tag}") for c in range(consumers)]
    self.rb = [I(f"rb{c}{tag}") for c in range(consumers)]
    self.cbit = [[[Bo(f"cbit{c}_{s}_{b}{tag}") for b in range(B)] for s in range(S)]
                 for c in range(consumers)]

  def fields(self) -> dict:
    return {k: v for k, v in vars(self).items() if k not in ("p", "S", "B", "C")}


def _flat(x):
  if isinstance(x, list):
    for y in x:
      yield from _flat(y)
  else:
    yield x


def _same(a: State, b: State, changed: dict) -> list:
  """b equals a except for the listed updates ({name: value or nested list})."""
  out = []
  for name, va in a.fields().items():
    vb = getattr(b, name)
    want = changed.get(name, va)
    out += [x == y for x, y in zip(_flat(vb), _flat(want))]
  return out


def _set(lst, idx_expr, value, size):
  """lst with element idx_expr (symbolic, in [0, size)) replaced by value."""
  return [z3.If(idx_expr == i, value, lst[i]) for i in range(size)]


def _at(lst, idx_expr):
  out = lst[-1]
  for i in range(len(lst) - 2, -1, -1):
    out = z3.If(idx_expr == i, lst[i], out)
  return out


@dataclasses.dataclass
class Action:
  name: str
  guard: z3.BoolRef
  update: dict
  bad: z3.BoolRef          # a safety violation if this action fires here


def actions(m: State, n) -> list[Action]:
  """Every action from state ``m`` (n: the number of blocks)."""
  p, S, B, C = m.p, m.S, m.B, m.C
  out = []
  # -- producer_acquire: wait consumed[ip] from block S (2S in the mutant) on.
  first_wait = 2 * S if p.mutation == "wait_from_2S" else S
  must_wait = m.gp >= first_wait
  if p.mutation == "producer_skips_wait":
    must_wait = z3.BoolVal(False)
  passes = _at(m.cons_par, m.ip) != _at(m.pbit, m.ip)
  out.append(Action(
      "producer_acquire",
      z3.And(z3.Not(m.acq), m.gp < n, z3.Or(z3.Not(must_wait), passes)),
      {"acq": z3.BoolVal(True), "jb": z3.IntVal(0),
       "pbit": [z3.If(z3.And(must_wait, m.ip == s), z3.Not(m.pbit[s]), m.pbit[s])
                for s in range(S)]},
      z3.BoolVal(False)))
  # -- producer_copy of buffer jb of block gp into slot ip.
  last = m.jb == B - 1
  wrap = m.ip == S - 1
  collision = z3.Or([z3.And(m.ic[c] == m.ip, m.gc[c] < m.gp) for c in range(C)])
  out.append(Action(
      "producer_copy",
      z3.And(m.acq, m.jb < B),
      {"pending": [[z3.Or(m.pending[s][b], z3.And(m.ip == s, m.jb == b)) for b in range(B)]
                   for s in range(S)],
       "pblock": [[z3.If(z3.And(m.ip == s, m.jb == b), m.gp, m.pblock[s][b]) for b in range(B)]
                  for s in range(S)],
       "jb": z3.If(last, 0, m.jb + 1),
       "acq": z3.If(last, False, True),
       "gp": z3.If(last, m.gp + 1, m.gp),
       "ip": z3.If(last, z3.If(wrap, 0, m.ip + 1), m.ip),
       "wp": z3.If(z3.And(last, wrap), m.wp + 1, m.wp),
       "wp_odd": z3.If(z3.And(last, wrap), z3.Not(m.wp_odd), m.wp_odd)},
      collision))
  # -- a TMA lands.
  for s, b in itertools.product(range(S), range(B)):
    out.append(Action(
        f"tma lands slot {s} {p.buffers[b]}",
        m.pending[s][b],
        {"pending": [[z3.BoolVal(False) if (s2, b2) == (s, b) else m.pending[s2][b2]
                      for b2 in range(B)] for s2 in range(S)],
         "data": [[m.pblock[s][b] if (s2, b2) == (s, b) else m.data[s2][b2]
                   for b2 in range(B)] for s2 in range(S)],
         "prod_par": [[z3.Not(m.prod_par[s][b]) if (s2, b2) == (s, b) else m.prod_par[s2][b2]
                       for b2 in range(B)] for s2 in range(S)]},
        z3.BoolVal(False)))
  # -- consumers.
  release_at = 1 if p.mutation == "release_after_first_buffer" else B
  for c in range(C):
    for b in range(B):
      bit = _at([m.cbit[c][s][b] for s in range(S)], m.ic[c])
      ppar = _at([m.prod_par[s][b] for s in range(S)], m.ic[c])
      data = _at([m.data[s][b] for s in range(S)], m.ic[c])
      cbit = [[[m.cbit[c2][s2][b2] if (c2, b2) != (c, b) else
                z3.If(m.ic[c] == s2, z3.Not(m.cbit[c2][s2][b2]), m.cbit[c2][s2][b2])
                for b2 in range(B)] for s2 in range(S)] for c2 in range(C)]
      out.append(Action(
          f"consumer {c}: consumer_wait {p.buffers[b]}",
          z3.And(m.gc[c] < n, m.rb[c] == b, ppar != bit),
          {"cbit": cbit, "rb": _set(m.rb, z3.IntVal(c), m.rb[c] + 1, C)},
          data != m.gc[c]))
    slot = m.ic[c]
    full = _at(m.cons_cnt, slot) + 1 == p.arrivals
    wrap_c = m.ic[c] == S - 1
    out.append(Action(
        f"consumer {c}: consumer_release",
        z3.And(m.gc[c] < n, m.rb[c] >= release_at),
        {"cons_cnt": [z3.If(slot == s, z3.If(full, 0, m.cons_cnt[s] + 1), m.cons_cnt[s])
                      for s in range(S)],
         "cons_par": [z3.If(z3.And(slot == s, full), z3.Not(m.cons_par[s]), m.cons_par[s])
                      for s in range(S)],
         "rb": _set(m.rb, z3.IntVal(c), z3.IntVal(0), C),
         "gc": _set(m.gc, z3.IntVal(c), m.gc[c] + 1, C),
         "ic": _set(m.ic, z3.IntVal(c), z3.If(wrap_c, 0, m.ic[c] + 1), C),
         "wc": _set(m.wc, z3.IntVal(c), z3.If(wrap_c, m.wc[c] + 1, m.wc[c]), C),
         "wc_odd": _set(m.wc_odd, z3.IntVal(c), z3.If(wrap_c, z3.Not(m.wc_odd[c]), m.wc_odd[c]),
                        C)},
        z3.BoolVal(False)))
  return out


def initial(m: State) -> list:
  S, B = m.S, m.B
  out = [m.gp == 0, m.ip == 0, m.wp == 0, z3.Not(m.wp_odd), z3.Not(m.acq), m.jb == 0]
  for s in range(S):
    out += [z3.Not(m.pbit[s]), m.cons_cnt[s] == 0, z3.Not(m.cons_par[s])]
    for b in range(B):
      out += [z3.Not(m.pending[s][b]), m.data[s][b] == -1, z3.Not(m.prod_par[s][b]),
              m.pblock[s][b] == -1]
  for c in range(m.C):
    out += [m.gc[c] == 0, m.ic[c] == 0, m.wc[c] == 0, z3.Not(m.wc_odd[c]), m.rb[c] == 0]
    out += [z3.Not(x) for x in _flat(m.cbit[c])]
  return out


def done(m: State, n) -> z3.BoolRef:
  return z3.And([m.gp == n, z3.Not(m.acq)] + [m.gc[c] == n for c in range(m.C)]
                + [z3.Not(x) for x in _flat(m.pending)])


def _b(x):
  return z3.If(x, 1, 0)


def invariant(m: State, n) -> list[tuple[str, z3.BoolRef]]:
  """The inductive invariant (see the module docstring), as named conjuncts."""
  S, B, C = m.S, m.B, m.C
  inv = []

  def add(name, e):
    inv.append((name, e))

  add("n >= 0", n >= 0)
  # The parity ghosts are relative to wp_odd; the two values the formulas
  # compare with constants (a count of 0 or 1) pin it where it matters.
  add("wrap parity", z3.And(z3.Implies(m.wp == 0, z3.Not(m.wp_odd)),
                            z3.Implies(m.wp == 1, m.wp_odd)))
  add("producer position", z3.And(m.gp == S * m.wp + m.ip, 0 <= m.ip, m.ip < S, m.wp >= 0,
                                  m.gp <= n, z3.Implies(m.acq, m.gp < n),
                                  0 <= m.jb, m.jb < B, z3.Implies(z3.Not(m.acq), m.jb == 0)))
  for c in range(C):
    add(f"consumer {c} position",
        z3.And(m.gc[c] == S * m.wc[c] + m.ic[c], 0 <= m.ic[c], m.ic[c] < S, m.wc[c] >= 0,
               m.gc[c] <= n, 0 <= m.rb[c], m.rb[c] <= B,
               z3.Implies(m.rb[c] > 0, m.gc[c] < n)))
    # The window: consumers never pass the producer, the producer never runs
    # more than S blocks ahead of any consumer's releases.
    add(f"window {c}", z3.And(m.gc[c] <= m.gp, m.gp <= m.gc[c] + S,
                              z3.Implies(m.acq, m.gp <= m.gc[c] + S - 1)))
    # So the wrap counters differ by at most one, which pins every parity
    # ghost to the producer's (the one fact that stands in for "mod 2").
    add(f"wraps {c}", z3.And(m.wp - m.wc[c] >= 0, m.wp - m.wc[c] <= 1,
                             m.wc_odd[c] == z3.Xor(m.wp_odd, m.wp == m.wc[c] + 1)))

  for s in range(S):
    F = m.wp + z3.If(m.ip > s, 1, 0)
    F_odd = z3.Xor(m.wp_odd, m.ip > s)
    for b in range(B):
      issuing = z3.And(m.acq, m.ip == s, m.jb > b)
      I = F + _b(issuing)
      L = I - _b(m.pending[s][b])
      L_odd = z3.Xor(z3.Xor(F_odd, issuing), m.pending[s][b])
      add(f"slot {s} {m.p.buffers[b]} copies",
          z3.And(z3.Implies(m.pending[s][b], z3.And(I >= 1, m.pblock[s][b] == S * (I - 1) + s)),
                 m.data[s][b] == z3.If(L >= 1, S * (L - 1) + s, -1),
                 m.prod_par[s][b] == L_odd))
      for c in range(C):
        W = m.wc[c] + _b(m.ic[c] > s) + _b(z3.And(m.ic[c] == s, m.rb[c] > b))
        W_odd = z3.Xor(z3.Xor(m.wc_odd[c], m.ic[c] > s), z3.And(m.ic[c] == s, m.rb[c] > b))
        add(f"consumer {c} bit slot {s} {m.p.buffers[b]}",
            z3.And(m.cbit[c][s][b] == W_odd, W <= L, L <= W + 1))
    rel = [m.wc[c] + _b(m.ic[c] > s) for c in range(C)]
    rel_odd = [z3.Xor(m.wc_odd[c], m.ic[c] > s) for c in range(C)]
    K, K_odd = rel[0], rel_odd[0]
    for c in range(1, C):
      K, K_odd = z3.If(rel[c] < K, rel[c], K), z3.If(rel[c] < K, rel_odd[c], K_odd)
    add(f"slot {s} consumed",
        z3.And([z3.And(r >= K, r <= K + 1) for r in rel]
               + [m.cons_cnt[s] == sum(_b(r == K + 1) for r in rel), m.cons_cnt[s] < m.p.arrivals,
                  m.cons_par[s] == K_odd]))
    A = F + _b(z3.And(m.acq, m.ip == s))
    A_odd = z3.Xor(F_odd, z3.And(m.acq, m.ip == s))
    add(f"slot {s} producer bit", m.pbit[s] == z3.If(A >= 1, z3.Not(A_odd), False))
  return inv


@dataclasses.dataclass
class RingProof:
  protocol: RingProtocol
  proven: bool
  seconds: float
  queries: int
  failures: list[str]


def _solver():
  s = z3.Solver()
  s.set("timeout", 60_000)
  return s


def prove(p: RingProtocol) -> RingProof:
  """Initiation, consecution (per action and conjunct), safety (per action),
  deadlock freedom; each an unsat query."""
  start = time.perf_counter()
  n = z3.Int("n")
  a, b = State(p, "", consumers=p.consumers), State(p, "'", consumers=p.consumers)
  inv_a, inv_b = invariant(a, n), invariant(b, n)
  failures, queries = [], 0

  def unsat(assumptions, goal, what):
    nonlocal queries
    queries += 1
    s = _solver()
    s.add(*assumptions)
    s.add(z3.Not(goal))
    r = s.check()
    if r != z3.unsat:
      failures.append(f"{what}: {r}")

  for name, e in inv_a:
    unsat(initial(a) + [n >= 0], e, f"initiation of {name}")
  facts = [e for _, e in inv_a]
  for act in actions(a, n):
    unsat(facts + [act.guard], z3.Not(act.bad), f"safety of {act.name}")
    step = facts + [act.guard] + _same(a, b, act.update)
    for name, e in inv_b:
      unsat(step, e, f"{act.name} keeps {name}")
  unsat(facts + [z3.Not(done(a, n))], z3.Or([act.guard for act in actions(a, n)]),
        "deadlock freedom")
  return RingProof(p, not failures, time.perf_counter() - start, queries, failures)


def find_counterexample(p: RingProtocol, *, n: int, max_steps: int) -> list[str] | None:
  """A shortest trace (action names) from the initial state, with ``n``
  blocks, to a safety violation or a deadlock; None if none within
  ``max_steps`` steps."""
  nn = z3.IntVal(n)
  states = [State(p, f"@0", consumers=p.consumers)]
  s = _solver()
  s.add(*initial(states[0]))
  chosen = []
  for k in range(max_steps):
    cur = states[-1]
    acts = actions(cur, nn)
    # Violation now: an enabled action is unsafe, or nothing is enabled.
    s.push()
    s.add(z3.Or([z3.And(x.guard, x.bad) for x in acts]
                + [z3.And(z3.Not(done(cur, nn)), z3.Not(z3.Or([x.guard for x in acts])))]))
    if s.check() == z3.sat:
      model = s.model()
      trace = [names[model.eval(sel, model_completion=True).as_long()]
               for sel, names in chosen]
      bad = [x.name for x in acts
             if z3.is_true(model.eval(z3.And(x.guard, x.bad), model_completion=True))]
      s.pop()
      return trace + ([f"UNSAFE: {bad[0]}"] if bad else ["DEADLOCK"])
    s.pop()
    nxt = State(p, f"@{k + 1}", consumers=p.consumers)
    sel = z3.Int(f"sel@{k}")
    s.add(sel >= 0, sel < len(acts))
    for i, x in enumerate(acts):
      s.add(z3.Implies(sel == i, z3.And([x.guard, z3.Not(x.bad)] + _same(cur, nxt, x.update))))
    chosen.append((sel, [x.name for x in acts]))
    states.append(nxt)
  return None


def kernel_protocols(head_dims=((64, 64), (128, 128), (256, 256), (256, 128), (128, 256))):
  """Every distinct ring the backward launches, from kernel.backward.launches."""
  from kernel import backward
  found = {}
  for d, dv in head_dims:
    for name, mb in backward.launches(d, dv):
      proto = RingProtocol.from_plan(name.split("[")[0], mb)
      found.setdefault((proto.num_stages, proto.buffers, proto.arrivals, proto.consumers), proto)
  return list(found.values())


def reachable_actions(p: RingProtocol, *, n: int, max_steps: int) -> set[str]:
  """Names of the actions enabled in some state reachable (safely) from the
  start within ``max_steps`` steps, with ``n`` blocks: the vacuity check
  that the proof's actions are not dead code."""
  nn = z3.IntVal(n)
  cur = State(p, "@0", consumers=p.consumers)
  s = _solver()
  s.add(*initial(cur))
  fired: set[str] = set()
  for k in range(max_steps + 1):
    acts = actions(cur, nn)
    for x in acts:
      if x.name in fired:
        continue
      s.push()
      s.add(x.guard)
      if s.check() == z3.sat:
        fired.add(x.name)
      s.pop()
    if len(fired) == len(acts) or k == max_steps:
      break
    nxt = State(p, f"@{k + 1}", consumers=p.consumers)
    s.add(z3.Or([z3.And([x.guard, z3.Not(x.bad)] + _same(cur, nxt, x.update)) for x in acts]))
    cur = nxt
  return fired
