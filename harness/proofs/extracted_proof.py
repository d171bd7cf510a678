"""Check a launch's barrier and stage-ring protocol, for every environment.

The subject is a :class:`harness.proofs.role_programs.LaunchProgram`: every role of
one thread block as the units its traced events are made of (read out of
the kernel's jaxpr by :mod:`harness.proofs.extract`, cut and tabulated by
:mod:`harness.proofs.role_programs`).  :func:`check` explores **every
interleaving** of the roles and of the TMA completions **under every
environment** -- every number of tiles and every trip count per tile, zero
included -- by an explicit-state search in which the environment is chosen
only as the roles read it (the word ``B^{n_0} | B^{n_1} | ... $`` of
:mod:`harness.proofs.role_programs`, generated one symbol at a time, every choice a
branch) and every counter is kept relative to the ones it is compared with,
so that the reachable states are finitely many.  That is what makes the
check a proof for all trip counts and tiles, under the premise of
:mod:`harness.proofs.role_programs`.

Hardware semantics, encoded here once:

* mbarrier: ``num_arrivals`` arrivals complete a phase; a TMA load's
  completion is one arrival (its ``arrive.expect_tx``).  A wait passes when
  the barrier's completed-phase count differs in parity from the waiter's own
  phase bit, which Mosaic GPU flips on every wait of that thread on that
  barrier (so the k-th wait, 0-based, waits with parity k mod 2).
* TMA loads complete in any order relative to everything else, those of one
  issuing role in issue order.
* named barrier: a generation completes when its thread count has arrived;
  surplus arrivals count toward the next; ``bar.sync`` arrives and waits for
  the generation its arrival counted toward.
* wgmma: groups complete in issue order; a read of shared memory lasts from
  the issue to the wait that leaves fewer groups in flight than its own
  position (``run_state``'s end waits for all).
* TMA store: reads its shared memory until a ``wait_smem_to_gmem`` leaves it
  behind.

Properties (each failure is reported with a trace of kernel source lines and
the environment that shows it):

* **read before copy completed**: a read (wgmma operand, load) of a slot a
  TMA fills sees exactly the copy its reader waited for, landed.  Which copy
  the reader means is what its waits say: the n-th wait of the reader on the
  barrier the slot's copies complete means the n-th copy into that slot.
* **ring order**: across a buffer's slots each reader takes the copies in the
  order they were issued, never an older one after a newer (a slot index that
  drifts from the producer's, e.g. a missing ``prev_iters`` carry).
* **overwrite before release**: a copy into a slot is not issued while the
  previous one is in flight or an asynchronous read of the slot (wgmma, TMA
  store) is, nor before every reader has read the copy it waited for; shared
  memory is not stored into while an asynchronous read of it runs.
* **stale read**: shared memory written by ordinary stores is read (by a
  load, a wgmma, a TMA store) as its reader's own last write or another
  role's write of the same step (the fused dQ's dS^T handoff), never a
  write of another step, nor before it is written.
* **overlay**: shared memory that shares bytes with another buffer (a
  RefUnion) is not read after a write into the other clobbered it, nor
  written while the other is still read asynchronously.
* **parity alias**: a pending wait never sees its barrier two or more phases
  ahead of the phase it waits for (one parity bit could not tell them apart),
  and never passes on an older phase.
* **no deadlock**: every reachable state steps or is the end.
* **named barriers**: ids outside Mosaic GPU's reserved ones and the
  hardware's 16, one use (kernel/sync/barriers.py helper) per id, one thread count
  per id, and no generation completed by one role's arrivals alone (a
  barrier that synchronises with nobody: a token passed to oneself).
* **async-proxy ordering**: shared memory written by ordinary stores is fenced
  (``commit_smem``) before an async-proxy read of it (TMA store, wgmma) by the
  same role, and before an arrive that publishes it to a role that reads it
  through the async proxy; it is not rewritten while a TMA store still reads it.

Reductions, each losing no violation:

* A step that touches only its own role's state (a wgmma or TMA store
  issue, whose reads are then tracked while they run; a fence; a load or
  store of shared memory no other role touches) is taken alone, without
  branching, but the safety of every enabled step of every role is checked
  at every state.  So is a load of a slot a TMA copy fills: a copy issued
  into the slot while the load is a role's next step is reported there.  Waits that retire reads (wgmma waits, store waits) and
  every step other roles can observe are interleaved.
* A wait that can pass is taken at once.  What a delay could add is the
  waiter's lag: another phase of its barrier completing before it passes.
  That is checked where it can happen next (an arrival that completes the
  phase, a copy in flight that completes it: a parity alias); further
  along, a phase of a barrier that orders a copy is a copy into a slot the
  waiter has not read yet, which its read reports, and a phase of a
  barrier that orders a release needs the waiter's own refill first.
* An mbarrier arrive and a TMA copy's issue are taken at once: both are
  always enabled, and taking them later only delays what they enable (a
  waiter passing, a copy landing) and lets other roles finish reads they
  would otherwise be caught overwriting.  A phase completed sooner can only
  bring a parity alias sooner, never hide one: a wait passes on an older
  phase only after an earlier wait did.  (Named-barrier arrivals stay
  interleaved: which roles' arrivals complete a generation depends on
  their order.)
* A TMA copy lands only once some role waits on its barrier (or on the
  barrier of a later copy of the same issuer), or when nothing else can
  step.  A copy still in flight only adds violations (a read of it, a
  store or copy into its slot); what only a landed copy can cause is
  seen by a waiter on its barrier (a parity alias: both copies may land
  while the waiter is at its wait), and a waiter is what the landing
  is for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

from harness.proofs.extract import Event
from harness.proofs.role_programs import (AHEAD_CAP, N_CAP, CoverageError, LaunchProgram,
                                   RoleProgram)
from kernel.sync import barriers as kbarriers

MAX_STATES = 3_000_000
PRE, HEAD, ITER, TAIL, POST, DONE = range(6)
# Slot contents (per shared-memory slot): the latest TMA copy, an ordinary
# store (role, step), clobbered by a write into overlapping bytes, nothing.
C_TMA, C_GEN, C_CLOB, C_NONE = 0, 1, 2, 3
# Steps taken alone once a role reaches them (see the module docstring).
EAGER = frozenset(("wait", "arrive", "tma_load"))
_PASSES = ("phase 0 passes", "phase 1 passes")


@dataclasses.dataclass
class Violation:
  kind: str
  message: str
  trace: list = dataclasses.field(default_factory=list)   # (role, Event, note)
  environment: str = ""

  def format(self) -> str:
    lines = [f"{self.kind}: {self.message}"]
    if self.environment:
      lines.append(f"  environment: {self.environment}")
    for i, (role, ev, note) in enumerate(self.trace):
      lines.append(f"  {i:3d} {role:<10} {ev.src:<26} {ev.describe()}"
                   + (f"  [{note}]" if note else ""))
    return "\n".join(lines)


@dataclasses.dataclass
class CheckResult:
  ok: bool
  states: int
  seconds: float
  violation: Violation | None = None
  unexecuted: list = dataclasses.field(default_factory=list)  # (role, Event), with record


class _Fail(Exception):
  def __init__(self, kind, message, note=""):
    super().__init__(message)
    self.kind, self.message, self.note = kind, message, note


def describe_word(word: str) -> str:
  """The environment a path chose: its tiles' trip counts."""
  tiles, n, out = [], 0, ""
  for c in word:
    if c == "B":
      n += 1
    elif c in "|$":
      tiles.append(n)
      n = 0
  if word and word[-1] != "$":
    out = " (and what follows, not yet read)"
    tiles.append(f">={n}" if n else "...")
  if not tiles:
    return "nothing read yet"
  return ("tiles of " + ", ".join(map(str, tiles)) + " key blocks" + out)


class _Static:
  """Everything about the program that does not depend on the state."""

  def __init__(self, prog: LaunchProgram):
    self.prog = prog
    self.ring = prog.ring
    self.roles = list(prog.roles)
    self.names = [r.name for r in self.roles]
    self.violations: list[Violation] = []
    self.units: list[tuple] = []
    self.uid: dict = {}
    self.uid_of_obj: dict = {}   # id(unit tuple) -> uid, for the tuples the tables hold
    self.held: list = []         # those tuples, kept alive while their ids are keys
    units_of = []   # per role: [(unit kind, events)]
    for r in self.roles:
      us = [("pre", r.pre)]
      for kind in ("head", "iter", "tail", "post"):
        us += [(kind, evs) for _, evs in getattr(r, kind).units]
      units_of.append(us)
    self.units_of = units_of
    arrivals = {name: a for name, a, _ in prog.barriers}
    # Copies: (buffer, slot) -> the (barrier, slot) they complete; the writer role.
    self.copy_bar, self.writer, stationary, ring_slots = {}, {}, set(), set()
    smem_slots, bar_keys, access = set(), set(), {}
    self.async_readers: dict = {}
    for ri, us in enumerate(units_of):
      for kind, evs in us:
        for e in evs:
          where = [(self.names[ri], e, "")]
          if e.kind == "tma_load":
            key = (e.buf, e.slot)
            if self.writer.setdefault(e.buf, ri) != ri:
              raise ValueError(f"{e.src}: {e.buf} is written by TMA from two roles: "
                               f"not modelled")
            prev = self.copy_bar.setdefault(key, (e.bar, e.bar_slot))
            if prev != (e.bar, e.bar_slot):
              self.violations.append(Violation(
                  "barrier mismatch", f"copies into {e.buf}[{e.slot}] complete both "
                  f"{prev[0]}[{prev[1]}] and {e.bar}[{e.bar_slot}]", where))
            # Filled once per launch: before the tile loop, or (one tile)
            # outside its key loop.
            once = kind == "pre" or (not prog.persistent and kind != "iter")
            (stationary if once else ring_slots).add(key)
            bar_keys.add((e.bar, e.bar_slot))
            smem_slots.add(key)
            access.setdefault(key, set()).add(ri)
          elif e.kind in ("wait", "arrive"):
            bar_keys.add((e.buf, e.slot))
          elif e.kind == "wgmma":
            for b, s in e.reads:
              smem_slots.add((b, s))
              access.setdefault((b, s), set()).add(ri)
              self.async_readers.setdefault(b, set()).add(ri)
          elif e.kind in ("smem_load", "smem_store", "tma_store"):
            smem_slots.add((e.buf, e.slot))
            access.setdefault((e.buf, e.slot), set()).add(ri)
            if e.kind == "tma_store":
              self.async_readers.setdefault(e.buf, set()).add(ri)
    self.stationary = stationary - ring_slots
    self.bar_keys = sorted(bar_keys, key=str)
    self.bar_index = {k: i for i, k in enumerate(self.bar_keys)}
    self.arrivals = [arrivals.get(k[0], 1) for k in self.bar_keys]
    self.tma_slots = sorted(self.copy_bar, key=str)
    self.tma_index = {k: i for i, k in enumerate(self.tma_slots)}
    self.smem_slots = sorted(smem_slots, key=str)
    self.smem_index = {k: i for i, k in enumerate(self.smem_slots)}
    self.tma_smem = [self.smem_index[k] for k in self.tma_slots]
    self.is_tma = [k in self.copy_bar for k in self.smem_slots]
    self.ring_buffers = sorted({b for b, _ in ring_slots})
    self.rbuf_index = {b: i for i, b in enumerate(self.ring_buffers)}
    self.overlaps = {a: set(bs) for a, bs in prog.overlaps}
    # slots of buffers sharing bytes with each slot's buffer
    self.clobbers = [tuple(self.smem_index[k] for k in self.smem_slots
                           if k[0] in self.overlaps.get(b, ())) for b, _ in self.smem_slots]
    overlapped_by = {}
    for (b, s), rs in access.items():
      for w in self.overlaps.get(b, ()):
        overlapped_by.setdefault(w, set()).update(rs)
    self.private = {}
    for k, rs in access.items():
      others = (rs | overlapped_by.get(k[0], set()))
      for ri in rs:
        self.private[(ri, k)] = others == {ri} and k not in self.copy_bar
    # Waits: per role the barrier keys it waits on (its phase bits).
    self.waits_of = []
    for ri, us in enumerate(units_of):
      keys = sorted({(e.buf, e.slot) for _, evs in us for e in evs if e.kind == "wait"},
                    key=str)
      self.waits_of.append({k: i for i, k in enumerate(keys)})
    # Counter families (normalised together): per barrier key, the waits on
    # it and the copies whose barrier it is.  Stationary barriers stay
    # absolute (they count one copy).
    self.family_waits = [[(ri, w[k]) for ri, w in enumerate(self.waits_of) if k in w]
                         for k in self.bar_keys]
    self.family_copies = [[i for i, s in enumerate(self.tma_slots) if self.copy_bar[s] == k]
                          for k in self.bar_keys]
    self.stationary_bar = [bool(c) and all(self.tma_slots[i] in self.stationary for i in c)
                           for c in self.family_copies]
    self.slot_rbuf = [self.rbuf_index.get(b, -1) for b, _ in self.tma_slots]
    self.families = [(bi, self.family_waits[bi], self.family_copies[bi],
                      frozenset(self.family_copies[bi]))
                     for bi in range(len(self.bar_keys)) if not self.stationary_bar[bi]]
    self.family_of = {f[0]: f for f in self.families}
    # by the barrier index a step changed (-1, -2: none), the families to shift
    self.family_list = {bi: [self.family_of[bi]] if bi in self.family_of else []
                        for bi in range(-2, len(self.bar_keys))}
    self.copy_family = [self.bar_index[self.copy_bar[key]] for key in self.tma_slots]
    self.wait_family = [[self.bar_index[key] for key in sorted(w, key=lambda key, w=w: w[key])]
                        for w in self.waits_of]
    self.rbuf_slots = [(bi, frozenset(ci for ci in range(len(self.tma_slots))
                                      if self.slot_rbuf[ci] == bi))
                       for bi in range(len(self.ring_buffers))]
    self.reads = [r.reads for r in self.roles]
    self.threads = [r.threads for r in self.roles]
    self.all_readers = [ri for ri, r in enumerate(self.reads) if r == "all"]
    self.has_generic = any(e.kind == "smem_store" for us in units_of for _, evs in us
                           for e in evs)
    self._named()
    # per role, per event object: local (taken alone) or not
    self.local = [{} for _ in self.roles]
    for ri, us in enumerate(units_of):
      for _, evs in us:
        for e in evs:
          self.local[ri][e] = self._is_local(ri, e)
    for ri, us in enumerate(units_of):
      for _, evs in us:
        self.unit_id(evs)
    # per unit, per event: the barrier index of a wait or arrive (a TMA
    # load's: its slot's copy index), and a wait's index among its role's
    self.ubar, self.uwi = [], []
    role_of = {name: ri for ri, name in enumerate(self.names)}
    for evs in self.units:
      bars, wis = [], []
      for e in evs:
        key = (e.buf, e.slot)
        if e.kind in ("wait", "arrive"):
          bars.append(self.bar_index[key])
        elif e.kind == "tma_load":
          bars.append(self.tma_index[key])
        else:
          bars.append(-1)
        wis.append(self.waits_of[role_of[e.role]][key] if e.kind == "wait" else -1)
      self.ubar.append(tuple(bars))
      self.uwi.append(tuple(wis))
    self.tma_writer = [self.writer[b] for b, _ in self.tma_slots]
    self.rotation = None if prog.word is not None else self._rotation()
    # per unit, per event: taken alone when reached (see check's reductions)
    self.alone = [[(self.local_any(e) and e.kind not in ("wgmma_wait", "store_wait"))
                   or e.kind in EAGER for e in evs] for evs in self.units]

  # -- symmetry ---------------------------------------------------------------
  def _rotation(self):
    """If the program is equivariant under shifting every ring position by
    one -- each unit at a warm position x + 1 is the unit at x with the ring
    arrays' slots advanced by one -- the per-role maps that rotate units
    back by k (for k in 0 .. M-1), else None.  A ring array is one whose
    slots the shift advances: found from the units, then checked."""
    ring = self.ring
    S, M = ring.stages, ring.period
    if S < 2 and M < 2:
      return None
    warm = list(range(S, S + M))
    arrays = set()
    # units by (role, kind, class) at warm classes
    def unit_at(role, kind, c, rest):
      table = getattr(role, kind)
      ctx = {**ring.features(c), **rest}
      try:
        return table.get(ctx, role=role.name, kind=kind)
      except CoverageError:
        return None
    rests = {"head": [{"later": l, "n": n} for l in (False, True) for n in range(N_CAP + 1)],
             "iter": [{"ahead": a} for a in range(1, AHEAD_CAP + 1)],
             "tail": [{"n": n} for n in range(N_CAP + 1)], "post": [{}]}
    pairs = []
    for role in self.roles:
      for kind, rs in rests.items():
        for rest in rs:
          for c in warm:
            a, b = unit_at(role, kind, c, rest), unit_at(role, kind, ring.advance(c), rest)
            if a is None or b is None:
              continue
            if len(a) != len(b):
              return None
            pairs.append((role, a, b))
            for x, y in zip(a, b):
              for (bx, sx), (by, sy) in zip(_slots(x), _slots(y)):
                if bx != by:
                  return None
                if sx != sy:
                  arrays.add(bx)
    if not arrays:
      return None
    sizes = {}
    for e in self.all_events():
      for b, sl in _slots(e):
        if b in arrays:
          sizes[b] = max(sizes.get(b, 0), sl + 1)
    if any(n != S for n in sizes.values()):
      return None
    self.ring_arrays = arrays
    for role, a, b in pairs:
      if tuple(_rotate_event(x, arrays, S, 1) for x in a) != b:
        return None
    # every unit of a role, rotated back by k, is a unit of the role
    maps = []
    for ri, us in enumerate(self.units_of):
      per_k = []
      for k in range(M):
        m = {}
        for _, evs in us:
          rot = tuple(_rotate_event(x, arrays, S, -k) for x in evs)
          u = self.uid.get(rot)
          if u is not None:  # else a unit of the cold start: never moved
            m[self.uid[evs]] = u
        per_k.append(m)
      maps.append(per_k)
    # index permutations of the slot-indexed state, per k
    def perm(keys):
      index = {key: i for i, key in enumerate(keys)}
      return [tuple(index[(b, (sl - k) % S) if b in arrays else (b, sl)] for b, sl in keys)
              for k in range(M)]
    try:
      self.perm_bar = perm(self.bar_keys)
      self.perm_tma = perm(self.tma_slots)
      self.perm_smem = perm(self.smem_slots)
      self.perm_waits = [perm(sorted(w, key=lambda key, w=w: w[key])) for w in self.waits_of]
    except KeyError:
      return None  # a ring array some state names only some slots of
    # inverse permutations, by the permutation's identity
    self.inverse = []
    for k in range(M):
      inv = {}
      for p in [self.perm_bar[k], self.perm_tma[k], self.perm_smem[k]] + \
          [w[k] for w in self.perm_waits]:
        q = [0] * len(p)
        for i, j in enumerate(p):
          q[j] = i
        inv[id(p)] = tuple(q)
      self.inverse.append(inv)
    return maps

  def local_any(self, e):
    """Local for whichever role runs it (a unit's events are one role's)."""
    return any(r.get(e, False) for r in self.local)

  def all_events(self):
    for us in self.units_of:
      for _, evs in us:
        yield from evs

  def _is_local(self, ri, e):
    if e.kind in ("wgmma", "fence", "tma_store"):
      return True
    if e.kind == "smem_load" and (e.buf, e.slot) in self.copy_bar:
      return True  # a copy's read: an issue that would overwrite it sees it coming
    if e.kind in ("smem_load", "smem_store"):
      return self.private.get((ri, (e.buf, e.slot)), False)
    return False

  def unit_id(self, evs) -> int:
    u = self.uid_of_obj.get(id(evs))
    if u is not None:
      return u
    u = self.uid.get(evs)
    if u is None:
      u = self.uid[evs] = len(self.units)
      self.units.append(evs)
    self.uid_of_obj[id(evs)] = u
    self.held.append(evs)
    return u

  def _named(self):
    # Mosaic GPU's own ids: 0 and one per warpgroup of the launch (roles
    # are named wg<w> or wg<w>.warp<i>).
    warpgroups = 1 + max(int(n.split(".")[0][2:]) for n in self.names)
    reserved = set(kbarriers.reserved_ids(warpgroups))
    family, threads = {}, {}
    for ri, us in enumerate(self.units_of):
      for _, evs in us:
        for e in evs:
          if e.kind not in ("bar_sync", "bar_arrive"):
            continue
          where = [(self.names[ri], e, "")]
          if e.bar_id in reserved or not 0 <= e.bar_id < kbarriers.HW_NAMED_BARRIERS:
            self.violations.append(Violation(
                "named barrier id", f"id {e.bar_id} is Mosaic GPU's or past the hardware's "
                f"{kbarriers.HW_NAMED_BARRIERS}", where))
          f = family.setdefault(e.bar_id, (e.family, e))
          if f[0] != e.family:
            self.violations.append(Violation(
                "named barrier id collision",
                f"id {e.bar_id} serves both {f[0]} and {e.family}",
                [(self.names[ri], f[1], f[0]), (self.names[ri], e, e.family)]))
          t = threads.setdefault(e.bar_id, (e.threads, e))
          if t[0] != e.threads:
            self.violations.append(Violation(
                "named barrier id collision",
                f"id {e.bar_id} is used with {t[0]} and {e.threads} threads", where))
    self.named_ids = sorted(family)
    self.nid = {i: k for k, i in enumerate(self.named_ids)}
    self.named_threads = {i: t[0] for i, t in threads.items()}


# A role's state: (phase, unit, k, x, y, waits, waited, groups, stores, dirty,
# lastread, syncw).  x, y: where it reads the environment -- a role reading
# the whole word: (anchor word index, min(n, 2) of its tile); one reading
# blocks: (ordinal of its next block from the word's start, its class); one
# reading tiles: (ordinal of its tile from the word's start, tile >= 1).
# The environment: _Static's env (the comment above _Static.committed).


class _Search:
  def __init__(self, st: _Static, max_states: int, reduce: bool = True):
    self.st, self.max_states, self.reduce = st, max_states, reduce
    self.prog = st.prog
    self.ring = st.ring
    self.window = 4 * (st.ring.stages + AHEAD_CAP) + 16
    if st.prog.word is not None:  # one environment: roles drift at most its length apart
      self.window = max(self.window, len(st.prog.word) + 16)
    self.rotate_states = reduce

  # -- the environment ------------------------------------------------------
  # env = (word, class at its start, a tile boundary before it, no more
  # blocks, no more tiles, blocks in the word's last tile (capped), blocks
  # owed).  Blocks and tiles that roles reading only blocks or only tiles
  # have gone past the word's end are committed: they exist, their tiles'
  # boundaries (or blocks) not yet chosen.  Blocks owed: those a role
  # reading blocks had found past the word when it found the next one
  # missing; the word places them before it ends, though that role, done
  # reading, commits no more.  (Without them the word could end short of
  # the blocks the producer had copied, a third copy in a tile of two.)
  def committed(self, env, roles):
    word = env[0]
    blocks, tiles = 0, 0
    for ri, r in enumerate(roles):
      reads = self.st.roles[ri].reads
      if reads == "blocks" and r[0] == ITER:
        blocks = max(blocks, r[3] + 1)
      elif reads == "tiles" and r[0] in (HEAD, TAIL):
        tiles = max(tiles, r[3] + 1)
    return (max(env[6], blocks - word.count("B")), max(0, tiles - 1 - word.count("|")))

  def extend(self, env, roles):
    """Every way to append one symbol to the word: [(symbol, env)]."""
    word, bc, bl, bfin, tfin, cur, owed = env
    if word and word[-1] == "$":
      return []
    prog = self.prog
    if prog.word is not None:  # one environment
      sym = prog.word[len(word)]
      return [(sym, (word + sym, bc, bl, bfin, tfin, cur, owed))]
    cb, ct = self.committed(env, roles)
    cap = max(prog.min_blocks, prog.max_blocks or 0)
    out = []
    if (cb > 0 or not bfin) and (prog.max_blocks is None or cur < prog.max_blocks):
      out.append(("B", (word + "B", bc, bl, bfin, tfin, min(cur + 1, cap), max(0, owed - 1))))
    if cur >= prog.min_blocks:
      if prog.persistent and (ct > 0 or not tfin):
        out.append(("|", (word + "|", bc, bl, bfin, tfin, 0, owed)))
      if cb == 0 and ct == 0:
        out.append(("$", (word + "$", bc, bl, True, True, cur, owed)))
    return out

  def symbol(self, env, roles, i):
    """[(symbol at word index i, env)] -- generating the word up to i."""
    if i < len(env[0]):
      return [(env[0][i], env)]
    out = []
    for _, env2 in self.extend(env, roles):
      out += self.symbol(env2, roles, i)
    return out

  def run_of_blocks(self, env, roles, i, cap):
    """[(number of consecutive blocks from word index i, up to cap, env)]."""
    if cap == 0:
      return [(0, env)]
    out = []
    for s, env2 in self.symbol(env, roles, i):
      if s != "B":
        out.append((0, env2))
      else:
        out += [(k + 1, e) for k, e in self.run_of_blocks(env2, roles, i + 1, cap - 1)]
    return out

  def block_exists(self, env, roles, b):
    """For a role reading blocks only: [(does block ordinal b exist, env)]."""
    word, bc, bl, bfin, tfin, cur, owed = env
    cb, _ = self.committed(env, roles)
    placed = word.count("B")
    if b < placed + cb:
      return [(True, env)]
    if (word and word[-1] == "$") or bfin:
      return [(False, env)]
    out = [(True, env)]
    if self.prog.persistent or cur + cb >= self.prog.min_blocks:
      out.append((False, (word, bc, bl, True, tfin, cur, max(owed, b - placed))))
    return out

  def tile_exists(self, env, roles, tau):
    """For a role reading tile boundaries only: [(does tile ordinal tau exist, env)]."""
    word, bc, bl, bfin, tfin, cur, owed = env
    _, ct = self.committed(env, roles)
    tiles = 1 + word.count("|")
    if tau < tiles + ct:
      return [(True, env)]
    if (word and word[-1] == "$") or tfin:
      return [(False, env)]
    return [(True, env), (False, (word, bc, bl, bfin, True, cur, owed))]

  def at_tile(self, env, i):
    """The tile index, a feature of a launch under one environment only
    (whose word is never cut)."""
    return {"t": env[0][:i].count("|")} if self.prog.word is not None else {}

  def cls_at(self, env, i):
    return self.ring.advance(env[1], env[0][:i].count("B"))

  def later_at(self, env, i):
    return env[2] or "|" in env[0][:i]

  # -- moving a role through its units ----------------------------------------
  def settle(self, ri, phase, uid, k, x, y, env, roles):
    """The role at (phase, unit, k) having finished its last step: move it to
    its next event, through empty units, choosing the environment as it
    reads it.  [(phase, uid, k, x, y, env)]."""
    st = self.st
    if phase == DONE or k < len(st.units[uid]):
      return [(phase, uid, k, x, y, env)]
    out = []
    for nxt in self.next_unit(ri, phase, x, y, env, roles):
      out += self.settle(ri, *nxt[:2], 0, *nxt[2:], roles)
    return out

  def unit(self, ri, kind, ctx):
    return self.st.unit_id(self.st.roles[ri].unit(kind, ctx))

  def next_unit(self, ri, phase, x, y, env, roles):
    """[(phase, uid, x, y, env)] after the role's current unit."""
    role: RoleProgram = self.st.roles[ri]
    if phase == POST:
      return [(DONE, 0, x, y, env)]
    if role.reads == "blocks":
      b, c = x, y
      if phase == ITER:
        b, c = b + 1, self.ring.advance(c)
      out = []
      for exists, env2 in self.block_exists(env, roles, b):
        if exists:
          out.append((ITER, self.unit(ri, "iter", self.ring.features(c)), b, c, env2))
        else:
          out.append((POST, self.unit(ri, "post", self.ring.features(c)), b, c, env2))
      return out
    if role.reads == "tiles":
      tau, later = x, y
      if phase == PRE:
        return [(HEAD, self.unit(ri, "head", {"later": False}), 0, False, env)]
      if phase == HEAD:
        return [(TAIL, self.unit(ri, "tail", {}), tau, later, env)]
      out = []
      for exists, env2 in self.tile_exists(env, roles, tau + 1):
        if exists:
          out.append((HEAD, self.unit(ri, "head", {"later": True}), tau + 1, True, env2))
        else:
          out.append((POST, self.unit(ri, "post", {}), tau, later, env2))
      return out
    # a role reading the whole word
    p, nk = x, y
    delta = role.delta
    if phase == PRE:
      return self.head_at(ri, 0, env, roles)
    if phase == HEAD:
      out = []
      if delta is not None:
        for k, env2 in self.run_of_blocks(env, roles, p, delta + 1):
          if k == delta + 1:
            out += self.iter_at(ri, p, nk, env2, roles)
          else:
            out += self.tail_at(ri, p + k, nk, env2)
        return out
      for k, env2 in self.run_of_blocks(env, roles, p, self.window):
        if k == self.window:
          raise _Fail("unbounded drift", f"{role.name} reads a tile of more than "
                      f"{self.window} key blocks at once")
        out += self.tail_at(ri, p + k, nk, env2)
      return out
    if phase == ITER:
      out = []
      for k, env2 in self.run_of_blocks(env, roles, p + 1, delta + 1):
        if k == delta + 1:
          out += self.iter_at(ri, p + 1, nk, env2, roles)
        else:
          out += self.tail_at(ri, p + 1 + k, nk, env2)
      return out
    if phase == TAIL:
      out = []
      for s, env2 in self.symbol(env, roles, p):
        if s == "|":
          out += self.head_at(ri, p + 1, env2, roles)
        else:
          out.append((POST, self.unit(ri, "post", self.ring.features(self.cls_at(env2, p))),
                      p, nk, env2))
      return out
    raise AssertionError(phase)

  # A unit's context is read from the environment only as far as the role's
  # tables depend on it: a decision no unit needs yet would only multiply
  # the states by the futures it fixes.
  def head_at(self, ri, p, env, roles):
    role = self.st.roles[ri]
    if "n" in role.head.features or "n" in role.tail.features:
      counts = self.run_of_blocks(env, roles, p, N_CAP)
    else:
      counts = [(-1, env)]
    out = []
    for n, env2 in counts:
      ctx = {**self.ring.features(self.cls_at(env2, p)), "later": self.later_at(env2, p),
             "n": n, **self.at_tile(env2, p)}
      out.append((HEAD, self.unit(ri, "head", ctx), p, n, env2))
    return out

  def iter_at(self, ri, p, nk, env, roles):
    if "ahead" in self.st.roles[ri].iter.features:
      counts = self.run_of_blocks(env, roles, p, AHEAD_CAP)
    else:
      counts = [(-1, env)]
    out = []
    for a, env2 in counts:
      ctx = {**self.ring.features(self.cls_at(env2, p)), "ahead": a}
      out.append((ITER, self.unit(ri, "iter", ctx), p, nk, env2))
    return out

  def tail_at(self, ri, p, nk, env):
    ctx = {**self.ring.features(self.cls_at(env, p)), "n": nk, **self.at_tile(env, p)}
    return [(TAIL, self.unit(ri, "tail", ctx), p, nk, env)]

  # -- normal form --------------------------------------------------------------
  def normalise(self, state, parent=None, family=-1, moved=True):
    """The state's canonical form: the word cut to what some role still
    reads, and every counter family shifted to start at 0 (ring-order
    write indices replaced by their ranks).  ``parent``: the normal state
    it was stepped from, ``family``: the one counter family that step
    changed (-1: none, -2: none, but the named barriers changed; only
    what the step changed is shifted); ``moved=False``: the step left the
    word and every role's place in it as they were (a next event of the
    same unit, a copy landing), so the word's cut is the parent's, none."""
    if not moved and family == -1 and parent is not None:
      return state   # nothing it changed is normalised: as it was
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    st = self.st
    word = env[0]
    reads = st.reads
    # The word's start: the earliest position any role still reads (a step
    # that moved nobody leaves a normal parent's word as it was: cut).
    if parent is None or moved:
      if not word:
        cut = 0
        mixed_active = False
        for ri in st.all_readers:
          if roles[ri][0] != DONE:
            mixed_active = True
            break
      else:
        cut = len(word)
        mixed_active = False
        for ri, r in enumerate(roles):
          phase = r[0]
          if phase == DONE:
            continue
          if phase == PRE:
            cut = 0
            mixed_active = mixed_active or reads[ri] == "all"
            continue
          kind = reads[ri]
          if kind == "all":
            mixed_active = True
            if r[3] < cut:
              cut = r[3]
          elif phase != POST and cut:
            if kind == "blocks":
              at = _nth(word, "B", r[3])
            else:
              at = 0 if r[3] == 0 else _nth(word, "|", r[3] - 1) + 1
            if at < cut:
              cut = at
      if cut and self.prog.word is None:
        dropped = word[:cut]
        nb_, nt_ = dropped.count("B"), dropped.count("|")
        env = (word[cut:], self.ring.advance(env[1], nb_), env[2] or nt_ > 0) + env[3:]
        shift = {"all": cut, "blocks": nb_, "tiles": nt_}
        roles = tuple(r if r[0] in (PRE, DONE) or not shift[reads[ri]] else
                      r[:3] + (r[3] - shift[reads[ri]],) + r[4:] for ri, r in enumerate(roles))
        if st.has_generic:
          content = tuple(c if c[0] != C_GEN or c[2] < 0 else
                          (C_GEN, c[1], c[2] - cut if c[2] >= cut else -1) for c in content)
      if not mixed_active and not env[0]:
        # No role reads the word: blocks and tiles are counted apart, and only
        # relative to each other's readers.
        for kind in ("blocks", "tiles"):
          active = [ri for ri, r in enumerate(roles) if reads[ri] == kind
                    and r[0] in (HEAD, ITER, TAIL)]
          if active:
            low = min(roles[ri][3] for ri in active)
            if low:
              roles = tuple(r[:3] + (r[3] - low,) + r[4:] if reads[ri] == kind
                            and r[0] not in (PRE, DONE) else r for ri, r in enumerate(roles))
      if len(env[0]) > self.window:
        raise _Fail("unbounded drift", f"the roles drift apart by more than {self.window} "
                    f"symbols of the environment: the search would not end")
    # Counters, relative within each family.
    rl = None
    families = st.families
    if parent is not None:
      families = st.family_list[family]
    for bi, fam_waits, fam_copies, copy_set in families:
      base = mb[bi][0]
      for ri, wi in fam_waits:
        v = roles[ri][5][wi]
        if v < base:
          base = v
      for ci in fam_copies:
        if issued[ci] < base:
          base = issued[ci]
      if not base:
        continue
      if rl is None:
        rl = list(roles)
      mb = _set(mb, bi, (mb[bi][0] - base, mb[bi][1]))
      for ri, wi in fam_waits:
        r = rl[ri]
        rl[ri] = r[:5] + (_set(r[5], wi, r[5][wi] - base),) + r[6:]
      if fam_copies:
        il = list(issued)
        for ci in fam_copies:
          il[ci] -= base
        issued = tuple(il)
        tma = tuple((ci, n - base) if ci in copy_set else (ci, n) for ci, n in tma)
    if rl is not None:
      roles = tuple(rl)
    if parent is not None and family != -2:  # the named barriers as they were: normal
      if not moved:   # the ring's class and every unit as the parent's: rotated as it was
        return (env, roles, mb, tma, issued, gidx, wcount, content, named)
      return self.rotated((env, roles, mb, tma, issued, gidx, wcount, content, named))
    for i in range(len(named)):
      base = named[i][0]
      for r in roles:
        if r[11] is not None and r[11][0] == i and r[11][1] < base:
          base = r[11][1]
      if base:
        named = _set(named, i, (named[i][0] - base,) + named[i][1:])
        roles = tuple(r if r[11] is None or r[11][0] != i else
                      r[:11] + ((i, r[11][1] - base),) for r in roles)
    return self.rotated((env, roles, mb, tma, issued, gidx, wcount, content, named))

  def rotated(self, state):
    st = self.st
    env, roles = state[0], state[1]
    if st.rotation is not None and self.rotate_states and env[1] >= self.ring.stages:
      k = (env[1] - self.ring.stages) % self.ring.period
      if k and all(r[0] != PRE for r in roles):
        state = self.rotate(state, k)
    return state

  def rotate(self, state, k):
    """The state with every ring position moved back by k (symmetry)."""
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    S = self.ring.stages
    pb, pt, ps = st.perm_bar[k], st.perm_tma[k], st.perm_smem[k]

    inverse = st.inverse[k]

    def moved(p, t):
      inv = inverse[id(p)]
      return tuple([t[j] for j in inv])
    env = (env[0], S + (env[1] - S - k) % self.ring.period) + env[2:]
    new_roles = []
    for ri, r in enumerate(roles):
      phase, uid, kk, x, y, waits, waited, groups, stores, dirty, lastread, syncw = r
      if phase != DONE:
        uid = st.rotation[ri][k].get(uid)
        if uid is None:
          return state  # a unit the shift does not reach: keep the state as it is
      if st.reads[ri] == "blocks" and phase != PRE and y >= S:
        y = S + (y - S - k) % self.ring.period
      pw = st.perm_waits[ri][k]
      waits = moved(pw, waits)
      waited = sum(1 << pw[i] for i in range(len(pw)) if waited >> i & 1)
      groups = tuple(tuple(ps[si] for si in g) for g in groups)
      stores = tuple(ps[si] for si in stores)
      dirty = frozenset(ps[si] for si in dirty)
      new_roles.append((phase, uid, kk, x, y, waits, waited, groups, stores, dirty, lastread,
                        syncw))
    return (env, tuple(new_roles), moved(pb, mb), tuple((pt[ci], n) for ci, n in tma),
            moved(pt, issued), moved(pt, gidx), wcount, moved(ps, content), named)

  # -- one step ---------------------------------------------------------------
  def successors(self, state):
    """(violation or None, [(state, step, family, moved)]) -- the reduced
    successors, every enabled step of every role checked (``family`` and
    ``moved``: what the step changed, for :meth:`normalise`)."""
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    units, ubar, uwi = st.units, st.ubar, st.uwi
    reduce = self.reduce
    # The role whose next step is taken alone, if any: the first whose step
    # may be (and can be taken now); every other role's step is then only
    # checked.
    chosen = -1
    if reduce:
      alone = st.alone
      for ri, r in enumerate(roles):
        if r[0] != DONE and r[11] is None and alone[r[1]][r[2]]:
          uid, k = r[1], r[2]
          if (units[uid][k].kind != "wait"
              or mb[ubar[uid][k]][0] % 2 != r[5][uwi[uid][k]] % 2):
            chosen = ri
            break
    succ_local, succ = None, []
    waited = set()   # the barriers roles wait on (for the copies' completions)
    for ri, r in enumerate(roles):
      phase, uid, k = r[0], r[1], r[2]
      syncw = r[11]
      if phase == DONE:
        continue
      if syncw is not None:
        i, g = syncw
        if named[i][0] > g and chosen < 0:
          nr = r[:11] + (None,)
          succ.append((_set(state, 1, _set(roles, ri, nr)), (ri, None, "generation complete"),
                       -2, False))
        continue
      e = units[uid][k]
      build = chosen < 0 or chosen == ri
      kind = e.kind
      if kind == "wait":
        bi = ubar[uid][k]
        waited.add(bi)
        # A wait that stays blocked: no step (step would say None), nothing
        # to check.
        done, kk = mb[bi][0], r[5][uwi[uid][k]]
        if done < kk + 2 and done % 2 == kk % 2:
          continue
      elif not build:
        # Only checked: a retiring wait or a fence has nothing to check; a
        # named-barrier arrival with nothing to publish, only a generation
        # it would complete.
        if kind in ("wgmma_wait", "store_wait", "fence"):
          continue
        if kind in ("bar_sync", "bar_arrive") and not r[9]:
          if named[st.nid[e.bar_id]][1] + st.threads[ri] < st.named_threads[e.bar_id]:
            continue
      try:
        out = self.step(state, ri, e, build)
        if out is not None and kind == "wait" and reduce:
          self.check_lag(state, ri, e)
      except _Fail as f:
        return Violation(f.kind, f.message, [(st.names[ri], e, f.note)]), []
      if out is None:   # blocked
        continue
      if ri == chosen:
        succ_local = out
      elif chosen < 0:
        succ.extend(out)
    if succ_local is not None:
      return None, succ_local
    # TMA completions: per issuing role the oldest copy in flight, taken now
    # only where a role waits on the barrier of it or of a later copy of the
    # same role (lazy completion, see the module docstring).
    if not tma:
      deferred = []
    else:
      heads, deferred = {}, []
      writer, copy_family = st.tma_writer, st.copy_family
      for idx, (ci, n) in enumerate(tma):
        w = writer[ci]
        if w not in heads:
          heads[w] = [idx, copy_family[ci] in waited]
        elif copy_family[ci] in waited:
          heads[w][1] = True
    for w, (idx, needed) in (heads.items() if tma else ()):
      ci, n = tma[idx]
      bi = st.copy_family[ci]
      done, arr = mb[bi]
      arr += 1
      if arr >= st.arrivals[bi]:
        done, arr = done + 1, 0
      s2 = (env, roles, mb[:bi] + ((done, arr),) + mb[bi + 1:], tma[:idx] + tma[idx + 1:],
            issued, gidx, wcount, content, named)
      (succ if needed or not self.reduce else deferred).append((s2, (-1, (ci, n), ""), bi,
                                                                False))
    if succ_local is not None:
      return None, succ_local
    if not succ:
      succ = deferred
    if not succ and any(r[0] != DONE for r in roles):
      blocked = []
      for ri, r in enumerate(roles):
        if r[0] == DONE:
          continue
        if r[11] is not None:
          blocked.append(f"{st.names[ri]} in bar.sync id {st.named_ids[r[11][0]]}")
          continue
        e = st.units[r[1]][r[2]]
        extra = ""
        if e.kind == "wait":
          bi = st.bar_index[(e.buf, e.slot)]
          kk = r[5][st.waits_of[ri][(e.buf, e.slot)]]
          extra = f" (its wait #{kk} with {mb[bi][0]} phases completed, relative)"
        blocked.append(f"{st.names[ri]} at {e.src} {e.describe()}{extra}")
      return Violation("deadlock", "no role can step: " + "; ".join(blocked)), []
    return None, succ

  def wait_passes(self, state, ri, e) -> bool:
    st = self.st
    r = state[1][ri]
    done = state[2][st.ubar[r[1]][r[2]]][0]
    kk = r[5][st.uwi[r[1]][r[2]]]
    return done % 2 != kk % 2

  def step(self, state, ri, e, build: bool = True):
    """Role ri takes event e: None if blocked, else [(state, step, family, moved)] (several
    when the role then reads an undecided environment; ``build=False``: only
    checked, [] when enabled).  Raises _Fail."""
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    r = roles[ri]
    phase, uid, k, x, y, waits, waited, groups, stores, dirty, lastread, syncw = r
    kind = e.kind
    name = st.names[ri]
    note = ""
    fam = -1   # the counter family the step changes
    if kind == "wait":
        bi = st.ubar[uid][k]
        wi = st.uwi[uid][k]
        done = mb[bi][0]
        kk = waits[wi]
        if done >= kk + 2:
          raise _Fail("parity alias",
                      f"{name}'s wait on {e.buf}[{e.slot}] finds its barrier {done - kk} "
                      f"phases past the one it waits for: one parity bit cannot tell them "
                      f"apart", f"completed {done - kk} ahead")
        if done % 2 == kk % 2:
          return None
        if done < kk + 1:
          raise _Fail("parity alias",
                      f"{name}'s wait on {e.buf}[{e.slot}] passes {kk + 1 - done} phases "
                      f"early: it took an older phase for the one it waits for")
        waits = waits[:wi] + (kk + 1,) + waits[wi + 1:]
        waited = waited | (1 << wi)
        note = _PASSES[kk % 2]
        fam = bi
    elif kind == "arrive":
        if dirty:
          self.check_publish(ri, r, e)
        bi = st.ubar[uid][k]
        done, arr = mb[bi]
        arr += 1
        if arr >= st.arrivals[bi]:
          done, arr = done + 1, 0
        mb = mb[:bi] + ((done, arr),) + mb[bi + 1:]
        fam = bi
    elif kind == "tma_load":
        ci = st.ubar[uid][k]
        si = st.tma_smem[ci]
        n = issued[ci] + 1
        if (ci, n - 1) in tma:
          raise _Fail("overwrite before release", f"a copy into {e.buf}[{e.slot}] issued "
                      f"while the previous one is still in flight")
        self.check_no_async_reader(roles, si, f"a copy into {e.buf}[{e.slot}] issued")
        self.check_overlays(
            roles, tma, si,
            lambda b: f"a copy into {e.buf}[{e.slot}], which shares bytes with {b}, issued",
            lambda b: f"a copy into {e.buf}[{e.slot}] issued while a copy into {b}, which "
                      f"shares bytes with it, is in flight")
        for rj, other in enumerate(roles):
          if rj != ri:
            self.check_pending_read(rj, other, ci, n)
        issued = _set(issued, ci, n)
        fam = st.copy_family[ci]
        rb = st.slot_rbuf[ci]
        if rb >= 0:
          gidx = _set(gidx, ci, wcount[rb])
          wcount = _set(wcount, rb, wcount[rb] + 1)
        tma = tma + ((ci, n),)
        content = _set(content, si, (C_TMA,))
        for w in st.clobbers[si]:
          content = _set(content, w, (C_CLOB,))
    elif kind in ("bar_sync", "bar_arrive"):
        if dirty:
          self.check_publish(ri, r, e)
        i = st.nid[e.bar_id]
        gen, arrived, who = named[i]
        mine = gen
        arrived += st.roles[ri].threads
        who |= 1 << ri
        need = st.named_threads[e.bar_id]
        while arrived >= need:
          if who == 1 << ri:
            raise _Fail("named barrier alone",
                        f"{name} completes a generation of named barrier {e.bar_id} "
                        f"({need} threads) with its own arrivals only: it synchronises "
                        f"with nobody")
          gen, arrived = gen + 1, arrived - need
          who = 1 << ri if arrived else 0
        named = _set(named, i, (gen, arrived, who))
        if kind == "bar_sync" and gen <= mine:
          syncw = (i, mine)
        fam = -2
    elif kind == "wgmma":
        slots = []
        for b, s in e.reads:
          si = st.smem_index[(b, s)]
          if si in dirty:
            raise _Fail("async-proxy ordering",
                        f"{name} reads {b}[{s}] through the async proxy after an ordinary "
                        f"store without commit_smem between")
          lastread = self.check_read(state, ri, r, b, s, lastread)
          slots.append(si)
        groups = groups + (tuple(slots),)
    elif kind == "wgmma_wait":
        groups = groups[len(groups) - e.n:] if e.n else ()
    elif kind == "smem_load":
        lastread = self.check_read(state, ri, r, e.buf, e.slot, lastread)
    elif kind == "smem_store":
        si = st.smem_index[(e.buf, e.slot)]
        if si in stores:
          raise _Fail("async-proxy ordering",
                      f"{name} rewrites {e.buf}[{e.slot}] while its TMA store still reads it")
        self.check_no_async_reader(roles, si, f"{name} stores into {e.buf}[{e.slot}]")
        if any(st.tma_smem[c] == si for c, _ in tma):
          raise _Fail("overwrite before release", f"{name} stores into {e.buf}[{e.slot}] "
                      f"while a TMA load into it is in flight")
        self.check_overlays(
            roles, tma, si,
            lambda b: f"{name} stores into {e.buf}, which shares bytes with {b}",
            lambda b: f"{name} stores into {e.buf}, which shares bytes with {b}, while a TMA "
                      f"load into it is in flight")
        content = _set(content, si, (C_GEN, ri, self.anchor(ri, r)))
        for w in st.clobbers[si]:
          content = _set(content, w, (C_CLOB,))
        dirty = dirty | {si}
    elif kind == "fence":
        dirty = frozenset()
    elif kind == "tma_store":
        si = st.smem_index[(e.buf, e.slot)]
        if si in dirty:
          raise _Fail("async-proxy ordering",
                      f"{name} reads {e.buf}[{e.slot}] through the async proxy after an "
                      f"ordinary store without commit_smem between")
        self.check_generic(state, ri, r, si, e.buf, e.slot)
        stores = stores + (si,)
    elif kind == "store_wait":
        stores = stores[len(stores) - e.n:] if e.n else ()
    else:
      raise AssertionError(kind)
    if not build:
      return []
    touched = ()
    if kind == "tma_load" and st.slot_rbuf[ci] >= 0:
      touched = (st.slot_rbuf[ci],)
    elif kind in ("wgmma", "smem_load") and lastread != r[10]:
      touched = tuple(bi for bi in range(len(lastread)) if lastread[bi] != r[10][bi])
    if k + 1 < len(st.units[uid]) and not touched:   # the next event of the same unit
      nr = (phase, uid, k + 1, x, y, waits, waited, groups, stores, dirty, lastread, syncw)
      return [((env, roles[:ri] + (nr,) + roles[ri + 1:], mb, tma, issued, gidx, wcount,
                content, named), (ri, e, note), fam, False)]
    out = []
    for ph, u, kk_, x2, y2, env2 in self.settle(ri, phase, uid, k + 1, x, y, env, roles):
      nr = (ph, u, kk_, x2, y2, waits, waited, groups, stores, dirty, lastread, syncw)
      roles2, gidx2, wcount2 = roles[:ri] + (nr,) + roles[ri + 1:], gidx, wcount
      for bi in touched:
        gidx2, wcount2, roles2 = self.rerank(bi, gidx2, wcount2, roles2)
      out.append(((env2, roles2, mb, tma, issued, gidx2, wcount2, content, named),
                  (ri, e, note), fam, not (ph == phase and x2 == x and y2 == y and env2 is env)))
    return out

  def check_lag(self, state, ri, e):
    """Role ri's wait on e's barrier can pass (one phase completed past its
    last): may another phase complete before it passes?  An arrival that
    would complete one, or a copy completing the barrier in flight."""
    st = self.st
    env, roles, mb, tma, *_ = state
    key = (e.buf, e.slot)
    bi = st.bar_index[key]
    done, arr = mb[bi]
    copy_family = st.copy_family   # a copy's barrier, by its index
    for ci, n in tma:
      if copy_family[ci] == bi:
        raise _Fail("parity alias",
                    f"{st.names[ri]} may pass its wait on {e.buf}[{e.slot}] (a phase completed) "
                    f"while a copy that completes the next phase is in flight: one parity "
                    f"bit cannot tell them apart")
    if arr + 1 >= st.arrivals[bi]:
      for rj, other in enumerate(roles):
        if rj == ri or other[0] == DONE or other[11] is not None:
          continue
        o = st.units[other[1]][other[2]]
        if o.kind == "arrive" and (o.buf, o.slot) == key:
          raise _Fail("parity alias",
                      f"{st.names[ri]} may pass its wait on {e.buf}[{e.slot}] while "
                      f"{st.names[rj]}'s arrive (at {o.src}) completes the next phase: one "
                      f"parity bit cannot tell them apart")

  def rerank(self, bi, gidx, wcount, roles):
    """Ring order compares a buffer's write indices only with each other:
    keep their ranks, not their values (called where they change)."""
    slots = self.st.rbuf_slots[bi][1]
    vals = {wcount[bi]}
    for ci in slots:
      g = gidx[ci]
      if g >= 0:
        vals.add(g)
    for r in roles:
      g = r[10][bi]
      if g >= 0:
        vals.add(g)
    if max(vals) == len(vals) - 1:
      return gidx, wcount, roles
    rank = {v: i for i, v in enumerate(sorted(vals))}
    gl = list(gidx)
    for ci in slots:
      if gl[ci] >= 0:
        gl[ci] = rank[gl[ci]]
    return (tuple(gl), _set(wcount, bi, rank[wcount[bi]]),
            tuple(r if r[10][bi] < 0 else
                  r[:10] + (_set(r[10], bi, rank[r[10][bi]]),) + r[11:] for r in roles))

  def anchor(self, ri, r):
    return r[3] if self.st.roles[ri].reads == "all" and r[0] not in (PRE, DONE) else -2

  def check_publish(self, ri, r, e):
    st = self.st
    for si in r[9]:
      b, s = st.smem_slots[si]
      if st.async_readers.get(b, set()) - {ri}:
        raise _Fail("async-proxy ordering",
                    f"{st.names[ri]} publishes {b}[{s}] to another role's async-proxy read "
                    f"without commit_smem before the arrive")

  def check_no_async_reader(self, roles, si, what, kind="overwrite before release"):
    st = self.st
    b, s = st.smem_slots[si]
    for rj, other in enumerate(roles):
      for g in other[7]:
        if si in g:
          raise _Fail(kind, f"{what} while a wgmma of {st.names[rj]} still reads "
                      f"{b}[{s}]")
      if si in other[8]:
        raise _Fail(kind, f"{what} while a TMA store of {st.names[rj]} still reads "
                    f"{b}[{s}]")

  def check_overlays(self, roles, tma, si, writes, in_flight):
    """A write into slot si: no slot sharing bytes with it may still be read
    asynchronously or loaded by a TMA in flight; ``writes`` and ``in_flight``
    word either failure, given the other slot's buffer."""
    st = self.st
    for w in st.clobbers[si]:
      b = st.smem_slots[w][0]
      self.check_no_async_reader(roles, w, writes(b), "overlay")
      if any(st.tma_smem[c] == w for c, _ in tma):
        raise _Fail("overlay", in_flight(b))

  def check_pending_read(self, rj, other, ci, n):
    """A copy n into slot ci is issued: is role rj still to read copy n - 1
    (it waited for it, and its next event reads the slot)?"""
    st = self.st
    if other[0] == DONE or other[11] is not None:
      return
    e = st.units[other[1]][other[2]]
    key = st.tma_slots[ci]
    reads = e.reads if e.kind == "wgmma" else ((e.buf, e.slot),) if e.kind == "smem_load" else ()
    if key not in reads:
      return
    cb = st.copy_bar[key]
    wi = st.waits_of[rj].get(cb)
    if wi is not None and other[6] >> wi & 1 and other[5][wi] == n - 1:
      raise _Fail("overwrite before release",
                  f"a copy into {key[0]}[{key[1]}] issued before {st.names[rj]} read the "
                  f"copy it waited for (at {e.src})")

  def check_read(self, state, ri, r, b, s, lastread):
    """A read of (b, s) by role ri: the copy it waited for, or its own (or its
    step's) ordinary store.  Returns the role's updated ring-order record."""
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    key = (b, s)
    si = st.smem_index[key]
    name = st.names[ri]
    if not st.is_tma[si]:
      self.check_generic(state, ri, r, si, b, s)
      return lastread
    ci = st.tma_index[key]
    c = content[si]
    if c[0] == C_CLOB:
      raise _Fail("overlay", f"{name} reads {b}[{s}] after a write into memory sharing its "
                  f"bytes clobbered it")
    if c[0] == C_GEN:
      raise _Fail("stale read", f"{name} reads {b}[{s}] as the copy it waited for, but an "
                  f"ordinary store has overwritten it")
    if key in st.stationary:
      if issued[ci] < 1 or (ci, issued[ci]) in tma:
        raise _Fail("read before copy completed",
                    f"{name} reads {b}[{s}] before its one copy has landed")
      return lastread
    cb = st.copy_bar[key]
    wi = st.waits_of[ri].get(cb)
    if wi is None or not r[6] >> wi & 1:
      raise _Fail("read before copy completed",
                  f"{name} reads {b}[{s}] without having waited on {cb[0]}[{cb[1]}]")
    n = r[5][wi]
    have = issued[ci]
    if have < n:
      raise _Fail("read before copy completed",
                  f"{name} reads {b}[{s}] expecting the copy it waited for, which is not "
                  f"even issued")
    if have == n and (ci, n) in tma:
      raise _Fail("read before copy completed",
                  f"{name} reads {b}[{s}] expecting the copy it waited for, which is still "
                  f"in flight")
    if have > n:
      raise _Fail("overwrite before release",
                  f"{name} reads {b}[{s}] expecting the copy it waited for, but "
                  f"{have - n} later cop{'y' if have - n == 1 else 'ies'} already overwrote it")
    rb = st.slot_rbuf[ci]
    if rb >= 0:
      g = gidx[ci]
      if lastread[rb] >= 0 and g < lastread[rb]:
        raise _Fail("ring order",
                    f"{name} reads a copy of {b} issued before one it read already: its "
                    f"slot index drifted from the producer's")
      lastread = _set(lastread, rb, g)
    return lastread

  def check_generic(self, state, ri, r, si, b, s):
    st = self.st
    c = state[7][si]
    name = st.names[ri]
    if c[0] == C_CLOB:
      raise _Fail("overlay", f"{name} reads {b}[{s}] after a write into memory sharing its "
                  f"bytes clobbered it")
    if c[0] == C_NONE:
      raise _Fail("stale read", f"{name} reads {b}[{s}] before anything is stored there")
    if c[0] == C_TMA:
      raise _Fail("stale read", f"{name} reads {b}[{s}] as its own store, but a TMA copy "
                  f"has overwritten it")
    _, writer, step = c
    if writer != ri and (step < 0 or step != self.anchor(ri, r)):
      raise _Fail("stale read", f"{name} reads {b}[{s}], which {st.names[writer]} stored "
                  f"at another step (a handoff must be of the reader's own step)")

  # -- the search -------------------------------------------------------------
  def initial(self):
    """The initial states: every role at its first event (a role whose
    units before it are empty has read some environment to get there)."""
    st = self.st
    bases = [(PRE, st.unit_id(role.pre), 0, 0, 0 if role.reads != "tiles" else False,
              tuple(0 for _ in st.waits_of[ri]), 0, (), (), frozenset(),
              tuple(-1 for _ in st.ring_buffers), None) for ri, role in enumerate(st.roles)]
    partial = [(("", 0, False, False, not self.prog.persistent, 0, 0), tuple(bases))]
    for ri in range(len(st.roles)):
      grown = []
      for env, roles in partial:
        r = roles[ri]
        for ph, u, k, x, y, env2 in self.settle(ri, *r[:5], env, roles):
          grown.append((env2, _set(roles, ri, (ph, u, k, x, y) + r[5:])))
      partial = grown
    return [(env, roles, tuple((0, 0) for _ in st.bar_keys), (),
             tuple(0 for _ in st.tma_slots), tuple(-1 for _ in st.tma_slots),
             tuple(0 for _ in st.ring_buffers), tuple((C_NONE,) for _ in st.smem_slots),
             tuple((0, 0, 0) for _ in st.named_ids)) for env, roles in partial]


def _slots(e: Event):
  """(array, slot) pairs an event names: its buffer or barrier, a copy's
  barrier, a wgmma's operands."""
  out = []
  if e.buf and e.slot is not None:
    out.append((e.buf, e.slot))
  if e.bar and e.bar_slot is not None:
    out.append((e.bar, e.bar_slot))
  out += [(b, sl) for b, sl in e.reads if sl is not None]
  return out


def _rotate_event(e: Event, arrays, stages: int, k: int) -> Event:
  rot = lambda b, sl: (sl + k) % stages if b in arrays and sl is not None else sl
  if not (e.buf in arrays or e.bar in arrays or any(b in arrays for b, _ in e.reads)):
    return e
  return dataclasses.replace(e, slot=rot(e.buf, e.slot), bar_slot=rot(e.bar, e.bar_slot),
                             reads=tuple((b, rot(b, sl)) for b, sl in e.reads))


def _set(t: tuple, i: int, v) -> tuple:
  return t[:i] + (v,) + t[i + 1:]


def _nth(word: str, ch: str, n: int) -> int:
  """Index of the n-th (0-based) ch in word, or len(word)."""
  i = -1
  for _ in range(n + 1):
    i = word.find(ch, i + 1)
    if i < 0:
      return len(word)
  return i


@contextlib.contextmanager
def collector_paused():
  """Python's cyclic garbage collector off for the block (as it was after).
  The search allocates millions of tuples and keeps every state it reached;
  none of them is in a reference cycle, so reference counting frees all of
  it, while each pass of the collector walks every live container -- the
  states kept and the JAX modules imported -- which cost about a third of
  a check.  Tracing and learning (:mod:`harness.proofs.prove_extracted`)
  leave next to no cyclic garbage either and run under it as well."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


def check(prog: LaunchProgram, *, max_states: int = MAX_STATES, reduce: bool = True,
          record: bool = False) -> CheckResult:
  """Every property of the module docstring for one launch, every environment.
  ``reduce=False``: every interleaving, no reduction (to test them);
  ``record``: also list the units' events no explored step took (with the
  ring's rotation off, which would fold some of them into others)."""
  with collector_paused():
    return _check(prog, max_states=max_states, reduce=reduce, record=record)


def _check(prog: LaunchProgram, *, max_states: int, reduce: bool, record: bool) -> CheckResult:
  start = time.perf_counter()
  st = _Static(prog)
  if st.violations:
    return CheckResult(False, 0, time.perf_counter() - start, st.violations[0])
  search = _Search(st, max_states, reduce)
  if record:
    search.rotate_states = False
  taken: set = set()
  parent: dict = {}

  def fail(v: Violation, state, last=None):
    steps, words = [], []
    s = state
    while parent[s] is not None:
      s, step, word = parent[s]
      steps.append(step)
      words.append(word)
    steps.reverse()
    trace = []
    for ri, ev, note in steps:
      if ri == -1:
        ci, n = ev
        buf, slot = st.tma_slots[ci]
        bar = st.copy_bar[(buf, slot)]
        trace.append(("TMA", Event("tma_done", "TMA", "(hardware)", buf, slot, bar=bar[0],
                                   bar_slot=bar[1]), f"the copy into {buf}[{slot}] lands"))
      elif ev is None:
        trace.append((st.names[ri], Event("bar_sync", st.names[ri], "(hardware)"), note))
      else:
        trace.append((st.names[ri], ev, note))
    v.trace = trace + v.trace
    v.environment = describe_word(_word_of(parent, roots, state))
    return CheckResult(False, len(parent), time.perf_counter() - start, v)

  try:
    raw_inits = search.initial()
    inits = [search.normalise(s) for s in raw_inits]
  except (_Fail, CoverageError) as f:
    v = Violation(getattr(f, "kind", "coverage"), getattr(f, "message", str(f)))
    return CheckResult(False, 0, time.perf_counter() - start, v)
  roots = {}
  for init, raw in zip(inits, raw_inits):
    parent[init] = None
    roots[init] = raw[0][0]
  stack = list(inits)
  successors, normalise, keep, push = (search.successors, search.normalise,
                                       parent.setdefault, stack.append)
  while stack:
    state = stack.pop()
    try:
      violation, succ = successors(state)
    except CoverageError as f:
      return fail(Violation("coverage", str(f)), state)
    if violation is not None:
      return fail(violation, state)
    before = state[0][0]
    for nxt, step, family, moved in succ:
      try:
        norm = normalise(nxt, state, family, moved)
      except _Fail as f:
        return fail(Violation(f.kind, f.message), state)
      if record and step[0] >= 0 and step[1] is not None:
        taken.add((step[0], step[1]))
      word = nxt[0][0]
      size = len(parent)
      keep(norm, (state, step, "" if word is before else word[len(before):]))
      if len(parent) != size:
        if size >= max_states:
          raise RuntimeError(f"{prog.name}: state budget {max_states} exceeded")
        push(norm)
  result = CheckResult(True, len(parent), time.perf_counter() - start)
  if record:
    result.unexecuted = sorted({(st.names[ri], e) for ri, us in enumerate(st.units_of)
                                for _, evs in us for e in evs if (ri, e) not in taken},
                               key=repr)
  return result


def _word_of(parent, roots, state) -> str:
  """The environment a path read, from the symbols each step appended."""
  parts = []
  s = state
  while parent[s] is not None:
    s, _, grown = parent[s]
    parts.append(grown)
  parts.append(roots.get(s, ""))
  return "".join(reversed(parts))
