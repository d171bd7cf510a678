"""The barrier and ring protocol read out of the traced kernels, proved.

For each distinct forward protocol the heuristics and the autotuner emit
(:func:`harness.proofs.cases.forward_cases`: stages, persistent, schedule,
staged bias/mask, causal, the output staged in the query slot; block sizes
and head dims do not change the sequence of synchronisation events) and for
every launch kind of ``kernel/backward.py``
(:func:`harness.proofs.cases.backward_cases`), this traces the
kernel on the CPU, reads every role's events out of the jaxpr
(:mod:`harness.proofs.extract`) under *probe* environments, learns each role's
program from them (:mod:`harness.proofs.role_programs`, which states the premise
that makes the proof unbounded and tests it on every probe), has Z3 prove
that premise for the traced kernel (:mod:`harness.proofs.premise`, each
counterexample probed in turn: :func:`_proved`) and checks the program
for every environment (:func:`harness.proofs.search.check`: every number
of tiles, every trip count per tile, zero included, every interleaving).
Launches whose programs are equal up to the names of their buffers and
barriers and their source lines (the staged bias's ring and the staged
mask's: :meth:`harness.proofs.role_programs.LaunchProgram.shape`) share one check.

Probes.  A forward block reads each tile's key range ``[lb, lb + n)`` from
its ``k_range_tiles`` entry, so the probe chooses it (``lb`` alternating,
which the units must not depend on): a non-persistent block runs one tile,
probed for n = 0, 1, 2, 3 and S + M + 3 (M = lcm(S, 2)); a persistent block
(traced with :data:`PROBE_SMS` blocks, the probed ones those whose tiles'
causal bounds leave the most room) walks :func:`probe_tiles` tiles, each
tile's n chosen as the kernel asks for it so as to show head contexts not
yet seen (:class:`_Chooser`).  Then each context the learned tables lack
gets a probe of its own (:func:`_realise`).  The backward's dQ kernel reads
its tile's range the same way; the dK/dV kernels' streams are as long as
the traced shapes make them, so they are traced at two query lengths (and,
causal, every key tile of them, whose streams start further in).

A case whose units break the premise (seen by the probes, or by Z3 and then
by the probe of its counterexample, a longer trace where the environment
needs more key blocks or tiles) is reported with the two probes that
disagree, each checked under its own environment (its trace, if it has a
violation, is the failure shown).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import os
import sys
import time

import numpy as np

from harness.proofs import extract as ex
from harness.proofs import jaxprs
from harness.proofs import search
from harness.proofs import role_programs as rp
from harness.proofs.cases import BackwardCase, ForwardCase
from harness.proofs.events import OPAQUE, ExtractionError
from harness.proofs.violations import Violation
from kernel.masks import Mask

PROBE_SMS = 16        # blocks of the traced persistent grid
PROBED_BLOCKS = 2     # of which this many walk many contexts in a first round

# What proving costs, by phase (name: what ``python -m harness prove`` calls
# it when it prints the run's); each learned case reports its share (:func:`_learn`).
PHASES = {"tracing": "JAX traces", "probes": "probes", "premise": "(P) by Z3",
          "search": "search"}
_SPENT: collections.Counter = collections.Counter()   # this process's CPU seconds, and counts
TRACES = "traces"   # how many JAX traces a learned case made, beside its phases' seconds


@contextlib.contextmanager
def _spending(phase: str):
  start = time.process_time()
  try:
    yield
  finally:
    _SPENT[phase] += time.process_time() - start
    _SPENT[f"{phase} count"] += 1


def _const_values(closed, kernel_eqn) -> dict:
  """gmem input index -> numpy value, for the kernel operands that are
  constants of the traced program (the longest-first schedule tables)."""
  known = {v: np.asarray(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}

  def walk(jaxpr, known):
    for eqn in jaxpr.eqns:
      if eqn is kernel_eqn:
        return {i: known[v] for i, v in enumerate(eqn.invars) if v in known}
      for sub in jaxprs.subjaxprs(eqn.params):
        if len(sub.invars) == len(eqn.invars):
          inner = {iv: known[ov] for iv, ov in zip(sub.invars, eqn.invars)
                   if not isinstance(ov, jaxprs.jex_core.Literal) and ov in known}
          inner.update({v: known[v] for v in sub.constvars if v in known})
        else:
          inner = {}
        found = walk(sub, inner)
        if found is not None:
          return found
    return None

  return walk(closed.jaxpr, known) or {}


def _int_operands(kernel_eqn, consts, shape: tuple) -> list[int]:
  """The kernel's int operands of ``shape`` that are not traced constants."""
  return [i for i, v in enumerate(kernel_eqn.invars)
          if tuple(v.aval.shape) == shape and "int" in str(v.aval.dtype) and i not in consts]


def _int_tables(kernel_eqn, consts, length: int, count: int, what: str) -> dict:
  """{buffer: k} of the ``count`` int (1, 1, ``length``) operands the kernel
  reads (not traced constants), k their order among the operands."""
  tables = _int_operands(kernel_eqn, consts, (1, 1, length))
  if len(tables) != count:
    raise ExtractionError(f"expected the {count} {what} among the kernel's operands, "
                             f"found {len(tables)}")
  return {f"gmem_in{i}": k for k, i in enumerate(tables)}


def _range_tables(kernel_eqn, consts, num_tiles) -> dict:
  """The forward's or the dQ kernel's four k_range_tiles tables."""
  return _int_tables(kernel_eqn, consts, num_tiles, 4, "k_range_tiles tables")


def _reranked_order(kernel_eqn, consts, case: ForwardCase, num_tiles: int) -> dict:
  """{operand: value} for the launch order a non-persistent longest-first
  launch over key ranges computes on the device (``Schedule.reranked``,
  from the ranges the environment decides): the last tile first, as the
  causal static order of the traced launch (one batch, one head) runs them.

  Sound for the protocol: the reranked table is a permutation of the tiles
  whatever the ranges hold (properties/test_schedule.py), and a
  non-persistent block runs the one tile it reads, whose key range the
  environment chooses anyway; the tile's index only bounds that range by
  its causal limit, which the last tile makes the widest.
  """
  if case.persistent or case.schedule != "longest-first":
    return {}
  found = _int_operands(kernel_eqn, consts, (num_tiles,))
  if len(found) != 1:
    raise ExtractionError(f"expected one computed launch order of {num_tiles} tiles "
                             f"among the kernel's operands, found {len(found)}")
  return {found[0]: np.arange(num_tiles - 1, -1, -1, dtype=np.int32)}


class _Env:
  """The integers a kernel reads from global memory: the schedule tables
  from the traced constants, and per tile ``qi`` its key range, which
  ``choose(qi)`` decides as the kernel first asks for it and returns as
  ``(lb, n)`` (lb, n in key blocks: the four k_range_tiles entries
  lb * block_kv, lb * block_kv, (lb + n) * block_kv, (lb + n) * block_kv)."""

  def __init__(self, tables: dict, consts: dict, block_kv: int, choose):
    self.tables, self.block_kv, self.choose = tables, block_kv, choose
    self.consts = {f"gmem_in{i}": v for i, v in consts.items()}
    self.ranges: dict = {}
    self.order: list = []   # tiles in the order first asked for

  def __call__(self, buf, idx):
    if buf in self.consts:
      return int(self.consts[buf][tuple(idx)])
    which = self.tables.get(buf)
    if which is None:
      raise ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which "
                               f"the prover gives no value")
    qi = idx[-1]
    if qi not in self.ranges:
      self.ranges[qi] = self.choose(qi)
      self.order.append(qi)
    lb, n = self.ranges[qi]
    return ((lb, lb, lb + n, lb + n)[which]) * self.block_kv


class _BandEnv:
  """The integers a dK/dV kernel reads: per key tile ``j`` the band of query
  blocks ``[lo, hi)`` it streams (kernel.padding.query_block_ranges), which
  ``choose(j)`` decides; ``tables`` maps each table's buffer to 0 (lo) or
  1 (hi).  Reads of the ``opaque`` buffers (the run of blocks inside every
  row's range, kernel.padding.query_block_inner_bounds) give data the
  protocol must not depend on: the extractor refuses a branch on it that
  holds synchronisation."""

  def __init__(self, tables: dict, choose, opaque=frozenset()):
    self.tables, self.choose, self.opaque = tables, choose, opaque

  def __call__(self, buf, idx):
    if buf in self.opaque:
      return OPAQUE
    which = self.tables.get(buf)
    if which is None:
      raise ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which "
                               f"the prover gives no value")
    return self.choose(idx[-1])[which]


def _band_tables(kernel, consts, num_key_tiles) -> dict:
  """{buffer: 0 (lo) / 1 (hi)} of a dK/dV kernel's two query-block tables."""
  return _int_tables(kernel, consts, num_key_tiles, 2, "query-block tables (lo, hi)")


def _inner_tables(kernel, consts, num_key_tiles) -> frozenset:
  """The buffers of a dK/dV kernel's inner-run table ((1, 1, 2, key tiles) int)."""
  return frozenset(f"gmem_in{i}" for i in _int_operands(kernel, consts, (1, 1, 2, num_key_tiles)))


def _no_reads(buf, idx):
  raise ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which the "
                           f"prover gives no value")


def _ring(stages: int) -> rp.Ring:
  return rp.Ring(stages)


def _probe_trips(ring: rp.Ring) -> int:
  """The longest trip count a one-tile probe walks: every ring class, with
  every lookahead of a key-loop iteration."""
  return ring.classes + rp.AHEAD_CAP


class _Chooser:
  """Trip counts for a persistent probe's tiles, chosen tile by tile within
  each tile's causal bound (``cap(qi)``) so that the probes of one case show
  every head context (ring class, trip count 0 / 1 / 2 or more; tails and
  key-loop iterations follow from them) and a tile long enough for every
  iteration's lookahead, then all of them again at other ring positions.
  ``seen`` (context -> times shown) is shared by the probes of one case."""

  def __init__(self, ring: rp.Ring, cap, first: int, seen: dict, lb: bool = True):
    self.ring, self.cap, self.first, self.seen, self.lb = ring, cap, first, seen, lb
    self.g, self.t = 0, 0
    self.long = ring.classes + rp.AHEAD_CAP

  def wanted(self, want: int):
    """The head contexts (class, min(n, 2)) and "long" shown fewer than ``want`` times."""
    out = {(c, a) for c in range(self.ring.classes) for a in range(rp.N_CAP + 1)
           if self.seen.get((c, a), 0) < want}
    if self.seen.get("long", 0) < want:
      out.add("long")
    return out

  def distance(self, c, targets, cap):
    """Tiles needed from ring class c to a tile that shows a target."""
    frontier, dist = {c}, 0
    seen = set()
    while frontier and dist < 2 * self.ring.classes:
      if "long" in targets or any((x, a) in targets for x in frontier
                                  for a in range(rp.N_CAP + 1)):
        return dist
      seen |= frontier
      frontier = {self.ring.advance(x, n) for x in frontier for n in range(min(cap, 2) + 1)}
      frontier -= seen
      dist += 1
    return 1 << 20

  def __call__(self, qi):
    cap = self.cap(qi)
    c = self.ring.cls(self.g)
    if self.t == 0:
      n = min(self.first, cap)
    else:
      targets = self.wanted(1) or self.wanted(2)
      if "long" in targets and cap >= self.long:
        n = self.long
      else:
        here = [a for a in range(min(cap, rp.N_CAP) + 1) if (c, a) in targets]
        if here:
          n = here[0]
        else:  # towards the nearest class that still has a target
          n = min(range(min(cap, rp.N_CAP) + 1),
                  key=lambda n: (self.distance(self.ring.advance(c, n), targets, cap), -n))
    if self.t >= 1:
      key = (c, min(n, rp.N_CAP))
      self.seen[key] = self.seen.get(key, 0) + 1
      if n >= self.long:
        self.seen["long"] = self.seen.get("long", 0) + 1
    self.g += n
    self.t += 1
    return (self.t % 2 if self.lb else 0, n)


def _kv_blocks(ring: rp.Ring) -> int:
  return max(_probe_trips(ring), ring.classes + rp.AHEAD_CAP) + 2


def trace_case(case: ForwardCase, *, modules=None, kv_blocks=None, tiles=None):
  """The closed jaxpr and kernel eqn of ``case`` traced on the CPU: a
  persistent grid of PROBE_SMS blocks and probe_tiles tiles each, or enough
  query tiles that the probed block's causal bound allows every probe
  (``kv_blocks``, ``tiles``: more key blocks, and more tiles per block,
  for a probe of longer trip counts)."""
  modules = modules or shipped_modules()
  ring = _ring(case.num_stages)
  # effective stages = min(config, key blocks): fewer stages means that few keys
  kv_blocks = case.num_stages if case.ring_cut else max(kv_blocks or 0, _kv_blocks(ring))
  if case.persistent:
    num_tiles = PROBE_SMS * max(tiles or 0, probe_tiles(ring))
  else:
    # enough tiles that the last one's causal bound reaches every key block
    num_tiles = max(_probe_trips(ring) + 1, -(-kv_blocks * case.block_kv // case.tile_q) + 1)
  if case.schedule == "split-tail":
    # Half a wave more: the last one and a half waves are cut into pieces,
    # so every probed block ends its tiles with pieces (SplitTail).
    num_tiles += PROBE_SMS // 2
  config, traced = _traced_problem(case, num_tiles, kv_blocks * case.block_kv)
  with _spending("tracing"):
    closed, kernel = ex.trace_forward(traced, config, num_tiles=num_tiles, kv_blocks=kv_blocks,
                                      head_dim=case.head_dim, head_dim_out=case.head_dim_out,
                                      bias=case.bias, mask=case.mask,
                                      module=modules.forward, num_sms=PROBE_SMS)
  return closed, kernel, traced


def _traced_problem(case: ForwardCase, num_tiles: int, seq_kv, short_q=0):
  """(config, problem) of ``case`` traced with ``num_tiles`` query tiles,
  the last ``short_q`` rows short of whole, and ``seq_kv`` keys, after
  checking that it stages the output where the case does."""
  from kernel.tiling import config as config_lib, plan as plan_lib
  config = config_lib.Config(block_q=case.block_q, block_kv=case.block_kv,
                             num_stages=case.config_stages or case.num_stages,
                             persistent=case.persistent, schedule=case.schedule,
                             compute_warpgroups=case.compute_warpgroups)
  traced = plan_lib.Problem(
      dtype=np.dtype(case.dtype), head_dim=case.head_dim, head_dim_out=case.head_dim_out,
      seq_q=num_tiles * case.tile_q - short_q, seq_kv=seq_kv, is_causal=case.causal,
      bias_2d=case.bias, mask_2d=case.mask, return_residuals=case.residuals,
      untiled_copies=case.untiled_copies, scale=0.125)
  layout = plan_lib.scratch_layout(traced, config)
  if (layout.overlay_q_with_output, layout.output_reaches_keys) != (
          case.overlay_q, case.output_over_keys) or \
          case.output_slots not in (None, plan_lib.output_slots(traced, config)):
    raise ExtractionError(f"{case.describe()}: the traced problem's layout does not "
                             f"stage the output where the case does")
  return config, traced


def trace_plain(case: ForwardCase, *, ragged: bool, modules=None):
  """([kernel eqn], dims) of the kernel a call of ``case``'s config without
  key ranges launches (its key-block count compiled in), traced at every
  length of its queries and keys (:func:`_every_length`)."""
  return _every_length(case, ragged=ragged, key_ranges=False, modules=modules)


def trace_ranged(case: ForwardCase, *, ragged: bool, modules=None):
  """([kernel eqn], dims) of the kernel :func:`trace_case` traces (it reads
  key ranges: a call with lengths, a window or segments), traced at every
  length of its queries and keys (:func:`_every_length`), where the probes'
  trace takes one: whatever the kernel's code decides from the lengths
  (``ragged_kv``, the bound a ragged key length puts on its blocks, a
  persistent round-robin block's count of tiles) is then held to the
  probes' tables at every length."""
  return _every_length(case, ragged=ragged, key_ranges=True, modules=modules)


def _every_length(case: ForwardCase, *, ragged: bool, key_ranges: bool, modules):
  """([kernel eqn], dims): ``case``'s kernel (``key_ranges``: the one that
  reads them) traced with the keys' length a symbolic dimension:
  ``block_kv * m`` keys (``ragged``: and r more, every r from 1 to
  block_kv - 1) for every m that fills the config's ring, so that
  :func:`harness.proofs.symbolic.extract_symbolic` reads a trip count
  compiled from it as a variable (``dims``: its dimension variables'
  bounds, :func:`_symbols`).  A
  ring cut to fewer key blocks than the config's stages (the case's
  ``config_stages``) runs exactly ``num_stages`` blocks: traced at that
  length.  The queries are symbols too, ``tile_q * mq - sq`` of them
  (mq >= 1, persistent mq >= PROBE_SMS, and sq from 0 to tile_q - 1: every
  length, whole or ragged, in mq tiles): causal, the bound cuts the trip
  count at the queries' end, and a persistent block walks as many tiles as
  the grid deals it.  The host's order tables are built from the lengths:
  :func:`_symbolic_schedule` stands in for them."""
  # at least the ring's stages of key blocks, the ragged one counted
  floor = case.num_stages - (1 if ragged else 0)
  dims = {} if case.ring_cut else {"m": floor}
  if ragged:
    dims["r"] = (1, case.block_kv - 1)
  # a persistent grid of PROBE_SMS blocks: at least as many tiles, as
  # the probes' traces have (min(SMs, tiles) is then decided)
  dims["mq"] = PROBE_SMS if case.persistent else 1
  # the last tile's rows short of whole: the kernel never asks whether
  # they are, so one trace takes whole and ragged queries
  dims["sq"] = (0, case.tile_q - 1)
  return _trace_symbolic(case, {**dims, **GRID_COUNTS}, floor, key_ranges=key_ranges,
                         modules=modules)


def _trace_symbolic(case, dims, blocks, *, key_ranges, modules):
  """([kernel eqn], its dimension variables' bounds, :func:`_symbols`):
  ``case`` traced with ``block_kv * m + r`` keys and ``tile_q * mq - sq``
  queries, each of m, r, mq and sq a symbolic length within its bounds in
  ``dims`` where named there (else ``blocks`` key blocks, no ragged keys,
  the ranged traces' tiles, and whole ones)."""
  from jax.experimental import pallas as pl
  modules = modules or shipped_modules()
  ring = _ring(case.num_stages)
  symbols, variables = _symbols(dims)
  blocks = symbols.get("m", blocks)
  num_tiles = symbols.get("mq", PROBE_SMS * probe_tiles(ring) if case.persistent
                          else _probe_trips(ring) + 1)
  # a symbolic grid (the query tiles') is Pallas's experimental export
  with _spending("tracing"), _exact_divisions(), \
          pl.pallas_export_experimental(dynamic_shapes="mq" in dims), \
          _symbolic_schedule(modules, _kv_blocks(ring) * case.block_kv,
                             PROBE_SMS * probe_tiles(ring)), \
          _decided_lengths(case.describe()):
    config, traced = _traced_problem(case, num_tiles,
                                     blocks * case.block_kv + symbols.get("r", 0),
                                     symbols.get("sq", 0))
    _, kernel = ex.trace_forward(traced, config, num_tiles=num_tiles,
                                 kv_blocks=blocks + (1 if "r" in symbols else 0),
                                 head_dim=case.head_dim, head_dim_out=case.head_dim_out,
                                 bias=case.bias, mask=case.mask, key_ranges=key_ranges,
                                 module=modules.forward, num_sms=PROBE_SMS,
                                 **_grid_counts(symbols))
  return [kernel], variables


# The counts of every symbolic trace's grid (the forward's and the
# backward's), symbolic dimensions from these lower bounds (_grid_counts):
# batches, key/value heads, and the group of query heads over each, so
# that a grid index read as a variable (symbolic.grid_index) takes every
# place in a group of every size.  The probes' traces have one of each
# (their events at every other grid point are held to the same tables).
# A count of 1 is left out for batches and key/value heads only:
# kernel/common.py's batch_head reads a dim of 1 at index 0, its only
# index, so the trace at 2 and more stands for it (docs/proof.md, "What is
# assumed").
GRID_COUNTS = {"batches": 2, "kv_heads": 2, "group": 1}


def _grid_counts(symbols: dict) -> dict:
  """trace_forward's batch, heads and kv_heads: the symbols of
  :data:`GRID_COUNTS` where traced, else :data:`GQA_GRID`'s."""
  if "group" not in symbols:
    return GQA_GRID
  return {"batch": symbols["batches"], "kv_heads": symbols["kv_heads"],
          "heads": symbols["kv_heads"] * symbols["group"]}


# Counts where the host needs integers while the trace's are symbolic (the
# split tail's entry table, built at these and read as global-memory
# indices), and the trace's own where GRID_COUNTS is emptied (a test).
GQA_GRID = {"batch": 2, "heads": 8, "kv_heads": 2}


def _symbols(dims: dict) -> tuple[dict, dict]:
  """(values, bounds): per name of ``dims`` (its lower bound, or (lower,
  upper)) a length of jax.export's symbolic dimensions taking every value
  within them, and the bounds of the dimension variables it is made of,
  for :func:`harness.proofs.symbolic.dim_term`.  JAX takes every dimension
  variable to be at least 1, so a length from ``lo`` is the variable plus
  ``lo - 1``: one that may be 0 (no whole key block of a one-stage ring,
  no row short of a whole tile) is traced as such."""
  from jax import export
  names = sorted(dims)
  if not names:
    return {}, {}
  bounds = {n: dims[n] if isinstance(dims[n], tuple) else (dims[n], None) for n in names}
  constraints = tuple(f"{n} <= {hi - lo + 1}" for n, (lo, hi) in bounds.items()
                      if hi is not None)
  variables = export.symbolic_shape(", ".join(names), constraints=constraints)
  values = {n: v + (bounds[n][0] - 1) for n, v in zip(names, variables)}
  return values, {n: 1 if hi is None else (1, hi - lo + 1) for n, (lo, hi) in bounds.items()}


@contextlib.contextmanager
def _exact_divisions():
  """While a kernel is traced with symbolic lengths: a floor division or
  remainder of a length by a constant d is exact wherever the symbols'
  bounds decide it.  JAX divides the terms d divides and leaves the rest
  as floordiv(...) and mod(...), which no comparison decides and no term
  of the proof reads; but the rest's bounds (a ragged remainder r in
  [1, d - 1]) often fix its quotient, and then ``(d*m + r) // d`` is
  ``m`` and ``(d*m + r) % d`` is ``r``, for every length the symbols
  stand for.  Where they do not, JAX's answer stands."""
  from jax._src.export import shape_poly
  cls = shape_poly._DimExpr
  original = cls._divmod

  def divmod_(self, divisor):
    quotient, remainder = original(self, divisor)
    if not (shape_poly.is_symbolic_dim(quotient) or shape_poly.is_symbolic_dim(remainder)) \
            or shape_poly.is_symbolic_dim(divisor) or int(divisor) <= 0:
      return quotient, remainder
    d = int(divisor)
    whole, rest = 0, 0   # self = d * whole + rest
    for term, count in self._sorted_terms:
      if term.is_constant:
        rest += count
      elif count % d == 0:
        whole += cls._from_term(term, count // d, self.scope)
      else:
        rest += cls._from_term(term, count, self.scope)
    if not shape_poly.is_symbolic_dim(rest):
      return quotient, remainder
    lo, hi = shape_poly._bounds_decision(rest, shape_poly.BoundsPrecision.BEST)
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo // d != hi // d:
      return quotient, remainder
    return whole + int(lo // d), rest - d * int(lo // d)

  cls._divmod = divmod_
  try:
    yield
  finally:
    cls._divmod = original


@contextlib.contextmanager
def _decided_lengths(what: str):
  """While a kernel is traced with symbolic lengths: every ``==`` or
  ``!=`` the kernel's own Python code asks of them must hold, or fail,
  for every length the symbols stand for.  JAX answers an equality it
  cannot decide False (its documented shape_poly convention), which
  would trace one branch for all lengths; the trace then fails, naming
  the kernel's line.  Comparisons JAX makes itself (broadcasting's
  ``d == 1``) follow that convention and are not the kernel's branches."""
  import traceback
  from jax._src.export import shape_poly
  import kernel
  kernel_dir = os.path.dirname(os.path.abspath(kernel.__file__)) + os.sep
  line = lambda path, n: f"{os.path.relpath(path, os.path.dirname(kernel_dir[:-1]))}:{n}"
  cls, original = shape_poly._DimExpr, shape_poly._DimExpr.__eq__
  undecided: list = []

  def eq(self, other):
    answer = original(self, other)
    if answer or not (isinstance(other, cls) and self.scope is other.scope
                      or shape_poly.core.is_constant_dim(other)):
      return answer   # decided, or not a length
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == shape_poly.__file__:
      frame = frame.f_back   # __ne__, reflected comparisons
    if frame is None or not os.path.abspath(frame.f_code.co_filename).startswith(kernel_dir):
      return answer
    diff = self - other
    if shape_poly.is_symbolic_dim(diff):
      lo, hi = shape_poly._bounds_decision(diff, shape_poly.BoundsPrecision.BEST)
      if lo <= 0 <= hi:
        undecided.append(f"{line(frame.f_code.co_filename, frame.f_lineno)}: {self} == {other}")
    return answer

  cls.__eq__ = eq
  try:
    yield
  except shape_poly.InconclusiveDimensionOperation as err:
    # JAX refuses an undecided order (<, >=, ...) itself: named the same way
    lines = [line(t.filename, t.lineno) for t in traceback.extract_tb(err.__traceback__)
             if os.path.abspath(t.filename).startswith(kernel_dir)]
    undecided.append(f"{lines[-1] if lines else 'JAX'}: {str(err).splitlines()[0]}")
  finally:
    cls.__eq__ = original
  if undecided:
    raise ExtractionError(
        f"{what}: the kernel compares its symbolic lengths where the answer depends on the "
        f"length, so one trace cannot stand for every length: {undecided[0]}"
        + (f" (and {len(undecided) - 1} more)" if len(undecided) > 1 else ""))


@contextlib.contextmanager
def _symbolic_schedule(modules, seq_kv: int, stand_in_tiles: int):
  """The launch's order tables (kernel/forward/order.py's ``_schedule``)
  while a plain kernel is traced with symbolic lengths, from which the host
  cannot build them.  The proof reads every table the kernel reads from
  memory as free values (harness/proofs/symbolic.py), so only their shapes
  and the order's kind matter: a longest-first order of the traced
  (symbolic) tiles with tables of zeros of the launch's shapes, whose
  tile ids the kernel unpacks by the symbolic tile count; the split
  tail's as the host builds it for ``seq_kv`` keys in ``stand_in_tiles``
  tiles, its tile ids unpacked by the traced (symbolic) count and without
  the merge of its pieces after the kernel (global memory, which the
  proof does not follow); round-robin, none, as on the host.
  properties/test_plain_proof.py holds the shapes to the host's."""
  import jax.numpy as jnp
  from kernel.tiling import schedule as schedule_lib
  scope = modules.forward.flash_attention_forward.__globals__
  host = scope["_schedule"]

  def schedule(f, config, *, batch, num_heads, num_tiles, num_sms, **lengths):
    if config.schedule == "split-tail":
      # at GQA_GRID's counts where the traced ones are symbolic: the table's
      # tile ids are global-memory indices, read as the kernel reads them
      order, tables = host(dataclasses.replace(f, seq_kv=seq_kv), config,
                           batch=batch if isinstance(batch, int) else GQA_GRID["batch"],
                           num_heads=(num_heads if isinstance(num_heads, int)
                                      else GQA_GRID["heads"]),
                           num_tiles=stand_in_tiles, num_sms=num_sms, **lengths)
      # the traced tiles and counts, which the kernel's tile ids unpack by;
      # the merge of pieces after the kernel, which the proof does not
      # read, left out
      return dataclasses.replace(order, num_tiles=num_tiles, batch=batch, num_heads=num_heads,
                                 split=np.zeros(0, np.int32),
                                 piece_slots=np.zeros((0, 0), np.int32)), tables
    if config.schedule != "longest-first":
      return host(f, config, batch=batch, num_heads=num_heads, num_tiles=num_tiles,
                  num_sms=num_sms, **lengths)
    order = schedule_lib.Schedule(batch, num_heads, num_tiles, np.zeros(0, np.int32),
                                  np.zeros(0, np.int64))
    total = batch * num_heads * num_tiles
    if config.persistent:
      return order, (jnp.zeros((num_sms, total), jnp.int32), jnp.zeros((num_sms,), jnp.int32))
    return order, (jnp.zeros((total,), jnp.int32), None)

  scope["_schedule"] = schedule
  try:
    yield
  finally:
    scope["_schedule"] = host


def _split_tail_table(consts: dict, case: ForwardCase):
  """The split tail's entry table (blocks, 4, entries) among the traced
  constants (kernel.schedule.SplitTail.table), or None for other schedules."""
  if case.schedule != "split-tail":
    return None
  found = [v for v in consts.values() if v.ndim == 3 and v.shape[1] == 4]
  if len(found) != 1:
    raise ExtractionError(f"expected the split tail's entry table among the kernel's "
                             f"constant operands, found {len(found)}")
  return found[0]


def probe_tiles(ring: rp.Ring) -> int:
  """Tiles each probed persistent block walks in the first round."""
  return ring.classes + 2


def forward_program(case: ForwardCase, *, modules=None, traced=None,
                    premise: bool = True) -> rp.LaunchProgram:
  """The role programs of ``case``'s blocks, learned from probes: a first
  round that walks many contexts (and several again), then one probe per
  context the learned tables still lack (:meth:`harness.proofs.role_programs.Learner.missing`);
  with ``premise``, then (P) proved by Z3 for the traced kernel
  (:func:`_proved`), each of its counterexamples probed until it holds or
  a probe shows the kernel's events disagree with themselves; then for the
  same kernel at every length of its queries and keys, whole and ragged
  (:func:`trace_ranged`), and for the plain kernels (:func:`trace_plain`)."""
  prober = _ForwardProber(case, modules, traced)
  prog = prober.learn()
  if not premise:
    return prog
  prog = _proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  (prog,) = _lengths_proved([prog], lambda ragged: trace_ranged(case, ragged=ragged,
                                                                modules=prober.modules),
                            RANGED_LENGTHS)
  (prog,) = _plain_proved([prog], lambda ragged: trace_plain(case, ragged=ragged,
                                                             modules=prober.modules))
  return prog


# The lengths at which each case's proof traces its ranged kernel again
# (trace_ranged's ``ragged``), as failures name them.
RANGED_LENGTHS = {"every length of whole key blocks": False, "every ragged length": True}

# The launches of a call without key ranges each case's proof traces
# (trace_plain's ``ragged``; the backward's are backward_pairings'), as failures name them.
PLAIN_KERNELS = {"whole blocks": False, "ragged lengths": True}


def _plain_proved(programs: list, trace, variants=None) -> list:
  """``programs``, the launches that read key ranges, each (P) proved, once
  Z3 proves (P) of the launches a call without key ranges makes
  (``trace(v)`` for each name: v of ``variants``, by default
  :data:`PLAIN_KERNELS`' ``ragged``: their kernels, in the same order, and
  the symbolic dimensions' bounds) against the same tables:
  each unit of theirs, at every trip count and ring position, is the
  table's entry, so their launches are environments of those programs and
  the programs' checks cover them.  A plain launch that synchronises
  otherwise fails, with Z3's position and trip count and both event
  lists."""
  variants = PLAIN_KERNELS if variants is None else variants
  proved = _also_proved(programs, trace, variants, "the launch of a call without key ranges "
                        "({name}) does not synchronise as the one that reads them")
  return [dataclasses.replace(prog, plain=tuple(variants)) for prog in proved]


def _lengths_proved(programs: list, trace, variants: dict) -> list:
  """``programs``, the launches that read key ranges (probed at one length
  each), once Z3 proves (P) of the same launches at the lengths
  ``trace(v)`` gives for each ``variants`` name: v, against the same
  tables; their ``lengths`` name them."""
  proved = _also_proved(programs, trace, variants, "the launch that reads key ranges, at "
                        "{name}, does not synchronise as its probes showed")
  return [dataclasses.replace(prog, lengths=tuple(variants)) for prog in proved]


def _also_proved(programs: list, trace, variants: dict, what: str) -> list:
  """``programs`` with Z3's proof of (P) extended to the launches
  ``trace(v)`` gives for each ``variants`` name: v, held to the same
  tables (``what``: a failure's words, with the variant's {name})."""
  from harness.proofs import premise, symbolic
  stats = [premise.Stats.of(prog.z3) for prog in programs]
  for name, variant in variants.items():
    kernels, dims = trace(variant)
    if len(kernels) != len(programs):
      raise ExtractionError(f"{programs[0].name} ({name}): {len(kernels)} launches "
                               f"traced, {len(programs)} learned")
    for prog, kernel, st in zip(programs, kernels, stats):
      try:
        with _spending("premise"):
          st.add(premise.prove(prog, symbolic.extract_symbolic(kernel, dims)))
      except premise.PremiseFailure as f:
        raise rp.PremiseError(f"{what.format(name=name)}: {f}") from None
  return [dataclasses.replace(prog, z3=st.summary()) for prog, st in zip(programs, stats)]


MAX_COUNTEREXAMPLES = 8   # probes of Z3's counterexamples before a failure is final


def _proved(learner, kernels, learn, realise) -> rp.LaunchProgram:
  """The program ``learn()`` gives once Z3 proves (P) for it on each traced
  kernel (:mod:`harness.proofs.premise`).  Each counterexample Z3 finds is
  probed (``realise(context)``) and the program learned again: a table
  that generalised too far from its probes gets the probe it lacked, and a
  kernel whose events disagree with themselves fails with the probes that
  disagree (:class:`harness.proofs.role_programs.PremiseError`, which the
  caller checks one by one for a trace)."""
  from harness.proofs import premise, symbolic
  tried: set = set()
  found: list = []   # Z3's counterexamples so far, each probed in turn
  prog = learn()
  while True:
    stats = premise.Stats()
    try:
      with _spending("premise"):
        for kernel in kernels:
          stats.add(premise.prove(prog, symbolic.extract_symbolic(kernel)))
      return dataclasses.replace(prog, z3=stats.summary())
    except premise.PremiseFailure as f:
      ctx = f.context
      found.append(str(f))
      so_far = "\n".join(found)
      key = tuple(ctx.get(k) for k in ("role", "kind", "t", "G", "n", "j", "GT"))
      if "n" not in ctx or key in tried or len(tried) >= MAX_COUNTEREXAMPLES:
        raise rp.PremiseError(so_far, learner.seen[-1:] if key in tried else []) from None
      tried.add(key)
      try:
        realise(ctx)
      except ExtractionError as err:
        raise rp.PremiseError(f"{so_far}\n  no probe could show that environment: {err}") from None
      try:
        prog = learn()
      except rp.PremiseError as err:
        raise rp.PremiseError(f"{so_far}\n  probed there: {err}", err.probes) from None


class _ForwardProber:
  """The probes of one forward case: its trace, its learner, and a probe of
  any trip counts (retracing a longer problem where the trace is too short
  for them)."""

  def __init__(self, case: ForwardCase, modules, traced):
    self.case, self.modules = case, modules or shipped_modules()
    self.ring = _ring(case.num_stages)
    # A config with more stages than key blocks runs with as many stages as
    # blocks: its problems have no more key blocks than that.
    self.few = case.ring_cut
    self.learner = rp.Learner(f"forward {case.describe()}", self.ring,
                              persistent=case.persistent,
                              max_blocks=case.num_stages if self.few else None)
    self._use(traced or trace_case(case, modules=self.modules))
    # blocks whose tiles' causal bounds are the widest
    self.wide = [PROBE_SMS - 1 - k if case.schedule == "round-robin" else k
                 for k in range(PROBED_BLOCKS)]
    case, ring = self.case, self.ring
    if case.persistent:
      seen: dict = {}
      for k, first in enumerate((0, 2)):
        self.probe(_Chooser(ring, self.cap, first=first, seen=seen, lb=not self.few),
                   self.wide[k])
    else:
      for n in sorted({0, 1, 2, 3, _probe_trips(ring)}):
        if not self.few or n <= case.num_stages:
          self.planned([n])

  def _use(self, traced):
    case = self.case
    self.closed, self.kernel, self.problem = traced
    self.consts = _const_values(self.closed, self.kernel)
    self.num_tiles = self.problem.seq_q // case.tile_q
    self.tables = _range_tables(self.kernel, self.consts, self.num_tiles)
    self.consts.update(_reranked_order(self.kernel, self.consts, case, self.num_tiles))
    self.split = _split_tail_table(self.consts, case)

  def actual(self, qi, lb, n):
    """The key blocks the kernel visits for a requested range (the causal
    bound may cut it), by the kernel's own rule."""
    case, f, bkv = self.case, self.problem, self.case.block_kv
    lo, hi = f.mask.key_blocks(qi, tile_q=case.tile_q, block_kv=bkv,
                               k_start_min=lb * bkv, k_end_max=(lb + n) * bkv)
    return lo, hi - lo

  def cap(self, qi):
    return self.actual(qi, 0 if self.few else 1, 1 << 20)[1]

  def cut(self, sm, entry, lo, n):
    """A split tail's piece visits its tile's blocks inside [lo, hi) of its
    entry only, by the kernel's rule (kernel.common.piece_block_range)."""
    if self.split is None:
      return lo, n
    first, end = self.modules.common.piece_block_range(lo, lo + n, int(self.split[sm, 1, entry]),
                                               int(self.split[sm, 2, entry]))
    return first, end - first

  def probe(self, choose, sm=None):
    case = self.case
    grid0 = {"batch": 0, "heads": 0, "q_tiles": 0, "tiles": 0, "sm": 0}
    env = _Env(self.tables, self.consts, case.block_kv, choose)
    if case.persistent:
      launch = ex.extract_kernel(self.kernel, env=env, grid={**grid0, "sm": sm},
                                 name=f"forward block {sm}")
    else:
      # the last query tile: its causal bound the widest (the longest-first
      # order's grid point 0 runs its heaviest tile)
      launch = ex.extract_kernel(self.kernel, env=env,
                                 grid={**grid0, "q_tiles": self.num_tiles - 1},
                                 name="forward block")
    trips = []
    for entry, qi in enumerate(env.order):
      lb, n = env.ranges[qi]
      lo, m = self.actual(qi, lb, n)
      if self.few and m < n:
        raise ExtractionError(f"tile {qi}: {n} key blocks asked of a problem with fewer")
      if (lo, m) != (lb, n):
        raise ExtractionError(f"tile {qi}: asked for key blocks [{lb}, {lb + n}), the "
                                 f"kernel visits [{lo}, {lo + m})")
      trips.append(self.cut(sm, entry, lo, m)[1])
    self.learner.observe(launch, trips, where=("block " + str(sm) + ", tiles"
                                               if case.persistent else "one tile")
                         + f" of {trips} key blocks")
    return trips

  def planned(self, trips, sm=None):
    order = []

    def choose(qi):
      t = len(order)
      order.append(qi)
      n = trips[t] if t < len(trips) else 0
      return (t % 2 if self.actual(qi, 1, n)[1] == n else 0, n)
    return self.probe(choose, sm)

  def learn(self) -> rp.LaunchProgram:
    """The program of the probes so far, after a probe of every context the
    search may ask for and the tables lack."""
    learner = self.learner
    for _ in range(4):
      prog = learner.program()
      missing = learner.missing(prog)
      if not missing:
        return prog
      done = set()
      for role, kind, ctx in missing:
        trips = _realise(self.ring, kind, ctx, persistent=self.case.persistent)
        if trips not in done:
          done.add(trips)
          self.planned(list(trips), self.wide[0])
    raise rp.CoverageError(f"{learner.name}: probes do not cover {missing[:3]}")

  def realise(self, ctx: dict):
    """A probe of the environment of a counterexample of (P): a tile of
    ctx["n"] key blocks from ring position ctx["G"] (and, persistent, after
    ctx["t"] >= 1 earlier tiles), or ctx["GT"] blocks in all before the
    events after the tile loop; traced anew, longer, where this trace is
    too short for it."""
    case = self.case
    n, g = ctx.get("n", 0), ctx.get("G", 0)
    if ctx.get("kind") == "post":
      n, g = 0, ctx.get("GT", 0)
    if not case.persistent:
      if (n + 2 > self.problem.seq_kv // case.block_kv
              or self.actual(self.num_tiles - 1, 1, n)[1] != n):
        self._retrace(n + 3, None)
      return self.planned([n])
    later = ctx.get("t", 0) >= 1 or g > 0
    for _ in range(2):
      chooser = _Realiser(g, n, self.cap, later)
      try:
        self.probe(chooser, self.wide[0])
      except ExtractionError:
        chooser.placed = False
      if chooser.placed:
        return
      # a tile long enough for n, and enough tiles for G even one block each
      self._retrace(max(n, 2) + 3, g + 4)
    raise ExtractionError(f"no probe of {self.learner.name} reaches ring position {g} "
                             f"with a tile of {n} key blocks")

  def _retrace(self, kv_blocks, tiles):
    self._use(trace_case(self.case, modules=self.modules,
                         kv_blocks=max(kv_blocks, self.problem.seq_kv // self.case.block_kv),
                         tiles=tiles))


class _Realiser:
  """The trip counts of a persistent probe that reaches ring position ``g``
  (after at least one tile where ``later``), each tile taking as many of
  the blocks left as its causal bound allows, then a tile of ``n``
  blocks, then empty tiles."""

  def __init__(self, g, n, cap, later):
    self.left, self.n, self.cap, self.later = g, n, cap, later
    self.t, self.placed = 0, False

  def __call__(self, qi):
    cap = self.cap(qi)
    self.t += 1
    if self.placed:
      return (0, 0)
    if self.left > 0 or (self.later and self.t == 1):
      take = min(self.left, cap)
      self.left -= take
      return (0, take)
    if self.n <= cap:
      self.placed = True
      return (0, self.n)
    return (0, 0)   # this tile is too short for the one wanted: the next


def _realise(ring: rp.Ring, kind: str, ctx: dict, *, persistent: bool) -> tuple:
  """Trip counts of a block's tiles that show a unit of ``kind`` in ``ctx``."""
  c = ctx["cls"]
  if persistent:
    if kind == "head":
      return (ctx["n"],) if not ctx["later"] else (c, ctx["n"])
    if kind == "iter":
      return (c, ctx["ahead"])
    if kind == "tail":
      return (c - ctx["n"], ctx["n"])
    return (c,)
  if kind == "head":
    return (ctx["n"],)
  if kind == "iter":
    return (c + ctx["ahead"],)
  return (c,)


# -- backward -------------------------------------------------------------------

def trace_backward(head_dim, *, causal, bias, fuse_dq, seq_q, seq_kv, ranges=True,
                   modules=None, fixed_point=False, unpadded=False, batch=1, heads=1,
                   kv_heads=1):
  """The closed jaxpr of ``kernel.backward.attention_backward`` traced on the
  CPU, and its Mosaic GPU kernels in launch order (``unpadded``: q, k, v
  and dO read unpadded where the forward reads them so; ``batch``,
  ``heads``, ``kv_heads``: its grid, :data:`GQA_GRID` in the symbolic
  traces)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  from kernel.tiling import backward_plan, plan as plan_lib
  from kernel.tiling.heuristics import get_backward_config
  modules = modules or shipped_modules()
  sds = jax.ShapeDtypeStruct
  q = sds((batch, seq_q, heads, head_dim), jnp.bfloat16)
  k = sds((batch, seq_kv, kv_heads, head_dim), jnp.bfloat16)
  rows = sds((batch, heads, seq_q), jnp.float32)
  b = sds((batch, heads, seq_q, seq_kv), jnp.bfloat16) if bias else None
  kr = sds((batch, heads, seq_q), jnp.int32) if ranges else None

  problem = plan_lib.Problem(np.dtype("bfloat16"), head_dim, head_dim, seq_q, seq_kv,
                             is_causal=causal, scale=0.125, deterministic=fixed_point)
  dims = backward_plan.computed_head_dims(head_dim, head_dim)
  backward = backward_plan.Backward("pallas", dims, get_backward_config(
      *dims, causal=causal, fuse_dq=fuse_dq, whole_tiles=not unpadded))

  def fn(q, k, v, b, ks, ke, o, m, l, do):
    return modules.backward.attention_backward(problem, backward, q, k, v, b, None, ks, ke, o,
                                               m, l, do)

  with api.lowering_only(), _spending("tracing"):
    closed = jax.make_jaxpr(fn)(q, k, k, b, kr, kr, q, rows, rows, q)
  return closed, jaxprs.find_kernels(closed.jaxpr)


def _stream_length(launch, role="wg2.warp0") -> int:
  """A stream's length as its producer runs it: the iterations of its loop."""
  return len({lp[0] for lp in launch.loops.get(role, ()) if lp})


def _tables_of(kernel, consts):
  """(the four k_range_tiles tables, tiles) of a kernel that reads them, else None."""
  for v in kernel.invars:
    shape = tuple(v.aval.shape)
    if len(shape) == 3 and shape[:2] == (1, 1) and "int" in str(v.aval.dtype):
      try:
        return _range_tables(kernel, consts, shape[2]), shape[2]
      except ExtractionError:
        continue
  return None


def _last_tile_point(kernel, tables, consts, blocks, grid, num_tiles) -> int:
  """The dQ kernel's grid point whose block reads the last query tile's
  range (the one whose causal bound leaves room for the longest stream): the
  grid's last point, or its first where the kernel walks its tiles heaviest
  first (under causal: kernel.backward._dq_kernel)."""
  for at in (num_tiles - 1, 0):
    env = _Env(tables, consts, blocks.dq_stream_kv, lambda qi: (0, 0))
    ex.extract_kernel(kernel, env=env, grid={**grid, "q_tiles": at}, name="dq")
    if env.order == [num_tiles - 1]:
      return at
  raise ExtractionError(f"no dQ grid point of {num_tiles} reads the last tile's key range")


def backward_stages(case: BackwardCase, *, modules=None) -> list[int]:
  """The ring depth of each launch of one backward, in launch order, from
  the mbarrier plans kernel.backward.launches gives (its "consumed"
  barriers, one per slot): the launches of one backward may differ."""
  modules = modules or shipped_modules()
  plans = modules.backward_plan.launches(case.head_dim, case.head_dim, with_bias=case.bias,
                          causal=case.causal, fuse_dq=case.fuse_dq)
  return [next(b.num_barriers for b in plan if b.name == "consumed") for _, plan in plans]


def backward_programs(case: BackwardCase, *, modules=None,
                      premise: bool = True) -> list[rp.LaunchProgram]:
  """The role programs of every launch of one backward, learned from probes.

  The dK/dV kernels stream the query blocks (``blocks.dkv_stream_q`` rows,
  as kernel.backward.blocks_for chooses them) of the band their
  key tile reads from its tables, under causal from key tile j's first key
  on: with the whole length as band, one causal trace shows streams of
  every even length from its longest down to 0 (non-causal: a long trace
  and the shortest, one block of queries); then key tile 0 of the
  long trace is probed with bands of n = 0, 1, 2, 3 and S + M + 3 blocks,
  and each context the learned tables still lack.  The dQ kernel's tile
  reads its key range from the tables: probed at the long trace's last tile
  for the same n, then for each missing context likewise.  With
  ``premise``, (P) is then proved by Z3 on every traced kernel of each
  launch (:func:`_proved`)."""
  modules = modules or shipped_modules()
  blocks = modules.backward_plan.blocks_for(case.head_dim, case.head_dim, causal=case.causal)
  rings = [_ring(s) for s in backward_stages(case, modules=modules)]
  long = max(_probe_trips(r) for r in rings)
  tile = blocks.dq_tile
  # the dQ kernel's last tile bounds its causal range at 2 * (tiles) blocks
  seq_long = tile * max(-(-long * blocks.dkv_stream_q // tile), -(-long // 2) + 1)
  seq_kv = -(-(long + 2) * blocks.dq_stream_kv // blocks.dkv_tile) * blocks.dkv_tile
  shapes = (seq_long,) if case.causal else (seq_long, blocks.dkv_stream_q)
  learners: list = []
  probes: dict = {}     # id(learner) -> probe(n), for launches that read their range
  traced: dict = {}     # id(learner) -> its kernel at every traced length
  for seq_q in shapes:
    closed, kernels = trace_backward(case.head_dim, causal=case.causal, bias=case.bias,
                                     fuse_dq=case.fuse_dq, seq_q=seq_q, seq_kv=seq_kv,
                                     modules=modules, fixed_point=case.fixed_point,
                                     unpadded=case.unpadded)
    if not learners:
      if len(rings) != len(kernels):
        raise ExtractionError(f"{case.describe()}: {len(kernels)} launches traced, "
                                 f"kernel.backward.launches names {len(rings)}")
      learners = [rp.Learner(f"{case.describe()}, launch {i + 1} of {len(kernels)}", ring,
                             persistent=False) for i, ring in enumerate(rings)]
    elif len(learners) != len(kernels):
      raise ExtractionError(f"{case.describe()}: {len(kernels)} launches at one length, "
                               f"{len(learners)} at another")
    grid = {"batch": 0, "heads": 0, "q_tiles": 0, "kv_tiles": 0, "kv_heads": 0}
    for learner, kernel in zip(learners, kernels):
      traced.setdefault(id(learner), []).append(kernel)
      consts = _const_values(closed, kernel)
      found = _tables_of(kernel, consts)
      if found is not None:
        if seq_q != seq_long:
          continue  # the dQ kernel's stream is its table's: probed at one length
        tables, num_tiles = found
        learner.name = learner.name.replace("launch", "dQ kernel, launch")
        at = _last_tile_point(kernel, tables, consts, blocks, grid, num_tiles)

        def probe(n, learner=learner, kernel=kernel, tables=tables, consts=consts,
                  num_tiles=num_tiles, seq_q=seq_q, at=at):
          lb = n % 2
          env = _Env(tables, consts, blocks.dq_stream_kv, lambda qi: (lb, n))
          launch = ex.extract_kernel(kernel, env=env, grid={**grid, "q_tiles": at},
                                     name="dq")
          (qi,) = env.order
          lo, hi = Mask(seq_q, seq_kv, causal=case.causal).key_blocks(
              qi, tile_q=blocks.dq_tile, block_kv=blocks.dq_stream_kv,
              k_start_min=lb * blocks.dq_stream_kv, k_end_max=(lb + n) * blocks.dq_stream_kv)
          learner.observe(launch, [hi - lo], where=f"the dQ tile's key blocks [{lo}, {hi})")

        probes[id(learner)] = probe
        for n in sorted({0, 1, 2, 3, long}):
          probe(n)
      else:
        kv_tiles = -(-seq_kv // blocks.dkv_tile)
        nq = seq_q // blocks.dkv_stream_q
        bands = _band_tables(kernel, consts, kv_tiles)
        inner = _inner_tables(kernel, consts, kv_tiles)
        for j in range(kv_tiles) if case.causal else (0,):
          launch = ex.extract_kernel(kernel, env=_BandEnv(bands, lambda j: (0, nq), inner),
                                     grid={**grid, "kv_tiles": j}, name="dkv")
          n = _stream_length(launch)
          learner.observe(launch, [n], where=f"key tile {j} of {seq_q} queries ({n} blocks)")
        if seq_q != seq_long:
          continue

        def band_probe(n, learner=learner, kernel=kernel, bands=bands, nq=nq, inner=inner):
          lb = n % 2 if n + 1 <= nq else 0
          launch = ex.extract_kernel(kernel, env=_BandEnv(bands, lambda j: (lb, lb + n), inner),
                                     grid={**grid, "kv_tiles": 0}, name="dkv")
          got = _stream_length(launch)
          if got != n:
            raise ExtractionError(f"{learner.name}: key tile 0 given the query blocks "
                                     f"[{lb}, {lb + n}) streams {got}")
          learner.observe(launch, [n], where=f"key tile 0, query blocks [{lb}, {lb + n})")

        probes[id(learner)] = band_probe
        for n in sorted({0, 1, 2, 3, long}):
          band_probe(n)
  programs = []
  for learner in learners:
    lengths = [t for _, trips, _ in learner.seen for t in trips]
    learner.min_blocks = min(lengths)   # no shorter stream exists
    probe = probes.get(id(learner))

    def learn(learner=learner, probe=probe):
      prog = learner.program()
      for _ in range(4):
        missing = learner.missing(prog) if probe else []
        if not missing:
          break
        for n in sorted({_realise(learner.ring, kind, ctx, persistent=False)[0]
                         for _, kind, ctx in missing}):
          probe(n)
        prog = learner.program()
      return prog

    def realise(ctx, probe=probe):
      if probe is None:
        raise ExtractionError("this launch streams as many blocks as its traced shapes "
                                 "make it, so no probe chooses its trip count")
      probe(ctx["n"])

    programs.append(_proved(learner, traced[id(learner)], learn, realise) if premise
                    else learn())
  if not premise:
    return programs
  lengths = backward_pairings(case, modules=modules)
  programs = _lengths_proved(
      programs, lambda v: trace_backward_at(case, *v, modules=modules, ranges=True), lengths)
  return _plain_proved(programs, lambda v: trace_backward_at(case, *v, modules=modules),
                       lengths)


def backward_pairings(case: BackwardCase, *, modules=None) -> dict:
  """The lengths at which each case's proof traces the backward's launches,
  with key ranges and without, by name: (queries' remainder, keys'
  remainder, sectioned) for :func:`trace_backward_at`, every pair of the
  queries' and the keys' :func:`remainders` (whole lengths, and every
  ragged one), causal head by head and in L2 sections."""
  (whole_q, in_q), (whole_k, in_k) = _backward_lengths(case, modules or shipped_modules())
  queries, keys = remainders(whole_q, in_q), remainders(whole_k, in_k)
  pairs = [(rq, rk) for rq in queries for rk in keys]
  if case.unpadded:
    # Read unpadded, a length that is a multiple of 8 is copied by neither
    # pass, any other as shipped: each length is one past whole tiles in
    # eights (Eights) or one of the ragged ones, which no trace's range
    # then mixes; the pairs of two ragged ones are the shipped backward's.
    pieces = lambda whole, by: [Eights(r, tail) for tail in (False, True)
                                for r in remainders(whole // 8, [d // 8 for d in by])]
    pairs = [(rq, rk) for rq in pieces(whole_q, in_q) for rk in pieces(whole_k, in_k)
             if not (rq.tail and rk.tail)]
  out = {}
  for sectioned in (False, True) if case.causal else (False,):
    for rq, rk in pairs:
      name = f"queries {_past(rq)}, keys {_past(rk)}"
      out[name + (", in L2 sections" if sectioned else "")] = (rq, rk, sectioned)
  return out


@dataclasses.dataclass(frozen=True)
class Eights:
  """A length past whole tiles, for a backward read unpadded: 8 times
  ``units`` (0, a number, or (lo, hi): a symbol for each number from lo
  to hi), and with ``tail`` 1 to 7 more (a symbol), a length no multiple
  of 8."""
  units: int | tuple
  tail: bool = False


def _backward_lengths(case: BackwardCase, modules) -> tuple:
  """((whole, divisors) of the queries, of the keys): the tiles and blocks
  the backward's launches divide each length by, and their least common
  multiple, the whole lengths its plain traces take."""
  import math
  b = modules.backward_plan.blocks_for(case.head_dim, case.head_dim, causal=case.causal)
  return tuple((math.lcm(*by), by) for by in ((b.dq_tile, b.dkv_stream_q),
                                              (b.dkv_tile, b.dq_stream_kv)))


def remainders(whole: int, divisors) -> list:
  """The lengths past a whole multiple of ``whole`` a plain trace takes,
  together every one from 0 to whole - 1: 0; each multiple of a divisor
  below ``whole``; and between them each range (lo, hi), over which every
  divisor divides the length to the same quotient (:func:`_exact_divisions`),
  so that one trace stands for every length of the range."""
  cuts = sorted({k for d in divisors for k in range(d, whole, d)})
  out, lo = [0], 1
  for cut in cuts + [whole]:
    if lo < cut:
      out.append((lo, cut - 1) if lo < cut - 1 else lo)
    if cut < whole:
      out.append(cut)
    lo = cut + 1
  return out


def _past(rem) -> str:
  if isinstance(rem, Eights):
    u = rem.units
    eights = (f"{8 * u}" if isinstance(u, int) else f"{8 * u[0]} to {8 * u[1]}")
    return (f"{eights} and 1 to 7 past whole" if rem.tail else
            "whole" if u == 0 else f"{eights} past whole (multiples of 8)")
  if rem == 0:
    return "whole"
  return f"{rem} past whole" if isinstance(rem, int) else f"{rem[0]} to {rem[1]} past whole"


def trace_backward_at(case: BackwardCase, rem_q=0, rem_k=0, sectioned: bool = False, *,
                         modules=None, ranges: bool = False):
  """(kernels, their dimension variables' bounds) of the backward a call
  without key ranges launches (each launch's trip counts compiled in;
  ``ranges``: the one a call with them launches), traced with the queries' and
  the keys' lengths symbolic dimensions: whole multiples of every tile
  and block of the launches (``mq``, ``mk`` >= 1) and ``rem_q``, ``rem_k``
  more (:func:`remainders`: 0, a number, or (lo, hi), a symbol, ``rq`` or
  ``rk``, for every number from lo to hi).  A causal launch
  order is built on the host from the lengths: the trace takes it head by
  head or, ``sectioned``, in L2 sections (:func:`_launch_orders`)."""
  from jax.experimental import pallas as pl
  modules = modules or shipped_modules()
  (whole_q, _), (whole_k, _) = _backward_lengths(case, modules)
  # each remainder as (rows per unit, units, a tail of 1 to 7 rows)
  rems = {n: (8, r.units, r.tail) if isinstance(r, Eights) else (1, r, False)
          for n, r in (("rq", rem_q), ("rk", rem_k))}
  dims = {"mq": 1, "mk": 1, **GRID_COUNTS}
  dims.update({n: units for n, (_, units, _) in rems.items() if isinstance(units, tuple)})
  dims.update({"t" + n[1]: (1, 7) for n, (_, _, tail) in rems.items() if tail})
  symbols, variables = _symbols(dims)
  for n, (step, units, _) in rems.items():
    symbols[n] = step * symbols.get(n, units) + symbols.get("t" + n[1], 0)
  with _exact_divisions(), pl.pallas_export_experimental(dynamic_shapes=True), \
          _launch_orders(modules, sectioned), _decided_lengths(case.describe()):
    _, kernels = trace_backward(
        case.head_dim, causal=case.causal, bias=case.bias, fuse_dq=case.fuse_dq,
        seq_q=whole_q * symbols["mq"] + symbols["rq"],
        seq_kv=whole_k * symbols["mk"] + symbols["rk"], ranges=ranges,
        modules=modules, fixed_point=case.fixed_point, unpadded=case.unpadded,
        **_grid_counts(symbols))
  return kernels, variables


@contextlib.contextmanager
def _launch_orders(modules, sectioned: bool):
  """The backward's causal launch orders (kernel/backward/dkv.py's
  ``dkv_launch_order``, dq.py's ``dq_launch_order``: L2 sections the host
  sizes from the lengths, or head by head where sections do not repay)
  while a plain backward is traced with symbolic lengths: head by head
  (None), or ``sectioned``, the traced batch's and heads' units in one
  section of the symbolic tiles (the only sections one unit has); not
  causal, head by head, as on the host."""
  from kernel.tiling import schedule as schedule_lib
  scope = modules.backward.attention_backward.__globals__
  dkv_scope, dq_scope = scope["dkv_call"].__globals__, scope["dq_call"].__globals__
  hosts = dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"]

  def order(f, units, tiles):
    if not (f.is_causal and sectioned):
      return None
    return schedule_lib.LaunchOrder(units, tiles, (units,))

  def dkv(f, blocks, *, batch, num_kv_heads, s_pad, **_):
    return order(f, num_kv_heads * batch, s_pad // blocks.dkv_tile)

  def dq(f, blocks, *, batch, num_heads, t_pad, **_):
    return order(f, batch * num_heads, t_pad // blocks.dq_tile)

  dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"] = dkv, dq
  try:
    yield
  finally:
    dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"] = hosts


# -- running -----------------------------------------------------------------


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
  lengths: int = 0                 # its launch programs Z3 proved at every length (trace_ranged)

  @property
  def ok(self) -> bool:
    return self.violation is None and self.premise is None

  @property
  def premise_proved(self) -> bool:
    """Whether Z3 proved (P) for every launch program it covers."""
    return bool(self.z3) and all(self.z3)


_MUTANTS: dict = {}   # mutant name -> its kernel modules, per process


def shipped_modules():
  """The shipped kernel modules the proof traces, as
  harness.proofs.protocol_mutants.modules gives a mutant's."""
  import types
  from kernel import backward, common, forward
  from kernel.tiling import backward_plan
  return types.SimpleNamespace(forward=forward, backward=backward, common=common,
                               backward_plan=backward_plan)


def _modules(mutant):
  """The kernel modules to trace: the shipped ones, or ``mutant``'s edit of
  one of them (harness/proofs/protocol_mutants.py)."""
  if mutant is None:
    return shipped_modules()
  if mutant not in _MUTANTS:
    from harness.proofs import protocol_mutants
    _MUTANTS[mutant] = protocol_mutants.modules(mutant)
  return _MUTANTS[mutant]


def _programs_of(item):
  """((kind, case), mutant[, premise]) -> ([(name, LaunchProgram)], premise
  failure or None, seconds, CPU seconds by phase of :data:`PHASES`);
  ``premise`` False: (P) tested by the probes alone, not proved (the path
  before Z3 proved it, for comparison)."""
  (kind, case), mutant, *rest = item
  with search.collector_paused():
    return _learn(kind, case, mutant, premise=rest[0] if rest else True)


def _learn(kind, case, mutant, premise=True):
  start, cpu, before = time.perf_counter(), time.process_time(), _SPENT.copy()
  progs, failure = _learn_programs(kind, case, mutant, premise)
  for _, prog in progs:
    if prog is not None:
      prog.shape_digest()   # made here, on the worker, and carried by the pickle
  spent = {phase: _SPENT[phase] - before[phase] for phase in ("tracing", "premise")}
  # the rest of learning: the probes' concrete runs and the tables made of them
  spent["probes"] = time.process_time() - cpu - sum(spent.values())
  spent[TRACES] = _SPENT["tracing count"] - before["tracing count"]
  return progs, failure, time.perf_counter() - start, spent


def _learn_programs(kind, case, mutant, premise):
  modules = _modules(mutant)
  try:
    if kind == "forward":
      progs = [(case.describe(), forward_program(case, modules=modules, premise=premise))]
    else:
      progs = [(p.name, p) for p in backward_programs(case, modules=modules,
                                                      premise=premise)]
    return progs, None
  except rp.PremiseError as err:
    if kind == "forward":
      stages, persistent = case.num_stages, case.persistent
    else:
      # the deepest ring of the case's launches (the probes name no launch)
      stages, persistent = max(backward_stages(case, modules=modules)), False
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


def _check(prog):
  return search.check(prog)


def prove(items, *, jobs: int = 2, mutant: str | None = None, fail_fast: bool = False,
          pool=None, cache=None, early=(), premise: bool = True,
          spent: collections.Counter | None = None, on_failure=None) -> list[Result]:
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
  CPU seconds, by phase of :data:`PHASES`, of the work done (what the cache
  gave cost nothing).  ``on_failure(text)``: called with a line as soon as a
  case's premise fails or a check finds a violation, before the run ends."""
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
      new = _collect([w], [learned], configs, distinct)
      results += new
      for prog, result in list(distinct.values()):
        if result in new:
          _record(result, _searched(search.check(prog), spent))
      if any(not r.ok for r in new):
        break
    return results
  if pool is not None:
    return _prove_pooled(pool, jobs, items, early, mutant, cache, premise, spent, on_failure)
  if jobs > 1:
    with workers(jobs) as pool:
      return _prove_pooled(pool, jobs, items, early, mutant, cache, premise, spent, on_failure)
  learned = []
  for w in work:
    learned.append(_learned(w, mutant, cache, premise, spent))
    _report_premise(w, learned[-1], on_failure)
  results = _collect(work, learned, configs, distinct)
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
                  on_failure) -> list[Result]:
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
  results = _collect(work, [learned[w] for w in work], configs, final)
  for key, (prog, result) in final.items():
    _record(result, checked[key])
  return results


def _record(result, res):
  result.states, result.seconds = res.states, result.seconds + res.seconds
  result.violation = res.violation


def _collect(work, learned, configs, distinct) -> list[Result]:
  """Group the learned programs by shape (equal up to the names of buffers
  and barriers: :meth:`harness.proofs.role_programs.LaunchProgram.shape`); a case
  whose premise failed gets its own results (its probes' programs), marked
  with the failure."""
  results = []
  for (kind, case), (progs, premise, seconds, _) in zip(work, learned):
    for i, (name, prog) in enumerate(progs):
      if prog is None:   # the premise failed with no program to check (_learn)
        results.append(Result(name, [case.describe() if kind == "forward" else name],
                              configs.get(id(case), 0), seconds=seconds, premise=premise))
        continue
      key = prog.shape_digest()
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
