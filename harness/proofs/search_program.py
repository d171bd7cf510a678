"""What the protocol search (:mod:`harness.proofs.search`) knows of a launch
program before it explores a state: its units as numbers, the shared-memory
slots and barriers they touch, the counter families normalised together,
which steps are taken alone, the named barriers' ids, and the ring's
symmetry, if the program has it."""

from __future__ import annotations

import dataclasses

from harness.proofs.events import Event
from harness.proofs.role_programs import AHEAD_CAP, N_CAP, CoverageError, LaunchProgram
from harness.proofs.violations import Violation
from kernel.sync import barriers as kbarriers

# Steps taken alone once a role reaches them (see the search's docstring).
EAGER = frozenset(("wait", "arrive", "tma_load"))


class Static:
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
    self._slots_of(units_of)
    self._families(units_of)
    self.reads = [r.reads for r in self.roles]
    self.threads = [r.threads for r in self.roles]
    self.all_readers = [ri for ri, r in enumerate(self.reads) if r == "all"]
    self.has_generic = any(e.kind == "smem_store" for us in units_of for _, evs in us
                           for e in evs)
    self._named()
    self._unit_tables(units_of)
    self.tma_writer = [self.writer[key] for key in self.tma_slots]
    self.rotation = None if prog.word is not None else self._rotation()
    # per unit, per event: taken alone when reached (see check's reductions)
    self.alone = [[(self.local_any(e) and e.kind not in ("wgmma_wait", "store_wait"))
                   or e.kind in EAGER for e in evs] for evs in self.units]

  def _slots_of(self, units_of):
    """The shared-memory slots, barriers and copies the units touch, numbered."""
    # Copies: (buffer, slot) -> the (barrier, slot) they complete; its writer role.
    self.copy_bar, self.writer, stationary, ring_slots = {}, {}, set(), set()
    smem_slots, bar_keys, access = set(), set(), {}
    self.async_readers: dict = {}
    for ri, us in enumerate(units_of):
      for kind, evs in us:
        for e in evs:
          where = [(self.names[ri], e, "")]
          if e.kind == "tma_load":
            key = (e.buf, e.slot)
            # one writer per slot: roles may fill slots of one buffer each
            if self.writer.setdefault(key, ri) != ri:
              raise ValueError(f"{e.src}: {e.buf}[{e.slot}] is written by TMA from two "
                               f"roles: not modelled")
            prev = self.copy_bar.setdefault(key, (e.bar, e.bar_slot))
            if prev != (e.bar, e.bar_slot):
              self.violations.append(Violation(
                  "barrier mismatch", f"copies into {e.buf}[{e.slot}] complete both "
                  f"{prev[0]}[{prev[1]}] and {e.bar}[{e.bar_slot}]", where))
            # Filled once per launch: before the tile loop, or (one tile)
            # outside its key loop.
            once = kind == "pre" or (not self.prog.persistent and kind != "iter")
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
    self._index(stationary, ring_slots, smem_slots, bar_keys, access)

  def _index(self, stationary, ring_slots, smem_slots, bar_keys, access):
    """Numbers for the slots and barriers, and which slots share bytes or
    are a role's own."""
    arrivals = {name: a for name, a, _ in self.prog.barriers}
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
    self.overlaps = {a: set(bs) for a, bs in self.prog.overlaps}
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

  def _families(self, units_of):
    """The counter families (normalised together): per barrier key, the
    waits on it and the copies whose barrier it is.  Stationary barriers
    stay absolute (they count one copy)."""
    # Waits: per role the barrier keys it waits on (its phase bits).
    self.waits_of = []
    for ri, us in enumerate(units_of):
      keys = sorted({(e.buf, e.slot) for _, evs in us for e in evs if e.kind == "wait"},
                    key=str)
      self.waits_of.append({k: i for i, k in enumerate(keys)})
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

  def _unit_tables(self, units_of):
    """Per event, whether it is local; every unit numbered; per unit, per
    event: the barrier index of a wait or arrive (a TMA load's: its slot's
    copy index), and a wait's index among its role's."""
    # per role, per event object: local (taken alone) or not
    self.local = [{} for _ in self.roles]
    for ri, us in enumerate(units_of):
      for _, evs in us:
        for e in evs:
          self.local[ri][e] = self._is_local(ri, e)
    for ri, us in enumerate(units_of):
      for _, evs in us:
        self.unit_id(evs)
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
    found = self._ring_arrays(S, M)
    if found is None:
      return None
    arrays, pairs = found
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
    return maps if self._permutations(arrays, S, M) else None

  def _ring_arrays(self, S, M):
    """(the arrays whose slots a shift of the ring advances, the pairs of
    units at warm classes x and x + 1 that show it), or None where a unit
    changes otherwise."""
    ring = self.ring
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
    return arrays, pairs

  def _permutations(self, arrays, S, M) -> bool:
    """The index permutations of the slot-indexed state per k, and their
    inverses; False where a ring array some state names only some slots of."""
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
      return False
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
    return True

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
