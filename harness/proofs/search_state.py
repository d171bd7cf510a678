"""A state of the protocol search (:mod:`harness.proofs.search`): its layout,
and its normal form, which cuts the word to what some role still reads,
keeps every counter relative to the ones it is compared with and turns
the ring back to its first warm class, so that the reachable states are
finitely many.

A state: (env, roles, mb, tma, issued, gidx, wcount, content, named).
mb: per barrier key (completed phases, arrivals toward the next); tma: the
copies in flight, (copy slot, copy number) in issue order; issued: per copy
slot the copies issued; gidx: per copy slot its latest copy's write index
in its ring buffer, wcount: per ring buffer the next write index (ring
order); content: per shared-memory slot what it holds (``C_*``); named: per
named barrier (generation, threads arrived, roles arrived).

A role's state: (phase, unit, k, x, y, waits, waited, groups, stores, dirty,
lastread, syncw).  x, y: where it reads the environment -- a role reading
the whole word: (anchor word index, min(n, 2) of its tile); one reading
blocks: (ordinal of its next block from the word's start, its class); one
reading tiles: (ordinal of its tile from the word's start, tile >= 1).
waits: per barrier key it waits on, its waits so far; waited: a bit per
key it has waited on; groups: the wgmma groups in flight, each the slots it
reads; stores: the slots its TMA stores in flight read; dirty: slots it
stored into since its last fence; lastread: per ring buffer the write index
it read last; syncw: the named barrier generation it waits for, or None.

The environment: (word, class at its start, a tile boundary before it, no
more blocks, no more tiles, blocks in the word's last tile (capped),
blocks owed) (:mod:`harness.proofs.search_environment`).
"""

from __future__ import annotations

PRE, HEAD, ITER, TAIL, POST, DONE = range(6)
# Slot contents (per shared-memory slot): the latest TMA copy, an ordinary
# store (role, step), clobbered by a write into overlapping bytes, nothing.
C_TMA, C_GEN, C_CLOB, C_NONE = 0, 1, 2, 3


class Fail(Exception):
  """A step (or a state) the search refuses: reported as a violation of
  ``kind`` at the step that raised it."""

  def __init__(self, kind, message, note=""):
    super().__init__(message)
    self.kind, self.message, self.note = kind, message, note


def set_at(t: tuple, i: int, v) -> tuple:
  return t[:i] + (v,) + t[i + 1:]


def nth(word: str, ch: str, n: int) -> int:
  """Index of the n-th (0-based) ch in word, or len(word)."""
  i = -1
  for _ in range(n + 1):
    i = word.find(ch, i + 1)
    if i < 0:
      return len(word)
  return i


class NormalForm:
  """The normal form of :class:`harness.proofs.search.Search`'s states (it
  reads ``st``, ``prog``, ``ring``, ``window`` and ``rotate_states``)."""

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
    # A step that moved nobody leaves a normal parent's word as it was: cut.
    if parent is None or moved:
      env, roles, content = self._cut_word(env, roles, content)
    families = self.st.families if parent is None else self.st.family_list[family]
    roles, mb, tma, issued = self._relative_counters(families, roles, mb, tma, issued)
    if parent is not None and family != -2:  # the named barriers as they were: normal
      if not moved:   # the ring's class and every unit as the parent's: rotated as it was
        return (env, roles, mb, tma, issued, gidx, wcount, content, named)
      return self.rotated((env, roles, mb, tma, issued, gidx, wcount, content, named))
    roles, named = self._relative_named(roles, named)
    return self.rotated((env, roles, mb, tma, issued, gidx, wcount, content, named))

  def _word_start(self, word, roles) -> tuple:
    """(the earliest position of the word any role still reads, whether a
    role reading the whole word is still active)."""
    reads = self.st.reads
    if not word:
      return 0, any(roles[ri][0] != DONE for ri in self.st.all_readers)
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
          at = nth(word, "B", r[3])
        else:
          at = 0 if r[3] == 0 else nth(word, "|", r[3] - 1) + 1
        if at < cut:
          cut = at
    return cut, mixed_active

  def _cut_word(self, env, roles, content) -> tuple:
    """(env, roles, content) with the word cut at its earliest position any
    role still reads, and the places in it moved with it."""
    st = self.st
    reads = st.reads
    word = env[0]
    cut, mixed_active = self._word_start(word, roles)
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
      raise Fail("unbounded drift", f"the roles drift apart by more than {self.window} "
                 f"symbols of the environment: the search would not end")
    return env, roles, content

  def _relative_counters(self, families, roles, mb, tma, issued) -> tuple:
    """(roles, mb, tma, issued) with each of ``families``' counters (its
    barrier's phases, its waiters' waits, its copies) less their least."""
    rl = None
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
      mb = set_at(mb, bi, (mb[bi][0] - base, mb[bi][1]))
      for ri, wi in fam_waits:
        r = rl[ri]
        rl[ri] = r[:5] + (set_at(r[5], wi, r[5][wi] - base),) + r[6:]
      if fam_copies:
        il = list(issued)
        for ci in fam_copies:
          il[ci] -= base
        issued = tuple(il)
        tma = tuple((ci, n - base) if ci in copy_set else (ci, n) for ci, n in tma)
    if rl is not None:
      roles = tuple(rl)
    return roles, mb, tma, issued

  @staticmethod
  def _relative_named(roles, named) -> tuple:
    """(roles, named) with each named barrier's generations less the least
    its waiters wait for."""
    for i in range(len(named)):
      base = named[i][0]
      for r in roles:
        if r[11] is not None and r[11][0] == i and r[11][1] < base:
          base = r[11][1]
      if base:
        named = set_at(named, i, (named[i][0] - base,) + named[i][1:])
        roles = tuple(r if r[11] is None or r[11][0] != i else
                      r[:11] + ((i, r[11][1] - base),) for r in roles)
    return roles, named

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
