"""The environment of the protocol search (:mod:`harness.proofs.search`), as
the roles read it: the word ``B^{n_0} | B^{n_1} | ... $`` of
:mod:`harness.proofs.role_programs`, generated one symbol at a time, every
choice a branch, and each role moved through its units as it reads it."""

from __future__ import annotations

from harness.proofs.role_programs import AHEAD_CAP, N_CAP, RoleProgram
from harness.proofs.search_state import DONE, HEAD, ITER, POST, PRE, TAIL, Fail


class Environment:
  """The word and the roles' places in it, for
  :class:`harness.proofs.search.Search` (it reads ``st``, ``prog``, ``ring``
  and ``window``)."""

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
          raise Fail("unbounded drift", f"{role.name} reads a tile of more than "
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
