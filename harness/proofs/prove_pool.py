"""The barrier and ring protocol read out of the traced kernels, proved: the
cases learned and checked, in a pool of worker processes, through the cache.

For each distinct forward protocol the heuristics and the autotuner emit
(:func:`harness.proofs.cases.forward_cases`: stages, persistent, schedule,
staged bias/mask, causal, the output staged in the query slot; block sizes
and head dims do not change the sequence of synchronisation events) and for
every launch kind of ``kernel/backward/`` (:func:`harness.proofs.cases.backward_cases`),
this traces the kernel on the CPU, reads every role's events out of the
jaxpr (:mod:`harness.proofs.extract`) under *probe* environments
(:mod:`harness.proofs.probes`), learns each role's program from them
(:mod:`harness.proofs.role_programs`, which states the premise that makes
the proof unbounded and tests it on every probe), has Z3 prove that premise
for the traced kernel (:mod:`harness.proofs.premise`, each counterexample
probed in turn: :mod:`harness.proofs.premise_rounds`) and checks the program
for every environment (:func:`harness.proofs.search.check`: every number of
tiles, every trip count per tile, zero included, every interleaving).
Launches whose programs are equal up to the names of their buffers and
barriers and their source lines (the staged bias's ring and the staged
mask's: :meth:`harness.proofs.role_programs.LaunchProgram.shape`) share one
check.

A case whose units break the premise (seen by the probes, or by Z3 and then
by the probe of its counterexample, a longer trace where the environment
needs more key blocks or tiles) is reported with the two probes that
disagree, each checked under its own environment (its trace, if it has a
violation, is the failure shown).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import time

from harness.proofs import backward_probes as bwd
from harness.proofs import backward_traces as bt
from harness.proofs import forward_probes as fwd
from harness.proofs import role_programs as rp
from harness.proofs import search
from harness.proofs import tracing
from harness.proofs.events import ExtractionError, UnknownPrimitive, kernel_trace_error
from harness.proofs.violations import Violation
from harness.proofs import memos


@dataclasses.dataclass
class Result:
  """One check: a launch program (shared by every case whose program is
  equal), or the probes of a case whose events break the premise."""

  name: str
  cases: list                      # descriptions of the cases it covers
  configs: int = 0                 # emitted (problem, config) pairs covered
  states: int = 0
  seconds: float = 0.0
  violation: Violation | None = None
  premise: str | None = None       # the premise's failure, when no trace was found
  probes: int = 0
  # per launch program it covers: what proving (P) by Z3 took (premise.Stats'
  # summary), or () where (P) was only tested by the probes
  z3: list = dataclasses.field(default_factory=list)
  plain: int = 0                   # plain-call kernels proved to run its programs
  lengths: int = 0                 # its launch programs Z3 proved at every length

  @property
  def ok(self) -> bool:
    return self.violation is None and self.premise is None

  @property
  def premise_proved(self) -> bool:
    """Whether Z3 proved (P) for every launch program it covers."""
    return bool(self.z3) and all(self.z3)


_MUTANTS: dict = {}   # mutant name -> its kernel modules, per process


def _modules(mutant):
  """The kernel modules to trace: the shipped ones, or ``mutant``'s edit of
  one of them (harness/proofs/protocol_mutants.py)."""
  if mutant is None:
    return tracing.shipped_modules()
  if mutant not in _MUTANTS:
    from harness.proofs import protocol_mutants
    _MUTANTS[mutant] = protocol_mutants.modules(mutant)
  return _MUTANTS[mutant]


def _programs_of(item):
  """((kind, case), mutant[, premise]) -> ([(name, LaunchProgram)], premise
  failure or None, seconds, CPU seconds by phase of
  :data:`harness.proofs.tracing.PHASES`);
  ``premise`` False: (P) tested by the probes alone, not proved (the path
  before Z3 proved it, for comparison)."""
  (kind, case), mutant, *rest = item
  with search.collector_paused():
    return _learn(kind, case, mutant, premise=rest[0] if rest else True)


def _learn(kind, case, mutant, premise=True):
  memos.forget()   # the previous case's kernels: a worker learns thousands
  start, cpu, before = time.perf_counter(), time.process_time(), tracing.SPENT.copy()
  progs, failure = _learn_programs(kind, case, mutant, premise)
  for _, prog in progs:
    if prog is not None:
      prog.shape_digest()   # made here, on the worker, and carried by the pickle
  spent = {phase: tracing.SPENT[phase] - before[phase] for phase in ("tracing", "premise")}
  # the rest of learning: the probes' concrete runs and the tables made of them
  spent["probes"] = time.process_time() - cpu - sum(spent.values())
  spent[tracing.TRACES] = tracing.SPENT["tracing count"] - before["tracing count"]
  return progs, failure, time.perf_counter() - start, spent


def _learn_programs(kind, case, mutant, premise):
  modules = _modules(mutant)
  try:
    if kind == "forward":
      progs = [(case.describe(), fwd.forward_program(case, modules=modules, premise=premise))]
    else:
      progs = [(p.name, p) for p in bwd.backward_programs(case, modules=modules,
                                                          premise=premise)]
    return progs, None
  except (UnknownPrimitive, ExtractionError):
    raise
  except rp.PremiseError as err:
    if kind == "forward":
      stages, persistent = case.num_stages, case.persistent
    else:
      # the deepest ring of the case's launches (the probes name no launch)
      stages, persistent = max(bt.backward_stages(case, modules=modules)), False
    concrete, why = [], str(err)
    for p in err.probes:
      try:
        concrete.append(rp.concrete(case.describe(), stages, p, persistent=persistent))
      except rp.PremiseError as inner:
        # Not even one probe's launch is a program: its roles disagree on
        # the trip counts themselves (a producer filling blocks no consumer
        # takes).  That is the failure, with no trace to check.
        why = str(inner)
    if not concrete:
      return [(case.describe(), None)], why
    return [(c.name, c) for c in concrete], str(err)
  except Exception as err:
    # a kernel that does not trace is one the proof cannot read: named by its line,
    # in a message a worker sends back whole (not a broken pool or a raw traceback)
    raise kernel_trace_error(case.describe(), err) from None


def _check(prog):
  return search.check(prog)


def prove(items, *, jobs: int = 2, mutant: str | None = None, fail_fast: bool = False,
          pool=None, cache=None, early=(), premise: bool = True,
          spent: collections.Counter | None = None, on_failure=None,
          shapes: dict | None = None) -> list[Result]:
  """Learn the programs of ``items`` (("forward", ForwardCase, configs) or
  ("backward", BackwardCase, 0)), check each distinct one, and return one
  Result per check (premise failures included).  ``items`` may be a callable
  that lists them: on a pool it is called once the ``early`` items ((kind,
  case) pairs it will list) are on the workers, which so start while it
  lists the rest.  ``mutant``: trace a protocol mutant's kernel source
  instead of the shipped one.  ``fail_fast``: one worker, in order,
  stopping at the first failure.  ``cache``: a
  :class:`harness.proofs.prove_cache.Cache` to take learned programs and passed
  checks from, and to keep new ones in.  ``spent``: a Counter that gets the
  CPU seconds, by phase of :data:`harness.proofs.tracing.PHASES`, of the work done (what the cache
  gave cost nothing).  ``on_failure(text)``: called with a line as soon as a
  case's premise fails or a check finds a violation, before the run ends.
  ``shapes``: a dict that gets each forward case's program shape as its
  probes learned it
  (:meth:`harness.proofs.role_programs.LaunchProgram.probes_digest`), where
  its premise held."""
  spent = collections.Counter() if spent is None else spent
  on_failure = on_failure or (lambda text: None)
  if fail_fast or (pool is None and jobs <= 1):
    items = items() if callable(items) else items
    work = [(kind, case) for kind, case, _ in items]
    configs = {id(c): n for _, c, n in items}
    distinct: dict = {}
  if fail_fast:
    results = []
    for w in work:
      learned = _learned(w, mutant, None, premise, spent)
      _report_premise(w, learned, on_failure)
      new = _collect([w], [learned], configs, distinct, shapes)
      results += new
      for prog, result in list(distinct.values()):
        if result in new:
          _record(result, _searched(search.check(prog), spent))
          _report_violation(result.name, result.violation, on_failure)
      if any(not r.ok for r in new):
        break
    return results
  if pool is not None:
    return _prove_pooled(pool, jobs, items, early, mutant, cache, premise, spent, on_failure,
                         shapes)
  if jobs > 1:
    with workers(jobs) as pool:
      return _prove_pooled(pool, jobs, items, early, mutant, cache, premise, spent, on_failure,
                         shapes)
  learned = []
  for w in work:
    learned.append(_learned(w, mutant, cache, premise, spent))
    _report_premise(w, learned[-1], on_failure)
  results = _collect(work, learned, configs, distinct, shapes)
  for key, (prog, result) in distinct.items():
    _record(result, _checked(key, prog, result, cache, spent))
    _report_violation(result.name, result.violation, on_failure)
  return results


def _report_premise(w, answer, on_failure):
  """``on_failure`` told of a learned case whose premise failed (_learn's answer)."""
  if answer[1] is not None:
    kind, case = w
    on_failure(f"{case.describe()}: the events depend on more than the proof's contexts: "
               f"{str(answer[1]).splitlines()[0]}")


def _report_violation(name, violation, on_failure):
  """``on_failure`` told of a check that found ``violation`` (or none)."""
  if violation is not None:
    on_failure(f"{name}: {violation.format().splitlines()[0]}")


def _searched(res, spent):
  spent["search"] += res.seconds
  return res


def _learn_key(w, mutant, premise=True) -> str:
  return repr((w, mutant)) if premise else repr((w, mutant, "probes only"))


def _learned(w, mutant, cache, premise, spent):
  """_programs_of, through the cache (a case whose premise failed is not kept)."""
  key = _learn_key(w, mutant, premise)
  hit = cache.get("learned", key) if cache is not None else None
  if hit is None:
    hit = _programs_of((w, mutant, premise))
    spent.update(hit[3])
    if cache is not None and hit[1] is None:
      cache.put("learned", key, hit)
  return hit


def _cacheable(key, result) -> bool:
  return result.premise is None   # a premise failure's probes are keyed apart


def _checked(key, prog, result, cache, spent):
  """The check of one distinct program, through the cache (kept when it passed)."""
  if cache is None or not _cacheable(key, result):
    return _searched(search.check(prog), spent)
  hit = cache.get("checked", repr(key))
  if hit is None:
    hit = _searched(search.check(prog), spent)
    if hit.ok:
      cache.put("checked", repr(key), hit)
  return hit


def workers(jobs: int, *, fork: bool = False):
  """A pool of ``jobs`` processes that start with JAX and the kernels
  imported.  ``fork``: forked from this one where that is safe -- the
  caller knows this process (``python -m harness prove`` does), no other
  Python thread runs and no JAX backend is up, so nothing traced or running
  is shared; NumPy's BLAS threads handle a fork themselves -- else spawned
  fresh, importing them (:func:`_warm_up`) while the caller prepares the
  work."""
  import concurrent.futures
  import multiprocessing
  import sys
  import threading
  from kernel import backward, forward  # noqa: F401  (what a forked worker inherits)
  if fork:
    try:
      from jax._src import xla_bridge
      started = xla_bridge.backends_are_initialized()
    except Exception:  # noqa: BLE001 -- another JAX: take it as started
      started = True
    fork = ("fork" in multiprocessing.get_all_start_methods()
            and threading.active_count() == 1 and not started)
  sys.stdout.flush()
  sys.stderr.flush()
  if fork:
    # What a forked worker inherits (JAX and the kernels) stays put: frozen,
    # the collector's passes skip it (and leave its pages shared).
    gc.freeze()
  pool = concurrent.futures.ProcessPoolExecutor(
      max_workers=jobs, mp_context=multiprocessing.get_context("fork" if fork else "spawn"))
  for _ in range(jobs):
    pool.submit(_warm_up)
  return pool


def _warm_up():
  from kernel import backward, forward  # noqa: F401  (jax and the kernels)
  gc.freeze()
  return 0


def _prove_pooled(pool, jobs, items, early, mutant, cache, premise, spent,
                  on_failure, shapes=None) -> list[Result]:
  """Learn and check on the pool as results come: a worker that frees up
  takes a pending check first (the costliest cases are learned first, so
  their checks start early), else the next case to learn; what the cache
  holds is taken from it instead."""
  import concurrent.futures
  distinct: dict = {}   # shape -> (program, Result): which checks there are
  learned: dict = {}    # (kind, case) -> _programs_of's answer
  checked: dict = {}    # shape -> CheckResult
  running: dict = {}    # future -> ("learn", (kind, case)) | ("check", shape)
  checks, queue, taken = [], list(early), set()
  listed = None

  def learnt(w, answer):
    learned[w] = answer
    before = len(distinct)
    _collect([w], [answer], {}, distinct)
    for key in list(distinct)[before:]:   # the shapes it added (a dict keeps their order)
      hit = (cache.get("checked", repr(key))
             if cache is not None and _cacheable(key, distinct[key][1]) else None)
      if hit is not None:
        checked[key] = hit
      else:
        checks.append(key)

  while True:
    # Before the listing, a worker's worth of early items keeps each busy while it runs;
    # the rest wait in the listing's order (a mutant's own cases first: it fails early).
    while len(running) < jobs and (checks or queue):
      if checks:
        key = checks.pop(0)
        running[pool.submit(_check, distinct[key][0])] = ("check", key)
        continue
      w = queue.pop(0)
      if w in taken:
        continue
      taken.add(w)
      hit = (cache.get("learned", _learn_key(w, mutant, premise)) if cache is not None
             else None)
      if hit is not None:
        learnt(w, hit)
      else:
        running[pool.submit(_programs_of, (w, mutant, premise))] = ("learn", w)
    if listed is None:
      listed = items() if callable(items) else items
      queue = [(kind, case) for kind, case, _ in listed]
      continue
    if not running:
      if checks or queue:
        continue
      break
    done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
    for fut in done:
      kind, what = running.pop(fut)
      answer = fut.result()
      if kind == "check":
        checked[what] = _searched(answer, spent)
        if cache is not None and answer.ok and _cacheable(what, distinct[what][1]):
          cache.put("checked", repr(what), answer)
        _report_violation(distinct[what][1].name, answer.violation, on_failure)
        continue
      spent.update(answer[3])
      if cache is not None and answer[1] is None:
        cache.put("learned", _learn_key(what, mutant, premise), answer)
      _report_premise(what, answer, on_failure)
      learnt(what, answer)
  # The results named and ordered as a run in one process would have them.
  work = [(kind, case) for kind, case, _ in listed]
  configs = {id(c): n for _, c, n in listed}
  final: dict = {}
  results = _collect(work, [learned[w] for w in work], configs, final, shapes)
  for key, (prog, result) in final.items():
    _record(result, checked[key])
  return results


def _record(result, res):
  result.states, result.seconds = res.states, result.seconds + res.seconds
  result.violation = res.violation


def _collect(work, learned, configs, distinct, shapes=None) -> list[Result]:
  """Group the learned programs by shape (equal up to the names of buffers
  and barriers: :meth:`harness.proofs.role_programs.LaunchProgram.shape`); a case
  whose premise failed gets its own results (its probes' programs), marked
  with the failure; ``shapes`` (a dict) gets each forward case's shape."""
  results = []
  for (kind, case), (progs, premise, seconds, _) in zip(work, learned):
    for i, (name, prog) in enumerate(progs):
      if prog is None:   # the premise failed with no program to check (_learn)
        results.append(Result(name, [case.describe() if kind == "forward" else name],
                              configs.get(id(case), 0), seconds=seconds, premise=premise))
        continue
      key = prog.shape_digest()
      if shapes is not None and kind == "forward" and premise is None and len(progs) == 1:
        shapes[case] = prog.probes_digest()
      if premise is None and key in distinct:
        r = distinct[key][1]
        r.cases.append(case.describe() if kind == "forward" else name)
        r.configs += configs.get(id(case), 0)
        r.seconds += seconds / len(progs)
        r.z3.append(prog.z3)
        r.plain += len(prog.plain)
        r.lengths += bool(prog.lengths)
        continue
      r = Result(name, [case.describe() if kind == "forward" else name],
                 configs.get(id(case), 0), seconds=seconds / len(progs), premise=premise,
                 z3=[prog.z3] if premise is None else [], plain=len(prog.plain),
                 lengths=int(bool(prog.lengths)))
      results.append(r)
      distinct[key if premise is None else (key, kind, case, i)] = (prog, r)
  return results
