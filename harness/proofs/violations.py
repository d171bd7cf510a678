"""What the protocol search (:mod:`harness.proofs.search`) reports, and the
checks of each step's reads and writes that find it: a read of the copy its
reader waited for, landed and in ring order; no overwrite of a slot still
read or not yet released; ordinary stores fenced before the async proxy
reads them; overlaid buffers not read after the other was written."""

from __future__ import annotations

import dataclasses

from harness.proofs.search_state import C_CLOB, C_GEN, C_NONE, C_TMA, DONE, PRE, Fail, set_at


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


class Checks:
  """The checks a step of :class:`harness.proofs.search.Search` makes of
  what it reads and writes; each raises :class:`Fail` (it reads ``st``)."""

  def anchor(self, ri, r):
    return r[3] if self.st.roles[ri].reads == "all" and r[0] not in (PRE, DONE) else -2

  def check_publish(self, ri, r, e):
    st = self.st
    for si in r[9]:
      b, s = st.smem_slots[si]
      if st.async_readers.get(b, set()) - {ri}:
        raise Fail("async-proxy ordering",
                   f"{st.names[ri]} publishes {b}[{s}] to another role's async-proxy read "
                   f"without commit_smem before the arrive")

  def check_no_async_reader(self, roles, si, what, kind="overwrite before release"):
    st = self.st
    b, s = st.smem_slots[si]
    for rj, other in enumerate(roles):
      for g in other[7]:
        if si in g:
          raise Fail(kind, f"{what} while a wgmma of {st.names[rj]} still reads "
                     f"{b}[{s}]")
      if si in other[8]:
        raise Fail(kind, f"{what} while a TMA store of {st.names[rj]} still reads "
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
        raise Fail("overlay", in_flight(b))

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
      raise Fail("overwrite before release",
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
      raise Fail("overlay", f"{name} reads {b}[{s}] after a write into memory sharing its "
                 f"bytes clobbered it")
    if c[0] == C_GEN:
      raise Fail("stale read", f"{name} reads {b}[{s}] as the copy it waited for, but an "
                 f"ordinary store has overwritten it")
    if key in st.stationary:
      if issued[ci] < 1 or (ci, issued[ci]) in tma:
        raise Fail("read before copy completed",
                   f"{name} reads {b}[{s}] before its one copy has landed")
      return lastread
    cb = st.copy_bar[key]
    wi = st.waits_of[ri].get(cb)
    if wi is None or not r[6] >> wi & 1:
      raise Fail("read before copy completed",
                 f"{name} reads {b}[{s}] without having waited on {cb[0]}[{cb[1]}]")
    n = r[5][wi]
    have = issued[ci]
    if have < n:
      raise Fail("read before copy completed",
                 f"{name} reads {b}[{s}] expecting the copy it waited for, which is not "
                 f"even issued")
    if have == n and (ci, n) in tma:
      raise Fail("read before copy completed",
                 f"{name} reads {b}[{s}] expecting the copy it waited for, which is still "
                 f"in flight")
    if have > n:
      raise Fail("overwrite before release",
                 f"{name} reads {b}[{s}] expecting the copy it waited for, but "
                 f"{have - n} later cop{'y' if have - n == 1 else 'ies'} already overwrote it")
    rb = st.slot_rbuf[ci]
    if rb >= 0:
      g = gidx[ci]
      if lastread[rb] >= 0 and g < lastread[rb]:
        raise Fail("ring order",
                   f"{name} reads a copy of {b} issued before one it read already: its "
                   f"slot index drifted from the producer's")
      lastread = set_at(lastread, rb, g)
    return lastread

  def check_generic(self, state, ri, r, si, b, s):
    st = self.st
    c = state[7][si]
    name = st.names[ri]
    if c[0] == C_CLOB:
      raise Fail("overlay", f"{name} reads {b}[{s}] after a write into memory sharing its "
                 f"bytes clobbered it")
    if c[0] == C_NONE:
      raise Fail("stale read", f"{name} reads {b}[{s}] before anything is stored there")
    if c[0] == C_TMA:
      raise Fail("stale read", f"{name} reads {b}[{s}] as its own store, but a TMA copy "
                 f"has overwritten it")
    _, writer, step = c
    if writer != ri and (step < 0 or step != self.anchor(ri, r)):
      raise Fail("stale read", f"{name} reads {b}[{s}], which {st.names[writer]} stored "
                 f"at another step (a handoff must be of the reader's own step)")
