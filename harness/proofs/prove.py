"""``python -m harness prove``: the barrier and stage-ring protocol of the
kernels, read out of their traced jaxprs and proved for every config the
kernel can be asked to run and every environment.

The configs are those :func:`kernel.tiling.heuristics.get_heuristics_config` and
:func:`kernel.tiling.heuristics.get_autotuning_configs` emit over
:func:`problem_grid` (head dims, dtypes, staged bias/mask, causal, residuals,
sequence lengths), reduced to the forward protocols they differ in
(:func:`harness.proofs.cases.forward_cases`); the backward's are every
launch kind of ``kernel/backward/``.  Each is traced on the CPU, its roles'
programs are learned from probe environments, Z3 proves that they are the
kernel's events under every environment (the premise of
:mod:`harness.proofs.role_programs`; :mod:`harness.proofs.premise`, from the jaxpr
read with symbolic integers, :mod:`harness.proofs.symbolic`), and the search
proves them for every number of tiles and key blocks
(:mod:`harness.proofs.prove_pool`, :mod:`harness.proofs.search`);
launches whose programs are equal up to the names of their buffers and
barriers share one check.  A failure prints its trace in kernel source
lines and the environment that shows it.  ``docs/proof.md`` says what is
proved and what is not.

The run keeps what passed in ``.cache/prove/`` (:mod:`harness.proofs.prove_cache`:
the learned programs under a digest of the kernel and extraction sources,
each passed check under its program's shape and the checker's sources), and
a later run of the same sources takes it from there; ``--no-cache`` learns
and checks everything anew, as a fresh clone does.

``--mutant NAME`` proves a protocol defect of ``harness/proofs/protocol_mutants.py``
written into a copy of the kernel's source instead (the command must fail;
on one of its ``SAFE`` reorderings and rewrites it must succeed; it never
uses the cache, nor does ``--fail-fast``).  ``--probes-only``
tests the premise with the probes alone, as before Z3 proved it, for
comparison; the command then fails, as nothing beyond the probed trip
counts is proved.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import os
import time

import ml_dtypes
import numpy as np

from harness.proofs import cases
from harness.proofs.events import ExtractionError, UnknownPrimitive
from kernel.tiling import plan as plan_lib

# 192: a head dim the cache has no entries of, which reads the wider 256's;
# 96: 32-column rows (kernel.tiling.plan.padded_head_dims), which read 128's.
HEAD_DIMS = (64, 96, 128, 192, 256)
# float8_e4m3fn: the FP8 forward's configs (its protocols equal to 16-bit
# ones up to names share their checks).
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn))
# (seq_q, seq_kv): one key block, a partial block, a few blocks, many
# blocks; each also at its twin (:func:`length_twin`).
SEQ_LENGTHS = ((1, 1), (100, 64), (128, 200), (1000, 1000), (8192, 8192))


def length_twin(seq_q: int, seq_kv: int) -> tuple[int, int]:
  """Lengths of the same blocks as (seq_q, seq_kv) that the API copies the
  other way: a ragged pair (a length no multiple of 8, copied through
  untiled views where kernel.tiling.plan.untiled_copies_pay says) rounded
  up to whole 8-row tiles, an aligned pair one row and one key longer."""
  tiling = plan_lib.ROW_TILING
  if seq_q % tiling or seq_kv % tiling:
    return -(-seq_q // tiling) * tiling, -(-seq_kv // tiling) * tiling
  return seq_q + 1, seq_kv + 1


def problem_grid(*, experiments: bool = False) -> list[plan_lib.Problem]:
  """Every problem above as the API runs it, each length pair with its
  :func:`length_twin`; with ``experiments`` each once more with the copies
  the other way (kernel.experiments' untiled_copies), which ``python -m
  harness prove --experiments`` proves."""
  lengths = sorted({pair for base in SEQ_LENGTHS for pair in (base, length_twin(*base))})
  out = []
  for head_dim, same_out, dtype, bias, mask, causal, residuals, (sq, skv) in itertools.product(
      HEAD_DIMS, (True, False), DTYPES, (False, True), (False, True), (False, True),
      (False, True), lengths):
    head_dim_out = head_dim if same_out else 64 if head_dim != 64 else 256
    p = plan_lib.problem_for(dtype, head_dim, head_dim_out, sq, skv, is_causal=causal,
                             bias_2d=bias, mask_2d=mask, return_residuals=residuals)
    p = p.replace(untiled_copies=plan_lib.untiled_copies_pay(p))
    out += [p, p.replace(untiled_copies=not p.untiled_copies)] if experiments else [p]
  return out


def forward_listing(experiments: bool = False, every_config: bool = False) -> tuple:
  """``cases.forward_cases`` over :func:`problem_grid`: once per process,
  however many runs ask (the tests run prove once per mutant), however
  they spell the arguments."""
  return _forward_listing(bool(experiments), bool(every_config))


@functools.lru_cache(maxsize=4)
def _forward_listing(experiments: bool, every_config: bool) -> tuple:
  return tuple(cases.forward_cases(problem_grid(experiments=experiments),
                                   every_config=every_config))


def work_items(*, first: str | None = None, experiments: bool = False,
               every_config: bool = False) -> list:
  """Every case to prove: (kind, case, emitted configs it covers).  The
  costliest first (the workers finish together), or with ``first``
  ("forward" / "backward") the smallest cases of that kind first (a
  mutant's failure shows early); ``experiments``: :func:`problem_grid`'s;
  ``every_config``: :func:`cases.forward_cases`'."""
  forward = [("forward", c, n) for c, n in forward_listing(experiments, every_config)]
  backward = [("backward", c, 0) for c in cases.backward_cases(experiments=experiments)]
  if first is None:
    cost = lambda item: (-(item[1].persistent * 10 + item[1].num_stages) if item[0] == "forward"
                         else -5)
    return sorted(forward + backward, key=cost)
  small = lambda item: ((item[1].num_stages != 2, item[1].persistent, item[1].causal,
                         item[1].bias, item[1].mask, item[1].overlay_q,
                         item[1].schedule != "round-robin")
                        if item[0] == "forward" else (item[1].head_dim, item[1].causal,
                                                      item[1].bias, not item[1].fuse_dq))
  ordered = {"forward": sorted(forward, key=small), "backward": sorted(backward, key=small)}
  return ordered[first] + ordered["backward" if first == "forward" else "forward"]


def _listed_aside(first, experiments=False, every_config=False):
  """``work_items(first=first, experiments=experiments, every_config=...)`` computed in a
  process forked before JAX is imported, so that the listing (the
  heuristics over the whole grid, about a second) runs beside this
  process's import of JAX and the kernels: a
  callable that waits for it.  Where a fork is not known to be safe (JAX
  already imported, another thread, no fork), the callable lists here."""
  import os
  import pickle
  import sys
  import threading
  if "jax" in sys.modules or threading.active_count() != 1 or not hasattr(os, "fork"):
    return lambda: work_items(first=first, experiments=experiments, every_config=every_config)
  sys.stdout.flush()
  sys.stderr.flush()
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # the lister: list, hand it over, leave without cleaning up
    status = 1
    try:
      os.close(read)
      with os.fdopen(write, "wb") as f:
        f.write(pickle.dumps(work_items(first=first, experiments=experiments,
                                        every_config=every_config),
                             protocol=pickle.HIGHEST_PROTOCOL))
      status = 0
    finally:
      os._exit(status)
  os.close(write)

  def wait():
    with os.fdopen(read, "rb") as f:
      data = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
      # the lister failed: list here (its error shows)
      return work_items(first=first, experiments=experiments, every_config=every_config)
    return pickle.loads(data)

  return wait


def _premise_column(r) -> str:
  """How (P) stands for the launch programs a result covers: proved by Z3
  for all of them, or tested by the probes only."""
  if not r.ok and not r.z3:
    return "-"
  proved = sum(bool(z) for z in r.z3)
  return f"Z3 {proved}/{len(r.z3)}" if proved else "probes"


def format_results(results) -> str:
  lines = [f"{'launch program':<66} {'status':<10} {'(P)':>8} {'cases':>5} {'configs':>7} "
           f"{'states':>8} {'time':>6}"]
  for r in results:
    status = "proven" if r.ok else "VIOLATION" if r.violation else "PREMISE"
    lines.append(f"{r.name[:66]:<66} {status:<10} {_premise_column(r):>8} {len(r.cases):>5} "
                 f"{r.configs:>7} {r.states:>8} {r.seconds:5.1f}s")
  for r in results:
    if r.ok:
      continue
    lines.append("")
    lines.append(f"{r.name}:")
    if r.premise:
      lines.append(f"  the events depend on more than the proof's contexts: {r.premise}")
    if r.violation:
      lines.append(r.violation.format())
  return "\n".join(lines)


def format_spent(spent) -> str:
  """The CPU seconds of this run's work by phase, all workers together."""
  from harness.proofs import tracing
  total = sum(spent[p] for p in tracing.PHASES)
  if not total:
    return "CPU time: none spent learning or searching (all from the cache)"
  parts = ", ".join(f"{label} {spent[p]:.1f} s" for p, label in tracing.PHASES.items())
  return (f"CPU time by phase, all workers: {parts} (total {total:.1f} s); "
          f"{spent[tracing.TRACES]} JAX traces")


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
  """The CPUs this process may run on: its affinity, capped by a container's
  CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu/cpu.cfs_quota_us``), which
  the affinity does not show: a runner limited to 2 CPUs of a 64-core host
  gets 2 workers, not 64 workers' memory."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # no affinity on this OS
    cpus = os.cpu_count() or 1

  def words(*path):
    with open(os.path.join(cgroup, *path)) as f:
      return f.read().split()

  try:
    limit, period = words("cpu.max")[:2]                                # v2
  except (OSError, ValueError):
    try:
      limit, period = words("cpu", "cpu.cfs_quota_us")[0], words("cpu", "cpu.cfs_period_us")[0]
    except (OSError, IndexError):
      return max(1, cpus)                                               # no quota files
  if limit in ("max", "-1") or not (limit.isdigit() and period.isdigit()):
    return max(1, cpus)                                                 # no quota
  return max(1, min(cpus, -(-int(limit) // int(period))))


# The command's on/off switches: flag -> what it does.
SWITCHES = {
    "--fail-fast": "one process, smallest cases first, stop at the first failure",
    "--no-cache": "learn and check everything anew (harness/proofs/prove_cache.py: the cache "
                  "keeps what passed, keyed by the sources; --mutant and --fail-fast never use it)",
    "--experiments": "also every problem with the forward's copies through untiled views "
                     "(kernel.experiments' untiled_copies) and every backward launch kind reading "
                     "q, k, v and dO unpadded (its pallas-unpadded) and copied through untiled "
                     "views (its pallas-untiled), before those switches ship",
    "--every-config": "prove every emitted config at its own block sizes, stages, head dims and "
                      "16-bit dtype with Z3, not one representative per protocol whose program "
                      "each config is held to (about ten times the cases)",
    "--probes-only": "test the premise (P) with the probes alone, without Z3: the proof as it "
                     "stood before Z3 proved (P), for comparison; it covers the probed trip "
                     "counts only, and the command then always fails",
}


def main(argv=None) -> int:
  parser = _parser()
  args, words = _parse(parser, argv)
  if args.kernel is not None:
    return _prove_kernel(parser, args.kernel)
  start = time.perf_counter()
  premise = not args.probes_only
  if premise and not _has_z3():
    return 2
  first = None
  if args.mutant is not None:
    from harness.proofs import protocol_mutants
    if args.mutant not in protocol_mutants.BY_NAME:
      parser.error(f"--mutant: {args.mutant!r} is none of {sorted(protocol_mutants.BY_NAME)}")
    first = protocol_mutants.BY_NAME[args.mutant].kernel
  elif args.fail_fast:
    first = "forward"
  cache = None
  if args.mutant is None and not args.fail_fast and not args.no_cache:
    from harness.proofs import prove_cache
    cache = prove_cache.Cache()
  listing = _Listing(args, words, first, cache)
  from harness.proofs import prove_pool  # noqa: F401  (JAX and the kernels, meanwhile)

  if words and not listing():   # an empty selection stops before any work
    parser.error(f"--select: no forward protocol or backward launch kind is described "
                 f"with each of {words}")

  spent: collections.Counter = collections.Counter()
  try:
    results, held = _prove(args, listing, cache, premise, spent, start)
  except (UnknownPrimitive, ExtractionError) as err:
    # a kernel the proof cannot read is a failure, named where it happens
    print(f"the proof cannot read the kernel: {type(err).__name__}: {err}")
    return 1
  return _report(args, words, listing, results, held, cache, premise, spent, start)


def _parser() -> argparse.ArgumentParser:
  """The command's arguments: --jobs, --mutant, --select and the switches."""
  parser = argparse.ArgumentParser(prog="python -m harness prove", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--jobs", type=int, default=None,
                      help="worker processes (default: the CPUs this process may run on, "
                      f"{usable_cpus()} here)")
  parser.add_argument("--mutant", help="a protocol mutant of harness/proofs/protocol_mutants.py to "
                      "prove instead of the shipped kernel")
  parser.add_argument("--select", metavar="WORDS",
                      help="only the forward protocols and backward launch kinds whose "
                      "description (as the table names them) contains each comma-separated "
                      "word, e.g. 'persistent,causal' or 'backward d=128': a quick proof of "
                      "what a change touches; the gate proves them all")
  parser.add_argument("--kernel", metavar="MODULE:FUNCTION",
                      help="prove another author's kernels instead, at the shapes given: "
                      "FUNCTION returns (label, fn, args) triples, each a call that launches "
                      "Mosaic GPU kernels (harness/proofs/any_kernel.py)")
  for flag, text in SWITCHES.items():
    parser.add_argument(flag, action="store_true", help=text)
  return parser


def _prove_kernel(parser, spec: str) -> int:
  """``--kernel``: every verdict of the named cases, 0 when all are proven."""
  from harness.proofs import any_kernel
  try:
    results, report = any_kernel.prove_spec(spec)
  except (ImportError, AttributeError, ValueError) as err:
    parser.error(f"--kernel: {err}")
  print(report)
  return 0 if all(r.ok for r in results) else 1


def _parse(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[str]]:
  """(the arguments, --select's words), ``args.jobs`` defaulted to the usable CPUs."""
  args = parser.parse_args(argv)
  if args.jobs is not None and args.jobs < 1:
    parser.error(f"--jobs: {args.jobs} worker processes; give 1 or more")
  words = [w.strip() for w in (args.select or "").split(",") if w.strip()]
  if args.select is not None and not words:
    parser.error(f"--select: {args.select!r} names no word to select by")
  # the cases are independent: a runner with more cores proves in less time
  args.jobs = args.jobs or usable_cpus()
  return args, words


def _has_z3() -> bool:
  """Whether z3 imports; if not, says how to install it."""
  try:
    import z3  # noqa: F401  (the premise's prover: CPU hosts have it, GPU runners need not)
  except ImportError:
    print("python -m harness prove needs z3-solver to prove the premise (P) of "
          "harness/proofs/role_programs.py: pip install z3-solver (the proof runs on CPU "
          "hosts; --probes-only tests (P) without it, which proves nothing beyond the "
          "probed trip counts)")
    return False
  return True


class _Listing:
  """The run's work items, listed once when first asked for (from the cache,
  or by a process forked before JAX is imported), a mutant's own cases
  first, then those --select's words describe: ``everything`` before the
  selection, ``listed`` after it."""

  def __init__(self, args: argparse.Namespace, words: list[str], first: str | None, cache):
    self.args, self.words, self.cache = args, words, cache
    self.listed: list = []
    self.everything: list = []   # every item, before --select
    self.key = repr((first, args.experiments, args.every_config))
    self.hit = cache.get("listed", self.key) if cache is not None else None
    self.pending = (_listed_aside(first, args.experiments, args.every_config)
                    if self.hit is None else None)

  def selected(self, item) -> bool:
    """Whether each of --select's words is in ``item``'s description."""
    return all(w in item[1].describe() for w in self.words)

  def __call__(self) -> list:
    """The selected items, listed on the first call."""
    everything = self.everything
    if everything:   # listed already (--select lists before the pool starts)
      return self.listed
    everything[:] = self.hit if self.hit is not None else self.pending()
    if self.cache is not None and self.hit is None:
      self.cache.put("listed", self.key, everything)
    if self.args.mutant is not None:
      everything[:] = _mutant_first(self.args.mutant, everything)
    self.listed[:] = [it for it in everything if self.selected(it)]
    return self.listed


def _mutant_first(mutant: str, everything: list) -> list:
  """``everything`` with the cases that can show ``mutant`` first."""
  from harness.proofs import protocol_mutants
  # The backward case the mutant names, where it names one, first: its
  # failure shows there without proving the smaller cases before it.
  m = protocol_mutants.BY_NAME[mutant]
  own = [it for it in everything if it[0] == "backward" and m.backward
         and it[1] == cases.BackwardCase(*m.backward)]
  # the forward cases that can show it first, smallest first: the ones
  # its words describe, then (only a persistent block can show it) the
  # persistent ones
  own += [it for it in everything if it[0] == "forward" and m.shows
          and m.shows in it[1].describe()]
  if m.persistent:
    own += [it for it in everything if it[0] == "forward" and it[1].persistent]
  return list(dict.fromkeys(own)) + [it for it in everything if it not in own]


def _prove(args, listing: _Listing, cache, premise: bool, spent, start: float) -> tuple:
  """(results, the configs' check) of proving the listed cases, in this
  process or on a pool of workers; a failure is printed once known."""
  from harness.proofs import prove_pool
  first_failure: list = []
  shapes: dict = {}   # each proved case's program shape, which the configs' check reads

  def failed(text):
    # red as soon as it is known, not after the whole run: the table at the end has them all
    if not first_failure:
      first_failure.append(text)
      print(f"FAILED after {time.perf_counter() - start:.1f} s (the run goes on; the table at "
            f"the end lists every failure): {text}", flush=True)

  if args.fail_fast or args.jobs <= 1:
    results = prove_pool.prove(listing(), jobs=1, mutant=args.mutant, fail_fast=args.fail_fast,
                               cache=cache, premise=premise, spent=spent, on_failure=failed,
                               shapes=shapes)
    held = _representatives_held(args, listing(), listing.everything, cache, None, failed,
                                 shapes, spent)
    return results, held
  # The backward's cases need no heuristics: the workers start on them
  # while the forward's are listed, then take the listing's order.
  early = [("backward", c) for c in cases.backward_cases(experiments=args.experiments)
           if listing.selected(("backward", c))]
  with prove_pool.workers(args.jobs, fork=True) as pool:
    results = prove_pool.prove(listing, jobs=args.jobs, mutant=args.mutant, pool=pool,
                               cache=cache, early=early, premise=premise, spent=spent,
                               on_failure=failed, shapes=shapes)
    held = _representatives_held(args, listing(), listing.everything, cache, pool, failed,
                                 shapes, spent)
  return results, held


def _report(args, words: list[str], listing: _Listing, results, held, cache, premise: bool,
            spent, start: float) -> int:
  """Prints the table and what the run proved, and returns the exit status."""
  items, everything = listing.listed, listing.everything
  print(format_results(results))
  proven = sum(r.ok for r in results)
  forward = sum(kind == "forward" for kind, _, _ in items)
  configs = sum(n for _, _, n in items)
  wall = time.perf_counter() - start
  launches = sum(len(r.z3) for r in results)
  by_z3 = sum(bool(z) for r in results for z in r.z3)
  every = premise and by_z3 == launches
  print(f"\n{proven}/{len(results)} proven: every launch program of {forward} forward "
        f"protocols ({configs} emitted configs) and {len(items) - forward} backward "
        f"launch kinds, "
        + ("for every trip count: every number of tiles and key blocks" if every else
           "for the trip counts the probes showed (the premise (P) not proved)")
        + (f" ({args.mutant})" if args.mutant else "")
        + (" (with kernel.experiments' untiled copies, unpadded and untiled backward)"
           if args.experiments else "")
        + (" (each config traced at its own block sizes, stages, head dims and dtype)"
           if args.every_config else ""))
  if words:
    every_forward = sum(kind == "forward" for kind, _, _ in everything)
    print(f"selected by --select {args.select!r}: {forward} of {every_forward} forward "
          f"protocols and {len(items) - forward} of {len(everything) - every_forward} backward "
          f"launch kinds; the others are not proved by this run")
  _print_scope(results, launches)
  print(held[1])
  _print_premise(results, premise, by_z3, launches)
  if cache is not None and (cache.hits["learned"] or cache.hits["checked"]):
    print(f"from the cache ({cache.root}, kept by runs of the same sources; --no-cache "
          f"recomputes): the programs of {cache.hits['learned']} of {len(items)} cases, "
          f"{cache.hits['checked']} of {len(results)} checks")
  print(format_spent(spent))
  # What a cold run costs and why: docs/decisions/prove-cold-time.md.
  print(f"wall time {wall:.1f} s ({args.jobs if not args.fail_fast else 1} worker(s))")
  for line in held[0]:
    print(f"DIFFERS: {line}")
  return 0 if proven == len(results) and every and not held[0] else 1


def _print_scope(results, launches: int) -> None:
  """Prints what the launch programs were proved for: lengths, windows and
  chunks, every grid point, and the plain kernels."""
  # What the launch programs above are not: docs/proof.md, "What is not proved".
  print(f"calls with lengths, a window, chunks or segments: {sum(r.lengths for r in results)} of "
        f"{launches} launch programs proved by Z3 at every length of queries and keys, whole "
        f"or ragged, beyond the probes' one, with their key ranges free values, and once more "
        f"with a window and chunks of every size")
  # What the probes' one batch and head leave out: docs/proof.md, "Every grid point";
  # what the counts cost: docs/decisions/proof-traces-every-grid-point.md.
  from harness.proofs import symbolic_dims
  counts = symbolic_dims.GRID_COUNTS
  print(f"every grid point: each such proof, and the plain kernels' below, at every batch, "
        f"query head and key/value head of any number of batches (from {counts['batches']}) "
        f"and key/value heads (from {counts['kv_heads']}) in groups of any number of query "
        f"heads (from {counts['group']}), beyond the probes' first"
        + (", on a persistent grid of any number of blocks (from "
           f"{symbolic_dims.PERSISTENT_GRID['sms']})" if symbolic_dims.PERSISTENT_GRID else ""))
  plain = sum(r.plain for r in results)
  print(f"calls without lengths, a window, chunks or segments: {plain} kernels of theirs, whose "
        f"trip counts are compiled in, proved by Z3 to run the launch programs above (at every "
        f"length of queries and keys, whole or ragged; the "
        f"causal backward's head by head and in L2 sections)")


def _print_premise(results, premise: bool, by_z3: int, launches: int) -> None:
  """Prints how the premise (P) stands: proved by Z3 (its claims and time),
  or tested by the probes only."""
  stats = [z for r in results for z in r.z3 if z]
  if premise:
    # What proving (P) adds to a run: docs/decisions/premise-proof-time.md.
    print(f"(P) proved by Z3 for {by_z3} of {launches} launch programs, the premise that "
          f"makes the search cover every trip count ({sum(z[0] for z in stats)} claims, "
          f"{sum(z[1] for z in stats)} of them sent to Z3, the others equal to one sent "
          f"before; {sum(z[2] for z in stats):.1f} s in Z3)")
  else:
    print("(P) tested by the probes only (--probes-only): nothing is proved beyond the "
          "probed trip counts")


def _representatives_held(args, listed, everything, cache, pool, failed,
                          shapes=None, spent=None) -> tuple[list, str]:
  """harness.proofs.representatives.check over the emitted configs of the
  listed forward protocols, where the run proves representatives: (lines
  naming the configs that differ, the summary line); ``shapes``: the
  representatives' program shapes the proof learned."""
  from harness.proofs import representatives
  if args.mutant or args.fail_fast or args.every_config:
    why = ("--mutant" if args.mutant else "--fail-fast" if args.fail_fast
           else "--every-config, which proves each config's own program")
    return [], f"every config at its own sizes: not compared with its representative ({why})"
  chosen = {case for kind, case, _ in listed if kind == "forward"}
  if not chosen:
    return [], "every config at its own sizes: no forward protocol selected"

  def work():
    exact = [case for case, _ in forward_listing(args.experiments, every_config=True)]
    return [(case, rep) for case, rep in representatives.matched(
        exact, [case for kind, case, _ in everything if kind == "forward"]) if rep in chosen]

  lines, summary = representatives.check(
      work, pool=pool, cache=cache, key=repr((args.experiments, args.select)), known=shapes,
      spent=spent)
  if lines:
    failed(lines[0])
  return lines, summary


if __name__ == "__main__":
  raise SystemExit(main())
