"""The premise (P) of :mod:`harness.proofs.role_programs`, proved by Z3 for
every integer ring position and trip count.

The search of :mod:`harness.proofs.search` explores a launch's
role programs: per role and unit kind a table from the features of a
context (the ring position's class, whether the tile is the first, the
trip count up to 2, the key blocks still ahead up to 3) to the unit's
events, learned from probes.  That search covers every environment if
each role's events under every environment are the ones the tables give.
This module proves it from the kernel's own jaxpr, read symbolically
(:mod:`harness.proofs.symbolic`): for all integers

* t >= 0, the tile (t = 0 at ring position G = 0), G >= 0 its ring
  position, n its trip count (at least the launch's fewest, at most its
  most), j in [0, n - delta) an iteration of the tile's key loop, and G_T
  >= 0 the ring position after the last tile,
* and every value of what else the kernel reads (key ranges, schedule
  tables: free; grid indices: every value from 0 up),

each unit's events (their kinds, buffers, barriers, slots, order and
guards; never their source lines, which are labels) equal the table's
entry for the unit's features: the head at
(cls(G), t >= 1, min(n, 2)), iteration j at (cls(G + j), min(n - j, 3)),
the tail at (cls(G + n), min(n, 2)), the events after the tile loop at
cls(G_T), those before it always the same, where cls(x) = x below S and
S + (x - S) mod M from S on (S the stages, M = lcm(S, 2)).  A context
whose features no entry has is a failure too (coverage).  With it, the
events at x and at x + M (x >= S) are equal, and are decided by the
features the search uses, for every x at once.

The statement rests on four facts, proved first from the same terms (by Z3
where their form does not already show them):

* the key loops of a tile are consecutive ranges of one body (the
  forward's plain and masked loops), so iteration j has counter lo + j;
* n is well defined: the role that fills every block (``delta`` 0, the
  producer) runs a key loop of hi - lo >= 0 iterations, n = hi - lo, and
  every role iterates max(0, n - delta) times, its own ``delta``;
* the ring position: a persistent role's loop-carried ``prev_iters`` starts
  at 0 and grows by n per tile, so at tile t it is G (by induction);
* every persistent role walks the same tiles (the same loop bounds).

The trip count is free in every claim: it stands for the producer's
range wherever that appears, so the traced problem's few key blocks do not
bound it.

Each query reads "exists a context and an environment where the claim
fails": unsat is the proof.  Queries are built over terms and written in
a canonical form first -- every value that depends on none of t, G, n, j,
G_T (or on them only through a read from memory) generalised to a fresh
variable, which only widens what is checked -- so that the many launches
whose claims are equal up to those values share one Z3 call.  Where the
general form has a model, the query is asked again without the
generalisation; a model of that one is a counterexample:
:class:`PremiseFailure` names the role, the unit, the position and trip
counts, and both event lists as kernel source lines.  The facts of the
order of a tile's loop bounds are first tried by the sound syntactic rules
of :func:`harness.proofs.terms.nonneg` (most hold by the form of their
maxima), the rest go to Z3.

:func:`harness.proofs.premise_rounds.proved` probes each counterexample
and learns the tables again, until Z3 proves them or the probes disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

from harness.proofs import role_programs as rp
from harness.proofs import symbolic as sy
from harness.proofs import symbolic_dims
from harness.proofs import term_walks as tw
from harness.proofs import terms as tm
from harness.proofs import z3_terms
from harness.proofs.events import Event

# What a canonical form keeps: the variables the features are made of (a
# value that depends on none of them, or on them only through a read from
# memory, is generalised).
ESSENTIAL = frozenset(("t", "G", "n", "j", "GT"))
T, G, N, J, GT = (tm.permanent_var(v) for v in ("t", "G", "n", "j", "GT"))
K = tm.permanent_var("k")   # the key loops' common counter
TIMEOUT_MS = 60_000


class PremiseFailure(Exception):
  """(P) does not hold: ``context`` holds the role, the unit kind and the
  values of t, G, n, j, G_T where it fails (for a concrete probe there)."""

  def __init__(self, message: str, context: dict | None = None):
    super().__init__(message)
    self.context = context or {}


@dataclasses.dataclass
class Stats:
  """What proving (P) for one launch took."""

  queries: int = 0       # claims checked
  solved: int = 0        # of which Z3 decided here (the others shared a canonical form)
  seconds: float = 0.0   # in Z3

  def add(self, other: "Stats"):
    self.queries += other.queries
    self.solved += other.solved
    self.seconds += other.seconds

  def summary(self) -> tuple:
    return (self.queries, self.solved, self.seconds)

  @classmethod
  def of(cls, summary: tuple) -> "Stats":
    """The stats a :meth:`summary` was made of."""
    out = cls()
    out.queries, out.solved, out.seconds = summary
    return out


# Canonical query -> "unsat", shared by every launch of this process.
_PROVED: dict = {}
_NONNEG: dict = {}   # a generalised term's text -> whether it is syntactically >= 0


def _z3():
  try:
    import z3
  except ImportError as err:  # the GPU runners have none: the proof runs on CPU hosts
    raise PremiseFailure("z3-solver is not installed: proving the premise needs it "
                         "(pip install z3-solver; the proof runs on CPU hosts)") from err
  return z3


# -- canonical forms --------------------------------------------------------------

def canonical(query, structure: bool = False):
  """(digest, canonical query): every atom that mentions none of the
  essential variables replaced by a variable numbered in order of
  appearance; with ``structure``, the maxima and conditionals among them
  kept (their arguments generalised), for claims about the order of
  bounds built from them."""
  atoms = tw.atoms_of(query)
  essential: dict = {}
  gen = {}
  for a in atoms:  # innermost first
    if a.op == "var":
      essential[a.key] = a.args[0] in ESSENTIAL
    elif a.op == "read":  # any function of its indices: the table's values are free
      essential[a.key] = False
    else:
      essential[a.key] = any(essential[b.key] for b in tw.direct_atoms(a.args))
    if not essential[a.key] and not (structure and a.op in ("pos", "ite")):
      gen[a.key] = tm.var(f"gen:{len(gen)}")
  q = tw.subst(query, gen)
  names = {}
  for a in tw.atoms_of(q):
    if a.op == "var" and a.args[0].startswith("gen:"):
      names[a.key] = tm.var(f"g{len(names)}")
  q = tw.subst(q, names)
  return hashlib.sha1(tm.serialise(q).encode()).hexdigest(), q


def _decide(query) -> str:
  """The verdict alone ("sat", "unsat", "unknown"), the query handed to Z3
  as text."""
  z3 = _z3()
  s = z3.Solver()
  s.set("timeout", TIMEOUT_MS)
  s.from_string(z3_terms.smt2(query))
  return str(s.check())


def _solve(query, extra=()):
  """(verdict, model, terms) of one query; extra: terms to translate before
  solving, for evaluation in the model."""
  z3 = _z3()
  s = z3.Solver()
  s.set("timeout", TIMEOUT_MS)
  zt = z3_terms.Z3Terms(z3)
  e = zt(query)
  for x in extra:
    zt(x)
  s.add(*zt.side)
  s.add(e)
  r = s.check()
  if r == z3.unsat:
    return "unsat", None, zt
  if r == z3.sat:
    return "sat", s.model(), zt
  return "unknown", None, zt


# -- claims -------------------------------------------------------------------------

def _static(e: Event):
  """What an event does that is no term; never its source line, a label
  (an event written on two lines is one event)."""
  return (e.kind, e.role, e.buf, e.bar, e.n, e.threads, e.family,
          tuple(b for b, _ in e.reads), e.slot is None, e.bar_slot is None, e.bar_id is None)


def _dyn_eq(a: Event, b: Event):
  parts = []
  if a.bar_id is not None:  # a named barrier's id may depend on the step (the fused dQ's owner)
    parts.append(tm.eq(a.bar_id, b.bar_id))
  if a.slot is not None:
    parts.append(tm.eq(a.slot, b.slot))
  if a.bar_slot is not None:
    parts.append(tm.eq(a.bar_slot, b.bar_slot))
  for (_, s), (_, s2) in zip(a.reads, b.reads):
    if s is None or s2 is None:
      if (s is None) != (s2 is None):
        return False
      continue
    parts.append(tm.eq(s, s2))
  return tm.and_(*parts)


def seq_eq(items, events):
  """The guarded event list ``items`` (each event present where its guard
  holds) is exactly the sequence ``events``."""
  m = len(events)
  statics = [_static(e) for e in events]
  rank, parts = 0, []
  for it in items:
    g, e = it.guard, it.event
    s = _static(e)
    here = [tm.and_(tm.eq(rank, p), _dyn_eq(e, events[p])) for p in range(m)
            if statics[p] == s]
    parts.append(tm.or_(tm.not_(g), *here))
    rank = tm.add(rank, tm.to_int(g))
  parts.append(tm.eq(rank, m))
  return tm.and_(*parts)


def _features(ring: rp.Ring, x, **others):
  s, m = ring.stages, ring.period
  out = dict(others)
  out["slot"] = tm.rem(x, s)
  out["warm"] = tm.ge(x, s)
  out["mod"] = tm.rem(x, m)
  out["cls"] = tm.ite(tm.lt(x, s), x, tm.add(s, tm.rem(tm.sub(x, s), m)))
  return out


def _cap(x, k):
  return tm.min_(x, k)


def table_claim(table: rp.Table, feats: dict, items):
  """Where the features take an entry's key, the items are its events; and
  they take some entry's key."""
  by_events: dict = {}   # keys that share their events share one comparison
  for key, events in table.units:
    is_k = tm.and_(*(tm.eq(feats[f], v) for f, v in zip(table.features, key)))
    by_events.setdefault(events, []).append(is_k)
  some, each = [], []
  for events, keys in by_events.items():
    any_k = tm.or_(*keys)
    some.append(any_k)
    each.append(tm.or_(tm.not_(any_k), seq_eq(items, events)))
  return tm.and_(tm.or_(*some), *each)


# -- the launch -----------------------------------------------------------------------

def _relabel(items, labels):
  if not labels:
    return items
  n = lambda b: labels.get(b, b)
  out = []
  for it in items:
    if isinstance(it, sy.Ev):
      e = it.event
      out.append(sy.Ev(it.guard, dataclasses.replace(
          e, buf=n(e.buf), bar=n(e.bar), reads=tuple((n(b), s) for b, s in e.reads))))
    else:
      out.append(dataclasses.replace(it, body=_relabel(it.body, labels)))
  return out


def _first_src(items):
  for it in items:
    if isinstance(it, sy.Ev):
      return it.event.src
    return it.src
  return "?"


class _Launch:
  """The obligations of one launch (module docstring), built from its
  symbolic roles and learned program."""

  def __init__(self, prog: rp.LaunchProgram, launch: sy.SymLaunch, labels: dict):
    self.prog, self.ring = prog, prog.ring
    self.persistent = prog.persistent
    self.grid = launch.grid
    self.counts = launch.counts
    self.roles = {r.name: r for r in prog.roles}
    extra = sorted(set(launch.roles) - set(self.roles))
    if extra:
      raise PremiseFailure(
          f"{prog.name}: role {extra[0]} synchronises (at {_first_src(launch.roles[extra[0]])}) "
          f"but no probe showed it do so")
    self.units = {name: sy.units(name, _relabel(launch.roles.get(name, []), labels),
                                 persistent=self.persistent) for name in self.roles}
    self.sigma: dict = {}
    self.sigma_range = True
    self.ring_vars: dict = {}
    self.fixed_ring: tuple = ()
    self.n_def = None
    self._memos: dict = {}
    self._sigma_memo: dict = {}
    self._gen: dict = {}
    self._gen_memo: dict = {}
    self._dom_sig = repr((prog.ring, prog.persistent, prog.min_blocks, prog.max_blocks))

  # -- structure ----------------------------------------------------------------------
  def prepare(self, prove):
    """The facts the unit claims rest on (module docstring); ``prove(what,
    build)`` proves one claim (or raises)."""
    units = self.units
    # every persistent role walks the same tiles; t counts them from 0
    tiles = {u.name: (u.tile.lo, u.tile.hi) for u in units.values() if u.tile is not None}
    if len(set(tiles.values())) > 1:
      (a, ba), (b, bb) = list(tiles.items())[:2]
      raise PremiseFailure(f"{self.prog.name}: {a} and {b} walk different tiles "
                           f"([{ba[0]!r}, {ba[1]!r}) and [{bb[0]!r}, {bb[1]!r}))")
    self.tmap = {}
    for u in units.values():
      if u.tile is not None:
        self.tmap[u.name] = {tm.var(u.tile.counter).mono[0][0].key: tm.add(T, u.tile.lo)}
    # the key loops of each tile: one range, one body
    self.merged = {}
    for name, u in units.items():
      tmap = self.tmap.get(name, {})
      loops = [dataclasses.replace(L, lo=tw.subst(L.lo, tmap), hi=tw.subst(L.hi, tmap),
                                   body=sy.subst_items(L.body, tmap)) for L in u.loops]
      self.merged[name] = self._merge(name, loops, prove) if loops else None
    # n: the trip count of the role that fills every block
    refs = [r for r in self.prog.roles if r.delta == 0 and self.merged[r.name] is not None]
    refs.sort(key=lambda r: r.reads != "blocks")
    if not refs:
      raise PremiseFailure(f"{self.prog.name}: no role iterates once per key block, so the "
                           f"tiles' trip counts have no definition in the code")
    ref = refs[0]
    self.ref = ref.name
    lo, hi, _ = self.merged[ref.name]
    self.n_def = tm.sub(hi, lo)
    if not self._nonneg(self.n_def):  # a sum of max(0, .) terms needs no solver
      prove(f"{ref.name}'s key loop never runs backwards ([{lo!r}, {hi!r}))", ref.name,
            "loop", lambda full: tm.lt(self.n_def, 0))
    self.sigma, self.sigma_range = _solve_for(self.n_def)
    if self.sigma_range is not True:  # n stands for a max(0, .): only where that is >= 0
      self._dom_sig += tm.serialise(self.sigma_range)
    if not self.sigma:  # the domain then defines n by the producer's range
      self._dom_sig += tm.serialise(self.norm(self.ref, self.n_def, False))
    # the ring position: prev_iters from 0, n more per tile
    self.ring_vars = {}
    for name, u in units.items():
      mapping = {}
      for v, init, incr, end in (u.tile.accumulators if u.tile is not None else ()):
        if init != 0 or incr is None:
          continue
        d = tw.subst(incr, self.tmap[name])
        if self._abstract(d) != N:
          try:
            prove(f"{name}'s loop-carried {v} grows by the trip count per tile", name, "ring",
                  lambda full, d=d: tm.and_(self.domain(full), tm.ne(self._abstract(d), N)))
          except PremiseFailure:
            continue  # not the ring position: a free variable wherever it is read
        mapping[tm.var(v).mono[0][0].key] = G
        mapping[tm.var(end).mono[0][0].key] = GT
      self.ring_vars[name] = mapping
    # Every tile of one compiled-in trip count (a plain kernel whose ring is
    # cut to its key blocks): prev_iters advances by that constant, so the
    # symbolic run has it as n times the tile counter, no accumulator.  Tile
    # t then starts at ring position n * t, and the tile loop ends at n
    # times its tiles.
    if self.persistent and type(self.n_def) is int and tiles and \
            not any(self.ring_vars.values()):
      lo, hi = next(iter(tiles.values()))
      walked = tw.subst(tm.sub(hi, lo), self.tmap.get(self.ref, {}))
      self.fixed_ring = (tm.eq(G, tm.scale(T, self.n_def)),
                         tm.eq(GT, tm.scale(walked, self.n_def)))
      self._dom_sig += repr(self.n_def) + tm.serialise(walked)

  def _merge(self, name, loops, prove):
    common = K
    bodies = [sy.subst_items(L.body, {tm.var(L.counter).mono[0][0].key: common}) for L in loops]
    for L, body in zip(loops[1:], bodies[1:]):
      if body != bodies[0]:
        diff = next((f"{a.event.src} {a.event.describe()} against {b.event.src} "
                     f"{b.event.describe()}" for a, b in zip(bodies[0], body) if a != b),
                    f"{len(bodies[0])} events against {len(body)}")
        raise PremiseFailure(f"{self.prog.name}: {name}'s key loops at {loops[0].src} and "
                             f"{L.src} run different events per iteration ({diff}): an "
                             f"iteration's events would depend on which loop runs it")
    for a, b in zip(loops, loops[1:]):
      if a.hi != b.lo:
        raise PremiseFailure(f"{self.prog.name}: {name}'s key loops at {a.src} and {b.src} "
                             f"are not consecutive ranges ({a.hi!r} against {b.lo!r})")
    if len(loops) > 1 and not all(self._nonneg(tm.sub(L.hi, L.lo)) for L in loops):
      prove(f"{name}'s key loops at {', '.join(L.src for L in loops)} are ordered ranges",
            name, "loop", lambda full: tm.or_(*(tm.lt(L.hi, L.lo) for L in loops)))
    return loops[0].lo, loops[-1].hi, bodies[0]

  def _nonneg(self, x) -> bool:
    """:func:`harness.proofs.terms.nonneg` of ``x`` with its leaves (reads,
    divisions) generalised, which its rules do not look into: equal
    structures of other launches are decided once."""
    g = tw.generalise(x, ESSENTIAL, {}, {}, keep=("pos", "ite"))
    key = tm.serialise(g)
    hit = _NONNEG.get(key)
    if hit is None:
      hit = _NONNEG[key] = tm.nonneg(g)
    return hit

  # -- terms ---------------------------------------------------------------------------
  def _abstract(self, x):
    return tw.subst(x, self.sigma) if self.sigma else x

  def domain(self, full):
    prog = self.prog
    parts = [tm.ge(N, prog.min_blocks)]
    if prog.max_blocks is not None:
      parts.append(tm.le(N, prog.max_blocks))
    if self.persistent:
      parts += [tm.ge(T, 0), tm.ge(G, 0), tm.or_(tm.ge(T, 1), tm.eq(G, 0)), tm.ge(GT, 0)]
    if self.sigma_range is not True:
      parts.append(self.sigma_range)
    for fact in self.fixed_ring:
      parts.append(self.norm(self.ref, fact, full))
    if not self.sigma:  # n has no atom of its own to stand for: defined by the range
      parts.append(tm.eq(N, self.norm(self.ref, self.n_def, full)))
    return tm.and_(*parts)

  def norm(self, name, x, full):
    """A term of role ``name`` in the claims' variables: its tile counter as
    t, its ring position as G (and G_T); abstract (not ``full``): the trip
    count for the producer's range, every value that depends on none of the
    claims' variables generalised (module docstring)."""
    memos = self._memos.setdefault((name, full), ({}, {}, {}))
    x = tw.subst(x, self.tmap.get(name, {}), memos[0])
    # n is free in both forms: the trace's problem bounds its trip count
    # (its key blocks), every problem the kernel runs does not
    x = tw.subst(x, self.sigma, self._sigma_memo)
    x = tw.subst(x, self.ring_vars.get(name, {}), memos[1])
    if not full:
      x = tw.generalise(x, ESSENTIAL, self._gen, self._gen_memo)
    return x

  def _items(self, name, items, full, extra=None):
    out = []
    memo: dict = {}
    fix = (lambda x: self.norm(name, tw.subst(x, extra, memo), full)) if extra else (
        lambda x: self.norm(name, x, full))
    for it in items:
      g = fix(it.guard)
      if g is False:
        continue
      e = it.event
      out.append(sy.Ev(g, dataclasses.replace(
          e, slot=fix(e.slot), bar_slot=fix(e.bar_slot), bar_id=fix(e.bar_id),
          reads=tuple((b, fix(s)) for b, s in e.reads))))
    return out

  # -- the claims ------------------------------------------------------------------------
  def claims(self):
    """(what, role, kind, build) for every unit claim."""
    ring, persistent = self.ring, self.persistent
    g = G if persistent else 0
    later = tm.ge(T, 1) if persistent else False
    out = []
    for r in self.prog.roles:
      u, merged, name = self.units[r.name], self.merged[r.name], r.name
      expect = tm.pos(tm.sub(N, r.delta)) if r.delta is not None else 0

      def count(full, merged=merged, expect=expect, name=name):
        got = 0 if merged is None else tm.pos(tm.sub(merged[1], merged[0]))
        got = self.norm(name, got, full)
        sig = None if full else "count:" + tm.serialise((got, expect, self._dom_sig))
        return tm.and_(self.domain(full), tm.ne(got, expect)), None, sig

      at = f" (its key loops at {', '.join(L.src for L in u.loops)})" if u.loops else ""
      out.append((f"{name} iterates max(0, n - {r.delta}) times per tile{at}"
                  if r.delta is not None else f"{name} never iterates{at}", name, "count",
                  count))

      def unit(full, items, table, feats, extra_dom=True, name=name, extra=None):
        if extra is not None:  # the key loop's counter at iteration j
          lo, _ = extra
          extra = {K.mono[0][0]: tm.add(lo, J)}
        its = self._items(name, items, full, extra)
        sig = None
        if not full:
          sig = "unit:" + "\n".join(
              [tm.serialise((it.guard, it.event.slot, it.event.bar_slot, it.event.bar_id,
                             tuple(x for _, x in it.event.reads))) + repr(_static(it.event))
               for it in its] + [tm.serialise((extra_dom, tuple(feats.items()))),
                                 repr(table), self._dom_sig])
          if sig in _PROVED:
            return False, None, sig
        dom = tm.and_(self.domain(full), extra_dom)
        return (tm.and_(dom, tm.not_(table_claim(table, feats, its))), (its, table, feats),
                sig)

      # As role_programs.segment cuts a tile: events after the key loop
      # belong to the tail only once an iteration ran, else to the head.
      runs = tm.gt(tm.pos(tm.sub(merged[1], merged[0])), 0) if merged is not None else False
      head = u.head + [sy.Ev(tm.and_(it.guard, tm.not_(runs)), it.event) for it in u.tail]
      tail = [sy.Ev(tm.and_(it.guard, runs), it.event) for it in u.tail]
      out.append((f"{name}'s events before the tile loop", name, "pre",
                  lambda full, u=u, r=r, unit=unit: unit(
                      full, u.pre, rp.Table((), (((), r.pre),)), {})))
      nc = _cap(N, rp.N_CAP)
      out.append((f"{name}'s head unit", name, "head",
                  lambda full, head=head, r=r, unit=unit: unit(
                      full, head, r.head, _features(ring, g, later=later, n=nc))))
      if merged is not None and r.delta is not None:
        lo, _, body = merged
        kmap = (lo, name)
        jdom = tm.and_(tm.ge(J, 0), tm.lt(J, expect))
        out.append((f"{name}'s key-loop iteration", name, "iter",
                    lambda full, body=body, r=r, unit=unit, kmap=kmap, jdom=jdom: unit(
                        full, body, r.iter,
                        _features(ring, tm.add(g, J), ahead=_cap(tm.sub(N, J), rp.AHEAD_CAP)),
                        jdom, extra=kmap)))
      out.append((f"{name}'s tail unit", name, "tail",
                  lambda full, tail=tail, r=r, unit=unit: unit(
                      full, tail, r.tail, _features(ring, tm.add(g, N), n=nc))))
      out.append((f"{name}'s events after the tile loop", name, "post",
                  lambda full, u=u, r=r, unit=unit: unit(
                      full, u.post, r.post, _features(ring, GT if persistent else N))))
    return out


def _solve_for(n_def) -> tuple[dict, object]:
  """A substitution that writes the producer's range as the trip count:
  one atom of hi - lo with coefficient +-1 (a max of the range's bounds
  first) replaced by what n = hi - lo makes it; and the range of n that
  substitution holds on (a max(0, .) atom is never negative), else True."""
  if type(n_def) is int:
    return {}, True
  c, mono = tm.lin(n_def)
  best = None
  for a, k in mono.items():
    if k in (1, -1):
      rank = (a.op != "pos", k != 1)
      if best is None or rank < best[0]:
        best = (rank, a, k)
  if best is None:
    return {}, True
  _, a, k = best
  rest = tm.sub(n_def, tm.scale(tm.of_atom(a), k))
  value = tm.scale(tm.sub(N, rest), k)
  if a.op != "pos" or tm.serialise(value) == tm.serialise(N):  # n >= 0 is the domain's
    return {a.key: value}, True
  return {a.key: value}, tm.ge(value, 0)


def prove(prog: rp.LaunchProgram, launch: sy.SymLaunch, labels: dict | None = None) -> Stats:
  """Prove (P) for one launch (module docstring); raises
  :class:`PremiseFailure` with a counterexample where it does not hold."""
  stats = Stats()
  L = _Launch(prog, launch, dict(prog.labels) if labels is None else labels)

  def check(what, role, kind, build, explain=None):
    stats.queries += 1
    query = build(False)
    sig = None
    if isinstance(query, tuple):
      query, _, sig = query
      if sig is not None and sig in _PROVED:
        return
    digest, canon = canonical(query, structure=kind == "loop")
    if canon is False or _PROVED.get(digest) == "unsat":
      if sig is not None:
        _PROVED[sig] = "unsat"
      return
    start = time.perf_counter()
    verdict = _decide(canon)
    stats.seconds += time.perf_counter() - start
    stats.solved += 1
    if verdict == "unsat":
      _PROVED[digest] = "unsat"
      if sig is not None:
        _PROVED[sig] = "unsat"
      return
    # The general form has a model: ask again as the kernel has it.
    full = build(True)
    extra = ()
    if isinstance(full, tuple):
      full, extra, _ = full
    start = time.perf_counter()
    items = extra[0] if extra else ()
    verdict, model, zt = _solve(full, _item_terms(items))
    if verdict == "sat":
      verdict, model, zt = _small(full, _item_terms(items), (verdict, model, zt),
                                  _in_grid(L.grid), [term for term, _ in L.grid.values()])
    stats.seconds += time.perf_counter() - start
    stats.solved += 1
    if verdict == "unsat":
      return
    if verdict == "unknown":
      raise PremiseFailure(f"{prog.name}: Z3 could not decide that {what} "
                           f"(timeout {TIMEOUT_MS} ms)", {"role": role, "kind": kind})
    raise _failure(prog, L, what, role, kind, model, zt, extra)

  L.prepare(lambda what, role, kind, build: check(what, role, kind, build))
  for what, role, kind, build in L.claims():
    check(what, role, kind, build)
  return stats


# Bounds tried, smallest first, on a counterexample's trip count and ring
# positions, so that a probe can show it.
_BOUNDS = (16, 128, 1024)


def _small(query, extra, found, grid=True, indices=()):
  """A model of ``query`` with its trip count, ring positions and grid
  ``indices`` as small as one of :data:`_BOUNDS` allows, inside the traced
  grid (``grid``) where one is, else ``found``."""
  for inside in (grid, True) if grid is not True else (True,):
    for b in _BOUNDS:
      bounded = tm.and_(query, inside, tm.le(N, b), tm.le(G, b), tm.le(GT, b),
                        *(tm.le(i, b) for i in indices))
      got = _solve(bounded, extra)
      if got[0] == "sat":
        return got
  return found


def _in_grid(grid: dict):
  """Every grid index below its traced grid's size (a count's term where symbolic)."""
  return tm.and_(*(tm.lt(term, size) for term, size in grid.values() if size is not None))


def _item_terms(items):
  out = []
  for it in items:
    out.append(it.guard)
    e = it.event
    out += [x for x in (e.slot, e.bar_slot, e.bar_id, *(s for _, s in e.reads))
            if x is not None]
  return out


def _failure(prog, L, what, role, kind, model, zt, extra) -> PremiseFailure:
  z3 = _z3()

  def value(x):
    if type(x) in (int, bool) or x is None:
      return x
    v = model.eval(zt(x), model_completion=True)
    return z3.is_true(v) if z3.is_bool(v) else v.as_long()

  ctx = {k: value(v) for k, v in (("t", T), ("G", G), ("n", N), ("j", J), ("GT", GT))}
  ctx.update(role=role, kind=kind)
  where = _where(prog, kind, ctx)
  lines = [f"{prog.name}: (P) does not hold, found by Z3: {what} fails {where}"]
  if extra:
    items, table, feats = extra
    got = [dataclasses.replace(it.event, slot=value(it.event.slot),
                               bar_slot=value(it.event.bar_slot), bar_id=value(it.event.bar_id),
                               reads=tuple((b, value(s)) for b, s in it.event.reads))
           for it in items if value(it.guard)]
    key = tuple(value(feats[f]) for f in table.features)
    lines.append("  the kernel's events there:")
    lines += [f"    {e.src:<26} {e.describe()}" for e in got] or ["    (none)"]
    entry = dict(table.units).get(key)
    ctx_desc = dict(zip(table.features, key))
    if entry is None:
      lines.append(f"  the table, learned from probes, has no entry for {ctx_desc}")
    else:
      lines.append(f"  the table's, learned from probes, for {ctx_desc}:")
      lines += [f"    {e.src:<26} {e.describe()}" for e in entry] or ["    (none)"]
    ctx["key"] = key
    grid = _grid_point(L.grid, items, value)
    # the counts the unit's events read (a group of heads, the persistent
    # grid's size), where symbolic
    names = {a.args[0] for a in tw.atoms_of(tuple(_item_terms(items))) if a.op == "var"}
    counts = [f"{_COUNT_WORDS.get(n, n)} {symbolic_dims.length(n, value(t))}"
              for n, t in sorted(L.counts.items()) if f"dim.{n}" in names]
    if grid:
      ctx["grid"] = grid
      lines.insert(1, "  at grid point " + ", ".join(
          _grid_axis(axis, i, None if size is None else value(size))
          for axis, (i, size) in grid.items())
          + (f" ({', '.join(counts)})" if counts else ""))
    elif counts:
      lines.insert(1, "  with " + ", ".join(counts))
  return PremiseFailure("\n".join(lines), ctx)


# A symbolic count as a counterexample names it (symbolic_dims' names).
_COUNT_WORDS = {"sms": "persistent blocks", "window_left": "a window's left side",
                "window_right": "a window's right side", "chunk": "chunks of"}


def _grid_axis(axis: str, index: int, size: int | None) -> str:
  """One axis of a counterexample's grid point, never an index past the
  count it names: one past the traced grid's size stands for a launch with
  more (grid_index takes every index)."""
  if size is None:
    return f"{axis} {index}"
  if index < size:
    return f"{axis} {index} of {size}"
  return f"{axis} {index} (of a launch with {index + 1} or more; the trace's {size})"


def _grid_point(grid: dict, items, value) -> dict:
  """axis -> (index, size) in the model, of the grid indices the unit's
  events depend on (a head's place in its group, a batch)."""
  names = {a.args[0] for a in tw.atoms_of(tuple(_item_terms(items))) if a.op == "var"}
  return {axis: (value(term), size) for axis, (term, size) in grid.items()
          if f"axis.{axis}" in names}


def _where(prog, kind, ctx) -> str:
  ring = prog.ring
  g, n, j, t, gt = ctx["G"], ctx["n"], ctx["j"], ctx["t"], ctx["GT"]
  if not prog.persistent:
    g, t = 0, 0
  x = {"head": g, "iter": g + j, "tail": g + n, "post": gt if prog.persistent else n}.get(kind)
  parts = []
  if prog.persistent:
    parts.append(f"tile {t} starting at ring position {g}")
  parts.append(f"{n} key blocks")
  if kind == "iter":
    parts.append(f"iteration {j}")
  if x is not None:
    parts.append(f"ring position {x} (class {ring.cls(x)})")
  return "at " + ", ".join(parts)
