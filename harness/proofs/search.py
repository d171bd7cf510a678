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
  into the slot while the load is a role's next step is reported there.
  Waits that retire reads (wgmma waits, store waits) and every step other
  roles can observe are interleaved.
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
import gc
import time

from harness.proofs.events import Event
from harness.proofs.role_programs import AHEAD_CAP, CoverageError, LaunchProgram
from harness.proofs.search_environment import Environment
from harness.proofs.search_program import Static
from harness.proofs.search_state import C_NONE, PRE, Fail, NormalForm, set_at
from harness.proofs.search_steps import Steps
from harness.proofs.violations import Checks, CheckResult, Violation, describe_word

MAX_STATES = 3_000_000


class Search(Environment, NormalForm, Steps, Checks):
  """The search over one launch program's states: its environment
  (:mod:`harness.proofs.search_environment`), its states' normal form
  (:mod:`harness.proofs.search_state`), its steps
  (:mod:`harness.proofs.search_steps`) and the checks they make
  (:mod:`harness.proofs.violations`)."""

  def __init__(self, st: Static, max_states: int, reduce: bool = True):
    self.st, self.max_states, self.reduce = st, max_states, reduce
    self.prog = st.prog
    self.ring = st.ring
    self.window = 4 * (st.ring.stages + AHEAD_CAP) + 16
    if st.prog.word is not None:  # one environment: roles drift at most its length apart
      self.window = max(self.window, len(st.prog.word) + 16)
    self.rotate_states = reduce

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
          grown.append((env2, set_at(roles, ri, (ph, u, k, x, y) + r[5:])))
      partial = grown
    return [(env, roles, tuple((0, 0) for _ in st.bar_keys), (),
             tuple(0 for _ in st.tma_slots), tuple(-1 for _ in st.tma_slots),
             tuple(0 for _ in st.ring_buffers), tuple((C_NONE,) for _ in st.smem_slots),
             tuple((0, 0, 0) for _ in st.named_ids)) for env, roles in partial]


@contextlib.contextmanager
def collector_paused():
  """Python's cyclic garbage collector off for the block (as it was after).
  The search allocates millions of tuples and keeps every state it reached;
  none of them is in a reference cycle, so reference counting frees all of
  it, while each pass of the collector walks every live container -- the
  states kept and the JAX modules imported -- which cost about a third of
  a check.  Tracing and learning (:mod:`harness.proofs.prove_pool`)
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
  st = Static(prog)
  if st.violations:
    return CheckResult(False, 0, time.perf_counter() - start, st.violations[0])
  search = Search(st, max_states, reduce)
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
  except (Fail, CoverageError) as f:
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
      except Fail as f:
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
