"""``python -m harness prove``: the stage-ring protocol, proved for every config
the kernel can be asked to run.

First the forward kernel's protocol as extracted from its traced jaxpr
(:mod:`harness.prove_extracted`: about the code itself, bounded in trip
counts and tiles); then the hand-written Z3 models below (unbounded, by
induction, but about a model that mirrors the code).

The configs are those :func:`kernel.heuristics.get_heuristics_config` and
:func:`kernel.heuristics.get_autotuning_configs` emit over a grid of problems
(head dims, dtypes, staged bias/mask, causal, residuals, sequence lengths).
Each config's :func:`kernel.plan.pipeline_plan` is reduced to what the proof
depends on (:class:`harness.protocol_model.Protocol`: stages, staged buffers,
persistent, barrier arrival and thread counts), and each distinct one is
proved once by :func:`harness.protocol_model.prove`.  A staged mask alone is
the same transition system as a staged bias alone, renamed
(:meth:`~harness.protocol_model.Protocol.canonical`), so they share a proof.
A proof that fails is followed by an explicit search for a concrete
counterexample, so a failure reads as a bug (with a trace) rather than as a
weak invariant.

Then the backward kernels' rings: every launch of ``kernel/backward.py``
(:func:`harness.ring_model.kernel_protocols`, from the mbarrier plans the
kernels allocate) is proved by :func:`harness.ring_model.prove`.  Last, the
fused dQ's dS^T handoff between the compute warpgroups
(:mod:`harness.handoff_model`), proved for any number of steps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import time

import ml_dtypes
import numpy as np

from harness import handoff_model as hm
from harness import prove_extracted
from harness import protocol_model as pm
from harness import ring_model as rm
from kernel import heuristics, plan as plan_lib

HEAD_DIMS = (64, 128, 256)
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# (seq_q, seq_kv): one key block, a partial block, a few blocks, many blocks.
SEQ_LENGTHS = ((1, 1), (100, 64), (128, 200), (1000, 1000), (8192, 8192))


def problem_grid() -> list[plan_lib.Problem]:
  out = []
  for head_dim, same_out, dtype, bias, mask, causal, residuals, (sq, skv) in itertools.product(
      HEAD_DIMS, (True, False), DTYPES, (False, True), (False, True), (False, True),
      (False, True), SEQ_LENGTHS):
    head_dim_out = head_dim if same_out else 64 if head_dim != 64 else 256
    out.append(plan_lib.Problem(dtype, head_dim, head_dim_out, sq, skv, is_causal=causal,
                                bias_2d=bias, mask_2d=mask, return_residuals=residuals))
  return out


@dataclasses.dataclass
class Emitted:
  """The configs of the grid that share one proof."""

  protocol: pm.Protocol                     # canonical
  buffers: set = dataclasses.field(default_factory=set)   # staged buffer sets covered
  configs: int = 0
  examples: list = dataclasses.field(default_factory=list)  # (source, problem, config)

  def describe_example(self) -> str:
    source, p, c = self.examples[0]
    return (f"{self.configs} configs, e.g. {source} {c.block_q}x{c.block_kv} "
            f"stages={c.num_stages} for d={p.head_dim}/{p.head_dim_out} "
            f"seq {p.seq_q}x{p.seq_kv}")


def emitted_protocols(problems=None) -> list[Emitted]:
  """Every distinct proof the grid's emitted configs need, in a fixed order."""
  found: dict = {}
  for problem in problem_grid() if problems is None else problems:
    configs = []
    try:
      configs.append(("heuristic", heuristics.get_heuristics_config(problem)))
    except ValueError:
      pass  # nothing fits: the kernel refuses the problem
    configs += [("autotune", c) for c in heuristics.get_autotuning_configs(problem)]
    for source, config in configs:
      protocol = pm.Protocol.from_plan(plan_lib.pipeline_plan(problem, config))
      canonical = protocol.canonical()
      entry = found.setdefault(canonical, Emitted(canonical))
      entry.buffers.add("+".join(protocol.key_phase + protocol.value_phase))
      entry.configs += 1
      if len(entry.examples) < 3:
        entry.examples.append((source, problem, config))
  return sorted(found.values(), key=lambda e: (e.protocol.persistent,
                                                e.protocol.num_stages,
                                                e.protocol.key_phase))


@dataclasses.dataclass
class ProofRow:
  protocol: pm.Protocol
  buffers: str           # the staged buffer sets this proof covers
  example: str
  status: str            # proven | counterexample | not proven
  seconds: float
  queries: int
  conjuncts: int
  failures: list[str]
  counterexample: pm.Counterexample | None = None


def _prove_one(protocol: pm.Protocol, buffers: str, example: str) -> ProofRow:
  result = pm.prove(protocol)
  row = ProofRow(protocol, buffers, example, "proven" if result.proven else "not proven",
                 result.seconds, result.queries, result.conjuncts, result.failures)
  if not result.proven:
    start = time.perf_counter()
    # small tile lists first: the bugs found so far need at most 4 tiles of <= 2 blocks
    try:
      row.counterexample = pm.explore_all(protocol, max_tiles=4, max_trip=2,
                                          max_states=200_000)
    except pm.SearchBudgetExceeded:
      pass
    row.seconds += time.perf_counter() - start
    if row.counterexample is not None:
      row.status = "counterexample"
  return row


def prove_all(*, handshake: pm.Handshake = pm.KERNEL_HANDSHAKE, jobs: int = 2,
              problems=None, persistent: bool | None = None,
              nonempty_tiles: bool = False) -> list[ProofRow]:
  """Prove every distinct protocol the grid's configs need (``persistent``
  restricts to one kind; ``nonempty_tiles`` assumes every tile has a key
  block), with ``jobs`` worker processes."""
  work = []
  for entry in emitted_protocols(problems):
    if persistent is not None and entry.protocol.persistent != persistent:
      continue
    protocol = dataclasses.replace(entry.protocol, handshake=handshake,
                                   nonempty_tiles=nonempty_tiles)
    work.append((protocol, " | ".join(sorted(entry.buffers, key=len)),
                 entry.describe_example()))
  if jobs <= 1:
    return [_prove_one(*item) for item in work]
  # largest first, so the two workers finish together
  order = sorted(range(len(work)), key=lambda i: -(work[i][0].num_stages *
                                                   len(work[i][0].key_phase)))
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
    futures = {i: pool.submit(_prove_one, *work[i]) for i in order}
    return [futures[i].result() for i in range(len(work))]


def format_table(rows: list[ProofRow], *, traces: bool = True) -> str:
  lines = [f"{'stages':>6}  {'staged buffers':<29} {'kind':<10} {'status':<14} "
           f"{'time':>6} {'queries':>7}  configs"]
  for r in rows:
    p = r.protocol
    status = r.status
    if r.counterexample is not None:
      status = f"{r.counterexample.kind}"
    lines.append(
        f"{p.num_stages:>6}  {r.buffers:<29} {'persistent' if p.persistent else 'grid':<10} "
        f"{status:<14} {r.seconds:>5.1f}s {r.queries:>7}  {r.example}")
  shown = set()
  for r in rows if traces else []:
    if r.status == "proven":
      continue
    if r.counterexample is not None:
      ce = r.counterexample
      key = (ce.kind, ce.environment, tuple((x.actor, x.action) for x in ce.trace))
      if key in shown:
        lines.append(f"  and the same {ce.kind} for {r.protocol.describe()}")
        continue
      shown.add(key)
      lines += ["", ce.format()]
    else:
      lines.append("")
      lines.append(f"{r.protocol.describe()}: no counterexample up to 4 tiles of <= 2 "
                   f"blocks; the invariant fails at:")
      lines += ["  " + f for f in r.failures]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness prove", description=__doc__)
  parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
  parser.add_argument(
      "--handshake", choices=tuple(HANDSHAKES), default="kernel",
      help="the persistent blocks' pingpong handshake: the kernel's (default), or an "
           "earlier one of kernel/forward.py, to see its counterexample")
  parser.add_argument(
      "--extracted", choices=("representative", "all", "skip"), default="representative",
      help="the forward protocol extracted from the traced kernel (harness/prove_extracted.py): "
           "the representative set of distinct protocols (default), all of them, or none")
  args = parser.parse_args(argv)
  handshake = HANDSHAKES[args.handshake]
  extracted_ok = True
  if args.extracted != "skip":
    extracted_ok = prove_extracted.report(problem_grid(), args.extracted, jobs=args.jobs)
    print()
  start = time.perf_counter()
  rows = prove_all(handshake=handshake, jobs=args.jobs)
  print(f"stage-ring protocol; persistent blocks: {handshake.describe()}")
  print(format_table(rows))
  proven = sum(r.status == "proven" for r in rows)
  # The backward kernels' rings (harness/ring_model.py), from the plans of
  # every launch kernel.backward makes.
  ring_rows = [rm.prove(p) for p in rm.kernel_protocols()]
  print("\nbackward stage rings (kernel/backward.py):")
  for r in ring_rows:
    print(f"  {r.protocol.describe():<75} {'proven' if r.proven else 'NOT PROVEN'} "
          f"{r.seconds:5.1f}s {r.queries:>4} queries")
    for f in r.failures[:5]:
      print(f"    fails: {f}")
  ring_proven = sum(r.proven for r in ring_rows)
  handoff = hm.prove()
  print("\nfused dQ handoff (kernel/backward.py, harness/handoff_model.py):")
  print(f"  any number of steps: {'proven' if handoff.safe else 'NOT PROVEN'} "
        f"{handoff.seconds:5.1f}s")
  for f in handoff.failures[:5]:
    print(f"    fails: {f}")
  ring_proven += handoff.safe
  ring_rows = ring_rows + [handoff]
  total = len(rows) + len(ring_rows)
  print(f"\n{proven + ring_proven}/{total} proven in {time.perf_counter() - start:.1f} s "
        f"(z3, {args.jobs} worker(s)): forward {proven}/{len(rows)}, "
        f"backward {ring_proven}/{len(ring_rows)}")
  if proven < len(rows) and all(r.protocol.persistent for r in rows if r.status != "proven"):
    assumed = prove_all(handshake=handshake, jobs=args.jobs, persistent=True,
                        nonempty_tiles=True)
    ok = sum(r.status == "proven" for r in assumed)
    print(f"persistent, assuming every tile has a key block (no k_start/k_end ranges): "
          f"{ok}/{len(assumed)} proven")
  ok = proven == len(rows) and ring_proven == len(ring_rows) and extracted_ok
  return 0 if ok else 1


HANDSHAKES = {
    "kernel": pm.KERNEL_HANDSHAKE,
    "token-across-tiles": pm.TOKEN_ACROSS_TILES,   # 14c1599..0b8ad79
    "token-per-tile": pm.TOKEN_PER_TILE,           # before 14c1599
}


if __name__ == "__main__":
  raise SystemExit(main())
