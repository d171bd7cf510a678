"""Autotuning on the GPU: time every candidate config, keep the fastest.

The candidates are ``kernel.tiling.heuristics.get_autotuning_configs`` (each already
filtered by ``kernel.tiling.plan.config_fits``).  The winner is written to the cache
that ``kernel/tiling/autotune.py`` reads for ``config=None``, under the signature of
``kernel.tiling.autotune.selection_problem``, so what is tuned is what is found.

``python -m harness autotune`` (or ``python -m harness.tools.autotune``) tunes
:data:`COMMON_SHAPES` and writes ``kernel/tiling/autotune_cache.json``;
``--causal-grid`` tunes the causal points of ``bench --grid`` instead, and
``--coverage`` the whole set of :func:`coverage_jobs`: every head dim, sequence
bucket, mask and dtype the shipped cache is meant to answer for
(``--dtypes float8_e4m3fn``: the same set for FP8, whose entries only FP8
calls read).

The cache is written after every signature, so a run cut short keeps what it
finished.  ``--resume`` (the default with ``--coverage``) skips a signature the
cache already holds for this device with the candidate set this run would
time, so repeated runs fill the cache step by step; ``--budget-s`` stops
starting new signatures when the next one, estimated from those this run has
timed, would pass the budget; ``--order likely`` (the default) tunes the
signatures most calls hit first; ``--dry-run`` lists what would be tuned and
what is cached, and needs no GPU; ``--only`` keeps the named signatures of
the chosen set (the grid points that lag, say).

Each entry records the fastest ``config`` whose results pass the float64
check (:func:`tune`), every candidate's ``median_ms`` (an error string for
one that failed to run, ``"wrong: ..."`` for a faster one that failed the
check), and, since coverage tuning, the
``date``, the ``jax`` version and the representative ``shape`` it was timed
at.  Entries without the last three (older ones) are read all the same.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import re
import sys
import time
from pathlib import Path

from harness.tools.bench import BenchShape
from kernel.tiling import autotune, heuristics, plan
from kernel.tiling.config import Config


def record(problem: plan.Problem, device_kind: str, config: Config, timings_ms: dict,
           *, path: Path | None = None, meta: dict | None = None, **features) -> None:
  """Write one signature's entry.  ``meta`` is merged into the entry; by
  default it is the date (UTC) and the jax version the timings were taken
  with."""
  path = autotune.CACHE_PATH if path is None else path
  if meta is None:
    meta = run_meta()
  data = autotune.load_cache(path)
  data.setdefault(device_kind, {})[autotune.signature(problem, **features)] = {
      **meta,
      "config": dataclasses.asdict(config),
      "median_ms": timings_ms,
  }
  path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def run_meta() -> dict:
  import jax
  return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
          "jax": jax.__version__}


def tune(problem: plan.Problem, run, *, candidates=None, verify=None) -> tuple[Config, dict]:
  """Time ``run(config) -> seconds`` for every candidate; return the fastest
  whose results are right and every timing (ms).  Candidates that fail to
  compile are skipped.

  ``verify(config) -> None | str`` checks a candidate's results (on the GPU:
  :func:`_gpu_verify_maker`, a small case of the signature against float64
  under the tolerance rule).  It is asked of the fastest first, then of the
  next, until one passes: a candidate that is fast because it is wrong is
  never written to the cache; its timing is replaced by ``"wrong: "`` and
  the reason, so the entry says why it lost."""
  candidates = candidates or heuristics.get_autotuning_configs(problem)
  timings = {}
  for config in candidates:
    try:
      timings[str(config)] = run(config) * 1e3
    except Exception as err:  # a candidate the compiler rejects is not the best
      timings[str(config)] = f"{type(err).__name__}: {str(err)[:120]}"
  timed = {c: t for c, t in zip(candidates, (timings[str(c)] for c in candidates))
           if isinstance(t, float)}
  if not timed:
    raise RuntimeError(f"no candidate ran: {timings}")
  for best in sorted(timed, key=lambda c: (timed[c], candidates.index(c))):
    wrong = None if verify is None else verify(best)
    if wrong is None:
      return best, timings
    timings[str(best)] = f"wrong: {str(wrong)[:160]}"
  raise RuntimeError(f"no candidate gave right results: {timings}")


def config_of_key(text: str) -> Config:
  """The Config a ``median_ms`` key names.  Keys are ``str(config)`` as it was
  when tuned; a field added to Config since then takes its default."""
  match = re.fullmatch(r"Config\((.*)\)", text)
  if match is None:
    raise ValueError(f"not a Config: {text!r}")
  return Config(**{k: ast.literal_eval(v) for k, v in
                   (item.split("=", 1) for item in match.group(1).split(", "))})


def timed_candidates(entry: dict) -> frozenset[Config] | None:
  """The candidate set a cache entry was tuned over (None if unreadable)."""
  try:
    return frozenset(config_of_key(k) for k in entry.get("median_ms", {}))
  except (ValueError, TypeError, SyntaxError):
    return None


# --- what is tuned -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Job(BenchShape):
  """One representative shape to tune (a benchmark shape: (B, T, N, H) with
  T = S, head_dim_out = head_dim, self-attention with no bias, mask or key
  ranges)."""

  def problem(self) -> plan.Problem:
    shape = (self.batch, self.seq, self.heads, self.head_dim)
    return autotune.selection_problem(plan.problem_of_shapes(shape, shape, shape, self.dtype,
                                                             is_causal=self.causal))

  def signature(self) -> str:
    return autotune.signature(self.problem())

  def label(self) -> str:
    return (f"B{self.batch} T{self.seq} N{self.heads} H{self.head_dim} "
            f"{'causal' if self.causal else 'full'} {self.dtype}")


COMMON_SHAPES = (  # (batch, seq, heads, head_dim, causal)
    (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
    (16, 1024, 16, 128, False), (16, 1024, 16, 128, True),
    (1, 16384, 16, 128, False), (1, 16384, 16, 128, True),
    (4, 4096, 32, 64, False), (4, 4096, 8, 256, False),
)

COVERAGE_HEAD_DIMS = (64, 96, 128, 192, 256)
COVERAGE_SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
COVERAGE_DTYPES = ("bfloat16", "float16")


def coverage_jobs(dtypes=COVERAGE_DTYPES) -> list[Job]:
  """The signatures the shipped cache is meant to cover on a device: head
  dims 64, 96, 128, 192, 256 (head_dim_out = head_dim), sequence buckets 512
  to 32k with seq_q = seq_kv, causal and not, bfloat16 and float16: 5 * 7 * 2
  * 2 = 140 jobs, listed head dim, then seq, then causal, then dtype.

  Each is timed at the shape ``bench --grid`` times at that head dim and
  length: batch * seq = 16k tokens (batch at least 1) and heads * head_dim
  = 2048 (``bench_grid.heads_for``: 21 heads at 96, 10 at 192).

  Head dims are padded (``plan.padded_head_dims``: 96 stays 96) before the
  kernel sees them, so a head dim the padding rounds up (72 -> 96) shares
  the padded dim's signature: the kernel runs the same problem, and the
  cache answers both with one entry, tuned once (at the shape that comes
  first in the order tuned).  Every head dim listed here has a signature
  of its own."""
  from harness.tools import bench_grid
  return [Job(max(1, bench_grid.TOKENS // seq), seq, bench_grid.heads_for(d), d, causal, dtype)
          for d in COVERAGE_HEAD_DIMS for seq in COVERAGE_SEQS
          for causal in (False, True) for dtype in dtypes]


# --order likely: the calls most models make come first, so a cache filled
# part way answers the most calls.  Lexicographic in (dtype, head dim, seq,
# mask); values not listed go last, in their listed order.
LIKELY_DTYPES = ("bfloat16", "float16")
LIKELY_HEAD_DIMS = (128, 64, 256, 96, 192)
LIKELY_SEQS = (4096, 8192, 2048, 1024, 16384, 32768, 512)
LIKELY_CAUSAL = (True, False)   # decoder training and prefill are causal


def likely_order(jobs: list[Job]) -> list[Job]:
  """``jobs`` sorted most-used first: bfloat16 before float16; head dim 128,
  64, 256, 96, 192; sequence 4k, 8k, 2k, 1k, 16k, 32k, 512; causal before
  not.  Stable, so ties keep their listed order."""
  def rank(options, value):
    return options.index(value) if value in options else len(options)
  return sorted(jobs, key=lambda j: (rank(LIKELY_DTYPES, j.dtype),
                                     rank(LIKELY_HEAD_DIMS, j.head_dim),
                                     rank(LIKELY_SEQS, j.seq),
                                     rank(LIKELY_CAUSAL, j.causal)))


@dataclasses.dataclass
class Planned:
  """A job and what this run does with it.  ``status``: ``tune``; ``cached``
  (the cache holds its signature, tuned over the same candidates); ``retune``
  (held, but tuned over another candidate set, or resume is off: tuned again);
  ``same`` (an earlier job in this run has its signature, see ``same_as``)."""
  job: Job
  signature: str
  candidates: tuple[Config, ...]
  status: str
  same_as: Job | None = None
  note: str = ""

  @property
  def tunes(self) -> bool:
    return self.status in ("tune", "retune")


def candidates_for(problem: plan.Problem, restricted=None) -> tuple[Config, ...]:
  """Every autotuning candidate, or (``--candidates``) the heuristic's pick
  and those of ``restricted`` that fit."""
  if restricted is None:
    return tuple(heuristics.get_autotuning_configs(problem))
  out = [heuristics.get_heuristics_config(problem)]
  out += [c for c in restricted if plan.config_fits(problem, c) and c not in out]
  return tuple(out)


def split_tail_twins(problem: plan.Problem, entry: dict | None,
                     device_kind: str) -> tuple[Config, ...]:
  """``--split-tail-twins``: the config ``config=None`` runs for ``problem``
  (the cache entry's, else kernel.tiling.autotune.choice's nearest entry or
  heuristic) and its persistent split-tail twin, or () where the twin
  cannot run (causal) or does not fit.  Timing the two decides whether the
  split tail replaces the pick, at two candidates a signature."""
  pick = (Config(**entry["config"]) if entry is not None
          else autotune.choice(problem, device_kind)[0])
  if entry is None and pick.schedule == "split-tail":
    # A split tail borrowed from the nearest entry (not measured here):
    # timed beside its round-robin sibling, since it wins at some lengths
    # and loses at others (docs/decisions/split-tail-off-the-default.md).
    return (dataclasses.replace(pick, schedule="round-robin"), pick)
  twin = dataclasses.replace(pick, persistent=True, schedule="split-tail")
  if twin == pick or not plan.config_fits(problem, twin):
    return ()
  return (pick, twin)


def plan_jobs(jobs: list[Job], cache: dict, device_kind: str, *, resume: bool,
              restricted=None, keep_cached: bool = False,
              twins: bool = False) -> list[Planned]:
  """What to do with each job.  ``keep_cached`` (``--keep-cached``): a
  signature the cache holds is kept whatever candidates it was tuned over
  (a run over a short list then fills only what is missing).  ``twins``
  (``--split-tail-twins``): each job times :func:`split_tail_twins` alone;
  one without a twin is left as it is."""
  entries = cache.get(device_kind, {})
  first: dict[str, Job] = {}
  out = []
  for job in jobs:
    sig = job.signature()
    entry = entries.get(sig)
    candidates = (split_tail_twins(job.problem(), entry, device_kind) if twins
                  else candidates_for(job.problem(), restricted))
    if sig in first:
      out.append(Planned(job, sig, candidates, "same", first[sig]))
      continue
    first[sig] = job
    if twins and not candidates:
      out.append(Planned(job, sig, candidates, "cached",
                         note="no split-tail twin (causal, or it does not fit): kept"))
      continue
    if entry is None:
      status, note = "tune", ""
    elif not resume:
      status, note = "retune", "cached; tuned again without --resume"
    elif timed_candidates(entry) == frozenset(candidates):
      status, note = "cached", entry.get("date", "")
    elif keep_cached:
      status, note = "cached", f"{entry.get('date', '')} over another candidate set, kept"
    else:
      status, note = "retune", "cached over another candidate set"
    out.append(Planned(job, sig, candidates, status, note=note))
  return out


def describe(planned: list[Planned], device_kind: str, cache_path, out=print) -> None:
  """The ``--dry-run`` listing: one line per job, then the totals."""
  todo = [p for p in planned if p.tunes]
  for p in planned:
    if p.status == "same":
      extra = f"shares the signature of {p.same_as.label()}"
    else:
      extra = f"{len(p.candidates):3d} candidates"
      extra += f" ({p.note})" if p.note else ""
    out(f"  {p.status:7s} {p.signature:44s} {p.job.label():34s} {extra}")
  out(summary_line(planned, device_kind, cache_path))
  out(f"to tune: {len(todo)} signatures, {sum(len(p.candidates) for p in todo)} candidates")


def summary_line(planned: list[Planned], device_kind, cache_path) -> str:
  sigs = [p for p in planned if p.status != "same"]
  cached = sum(p.status == "cached" for p in sigs)
  return (f"{device_kind} in {cache_path}: {len(planned)} jobs, {len(sigs)} signatures, "
          f"{cached} cached, {len(sigs) - cached} to tune")


def run_plan(planned: list[Planned], device_kind: str, make_run, *, cache_path: Path,
             budget_s: float | None = None, report_path: Path | None = None,
             clock=None, out=print, meta=run_meta, make_verify=None) -> dict:
  """Tune every job of ``planned`` that ``tunes``, writing the cache after each.

  ``make_run(job)`` returns ``run(config) -> seconds``; ``make_verify(job)``,
  where given, ``verify(config) -> None | str`` (:func:`tune`).  With ``budget_s``, a
  job is not started when the seconds spent so far plus its estimate pass
  the budget: the estimate is its candidate count times the slowest
  per-candidate time of the jobs this run has timed (the first job always
  starts, having nothing to be estimated from).  ``report_path`` is
  rewritten after each job with every timing and the heuristic's.  Returns
  ``tuned``, ``failed`` (no candidate ran), ``left`` (not started) and
  ``report``.  ``clock`` (seconds) defaults to ``time.monotonic``."""
  clock = clock or time.monotonic
  start = clock()
  per_candidate: list[float] = []
  tuned, failed, report = [], [], []
  todo = [p for p in planned if p.tunes]
  left: list[Planned] = []
  for i, p in enumerate(todo):
    elapsed = clock() - start
    if budget_s is not None and per_candidate:
      estimate = len(p.candidates) * max(per_candidate)
      if elapsed + estimate > budget_s:
        left = todo[i:]
        out(f"budget: {elapsed:.0f} s of {budget_s:.0f} s spent; {p.signature} would take "
            f"about {estimate:.0f} s ({len(p.candidates)} candidates x "
            f"{max(per_candidate):.1f} s); not started")
        break
    t0 = clock()
    problem = p.job.problem()
    try:
      best, timings = tune(problem, make_run(p.job), candidates=list(p.candidates),
                           verify=None if make_verify is None else make_verify(p.job))
    except RuntimeError as err:  # every candidate failed: nothing to record
      failed.append(p)
      out(f"{p.signature}: {err}")
      per_candidate.append((clock() - t0) / max(1, len(p.candidates)))
      continue
    record(problem, device_kind, best, timings, path=cache_path,
           meta={**meta(), "shape": [p.job.batch, p.job.seq, p.job.heads, p.job.head_dim]})
    seconds = clock() - t0
    per_candidate.append(seconds / max(1, len(p.candidates)))
    tuned.append(p)
    heuristic = heuristics.get_heuristics_config(problem)
    h_ms = timings.get(str(heuristic))
    report.append(dict(shape=dataclasses.asdict(p.job), signature=p.signature,
                       best=str(best), best_ms=timings[str(best)], heuristic=str(heuristic),
                       heuristic_ms=h_ms, timings_ms=timings, seconds=seconds))
    out(f"{p.signature}: {best} {timings[str(best)]:.3f} ms; heuristic {heuristic} "
        f"{h_ms if isinstance(h_ms, str) or h_ms is None else f'{h_ms:.3f} ms'} "
        f"({len(p.candidates)} candidates, {seconds:.0f} s)")
    if report_path is not None:
      report_path.write_text(json.dumps(dict(device=device_kind, **meta(), shapes=report),
                                        indent=1))
  total = clock() - start
  out(f"tuned {len(tuned)} signatures in {total:.0f} s"
      f"{f', {len(failed)} failed' if failed else ''}; "
      f"{len(left)} left ({sum(len(p.candidates) for p in left)} candidates)"
      f"{': run the command again to continue' if left else ''}")
  for p in left:
    out(f"  left    {p.signature:44s} {p.job.label()}")
  return dict(tuned=tuned, failed=failed, left=left, report=report)


def _jobs(args) -> list[Job]:
  if args.coverage:
    jobs = coverage_jobs(tuple(d.strip() for d in args.dtypes.split(",")))
  elif args.causal_grid:
    from harness.tools.bench_grid import grid_points
    jobs = [Job(p.batch, p.seq, p.heads, p.head_dim, True)
            for p in grid_points(backward=False, ragged=False) if p.causal]
  elif args.shapes == "all":
    jobs = [Job(*s) for s in COMMON_SHAPES]
  else:
    jobs = [Job(*COMMON_SHAPES[int(i)]) for i in args.shapes.split(",")]
  if args.only:
    jobs = only(jobs, args.only)
  return likely_order(jobs) if args.order == "likely" else jobs


def only(jobs: list[Job], spec: str) -> list[Job]:
  """The jobs whose signature is one of ``spec``'s comma-separated
  signatures (as --dry-run lists them); a name that matches no job is an
  error, so a typo never tunes nothing in silence."""
  wanted = [w.strip() for w in spec.split(",") if w.strip()]
  known = {j.signature() for j in jobs}
  missing = [w for w in wanted if w not in known]
  if missing or not wanted:
    raise SystemExit(f"autotune: --only names no job of the chosen set: {missing or spec!r} "
                     f"(--dry-run lists the signatures)")
  return [j for j in jobs if j.signature() in wanted]


def _gpu_run_maker():
  """``make_run`` for the GPU: random inputs at the job's shape, each config
  jitted and timed by ``harness/tools/bench.py``'s method."""
  import jax
  from harness.tools.bench import BenchShape, _inputs, time_fns
  from kernel import api

  def make_run(job: Job):
    inputs = _inputs(BenchShape(job.batch, job.seq, job.heads, job.head_dim, job.causal,
                                job.dtype), 3)

    # FP8 is timed with unit descales (their values cost nothing).
    unit = ({n: 1.0 for n in ("q_descale", "k_descale", "v_descale")}
            if job.problem().fp8 else {})

    def run(config):
      fn = jax.jit(lambda q, k, v: api.dot_product_attention(q, k, v, is_causal=job.causal,
                                                             config=config, **unit))
      return time_fns({"x": fn}, inputs, trials=5, burst=10)["x"]
    return run
  return make_run


# The case each winner is checked on before it is cached: the signature's
# head dim, dtype and mask at lengths no block divides (ragged queries and
# keys), with grouped kv heads.
VERIFY_SHAPE = dict(batch=1, seq_q=1000, seq_kv=777, heads=4, kv_heads=2)


def _gpu_verify_maker():
  """``make_verify`` for the GPU: the job's config run on a small case of its
  signature (:data:`VERIFY_SHAPE`) against the float64 reference, under the
  tolerance rule (harness/numerics/conformance.py)."""
  import numpy as np
  from harness.numerics.conformance import check_forward, random_case, run_kernel

  def make_verify(job: Job):
    # FP8: its normal values as they are, with descales unlike 1
    fp8 = (dict(q_descale=np.float32(0.5), k_descale=np.float32(0.25),
                v_descale=np.float32(2.0)) if job.problem().fp8 else {})
    case = random_case(np.random.default_rng(job.seq), head_dim=job.head_dim, dtype=job.dtype,
                       is_causal=job.causal, **VERIFY_SHAPE, **fp8)

    def verify(config):
      try:
        report = check_forward(case, *run_kernel(case, config=config))
      except Exception as err:  # one that does not run at this shape is not verified
        return f"{type(err).__name__}: {err}"
      return None if report.passed else report.summary()
    return verify
  return make_verify


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m harness autotune")
  p.add_argument("--cache", default=str(autotune.CACHE_PATH))
  p.add_argument("--shapes", default="all",
                 help="comma-separated indices into COMMON_SHAPES, or 'all'")
  p.add_argument("--report", default=None,
                 help="JSON file for every timing and the heuristic's")
  p.add_argument("--causal-grid", action="store_true",
                 help="tune the causal points of bench --grid (head dim 64/128/256, "
                      "1k-16k, 16k tokens per batch) instead of --shapes")
  p.add_argument("--coverage", action="store_true",
                 help="tune coverage_jobs(): head dim 64/96/128/192/256, seq 512-32k, "
                      "causal and not, bf16 and f16 (140 jobs); resumes by default")
  p.add_argument("--dtypes", default=",".join(COVERAGE_DTYPES),
                 help="comma-separated dtypes of --coverage's jobs (float8_e4m3fn: FP8's "
                      "entries, timed with unit descales)")
  p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                 help="skip signatures the cache holds for this device, tuned over the "
                      "candidates this run would time (default: on with --coverage)")
  p.add_argument("--keep-cached", action="store_true",
                 help="with --resume, keep every signature the cache holds for this device, "
                      "whatever candidates it was tuned over")
  p.add_argument("--budget-s", type=float, default=None,
                 help="start no signature that, estimated from those timed in this run, "
                      "would end past this many seconds")
  p.add_argument("--order", choices=("likely", "listed"), default="likely",
                 help="likely: bf16 first, head dim 128/64/256/96/192, seq 4k/8k/2k/1k/"
                      "16k/32k/512, causal first; listed: as the set is defined")
  p.add_argument("--dry-run", action="store_true",
                 help="list what would be tuned and what is cached; needs no GPU")
  p.add_argument("--device-kind", default=None,
                 help="the cache's device key for --dry-run (default: this machine's "
                      "sm90 GPU, else 'NVIDIA H200')")
  p.add_argument("--only", default=None,
                 help="comma-separated signatures of the chosen set (as --dry-run lists "
                      "them) to tune alone, e.g. the grid points that lag")
  p.add_argument("--candidates", default=None,
                 help="';'-separated configs as bench --grid --variants spells them "
                      "(e.g. '64,128,2,p,lf;64,64,2,lf'); those that fit are timed "
                      "beside the heuristic's pick. Default: every autotuning candidate")
  p.add_argument("--split-tail-twins", action="store_true",
                 help="time only the config config=None runs and its split-tail twin, per "
                      "signature (jobs without a twin are kept as they are)")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  from kernel import api
  device = api.sm90_device()
  if device is not None:
    if args.device_kind and args.device_kind != device.device_kind:
      raise SystemExit(f"autotune: --device-kind {args.device_kind!r} but this GPU is "
                       f"{device.device_kind!r}")
    device_kind = device.device_kind
  elif args.dry_run:
    device_kind = args.device_kind or "NVIDIA H200"
  else:
    raise SystemExit("autotune: needs an sm90 GPU (--dry-run does not)")
  restricted = None
  if args.candidates and args.split_tail_twins:
    raise SystemExit("autotune: --candidates and --split-tail-twins each choose the "
                     "candidates; give one")
  if args.candidates:
    from harness.tools.bench_grid import parse_variant
    restricted = [parse_variant(t.strip()) for t in args.candidates.split(";") if t.strip()]
    if any(c is None for c in restricted):
      raise SystemExit("autotune: --candidates takes configs, not 'auto'")
  resume = args.coverage if args.resume is None else args.resume
  if args.keep_cached and not resume:
    raise SystemExit("autotune: --keep-cached keeps what --resume would skip; it needs "
                     "--resume (the default with --coverage)")
  cache_path = Path(args.cache)
  planned = plan_jobs(_jobs(args), autotune.load_cache(cache_path), device_kind,
                      resume=resume, restricted=restricted,
                      keep_cached=args.keep_cached, twins=args.split_tail_twins)
  if args.dry_run:
    describe(planned, device_kind, cache_path)
    return 0
  print(summary_line(planned, device_kind, cache_path), flush=True)
  run_plan(planned, device_kind, _gpu_run_maker(), cache_path=cache_path,
           budget_s=args.budget_s, report_path=Path(args.report) if args.report else None,
           out=lambda line: print(line, flush=True), make_verify=_gpu_verify_maker())
  return 0


if __name__ == "__main__":
  sys.exit(main())
