"""The barrier and ring protocol read out of the traced kernels, checked.

Backward (:func:`check_backward`): every launch kind of
``kernel/backward.py`` (head dims 64/128/256, causal, bias, fused dQ or the
dQ kernel) traced with 384 query rows (the dK/dV rings wrap) and the dQ
tile's key range ``[lb, lb + n)`` for ``lb`` in ``{0, 1}``, ``n`` in
:data:`BACKWARD_TRIPS`.

For each distinct forward protocol the heuristics and the autotuner emit
(:func:`forward_cases`: stages, persistent, schedule, staged bias/mask,
causal; block sizes and head dims do not change the sequence of
synchronisation events) this traces ``kernel/forward.py`` on the CPU, reads
every role's events out of the jaxpr (:mod:`harness.extract`) under a set of
environments — the key-block range ``[lb, lb + n)`` each tile reads from its
``k_range_tiles`` entry, so trip counts, zero included, and the ring's offset
are chosen here — and checks each with :func:`harness.extracted_proof.check`
(every interleaving of the roles and the TMA completions).  Environments that
give the same event sequences share one check.

Environments (bounded, see :data:`TRIPS`): a non-persistent block runs one
tile, checked for every ``n`` in ``0 .. stages + 2`` and ``lb`` in ``{0, 1}``;
a persistent block walks tiles whose trip counts are every sequence of
:data:`PERSISTENT_TILES` tiles over :data:`PERSISTENT_TRIPS`, so the ring
wraps across tile boundaries, after empty tiles, and at every phase.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from harness import extract as ex
from harness import extracted_proof as xp

PERSISTENT_TILES = 2
LB_CHOICES = (0, 1)


@dataclasses.dataclass(frozen=True)
class ForwardCase:
  """What the forward's synchronisation depends on, and one emitted config."""

  num_stages: int
  persistent: bool
  schedule: str
  bias: bool      # staged 2-D bias (through the ring)
  mask: bool      # staged 2-D mask
  causal: bool
  block_q: int = 64
  block_kv: int = 128
  config_stages: int = 0   # Config.num_stages; more than num_stages when the keys are fewer
  # Persistent blocks that stage each warpgroup's output in its query slot
  # (plan.overlays_query_with_output: separate buffers would not fit), traced
  # at the problem's head dim and residuals, which decide that layout.
  overlay_q: bool = False
  overlay_head_dim: int = 64
  overlay_residuals: bool = False

  def key(self):
    return (self.num_stages, self.persistent, self.schedule, self.bias, self.mask, self.causal,
            self.overlay_q, self.residuals)

  @property
  def head_dim(self) -> int:
    return self.overlay_head_dim if self.overlay_q else 64

  @property
  def residuals(self) -> bool:
    return self.overlay_q and self.overlay_residuals

  def describe(self) -> str:
    parts = [f"stages={self.num_stages}", "persistent" if self.persistent else "one tile",
             self.schedule]
    parts += [n for n, on in (("staged bias", self.bias), ("staged mask", self.mask),
                              ("causal", self.causal),
                              ("output in the query slot", self.overlay_q),
                              ("with residuals", self.residuals)) if on]
    return " ".join(parts)


def forward_cases(problems) -> list[tuple[ForwardCase, int]]:
  """Every distinct forward protocol of the configs the heuristics and the
  autotuner emit for ``problems`` (:func:`harness.prove.problem_grid`), with
  how many (problem, config) pairs it covers."""
  from kernel import heuristics, plan as plan_lib
  found: dict = {}
  for p in problems:
    configs = []
    try:
      configs.append(heuristics.get_heuristics_config(p))
    except ValueError:
      pass
    configs += list(heuristics.get_autotuning_configs(p))
    for c in configs:
      stages = plan_lib.pipeline_plan(p, c).num_stages
      overlay = plan_lib.scratch_layout(p, c).overlay_q_with_output
      case = ForwardCase(stages, c.persistent, c.schedule, p.bias_2d, p.mask_2d, p.is_causal,
                         c.block_q, c.block_kv, c.num_stages, overlay,
                         p.head_dim if overlay else 64, overlay and p.return_residuals)
      prev = found.get(case.key())
      found[case.key()] = (prev[0] if prev else case, (prev[1] if prev else 0) + 1)
  return [found[k] for k in sorted(found)]


def _const_values(closed, kernel_eqn) -> dict:
  """gmem input index -> numpy value, for the kernel operands that are
  constants of the traced program (the longest-first schedule tables)."""
  known = {v: np.asarray(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}

  def walk(jaxpr, known):
    for eqn in jaxpr.eqns:
      if eqn is kernel_eqn:
        return {i: known[v] for i, v in enumerate(eqn.invars) if v in known}
      for sub in ex._subjaxprs(eqn.params):
        if len(sub.invars) == len(eqn.invars):
          inner = {iv: known[ov] for iv, ov in zip(sub.invars, eqn.invars)
                   if not isinstance(ov, ex.jex_core.Literal) and ov in known}
          inner.update({v: known[v] for v in sub.constvars if v in known})
        else:
          inner = {}
        found = walk(sub, inner)
        if found is not None:
          return found
    return None

  return walk(closed.jaxpr, known) or {}


class _Env:
  """The integers the kernel reads from global memory: per tile ``qi`` its
  key range from ``ranges[qi] = (lb, n)`` (the four k_range_tiles tables),
  the schedule tables from the traced constants."""

  def __init__(self, kernel_eqn, consts, ranges, block_kv):
    self.ranges, self.block_kv = ranges, block_kv
    self.consts = {f"gmem_in{i}": v for i, v in consts.items()}
    num_tiles = len(ranges)
    tables = [i for i, v in enumerate(kernel_eqn.invars)
              if tuple(v.aval.shape) == (1, 1, num_tiles) and "int" in str(v.aval.dtype)
              and i not in consts]
    if len(tables) != 4:
      raise ex.ExtractionError(f"expected the 4 k_range_tiles tables among the kernel's "
                               f"operands, found {len(tables)}")
    self.tables = {f"gmem_in{i}": k for k, i in enumerate(tables)}

  def __call__(self, buf, idx):
    if buf in self.consts:
      return int(self.consts[buf][tuple(idx)])
    which = self.tables.get(buf)
    if which is None:
      raise ex.ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which "
                               f"the prover gives no value")
    lb, n = self.ranges[idx[-1]]
    start_min, start_max = lb * self.block_kv, lb * self.block_kv
    end_min = end_max = (lb + n) * self.block_kv
    return (start_min, start_max, end_min, end_max)[which]


def _causal_offset(case: ForwardCase, max_trips: int) -> int:
  """Tiles to put before the checked ones so that the causal bound, at most
  ``(qi + 1) * 2 * block_q`` keys for tile ``qi``, never caps a range."""
  if not case.causal:
    return 0
  need = -(-(max_trips + 1) * case.block_kv // (2 * case.block_q))  # tiles
  return max(0, need - 1)


def forward_environments(case: ForwardCase):
  """Per-tile (lb, n) tuples: the environments a case is checked under.  A
  non-persistent block runs one tile (the last of the tuple, the others are
  the grid's other blocks, given the same range); a persistent block walks
  them all: empty tiles first where the causal bound needs room."""
  s = case.num_stages
  if not case.persistent:
    pad = _causal_offset(case, s + 2)
    return [((lb, n),) * (pad + 1) for lb in LB_CHOICES for n in range(s + 3)]
  trips = sorted({0, 1, s, s + 1})
  pad = _causal_offset(case, s + 2)
  return [((0, 0),) * pad + tuple((0 if k else 1, n) for k, n in enumerate(seq))
          for seq in itertools.product(trips, repeat=PERSISTENT_TILES)]


def trace_case(case: ForwardCase, num_tiles: int, *, module=None):
  from kernel import config as config_lib, forward
  module = module or forward
  config_stages = case.config_stages or case.num_stages
  # effective stages = min(config, key blocks): fewer stages means that few keys
  max_blocks = case.num_stages + 4 if config_stages == case.num_stages else case.num_stages
  seq_q = num_tiles * 2 * case.block_q
  features = module.Features(
      scale=0.125, is_causal=case.causal, logits_soft_cap=None, rescale_threshold=1.0,
      normalize_output=True, return_residuals=case.residuals, seq_q=seq_q,
      seq_kv=max_blocks * case.block_kv, stage_2d=case.bias or case.mask)
  config = config_lib.Config(block_q=case.block_q, block_kv=case.block_kv,
                             num_stages=config_stages, persistent=case.persistent,
                             schedule=case.schedule)
  from kernel import plan as plan_lib
  traced = plan_lib.Problem(
      dtype=np.dtype("bfloat16"), head_dim=case.head_dim, head_dim_out=case.head_dim,
      seq_q=seq_q, seq_kv=features.seq_kv, is_causal=case.causal, bias_2d=case.bias,
      mask_2d=case.mask, return_residuals=case.residuals)
  if plan_lib.scratch_layout(traced, config).overlay_q_with_output != case.overlay_q:
    raise ex.ExtractionError(f"{case.describe()}: the traced problem's layout does not "
                             f"stage the output where the case does")
  return ex.trace_forward(features, config, num_tiles=num_tiles, kv_blocks=max_blocks,
                          head_dim=case.head_dim, bias=case.bias, mask=case.mask, module=module)


def extract_case(case: ForwardCase, ranges, *, traced=None, module=None):
  """The extracted launches (one per block that runs) of ``case`` under ``ranges``."""
  closed, kernel = traced or trace_case(case, len(ranges), module=module)
  consts = _const_values(closed, kernel)
  env = _Env(kernel, consts, ranges, case.block_kv)
  grid0 = {"batch": 0, "heads": 0, "q_tiles": 0, "tiles": 0, "sm": 0}
  if case.persistent:
    return [ex.extract_kernel(kernel, env=env, grid=grid0, name="forward")]
  # Every block has the same range: check the one whose tile the causal bound
  # caps least (longest-first runs the heaviest tile first).
  qi = len(ranges) - 1
  return [ex.extract_kernel(kernel, env=env, grid={**grid0, "q_tiles": qi, "tiles": 0},
                            name=f"forward block {qi}")]


@dataclasses.dataclass
class CaseResult:
  case: ForwardCase
  configs: int
  environments: int
  checks: int
  states: int
  seconds: float
  violation: xp.Violation | None = None


def check_case(case: ForwardCase, configs: int = 1, *, module=None,
               environments=None) -> CaseResult:
  start = time.perf_counter()
  envs = environments if environments is not None else forward_environments(case)
  traced = {}
  seen, states = set(), 0
  for ranges in envs:
    nt = len(ranges)
    if nt not in traced:
      traced[nt] = trace_case(case, nt, module=module)
    for launch in extract_case(case, ranges, traced=traced[nt]):
      sk = launch.skeleton()
      if sk in seen:
        continue
      seen.add(sk)
      label = ", ".join(f"tile {i}: blocks [{lb}, {lb + n})" for i, (lb, n) in enumerate(ranges))
      r = xp.check(launch, environment=f"{launch.name}; {label}")
      states += r.states
      if not r.ok:
        return CaseResult(case, configs, len(envs), len(seen), states,
                          time.perf_counter() - start, r.violation)
  return CaseResult(case, configs, len(envs), len(seen), states, time.perf_counter() - start)


BACKWARD_HEAD_DIMS = (64, 128, 256)  # two stages, one dK/dV launch (fused dQ where it fits); one stage, dK and dV apart
BACKWARD_TRIPS = (0, 1, 2, 3)     # key blocks of the dQ kernel's tile (64 keys each)
# Queries: the dK/dV kernels stream every 64-row query block, so their ring
# wraps past its first refill at 384 rows (6 blocks); the dQ kernel's tiles are 128 rows.
BACKWARD_SEQ_Q = 384


def trace_backward(head_dim, *, causal, bias, fuse_dq, seq_q=BACKWARD_SEQ_Q, seq_kv=192, ranges=True,
                   module=None):
  """The closed jaxpr of ``kernel.backward.attention_backward`` traced on the
  CPU, and its Mosaic GPU kernels in launch order."""
  import jax
  import jax.numpy as jnp
  from kernel import api, backward
  module = module or backward
  sds = jax.ShapeDtypeStruct
  q = sds((1, seq_q, 1, head_dim), jnp.bfloat16)
  k = sds((1, seq_kv, 1, head_dim), jnp.bfloat16)
  rows = sds((1, 1, seq_q), jnp.float32)
  b = sds((1, 1, seq_q, seq_kv), jnp.bfloat16) if bias else None
  kr = sds((1, 1, seq_q), jnp.int32) if ranges else None

  def fn(q, k, v, b, ks, ke, o, m, l, do):
    return module.attention_backward(q, k, v, b, None, ks, ke, o, m, l, do, scale=0.125,
                                     is_causal=causal, fuse_dq=fuse_dq)

  with api.lowering_only():
    closed = jax.make_jaxpr(fn)(q, k, k, b, kr, kr, q, rows, rows, q)
  return closed, ex.find_kernels(closed.jaxpr)


def backward_cases():
  """(head_dim, causal, bias, fuse_dq): every launch kind kernel/backward.py makes."""
  return [(d, c, b, f) for d in BACKWARD_HEAD_DIMS for c in (False, True)
          for b in (False, True) for f in (True, False)]


def check_backward(head_dim, causal, bias, fuse_dq, *, module=None) -> CaseResult:
  """Every kernel of one backward, its dQ tile's key range [lb, lb + n) for
  lb in {0, 1} and n in BACKWARD_TRIPS (the dK/dV kernels' query loops run
  over the whole padded query length)."""
  start = time.perf_counter()
  closed, kernels = trace_backward(head_dim, causal=causal, bias=bias, fuse_dq=fuse_dq,
                                   module=module)
  grid = {"batch": 0, "heads": 0, "q_tiles": 0, "kv_tiles": 0, "kv_heads": 0}
  seen, states, envs = set(), 0, 0
  for kernel in kernels:
    for lb in LB_CHOICES:
      for n in BACKWARD_TRIPS:
        envs += 1
        nt = BACKWARD_SEQ_Q // 128
        env = _Env(kernel, {}, ((lb, n),) * nt, 64) if _has_tables(kernel, nt) else _no_reads
        launch = ex.extract_kernel(kernel, env=env, grid=grid, name="backward")
        sk = launch.skeleton()
        if sk in seen:
          continue
        seen.add(sk)
        r = xp.check(launch, environment=f"backward d={head_dim} causal={causal} "
                     f"bias={bias} fuse_dq={fuse_dq}; dQ tile blocks [{lb}, {lb + n})")
        states += r.states
        label = BackwardCase(head_dim, causal, bias, fuse_dq)
        if not r.ok:
          return CaseResult(label, 1, envs, len(seen), states, time.perf_counter() - start,
                            r.violation)
  return CaseResult(BackwardCase(head_dim, causal, bias, fuse_dq), 1, envs, len(seen), states,
                    time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class BackwardCase:
  head_dim: int
  causal: bool
  bias: bool
  fuse_dq: bool

  def describe(self) -> str:
    return (f"backward d={self.head_dim}{' causal' if self.causal else ''}"
            f"{' bias' if self.bias else ''} {'fused dQ' if self.fuse_dq else 'dQ kernel'}")


def _has_tables(kernel, num_tiles) -> bool:
  return sum(tuple(v.aval.shape) == (1, 1, num_tiles) and "int" in str(v.aval.dtype)
             for v in kernel.invars) == 4


def _no_reads(buf, idx):
  raise ex.ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which the "
                           f"prover gives no value")


def representative(cases):
  """The cases ``python -m harness prove`` checks by default: every case
  without staged operands, and the staged ones up to two stages (a staged
  bias and mask add slots to the same key phase, checked on the smallest
  rings that wrap; ``python -m harness prove --extracted all`` checks every case)."""
  return [(c, n) for c, n in cases if not (c.bias or c.mask) or c.num_stages <= 2]


def _check_one(item):
  case, configs = item
  return check_case(case, configs)


def run(cases, *, verbose=True, module=None, jobs=1) -> list[CaseResult]:
  if jobs > 1 and module is None:
    import concurrent.futures
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    # costliest first (persistent, deep rings, staged), so the workers finish together
    order = sorted(range(len(cases)), key=lambda i: (
        -cases[i][0].persistent, -cases[i][0].num_stages,
        -(cases[i][0].bias + cases[i][0].mask)))
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
      futures = {i: pool.submit(_check_one, cases[i]) for i in order}
      out = [futures[i].result() for i in range(len(cases))]
  else:
    out = [check_case(case, configs, module=module) for case, configs in cases]
  if verbose:
    for r in out:
      status = "proven" if r.violation is None else "VIOLATION"
      print(f"  {r.case.describe():<58} {status:9s} {r.configs:4d} configs "
            f"{r.checks:3d}/{r.environments:3d} env {r.states:8d} states {r.seconds:6.2f} s",
            flush=True)
      if r.violation is not None:
        print(r.violation.format())
  return out


def report(problems, which: str = "representative", jobs: int = 2) -> bool:
  """Print the extracted proof (forward: the configs emitted for ``problems``;
  backward: every launch kind); True when every case proves.  Run by
  ``python -m harness prove``."""
  start = time.perf_counter()
  cases = forward_cases(problems)
  chosen = cases if which == "all" else representative(cases)
  print(f"forward kernel, protocol extracted from its jaxpr (kernel/forward.py): "
        f"{len(chosen)} of {len(cases)} distinct protocols ({which}), covering "
        f"{sum(n for _, n in chosen)} of {sum(n for _, n in cases)} emitted configs")
  results = run(chosen, jobs=jobs)
  bad = [r for r in results if r.violation is not None]
  print(f"extracted forward protocol: {len(results) - len(bad)}/{len(results)} proven in "
        f"{time.perf_counter() - start:.1f} s ({jobs} worker(s))")
  bstart = time.perf_counter()
  print("backward kernels, protocol extracted from their jaxpr (kernel/backward.py):")
  bres = [check_backward(*c) for c in backward_cases()]
  for r in bres:
    status = "proven" if r.violation is None else "VIOLATION"
    print(f"  {r.case.describe():<58} {status:9s} {r.checks:3d}/{r.environments:3d} env "
          f"{r.states:8d} states {r.seconds:6.2f} s", flush=True)
    if r.violation is not None:
      print(r.violation.format())
  bbad = [r for r in bres if r.violation is not None]
  print(f"extracted backward protocol: {len(bres) - len(bbad)}/{len(bres)} proven in "
        f"{time.perf_counter() - bstart:.1f} s; total {time.perf_counter() - start:.1f} s")
  return not bad and not bbad
