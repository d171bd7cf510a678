"""Check the protocol :mod:`harness.extract` read out of a kernel's jaxpr.

For one extracted launch (every role's event sequence under one environment:
grid point, per-tile key ranges, hence trip counts including zero) this
explores **every interleaving** of the roles and of the TMA completions
(explicit-state search with a visited set; a step that only touches its own
role's state, and does not end a read other roles' steps are checked
against, is taken without branching, and the safety of every enabled
step is checked at every state, so the reduction loses no violation), under
the hardware semantics encoded once here:

* mbarrier: ``num_arrivals`` arrivals complete a phase; a TMA load's
  completion is one arrival (its ``arrive.expect_tx``).  A wait passes when
  the barrier's completed-phase count differs in parity from the waiter's own
  phase bit, which Mosaic GPU flips on every wait of that thread on that
  barrier (so the k-th wait, 0-based, waits with parity k mod 2).
* named barrier: a generation completes when its thread count has arrived;
  surplus arrivals count toward the next; ``bar.sync`` arrives and waits for
  the generation its arrival counted toward.
* wgmma: groups complete in issue order; a read of shared memory lasts from
  the issue to the wait that leaves fewer groups in flight than its own
  position (``run_state``'s end waits for all).
* TMA store: reads its shared memory until a ``wait_smem_to_gmem`` leaves it
  behind.

Properties (each failure is reported with a trace of kernel source lines):

* **read before copy completed**: a read (wgmma operand, load) of a ring
  slot sees exactly the copy its reader waited for, completed.  Which copy the
  reader means is what its waits say: the n-th wait of the reader on the
  barrier the slot's copies complete means the n-th copy into that slot.
* **ring order**: across a buffer's slots each reader takes the copies in the
  order they were issued, never an older one after a newer (a slot index that
  drifts from the producer's, e.g. a missing ``prev_iters`` carry).
* **overwrite before release**: a TMA load into a slot is issued only once
  every reader of the slot's previous copy has retired its reads of it.
* **parity alias**: a pending wait never sees its barrier two or more phases
  ahead of the phase it waits for (one parity bit could not tell them apart).
* **no deadlock**: every role runs to its end; every reachable state either
  steps or is the end.
* **named barriers**: ids outside Mosaic GPU's reserved ones and the
  hardware's 16, one use (kernel/barriers.py helper) per id, one thread count
  per id, and no generation completed by one role's arrivals alone (a
  barrier that synchronises with nobody: a token passed to oneself).
* **async-proxy ordering**: shared memory written by ordinary stores is fenced
  (``commit_smem``) before an async-proxy read of it (TMA store, wgmma) by the
  same role, and before an arrive that publishes it to a role that reads it
  through the async proxy; it is not rewritten while a TMA store still reads it.

This is a bounded check: it is exhaustive over interleavings for the
environments it is given (trip-count sequences per tile, chosen by
:mod:`harness.prove_extracted`), not a proof for every trip count.
"""

from __future__ import annotations

import dataclasses
import time

from harness.extract import Event, Extracted
from kernel import barriers as kbarriers

MAX_STATES = 2_000_000
# Local steps that end reads other roles' steps are checked against: never
# taken ahead of the others (see check's reduction).
RETIRING = frozenset(("wgmma_wait", "store_wait"))
LOCAL = frozenset(("wgmma", "wgmma_wait", "smem_load", "smem_store", "fence", "tma_store",
                   "store_wait"))


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
      lines.append(f"  {i:3d} {role:<10} {ev.src:<22} {ev.describe()}"
                   + (f"  [{note}]" if note else "")
)
    return "\n".join(lines)


@dataclasses.dataclass
class CheckResult:
  ok: bool
  states: int
  seconds: float
  violation: Violation | None = None


class _Static:
  """Everything about the roles that does not depend on the interleaving."""

  def __init__(self, ex: Extracted):
    self.ex = ex
    self.roles = sorted(ex.roles)
    self.events = [ex.roles[r] for r in self.roles]
    self.violations: list[Violation] = []
    # Copies: (buffer, slot) -> the (barrier, slot) they complete, the writer role.
    self.copy_bar, self.writer = {}, {}
    for ri, evs in enumerate(self.events):
      for pc, e in enumerate(evs):
        if e.kind == "tma_load":
          key = (e.buf, e.slot)
          if self.writer.setdefault(e.buf, ri) != ri:
            raise ValueError(f"{e.src}: {e.buf} is written by TMA from two roles: not modelled")
          prev = self.copy_bar.setdefault(key, (e.bar, e.bar_slot))
          if prev != (e.bar, e.bar_slot):
            self.violations.append(Violation(
                "barrier mismatch", f"copies into {e.buf}[{e.slot}] complete both "
                f"{prev[0]}[{prev[1]}] and {e.bar}[{e.bar_slot}]", [(self.roles[ri], e, "")]))
    self.copies = {}
    for evs in self.events:
      for e in evs:
        if e.kind == "tma_load":
          self.copies[(e.buf, e.slot)] = self.copies.get((e.buf, e.slot), 0) + 1
    # Writes per (buffer, slot) in issue order, with a global order per buffer.
    self.global_index = {}   # (buf, slot, n) -> index among the buffer's writes
    self.writes_before = []  # per role: per pc, {(buf, slot): writes issued before pc}
    for ri, evs in enumerate(self.events):
      counts, per_pc, order = {}, [], {}
      for e in evs:
        per_pc.append(dict(counts))
        if e.kind == "tma_load":
          key = (e.buf, e.slot)
          counts[key] = counts.get(key, 0) + 1
          self.global_index[(e.buf, e.slot, counts[key])] = order.get(e.buf, 0)
          order[e.buf] = order.get(e.buf, 0) + 1
      per_pc.append(dict(counts))
      self.writes_before.append(per_pc)
    self.barrier_keys = sorted({(e.buf, e.slot) for evs in self.events for e in evs
                                if e.kind in ("wait", "arrive")}
                               | {v for v in self.copy_bar.values()})
    self.bar_index = {k: i for i, k in enumerate(self.barrier_keys)}
    self.arrivals = {k: self.ex.barriers[k[0]].num_arrivals if k[0] in self.ex.barriers else 1
                     for k in self.barrier_keys}
    self._per_role()
    self._named()
    self._fences()
    self._overlay_uses()

  def _overlay_uses(self):
    """Per role, the last step at which it still uses each buffer that shares
    bytes with another (a RefUnion overlay): until then nobody may store into
    the other."""
    self.last_use = []
    overl = self.ex.overlaps
    for ri, evs in enumerate(self.events):
      last, groups, pending = {}, [], []
      for pc, e in enumerate(evs):
        touched = []
        if e.kind in ("smem_store", "smem_load", "tma_load"):
          touched.append(e.buf)
        elif e.kind == "wgmma":
          groups.append([b for b, _ in e.reads])
        elif e.kind == "wgmma_wait":
          while len(groups) > e.n:
            touched += groups.pop(0)
        elif e.kind == "tma_store":
          pending.append(e.buf)
        elif e.kind == "store_wait":
          keep = pending[len(pending) - e.n:] if e.n else []
          touched += pending[:len(pending) - len(keep)]
          pending = keep
        for b in touched:
          if b in overl:
            last[b] = pc
      for b in [x for g in groups for x in g] + pending:
        if b in overl:
          last[b] = len(evs)
      self.last_use.append(last)

  def _per_role(self):
    """Wait parities; the copy each read means; when each read retires."""
    self.wait_k = []        # per role, per pc: k (0-based wait count on that barrier)
    self.reads = []         # per role, per pc: ((buf, slot, n), ...) expected copies
    self.inflight = []      # per role, per pc: {(buf, slot)} read by wgmma in flight
    self.release = []       # per role: (buf, slot, n) -> pc after which it is released
    for ri, evs in enumerate(self.events):
      role = self.roles[ri]
      waits, ks, reads = {}, [], []
      groups, inflight, release = [], [], {}
      for pc, e in enumerate(evs):
        inflight.append(frozenset(x for g in groups for x in g[1]))
        ks.append(None)
        rd = ()
        if e.kind == "wait":
          key = (e.buf, e.slot)
          ks[-1] = waits.get(key, 0)
          waits[key] = waits.get(key, 0) + 1
        elif e.kind in ("wgmma", "smem_load"):
          where = e.reads if e.kind == "wgmma" else ((e.buf, e.slot),)
          exp = []
          for buf, slot in where:
            if (buf, slot) not in self.copy_bar:
              if buf in self.writer:
                self.violations.append(Violation(
                    "read before copy completed",
                    f"{role} reads {buf}[{slot}], a slot no copy ever fills", [(role, e, "")]))
              continue
            n = waits.get(self.copy_bar[(buf, slot)], 0)
            if n == 0 and self.copies.get((buf, slot)) == 1:
              # A slot filled once (a stationary tile) read by a role that
              # never waits its barrier: ordered through another role's wait
              # and a named barrier.  The search checks at the read, in every
              # interleaving, that the one copy has completed.
              n = 1
            if n == 0:
              self.violations.append(Violation(
                  "read before copy completed",
                  f"{role} reads {buf}[{slot}] without having waited on "
                  f"{self.copy_bar[(buf, slot)][0]}[{slot}]", [(role, e, "")]))
              continue
            exp.append((buf, slot, n))
          rd = tuple(exp)
          if e.kind == "wgmma":
            groups.append((pc, rd and frozenset((b, s) for b, s, _ in rd), rd))
          else:
            for x in rd:
              release[x] = pc
        elif e.kind == "wgmma_wait":
          while len(groups) > e.n:
            _, _, rdg = groups.pop(0)
            for x in rdg:
              release[x] = pc
        reads.append(rd)
      inflight.append(frozenset(x for g in groups for x in g[1]))
      for _, _, rdg in groups:  # never retired: released only at the end
        for x in rdg:
          release[x] = len(evs)
      self.wait_k.append(ks)
      self.reads.append(reads)
      self.inflight.append(inflight)
      self.release.append(release)
      # Ring order: the copies a role reads from one buffer never go back.
      last = {}
      rings = {b for (b, _), c in self.copies.items() if c > 1}
      for pc, rd in enumerate(reads):
        for buf, slot, n in rd:
          if buf not in rings and n == 1:
            continue  # stationary tiles, filled once: no order among their slots
          g = self.global_index.get((buf, slot, n))
          if g is None:
            self.violations.append(Violation(
                "read before copy completed",
                f"{role} waits for copy {n} into {buf}[{slot}], which is never issued",
                [(role, evs[pc], "")]))
            continue
          if g < last.get(buf, (-1,))[0]:
            lg, lpc = last[buf]
            self.violations.append(Violation(
                "ring order",
                f"{role} reads copy #{g} of {buf} after copy #{lg}: its slot index "
                f"drifted from the producer's", [(role, evs[lpc], f"copy #{lg}"),
                                                  (role, evs[pc], f"copy #{g}")]))
          last[buf] = (g, pc)

  def _named(self):
    reserved = set(kbarriers.MOSAIC_RESERVED_IDS)
    family, threads = {}, {}
    for ri, evs in enumerate(self.events):
      for e in evs:
        if e.kind not in ("bar_sync", "bar_arrive"):
          continue
        where = [(self.roles[ri], e, "")]
        if e.bar_id in reserved or not 0 <= e.bar_id < kbarriers.HW_NAMED_BARRIERS:
          self.violations.append(Violation(
              "named barrier id", f"id {e.bar_id} is Mosaic GPU's or past the hardware's "
              f"{kbarriers.HW_NAMED_BARRIERS}", where))
        f = family.setdefault(e.bar_id, (e.family, e))
        if f[0] != e.family:
          self.violations.append(Violation(
              "named barrier id collision",
              f"id {e.bar_id} serves both {f[0]} and {e.family}",
              [(self.roles[ri], f[1], f[0]), (self.roles[ri], e, e.family)]))
        t = threads.setdefault(e.bar_id, (e.threads, e))
        if t[0] != e.threads:
          self.violations.append(Violation(
              "named barrier id collision",
              f"id {e.bar_id} is used with {t[0]} and {e.threads} threads", where))
    self.named_ids = sorted(family)
    self.named_threads = {i: t[0] for i, t in threads.items()}

  def _fences(self):
    async_read = {}  # buffer -> roles that read it through the async proxy
    for ri, evs in enumerate(self.events):
      for e in evs:
        if e.kind == "tma_store":
          async_read.setdefault(e.buf, set()).add(ri)
        elif e.kind == "wgmma":
          for b, _ in e.reads:
            async_read.setdefault(b, set()).add(ri)
    for ri, evs in enumerate(self.events):
      role = self.roles[ri]
      dirty, pending = {}, []   # (buf, slot) -> store event; TMA stores in flight
      for e in evs:
        if e.kind == "smem_store":
          key = (e.buf, e.slot)
          for st in pending:
            if (st.buf, st.slot) == key:
              self.violations.append(Violation(
                  "async-proxy ordering",
                  f"{role} rewrites {e.buf}[{e.slot}] while a TMA store still reads it",
                  [(role, st, "store in flight"), (role, e, "")]))
          dirty[key] = e
        elif e.kind == "fence":
          dirty.clear()
        elif e.kind in ("tma_store", "wgmma"):
          for key in ((e.buf, e.slot),) if e.kind == "tma_store" else e.reads:
            if key in dirty:
              self.violations.append(Violation(
                  "async-proxy ordering",
                  f"{role} reads {key[0]}[{key[1]}] through the async proxy after an "
                  f"ordinary store without commit_smem between",
                  [(role, dirty[key], "generic store"), (role, e, "async read")]))
          if e.kind == "tma_store":
            pending.append(e)
        elif e.kind == "store_wait":
          pending = pending[len(pending) - e.n:] if e.n else []
        elif e.kind in ("arrive", "bar_arrive", "bar_sync"):
          for key, st in dirty.items():
            if async_read.get(key[0], set()) - {ri}:
              self.violations.append(Violation(
                  "async-proxy ordering",
                  f"{role} publishes {key[0]}[{key[1]}] to another role's async-proxy "
                  f"read without commit_smem before the arrive",
                  [(role, st, "generic store"), (role, e, "publishing arrive")]))


def check(ex: Extracted, *, environment: str = "", max_states: int = MAX_STATES,
          fifo: bool = True) -> CheckResult:
  """Every property of the module docstring for one extracted launch."""
  start = time.perf_counter()
  st = _Static(ex)
  if st.violations:
    v = st.violations[0]
    v.environment = environment
    return CheckResult(False, 0, time.perf_counter() - start, v)
  roles, events = st.roles, st.events
  nroles = len(roles)
  ends = tuple(len(e) for e in events)
  nb = len(st.barrier_keys)
  named_ids = st.named_ids
  nid = {i: k for k, i in enumerate(named_ids)}
  role_threads = [ex.threads[r] for r in roles]
  # State: pcs, per-barrier (completed, arrivals), in-flight TMA loads,
  # per named id (generation, arrived threads), per role the generation its
  # bar.sync waits for (or -1).
  init = (tuple(0 for _ in roles), tuple((0, 0) for _ in range(nb)), (),
          tuple((0, 0, 0) for _ in named_ids), tuple((-1, -1) for _ in roles))
  parent = {init: None}
  stack = [init]

  def trace_to(state, last=None):
    steps = []
    while parent[state] is not None:
      state, step = parent[state]
      steps.append(step)
    steps.reverse()
    if last:
      steps.append(last)
    out = []
    for ri, pc, note in steps:
      if ri == -1:
        buf, slot, n = pc
        bar = st.copy_bar[(buf, slot)]
        out.append(("TMA", Event("tma_done", "TMA", "(hardware)", buf, slot, bar=bar[0],
                                 bar_slot=bar[1]), f"copy {n} into {buf}[{slot}] completes"))
      else:
        out.append((roles[ri], events[ri][pc], note))
    return out

  def content(buf, slot, state):
    w = st.writer[buf]
    issued = st.writes_before[w][state[0][w]].get((buf, slot), 0)
    return issued, (buf, slot, issued) in state[2]

  def fail(kind, msg, state, last):
    return CheckResult(False, len(parent), time.perf_counter() - start,
                       Violation(kind, msg, trace_to(state, last), environment))

  while stack:
    state = stack.pop()
    pcs, mb, tma, named, syncw = state
    succ_local, succ = None, []
    for ri in range(nroles):
      pc = pcs[ri]
      if syncw[ri][0] >= 0:  # blocked in bar.sync until the generation completes
        i, g = syncw[ri]
        if named[i][0] > g:
          ns = list(syncw)
          ns[ri] = (-1, -1)
          succ.append(((pcs, mb, tma, named, tuple(ns)), (ri, pc - 1, "generation complete")))
        continue
      if pc == ends[ri]:
        continue
      e = events[ri][pc]
      k = e.kind
      step = (ri, pc, "")
      if k == "wait":
        bi = st.bar_index[(e.buf, e.slot)]
        done, _ = mb[bi]
        kk = st.wait_k[ri][pc]
        if done >= kk + 2:
          return fail("parity alias",
                      f"{roles[ri]}'s wait #{kk} on {e.buf}[{e.slot}] (parity {kk % 2}) finds "
                      f"{done} phases completed: one parity bit cannot tell phase {kk} from "
                      f"{done - 1}", state, (ri, pc, f"phase {kk}, completed {done}"))
        if done % 2 != kk % 2 and done < kk + 1:
          return fail("parity alias",
                      f"{roles[ri]}'s wait #{kk} on {e.buf}[{e.slot}] (parity {kk % 2}) passes "
                      f"with only {done} phases completed: it took an older phase for the "
                      f"one it waits for", state, (ri, pc, f"phase {kk}, completed {done}"))
        if done % 2 != kk % 2:
          step = (ri, pc, f"parity {kk % 2}, completed {done}")
          succ.append(((pcs[:ri] + (pc + 1,) + pcs[ri + 1:], mb, tma, named, syncw), step))
        continue
      if k == "arrive":
        bi = st.bar_index[(e.buf, e.slot)]
        done, arr = mb[bi]
        arr += 1
        if arr >= st.arrivals[(e.buf, e.slot)]:
          done, arr = done + 1, 0
        nmb = mb[:bi] + ((done, arr),) + mb[bi + 1:]
        succ.append(((pcs[:ri] + (pc + 1,) + pcs[ri + 1:], nmb, tma, named, syncw), step))
        continue
      if k == "tma_load":
        key = (e.buf, e.slot)
        n = st.writes_before[ri][pc].get(key, 0) + 1
        if (e.buf, e.slot, n - 1) in tma:
          return fail("overwrite before release", f"copy {n} into {e.buf}[{e.slot}] issued "
                      f"while copy {n - 1} is still in flight", state, step)
        for rj in range(nroles):
          if rj == ri:
            continue
          if key in st.inflight[rj][pcs[rj]]:
            return fail("overwrite before release",
                        f"copy {n} into {e.buf}[{e.slot}] issued while {roles[rj]}'s wgmma "
                        f"still reads it (at {events[rj][pcs[rj] - 1].src} or earlier)",
                        state, step)
          rel = st.release[rj].get((e.buf, e.slot, n - 1))
          if rel is not None and pcs[rj] <= rel:
            return fail("overwrite before release",
                        f"copy {n} into {e.buf}[{e.slot}] issued before {roles[rj]} "
                        f"retired its reads of copy {n - 1} (at {events[rj][rel].src})",
                        state, step)
        ntma = tma + ((e.buf, e.slot, n),)
        succ.append(((pcs[:ri] + (pc + 1,) + pcs[ri + 1:], mb, ntma, named, syncw), step))
        continue
      if k in ("bar_sync", "bar_arrive"):
        i = nid[e.bar_id]
        gen, arrived, who = named[i]
        mine = gen
        arrived += role_threads[ri]
        who |= 1 << ri
        need = st.named_threads[e.bar_id]
        while arrived >= need:
          if who == 1 << ri:
            return fail("named barrier alone",
                        f"{roles[ri]} completes a generation of named barrier {e.bar_id} "
                        f"({need} threads) with its own arrivals only: it synchronises with "
                        f"nobody", state, step)
          gen, arrived = gen + 1, arrived - need
          who = 1 << ri if arrived else 0
        nn = named[:i] + ((gen, arrived, who),) + named[i + 1:]
        ns = syncw
        if k == "bar_sync" and gen <= mine:
          ns = syncw[:ri] + ((i, mine),) + syncw[ri + 1:]
        succ.append(((pcs[:ri] + (pc + 1,) + pcs[ri + 1:], mb, tma, nn, ns), step))
        continue
      # local steps: check reads against the slot contents, then step alone
      if k == "smem_store" and e.buf in ex.overlaps:
        for w in ex.overlaps[e.buf]:
          if any(t[0] == w for t in tma):
            return fail("overlay", f"{roles[ri]} stores into {e.buf}, which shares bytes "
                        f"with {w}, while a TMA load into {w} is in flight", state, step)
          for rj in range(nroles):
            lu = st.last_use[rj].get(w)
            if rj != ri and lu is not None and pcs[rj] <= lu:
              return fail("overlay",
                          f"{roles[ri]} stores into {e.buf}, which shares bytes with {w}, "
                          f"before {roles[rj]} is done with {w} (at {events[rj][min(lu, ends[rj] - 1)].src})",
                          state, step)
      for buf, slot, n in st.reads[ri][pc]:
        issued, flying = content(buf, slot, state)
        if issued < n or (issued == n and flying):
          return fail("read before copy completed",
                      f"{roles[ri]} reads {buf}[{slot}] expecting copy {n}, but copy {n} "
                      f"{'is still in flight' if issued == n else 'is not even issued'}",
                      state, step)
        if issued > n:
          return fail("read before copy completed",
                      f"{roles[ri]} reads {buf}[{slot}] expecting copy {n}, but copy "
                      f"{issued} already overwrote it", state, step)
      nxt = ((pcs[:ri] + (pc + 1,) + pcs[ri + 1:], mb, tma, named, syncw), step)
      if k in RETIRING:
        # Retiring reads is visible to the other roles (what a refill may
        # overwrite): taken alone, it would hide every state in which
        # another role acts before the reads retire.
        succ.append(nxt)
      elif succ_local is None:
        succ_local = nxt
    seen_writers = set()
    for idx, item in enumerate(tma):
      buf, slot, n = item
      w = st.writer[buf]
      if w in seen_writers and fifo:
        continue
      seen_writers.add(w)
      bi = st.bar_index[st.copy_bar[(buf, slot)]]
      done, arr = mb[bi]
      arr += 1
      if arr >= st.arrivals[st.copy_bar[(buf, slot)]]:
        done, arr = done + 1, 0
      succ.append(((pcs, mb[:bi] + ((done, arr),) + mb[bi + 1:], tma[:idx] + tma[idx + 1:], named, syncw),
                   (-1, item, "")))
    if succ_local is not None:
      succ = [succ_local]
    if not succ:
      if pcs != ends or any(s[0] >= 0 for s in syncw):
        blocked = []
        for ri in range(nroles):
          if syncw[ri][0] >= 0:
            blocked.append(f"{roles[ri]} in bar.sync id {named_ids[syncw[ri][0]]} at "
                           f"{events[ri][pcs[ri] - 1].src}")
          elif pcs[ri] < ends[ri]:
            e = events[ri][pcs[ri]]
            bi = st.bar_index.get((e.buf, e.slot))
            extra = (f" (wait #{st.wait_k[ri][pcs[ri]]}, {mb[bi][0]} phases completed)"
                     if bi is not None else "")
            blocked.append(f"{roles[ri]} at {e.src} {e.describe()}{extra}")
        return fail("deadlock", "no role can step: " + "; ".join(blocked), state, None)
      continue
    for nxt, step in succ:
      if nxt not in parent:
        parent[nxt] = (state, step)
        if len(parent) > max_states:
          raise RuntimeError(f"state budget {max_states} exceeded ({environment})")
        stack.append(nxt)
  return CheckResult(True, len(parent), time.perf_counter() - start)
