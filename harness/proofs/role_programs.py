"""Each role of a kernel launch as a program over its environment: the
units its extracted events are made of, learned from extractions, and the
premise that makes the extracted proof unbounded.

**Environment.**  One thread block runs T >= 1 tiles (a persistent forward
block; every other launch runs T = 1), tile t visiting n_t >= 0 key blocks
(bounded below where no shorter stream exists, e.g. the dK/dV kernels'
query streams, and above where the problems have that few key blocks, e.g.
a config whose stages outnumber them).  Write G_t = n_0 + ... + n_{t-1}, the
ring position tile t starts at, and ``cls(x) = x`` for x < S,
``S + (x - S) mod M`` beyond, with S the ring's stages and M = lcm(S, 2):
the class of a ring position, which decides its slot (x mod S), whether the
producer must wait for a release there (x >= S), and x mod 2 (the fused
dQ's buffer and owner).  It does not decide a barrier's phase: the search
counts each role's waits and each barrier's completed phases.

**Units.**  :func:`segment` cuts the events :mod:`harness.proofs.extract` reads for
one role under one environment by the while-loop iterations around them
(:attr:`harness.proofs.events.Extracted.loops`): *pre* (before the tile loop),
per tile a *head*, the tile's key-loop iterations (*iter* j, numbered across
the loops of one tile, e.g. the forward's plain and masked loops) and a
*tail*, and *post* (after the tile loop).  A role iterates
``max(0, n_t - delta)`` times per tile, delta a constant of the role.

**Premise (P).**  Every unit is a function of its context: head of
(cls(G_t), t >= 1, min(n_t, 2)), iter j of (cls(G_t + j), min(n_t - j, 3)),
tail of (cls(G_t + n_t), min(n_t, 2)), post of cls(G_T); pre is constant.
:class:`Learner` keeps, per role and unit kind, the coarsest features every
observed instance agrees with (the position as nothing, its slot, its slot
and whether it is past the first S, x mod M, or its class; each other
feature kept or dropped: :class:`Table`), then asks for a probe of every
context those features can take that no probe showed
(:meth:`Learner.missing`).  An instance that even all the features do not
explain is a :class:`PremiseError` naming the two probes, which are then
checked on their own, each under its one environment (:func:`concrete`),
for a trace of what the kernel does there.

**Consequence.**  Under (P) a role's events under *any* environment are what
a finite automaton emits while it reads the environment as the word
``B^{n_0} | B^{n_1} | ... $`` (:class:`LaunchProgram`): each unit chosen by
symbols it has read.  :mod:`harness.proofs.search` explores that automaton
with the hardware's semantics for every word at once, the environment being
chosen only as the roles read it, and every counter kept relative to the
others (mbarrier phases against the waits that count them, copies against
the readers that expect them), so the state space is finite and its
exhaustive search covers every number of key blocks and of tiles, zero
included: the ring position and the mbarrier parities carried across tiles
of any trip count (``prev_iters``) are part of every state it explores.

**How (P) is proved.**  The probes (:mod:`harness.proofs.probes`)
show every context the search can ask for under the learned features, and
every instance must agree with its table; a context the search needs and no
probe showed is a :class:`CoverageError`.  That tests (P) at the probed
positions only: a kernel whose events depended on, say, G mod 64 would
agree with every probe.  :mod:`harness.proofs.premise` proves it: from the
kernel's jaxpr read with symbolic integers (:mod:`harness.proofs.symbolic`),
Z3 shows that every unit equals its table's entry for every ring position,
trip count and tile, and that the features take only keys the tables
have; each counterexample is probed, and the tables learned again, until
Z3 proves them or the probes disagree (a :class:`PremiseError`).  Both
errors fail ``python -m harness prove``.

Roles that read only part of the word (:attr:`RoleProgram.reads`): a role
whose units are all per key block (the producer, which does not see tile
boundaries: empty heads and tails, no lookahead) reads only the blocks; a
role that never iterates and whose units do not depend on blocks (the query
prefetch warp) reads only the tile boundaries.  Otherwise the search would
have to decide arbitrarily many empty tiles ahead of the producer, or
arbitrarily many blocks ahead of the query prefetch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math

from harness.proofs.events import Extracted

# The features a unit kind may depend on, besides the ring position's.
OTHER_FEATURES = {
    "head": ("later", "n"),   # t >= 1, min(n_t, 2)
    "iter": ("ahead",),       # min(n_t - j, 3)
    "tail": ("n",),           # min(n_t, 2)
    "post": (),
}
# The ring position x (G_t for a head, G_t + j for an iteration, G_t + n_t
# for a tail and G_T for post), coarsest first: nothing, its slot x mod S,
# the slot and whether x >= S (a fill that must wait for a release), x mod M,
# and its class.
POSITION = ((), ("slot",), ("slot", "warm"), ("mod",), ("cls",))
N_CAP, AHEAD_CAP = 2, 3
KINDS = ("head", "iter", "tail", "post")


class PremiseError(ValueError):
  """A role's events are not a function of the contexts the proof assumes.
  ``probes``: the (extraction, trip counts, description) that disagree, each
  checkable on its own (:func:`concrete`)."""

  def __init__(self, message, probes=()):
    super().__init__(message)
    self.probes = list(probes)


class CoverageError(ValueError):
  """The search needs a unit in a context no probe environment showed."""


@dataclasses.dataclass(frozen=True)
class Ring:
  """The ring positions' classes (see the module docstring); ``exact``: no
  folding, for a launch checked under one environment (:func:`concrete`)."""

  stages: int
  exact: bool = False

  def __post_init__(self):
    object.__setattr__(self, "period", math.lcm(self.stages, 2))
    object.__setattr__(self, "classes", self.stages + self.period)
    object.__setattr__(self, "_features", {})

  def cls(self, x: int) -> int:
    s = self.stages
    return x if x < s or self.exact else s + (x - s) % self.period

  def advance(self, c: int, k: int = 1) -> int:
    """cls(x + k) from c = cls(x)."""
    s = self.stages
    if c < s or self.exact:
      return self.cls(c + k)
    return s + (c - s + k) % self.period

  def features(self, c: int) -> dict:
    """The position features of every x of class c (:data:`POSITION`)."""
    hit = self._features.get(c)
    if hit is None:
      hit = self._features[c] = {"cls": c, "slot": c % self.stages, "warm": c >= self.stages,
                                 "mod": c % self.period}
    return hit


@dataclasses.dataclass
class Segments:
  """One role's events under one environment, cut into units."""

  pre: tuple
  tiles: list          # per tile: (head, [iteration events...], tail)
  post: tuple


def segment(events, loops, *, persistent: bool, num_tiles: int, role: str) -> Segments:
  """Cut a role's events into units by the while-loop iterations around
  them (the module docstring).  Events between two key-loop iterations
  that belong to neither fit no unit: an ExtractionError-like PremiseError."""
  depth = 1 if persistent else 0
  pre, post = [], []
  per_tile = [[] for _ in range(num_tiles)]
  tile_loop = None
  seen_tile = False
  for e, lp in zip(events, loops):
    if not persistent:
      per_tile[0].append((e, lp))
      continue
    if not lp:
      (post if seen_tile else pre).append(e)
      continue
    src, t = lp[0]
    if tile_loop is None:
      tile_loop = src
    elif src != tile_loop:
      raise PremiseError(f"{role}: events in two outermost loops ({tile_loop} and {src}); "
                         f"a persistent role's outermost loop must be its tile loop")
    if post:
      raise PremiseError(f"{role}: events after the tile loop and then in it again")
    if t >= num_tiles:
      raise PremiseError(f"{role}: tile loop iteration {t}, but the block runs {num_tiles} tiles")
    seen_tile = True
    per_tile[t].append((e, lp))
  tiles = []
  for t, evs in enumerate(per_tile):
    head, iters, tail = [], [], []
    current = None
    for e, lp in evs:
      if len(lp) > depth:
        key = lp[depth]
        if key != current:
          if tail:
            raise PremiseError(f"{role}: tile {t} has events between two key-loop "
                               f"iterations outside both (at {tail[0].src})")
          iters.append([])
          current = key
        iters[-1].append(e)
      elif iters:
        tail.append(e)
      else:
        head.append(e)
    tiles.append((tuple(head), [tuple(i) for i in iters], tuple(tail)))
  return Segments(tuple(pre), tiles, tuple(post))


@dataclasses.dataclass(frozen=True)
class Table:
  """A unit kind of one role: the features its units depend on, and the
  units observed, keyed by those features' values."""

  features: tuple
  units: tuple          # ((key, events), ...) sorted

  def __post_init__(self):
    object.__setattr__(self, "_lookup", dict(self.units))

  def get(self, ctx: dict, *, role: str, kind: str):
    key = tuple(ctx[f] for f in self.features)
    hit = self._lookup.get(key)
    if hit is not None:
      return hit
    raise CoverageError(
        f"{role}: no probe environment showed its {kind} unit for "
        f"{dict(zip(self.features, key))} (the search reaches it)")

  def empty(self) -> bool:
    return all(not evs for _, evs in self.units)


@dataclasses.dataclass(frozen=True)
class RoleProgram:
  name: str
  threads: int          # threads it contributes to named barriers
  delta: int | None     # iterations per tile: max(0, n - delta); None: never iterates
  pre: tuple
  head: Table
  iter: Table
  tail: Table
  post: Table
  reads: str            # "all" | "blocks" | "tiles" (the module docstring)

  def unit(self, kind: str, ctx: dict) -> tuple:
    return getattr(self, kind).get(ctx, role=self.name, kind=kind)

  def iterations(self, n: int) -> int:
    return 0 if self.delta is None else max(0, n - self.delta)


@dataclasses.dataclass(frozen=True)
class LaunchProgram:
  """Everything :mod:`harness.proofs.search` explores for one launch."""

  name: str
  ring: Ring
  persistent: bool      # any number of tiles (else exactly one)
  min_blocks: int       # the smallest trip count a tile can have
  max_blocks: int | None  # the largest (None: any)
  roles: tuple          # RoleProgram, by name
  barriers: tuple       # ((name, num_arrivals, slots), ...)
  overlaps: tuple       # ((buffer, (buffers sharing bytes...)), ...)
  word: str | None = None   # one environment only (:func:`concrete`)
  # raw buffer name -> its source name, as the units have them (for
  # harness/proofs/premise.py, which names the symbolic events alike)
  labels: tuple = dataclasses.field(default=(), compare=False)
  # what proving (P) for it took (harness/proofs/premise.py's Stats.summary);
  # empty where it was not proved
  z3: tuple = dataclasses.field(default=(), compare=False)
  # the plain-call kernels (no key ranges) Z3 proved to run this program
  # too (harness/proofs/premise_rounds.py's plain_proved), by name
  plain: tuple = dataclasses.field(default=(), compare=False)
  # the lengths at which Z3 proved its own kernel to run it too, beyond the
  # probes' one (forward_traces.py's trace_ranged), by name
  lengths: tuple = dataclasses.field(default=(), compare=False)

  def key(self):
    """Two launches with equal keys are the same transition system."""
    return (self.ring, self.persistent, self.min_blocks, self.max_blocks, self.roles,
            self.barriers, self.overlaps, self.word)

  def shape(self):
    """The key up to the names of buffers and mbarrier arrays and the source
    lines: every buffer and barrier renamed by where it first appears (roles
    by name, each role's units in the order pre, head, iter, tail, post and
    by context, events in order), events without their lines.  The search
    of :mod:`harness.proofs.search` compares names only for equality and
    reads lines only to print a trace, so two launches of one shape have
    isomorphic state spaces, explored in the same order: one check decides
    both, and its trace (in one launch's names) is the other's renamed."""
    names: dict = {}

    def n(b):
      if not b:
        return b
      if b not in names:
        names[b] = f"#{len(names)}"
      return names[b]

    def event(e):
      return (e.kind, e.role, n(e.buf), e.slot, n(e.bar), e.bar_slot,
              tuple((n(b), s) for b, s in e.reads), e.n, e.bar_id, e.threads, e.family)

    roles = []
    for r in sorted(self.roles, key=lambda r: r.name):
      tables = tuple((t.features, tuple((k, tuple(event(e) for e in evs))
                                        for k, evs in sorted(t.units, key=lambda u: repr(u[0]))))
                     for t in (r.head, r.iter, r.tail, r.post))
      roles.append((r.name, r.threads, r.delta, r.reads, tuple(event(e) for e in r.pre), tables))
    # barriers and overlaps no event names keep no name: only their count matters
    rename = lambda b: names.get(b, "?")
    barriers = tuple(sorted((rename(b), a, sl) for b, a, sl in self.barriers))
    overlaps = tuple(sorted((rename(a), tuple(sorted(rename(x) for x in bs)))
                            for a, bs in self.overlaps))
    return (self.ring, self.persistent, self.min_blocks, self.max_blocks, tuple(roles),
            barriers, overlaps, self.word)

  def probes_digest(self) -> str:
    """The :meth:`shape_digest` of the program its first round of probes
    learned, before Z3's counterexamples refined it (kept on the program
    by :func:`harness.proofs.forward_probes.forward_program`; the program's
    own where none was kept): what a config learned from its probes alone
    is compared with (:mod:`harness.proofs.representatives`)."""
    return self.__dict__.get("_probes_digest") or self.shape_digest()

  def shape_digest(self) -> str:
    """A SHA-256 of :meth:`shape`'s repr, kept on the program once made (its
    pickle carries it), for grouping and caching by shape: hashing the shape
    itself, a tuple of every event, costs milliseconds each time."""
    digest = self.__dict__.get("_shape_digest")
    if digest is None:
      digest = hashlib.sha256(repr(self.shape()).encode()).hexdigest()
      object.__setattr__(self, "_shape_digest", digest)
    return digest


class Learner:
  """Collects unit instances from extractions and builds the launch's
  program (:meth:`program`)."""

  def __init__(self, name: str, ring: Ring, *, persistent: bool, min_blocks: int = 0,
               max_blocks: int | None = None):
    self.name, self.ring, self.persistent = name, ring, persistent
    self.min_blocks, self.max_blocks = min_blocks, max_blocks
    self.obs: dict = {}      # (role, kind) -> {full context: (events, where)}
    self.conflicts: list = []
    self.pre: dict = {}      # role -> (events, where)
    self.deltas: dict = {}   # role -> {(n, iterations)}
    self.loop_src: dict = {}  # role -> the source line of its key loop's first event
    self.threads: dict = {}
    self.barriers: dict = {}
    self.overlaps: dict = {}
    self.probes = 0
    self.seen: list = []     # (extraction, trip counts, description)
    self.exact = ring.exact  # one environment: every unit keyed by where it is
    self.probe = 0           # the index in seen of the extraction being read
    self._read = (0, ())     # probes of seen read into obs, and the roles then known
    self._tables: dict = {}  # (role, kind) -> (observations it was built from, Table)

  def observe(self, ex: Extracted, trips, *, where: str = "") -> None:
    """One extraction whose block ran tiles with these trip counts."""
    self.probes += 1
    for name, b in ex.barriers.items():
      shape = (b.num_arrivals, b.shape[0] if b.shape else 1)
      prev = self.barriers.setdefault(name, shape)
      if prev != shape:
        raise PremiseError(f"mbarrier {name} changed between probes: {prev} and {shape}")
    for a, bs in ex.overlaps.items():
      self.overlaps.setdefault(a, set()).update(bs)
    self.threads.update(ex.threads)
    self.seen.append((ex, list(trips), where))

  def _observe(self, ex, trips, where):
    for role in self.threads:
      if role not in ex.roles:  # no events under this environment: all its units empty
        self._empty(role, trips, where)
        continue
      seg = segment(ex.roles[role], ex.loops[role], persistent=self.persistent,
                    num_tiles=len(trips), role=role)
      self._one(role, "pre", {}, seg.pre, where)
      g = 0
      for t, ((head, iters, tail), n) in enumerate(zip(seg.tiles, trips)):
        self.deltas.setdefault(role, set()).add((n, len(iters)))
        tag = f"{where}, tile {t} ({n} blocks from ring position {g})"
        at = {"t": t} if self.exact else {}
        self._one(role, "head", {"cls": self.ring.cls(g), "later": t >= 1,
                                 "n": min(n, N_CAP), **at}, head, tag)
        for j, it in enumerate(iters):
          if it:
            self.loop_src.setdefault(role, it[0].src)
          self._one(role, "iter", {"cls": self.ring.cls(g + j),
                                   "ahead": min(n - j, AHEAD_CAP)}, it, f"{tag}, iteration {j}")
        self._one(role, "tail", {"cls": self.ring.cls(g + n), "n": min(n, N_CAP), **at},
                  tail, tag)
        g += n
      self._one(role, "post", {"cls": self.ring.cls(g)}, seg.post, where)

  def _empty(self, role, trips, where):
    g = 0
    self._one(role, "pre", {}, (), where)
    for t, n in enumerate(trips):
      at = {"t": t} if self.exact else {}
      self.deltas.setdefault(role, set()).add((n, 0))
      self._one(role, "head", {"cls": self.ring.cls(g), "later": t >= 1, "n": min(n, N_CAP),
                               **at}, (), where)
      self._one(role, "tail", {"cls": self.ring.cls(g + n), "n": min(n, N_CAP), **at}, (),
                where)
      g += n
    self._one(role, "post", {"cls": self.ring.cls(g)}, (), where)

  def _one(self, role, kind, ctx, events, where):
    if kind == "pre":
      prev = self.pre.setdefault(role, (events, where, self.probe))
      if prev[0] != events:
        self.conflicts.append((f"{role}: its events before the tile loop differ between "
                               f"{prev[1]} and {where}", prev[2], self.probe))
      return
    key = tuple(sorted(ctx.items()))
    seen = self.obs.setdefault((role, kind), {})
    prev = seen.setdefault(key, (events, where, self.probe))
    if prev[0] != events:
      self.conflicts.append((
          f"{role}: its {kind} unit in context {dict(key)} differs between {prev[1]} and "
          f"{where}: {_diff(prev[0], events)}", prev[2], self.probe))

  def _full(self, ctx: dict) -> dict:
    return {**ctx, **self.ring.features(ctx["cls"])} if "cls" in ctx else dict(ctx)

  def _table(self, role, kind) -> Table:
    """The coarsest features every observation agrees with: fewest distinct
    keys, then fewest features."""
    count = len(self.obs.get((role, kind), ()))   # observations are only added
    hit = self._tables.get((role, kind))
    if hit is None or hit[0] != count:
      hit = self._tables[(role, kind)] = (count, self._table_of(role, kind))
    return hit[1]

  def _table_of(self, role, kind) -> Table:
    seen = [(self._full(dict(k)), evs) for k, (evs, *_) in
            self.obs.get((role, kind), {}).items()]
    if self.exact:
      features = tuple(sorted(seen[0][0])) if seen else ()
      return Table(features, tuple(sorted(((tuple(c[f] for f in features), evs)
                                           for c, evs in seen), key=repr)))
    others = OTHER_FEATURES[kind]
    # Events compared by a number per distinct sequence (equal numbers,
    # equal events), not event by event for every candidate feature set.
    ids: dict = {}
    seen = [(ctx, events, ids.setdefault(events, len(ids))) for ctx, events in seen]
    best = None
    for pos in POSITION:
      for size in range(len(others) + 1):
        for sub in itertools.combinations(others, size):
          features = pos + sub
          units, ok = {}, True
          for ctx, events, eid in seen:
            k = tuple(ctx[f] for f in features)
            if units.setdefault(k, (eid, events))[0] != eid:
              ok = False
              break
          if ok:
            rank = (len(units), len(features))
            if best is None or rank < best[0]:
              best = (rank, features, units)
    if best is None:
      raise AssertionError("the full feature set was checked in _one")
    _, features, units = best
    return Table(features, tuple(sorted(((k, evs) for k, (_, evs) in units.items()), key=repr)))

  def reachable(self, kind: str, delta):
    """Every context (cls and the other features) a unit of this kind can
    be asked for, for a role iterating max(0, n - delta) times."""
    classes = range(self.ring.classes)
    top = N_CAP if self.max_blocks is None else min(N_CAP, self.max_blocks)
    low = 0 if self.persistent else self.min_blocks
    if kind == "head":
      for c in classes:
        for later in (False, True) if self.persistent else (False,):
          if c and not later:
            continue  # the first tile starts at position 0
          for n in range(low, top + 1):
            yield {"cls": c, "later": later, "n": n}
    elif kind == "iter":
      if delta is None:
        return
      most = AHEAD_CAP if self.max_blocks is None else min(AHEAD_CAP, self.max_blocks)
      for c in classes:
        for a in range(delta + 1, most + 1):
          yield {"cls": c, "ahead": a}
    elif kind == "tail":
      for c in classes:
        for n in range(low, top + 1):
          if (self.persistent or n == min(c, N_CAP)) and (n == 0 or c >= 1):
            yield {"cls": c, "n": n}
    elif kind == "post":
      for c in classes:
        if self.persistent or c >= self.min_blocks:
          yield {"cls": c}

  def missing(self, prog: "LaunchProgram") -> list:
    """(role, kind, context) the search may ask for and no probe showed,
    under the features each table chose."""
    out = []
    for role in prog.roles:
      for kind in KINDS:
        if role.reads == "blocks" and kind in ("head", "tail"):
          continue
        if role.reads == "tiles" and kind == "iter":
          continue
        table = getattr(role, kind)
        have = {k for k, _ in table.units}
        for ctx in self.reachable(kind, role.delta):
          key = tuple(self._full(ctx)[f] for f in table.features)
          if key not in have:
            have.add(key)
            out.append((role.name, kind, ctx))
    return out

  def program(self) -> LaunchProgram:
    # The probes are read in order, each once: a role first seen in a later
    # probe (whose earlier probes then count as empty for it) reads them anew.
    done, known = self._read
    if known != tuple(sorted(self.threads)):
      self.obs, self.pre, self.deltas, self.conflicts, self._tables = {}, {}, {}, [], {}
      done = 0
    for i in range(done, len(self.seen)):
      self.probe = i
      self._observe(*self.seen[i])
    self._read = (len(self.seen), tuple(sorted(self.threads)))
    if self.conflicts:
      message, a, b = self.conflicts[0]
      raise PremiseError(f"{self.name}: {message}", [self.seen[a], self.seen[b]])
    roles = []
    for role in sorted(self.threads):
      pairs = self.deltas.get(role, set())
      if all(m == 0 for _, m in pairs):
        delta = None
      else:
        ds = {n - m for n, m in pairs if m > 0}
        if len(ds) != 1 or any(m != max(0, n - next(iter(ds))) for n, m in pairs):
          loop = self.loop_src.get(role)
          raise PremiseError(f"{self.name}: {role} iterates not max(0, n - d) times per tile "
                             f"for one d: (trip count, iterations) seen {sorted(pairs)}"
                             + (f"; its loop's first event is at {loop}" if loop else ""))
        delta = ds.pop()
      tables = {k: self._table(role, k) for k in KINDS}
      position = {"cls", "slot", "warm", "mod"}
      reads = "all"
      if (delta == 0 and tables["head"].empty() and tables["tail"].empty()
          and "ahead" not in tables["iter"].features):
        reads = "blocks"
      elif (delta is None and not (position | {"n"}) & set(tables["head"].features)
            and tables["tail"].empty() and not position & set(tables["post"].features)):
        reads = "tiles"
      roles.append(RoleProgram(role, self.threads[role], delta, self.pre.get(role, ((),))[0],
                               tables["head"], tables["iter"], tables["tail"], tables["post"],
                               reads))
    roles, barriers, overlaps = self._named(roles)
    word = None
    if self.exact:
      ((_, trips, _),) = self.seen
      word = "|".join("B" * n for n in trips) + "$"
      roles = [dataclasses.replace(r, reads="all") for r in roles]
    return LaunchProgram(self.name, self.ring, self.persistent, self.min_blocks,
                         self.max_blocks, tuple(roles), barriers, overlaps, word,
                         tuple(sorted(self.labels.items())))

  def _named(self, roles):
    """Buffers and barriers under the kernel source's names (one name per
    allocation, made unique), in the roles, the barrier plan and the overlaps."""
    names, taken = {}, set()
    for ex, _, _ in self.seen:
      for raw, label in sorted(ex.names.items()):
        if raw not in names:
          label = label if label not in taken else f"{label}#{raw}"
          names[raw] = label
          taken.add(label)
    self.labels = names   # the symbolic extraction's events are named alike
    n = lambda b: names.get(b, b)
    cache: dict = {}

    def event(e):
      r = cache.get((e, e.src))  # events equal but for their lines keep their own labels
      if r is None:
        r = cache[(e, e.src)] = dataclasses.replace(e, buf=n(e.buf), bar=n(e.bar),
                                                    reads=tuple((n(b), s) for b, s in e.reads))
      return r

    def table(t):
      return Table(t.features, tuple((k, tuple(event(e) for e in evs)) for k, evs in t.units))

    roles = [dataclasses.replace(r, pre=tuple(event(e) for e in r.pre), head=table(r.head),
                                 iter=table(r.iter), tail=table(r.tail), post=table(r.post))
             for r in roles]
    barriers = tuple(sorted((n(b), a, sl) for b, (a, sl) in self.barriers.items()))
    overlaps = tuple(sorted((n(a), tuple(sorted(n(x) for x in bs)))
                            for a, bs in self.overlaps.items()))
    return roles, barriers, overlaps


def _diff(a, b) -> str:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return f"event {i}: {x.src} {x.describe()} against {y.src} {y.describe()}"
  longer, what = (a, "first") if len(a) > len(b) else (b, "second")
  if len(a) == len(b):
    return "equal"
  extra = longer[min(len(a), len(b))]
  return f"the {what} has {abs(len(a) - len(b))} more events, from {extra.src} {extra.describe()}"


def concrete(name: str, stages: int, probe, *, persistent: bool) -> LaunchProgram:
  """One probe's launch as a program for its own environment only: every
  unit at its place, the environment fixed to the probe's trip counts.
  Checked where the premise fails, for a trace of what the kernel does
  there."""
  ex, trips, where = probe
  learner = Learner(f"{name}, {where}", Ring(stages, exact=True), persistent=persistent)
  learner.observe(ex, trips, where=where)
  return learner.program()
