"""Tracing the forward kernel on the CPU for the proof: at the probes' one
length (:func:`trace_case`), and at every length of its queries and keys,
each a symbolic dimension, the one that reads key ranges
(:func:`trace_ranged`) and the one a call without them launches
(:func:`trace_plain`)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np

from harness.proofs import probes
from harness.proofs import role_programs as rp
from harness.proofs import symbolic_dims as sd
from harness.proofs import tracing
from harness.proofs.cases import ForwardCase
from harness.proofs.events import ExtractionError
from harness.proofs.jaxprs import find_kernels
from kernel.tiling import schedule as schedule_lib


# A window's sides (jax.nn's local window: keys left and right of a row's
# diagonal, from 0) and a chunk's size (from 1), symbolic dimensions of the
# ranged traces with ``windows``.
WINDOWS = {"window_left": 0, "window_right": 0, "chunk": 1}


def trace_forward(problem, config, *, batch=1, heads=1, num_tiles=2, kv_blocks=3,
                  head_dim=64, head_dim_out=None, bias=False, mask=False, key_ranges=True,
                  num_sms=1, module=None, kv_heads=None):
  """The closed jaxpr of ``kernel.forward.flash_attention_forward`` and its
  kernel eqn, traced on the CPU.  With ``key_ranges`` the kernel reads each
  tile's key range from global memory (the environment decides it), so trip
  counts, including zero, are the prover's to choose.  ``kv_heads`` (by
  default ``heads``): fewer make groups of ``heads // kv_heads`` query
  heads (GQA)."""
  import jax.numpy as jnp
  from kernel import api, forward
  forward = module or forward  # a mutated copy of the kernel package's, in the tests
  sds = jax.ShapeDtypeStruct
  tile = config.tile_q
  t_pad, s_pad = num_tiles * tile, kv_blocks * config.block_kv
  dt = jnp.dtype(problem.dtype)
  dv = head_dim if head_dim_out is None else head_dim_out
  q = sds((batch, t_pad, heads, head_dim), dt)
  kh = heads if kv_heads is None else kv_heads
  k = sds((batch, s_pad, kh, head_dim), dt)
  # FP8 takes V^T and its descales (kernel.forward.launch.flash_attention_forward).
  v = sds((batch, kh, dv, s_pad) if problem.fp8 else (batch, s_pad, kh, dv), dt)
  # Per (batch, head) operands, so that the grid indices reach their reads
  # (kernel.common.batch_head reads a dim of 1 at 0).
  fp8 = {"descales": sds((batch, kh, 2), jnp.float32)} if problem.fp8 else {}
  args = [q, k, v]
  b_ = sds((batch, heads, t_pad, s_pad), jnp.dtype(problem.bias_dtype)) if bias else None
  m_ = sds((batch, heads, t_pad, s_pad), jnp.int8) if mask else None
  if key_ranges:
    rows = sds((batch, heads, t_pad), jnp.int32)
    tiles = tuple(sds((batch, heads, num_tiles), jnp.int32) for _ in range(4))
  else:
    rows, tiles = None, None

  def fn(q, k, v, b, m, ks, ke, tl, **descales):
    return forward.flash_attention_forward(problem, config, q, k, v, b, m, ks, ke, tl,
                                           num_sms=num_sms, **descales)

  with api.lowering_only():
    closed = jax.make_jaxpr(fn)(*args, b_, m_, rows, rows, tiles, **fp8)
  (kernel,) = find_kernels(closed.jaxpr)
  return closed, kernel


def trace_case(case: ForwardCase, *, modules=None, kv_blocks=None, tiles=None):
  """The closed jaxpr and kernel eqn of ``case`` traced on the CPU: a
  persistent grid of PROBE_SMS blocks and probe_tiles tiles each, or enough
  query tiles that the probed block's causal bound allows every probe
  (``kv_blocks``, ``tiles``: more key blocks, and more tiles per block,
  for a probe of longer trip counts)."""
  modules = modules or tracing.shipped_modules()
  ring = rp.Ring(case.num_stages)
  # effective stages = min(config, key blocks): fewer stages means that few keys
  kv_blocks = case.num_stages if case.ring_cut else max(kv_blocks or 0, probes.kv_blocks(ring))
  if case.persistent:
    num_tiles = probes.PROBE_SMS * max(tiles or 0, probes.probe_tiles(ring))
  else:
    # enough tiles that the last one's causal bound reaches every key block
    num_tiles = max(probes.probe_trips(ring) + 1,
                    -(-kv_blocks * case.block_kv // case.tile_q) + 1)
  if case.schedule == "split-tail":
    # Half a wave more: the last one and a half waves are cut into pieces,
    # so every probed block ends its tiles with pieces (SplitTail).
    num_tiles += probes.PROBE_SMS // 2
  config, traced = _traced_problem(case, num_tiles, kv_blocks * case.block_kv)
  with tracing.spending("tracing"):
    closed, kernel = trace_forward(traced, config, num_tiles=num_tiles, kv_blocks=kv_blocks,
                                   head_dim=case.head_dim, head_dim_out=case.head_dim_out,
                                   bias=case.bias, mask=case.mask,
                                   module=modules.forward, num_sms=probes.PROBE_SMS)
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
  traced = plan_lib.problem_for(
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


def trace_ranged(case: ForwardCase, *, ragged: bool, windows: bool = False, modules=None):
  """([kernel eqn], dims) of the kernel :func:`trace_case` traces (it reads
  key ranges: a call with lengths, a window or segments), traced at every
  length of its queries and keys (:func:`_every_length`), where the probes'
  trace takes one: whatever the kernel's code decides from the lengths
  (``ragged_kv``, the bound a ragged key length puts on its blocks, a
  persistent round-robin block's count of tiles) is then held to the
  probes' tables at every length.  ``windows``: the problem carries a
  window and a chunk, each side and size a symbolic dimension (from 0
  and 1), as the kernels receive a call's: whatever their code decides
  from them is held to the same tables for every window and chunk, and a
  Python branch on a size fails the trace, naming its line."""
  return _every_length(case, ragged=ragged, key_ranges=True, modules=modules,
                       windows=windows)


def _every_length(case: ForwardCase, *, ragged: bool, key_ranges: bool, modules,
                  windows: bool = False):
  """([kernel eqn], dims): ``case``'s kernel (``key_ranges``: the one that
  reads them) traced with the keys' length a symbolic dimension:
  ``block_kv * m`` keys (``ragged``: and r more, every r from 1 to
  block_kv - 1) for every m that fills the config's ring, so that
  :func:`harness.proofs.symbolic.extract_symbolic` reads a trip count
  compiled from it as a variable (``dims``: its dimension variables'
  bounds, :func:`harness.proofs.symbolic_dims.dimensions`).  A
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
  dims["mq"] = 1
  at_least = ()
  if case.persistent and sd.PERSISTENT_GRID:
    # a persistent grid of any number of blocks: the launch's SMs, each a
    # block while the tiles last (min(SMs, tiles) is sms, tiles >= sms),
    # or the split tail's table's rows, as many as the SMs
    dims.update(sd.PERSISTENT_GRID)
    if case.schedule != "split-tail":
      at_least = ((("batches", "kv_heads", "group", "mq"), "sms"),)
  elif case.persistent:
    # PROBE_SMS blocks, as the probes' traces have: at least as many tiles
    dims["mq"] = probes.PROBE_SMS
  # the last tile's rows short of whole: the kernel never asks whether
  # they are, so one trace takes whole and ragged queries
  dims["sq"] = (0, case.tile_q - 1)
  if windows:
    dims.update(WINDOWS)
  return _trace_symbolic(case, {**dims, **sd.GRID_COUNTS}, floor, key_ranges=key_ranges,
                         modules=modules, at_least=at_least)


def _trace_symbolic(case, dims, blocks, *, key_ranges, modules, at_least=()):
  """([kernel eqn], its dimension variables' bounds,
  :func:`harness.proofs.symbolic_dims.dimensions`):
  ``case`` traced with ``block_kv * m + r`` keys and ``tile_q * mq - sq``
  queries, each of m, r, mq and sq a symbolic length within its bounds in
  ``dims`` where named there (else ``blocks`` key blocks, no ragged keys,
  the ranged traces' tiles, and whole ones), on a persistent grid of
  ``sms`` blocks where named (else PROBE_SMS); ``at_least`` as
  :func:`harness.proofs.symbolic_dims.dimensions` takes it."""
  from jax.experimental import pallas as pl
  modules = modules or tracing.shipped_modules()
  ring = rp.Ring(case.num_stages)
  symbols, variables = sd.dimensions(dims, at_least)
  blocks = symbols.get("m", blocks)
  num_tiles = symbols.get("mq", probes.PROBE_SMS * probes.probe_tiles(ring) if case.persistent
                          else probes.probe_trips(ring) + 1)
  # a symbolic grid (the query tiles') is Pallas's experimental export
  with tracing.spending("tracing"), sd.exact_divisions(), \
          pl.pallas_export_experimental(dynamic_shapes="mq" in dims), \
          _symbolic_schedule(modules, probes.kv_blocks(ring) * case.block_kv,
                             probes.PROBE_SMS * probes.probe_tiles(ring)), \
          sd.symbolic_axis_sizes({"sm": symbols["sms"]} if "sms" in symbols else {}), \
          sd.decided_lengths(case.describe()):
    config, traced = _traced_problem(case, num_tiles,
                                     blocks * case.block_kv + symbols.get("r", 0),
                                     symbols.get("sq", 0))
    if "chunk" in symbols:
      traced = traced.replace(window=(symbols["window_left"], symbols["window_right"]),
                              chunk=symbols["chunk"])
    _, kernel = trace_forward(traced, config, num_tiles=num_tiles,
                              kv_blocks=blocks + (1 if "r" in symbols else 0),
                              head_dim=case.head_dim, head_dim_out=case.head_dim_out,
                              bias=case.bias, mask=case.mask, key_ranges=key_ranges,
                              module=modules.forward,
                              num_sms=symbols.get("sms", probes.PROBE_SMS),
                              **sd.grid_counts(symbols))
  return [kernel], variables


@dataclasses.dataclass(frozen=True)
class _SplitTailRows(schedule_lib.SplitTail):
  """The split tail's order on a grid of ``rows`` blocks, a symbolic count."""
  rows: object = None

  @property
  def grid_blocks(self):
    return self.rows


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
  properties/proof/test_plain_proof.py holds the shapes to the host's."""
  import jax.numpy as jnp
  scope = modules.forward.flash_attention_forward.__globals__
  host = scope["_schedule"]

  def schedule(problem, config, *, batch, num_heads, num_tiles, num_sms, **lengths):
    if config.schedule == "split-tail":
      # at GQA_GRID's counts and PROBE_SMS where the traced ones are
      # symbolic: the table's entries are global-memory values, read as
      # the kernel reads them
      concrete = lambda x, n: x if isinstance(x, int) else n
      order, tables = host(problem.replace(seq_kv=seq_kv), config,
                           batch=concrete(batch, sd.GQA_GRID["batch"]),
                           num_heads=concrete(num_heads, sd.GQA_GRID["heads"]),
                           num_tiles=stand_in_tiles,
                           num_sms=concrete(num_sms, probes.PROBE_SMS), **lengths)
      # the traced tiles and counts, which the kernel's tile ids unpack by;
      # the merge of pieces after the kernel, which the proof does not
      # read, left out
      order = dataclasses.replace(order, num_tiles=num_tiles, batch=batch, num_heads=num_heads,
                                  split=np.zeros(0, np.int32),
                                  piece_slots=np.zeros((0, 0), np.int32))
      if isinstance(num_sms, int):
        return order, tables
      # a row per block of the symbolic grid: tables of the host's entries
      rows = _SplitTailRows(**{fd.name: getattr(order, fd.name)
                               for fd in dataclasses.fields(order)}, rows=num_sms)
      return rows, tuple(jnp.zeros((num_sms, *t.shape[1:]), t.dtype) for t in tables)
    if config.schedule != "longest-first":
      return host(problem, config, batch=batch, num_heads=num_heads, num_tiles=num_tiles,
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
