"""Probing the forward kernel: the probes of one case's trace, chosen so that
they show every context the role programs' tables need
(:class:`_ForwardProber`), the program learned from them, and (P) proved by
Z3 for it at the probes' length, at every length and for the kernels of a
call without key ranges (:func:`forward_program`)."""

from __future__ import annotations

import numpy as np

from harness.proofs import extract as ex
from harness.proofs import forward_traces as ft
from harness.proofs import premise_rounds as rounds
from harness.proofs import probes
from harness.proofs import role_programs as rp
from harness.proofs import tracing
from harness.proofs.cases import ForwardCase
from harness.proofs.events import ExtractionError


def _reranked_order(kernel_eqn, consts, case: ForwardCase, num_tiles: int) -> dict:
  """{operand: value} for the launch order a non-persistent longest-first
  launch over key ranges computes on the device (``Schedule.reranked``,
  from the ranges the environment decides): the last tile first, as the
  causal static order of the traced launch (one batch, one head) runs them.

  Sound for the protocol: the reranked table is a permutation of the tiles
  whatever the ranges hold (properties/kernel/test_schedule.py), and a
  non-persistent block runs the one tile it reads, whose key range the
  environment chooses anyway; the tile's index only bounds that range by
  its causal limit, which the last tile makes the widest.
  """
  if case.persistent or case.schedule != "longest-first":
    return {}
  found = probes.int_operands(kernel_eqn, consts, (num_tiles,))
  if len(found) != 1:
    raise ExtractionError(f"expected one computed launch order of {num_tiles} tiles "
                          f"among the kernel's operands, found {len(found)}")
  return {found[0]: np.arange(num_tiles - 1, -1, -1, dtype=np.int32)}


class _Chooser:
  """Trip counts for a persistent probe's tiles, chosen tile by tile within
  each tile's causal bound (``cap(qi)``) so that the probes of one case show
  every head context (ring class, trip count 0 / 1 / 2 or more; tails and
  key-loop iterations follow from them) and a tile long enough for every
  iteration's lookahead, then all of them again at other ring positions.
  ``seen`` (context -> times shown) is shared by the probes of one case."""

  def __init__(self, ring: rp.Ring, cap, first: int, seen: dict, lb: bool = True):
    self.ring, self.cap, self.first, self.seen, self.lb = ring, cap, first, seen, lb
    self.g, self.t = 0, 0
    self.long = ring.classes + rp.AHEAD_CAP

  def wanted(self, want: int):
    """The head contexts (class, min(n, 2)) and "long" shown fewer than ``want`` times."""
    out = {(c, a) for c in range(self.ring.classes) for a in range(rp.N_CAP + 1)
           if self.seen.get((c, a), 0) < want}
    if self.seen.get("long", 0) < want:
      out.add("long")
    return out

  def distance(self, c, targets, cap):
    """Tiles needed from ring class c to a tile that shows a target."""
    frontier, dist = {c}, 0
    seen = set()
    while frontier and dist < 2 * self.ring.classes:
      if "long" in targets or any((x, a) in targets for x in frontier
                                  for a in range(rp.N_CAP + 1)):
        return dist
      seen |= frontier
      frontier = {self.ring.advance(x, n) for x in frontier for n in range(min(cap, 2) + 1)}
      frontier -= seen
      dist += 1
    return 1 << 20

  def __call__(self, qi):
    cap = self.cap(qi)
    c = self.ring.cls(self.g)
    if self.t == 0:
      n = min(self.first, cap)
    else:
      targets = self.wanted(1) or self.wanted(2)
      if "long" in targets and cap >= self.long:
        n = self.long
      else:
        here = [a for a in range(min(cap, rp.N_CAP) + 1) if (c, a) in targets]
        if here:
          n = here[0]
        else:  # towards the nearest class that still has a target
          n = min(range(min(cap, rp.N_CAP) + 1),
                  key=lambda n: (self.distance(self.ring.advance(c, n), targets, cap), -n))
    if self.t >= 1:
      key = (c, min(n, rp.N_CAP))
      self.seen[key] = self.seen.get(key, 0) + 1
      if n >= self.long:
        self.seen["long"] = self.seen.get("long", 0) + 1
    self.g += n
    self.t += 1
    return (self.t % 2 if self.lb else 0, n)


def _split_tail_table(consts: dict, case: ForwardCase):
  """The split tail's entry table (blocks, 4, entries) among the traced
  constants (kernel.tiling.schedule.SplitTail.table), or None for other schedules."""
  if case.schedule != "split-tail":
    return None
  found = [v for v in consts.values() if v.ndim == 3 and v.shape[1] == 4]
  if len(found) != 1:
    raise ExtractionError(f"expected the split tail's entry table among the kernel's "
                          f"constant operands, found {len(found)}")
  return found[0]


def forward_program(case: ForwardCase, *, modules=None, traced=None,
                    premise: bool = True) -> rp.LaunchProgram:
  """The role programs of ``case``'s blocks, learned from probes: a first
  round that walks many contexts (and several again), then one probe per
  context the learned tables still lack
  (:meth:`harness.proofs.role_programs.Learner.missing`); with ``premise``,
  then (P) proved by Z3 for the traced kernel
  (:func:`harness.proofs.premise_rounds.proved`), each of its
  counterexamples probed until it holds or a probe shows the kernel's
  events disagree with themselves; then for the same kernel at every
  length of its queries and keys, whole and ragged, without and with a
  window and chunks of every size
  (:func:`harness.proofs.forward_traces.trace_ranged`), and for the plain
  kernels (:func:`harness.proofs.forward_traces.trace_plain`)."""
  prober = _ForwardProber(case, modules, traced)
  prog = prober.learn()
  if not premise:
    return prog
  probed = prog.shape_digest()
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  (prog,) = rounds.lengths_proved([prog], lambda how: ft.trace_ranged(
      case, ragged=how[0], windows=how[1], modules=prober.modules), rounds.RANGED_LENGTHS)
  (prog,) = rounds.plain_proved([prog], lambda ragged: ft.trace_plain(
      case, ragged=ragged, modules=prober.modules))
  # what the probes alone learned, which a config at its own sizes is held to
  # (harness/proofs/representatives.py): Z3's rounds refine 4-stage rings further
  object.__setattr__(prog, "_probes_digest", probed)
  return prog


class _ForwardProber:
  """The probes of one forward case: its trace, its learner, and a probe of
  any trip counts (retracing a longer problem where the trace is too short
  for them)."""

  def __init__(self, case: ForwardCase, modules, traced):
    self.case, self.modules = case, modules or tracing.shipped_modules()
    self.ring = rp.Ring(case.num_stages)
    # A config with more stages than key blocks runs with as many stages as
    # blocks: its problems have no more key blocks than that.
    self.few = case.ring_cut
    self.learner = rp.Learner(f"forward {case.describe()}", self.ring,
                              persistent=case.persistent,
                              max_blocks=case.num_stages if self.few else None)
    self._use(traced or ft.trace_case(case, modules=self.modules))
    # blocks whose tiles' causal bounds are the widest
    self.wide = [probes.PROBE_SMS - 1 - k if case.schedule == "round-robin" else k
                 for k in range(probes.PROBED_BLOCKS)]
    case, ring = self.case, self.ring
    if case.persistent:
      seen: dict = {}
      for k, first in enumerate((0, 2)):
        self.probe(_Chooser(ring, self.cap, first=first, seen=seen, lb=not self.few),
                   self.wide[k])
    else:
      for n in sorted({0, 1, 2, 3, probes.probe_trips(ring)}):
        if not self.few or n <= case.num_stages:
          self.planned([n])

  def _use(self, traced):
    case = self.case
    self.closed, self.kernel, self.problem = traced
    self.consts = probes.const_values(self.closed, self.kernel)
    self.num_tiles = self.problem.seq_q // case.tile_q
    self.tables = probes.range_tables(self.kernel, self.consts, self.num_tiles)
    self.consts.update(_reranked_order(self.kernel, self.consts, case, self.num_tiles))
    self.split = _split_tail_table(self.consts, case)

  def actual(self, qi, lb, n):
    """The key blocks the kernel visits for a requested range (the causal
    bound may cut it), by the kernel's own rule."""
    case, problem, bkv = self.case, self.problem, self.case.block_kv
    lo, hi = problem.mask.key_blocks(qi, tile_q=case.tile_q, block_kv=bkv,
                                     k_start_min=lb * bkv, k_end_max=(lb + n) * bkv)
    return lo, hi - lo

  def cap(self, qi):
    return self.actual(qi, 0 if self.few else 1, 1 << 20)[1]

  def cut(self, sm, entry, lo, n):
    """A split tail's piece visits its tile's blocks inside [lo, hi) of its
    entry only, by the kernel's rule (kernel.common.piece_block_range)."""
    if self.split is None:
      return lo, n
    first, end = self.modules.common.piece_block_range(lo, lo + n, int(self.split[sm, 1, entry]),
                                                       int(self.split[sm, 2, entry]))
    return first, end - first

  def probe(self, choose, sm=None):
    case = self.case
    grid0 = {"batch": 0, "heads": 0, "q_tiles": 0, "tiles": 0, "sm": 0}
    env = probes.Env(self.tables, self.consts, case.block_kv, choose)
    if case.persistent:
      launch = ex.extract_kernel(self.kernel, env=env, grid={**grid0, "sm": sm},
                                 name=f"forward block {sm}")
    else:
      # the last query tile: its causal bound the widest (the longest-first
      # order's grid point 0 runs its heaviest tile)
      launch = ex.extract_kernel(self.kernel, env=env,
                                 grid={**grid0, "q_tiles": self.num_tiles - 1},
                                 name="forward block")
    trips = []
    for entry, qi in enumerate(env.order):
      lb, n = env.ranges[qi]
      lo, m = self.actual(qi, lb, n)
      if self.few and m < n:
        raise ExtractionError(f"tile {qi}: {n} key blocks asked of a problem with fewer")
      if (lo, m) != (lb, n):
        raise ExtractionError(f"tile {qi}: asked for key blocks [{lb}, {lb + n}), the "
                              f"kernel visits [{lo}, {lo + m})")
      trips.append(self.cut(sm, entry, lo, m)[1])
    self.learner.observe(launch, trips, where=("block " + str(sm) + ", tiles"
                                               if case.persistent else "one tile")
                         + f" of {trips} key blocks")
    return trips

  def planned(self, trips, sm=None):
    order = []

    def choose(qi):
      t = len(order)
      order.append(qi)
      n = trips[t] if t < len(trips) else 0
      return (t % 2 if self.actual(qi, 1, n)[1] == n else 0, n)
    return self.probe(choose, sm)

  def learn(self) -> rp.LaunchProgram:
    """The program of the probes so far, after a probe of every context the
    search may ask for and the tables lack."""
    learner = self.learner
    for _ in range(4):
      prog = learner.program()
      missing = learner.missing(prog)
      if not missing:
        return prog
      done = set()
      for role, kind, ctx in missing:
        trips = probes.trips_showing(self.ring, kind, ctx, persistent=self.case.persistent)
        if trips not in done:
          done.add(trips)
          self.planned(list(trips), self.wide[0])
    raise rp.CoverageError(f"{learner.name}: probes do not cover {missing[:3]}")

  def realise(self, ctx: dict):
    """A probe of the environment of a counterexample of (P): a tile of
    ctx["n"] key blocks from ring position ctx["G"] (and, persistent, after
    ctx["t"] >= 1 earlier tiles), or ctx["GT"] blocks in all before the
    events after the tile loop; traced anew, longer, where this trace is
    too short for it."""
    case = self.case
    n, g = ctx.get("n", 0), ctx.get("G", 0)
    if ctx.get("kind") == "post":
      n, g = 0, ctx.get("GT", 0)
    if not case.persistent:
      if (n + 2 > self.problem.seq_kv // case.block_kv
              or self.actual(self.num_tiles - 1, 1, n)[1] != n):
        self._retrace(n + 3, None)
      return self.planned([n])
    later = ctx.get("t", 0) >= 1 or g > 0
    for _ in range(2):
      chooser = _Realiser(g, n, self.cap, later)
      try:
        self.probe(chooser, self.wide[0])
      except ExtractionError:
        chooser.placed = False
      if chooser.placed:
        return
      # a tile long enough for n, and enough tiles for G even one block each
      self._retrace(max(n, 2) + 3, g + 4)
    raise ExtractionError(f"no probe of {self.learner.name} reaches ring position {g} "
                          f"with a tile of {n} key blocks")

  def _retrace(self, kv_blocks, tiles):
    self._use(ft.trace_case(self.case, modules=self.modules,
                            kv_blocks=max(kv_blocks, self.problem.seq_kv // self.case.block_kv),
                            tiles=tiles))


class _Realiser:
  """The trip counts of a persistent probe that reaches ring position ``g``
  (after at least one tile where ``later``), each tile taking as many of
  the blocks left as its causal bound allows, then a tile of ``n``
  blocks, then empty tiles."""

  def __init__(self, g, n, cap, later):
    self.left, self.n, self.cap, self.later = g, n, cap, later
    self.t, self.placed = 0, False

  def __call__(self, qi):
    cap = self.cap(qi)
    self.t += 1
    if self.placed:
      return (0, 0)
    if self.left > 0 or (self.later and self.t == 1):
      take = min(self.left, cap)
      self.left -= take
      return (0, take)
    if self.n <= cap:
      self.placed = True
      return (0, self.n)
    return (0, 0)   # this tile is too short for the one wanted: the next
