"""Z3 model of one thread block of the forward kernel: the TMA stage ring,
the query prefetch, the pingpong schedule barriers and the epilogue.

The block is a transition system of concurrent actors (:class:`Model`), each
action one step of ``kernel/forward.py``'s program order:

* ``memory``: warp 0 of the memory warpgroup.  For every key block
  ``g = prev_iters + i`` it fills slot ``PipelineState.at(S, g).index``: waits
  ``k_consumed`` (when ``g >= S``), issues one TMA per key-phase buffer (k, and
  bias/mask when staged), waits ``v_consumed`` (when ``g >= S``), issues v.
* ``qload``: warp 1 of the memory warpgroup; per tile and compute warpgroup w,
  waits ``q_consumed[w]`` (from the second tile on) and issues q[w].
* ``wg0``, ``wg1``: the compute warpgroups.  Per tile: wait q; if the tile has
  key blocks, wait k of the first block, issue its QK, pass the pingpong
  token, wait the QK, arrive ``k_consumed``; then per block: wait v, acquire
  the token, and if a block follows wait its k and issue its QK; issue PV;
  if a block follows, pass the token; wait both products, arrive
  ``v_consumed`` (and ``k_consumed`` of the next block).  Then the epilogue.
  (The kernel issues the next block's QK before the PV — FlashAttention-3's
  intra-warpgroup overlap: wgmma groups complete in issue order, so it waits
  for the QK alone, runs the softmax while the PV still runs, then waits for
  the PV.  Between those two waits it takes no synchronising action, so they
  are this model's one wait for both.)
  With staged bias/mask (key-phase buffers after k), the warpgroup waits on
  them right after issuing the block's QK, before passing the token, as here;
  the kernel arrives ``k_consumed`` once the softmax has read them: in the
  loop at this model's point (after ``v_consumed``), for a tile's first
  block right after its QK wait as here, except that in a persistent tile of
  one key block the kernel arrives ``q_consumed`` first: two arrivals with
  no wait between them, the later ``k_consumed`` only holding the slot
  longer.
* ``tma``: the copy engine; any issued copy may land at any time, completing
  the phase of its "produced" mbarrier (arrive.expect_tx is the issue).
* ``async``: wgmma completion and the output copy's read of the o slot.

An action that models a verb of the kernel's rings (kernel/ring.py) is named
after it: ``producer_acquire``, ``producer_copy``, ``consumer_wait``,
``consumer_release``, then the barrier or buffer it reads.

Every number comes from :func:`kernel.plan.pipeline_plan` and
:mod:`kernel.barriers` (stages, staged buffers, arrival counts, named-barrier
thread counts); none is retyped here.

Hardware rules:

* mbarrier with c completed phases: ``try_wait.parity(p)`` passes iff
  ``p != c mod 2``.  Mosaic GPU's parity is implicit: an actor keeps one bit
  per mbarrier, flipped by each of its waits on it.
* named barrier: a generation completes when ``num_threads`` threads arrived
  (128 per warpgroup); ``bar.sync`` arrives and waits for the generation it
  arrived in, ``bar.arrive`` only arrives; surplus arrivals count toward the
  next generation.

Three ways to use the model:

* :func:`prove`: an unbounded proof.  A hand-written inductive invariant in
  linear integer arithmetic (:func:`invariant`) is checked by separate
  queries: initiation, consecution and the safety obligations of every
  action, deadlock freedom.  num_stages is concrete; slot index and phase
  advance like ``PipelineState`` (wrap and flip, no mod); ghost counters
  (wraps R with ``g = S*R + index``, the block each slot holds, the tiles
  without key blocks) relate them to global block counts.  The number of
  tiles, each tile's trip count (>= 0) and the total are symbolic.
* :func:`find_counterexample`: bounded unrolling in macro-steps (each step
  lets every actor, in a fixed order, take one action or idle), trip counts
  symbolic.  Fast to about 20 macro-steps.
* :func:`explore`: breadth-first search of the same actions, compiled to
  Python, for concrete small trip counts; shortest traces, and deep ones.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Iterable

import z3

from kernel import barriers as barriers_lib
from kernel import plan as plan_lib
from kernel.config import MAX_STAGES

MUTATIONS = {
    "tile_local_slot":
        "slot (and the g >= num_stages test) from the tile-local step, "
        "without prev_iters, in every actor",
    "tile_local_parity":
        "compute warpgroups wait with an explicit parity from the tile-local "
        "step (slot still global)",
    "producer_waits_early":
        "the producer waits on the consumed barriers from g >= S - 1 "
        "(one round too early)",
    "producer_waits_late":
        "the producer waits on the consumed barriers only from g >= S + 1 "
        "(one wait missing)",
    "release_before_wgmma":
        "k_consumed arrived before the QK wgmma reading the slot completed",
    "short_warpgroup":
        "warpgroup 0 has fewer key blocks (causal) and leaves the loop "
        "without releasing the slots the producer still fills",
}


@dataclasses.dataclass(frozen=True)
class Handshake:
  """How the compute warpgroups hand the pingpong token to each other.

  The rest of the protocol is fixed (it is what ``kernel/forward.py`` does):
  ``q_consumed[w]`` arrives once the tile's last QK completed (after the key
  loop for a tile without key blocks), and the prefetch warp refills q[0]
  then q[1], each after its own ``q_consumed`` wait.
  """

  # "kernel": warpgroup 1 acquires once before the tile loop and warpgroup 0
  # passes once after its last key loop.  "tile": both once per tile.
  schedule_scope: str = "kernel"
  # A persistent block's tile without key blocks still passes and then
  # acquires the token once, like a block without work.  (A one-tile block
  # needs no such step: warpgroup 0's last pass is its only one.)
  empty_tile_token: bool = False

  def __post_init__(self):
    if self.schedule_scope not in ("kernel", "tile"):
      raise ValueError(f"schedule_scope {self.schedule_scope!r}")

  def describe(self) -> str:
    out = f"token passed per {self.schedule_scope}"
    if self.empty_tile_token:
      out += ", tiles without key blocks pass it too"
    return out


# The handshake of kernel/forward.py before commit 14c1599 (modelled on
# today's loop): warpgroup 1's first acquire and warpgroup 0's last pass once
# per tile.  Deadlocks (trip counts [1, 1]): warpgroup 0 passes twice in a row
# and its 2 x 128 arrivals complete a generation on their own.
TOKEN_PER_TILE = Handshake(schedule_scope="tile")
# kernel/forward.py from 14c1599 to 0b8ad79: the token crosses tile
# boundaries.  Deadlocks when two tiles without key blocks follow each other
# before another tile (trip counts [0, 0, 0] or [1, 0, 0, 0]): warpgroup 1
# waits for a pass that warpgroup 0 makes only after a query refill that
# waits for warpgroup 1.  Proven when every tile has a key block.
TOKEN_ACROSS_TILES = Handshake(schedule_scope="kernel")
# kernel/forward.py since 0b8ad79, proven: a tile without key blocks passes
# and then acquires the token once in each warpgroup (before its q_consumed
# arrival), so neither runs a tile ahead of the other.
EMPTY_TILES_PASS_TOKEN = Handshake(schedule_scope="kernel", empty_tile_token=True)

# What kernel/forward.py implements; harness/prove.py proves this one.
KERNEL_HANDSHAKE = EMPTY_TILES_PASS_TOKEN


# --------------------------------------------------------------------------
# Proof parameters, read from the kernel's plan.


@dataclasses.dataclass(frozen=True)
class Protocol:
  """What the proof depends on: the plan's distinct parameters, the handshake
  variant and (for refutation only) a mutation."""

  num_stages: int
  key_phase: tuple[str, ...]
  value_phase: tuple[str, ...]
  persistent: bool
  compute_warpgroups: int
  mbarrier_arrivals: tuple[tuple[str, int], ...]
  mbarrier_counts: tuple[tuple[str, int], ...]
  named_threads: tuple[tuple[str, int], ...]
  handshake: Handshake = KERNEL_HANDSHAKE
  mutation: str | None = None
  # Environment assumption: every tile has at least one key block (true
  # without k_start/k_end ranges: kv_block_range is never empty then).
  nonempty_tiles: bool = False

  @classmethod
  def from_plan(cls, plan: plan_lib.PipelinePlan, *, handshake: Handshake = KERNEL_HANDSHAKE,
                mutation: str | None = None) -> "Protocol":
    if mutation is not None and mutation not in MUTATIONS:
      raise ValueError(f"unknown mutation {mutation!r}")
    return cls(
        num_stages=plan.num_stages,
        key_phase=tuple(plan.key_phase),
        value_phase=tuple(plan.value_phase),
        persistent=bool(plan.persistent),
        compute_warpgroups=plan.compute_warpgroups,
        mbarrier_arrivals=tuple((b.name, b.num_arrivals) for b in plan.mbarriers),
        mbarrier_counts=tuple((b.name, b.num_barriers) for b in plan.mbarriers),
        named_threads=tuple((b.name, b.num_threads) for b in plan.named_barriers),
        handshake=handshake,
        mutation=mutation,
    )

  def arrivals(self, name: str) -> int:
    return dict(self.mbarrier_arrivals)[name]

  def threads(self, name: str) -> int:
    return dict(self.named_threads)[name]

  def describe(self) -> str:
    bits = [f"S={self.num_stages}", "+".join(self.key_phase + self.value_phase),
            "persistent" if self.persistent else "one tile"]
    if self.persistent:
      bits.append(self.handshake.describe())
    if self.mutation:
      bits.append(f"mutant {self.mutation}")
    if self.nonempty_tiles:
      bits.append("assuming every tile has key blocks")
    return ", ".join(bits)

  def canonical(self) -> "Protocol":
    """The same protocol with its staged bias/mask buffers renamed to the
    first names in ``CANONICAL_EXTRA``.  The model builds every extra
    key-phase buffer by the same code (its name is only a label), so a
    protocol and its canonical form are the same transition system up to
    renaming, and one proof covers both."""
    extra = self.key_phase[1:]
    rename = dict(zip(extra, CANONICAL_EXTRA))
    if all(a == b for a, b in rename.items()):
      return self

    def mb(name):
      for old, new in rename.items():
        if name == f"{old}_produced":
          return f"{new}_produced"
      return name
    return dataclasses.replace(
        self, key_phase=(self.key_phase[0],) + tuple(rename[b] for b in extra),
        mbarrier_arrivals=tuple((mb(n), a) for n, a in self.mbarrier_arrivals),
        mbarrier_counts=tuple((mb(n), c) for n, c in self.mbarrier_counts))


CANONICAL_EXTRA = ("bias", "mask")


# Which warpgroups use which named barrier, and how (the model's program).
NAMED_BARRIER_USERS = {
    "schedule_wg0": {0: "bar.sync", 1: "bar.arrive"},
    "schedule_wg1": {1: "bar.sync", 0: "bar.arrive"},
    "epilogue": {0: "bar.sync", 1: "bar.sync"},
}


def check_plan(plan: plan_lib.PipelinePlan) -> list[str]:
  """Property (d): barrier IDs, arrival counts and thread counts agree with the
  actors that use them.  Returns the problems found (empty: consistent)."""
  problems = []
  try:
    barriers_lib.check_budget(plan.named_barriers)
  except ValueError as err:
    problems.append(f"named barriers: {err}")
  if not 1 <= plan.num_stages <= MAX_STAGES:
    problems.append(f"num_stages {plan.num_stages} outside [1, {MAX_STAGES}]")
  cw = plan.compute_warpgroups
  if cw != barriers_lib.COMPUTE_WARPGROUPS or cw != 2:
    problems.append(f"the pingpong protocol needs 2 compute warpgroups, plan has {cw}")
  if tuple(plan.value_phase) != ("v",) or not plan.key_phase or plan.key_phase[0] != "k":
    problems.append(f"staged buffers {plan.key_phase}/{plan.value_phase} are not k.../v")
  expect = {"q_produced": (cw, 1), "k_consumed": (plan.num_stages, cw),
            "v_consumed": (plan.num_stages, cw)}
  for name in tuple(plan.key_phase) + tuple(plan.value_phase):
    expect[f"{name}_produced"] = (plan.num_stages, 1)
  if plan.persistent:
    expect["q_consumed"] = (cw, 1)
  have = {b.name: (b.num_barriers, b.num_arrivals) for b in plan.mbarriers}
  for name, (count, arrivals) in expect.items():
    if name not in have:
      problems.append(f"mbarrier {name} missing")
      continue
    if have[name][0] != count:
      problems.append(f"mbarrier {name}: {have[name][0]} barriers, the protocol uses {count}")
    if have[name][1] != arrivals:
      problems.append(
          f"mbarrier {name}: {have[name][1]} arrivals per phase, but {arrivals} "
          f"actor(s) arrive on it per phase")
  for name in sorted(set(have) - set(expect)):
    problems.append(f"mbarrier {name} is not used by the protocol")
  named = {b.name: b for b in plan.named_barriers}
  for name, users in NAMED_BARRIER_USERS.items():
    if name == "epilogue" and plan.persistent:
      continue
    if name not in named:
      problems.append(f"named barrier {name} missing")
      continue
    want = len(users) * barriers_lib.WARPGROUP_THREADS
    if named[name].num_threads != want:
      problems.append(
          f"named barrier {name}: {named[name].num_threads} threads, but "
          f"{len(users)} warpgroups ({want} threads) take part")
  return problems


# --------------------------------------------------------------------------
# The transition system.

State = dict  # variable name -> z3 expression


def _b2i(b):
  return z3.If(b, 1, 0)


def _z3(v):
  if isinstance(v, bool):
    return z3.BoolVal(v)
  if isinstance(v, int):
    return z3.IntVal(v)
  return v


@dataclasses.dataclass
class Action:
  actor: str
  label: str            # the program point it executes (the actor's pc)
  name: str             # for traces
  guard: Callable[[State], z3.BoolRef]
  update: Callable[[State, dict], dict]
  checks: Callable[[State], list] = lambda s: []   # (kind, what, ok-expr)
  slot: int | None = None
  block: Callable[[State], z3.ArithRef] | None = None
  parity: Callable[[State], z3.ExprRef] | None = None
  fresh: tuple[str, ...] = ()                       # nondeterministic ints
  fresh_ok: Callable[[State, dict], z3.BoolRef] | None = None
  witness: Callable[[State], dict] | None = None


# Program points of a compute warpgroup (both use the same list; a point a
# warpgroup never reaches is excluded by the invariant).
_PROLOGUE = ["pre_sync", "pre_sync_wait"]                       # kernel scope, wg1
_TILE_HEAD = ["q_wait", "k_wait0", "tile_pre_sync", "tile_pre_sync_wait", "qk0"]
_FIRST_QK_TAIL = ["sched_arrive0", "k_release_early", "qk_wait0", "k_release", "q_release"]
_BODY_HEAD = ["loop", "sched_sync", "sched_wait", "next_k_wait", "next_qk", "pv"]
# Program points of a block whether or not a next block follows (elsewhere in
# next_qk_labels only with one).
_WITH_OR_WITHOUT_NEXT = ("pv", "mma_wait", "v_release")
_BODY_TAIL = ["next_sched_arrive", "mma_wait", "v_release"]
_EXIT = ["empty_pass", "empty_sync", "empty_sync_wait", "final_arrive", "q_release_end",
         "store_wait", "epi_sync", "epi_wait", "o_write", "o_store", "last_arrive", "done"]


class Model:
  """One thread block as actors over shared state (see the module docstring).

  ``mode="proof"``: symbolic total key blocks T and tile count NT; a compute
  warpgroup learns the trip count when it enters a tile (the other copies it),
  the producer is one stream of T blocks (with prev_iters carried, its tile
  loop issues exactly g = 0..T-1 in order).  ``mode="bmc"``: a bounded tile
  list of trip counts that every actor reads, so the producer's tile loop is
  modelled too (the tile-local mutants need it).
  """

  ACTORS = ("memory", "qload", "wg0", "wg1", "tma", "async")

  def __init__(self, proto: Protocol, mode: str = "proof", *, max_tiles: int = 2,
               max_trip: int = 3):
    if mode not in ("proof", "bmc"):
      raise ValueError(mode)
    if mode == "proof" and proto.mutation is not None:
      raise ValueError("mutants are refuted by search, not proved")
    self.p = proto
    self.mode = mode
    self.S = proto.num_stages
    self.KP = proto.key_phase
    self.EXTRA = proto.key_phase[1:]
    self.RING = proto.key_phase + proto.value_phase
    self.W = proto.compute_warpgroups
    if self.W != 2:
      raise ValueError("the pingpong protocol is modelled for 2 compute warpgroups")
    self.persistent = proto.persistent
    hs = proto.handshake
    self.scope = hs.schedule_scope
    self.empty_token = hs.empty_tile_token and proto.persistent
    self.mut = proto.mutation
    self.ghosts = mode == "proof"
    self.sorts: dict[str, str] = {}
    self.pc: dict[str, dict[str, int]] = {}
    self.labels: dict[str, list[str]] = {}
    self._env(max_tiles, max_trip)
    self._declare()
    self.actions: list[Action] = []
    self.unused_labels: dict[str, list[str]] = {}   # per warpgroup
    self._producer()
    self._qload()
    for w in range(self.W):
      self._compute(w)
    self._tma()
    self._async()

  # ---- environment ------------------------------------------------------

  def _env(self, max_tiles, max_trip):
    self.NT = z3.Int("env.NT")
    env = [self.NT >= 1]
    if not self.persistent:
      env.append(self.NT == 1)
    least = 1 if self.p.nonempty_tiles else 0
    if self.mode == "proof":
      self.T = z3.Int("env.T")
      env.append(self.T >= least * self.NT)
    else:
      self.K = max_tiles if self.persistent else 1
      self.trips = [z3.Int(f"env.n[{t}]") for t in range(self.K)]
      self.short = [z3.Int(f"env.m[{t}]") for t in range(self.K)]
      env.append(self.NT <= self.K)
      for n, m in zip(self.trips, self.short):
        env += [n >= least, n <= max_trip, m >= 0, m <= n]
      self.T = z3.Sum([z3.If(t < self.NT, self.trips[t], 0) for t in range(self.K)])
    self.env = env

  def trip(self, t, short=False):
    """Trip count of tile t (bmc mode), as an If-chain over the tile list."""
    seq = self.short if short else self.trips
    expr = z3.IntVal(0)
    for i in reversed(range(self.K)):
      expr = z3.If(t == i, seq[i], expr)
    return expr

  # ---- state ------------------------------------------------------------

  def _var(self, name, sort):
    assert name not in self.sorts, name
    self.sorts[name] = sort

  def _labels(self, actor, labels):
    self.labels[actor] = list(labels)
    self.pc[actor] = {l: i for i, l in enumerate(labels)}

  def wg_labels(self) -> list[str]:
    extra0 = [f"{b}_wait0" for b in self.EXTRA]
    extra_next = [f"{b}_wait_next" for b in self.EXTRA]
    return (_PROLOGUE + _TILE_HEAD + extra0 + _FIRST_QK_TAIL + _BODY_HEAD + extra_next
            + _BODY_TAIL + _EXIT)

  def _declare(self):
    S = self.S
    self._labels("memory", ["k_wait"] + [f"{b}_issue" for b in self.KP] +
                 ["v_wait", "v_issue", "done"])
    for n in ("pc", "g", "idx", "R", "ph"):
      self._var(f"memory.{n}", "int")
    if self.mode == "bmc":
      for n in ("t", "E"):
        self._var(f"memory.{n}", "int")
    for c in ("k_consumed", "v_consumed"):
      for s in range(S):
        self._var(f"memory.bit.{c}[{s}]", "bool")
    self._labels("qload", ["qc0_wait", "q0_issue", "qc1_wait", "q1_issue", "done"])
    self._var("qload.pc", "int")
    self._var("qload.t", "int")
    for w in range(self.W):
      self._var(f"qload.bit.q_consumed[{w}]", "bool")
    # copies in flight, and the block each slot holds (ghost)
    for b in self.RING:
      for s in range(S):
        self._var(f"tma.{b}[{s}]", "bool")
        self._var(f"blk.{b}[{s}]", "int")
    for w in range(self.W):
      self._var(f"tma.q[{w}]", "bool")
      self._var(f"blk.q[{w}]", "int")
    for name, count in self.mbarriers():
      for i in range(count):
        self._var(f"mb.{name}[{i}].phase", "bool")
        if self.p.arrivals(name) > 1:
          self._var(f"mb.{name}[{i}].pending", "int")
    for name in self.named_barriers():
      self._var(f"nb.{name}.count", "int")
      self._var(f"nb.{name}.gen", "int")
    labels = self.wg_labels()
    for w in range(self.W):
      self._labels(f"wg{w}", labels)
      for n in ("pc", "g", "idx", "R", "ph", "t", "P", "E", "target"):
        self._var(f"wg{w}.{n}", "int")
      if self.mut == "tile_local_parity":
        self._var(f"wg{w}.lidx", "int")
        self._var(f"wg{w}.lph", "int")
      for b in self.RING:
        for s in range(S):
          self._var(f"wg{w}.bit.{b}_produced[{s}]", "bool")
      self._var(f"wg{w}.bit.q_produced[{w}]", "bool")
      for n in ("qk", "pv", "store"):
        self._var(f"wg{w}.{n}", "bool")
      if self.ghosts:
        # ghost: tiles without key blocks entered so far (each passes and
        # acquires the pingpong token once, like one block)
        self._var(f"wg{w}.empties", "int")

  def mbarriers(self) -> list[tuple[str, int]]:
    names = ["q_produced"] + (["q_consumed"] if self.persistent else [])
    names += [f"{b}_produced" for b in self.RING] + ["k_consumed", "v_consumed"]
    counts = dict(self.p.mbarrier_counts)
    return [(n, counts[n]) for n in names]

  def named_barriers(self) -> list[str]:
    return ["schedule_wg0", "schedule_wg1"] + ([] if self.persistent else ["epilogue"])

  def units(self, name) -> int:
    """Warpgroup arrivals that complete a generation of a named barrier."""
    return -(-self.p.threads(name) // barriers_lib.WARPGROUP_THREADS)

  def state(self, tag: str) -> State:
    mk = {"int": z3.Int, "bool": z3.Bool}
    return {n: mk[sort](f"{n}@{tag}") for n, sort in self.sorts.items()}

  def start_label(self, actor) -> str:
    if actor == "wg1" and self.scope == "kernel":
      return "pre_sync"
    if actor.startswith("wg"):
      return "q_wait"
    return self.labels[actor][0]

  def initial(self, s: State) -> z3.BoolRef:
    c = []
    for n, sort in self.sorts.items():
      if sort == "bool":
        c.append(z3.Not(s[n]))
      elif n.startswith("blk."):
        c.append(s[n] == -1)
      elif n.endswith(".pc"):
        actor = n.split(".")[0]
        c.append(s[n] == self.pc[actor][self.start_label(actor)])
      else:
        c.append(s[n] == 0)
    return z3.And(c)

  def final(self, s: State) -> z3.BoolRef:
    return z3.And([s[f"{a}.pc"] == self.pc[a]["done"]
                   for a in ("memory", "qload", "wg0", "wg1")])

  # ---- helpers ----------------------------------------------------------

  def at(self, s, actor, *labels):
    return z3.Or([s[f"{actor}.pc"] == self.pc[actor][l] for l in labels])

  def goto(self, actor, label):
    return z3.IntVal(self.pc[actor][label])

  def _act(self, **kw):
    self.actions.append(Action(**kw))

  def _advance(self, s, who, prefix="") -> dict:
    """PipelineState ++: wrap the index at num_stages and flip the phase."""
    idx, ph = s[f"{who}.{prefix}idx"], s[f"{who}.{prefix}ph"]
    wrap = idx == self.S - 1
    upd = {f"{who}.{prefix}idx": z3.If(wrap, 0, idx + 1),
           f"{who}.{prefix}ph": z3.If(wrap, 1 - ph, ph)}
    if not prefix:
      upd[f"{who}.R"] = z3.If(wrap, s[f"{who}.R"] + 1, s[f"{who}.R"])
    return upd

  def _wait_bit(self, s, who, barrier) -> dict:
    """Implicit parity: a wait flips the waiter's bit for that barrier."""
    return {f"{who}.bit.{barrier}": z3.Not(s[f"{who}.bit.{barrier}"])}

  def _complete(self, s, barrier) -> dict:
    """An mbarrier phase completes: its parity flips."""
    return {f"mb.{barrier}.phase": z3.Not(s[f"mb.{barrier}.phase"])}

  def _arrive(self, s, name, i) -> dict:
    """One arrival on mbarrier name[i]; the phase completes at the plan's count."""
    arrivals = self.p.arrivals(name)
    barrier = f"{name}[{i}]"
    if arrivals == 1:
      return self._complete(s, barrier)
    pend = s[f"mb.{barrier}.pending"]
    full = pend + 1 == arrivals
    upd = {f"mb.{barrier}.pending": z3.If(full, 0, pend + 1)}
    for k, v in self._complete(s, barrier).items():
      upd[k] = z3.If(full, v, s[k])
    return upd

  def _bar(self, s, name, who=None) -> dict:
    """bar.arrive (who None) or the arrive half of bar.sync (records the
    generation ``who`` waits for)."""
    count, gen = s[f"nb.{name}.count"], s[f"nb.{name}.gen"]
    full = count + 1 == self.units(name)
    upd = {f"nb.{name}.count": z3.If(full, 0, count + 1),
           f"nb.{name}.gen": z3.If(full, gen + 1, gen)}
    if who is not None:
      upd[f"{who}.target"] = gen
    return upd

  def passes(self, s, who, barrier, parity=None):
    """try_wait.parity(p) passes iff p != (completed phases mod 2)."""
    p = s[f"{who}.bit.{barrier}"] if parity is None else parity
    return p != s[f"mb.{barrier}.phase"]

  def ring_count(self, s, who):
    """The count the actor's ring position was built from (g, unless mutated)."""
    return self.S * s[f"{who}.R"] + s[f"{who}.idx"]

  # ---- memory warpgroup: the key/value producer -------------------------

  def _producer(self):
    S, a = self.S, "memory"
    g = lambda s: s["memory.g"]
    offset = {"producer_waits_early": -1, "producer_waits_late": 1}.get(self.mut, 0)
    reuse = lambda s: self.ring_count(s, a) >= S + offset
    if self.mode == "proof":
      more = lambda s: g(s) < self.T
      finished = lambda s: g(s) == self.T
    else:
      more = lambda s: g(s) < s["memory.E"]
      finished = lambda s: z3.And(g(s) == s["memory.E"], s["memory.t"] == self.NT)

      def next_tile(s, f):
        upd = {"memory.t": s["memory.t"] + 1,
               "memory.E": g(s) + self.trip(s["memory.t"])}
        if self.mut == "tile_local_slot":
          upd.update({"memory.idx": 0, "memory.ph": 0, "memory.R": 0})
        return upd
      self._act(actor=a, label="k_wait", name="next tile",
                guard=lambda s: z3.And(self.at(s, a, "k_wait"), g(s) == s["memory.E"],
                                       s["memory.t"] < self.NT),
                update=next_tile, block=g)
    self._act(actor=a, label="k_wait", name="finish",
              guard=lambda s: z3.And(self.at(s, a, "k_wait"), finished(s)),
              update=lambda s, f: {"memory.pc": self.goto(a, "done")}, block=g)
    for wait, cons, nxt in (("k_wait", "k_consumed", f"{self.KP[0]}_issue"),
                            ("v_wait", "v_consumed", "v_issue")):
      for i in range(S):
        bar = f"{cons}[{i}]"

        def here(s, i=i, wait=wait):
          h = z3.And(self.at(s, a, wait), s["memory.idx"] == i)
          return z3.And(h, more(s)) if wait == "k_wait" else h
        self._act(actor=a, label=wait, name=f"producer_acquire: wait {cons}", slot=i, block=g,
                  parity=lambda s, bar=bar: s[f"memory.bit.{bar}"],
                  guard=lambda s, here=here, bar=bar: z3.And(
                      here(s), reuse(s), self.passes(s, a, bar)),
                  update=lambda s, f, bar=bar, nxt=nxt: {
                      "memory.pc": self.goto(a, nxt), **self._wait_bit(s, a, bar)})
        self._act(actor=a, label=wait,
                  name=f"producer_acquire: no {cons} wait (slot's first use)",
                  slot=i, block=g,
                  guard=lambda s, here=here: z3.And(here(s), z3.Not(reuse(s))),
                  update=lambda s, f, nxt=nxt: {"memory.pc": self.goto(a, nxt)})
    seq = self.labels[a]
    for b in self.RING:
      label = f"{b}_issue"
      nxt = seq[seq.index(label) + 1] if b != "v" else "k_wait"
      for i in range(S):
        def upd(s, f, b=b, i=i, nxt=nxt):
          u = {"memory.pc": self.goto(a, nxt), f"tma.{b}[{i}]": z3.BoolVal(True),
               f"blk.{b}[{i}]": g(s)}
          if b == "v":
            u.update(self._advance(s, a))
            u["memory.g"] = g(s) + 1
          return u

        def checks(s, b=b, i=i):
          out = [("overwrite", f"TMA into {b}[{i}] while a compute warpgroup reads it",
                  z3.Not(z3.Or([self.reads_ring(s, w, b, i) for w in range(self.W)]))),
                 ("overwrite", f"TMA into {b}[{i}] while the previous one is in flight",
                  z3.Not(s[f"tma.{b}[{i}]"]))]
          if b == "k" and not self.persistent:
            out.append(("overlay", "TMA into k after the output overlaid it",
                        z3.Not(z3.Or([self.output_written(s, w) for w in range(self.W)]))))
          return out
        self._act(actor=a, label=label, name=f"producer_copy: TMA {b}", slot=i, block=g,
                  parity=lambda s: s["memory.ph"],
                  guard=lambda s, label=label, i=i: z3.And(self.at(s, a, label),
                                                           s["memory.idx"] == i),
                  update=upd, checks=checks)

  # ---- memory warpgroup: the query prefetch warp ------------------------

  def _qload(self):
    a = "qload"
    t = lambda s: s["qload.t"]
    seq = self.labels[a]
    first = seq[0]
    self._act(actor=a, label=first, name="finish",
              guard=lambda s: z3.And(self.at(s, a, first), t(s) == self.NT),
              update=lambda s, f: {"qload.pc": self.goto(a, "done")}, block=t)
    for w in range(self.W):
      bar = f"q_consumed[{w}]"
      wait, issue = f"qc{w}_wait", f"q{w}_issue"
      nxt_wait = seq[seq.index(wait) + 1]
      more = (lambda s: t(s) < self.NT) if wait == first else (lambda s: z3.BoolVal(True))
      if self.persistent:
        self._act(actor=a, label=wait, name=f"producer_acquire: wait {bar}", slot=w, block=t,
                  parity=lambda s, bar=bar: s[f"qload.bit.{bar}"],
                  guard=lambda s, wait=wait, more=more, bar=bar: z3.And(
                      self.at(s, a, wait), more(s), t(s) >= 1, self.passes(s, a, bar)),
                  update=lambda s, f, n=nxt_wait, bar=bar: {
                      "qload.pc": self.goto(a, n), **self._wait_bit(s, a, bar)})
      self._act(actor=a, label=wait, name="producer_acquire: no wait (first tile)", slot=w,
                block=t,
                guard=lambda s, wait=wait, more=more: z3.And(
                    self.at(s, a, wait), more(s), t(s) == 0),
                update=lambda s, f, n=nxt_wait: {"qload.pc": self.goto(a, n)})

      def upd(s, f, w=w, issue=issue):
        u = {f"tma.q[{w}]": z3.BoolVal(True), f"blk.q[{w}]": t(s)}
        nxt = seq[seq.index(issue) + 1]
        if nxt == "done":   # q[1] is the tile's last copy: next tile
          u["qload.pc"] = self.goto(a, first)
          u["qload.t"] = t(s) + 1
        else:
          u["qload.pc"] = self.goto(a, nxt)
        return u

      def checks(s, w=w):
        out = [("overwrite", f"TMA into q[{w}] while warpgroup {w} reads it",
                z3.Not(z3.Or(self.q_hold(s, w), s[f"wg{w}.qk"]))),
               ("overwrite", f"TMA into q[{w}] while the previous one is in flight",
                z3.Not(s[f"tma.q[{w}]"]))]
        if not self.persistent:
          out.append(("overlay", "TMA into q after the output overlaid it",
                      z3.Not(z3.Or([self.output_written(s, v) for v in range(self.W)]))))
        return out
      self._act(actor=a, label=issue, name=f"producer_copy: TMA q[{w}]", slot=w, block=t,
                guard=lambda s, issue=issue: self.at(s, a, issue), update=upd,
                checks=checks)

  # ---- what a compute warpgroup reads -----------------------------------

  def first_qk_labels(self):
    """Program points from the tile's first QK issue until its k_consumed
    arrival (k_release follows; the mutant arrives before the QK wait)."""
    seq = ["qk0"] + [f"{b}_wait0" for b in self.EXTRA] + ["sched_arrive0"]
    seq += ["k_release_early"] if self.mut == "release_before_wgmma" else ["qk_wait0"]
    return seq

  def next_qk_labels(self):
    """Program points after waiting for the next block's keys, before its QK
    completed (pv, mma_wait and v_release only when a next block exists)."""
    return (["next_qk", "pv"] + [f"{b}_wait_next" for b in self.EXTRA] +
            ["next_sched_arrive", "mma_wait", "v_release"])

  def at_next(self, s, w, labels=None):
    """pc in ``labels`` (default: all of next_qk_labels) while holding the
    next block's keys."""
    a = f"wg{w}"
    labels = self.next_qk_labels() if labels is None else labels
    only = [l for l in labels if l not in _WITH_OR_WITHOUT_NEXT]
    shared = [l for l in labels if l in _WITH_OR_WITHOUT_NEXT]
    out = [self.at(s, a, *only)] if only else []
    if shared:
      out.append(z3.And(self.at(s, a, *shared), s[f"{a}.g"] + 1 < s[f"{a}.E"]))
    return z3.Or(out) if out else z3.BoolVal(False)

  def reads_ring(self, s, w, b, i):
    """Warpgroup w may still read ring buffer b in slot i (held or wgmma)."""
    a = f"wg{w}"
    idx, g, E = s[f"{a}.idx"], s[f"{a}.g"], s[f"{a}.E"]
    cur, nxt = idx == i, idx == (i - 1) % self.S
    if b == "v":
      held = self.at(s, a, *_BODY_HEAD[1:], *self.next_qk_labels())
      return z3.Or(z3.And(held, cur), z3.And(s[f"{a}.pv"], cur))
    if b == "k":
      held_cur = z3.Or(self.at(s, a, *self.first_qk_labels(), "k_release"),
                       z3.And(self.at(s, a, "tile_pre_sync", "tile_pre_sync_wait"), g < E))
      held_next = self.at_next(s, w)
      busy_cur = z3.And(s[f"{a}.qk"], self.at(s, a, *self.first_qk_labels(), "qk_wait0"))
      busy_next = z3.And(s[f"{a}.qk"], self.at(s, a, *self.next_qk_labels()))
      return z3.Or(z3.And(z3.Or(held_cur, busy_cur), cur),
                   z3.And(z3.Or(held_next, busy_next), nxt))
    after0 = self.first_qk_labels()
    after0 = after0[after0.index(f"{b}_wait0") + 1:]
    afternext = self.next_qk_labels()
    afternext = afternext[afternext.index(f"{b}_wait_next") + 1:]
    return z3.Or(z3.And(self.at(s, a, *after0, "k_release"), cur),
                 z3.And(self.at_next(s, w, afternext), nxt))

  def q_reads_left(self, s, w):
    """Warpgroup w has waited for its queries and a QK of this tile still
    reads them (in flight, or not issued yet)."""
    a = f"wg{w}"
    g, E = s[f"{a}.g"], s[f"{a}.E"]
    first = self.first_qk_labels()
    return z3.Or(s[f"{a}.qk"],
                 z3.And(self.at(s, a, "k_wait0", "tile_pre_sync", "tile_pre_sync_wait", "qk0"),
                        g < E),
                 z3.And(self.at(s, a, *first[1:], "qk_wait0", "k_release", "q_release",
                                *[l for l in _BODY_HEAD if l != "pv"]), g + 1 < E),
                 z3.And(self.at(s, a, *self.next_qk_labels()), g + 2 < E))

  def q_hold(self, s, w):
    """Warpgroup w has waited for its queries and not released them yet
    (persistent; a one-tile block never releases, so: reads left)."""
    a = f"wg{w}"
    g, E, P = s[f"{a}.g"], s[f"{a}.E"], s[f"{a}.P"]
    if not self.persistent:
      return self.q_reads_left(s, w)
    head = ["k_wait0", "tile_pre_sync", "tile_pre_sync_wait"]
    first = self.first_qk_labels() + ["qk_wait0", "k_release", "q_release"]
    empty = ["tile_pre_sync", "tile_pre_sync_wait", "loop", "empty_pass", "empty_sync",
             "empty_sync_wait", "final_arrive", "q_release_end"]
    # released with the last block's k_consumed (after the loop if no blocks)
    return z3.Or(z3.And(self.at(s, a, *head), g < E),
                 self.at(s, a, *dict.fromkeys(first)),
                 self.at_next(s, w),
                 z3.And(self.at(s, a, *_BODY_HEAD), g + 1 < E),
                 z3.And(self.at(s, a, *empty), E == P))

  def output_written(self, s, w):
    return self.at(s, f"wg{w}", "o_store", "last_arrive", "done")

  # ---- compute warpgroups -----------------------------------------------

  def _compute(self, w):
    S, a = self.S, f"wg{w}"
    other = f"wg{1 - w}"
    g = lambda s: s[f"{a}.g"]
    E = lambda s: s[f"{a}.E"]
    P = lambda s: s[f"{a}.P"]
    idx = lambda s: s[f"{a}.idx"]
    local = self.mut == "tile_local_parity"
    own, oth = f"schedule_wg{w}", f"schedule_wg{1 - w}"
    tile_scope = self.scope == "tile"

    def chain(*steps):
      """The first program point whose condition holds (the last is unconditional)."""
      expr = self.goto(a, steps[-1][0] if isinstance(steps[-1], tuple) else steps[-1])
      for step in reversed(steps[:-1]):
        label, cond = step
        if cond is True:
          expr = self.goto(a, label)
        elif cond is not False:
          expr = z3.If(cond, self.goto(a, label), expr)
      return expr

    def content(s, b, i, block):
      return z3.And(z3.Not(s[f"tma.{b}[{i}]"]), s[f"blk.{b}[{i}]"] == block)

    def stale(b, i, block):
      return lambda s: [("stale", f"{a} reads {b}[{i}] before its block landed",
                         content(s, b, i, block(s)))]

    def explicit_parity(s, offset):
      # the mutant's parity: phase of the tile-local PipelineState (+offset)
      lidx, lph = s[f"{a}.lidx"], s[f"{a}.lph"]
      if offset == 0:
        return lph == 1
      return z3.If(lidx == S - 1, 1 - lph, lph) == 1

    def ring_wait(s, b, i, offset):
      bar = f"{b}_produced[{i}]"
      if local:
        return self.passes(s, a, bar, explicit_parity(s, offset)), {}
      return self.passes(s, a, bar), self._wait_bit(s, a, bar)

    def parity_of(b, i, offset):
      if local:
        return lambda s: explicit_parity(s, offset)
      return lambda s: s[f"{a}.bit.{b}_produced[{i}]"]

    def act(label, name, guard=lambda s: z3.BoolVal(True), extra=lambda s, f: {},
            nxt=None, **kw):
      self._act(actor=a, label=label, name=name,
                guard=lambda s: z3.And(self.at(s, a, label), guard(s)),
                update=lambda s, f: {f"{a}.pc": nxt(s), **extra(s, f)}, **kw)

    def ring_waits(label, b, offset, block, nxt, when=lambda s: z3.BoolVal(True)):
      for i in range(S):
        j = (i + offset) % S

        def guard(s, i=i, j=j):
          ok, _ = ring_wait(s, b, j, offset)
          return z3.And(when(s), idx(s) == i, ok)

        def extra(s, f, j=j):
          return ring_wait(s, b, j, offset)[1]
        what = f"consumer_wait: wait {b}_produced" + ("" if b in ("k", "v") else f", read {b}")
        where = " (next block)" if offset else " (first block)" if label.endswith("0") else ""
        act(label, what + where, guard=guard, extra=extra,
            nxt=nxt, slot=j, block=block, parity=parity_of(b, j, offset),
            checks=stale(b, j, block))

    last_qk = lambda s: g(s) + 1 == E(s)

    # program points only some variants have
    uses = set()
    if w == 1 and not tile_scope:
      uses |= {"pre_sync", "pre_sync_wait"}
    if w == 1 and tile_scope:
      uses |= {"tile_pre_sync", "tile_pre_sync_wait"}
    if self.mut == "release_before_wgmma":
      uses.add("k_release_early")
    if self.persistent:
      uses |= {"q_release_end", "store_wait", "q_release"}
    else:
      uses |= {"epi_sync", "epi_wait"}
    if self.empty_token:
      uses |= {"empty_pass", "empty_sync", "empty_sync_wait"}
    if w == 0 and (tile_scope or not self.persistent):
      uses.add("final_arrive")
    if w == 0 and not tile_scope and self.persistent:
      uses.add("last_arrive")
    optional = {"pre_sync", "pre_sync_wait", "tile_pre_sync", "tile_pre_sync_wait",
                "k_release_early", "q_release_end", "store_wait", "q_release", "epi_sync",
                "epi_wait", "empty_pass", "empty_sync", "empty_sync_wait", "final_arrive",
                "last_arrive"}
    self.unused_labels[a] = sorted(optional - uses)
    plain_act = act

    def act(label, *args, **kw):
      if label in optional and label not in uses:
        return
      plain_act(label, *args, **kw)

    # once per kernel: warpgroup 1 acquires the token first
    act("pre_sync", f"bar.sync {own} (arrive; before the tile loop)",
        extra=lambda s, f: self._bar(s, own, a), nxt=lambda s: self.goto(a, "pre_sync_wait"))
    act("pre_sync_wait", f"bar.sync {own} (wait)",
        guard=lambda s: s[f"nb.{own}.gen"] > s[f"{a}.target"],
        nxt=lambda s: self.goto(a, "q_wait"))

    # tile entry: wait for the queries, learn the trip count
    def enter(s, f):
      t = s[f"{a}.t"]
      u = {f"{a}.t": t + 1, f"{a}.P": g(s), **self._wait_bit(s, a, f"q_produced[{w}]")}
      if self.mode == "bmc":
        u[f"{a}.E"] = g(s) + self.trip(t, short=(self.mut == "short_warpgroup" and w == 0))
      else:
        u[f"{a}.E"] = f["end"]
      if self.ghosts:
        u[f"{a}.empties"] = s[f"{a}.empties"] + _b2i(u[f"{a}.E"] == g(s))
      if self.mut == "tile_local_slot":
        u.update({f"{a}.idx": 0, f"{a}.ph": 0, f"{a}.R": 0})
      if local:
        u.update({f"{a}.lidx": 0, f"{a}.lph": 0})
      has = g(s) < u[f"{a}.E"]
      u[f"{a}.pc"] = chain(("k_wait0", has), ("tile_pre_sync", tile_scope and w == 1), "loop")
      return u

    def known_end(s):
      """Proof mode: the end of the tile being entered, if the other warpgroup
      entered it (or the next one) first; -1 if this warpgroup is first."""
      t, to = s[f"{a}.t"], s[f"{other}.t"]
      return z3.If(to == t + 1, s[f"{other}.E"],
                   z3.If(to == t + 2, s[f"{other}.P"], z3.IntVal(-1)))

    least = 1 if self.p.nonempty_tiles else 0

    def fresh_ok(s, f):
      # any trip count, leaving at least `least` blocks to each later tile
      t, e = s[f"{a}.t"], f["end"]
      known = known_end(s)
      return z3.If(known >= 0, e == known,
                   z3.And(e >= g(s) + least, e <= self.T - least * (self.NT - t - 1),
                          z3.Implies(t + 1 == self.NT, e == self.T)))

    def witness(s):
      t = s[f"{a}.t"]
      known = known_end(s)
      return {"end": z3.If(known >= 0, known,
                           z3.If(t + 1 == self.NT, self.T, g(s) + least))}

    self._act(actor=a, label="q_wait", name=f"consumer_wait: wait q_produced[{w}]", slot=w,
              block=lambda s: s[f"{a}.t"], parity=lambda s: s[f"{a}.bit.q_produced[{w}]"],
              guard=lambda s: z3.And(self.at(s, a, "q_wait"), s[f"{a}.t"] < self.NT,
                                     self.passes(s, a, f"q_produced[{w}]")),
              update=enter,
              checks=lambda s: [("stale", f"{a} reads q before its tile landed",
                                 z3.And(z3.Not(s[f"tma.q[{w}]"]),
                                        s[f"blk.q[{w}]"] == s[f"{a}.t"]))],
              fresh=("end",) if self.mode == "proof" else (),
              fresh_ok=fresh_ok if self.mode == "proof" else None,
              witness=witness if self.mode == "proof" else None)

    after_k0 = lambda s: chain(("tile_pre_sync", tile_scope and w == 1), "qk0")
    ring_waits("k_wait0", "k", 0, g, after_k0)
    act("tile_pre_sync", f"bar.sync {own} (arrive; tile start)",
        extra=lambda s, f: self._bar(s, own, a),
        nxt=lambda s: self.goto(a, "tile_pre_sync_wait"))
    act("tile_pre_sync_wait", f"bar.sync {own} (wait)",
        guard=lambda s: s[f"nb.{own}.gen"] > s[f"{a}.target"],
        nxt=lambda s: chain(("qk0", g(s) < E(s)), "loop"))

    # the tile's first QK
    first = self.first_qk_labels()
    for i in range(S):
      act("qk0", "issue QK wgmma (first block)", guard=lambda s, i=i: idx(s) == i,
          extra=lambda s, f: {f"{a}.qk": z3.BoolVal(True)},
          nxt=lambda s: self.goto(a, first[1]), slot=i, block=g,
          parity=lambda s: s[f"{a}.ph"],
          checks=lambda s, i=i: [
              ("stale", f"{a} QK reads k[{i}] before its block landed",
               content(s, "k", i, g(s))),
              ("stale", f"{a} QK reads q before its tile landed",
               z3.And(z3.Not(s[f"tma.q[{w}]"]), s[f"blk.q[{w}]"] == s[f"{a}.t"] - 1))])
    for b in self.EXTRA:
      label = f"{b}_wait0"
      nxt_label = first[first.index(label) + 1]
      ring_waits(label, b, 0, g, lambda s, n=nxt_label: self.goto(a, n))
    act("sched_arrive0", f"bar.arrive {oth} (pass the token)",
        extra=lambda s, f: self._bar(s, oth),
        nxt=lambda s: self.goto(a, first[first.index("sched_arrive0") + 1]))
    after_release = lambda s: chain(("q_release", self.persistent and last_qk(s)), "loop")
    for i in range(S):
      act("k_release_early", "consumer_release: arrive k_consumed (before the QK completed)",
          guard=lambda s, i=i: idx(s) == i, extra=lambda s, f, i=i: self._arrive(s, "k_consumed", i),
          nxt=lambda s: self.goto(a, "qk_wait0"), slot=i, block=g)
    act("qk_wait0", "wait for the QK wgmma", guard=lambda s: z3.Not(s[f"{a}.qk"]),
        nxt=(after_release if self.mut == "release_before_wgmma"
             else lambda s: self.goto(a, "k_release")))
    for i in range(S):
      act("k_release", "consumer_release: arrive k_consumed", guard=lambda s, i=i: idx(s) == i,
          extra=lambda s, f, i=i: self._arrive(s, "k_consumed", i), nxt=after_release,
          slot=i, block=g)
    act("q_release", f"consumer_release: arrive q_consumed[{w}] (the tile's last QK completed)",
        extra=lambda s, f: self._arrive(s, "q_consumed", w),
        nxt=lambda s: self.goto(a, "loop"))

    # the key loop: QK of block g + 1 (if any), then PV of block g, one turn
    ring_waits("loop", "v", 0, g, lambda s: self.goto(a, "sched_sync"),
               when=lambda s: g(s) < E(s))
    def release_at_end(s):
      if not self.persistent:
        return False
      return E(s) == P(s)
    exit_chain = lambda s: chain(
        ("empty_pass", self.empty_token and (E(s) == P(s))),
        ("final_arrive", w == 0 and (tile_scope or not self.persistent)),
        ("q_release_end", release_at_end(s)), ("store_wait", self.persistent), "epi_sync")
    act("loop", "leave the key loop", guard=lambda s: g(s) == E(s), nxt=exit_chain, block=g)
    act("sched_sync", f"bar.sync {own} (arrive; acquire the token)",
        extra=lambda s, f: self._bar(s, own, a), nxt=lambda s: self.goto(a, "sched_wait"))
    act("sched_wait", f"bar.sync {own} (wait)",
        guard=lambda s: s[f"nb.{own}.gen"] > s[f"{a}.target"],
        nxt=lambda s: chain(("next_k_wait", g(s) + 1 < E(s)), "pv"))
    for i in range(S):
      act("pv", "issue PV wgmma", guard=lambda s, i=i: idx(s) == i,
          extra=lambda s, f: {f"{a}.pv": z3.BoolVal(True)},
          nxt=lambda s: chain((nq[nq.index("pv") + 1], g(s) + 1 < E(s)), "mma_wait"),
          slot=i, block=g, parity=lambda s: s[f"{a}.ph"], checks=stale("v", i, g))
    ring_waits("next_k_wait", "k", 1, lambda s: g(s) + 1, lambda s: self.goto(a, "next_qk"))
    nq = self.next_qk_labels()
    for i in range(S):
      j = (i + 1) % S
      act("next_qk", "issue QK wgmma (next block)", guard=lambda s, i=i: idx(s) == i,
          extra=lambda s, f: {f"{a}.qk": z3.BoolVal(True)},
          nxt=lambda s: self.goto(a, nq[1]), slot=j, block=lambda s: g(s) + 1,
          checks=lambda s, j=j: [
              ("stale", f"{a} QK reads k[{j}] before its block landed",
               content(s, "k", j, g(s) + 1)),
              ("stale", f"{a} QK reads q before its tile landed",
               z3.And(z3.Not(s[f"tma.q[{w}]"]), s[f"blk.q[{w}]"] == s[f"{a}.t"] - 1))])
    for b in self.EXTRA:
      label = f"{b}_wait_next"
      ring_waits(label, b, 1, lambda s: g(s) + 1,
                 lambda s, n=nq[nq.index(label) + 1]: self.goto(a, n))
    act("next_sched_arrive", f"bar.arrive {oth} (pass the token)",
        extra=lambda s, f: self._bar(s, oth), nxt=lambda s: self.goto(a, "mma_wait"))
    act("mma_wait", "wait for the wgmmas (PV, and QK of the next block)",
        guard=lambda s: z3.And(z3.Not(s[f"{a}.pv"]), z3.Not(s[f"{a}.qk"])),
        nxt=lambda s: self.goto(a, "v_release"))
    for i in range(S):
      def v_release(s, f, i=i):
        u = {f"{a}.g": g(s) + 1, **self._arrive(s, "v_consumed", i), **self._advance(s, a)}
        if local:
          u.update(self._advance(s, a, prefix="l"))
        return u
      act("v_release", "consumer_release: arrive v_consumed", guard=lambda s, i=i: idx(s) == i,
          extra=v_release, nxt=lambda s: chain(("k_release", g(s) + 1 < E(s)), "loop"),
          slot=i, block=g)

    # after the key loop
    after_empty = lambda s: chain(
        ("final_arrive", w == 0 and (tile_scope or not self.persistent)),
        ("q_release_end", release_at_end(s)), ("store_wait", self.persistent), "epi_sync")
    # (each warpgroup passes, then acquires, as for a block without work)
    act("empty_pass", f"bar.arrive {oth} (pass the token; tile without key blocks)",
        extra=lambda s, f: self._bar(s, oth), nxt=lambda s: self.goto(a, "empty_sync"))
    act("empty_sync", f"bar.sync {own} (arrive; tile without key blocks)",
        extra=lambda s, f: self._bar(s, own, a),
        nxt=lambda s: self.goto(a, "empty_sync_wait"))
    act("empty_sync_wait", f"bar.sync {own} (wait)",
        guard=lambda s: s[f"nb.{own}.gen"] > s[f"{a}.target"], nxt=after_empty)
    act("final_arrive", f"bar.arrive {oth} (pass the token for the last time)",
        extra=lambda s, f: self._bar(s, oth),
        nxt=lambda s: chain(("q_release_end", release_at_end(s)),
                            ("store_wait", self.persistent), "epi_sync"))
    act("q_release_end", f"consumer_release: arrive q_consumed[{w}] (after the key loop)",
        extra=lambda s, f: self._arrive(s, "q_consumed", w),
        nxt=lambda s: self.goto(a, "store_wait"))
    act("store_wait", "wait_smem_to_gmem (the last output copy read o)",
        guard=lambda s: z3.Not(s[f"{a}.store"]), nxt=lambda s: self.goto(a, "o_write"))
    act("epi_sync", "bar.sync epilogue (arrive)", extra=lambda s, f: self._bar(s, "epilogue", a),
        nxt=lambda s: self.goto(a, "epi_wait"))
    act("epi_wait", "bar.sync epilogue (wait)",
        guard=lambda s: s["nb.epilogue.gen"] > s[f"{a}.target"],
        nxt=lambda s: self.goto(a, "o_write"))

    def o_checks(s):
      if self.persistent:
        return [("output", f"{a} overwrites o[{w}] while its last copy still reads it",
                 z3.Not(s[f"{a}.store"]))]
      busy = []
      for v in range(self.W):
        busy += [self.q_reads_left(s, v), s[f"wg{v}.qk"], s[f"tma.q[{v}]"]]
        busy += [self.reads_ring(s, v, "k", i) for i in range(S)]
      busy += [s[f"tma.k[{i}]"] for i in range(S)]
      return [("overlay", f"{a} writes the output over q/k still in use",
               z3.Not(z3.Or(busy)))]
    act("o_write", "write o (and m, l) to shared memory", checks=o_checks,
        nxt=lambda s: self.goto(a, "o_store"))

    def after_store(s):
      if not self.persistent:
        return self.goto(a, "done")
      end = chain(("last_arrive", w == 0 and not tile_scope), "done")
      return z3.If(s[f"{a}.t"] < self.NT, self.goto(a, "q_wait"), end)
    act("o_store", "issue the output TMA store",
        extra=lambda s, f: {f"{a}.store": z3.BoolVal(True)}, nxt=after_store)
    act("last_arrive", f"bar.arrive {oth} (pass the token for the last time)",
        extra=lambda s, f: self._bar(s, oth), nxt=lambda s: self.goto(a, "done"))

  # ---- hardware ---------------------------------------------------------

  def _tma(self):
    for b in self.RING:
      for i in range(self.S):
        self._act(actor="tma", label="land", name=f"TMA {b} lands", slot=i,
                  block=lambda s, b=b, i=i: s[f"blk.{b}[{i}]"],
                  guard=lambda s, b=b, i=i: s[f"tma.{b}[{i}]"],
                  update=lambda s, f, b=b, i=i: {f"tma.{b}[{i}]": z3.BoolVal(False),
                                                 **self._complete(s, f"{b}_produced[{i}]")})
    for w in range(self.W):
      self._act(actor="tma", label="land", name="TMA q lands", slot=w,
                block=lambda s, w=w: s[f"blk.q[{w}]"],
                guard=lambda s, w=w: s[f"tma.q[{w}]"],
                update=lambda s, f, w=w: {f"tma.q[{w}]": z3.BoolVal(False),
                                          **self._complete(s, f"q_produced[{w}]")})

  def _async(self):
    for w in range(self.W):
      for n, what in (("qk", "QK wgmma completes"), ("pv", "PV wgmma completes"),
                      ("store", "output copy has read o")):
        self._act(actor="async", label="complete", name=f"wg{w} {what}",
                  block=lambda s, w=w: s[f"wg{w}.g"],
                  guard=lambda s, w=w, n=n: s[f"wg{w}.{n}"],
                  update=lambda s, f, w=w, n=n: {f"wg{w}.{n}": z3.BoolVal(False)})


# --------------------------------------------------------------------------
# Counterexamples: traces.


@dataclasses.dataclass(frozen=True)
class TraceRow:
  step: int
  actor: str
  action: str
  slot: int | None
  block: int | None
  phase: int | None

  def format(self) -> str:
    def f(x):
      return "-" if x is None else str(x)
    return (f"{self.step:>4}  {self.actor:<7} {self.action:<62} "
            f"{f(self.slot):>4} {f(self.block):>5} {f(self.phase):>5}")


@dataclasses.dataclass
class Counterexample:
  protocol: Protocol
  kind: str          # overwrite | stale | overlay | output | deadlock
  what: str
  trace: list[TraceRow]
  environment: str
  stuck: list[str]   # deadlock: where each actor is
  seconds: float
  engine: str

  def format(self) -> str:
    head = (f"counterexample ({self.kind}) for {self.protocol.describe()}: {self.what}\n"
            f"  {self.environment}; found by {self.engine} in {self.seconds:.1f} s\n"
            f"{'step':>4}  {'actor':<7} {'action':<62} {'slot':>4} {'block':>5} "
            f"{'phase':>5}")
    rows = [r.format() for r in self.trace]
    tail = ["  stuck: " + "; ".join(self.stuck)] if self.stuck else []
    return "\n".join([head, *rows, *tail])


def _describe_stuck(m: Model, value: Callable) -> list[str]:
  out = []
  for actor in ("memory", "qload", "wg0", "wg1"):
    label = m.labels[actor][value(f"{actor}.pc")]
    if actor == "memory":
      out.append(f"memory at {label} (block {value('memory.g')}, slot {value('memory.idx')})")
    elif actor == "qload":
      out.append(f"qload at {label} (tile {value('qload.t')})")
    else:
      tile = value(f"{actor}.t") - 1
      where = (f"tile {tile}, block {value(f'{actor}.g')} of blocks up to "
               f"{value(f'{actor}.E')}, slot {value(f'{actor}.idx')}" if tile >= 0
               else "before its first tile")
      out.append(f"{actor} at {label} ({where})")
  for name in m.named_barriers():
    out.append(f"{name}: {value(f'nb.{name}.count')} warpgroup(s) arrived in "
               f"generation {value(f'nb.{name}.gen')}")
  return out


# --------------------------------------------------------------------------
# Explicit-state search: the same actions, compiled to Python.

_PY_OPS = {
    z3.Z3_OP_ADD: lambda c: "(" + " + ".join(c) + ")",
    z3.Z3_OP_SUB: lambda c: "(" + " - ".join(c) + ")",
    z3.Z3_OP_UMINUS: lambda c: f"(-{c[0]})",
    z3.Z3_OP_MUL: lambda c: "(" + " * ".join(c) + ")",
    z3.Z3_OP_ITE: lambda c: f"({c[1]} if {c[0]} else {c[2]})",
    z3.Z3_OP_AND: lambda c: "(" + " and ".join(c) + ")",
    z3.Z3_OP_OR: lambda c: "(" + " or ".join(c) + ")",
    z3.Z3_OP_NOT: lambda c: f"(not {c[0]})",
    z3.Z3_OP_EQ: lambda c: f"({c[0]} == {c[1]})",
    z3.Z3_OP_DISTINCT: lambda c: f"({c[0]} != {c[1]})",
    z3.Z3_OP_LE: lambda c: f"({c[0]} <= {c[1]})",
    z3.Z3_OP_LT: lambda c: f"({c[0]} < {c[1]})",
    z3.Z3_OP_GE: lambda c: f"({c[0]} >= {c[1]})",
    z3.Z3_OP_GT: lambda c: f"({c[0]} > {c[1]})",
    z3.Z3_OP_IMPLIES: lambda c: f"((not {c[0]}) or {c[1]})",
    z3.Z3_OP_XOR: lambda c: f"({c[0]} != {c[1]})",
}


def _to_python(expr, index: dict, env: dict) -> str:
  """Python source for a quantifier-free integer/boolean z3 expression over
  the state tuple ``st`` (state variable -> ``st[i]``, constants inlined)."""
  memo: dict = {}

  def go(e):
    key = e.get_id()
    if key in memo:
      return memo[key]
    if z3.is_int_value(e):
      out = str(e.as_long())
    elif z3.is_true(e):
      out = "True"
    elif z3.is_false(e):
      out = "False"
    elif z3.is_const(e):
      name = e.decl().name()
      out = repr(env[name]) if name in env else f"st[{index[name]}]"
    else:
      op = _PY_OPS.get(e.decl().kind())
      if op is None:
        raise NotImplementedError(f"cannot compile {e.decl()}")
      out = op([go(c) for c in e.children()])
    memo[key] = out
    return out
  return go(expr)


def explore(proto: Protocol, trips: tuple[int, ...], *, short: tuple[int, ...] | None = None,
            max_states: int = 3_000_000, kinds: Iterable[str] | None = None,
            fired: set | None = None) -> Counterexample | None:
  """Breadth-first search of every interleaving for one tile list (its trip
  counts; ``short``: warpgroup 0's under the short_warpgroup mutant).
  Returns a shortest run (in actions) to a violated safety obligation or a
  deadlock, or None when every reachable state is safe.  ``fired`` collects
  (actor, action, slot) of every action taken somewhere."""
  start = time.perf_counter()
  m = Model(proto, "bmc", max_tiles=len(trips), max_trip=max(trips, default=0))
  kinds = None if kinds is None else set(kinds)
  names = sorted(m.sorts)
  s = {n: (z3.Int if m.sorts[n] == "int" else z3.Bool)(f"{n}@x") for n in names}
  index = {f"{n}@x": i for i, n in enumerate(names)}
  env = {"env.NT": len(trips)}
  for i, n in enumerate(trips):
    env[f"env.n[{i}]"] = n
  for i, n in enumerate(short if short is not None else trips):
    env[f"env.m[{i}]"] = n

  def fn(expr):
    return eval("lambda st: " + _to_python(z3.simplify(_z3(expr)), index, env))

  compiled = []
  for act in m.actions:
    upd = act.update(s, {})
    parts = {names.index(k): _to_python(z3.simplify(_z3(v)), index, env) for k, v in upd.items()}
    step = eval("lambda st: (" + "".join(
        (parts[i] if i in parts else f"st[{i}]") + ", " for i in range(len(names))) + ")")
    checks = [(k, w, fn(ok)) for k, w, ok in act.checks(s)
              if kinds is None or k in kinds]
    info = (fn(act.block(s)) if act.block else None,
            fn(_b2i(act.parity(s)) if act.parity is not None and
               z3.is_bool(act.parity(s)) else act.parity(s)) if act.parity else None)
    compiled.append((act, fn(act.guard(s)), step, checks, info))
  final = fn(m.final(s))
  init_solver = z3.Solver()
  init_solver.add(m.initial(s))
  init_solver.check()
  model = init_solver.model()
  init = tuple(z3.is_true(model.eval(s[n], model_completion=True)) if m.sorts[n] == "bool"
               else model.eval(s[n], model_completion=True).as_long() for n in names)

  parent: dict = {init: None}
  queue = collections.deque([init])

  def trace_to(st, last=None):
    rows = []
    while parent[st] is not None:
      prev, k = parent[st]
      rows.append((prev, k))
      st = prev
    rows.reverse()
    if last is not None:
      rows.append(last)
    out = []
    for n, (pre, k) in enumerate(rows):
      act, _, _, _, (blk, par) = compiled[k]
      par_v = par(pre) if par else None
      out.append(TraceRow(n, act.actor, act.name, act.slot, blk(pre) if blk else None,
                          int(par_v) if par_v is not None else None))
    return out

  env_text = f"trip counts per tile: {list(trips)}"
  if m.mut == "short_warpgroup":
    env_text += f", warpgroup 0 visits {list(short if short is not None else trips)}"
  while queue:
    st = queue.popleft()
    moved = False
    for k, (act, guard, step, checks, _) in enumerate(compiled):
      if not guard(st):
        continue
      moved = True
      if fired is not None:
        fired.add((act.actor, act.name, act.slot))
      for kind, what, ok in checks:
        if not ok(st):
          return Counterexample(proto, kind, what, trace_to(st, (st, k)), env_text, [],
                                time.perf_counter() - start, "explicit search")
      nxt = step(st)
      if nxt not in parent:
        parent[nxt] = (st, k)
        queue.append(nxt)
    if not moved and not final(st) and (kinds is None or "deadlock" in kinds):
      value = lambda n: int(st[names.index(n)])
      return Counterexample(proto, "deadlock", "no actor can move", trace_to(st), env_text,
                            _describe_stuck(m, value), time.perf_counter() - start,
                            "explicit search")
    if len(parent) > max_states:
      raise SearchBudgetExceeded(f"more than {max_states} states for trips {trips}")
  return None


class SearchBudgetExceeded(RuntimeError):
  pass


def explore_all(proto: Protocol, *, max_tiles: int = 2, max_trip: int = 2,
                max_states: int = 3_000_000, **kw) -> Counterexample | None:
  """:func:`explore` over every tile list of up to ``max_tiles`` tiles (one
  for a non-persistent block) with trip counts up to ``max_trip``, fewest key
  blocks first; the first counterexample found.  Tile lists whose state space
  exceeds ``max_states`` are skipped (raises if all of them are)."""
  lists = [trips for n in range(1, (max_tiles if proto.persistent else 1) + 1)
           for trips in itertools.product(range(max_trip + 1), repeat=n)]
  lists.sort(key=lambda trips: (sum(trips), len(trips)))
  skipped = 0
  for trips in lists:
    try:
      found = explore(proto, trips, max_states=max_states, **kw)
    except SearchBudgetExceeded:
      skipped += 1
      continue
    if found is not None:
      return found
  if skipped == len(lists):
    raise SearchBudgetExceeded(f"every tile list exceeds {max_states} states")
  return None


# --------------------------------------------------------------------------
# Bounded unrolling in macro-steps (SAT), trip counts symbolic.


def _val(model, expr):
  v = model.eval(expr, model_completion=True)
  if z3.is_true(v):
    return 1
  if z3.is_false(v):
    return 0
  return v.as_long()


def _bmc_solver():
  # solve-eqs eliminates the chain of per-step definitions first: about 20x
  # faster than the incremental default solver on these unrollings.
  return z3.Then("simplify", "propagate-values", "solve-eqs", "smt").solver()


def find_counterexample(proto: Protocol, *, max_steps: int = 16, max_tiles: int = 2,
                        max_trip: int = 3, trips: tuple[int, ...] | None = None,
                        short: tuple[int, ...] | None = None,
                        kinds: Iterable[str] | None = None) -> Counterexample | None:
  """A run of at most ``max_steps`` macro-steps (every actor, in the order of
  ``Model.ACTORS``, takes one action or idles; every interleaving is a run)
  that violates a safety obligation or deadlocks; None if there is none.

  Trip counts are symbolic in [0, max_trip] for up to ``max_tiles`` tiles
  unless ``trips`` fixes them.  One query at the final depth: a deadlocked
  state stays deadlocked and obligations of every step are collected, so any
  shorter counterexample is found too.
  """
  start = time.perf_counter()
  if trips is not None:
    max_tiles = len(trips)
    max_trip = max(max_trip, *trips)
  m = Model(proto, "bmc", max_tiles=max_tiles, max_trip=max_trip)
  kinds = None if kinds is None else set(kinds)
  solver = _bmc_solver()
  solver.add(m.env)
  if trips is not None:
    solver.add(m.NT == len(trips))
    solver.add([n == v for n, v in zip(m.trips, trips)])
  if short is not None:
    solver.add([n == v for n, v in zip(m.short, short)])
  elif m.mut != "short_warpgroup":
    solver.add([a == b for a, b in zip(m.short, m.trips)])
  cur = m.state("0")
  solver.add(m.initial(cur))
  by_actor = {a: [x for x in m.actions if x.actor == a] for a in m.ACTORS}
  probe = m.state("probe")
  touched = {a: sorted({k for x in acts for k in x.update(probe, {})})
             for a, acts in by_actor.items()}
  record = []      # (macro-step, actor, choice, pre-state, actions)
  candidates = []  # (kind, what, condition, state, record index)
  for step in range(max_steps):
    for actor in m.ACTORS:
      acts = by_actor[actor]
      ch = z3.Int(f"ch.{step}.{actor}")
      solver.add(ch >= 0, ch <= len(acts))
      ups = []
      for k, act in enumerate(acts, 1):
        solver.add(z3.Implies(ch == k, act.guard(cur)))
        ups.append(act.update(cur, {}))
        for kind, what, ok in act.checks(cur):
          if kinds is None or kind in kinds:
            candidates.append((kind, what, z3.And(ch == k, z3.Not(ok)), cur, len(record)))
      record.append((step, actor, ch, cur, acts))
      new = dict(cur)
      for name in touched[actor]:
        expr = cur[name]
        for k in range(len(acts), 0, -1):
          if name in ups[k - 1]:
            expr = z3.If(ch == k, _z3(ups[k - 1][name]), expr)
        nv = (z3.Bool if m.sorts[name] == "bool" else z3.Int)(f"{name}@{step}.{actor}")
        solver.add(nv == expr)
        new[name] = nv
      cur = new
  if kinds is None or "deadlock" in kinds:
    stuck = z3.And(z3.Not(m.final(cur)), *[z3.Not(x.guard(cur)) for x in m.actions])
    candidates.append(("deadlock", "no actor can move", stuck, cur, len(record)))
  if not candidates:
    return None
  solver.add(z3.Or([c[2] for c in candidates]))
  if solver.check() != z3.sat:
    return None
  model = solver.model()
  hit = next(c for c in candidates if z3.is_true(model.eval(c[2], model_completion=True)))
  trace = []
  for (_, actor, ch, pre, acts) in record[:hit[4] + 1]:
    k = _val(model, ch)
    if k:
      act = acts[k - 1]
      trace.append(TraceRow(len(trace), actor, act.name, act.slot,
                            _val(model, act.block(pre)) if act.block else None,
                            _val(model, act.parity(pre)) if act.parity else None))
  nt = _val(model, m.NT)
  env = "trip counts per tile: " + str([_val(model, m.trips[t]) for t in range(nt)])
  if m.mut == "short_warpgroup":
    env += ", warpgroup 0 visits " + str([_val(model, m.short[t]) for t in range(nt)])
  stuck = []
  if hit[0] == "deadlock":
    stuck = _describe_stuck(m, lambda n: _val(model, hit[3][n]))
  return Counterexample(proto, hit[0], hit[1], trace, env, stuck,
                        time.perf_counter() - start, f"unrolling ({max_steps} macro-steps)")


# --------------------------------------------------------------------------
# The inductive invariant (proof mode).


def _min(a, b):
  return z3.If(a <= b, a, b)


class _Counts:
  """Global event counts of one state, as linear expressions.

  Every count is ``g + e``: ``g = S*R + index`` is the actor's loop count
  (its ring position) and ``e`` a small 0/1/2 expression of its pc, so "how
  many of those events hit slot i" stays linear without mod:
  ``R + [index > i] + sum_j [e > j and index == (i - j) mod S]``.
  """

  def __init__(self, m: Model, s: State):
    self.m, self.s, self.S = m, s, m.S

  def before(self, who, e, i):
    s, S = self.s, self.S
    idx = s[f"{who}.idx"]
    out = s[f"{who}.R"] + _b2i(idx > i)
    for j in range(2):
      out = out + _b2i(z3.And(e > j, idx == (i - j) % S))
    return out

  def total(self, who, e):
    return self.s[f"{who}.g"] + e

  # producer ----------------------------------------------------------------
  def p_claim(self, b):
    """Blocks for which the producer is past its consumed-wait for buffer b."""
    m, s = self.m, self.s
    if b == "v":
      return _b2i(m.at(s, "memory", "v_issue"))
    return _b2i(m.at(s, "memory", *[f"{x}_issue" for x in m.KP], "v_wait", "v_issue"))

  def p_issued(self, b):
    m, s = self.m, self.s
    if b == "v":
      return z3.IntVal(0)
    seq = m.labels["memory"]
    later = seq[seq.index(f"{b}_issue") + 1:seq.index("done")]
    return _b2i(m.at(s, "memory", *later))

  # compute warpgroups ------------------------------------------------------
  def _sets(self, w):
    m, s = self.m, self.s
    a = f"wg{w}"
    g, E = s[f"{a}.g"], s[f"{a}.E"]
    first = m.first_qk_labels()
    nxt = m.next_qk_labels()
    only, tail = [l for l in nxt[:-2] if l != "pv"], nxt[-2:]
    body_pre = ["sched_sync", "sched_wait", "next_k_wait", "pv"]
    in_iter = z3.Or(m.at(s, a, *body_pre, *only, *tail),
                    z3.And(m.at(s, a, "loop"), g < E))
    return a, g, E, first, only, tail, body_pre, in_iter

  def w_waited(self, w, b):
    m, s = self.m, self.s
    a, g, E, first, only, tail, body_pre, in_iter = self._sets(w)
    if b == "v":
      return _b2i(m.at(s, a, *body_pre, *only, *tail))
    key = "k" if b == "k" else b
    f_after = first[first.index("qk0"):] if key == "k" else first[first.index(f"{b}_wait0") + 1:]
    n_after = only if key == "k" else only[only.index(f"{b}_wait_next") + 1:]
    cur = z3.Or(m.at(s, a, *f_after, "k_release", "q_release"), in_iter,
                z3.And(m.at(s, a, "tile_pre_sync", "tile_pre_sync_wait"), g < E,
                       key == "k"))
    # the next block's keys are waited for before the PV issue (its staged
    # tiles after it)
    after_wait = [*tail, "pv"] if key == "k" else tail
    nxt = z3.Or(m.at(s, a, *n_after) if n_after else z3.BoolVal(False),
                z3.And(m.at(s, a, *after_wait), g + 1 < E))
    return _b2i(cur) + _b2i(nxt)

  def w_released(self, w, b):
    m, s = self.m, self.s
    if b == "v":
      return z3.IntVal(0)
    a, g, E, first, only, tail, body_pre, in_iter = self._sets(w)
    return _b2i(z3.Or(m.at(s, a, "q_release"), in_iter))

  def passed_not_acquired(self, w):
    """Warpgroup w passed the token and has not yet arrived to acquire it back."""
    m, s = self.m, self.s
    a, g, E, first, only, tail, body_pre, in_iter = self._sets(w)
    return z3.Or(m.at(s, a, "qk_wait0", "k_release", "q_release", "sched_sync", "empty_sync"),
                 z3.And(m.at(s, a, "loop"), g < E), z3.And(m.at(s, a, *tail), g + 1 < E))


def invariant(m: Model, s: State) -> list[tuple[str, z3.BoolRef]]:
  """The inductive invariant, as named conjuncts.

  * Program points and loop counters agree (e.g. inside a block g < E).
  * Ring: for every staged buffer, each warpgroup waits only for issued
    blocks, releases only waited ones, and the producer claims a slot at most
    S blocks past each warpgroup's release.  Per slot, the copies landed,
    issued and waited for are linear in the actors' positions.
  * Window lemma: a waiter is never more than one phase behind a barrier, so
    its single parity bit differs from the barrier's exactly when the phase it
    waits for has completed (this is what rules out parity aliasing).
  * Consumed barriers: the two warpgroups' arrivals on a slot pair up
    (differ by at most one), so completed phases = the smaller count.
  * Queries: the same for the one-deep q ring per warpgroup.
  * Pingpong: passes and acquires per warpgroup are counted from its blocks
    and tiles without key blocks; every schedule-barrier generation is one
    pass plus one acquire, and a waiting warpgroup waits for its own.
  * Tiles: warpgroups in the same tile agree on its range; one or two tiles
    apart, the ranges abut.
  """
  if m.mode != "proof" or m.mut is not None:
    raise ValueError("the invariant is for a protocol without mutation, in proof mode")
  if m.scope != "kernel":
    raise ValueError("no invariant for a per-tile token: it deadlocks (see explore)")
  S, T, NT = m.S, m.T, m.NT
  c = _Counts(m, s)
  inv: list[tuple[str, z3.BoolRef]] = []

  def add(name, expr):
    inv.append((name, expr))

  def window(completed, waits, phase, bit, name):
    """A waiter is never more than one phase behind, so its one parity bit is
    unambiguous: it differs from the barrier's iff the awaited phase completed."""
    add(f"{name}: at most one phase ahead of the waiter",
        z3.And(waits <= completed, completed <= waits + 1))
    add(f"{name}: parity bits differ iff the next phase completed",
        (s[bit] != s[phase]) == (completed == waits + 1))

  for actor in ("memory", "qload", "wg0", "wg1"):
    pc = s[f"{actor}.pc"]
    add(f"{actor}: pc is a program point", z3.And(pc >= 0, pc < len(m.labels[actor])))
  for w in range(m.W):
    a = f"wg{w}"
    unused = list(m.unused_labels[a])
    if w == 0:
      unused += ["pre_sync", "pre_sync_wait"]
    if unused:
      add(f"{a}: never at {unused}", z3.Not(m.at(s, a, *unused)))
  # ring positions: g = S*R + index, like PipelineState.at(S, g)
  for who in ("memory", "wg0", "wg1"):
    add(f"{who}: g = S*R + index", s[f"{who}.g"] == S * s[f"{who}.R"] + s[f"{who}.idx"])
    add(f"{who}: index in [0, S)", z3.And(s[f"{who}.idx"] >= 0, s[f"{who}.idx"] < S))
    add(f"{who}: R >= 0", s[f"{who}.R"] >= 0)
    add(f"{who}: phase bit", z3.Or(s[f"{who}.ph"] == 0, s[f"{who}.ph"] == 1))

  # producer loop
  gp = s["memory.g"]
  add("memory: g <= T", gp <= T)
  add("memory: issuing only blocks < T", z3.Implies(c.p_claim("k") == 1, gp < T))
  add("memory: done at T", z3.Implies(m.at(s, "memory", "done"), gp == T))

  # compute warpgroups: tiles and program points
  first = m.first_qk_labels()
  nxt = m.next_qk_labels()
  body = ["sched_sync", "sched_wait", "next_k_wait"] + nxt
  exits = [l for l in _EXIT if l not in ("done", "last_arrive")]
  for w in range(m.W):
    a = f"wg{w}"
    g, E, P, t = (s[f"{a}.{n}"] for n in ("g", "E", "P", "t"))
    add(f"{a}: P <= g <= E <= T", z3.And(0 <= P, P <= g, g <= E, E <= T))
    add(f"{a}: 0 <= t <= NT", z3.And(t >= 0, t <= NT))
    add(f"{a}: no tile entered", z3.Implies(t == 0, z3.And(g == 0, P == 0, E == 0)))
    add(f"{a}: the first tile starts at 0", z3.Implies(t <= 1, P == 0))
    add(f"{a}: the last tile ends at T", z3.Implies(z3.And(t >= 1, t == NT), E == T))
    add(f"{a}: before the first tile", z3.Implies(m.at(s, a, "pre_sync", "pre_sync_wait"),
                                                  t == 0))
    add(f"{a}: between tiles", z3.Implies(m.at(s, a, "q_wait"), z3.And(g == E, t < NT)))
    add(f"{a}: the tile's first block", z3.Implies(
        m.at(s, a, "k_wait0", *first), z3.And(g == P, g < E, t >= 1)))
    add(f"{a}: released keys of a block in the tile", z3.Implies(
        m.at(s, a, "k_release", "q_release"), z3.And(g < E, t >= 1)))
    add(f"{a}: in the key loop", z3.Implies(m.at(s, a, "loop"), t >= 1))
    add(f"{a}: in a block", z3.Implies(m.at(s, a, *body), z3.And(g < E, t >= 1)))
    add(f"{a}: a next block exists", z3.Implies(
        m.at(s, a, "next_k_wait", *[l for l in nxt[:-2] if l != "pv"]), g + 1 < E))
    if m.persistent:
      add(f"{a}: q released at the last block", z3.Implies(m.at(s, a, "q_release"),
                                                           g + 1 == E))
    add(f"{a}: after the key loop", z3.Implies(m.at(s, a, *exits), z3.And(g == E, t >= 1)))
    add(f"{a}: tile without key blocks", z3.Implies(
        m.at(s, a, "empty_pass", "empty_sync", "empty_sync_wait"), P == E))
    if m.persistent:
      add(f"{a}: q released after the loop only without key blocks", z3.Implies(
          m.at(s, a, "q_release_end"), P == E))
    add(f"{a}: done", z3.Implies(m.at(s, a, "done", "last_arrive"),
                                 z3.And(t == NT, g == T)))
    add(f"{a}: QK in flight only while awaited",
        z3.Implies(s[f"{a}.qk"], z3.Or(m.at(s, a, *first[1:], "qk_wait0"),
                                       m.at_next(s, w, nxt[1:-1]))))
    add(f"{a}: PV in flight only while awaited",
        z3.Implies(s[f"{a}.pv"], m.at(s, a, *nxt[nxt.index("pv") + 1:-1])))
    add(f"{a}: output copy done before o is written",
        z3.Implies(m.at(s, a, "o_write"), z3.Not(s[f"{a}.store"])))
    if not m.persistent:
      add(f"{a}: output copy only at the end",
          z3.Implies(s[f"{a}.store"], m.at(s, a, "done", "last_arrive")))
  if m.p.nonempty_tiles:
    for w in range(m.W):
      a = f"wg{w}"
      g, E, P, t = (s[f"{a}.{n}"] for n in ("g", "E", "P", "t"))
      add(f"{a}: tiles have key blocks", z3.Implies(t >= 1, E >= P + 1))
      add(f"{a}: blocks left for the later tiles", T - E >= NT - t)
    add("tiles: the tile between has key blocks", z3.Implies(
        s["wg0.t"] == s["wg1.t"] + 2, s["wg0.P"] >= s["wg1.E"] + 1))
  t0, t1 = s["wg0.t"], s["wg1.t"]
  add("tiles: wg0 at most 2 ahead, 1 behind", z3.And(t0 - t1 <= 2, t1 - t0 <= 1))
  add("tiles: same tile, same range", z3.Implies(t0 == t1, z3.And(
      s["wg0.P"] == s["wg1.P"], s["wg0.E"] == s["wg1.E"])))
  add("tiles: wg0 one ahead", z3.Implies(t0 == t1 + 1, s["wg0.P"] == s["wg1.E"]))
  add("tiles: wg0 two ahead", z3.Implies(t0 == t1 + 2, s["wg0.P"] >= s["wg1.E"]))
  add("tiles: wg1 one ahead", z3.Implies(t1 == t0 + 1, s["wg1.P"] == s["wg0.E"]))

  # the key/value ring
  for b in m.RING:
    claim = c.p_claim(b)
    issued = c.p_issued(b)
    rel = "v" if b == "v" else "k"
    for w in range(m.W):
      a = f"wg{w}"
      waited = c.w_waited(w, b)
      released = c.w_released(w, rel)
      add(f"{b}: {a} releases after it waits", released <= waited)
      add(f"{b}: {a} waits only for issued blocks",
          c.total(a, waited) <= c.total("memory", issued))
      add(f"{b}: producer at most S ahead of {a}'s release",
          c.total("memory", claim) <= c.total(a, released) + S)
    add(f"{b}: issue after the consumed wait", issued <= claim)
    for i in range(S):
      n = c.before("memory", issued, i)
      landed = n - _b2i(s[f"tma.{b}[{i}]"])
      add(f"{b}[{i}]: holds the latest block issued into it",
          s[f"blk.{b}[{i}]"] == z3.If(n >= 1, S * (n - 1) + i, -1))
      add(f"{b}[{i}]: in flight only once issued", landed >= 0)
      for w in range(m.W):
        a = f"wg{w}"
        window(landed, c.before(a, c.w_waited(w, b), i), f"mb.{b}_produced[{i}].phase",
               f"{a}.bit.{b}_produced[{i}]", f"{b}_produced[{i}] vs {a}")
  for cons, b in (("k_consumed", "k"), ("v_consumed", "v")):
    for i in range(S):
      arr = [c.before(f"wg{w}", c.w_released(w, b), i) for w in range(m.W)]
      done = _min(arr[0], arr[1])
      add(f"{cons}[{i}]: arrivals pair up",
          z3.And(arr[0] - arr[1] <= 1, arr[1] - arr[0] <= 1))
      add(f"{cons}[{i}]: pending arrivals",
          s[f"mb.{cons}[{i}].pending"] == arr[0] + arr[1] - 2 * done)
      n = c.before("memory", c.p_claim(b), i)
      # the producer skips its wait on each slot's first use (g < S)
      window(done, z3.If(n >= 1, n - 1, 0), f"mb.{cons}[{i}].phase",
             f"memory.bit.{cons}[{i}]", f"{cons}[{i}] vs memory")

  # the query slots
  tq = s["qload.t"]
  seq = m.labels["qload"][:-1]
  add("qload: 0 <= t <= NT", z3.And(tq >= 0, tq <= NT))
  add("qload: done at NT", z3.Implies(m.at(s, "qload", "done"), tq == NT))
  add("qload: issuing only tiles < NT", z3.Implies(m.at(s, "qload", *seq[1:]), tq < NT))
  claimed = [tq + _b2i(m.at(s, "qload", *seq[seq.index(f"qc{w}_wait") + 1:]))
             for w in range(m.W)]
  issued = [tq + _b2i(m.at(s, "qload", *seq[seq.index(f"q{w}_issue") + 1:]))
            if seq.index(f"q{w}_issue") + 1 < len(seq) else tq for w in range(m.W)]
  for w in range(m.W):
    a = f"wg{w}"
    landed = issued[w] - _b2i(s[f"tma.q[{w}]"])
    add(f"q[{w}]: holds the latest tile issued", s[f"blk.q[{w}]"] == issued[w] - 1)
    add(f"q[{w}]: in flight only once issued", landed >= 0)
    window(landed, s[f"{a}.t"], f"mb.q_produced[{w}].phase", f"{a}.bit.q_produced[{w}]",
           f"q_produced[{w}] vs {a}")
    add(f"q[{w}]: issue after the consumed wait", issued[w] <= claimed[w])
    if m.persistent:
      hold = m.q_hold(s, w)
      released = s[f"{a}.t"] - _b2i(hold)
      add(f"q[{w}]: held only inside a tile", z3.Implies(hold, s[f"{a}.t"] >= 1))
      add(f"q[{w}]: prefetch at most one tile ahead", claimed[w] <= released + 1)
      window(released, z3.If(claimed[w] >= 1, claimed[w] - 1, 0),
             f"mb.q_consumed[{w}].phase", f"qload.bit.q_consumed[{w}]",
             f"q_consumed[{w}] vs qload")

  # the pingpong token: every generation of a schedule barrier is one pass of
  # the other warpgroup plus one acquire of its owner; passes and acquires
  # counted per block (QK passes, PV acquires) and per tile without blocks
  passes, acquires = [], []
  for w in range(m.W):
    a, g, E, first, only, tail, body_pre, in_iter = c._sets(w)
    P, Z = s[f"{a}.P"], s[f"{a}.empties"]
    empty_tile = P == E
    add(f"{a}: tiles without key blocks <= tiles", z3.And(Z >= 0, Z <= s[f"{a}.t"]))
    pass_g = z3.Or(m.at(s, a, *first[first.index("sched_arrive0") + 1:], "qk_wait0",
                        "k_release", "q_release"), in_iter)
    pass_next = z3.And(m.at(s, a, *tail), g + 1 < E)
    pend_pass = z3.And(empty_tile, m.at(s, a, "loop", "empty_pass"))
    acq_g = m.at(s, a, "sched_wait", "pv", "next_k_wait", *only, *tail)
    pend_acq = z3.And(empty_tile, m.at(s, a, "loop", "empty_pass", "empty_sync"))
    if m.empty_token:
      empties_passed = Z - _b2i(pend_pass)
      empties_acquired = Z - _b2i(pend_acq)
    else:
      empties_passed = empties_acquired = z3.IntVal(0)
    p = g + _b2i(pass_g) + _b2i(pass_next) + empties_passed
    q = g + _b2i(acq_g) + empties_acquired
    if w == 0:
      final = (m.at(s, a, "done") if m.persistent else
               m.at(s, a, *_EXIT[_EXIT.index("final_arrive") + 1:]))
      p = p + _b2i(final)
    else:
      q = q + _b2i(z3.Not(m.at(s, a, "pre_sync")))
    passes.append(p)
    acquires.append(q)
  Z0, Z1 = s["wg0.empties"], s["wg1.empties"]
  e0 = _b2i(s["wg0.P"] == s["wg0.E"])
  e1 = _b2i(s["wg1.P"] == s["wg1.E"])
  add("empties: same tile", z3.Implies(t0 == t1, Z0 == Z1))
  add("empties: wg0 one tile ahead", z3.Implies(t0 == t1 + 1, Z0 == Z1 + e0))
  add("empties: wg0 two tiles ahead", z3.Implies(
      t0 == t1 + 2, Z0 == Z1 + e0 + _b2i(s["wg1.E"] == s["wg0.P"])))
  add("empties: wg1 one tile ahead", z3.Implies(t1 == t0 + 1, Z1 == Z0 + e1))
  for w in range(m.W):
    a = f"wg{w}"
    barrier = f"schedule_wg{w}"
    x, y = passes[1 - w], acquires[w]
    gen, count = s[f"nb.{barrier}.gen"], s[f"nb.{barrier}.count"]
    waiting = m.at(s, a, "pre_sync_wait", "sched_wait", "empty_sync_wait")
    add(f"{barrier}: one pass per acquire", z3.And(x - y <= 1, y - x <= 1))
    add(f"{barrier}: generation", gen == _min(x, y))
    add(f"{barrier}: count", count == x + y - 2 * _min(x, y))
    add(f"{barrier}: {a} waits for its own generation",
        z3.Implies(waiting, s[f"{a}.target"] == y - 1))
    add(f"{barrier}: {a} passed only completed generations", y - _b2i(waiting) <= gen)
  if not m.persistent:
    ep = [_b2i(m.at(s, f"wg{w}", "epi_wait", "o_write", "o_store", "done"))
          for w in range(m.W)]
    gen, count = s["nb.epilogue.gen"], s["nb.epilogue.count"]
    add("epilogue: generation", gen == _min(ep[0], ep[1]))
    add("epilogue: count", count == ep[0] + ep[1] - 2 * _min(ep[0], ep[1]))
    for w in range(m.W):
      a = f"wg{w}"
      add(f"epilogue: {a} waits for generation 0",
          z3.Implies(m.at(s, a, "epi_wait"), s[f"{a}.target"] == 0))
      add(f"epilogue: {a} passed only completed generations",
          ep[w] - _b2i(m.at(s, a, "epi_wait")) <= gen)
  return inv


# --------------------------------------------------------------------------
# The proof.


@dataclasses.dataclass
class ProofResult:
  protocol: Protocol
  proven: bool
  seconds: float
  queries: int
  conjuncts: int
  failures: list[str]

  def format(self) -> str:
    status = "proven" if self.proven else "NOT proven"
    out = [f"{self.protocol.describe()}: {status} ({self.queries} queries, "
           f"{self.conjuncts} conjuncts, {self.seconds:.2f} s)"]
    out += ["  " + f for f in self.failures]
    return "\n".join(out)


def _state_vars(expr, cache: dict) -> frozenset:
  """Names of the state variables an expression mentions (memoised by AST id)."""
  key = expr.get_id()
  if key in cache:
    return cache[key]
  if z3.is_const(expr):
    name = expr.decl().name()
    out = frozenset([name.split("@")[0]]) if "@" in name else frozenset()
  else:
    out = frozenset().union(*[_state_vars(ch, cache) for ch in expr.children()])
  cache[key] = out
  return out


def _query_solver():
  # A fresh, non-incremental solver per query: the guard fixes the acting
  # warpgroup's pc, and propagate-values / solve-eqs then discard most
  # conjuncts before search (about 5x faster than push/pop on one solver);
  # z3's older arithmetic solver is another ~10% faster on these queries.
  return z3.Then("simplify", "propagate-values", "solve-eqs", "simplify",
                 z3.With("smt", **{"arith.solver": 2})).solver()


def prove(proto: Protocol, *, max_failures: int = 5, explain: bool = True,
          drop: Iterable[str] = ()) -> ProofResult:
  """Check the invariant by separate queries: initiation; for every action,
  consecution and its safety obligations (one query: guard, invariant, and
  the negation of both); the nondeterministic choices' feasibility; deadlock
  freedom (an invariant state that is not final enables some action).

  Consecution of an action only re-checks the conjuncts that mention a
  variable the action changes (the others are preserved trivially), each
  obtained by substituting the post-state into the conjunct.
  """
  start = time.perf_counter()
  m = Model(proto, "proof")
  s = m.state("s")
  drop = tuple(drop)
  inv = [(n, e) for n, e in invariant(m, s) if not any(d in n for d in drop)]
  base = [z3.And(*m.env, *[e for _, e in inv])]
  cache: dict = {}
  mentions = [_state_vars(e, cache) for _, e in inv]
  failures: list[str] = []
  queries = 0

  def check(*extra):
    nonlocal queries
    queries += 1
    solver = _query_solver()
    solver.add(*extra)
    result = solver.check()
    if result == z3.unknown:
      raise RuntimeError(f"z3 gave up: {solver.reason_unknown()}")
    return solver.model() if result == z3.sat else None

  def where(model):
    return [f"{a}@{m.labels[a][_val(model, s[f'{a}.pc'])]}"
            for a in ("memory", "qload", "wg0", "wg1")]

  def fail(msg):
    if len(failures) < max_failures:
      failures.append(msg)

  model = check(*m.env, m.initial(s), z3.Not(z3.And([e for _, e in inv])))
  if model is not None:
    bad = [n for n, e in inv if z3.is_false(model.eval(e, model_completion=True))]
    fail(f"initiation: {bad[:4]}")
  for act in m.actions:
    fresh = {n: z3.Int(f"fresh.{n}") for n in act.fresh}
    upd = {k: _z3(v) for k, v in act.update(s, fresh).items()}
    changed = {k for k, v in upd.items() if not v.eq(s[k])}
    pairs = [(s[k], upd[k]) for k in changed]
    touched = [(n, e) for (n, e), vs in zip(inv, mentions) if vs & changed]
    checks = act.checks(s)
    guard = [act.guard(s)] + ([act.fresh_ok(s, fresh)] if act.fresh_ok else [])
    wrong = [z3.Not(z3.substitute(z3.And([e for _, e in touched]), *pairs))] if touched else []
    wrong += [z3.Not(ok) for _, _, ok in checks]
    if wrong:
      model = check(*base, *guard, z3.Or(wrong))
      if model is not None:
        what = f"{act.actor} '{act.name}' slot {act.slot}"
        ev = lambda e: z3.is_false(model.eval(e, model_completion=True))
        bad_inv = [n for n, e in touched if ev(z3.substitute(e, *pairs))]
        bad_safe = [f"{k}: {w}" for k, w, ok in checks if ev(ok)]
        if bad_safe:
          fail(f"safety: {what}: {bad_safe}" + (f"; from {where(model)}" if explain else ""))
        if bad_inv:
          fail(f"consecution: {what}; breaks {bad_inv[:4]}"
               + (f"; from {where(model)}" if explain else ""))
    if act.witness is not None:
      model = check(*base, act.guard(s), z3.Not(act.fresh_ok(s, act.witness(s))))
      if model is not None:
        fail(f"choice infeasible: {act.actor} '{act.name}'")
  model = check(*base, z3.Not(m.final(s)), *[z3.Not(a.guard(s)) for a in m.actions])
  if model is not None:
    fail("deadlock: an invariant state where no actor can move"
         + (f"; {where(model)}" if explain else ""))
  return ProofResult(proto, not failures, time.perf_counter() - start, queries, len(inv),
                     failures)


# --------------------------------------------------------------------------
# Vacuity: the proof is about runs that exist.


@dataclasses.dataclass
class Vacuity:
  protocol: Protocol
  satisfiable: bool                  # some state satisfies the invariant
  dead: list[str]                    # actions enabled in no invariant state
  shallow: list[str]                 # enabled only while g < 3 * num_stages
  producer_ahead: bool               # producer S blocks past both consumers
  producer_beyond: bool              # ... or more (must be False)


def _depth(m: Model, act: Action, s: State):
  deep = 3 * m.S
  if act.actor.startswith("wg"):
    return s[f"{act.actor}.g"] >= deep
  if act.actor == "qload":
    return z3.And(s["qload.t"] >= 2, s["memory.g"] >= deep)
  return s["memory.g"] >= deep


def vacuity(proto: Protocol) -> Vacuity:
  """Every action can fire from some invariant state, deep ones (g >= 3S)
  included; the producer can run num_stages blocks ahead and no further."""
  m = Model(proto, "proof")
  s = m.state("s")
  base = z3.And(*m.env, *[e for _, e in invariant(m, s)])

  def sat(*extra):
    solver = _query_solver()
    solver.add(base, *extra)
    return solver.check() == z3.sat

  dead, shallow = [], []
  for act in m.actions:
    what = f"{act.actor} '{act.name}'" + (f" slot {act.slot}" if act.slot is not None else "")
    if sat(act.guard(s), _depth(m, act, s)):
      continue
    (shallow if sat(act.guard(s)) else dead).append(what)
  c = _Counts(m, s)
  claim = c.total("memory", c.p_claim("k"))
  released = [c.total(f"wg{w}", c.w_released(w, "k")) for w in range(m.W)]
  ahead = sat(*[claim == r + m.S for r in released], s["memory.g"] >= 3 * m.S,
              m.at(s, "memory", "k_wait"))
  beyond = sat(z3.Or([claim > r + m.S for r in released]))
  return Vacuity(proto, sat(), dead, shallow, ahead, beyond)
