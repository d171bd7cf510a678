"""One step of the protocol search (:mod:`harness.proofs.search`): which
steps a state has (the reductions of the search's docstring), and what each
kind of event does to the state under the hardware's semantics, checked as
it is taken."""

from __future__ import annotations

from harness.proofs.search_state import C_CLOB, C_GEN, C_TMA, DONE, Fail, set_at
from harness.proofs.violations import Violation

_PASSES = ("phase 0 passes", "phase 1 passes")


class Steps:
  """The successors of a state of :class:`harness.proofs.search.Search`
  (it reads ``st``, ``reduce`` and the other parts' methods)."""

  def successors(self, state):
    """(violation or None, [(state, step, family, moved)]) -- the reduced
    successors, every enabled step of every role checked (``family`` and
    ``moved``: what the step changed, for :meth:`normalise`)."""
    chosen = self._alone(state) if self.reduce else -1
    violation, succ_local, succ, waited = self._role_steps(state, chosen)
    if violation is not None:
      return violation, []
    if succ_local is not None:
      return None, succ_local
    deferred = self._completions(state, waited, succ)
    if not succ:
      succ = deferred
    if not succ and any(r[0] != DONE for r in state[1]):
      return self._deadlock(state), []
    return None, succ

  def _alone(self, state) -> int:
    """The role whose next step is taken alone, if any (else -1): the first
    whose step may be (and can be taken now); every other role's step is
    then only checked."""
    st = self.st
    mb = state[2]
    units, ubar, uwi, alone = st.units, st.ubar, st.uwi, st.alone
    for ri, r in enumerate(state[1]):
      if r[0] != DONE and r[11] is None and alone[r[1]][r[2]]:
        uid, k = r[1], r[2]
        if (units[uid][k].kind != "wait"
            or mb[ubar[uid][k]][0] % 2 != r[5][uwi[uid][k]] % 2):
          return ri
    return -1

  def _role_steps(self, state, chosen):
    """Every role's next step, taken or (beside a chosen role's) only
    checked: (violation or None, the chosen role's successors or None, the
    others' successors, the barriers roles wait on)."""
    st = self.st
    roles, mb, named = state[1], state[2], state[8]
    units, ubar, uwi = st.units, st.ubar, st.uwi
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
          succ.append((set_at(state, 1, set_at(roles, ri, nr)), (ri, None, "generation complete"),
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
        if out is not None and kind == "wait" and self.reduce:
          self.check_lag(state, ri, e)
      except Fail as f:
        return Violation(f.kind, f.message, [(st.names[ri], e, f.note)]), None, [], waited
      if out is None:   # blocked
        continue
      if ri == chosen:
        succ_local = out
      elif chosen < 0:
        succ.extend(out)
    return None, succ_local, succ, waited

  def _completions(self, state, waited, succ) -> list:
    """TMA completions: per issuing role the oldest copy in flight, added to
    ``succ`` only where a role waits on the barrier of it or of a later copy
    of the same role (lazy completion, see the search's docstring); the
    others returned, deferred."""
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    deferred = []
    if not tma:
      return deferred
    st = self.st
    heads = {}
    writer, copy_family = st.tma_writer, st.copy_family
    for idx, (ci, n) in enumerate(tma):
      w = writer[ci]
      if w not in heads:
        heads[w] = [idx, copy_family[ci] in waited]
      elif copy_family[ci] in waited:
        heads[w][1] = True
    for w, (idx, needed) in heads.items():
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
    return deferred

  def _deadlock(self, state) -> Violation:
    """No role can step: where each one stands."""
    st = self.st
    mb = state[2]
    blocked = []
    for ri, r in enumerate(state[1]):
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
    return Violation("deadlock", "no role can step: " + "; ".join(blocked))

  def step(self, state, ri, e, build: bool = True):
    """Role ri takes event e: None if blocked, else [(state, step, family, moved)] (several
    when the role then reads an undecided environment; ``build=False``: only
    checked, [] when enabled).  Raises Fail."""
    effect = _EFFECTS.get(e.kind)
    if effect is None:
      raise AssertionError(e.kind)
    r = state[1][ri]
    out = effect(self, state, ri, r, e)
    if out is None or not build:
      return out if out is None else []
    return self._advance(ri, e, r, *out)

  def _advance(self, ri, e, r, state, nr, note, fam):
    """The successors once role ri took e: ``state`` and its role ``nr`` as
    the event left them (``r``: the role before), moved to its next event
    (several where it then reads an undecided environment)."""
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    phase, uid, k, x, y, waits, waited, groups, stores, dirty, lastread, syncw = nr
    kind = e.kind
    touched = ()
    if kind == "tma_load" and st.slot_rbuf[st.ubar[uid][k]] >= 0:
      touched = (st.slot_rbuf[st.ubar[uid][k]],)
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

  # -- what each kind of event does: (state, the role, note, family changed),
  # or None where it is blocked ------------------------------------------------
  def _wait(self, state, ri, r, e):
    st = self.st
    uid, k, waits = r[1], r[2], r[5]
    bi = st.ubar[uid][k]
    wi = st.uwi[uid][k]
    done = state[2][bi][0]
    kk = waits[wi]
    name = st.names[ri]
    if done >= kk + 2:
      raise Fail("parity alias",
                 f"{name}'s wait on {e.buf}[{e.slot}] finds its barrier {done - kk} "
                 f"phases past the one it waits for: one parity bit cannot tell them "
                 f"apart", f"completed {done - kk} ahead")
    if done % 2 == kk % 2:
      return None
    if done < kk + 1:
      raise Fail("parity alias",
                 f"{name}'s wait on {e.buf}[{e.slot}] passes {kk + 1 - done} phases "
                 f"early: it took an older phase for the one it waits for")
    waits = waits[:wi] + (kk + 1,) + waits[wi + 1:]
    return state, r[:5] + (waits, r[6] | (1 << wi)) + r[7:], _PASSES[kk % 2], bi

  def _arrive(self, state, ri, r, e):
    st = self.st
    if r[9]:
      self.check_publish(ri, r, e)
    bi = st.ubar[r[1]][r[2]]
    mb = state[2]
    done, arr = mb[bi]
    arr += 1
    if arr >= st.arrivals[bi]:
      done, arr = done + 1, 0
    return set_at(state, 2, mb[:bi] + ((done, arr),) + mb[bi + 1:]), r, "", bi

  def _copy(self, state, ri, r, e):
    st = self.st
    env, roles, mb, tma, issued, gidx, wcount, content, named = state
    ci = st.ubar[r[1]][r[2]]
    si = st.tma_smem[ci]
    n = issued[ci] + 1
    if (ci, n - 1) in tma:
      raise Fail("overwrite before release", f"a copy into {e.buf}[{e.slot}] issued "
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
    issued = set_at(issued, ci, n)
    rb = st.slot_rbuf[ci]
    if rb >= 0:
      gidx = set_at(gidx, ci, wcount[rb])
      wcount = set_at(wcount, rb, wcount[rb] + 1)
    tma = tma + ((ci, n),)
    content = set_at(content, si, (C_TMA,))
    for w in st.clobbers[si]:
      content = set_at(content, w, (C_CLOB,))
    return ((env, roles, mb, tma, issued, gidx, wcount, content, named), r, "",
            st.copy_family[ci])

  def _named_barrier(self, state, ri, r, e):
    st = self.st
    if r[9]:
      self.check_publish(ri, r, e)
    named = state[8]
    i = st.nid[e.bar_id]
    gen, arrived, who = named[i]
    mine = gen
    arrived += st.roles[ri].threads
    who |= 1 << ri
    need = st.named_threads[e.bar_id]
    while arrived >= need:
      if who == 1 << ri:
        raise Fail("named barrier alone",
                   f"{st.names[ri]} completes a generation of named barrier {e.bar_id} "
                   f"({need} threads) with its own arrivals only: it synchronises "
                   f"with nobody")
      gen, arrived = gen + 1, arrived - need
      who = 1 << ri if arrived else 0
    named = set_at(named, i, (gen, arrived, who))
    if e.kind == "bar_sync" and gen <= mine:
      r = r[:11] + ((i, mine),)
    return set_at(state, 8, named), r, "", -2

  def _wgmma(self, state, ri, r, e):
    st = self.st
    lastread = r[10]
    slots = []
    for b, s in e.reads:
      si = st.smem_index[(b, s)]
      if si in r[9]:
        raise Fail("async-proxy ordering",
                   f"{st.names[ri]} reads {b}[{s}] through the async proxy after an "
                   f"ordinary store without commit_smem between")
      lastread = self.check_read(state, ri, r, b, s, lastread)
      slots.append(si)
    return state, r[:7] + (r[7] + (tuple(slots),),) + r[8:10] + (lastread,) + r[11:], "", -1

  def _wgmma_wait(self, state, ri, r, e):
    groups = r[7]
    groups = groups[len(groups) - e.n:] if e.n else ()
    return state, r[:7] + (groups,) + r[8:], "", -1

  def _load(self, state, ri, r, e):
    lastread = self.check_read(state, ri, r, e.buf, e.slot, r[10])
    return state, r[:10] + (lastread,) + r[11:], "", -1

  def _store(self, state, ri, r, e):
    st = self.st
    roles, tma, content = state[1], state[3], state[7]
    name = st.names[ri]
    si = st.smem_index[(e.buf, e.slot)]
    if si in r[8]:
      raise Fail("async-proxy ordering",
                 f"{name} rewrites {e.buf}[{e.slot}] while its TMA store still reads it")
    self.check_no_async_reader(roles, si, f"{name} stores into {e.buf}[{e.slot}]")
    if any(st.tma_smem[c] == si for c, _ in tma):
      raise Fail("overwrite before release", f"{name} stores into {e.buf}[{e.slot}] "
                 f"while a TMA load into it is in flight")
    self.check_overlays(
        roles, tma, si,
        lambda b: f"{name} stores into {e.buf}, which shares bytes with {b}",
        lambda b: f"{name} stores into {e.buf}, which shares bytes with {b}, while a TMA "
                  f"load into it is in flight")
    content = set_at(content, si, (C_GEN, ri, self.anchor(ri, r)))
    for w in st.clobbers[si]:
      content = set_at(content, w, (C_CLOB,))
    return set_at(state, 7, content), r[:9] + (r[9] | {si},) + r[10:], "", -1

  def _fence(self, state, ri, r, e):
    return state, r[:9] + (frozenset(),) + r[10:], "", -1

  def _tma_store(self, state, ri, r, e):
    st = self.st
    si = st.smem_index[(e.buf, e.slot)]
    if si in r[9]:
      raise Fail("async-proxy ordering",
                 f"{st.names[ri]} reads {e.buf}[{e.slot}] through the async proxy after an "
                 f"ordinary store without commit_smem between")
    self.check_generic(state, ri, r, si, e.buf, e.slot)
    return state, r[:8] + (r[8] + (si,),) + r[9:], "", -1

  def _store_wait(self, state, ri, r, e):
    stores = r[8]
    stores = stores[len(stores) - e.n:] if e.n else ()
    return state, r[:8] + (stores,) + r[9:], "", -1

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
        raise Fail("parity alias",
                   f"{st.names[ri]} may pass its wait on {e.buf}[{e.slot}] (a phase completed) "
                   f"while a copy that completes the next phase is in flight: one parity "
                   f"bit cannot tell them apart")
    if arr + 1 >= st.arrivals[bi]:
      for rj, other in enumerate(roles):
        if rj == ri or other[0] == DONE or other[11] is not None:
          continue
        o = st.units[other[1]][other[2]]
        if o.kind == "arrive" and (o.buf, o.slot) == key:
          raise Fail("parity alias",
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
    return (tuple(gl), set_at(wcount, bi, rank[wcount[bi]]),
            tuple(r if r[10][bi] < 0 else
                  r[:10] + (set_at(r[10], bi, rank[r[10][bi]]),) + r[11:] for r in roles))


# By event kind, its effect (each names the kernel's event it models).
_EFFECTS = {"wait": Steps._wait, "arrive": Steps._arrive, "tma_load": Steps._copy,
            "bar_sync": Steps._named_barrier, "bar_arrive": Steps._named_barrier,
            "wgmma": Steps._wgmma, "wgmma_wait": Steps._wgmma_wait, "smem_load": Steps._load,
            "smem_store": Steps._store, "fence": Steps._fence, "tma_store": Steps._tma_store,
            "store_wait": Steps._store_wait}
