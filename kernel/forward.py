"""The sm90 forward kernel: warp-specialised flash attention in Pallas Mosaic GPU.

One thread block = three warpgroups along the axis ``wg`` (four with
``Config(compute_warpgroups=3)``).  Warpgroups 0 and 1 (and 2) compute on one
query tile of ``compute_warpgroups * block_q`` rows (``Config.tile_q``),
``block_q`` each, taking turns on the tensor cores through the pingpong
schedule barriers of ``kernel/barriers.py`` (a token passed round the compute
warpgroups); the last warpgroup only issues TMA copies of keys and values
into the ``num_stages``-deep ring described by ``kernel/plan.py``.  Register
budgets: :data:`COMPUTE_REGISTERS`, :data:`MEMORY_REGISTERS`.  Automatic
barriers are off: every handshake below is placed by hand and is the
protocol that ``harness/proofs/extract.py`` reads out of the traced kernel
and ``harness/proofs/extracted_proof.py`` proves.

The roles are functions over one :class:`Kernel` context: the launch
(:func:`flash_attention_forward`) sizes it, :func:`_kernel` allocates the
scratch and :func:`_dispatch` builds the rings over it (``queries``, one slot
per compute warpgroup; ``keys``, with any staged bias/mask tiles; ``values``:
kernel/ring.py, whose verbs are the only handshakes) and starts each
warpgroup's role.  The memory warpgroup (:func:`memory_warpgroup`) runs
:func:`produce_tile` on warp 0 and :func:`prefetch_queries` on warp 1; each
compute warpgroup (:func:`compute_warpgroup`) runs :func:`compute_tile`:
:func:`tile_start`, :func:`tile_prologue`, :func:`key_loop` (its
:func:`loop_body` per block, :func:`last_pv`) and :func:`epilogue`.  All of
them walk the same tiles (:func:`for_each_tile`) and compute ring positions
the same way (:func:`ring_state`).

The key loop overlaps within a warpgroup too (FlashAttention-3): each turn on
the tensor cores issues the next block's QK, then this block's PV; the
softmax of the next block runs as soon as its QK completes, while the PV is
still running, and the accumulator is rescaled once the PV completes.
Measured on the H200 (2026-11-30), headline shape: 608.4
TFLOP/s, cuDNN 587.5 in the same process; in an A/B in one process the loop
without the overlap ran at 574.3 where the overlap ran at 596.1.

Arithmetic (the executable model is ``harness/numerics/online_softmax_model.py``):
logits are scaled with log2(e) folded into the scale once, exp2 everywhere,
running max ``m_i`` in base 2, rescale guarded by ``rescale_threshold`` with the
pending scale ``m_scale``; masked logits are -inf and a "safe base" keeps fully
masked rows at out = 0, m = -inf, l = 0 (the reference's contract); the stored
``m`` residual is converted to natural log.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from kernel import barriers
from kernel import plan as plan_lib
from kernel import ring as ring_lib
from kernel import schedule as schedule_lib
from kernel import common
from kernel.common import (LOG2E, NEG_INF, ROW, WGMMA, Logits, batch_head, is_2d,
                           kv_block_range, load_broadcast, piece_block_range, smem,
                           tile_key_bounds,
                           POISONED_START, window_tile_keys)
from kernel.config import Config

# Registers per thread (setmaxnreg) by compute warpgroup count: the block's
# 64K registers shared by the compute warpgroups and the memory warpgroup,
# 128 * (memory + cw * compute) <= 65536.  Three compute warpgroups get 160
# each, as FlashAttention-3's 192-row tiles do; the memory warpgroup's two
# copy-issuing warps then keep 32.
COMPUTE_REGISTERS = {2: 232, 3: 160}
MEMORY_REGISTERS = {2: 40, 3: 32}
assert all(barriers.WARPGROUP_THREADS * (MEMORY_REGISTERS[cw] + cw * COMPUTE_REGISTERS[cw])
           <= 65536 for cw in COMPUTE_REGISTERS)


@dataclasses.dataclass(frozen=True)
class Features(Logits):
  """Static, hashable description of everything the kernel specialises on:
  the logits (:class:`kernel.common.Logits`) and the forward's switches."""

  rescale_threshold: float
  normalize_output: bool
  return_residuals: bool
  # A bias or mask that varies along both T and S goes through the stage
  # ring (TMA, with the keys) instead of being read from global memory by
  # the compute warpgroups, where a config fits with it.
  stage_2d: bool = False
  # jax.nn's local window (left, right), for the longest-first schedule's
  # tile weights only: the kernel reads the window from the key ranges,
  # which are traced and so hidden from the schedule (computed at trace
  # time).  None elsewhere, so the window's value keys no other compile.
  window: tuple[int, int] | None = None
  # Rows whose key range starts at common.POISONED_START are written NaN
  # (out, m and l): the rows kernel/variants.py cannot serve with one range
  # (a segment id in several runs).  Done in the epilogue, where it costs a
  # select per row, not a pass over the output after the kernel (measured on
  # the H200: seven packed documents at 16k, d128, the pass took 0.037 of
  # 0.553 ms, 2026-12-04).
  poisons_rows: bool = False
  # The key ranges are a local window's alone (kernel/variants.py computes
  # them at trace time): the longest-first order, weighed by ``window``,
  # already ranks the tiles by the key blocks they visit, so a
  # non-persistent launch is not re-ranked on the device (a sort before
  # every call for the order it already has).
  window_ranges: bool = False
  # The longest-first order may even its L2 sections where dealing predicts
  # that it pays (kernel/schedule.py's longest_first); False keeps them
  # filled to the byte bound, the last one the rest (kernel.experiments'
  # A/B of the two).
  even_sections: bool = True
  # The longest-first order with its light tiles deferred after every
  # section's heavy ones (kernel/schedule.py's deferred_light): None where
  # schedule.light_last_gain predicts that it pays, True or False always
  # or never (kernel.experiments' defer_light, the A/B).
  defer_light: bool | None = None
  # The copies of q, k, v and the output go through untiled views of their
  # buffers, in column parts (kernel.plan.copy_parts), so that a length no
  # multiple of 8 needs no padded copy (kernel.experiments' untiled_copies).
  untiled_copies: bool = False


def launch_extent(config: Config, seq_q: int, seq_kv: int) -> tuple[int, int]:
  """(query tiles, padded key length) of a launch: whole tiles of
  ``config.tile_q`` rows, whole blocks of ``config.block_kv`` keys."""
  return -(-seq_q // config.tile_q), -(-seq_kv // config.block_kv) * config.block_kv


def tile_schedule(*, batch, num_heads, num_kv_heads, num_tiles, s_pad, head_dim,
                  head_dim_out, itemsize, tile_q, block_kv, seq_q, seq_kv, is_causal,
                  window=None, num_sms=None, even_sections=True, light_last=None):
  """The longest-first order of this launch's tiles (kernel/schedule.py),
  weighted by the key blocks each query tile visits: causal, the key length
  and a local ``window`` (left, right) are static and counted exactly; other
  key ranges (lengths, segments, the caller's) are data the schedule cannot
  see, so their tiles are weighed at this upper bound.  ``num_sms``: the
  SMs the tiles are dealt to (persistent blocks, or the hardware's deal of
  a grid in launch order), which lets the schedule even its L2 sections
  and defer its light tiles where that balances the deal
  (schedule.longest_first, schedule.light_last_gain; without ``num_sms``
  neither).  ``even_sections`` False keeps the sections filled;
  ``light_last`` True or False defers the light tiles always or never."""
  def tile_blocks(qi):
    ks = ke = None
    if window is not None:
      ks, ke = window_tile_keys(qi, tile_q, window, seq_q=seq_q, seq_kv=seq_kv)
    lb, ub = kv_block_range(qi, tile_q=tile_q, block_kv=block_kv, seq_q=seq_q,
                            seq_kv=seq_kv, is_causal=is_causal, k_start_min=ks,
                            k_end_max=ke)
    return ub - lb
  kv_bytes_per_head = s_pad * (head_dim + head_dim_out) * itemsize
  order = schedule_lib.longest_first(
      batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, num_tiles=num_tiles,
      tile_blocks=tile_blocks, kv_bytes_per_head=kv_bytes_per_head,
      num_sms=num_sms if even_sections else None)
  if light_last is None:
    light_last = num_sms is not None and schedule_lib.light_last_gain(
        order, num_sms=num_sms, kv_bytes_per_head=kv_bytes_per_head,
        flops_per_block=2 * tile_q * block_kv * (head_dim + head_dim_out),
    ) >= schedule_lib.DEFER_LIGHT_MIN_GAIN
  return schedule_lib.deferred_light(order) if light_last else order


def range_tile_blocks(k_range_tiles, *, num_tiles, tile_q, block_kv, seq_q, seq_kv,
                      is_causal):
  """The key blocks each query tile visits under its key ranges, (B|1, N|1,
  num_tiles) int32, traced: the steps ``tile_range`` gives the kernel.

  The non-persistent longest-first launch re-ranks its tiles by these
  (:meth:`kernel.schedule.Schedule.reranked`), as the static weights cannot
  see where packed documents or lengths put the work.  Measured on the H200,
  the forward alone on the key ranges of seven packed documents, causal,
  16k, d128 (2026-12-04): 0.470 ms in the static order, 0.426 ms in the
  order of these weights (N16); 0.891 against 0.841 ms with 32 query and 8
  kv heads.  A persistent launch dealt by these weights (an oracle, computed
  on the host) ran 0.586 ms: the hardware's dynamic deal of the grid beats
  it there.  Through the API with segment ids, the ranking included: 0.532
  against 0.555 ms (N16), 0.980 against 0.982 (32/8 heads); a causal window
  of 1024 at 16k 0.350 against 0.348, kv lengths at 4k B4 0.295 against
  0.299; outputs bitwise equal either way.  A window alone is not re-ranked
  (``Features.window_ranges``): its static order is already this one."""
  start_min, _, _, end_max = k_range_tiles
  qi = jnp.broadcast_to(jnp.arange(num_tiles, dtype=jnp.int32), start_min.shape)
  lb, ub = kv_block_range(qi, tile_q=tile_q, block_kv=block_kv, seq_q=seq_q, seq_kv=seq_kv,
                          is_causal=is_causal, k_start_min=start_min, k_end_max=end_max)
  return ub - lb


@dataclasses.dataclass(frozen=True)
class Kernel(common.OperandRefs):
  """What every role of one launch reads: its sizes and switches (set by
  :func:`flash_attention_forward`) and, inside the kernel, its refs, rings
  and warpgroup index (set by :func:`_dispatch`)."""

  f: Features
  config: Config
  batch: int
  num_heads: int
  num_tiles: int
  group: int                 # query heads per key/value head
  head_dim_out: int
  dtype: Any
  stages: int                # the ring's depth (kernel.plan.effective_stages)
  layout: plan_lib.ScratchLayout
  order: Any                 # the longest-first schedule or split tail, or None (round-robin)
  # A mask may remove keys from any block.  Causal, a ragged key length and
  # key ranges only from the blocks that reach the diagonal, the last key or
  # a row's range bound (the tile's first and last blocks), which the key
  # loop runs apart (``edge``) so the others keep the unmasked path (the
  # scale folded into exp2, no select, no per-block branch).
  masks_any_block: bool
  key_ranges: bool           # k_start or k_end given (windows, documents, lengths)
  # Inside the kernel (beside common.OperandRefs): the schedule's tables,
  # the rings, and where the outputs go.
  tiles_ref: Any = None      # per-tile key-range bounds (kernel.padding.key_ranges)
  sched_ref: Any = None      # longest-first: the tile order (or each SM's tiles);
                             # split tail: each SM's entries (SplitTail.table)
  counts_ref: Any = None     # persistent longest-first or split tail: tiles per SM
  queries: ring_lib.WarpgroupSlots | None = None
  keys: ring_lib.Ring | None = None      # k, and the staged bias/mask tiles
  values: ring_lib.Ring | None = None
  out_ref: Any = None
  m_ref: Any = None
  l_ref: Any = None
  # Split tail: the pieces' outputs (slots, tile_q, Dv), m and l (slots, tile_q).
  piece_refs: tuple[Any, Any, Any] | None = None
  # Each compute warpgroup's staging of its output rows: o, m, l; and the
  # view of o its TMA store reads (kernel.plan's untiled copies; else o).
  out_smems: tuple[Any, Any, Any] | None = None
  o_copy_smems: Any = None

  @property
  def block_q(self) -> int:
    return self.config.block_q

  @property
  def cw(self) -> int:
    """Compute warpgroups (Config.compute_warpgroups)."""
    return self.config.compute_warpgroups

  @property
  def tile_q(self) -> int:
    return self.config.tile_q

  @property
  def block_kv(self) -> int:
    return self.config.block_kv

  @property
  def bq_kv(self) -> tuple[int, int]:
    return (self.config.block_q, self.config.block_kv)

  @property
  def threshold(self) -> float:
    return float(self.f.rescale_threshold)

  @property
  def always_rescale(self) -> bool:
    return self.threshold == 1.0

  @property
  def ragged_kv(self) -> bool:
    return self.f.seq_kv % self.config.block_kv != 0

  @property
  def has_edge(self) -> bool:
    return self.f.is_causal or self.ragged_kv or self.key_ranges

  @property
  def stage_bias(self) -> bool:
    return "bias" in self.keys.buffers

  @property
  def stage_mask(self) -> bool:
    return "mask" in self.keys.buffers

  @property
  def staged(self) -> bool:
    # With staged operands, a key block's slot is released only once its
    # bias/mask tile has been read, after the softmax's mask; else right
    # after its QK completes.
    return self.stage_bias or self.stage_mask


@dataclasses.dataclass(frozen=True)
class Tile:
  """One compute warpgroup's part of one query super-tile: its grid indices,
  the key blocks [lb, ub) it visits and the global count ``prev_iters`` of
  key blocks before them, its query rows, and their key ranges."""

  b: Any
  h: Any
  qi: Any
  prev_iters: Any
  lb: Any
  ub: Any
  k_start_max: Any           # the tile's key-range bounds (None: no ranges)
  k_end_min: Any
  q_base: Any                # this warpgroup's first query row
  rows: Any                  # its query rows, pl.ds(q_base, block_q)
  k_start: Any               # per query row (None: no ranges)
  k_end: Any
  # Split tail: the piece slot the tile's rows go to (< 0: the output
  # itself); None under the other schedules.
  slot: Any = None


# -- the launch ----------------------------------------------------------------

def flash_attention_forward(q, k, v, bias, mask, k_start, k_end, k_range_tiles,
                            *, features: Features, config: Config, num_sms: int = 132,
                            outputs=None):
  """Launch the kernel on padded, validated inputs.

  q (B, T, N, D), k (B, S, K, D), v (B, S, K, Dv): D, Dv as
  kernel.plan.padded_head_dims computes them, T at least one tile
  (config.tile_q rows) and S at least block_kv, multiples of 8 (Mosaic
  GPU's tiled TMA; any length with ``features.untiled_copies``) of any
  length beyond: the TMA reads rows past the end as zeros (padded keys are
  masked, padded query rows never stored) and clips the stores of the last
  tile, so a ragged length costs no padded copy.  bias (rank 4, dims 1 or
  full, T and S padded to whole tiles), mask int8 likewise, k_start/k_end
  int32 (rank 3, (B|1, N|1, Tp|1), Tp the padded query length),
  k_range_tiles: None or (start_min, start_max, end_min, end_max) each
  (B|1, N|1, num_tiles) int32.
  Returns out (B, T, N, Dv) and, with return_residuals, m and l (B, N, Tp)
  f32, Tp = T rounded up to whole tiles.

  ``outputs``: None, or mutable arrays (``jax.new_ref``) the kernel writes
  instead of returning fresh ones: out (B, To, N, Dv) and, with residuals,
  m and l (B, N, To), with To >= Tp.  Rows from Tp on are a guard band the
  kernel must leave as they were (properties/test_guard_band_gpu.py: a
  fresh output cannot show a write past its end, which the TMA unit drops).
  Returns (None, None) then.
  """
  f = wanted = features
  batch, seq_q, num_heads, head_dim = q.shape
  _, seq_kv, num_kv_heads, head_dim_out = v.shape
  dtype = q.dtype
  num_tiles, s_pad = launch_extent(config, seq_q, seq_kv)
  problem = plan_lib.Problem(
      dtype=np.dtype(dtype), head_dim=head_dim, head_dim_out=head_dim_out,
      seq_q=f.seq_q, seq_kv=f.seq_kv, is_causal=f.is_causal,
      bias_2d=f.stage_2d and is_2d(bias), mask_2d=f.stage_2d and is_2d(mask),
      return_residuals=f.return_residuals, untiled_copies=f.untiled_copies)
  # The split tail's pieces are weighed by their (m, l) in the merge, so the
  # kernel may return residuals the caller did not ask for.
  problem = plan_lib.kernel_problem(problem, config)
  f = dataclasses.replace(f, return_residuals=problem.return_residuals)
  plan_lib.check_fits(problem, config)
  if f.poisons_rows and k_start is None:
    raise ValueError("features.poisons_rows: the rows to poison are marked in k_start, "
                     "and none was given")
  pipe = plan_lib.pipeline_plan(problem, config)
  if config.schedule == "split-tail" and outputs is not None:
    raise ValueError("outputs: the split-tail schedule merges its pieces after the kernel, "
                     "into fresh arrays; run it without outputs")
  order, schedule_tables = _schedule(
      f, config, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
      num_tiles=num_tiles, s_pad=s_pad, head_dim=head_dim, head_dim_out=head_dim_out,
      itemsize=np.dtype(dtype).itemsize, k_range_tiles=k_range_tiles, num_sms=num_sms)
  kernel = Kernel(
      f=f, config=config, batch=batch, num_heads=num_heads, num_tiles=num_tiles,
      group=num_heads // num_kv_heads, head_dim_out=head_dim_out, dtype=dtype,
      stages=pipe.num_stages, layout=plan_lib.scratch_layout(problem, config), order=order,
      masks_any_block=mask is not None, key_ranges=k_start is not None or k_end is not None)

  def kernel_body(*refs):
    _kernel(kernel, pipe.mbarriers, *refs)

  # The output's row: whole, or under untiled copies in column parts
  # (kernel.plan.copy_parts), q, k and v likewise (free reshapes).
  out_row = (head_dim_out,)
  if f.untiled_copies:
    if outputs is not None:
      raise ValueError("outputs: untiled copies write the output in column parts, "
                       "into a fresh array; run them without outputs")
    in_parts = lambda x: x.reshape(*x.shape[:3], *plan_lib.copy_parts(x.shape[3], x.itemsize))
    q, k, v = in_parts(q), in_parts(k), in_parts(v)
    out_row = plan_lib.copy_parts(head_dim_out, np.dtype(dtype).itemsize)
  out_type = _out_type(f, config, order, batch=batch, seq_q=seq_q, num_heads=num_heads,
                       num_tiles=num_tiles, out_row=out_row, dtype=dtype)
  grid, grid_names = _grid(config, order, batch=batch, num_heads=num_heads,
                           num_tiles=num_tiles, num_sms=num_sms)
  launch = functools.partial(
      plgpu.kernel, kernel_body, grid=grid, grid_names=grid_names,
      num_threads=config.compute_warpgroups + barriers.MEMORY_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True))
  operands = (q, k, v, bias, mask, k_start, k_end, k_range_tiles,
              *(schedule_tables or (None, None)))
  if outputs is not None:
    _check_guarded_outputs(outputs, out_type)
    # Operands after the inputs and schedule tables: kernel_body takes them
    # as its outputs.
    launch(out_type=[])(*operands, *outputs)
    return None, None
  results = launch(out_type=out_type)(*operands)
  results = tuple(results) if isinstance(results, (list, tuple)) else (results,)
  if f.untiled_copies:  # the output (and a piece's) back to whole rows
    whole = lambda x: x.reshape(*x.shape[:-2], head_dim_out)
    results = tuple(whole(x) if i in (0, 3) else x for i, x in enumerate(results))
  if config.schedule == "split-tail":
    out, m, l, *pieces = results
    out, m, l = merge_pieces(out, m, l, pieces, order, tile_q=config.tile_q,
                             normalized=f.normalize_output)
    return out, (m, l) if wanted.return_residuals else None
  if f.return_residuals:
    out, m, l = results
    return out, (m, l)
  (out,) = results
  return out, None


def _schedule(f: Features, config: Config, *, batch, num_heads, num_kv_heads, num_tiles,
              s_pad, head_dim, head_dim_out, itemsize, k_range_tiles, num_sms):
  """(order, tables): the launch's tile order (kernel/schedule.py: the
  split tail's, the longest-first one, or None for the round-robin grid)
  and the int32 tables the kernel reads it from (None, or the order or
  each block's entries, and the tiles per block or None)."""
  tile_q, block_kv = config.tile_q, config.block_kv
  if config.schedule == "split-tail":
    # Every SM takes part, even with fewer tiles than SMs (then every tile
    # is cut into pieces, as a split-KV launch would): no more SMs than key
    # blocks, so that none is idle.
    num_blocks = -(-f.seq_kv // block_kv)
    order = schedule_lib.split_tail(
        batch=batch, num_heads=num_heads, num_tiles=num_tiles, num_blocks=num_blocks,
        num_sms=min(num_sms, batch * num_heads * num_tiles * num_blocks))
    return order, (jnp.asarray(order.table()), jnp.asarray(order.counts))
  if config.schedule != "longest-first":
    return None, None
  light_last = f.defer_light
  if light_last is None and k_range_tiles is not None and not f.window_ranges:
    # Key ranges known only on the device: the static weights are upper
    # bounds, so the model's case for deferring does not hold.
    light_last = False
  order = tile_schedule(
      batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, num_tiles=num_tiles,
      s_pad=s_pad, head_dim=head_dim, head_dim_out=head_dim_out, itemsize=itemsize,
      tile_q=tile_q, block_kv=block_kv, seq_q=f.seq_q, seq_kv=f.seq_kv,
      is_causal=f.is_causal, window=f.window, num_sms=num_sms,
      even_sections=f.even_sections, light_last=light_last)
  if config.persistent:
    dealt, counts = order.assign(min(num_sms, order.total))
    return order, (jnp.asarray(dealt), jnp.asarray(counts))
  if k_range_tiles is not None and not f.window_ranges:
    return order, (order.reranked(range_tile_blocks(
        k_range_tiles, num_tiles=num_tiles, tile_q=tile_q, block_kv=block_kv,
        seq_q=f.seq_q, seq_kv=f.seq_kv, is_causal=f.is_causal)), None)
  return order, (jnp.asarray(order.order), None)


def _out_type(f: Features, config: Config, order, *, batch, seq_q, num_heads, num_tiles,
              out_row, dtype) -> list:
  """The kernel's outputs: out, then m and l with residuals, then the
  split tail's pieces (out, m, l per slot); an output row's shape is
  ``out_row``."""
  tile_q = config.tile_q
  out_type = [jax.ShapeDtypeStruct((batch, seq_q, num_heads, *out_row), dtype)]
  if f.return_residuals:
    # m and l stay padded to whole tiles: a clipped store of the last
    # tile's rows of a (B, N, T) array was seen to land in the next head's
    # first rows (H200, 2026-12-01, T = 1000: l off by ~T at head 1, row 0),
    # as if the copy were bounded by the flattened array, not by T.
    out_type += [jax.ShapeDtypeStruct((batch, num_heads, num_tiles * tile_q),
                                      jnp.float32)] * 2
  if config.schedule == "split-tail":
    slots = max(1, order.num_slots)
    out_type += [jax.ShapeDtypeStruct((slots, tile_q, *out_row), dtype)]
    out_type += [jax.ShapeDtypeStruct((slots, tile_q), jnp.float32)] * 2
  return out_type


def _grid(config: Config, order, *, batch, num_heads, num_tiles, num_sms):
  """(grid, grid_names): a block per SM that deals tiles (persistent, the
  split tail's SMs), a block per tile in the order's launch order, or the
  round-robin (heads, query tiles, batch) grid."""
  if config.schedule == "split-tail":
    return (len(order.counts),), ("sm",)
  if config.persistent:
    return (min(num_sms, batch * num_heads * num_tiles),), ("sm",)
  if order is not None:
    return (order.total,), ("tiles",)
  return (num_heads, num_tiles, batch), ("heads", "q_tiles", "batch")


def _check_guarded_outputs(outputs, out_type):
  if len(outputs) != len(out_type):
    raise ValueError(f"outputs: expected {len(out_type)} arrays (out, and m, l with "
                     f"residuals), got {len(outputs)}")
  for ref, want, name in zip(outputs, out_type, ("out", "m", "l")):
    axis = 1 if name == "out" else 2
    shape, dtype = tuple(ref.shape), jnp.dtype(ref.dtype)
    fits = (len(shape) == len(want.shape) and shape[axis] >= want.shape[axis]
            and all(a == b for i, (a, b) in enumerate(zip(shape, want.shape)) if i != axis))
    if not fits or dtype != want.dtype:
      raise ValueError(f"outputs: {name} must be {want.dtype} shaped like {want.shape} with "
                       f"axis {axis} at least as long, got {dtype} {shape}")


def merge_pieces(out, m, l, pieces, split: schedule_lib.SplitTail, *, tile_q: int,
                 normalized: bool):
  """The split tail's tiles from their pieces (kernel/schedule.py): out
  (B, T, N, Dv) and the natural-log m, l (B, N, Tp) with every split
  tile's rows written from ``pieces`` = (out, m, l) of the slots.

  Piece p of a row holds o_p (normalised by l_p, or relative to exp(m_p)
  when not ``normalized``), m_p and l_p over its keys; with M = max_p m_p
  and w_p = l_p exp(m_p - M), the row's m is M, its l sum_p w_p and its
  output sum_p w_p o_p / l (not normalised: sum_p exp(m_p - M) o_p).  A row
  no piece saw a key of (every m_p = -inf, l_p = 0) keeps the fully masked
  contract: out 0, m -inf, l 0.  A NaN in any piece makes the row NaN."""
  if split.split.size == 0:
    return out, m, l
  f32 = jnp.float32
  p_out, p_m, p_l = pieces
  slots = split.piece_slots
  has = jnp.asarray(slots >= 0)[:, :, None]                      # (tiles, pieces, 1)
  at = np.maximum(slots, 0)
  m_p = jnp.where(has, p_m[at], NEG_INF)                         # (tiles, pieces, rows)
  l_p = jnp.where(has, p_l[at], 0.0)
  top = jnp.max(m_p, axis=1)                                     # (tiles, rows)
  ref = jnp.where(top == NEG_INF, 0.0, top)
  scale = jnp.where(has, jnp.exp(m_p - ref[:, None]), 0.0)
  weight = l_p * scale
  total = jnp.sum(weight, axis=1)
  per_piece = weight if normalized else scale
  # where, not a product alone: an unused entry reads slot 0, which may hold NaN.
  merged = jnp.sum(jnp.where(has[..., None], per_piece[..., None] * p_out[at].astype(f32), 0.0),
                   axis=1)
  if normalized:
    merged = merged / (total + float(np.finfo(np.float32).tiny))[..., None]
  b, h, qi = split.unpack(split.split)
  rows = qi[:, None] * tile_q + np.arange(tile_q)                # (tiles, rows)
  out = out.at[b[:, None], rows, h[:, None]].set(merged.astype(out.dtype), mode="drop")
  m = m.at[b[:, None], h[:, None], rows].set(top, mode="drop")
  l = l.at[b[:, None], h[:, None], rows].set(total, mode="drop")
  return out, m, l


def _kernel(c: Kernel, mbarriers, q_ref, k_ref, v_ref, bias_ref, mask_ref, ks_ref, ke_ref,
            tiles_ref, sched_ref, counts_ref, out_ref, *residual_refs):
  """The kernel's entry: allocate the scratch of kernel/plan.py's layout and
  mbarrier plan, build the rings over it, and dispatch the warpgroups."""
  m_ref, l_ref = residual_refs[:2] if residual_refs else (None, None)
  piece_refs = tuple(residual_refs[2:]) or None   # split tail: the pieces' out, m, l
  layout = c.layout
  m_buf = layout.m if c.f.return_residuals else None
  l_buf = layout.l if c.f.return_residuals else None
  # A group of buffers as RefUnion groups: the tiled one wgmma reads, and
  # under untiled copies a mirror of it, the views the TMA copies use.
  untiled = layout.untiled_copies

  def groups(*bufs):
    tiled = tuple(None if b is None else smem(b) for b in bufs)
    return (tiled, tuple(map(common.untiled_smem, bufs))) if untiled else (tiled,)

  qk, out, v = groups(layout.q, layout.k), groups(layout.o, m_buf, l_buf), groups(layout.v)
  union = lambda gs: plgpu.RefUnion(*gs) if untiled else gs[0]
  if layout.overlay_qk_with_output:
    overlay = plgpu.RefUnion(qk[0], out[0], *qk[1:], *out[1:])
  else:
    overlay = (union(qk), union(out))
  mb = {b_.name: plgpu.Barrier(num_arrivals=b_.num_arrivals, num_barriers=b_.num_barriers)
        for b_ in mbarriers}
  staged = lambda buf: None if buf is None else smem(buf)
  refs = dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, bias_ref=bias_ref, mask_ref=mask_ref,
              ks_ref=ks_ref, ke_ref=ke_ref, tiles_ref=tiles_ref, sched_ref=sched_ref,
              counts_ref=counts_ref, out_ref=out_ref, m_ref=m_ref, l_ref=l_ref,
              piece_refs=piece_refs)
  v_alloc = plgpu.RefUnion(*v) if untiled else smem(layout.v)
  pl.run_scoped(
      lambda *scoped: _dispatch(c, refs, *scoped),
      (overlay, v_alloc, staged(layout.bias), staged(layout.mask)),
      (mb["q_produced"], mb.get("q_consumed"), mb["k_produced"], mb["v_produced"],
       mb["k_consumed"], mb["v_consumed"], mb.get("bias_produced"), mb.get("mask_produced")),
      collective_axes="wg",
  )


def _scratch_views(c: Kernel, smems):
  """{name: (the ref read, the view copied)} of q, k, v, o from the
  allocated scratch (_kernel's structure), and m, l, bias, mask.  Without
  untiled copies both are one ref; with them the copied view is the
  untiled mirror, its parts moved behind its rows (kernel.plan.copy_parts:
  a copy's rows land as (rows, parts, columns) of the global array)."""
  overlay, v, bias, mask = smems
  if not c.layout.untiled_copies:
    ((q, k), (o, m, l)) = overlay
    pairs = dict(q=(q, q), k=(k, k), v=(v, v), o=(o, o))
  else:
    if c.layout.overlay_qk_with_output:
      qk_t, out_t, qk_u, out_u = overlay
    else:
      (qk_t, qk_u), (out_t, out_u) = overlay
    v_t, v_u = v
    behind = lambda x: None if x is None else x.transpose((0, 2, 1, 3))
    pairs = dict(q=(qk_t[0], behind(qk_u[0])), k=(qk_t[1], behind(qk_u[1])),
                 v=(v_t[0], behind(v_u[0])), o=(out_t[0], behind(out_u[0])))
    m, l = out_t[1], out_t[2]
  if c.layout.overlay_q_with_output:
    pairs["o"] = pairs["q"]  # each warpgroup stages its output in its query slot
  return pairs, m, l, bias, mask


def _dispatch(c: Kernel, refs: dict, smems, mbars):
  """The rings over the allocated scratch, then each warpgroup's role."""
  wg = lax.axis_index("wg")
  views, m_smems, l_smems, bias_smems, mask_smems = _scratch_views(c, smems)
  (q_smems, q_copy), (k_smems, k_copy), (v_smems, v_copy), (o_smems, o_copy) = (
      views[name] for name in "qkvo")
  (q_produced, q_consumed, k_produced, v_produced, k_consumed, v_consumed,
   bias_produced, mask_produced) = mbars
  # The key phase: k and the staged bias/mask tiles of the same key block,
  # released together; the value phase at the same positions.
  key_buffers = {"k": (k_smems, k_produced)}
  if bias_smems is not None:
    key_buffers["bias"] = (bias_smems, bias_produced)
  if mask_smems is not None:
    key_buffers["mask"] = (mask_smems, mask_produced)
  # Only where the copies have views of their own, so that the shipped
  # kernel traces as before.
  copy_views = lambda name, view, read: {name: view} if view is not read else {}
  c = dataclasses.replace(
      c, wg=wg, **refs,
      queries=ring_lib.WarpgroupSlots({"q": (q_smems, q_produced)}, q_consumed,
                                      copy_views("q", q_copy, q_smems)),
      keys=ring_lib.Ring(c.stages, key_buffers, k_consumed, copy_views("k", k_copy, k_smems)),
      values=ring_lib.Ring(c.stages, {"v": (v_smems, v_produced)}, v_consumed,
                           copy_views("v", v_copy, v_smems)),
      out_smems=(o_smems, m_smems, l_smems), o_copy_smems=o_copy)
  pl.when(wg < c.cw)(functools.partial(compute_warpgroup, c))
  pl.when(wg == c.cw)(functools.partial(memory_warpgroup, c))


# -- the tile walk and ring positions, shared by every role ---------------------

def tile_range(c: Kernel, qi, b, h, piece=None):
  """(lb, ub, k_start_max, k_end_min): the key blocks of query tile qi of
  (b, h), and the bounds of its key ranges (None without ranges).  A split
  tail's ``piece`` (lo, hi, slot) visits only the blocks in [lo, hi)."""
  if c.tiles_ref is None:
    lb, ub = kv_block_range(qi, tile_q=c.tile_q, block_kv=c.block_kv, seq_q=c.f.seq_q,
                            seq_kv=c.f.seq_kv, is_causal=c.f.is_causal)
    start_max = end_min = None
  else:
    start_min, start_max, end_min, end_max = tile_key_bounds(c.tiles_ref, b, h, qi)
    lb, ub = kv_block_range(qi, tile_q=c.tile_q, block_kv=c.block_kv, seq_q=c.f.seq_q,
                            seq_kv=c.f.seq_kv, is_causal=c.f.is_causal,
                            k_start_min=start_min, k_end_max=end_max)
  if piece is not None:
    lb, ub = piece_block_range(lb, ub, *piece[:2])
  return lb, ub, start_max, end_min


def for_each_tile(c: Kernel, tile_body, init):
  """Run ``tile_body(b, h, qi, prev_iters) -> prev_iters`` over this block's tiles.

  Non-persistent: the one tile of this grid point (longest-first: the
  grid point's entry of the schedule's order).  Persistent: the tiles this
  block is dealt, in order (longest-first: its row of the schedule's
  table; round-robin: the whole logical grid dealt in turn, query tiles
  fastest, so blocks that run together share a head's keys in L2; split
  tail: its row's entries, each also given its ``piece`` (lo, hi, slot)).
  ``prev_iters`` carries the key blocks every earlier tile of this block
  consumed, so the ring keeps its phase across tiles (a tile may have zero
  key blocks).  Every warpgroup and warp calls this with the same tables,
  so they walk the same tiles.
  """
  order = c.order
  if isinstance(order, schedule_lib.SplitTail):
    sm = lax.axis_index("sm")

    def entry(j, carry):
      row = lambda field: c.sched_ref[sm, field, j]
      return tile_body(*order.unpack(row(0)), carry, piece=(row(1), row(2), row(3)))

    return lax.fori_loop(0, c.counts_ref[sm], entry, jnp.int32(init))
  if order is not None:
    if not c.config.persistent:
      return tile_body(*order.unpack(c.sched_ref[lax.axis_index("tiles")]), init)
    sm = lax.axis_index("sm")

    def step(j, carry):
      return tile_body(*order.unpack(c.sched_ref[sm, j]), carry)

    return lax.fori_loop(0, c.counts_ref[sm], step, jnp.int32(init))
  if not c.config.persistent:
    return tile_body(lax.axis_index("batch"), lax.axis_index("heads"),
                     lax.axis_index("q_tiles"), init)

  @plgpu.nd_loop((c.batch, c.num_heads, c.num_tiles), collective_axes="sm",
                 init_carry=jnp.int32(init))
  def final(info, carry):
    b, h, qi = info.index
    return tile_body(b, h, qi, carry)

  return final


def ring_state(keys, prev_iters, lb, ki):
  """The ring position of tile-local key block ki, for producer and
  consumers alike: the global block count, carried across tiles."""
  return keys.position(prev_iters + (ki - lb))


def key_position(c: Kernel, t: Tile, ki):
  """The position of the tile's key block ki, as a compute warpgroup sees it."""
  return ring_state(c.keys, t.prev_iters, t.lb, ki)


# -- the memory warpgroup --------------------------------------------------------

def memory_warpgroup(c: Kernel):
  """MEMORY_REGISTERS; warp 0 streams keys and values through the ring,
  warp 1 prefetches each tile's queries."""
  plgpu.set_max_registers(MEMORY_REGISTERS[c.cw], action="decrease")

  @plgpu.warp_map
  def _(warp):
    @pl.when(warp == 0)
    def _():
      for_each_tile(c, functools.partial(produce_tile, c), 0)

    @pl.when(warp == 1)
    def _():
      for_each_tile(c, functools.partial(prefetch_queries, c), 0)


def produce_tile(c: Kernel, b, h, qi, prev_iters, piece=None):
  """Warp 0: every key/value TMA of the tile into the ring."""
  lb, ub, _, _ = tile_range(c, qi, b, h, piece)
  hk = lax.div(h, jnp.int32(c.group))
  keys, values = c.keys, c.values

  def fill(ki):
    st = ring_state(keys, prev_iters, lb, ki)
    kb = pl.ds(ki * c.block_kv, c.block_kv)
    # Global fills 0..S-1 find fresh slots; every later one waits for
    # both warpgroups (ring.Ring.producer_acquire).
    keys.producer_acquire(st)
    keys.producer_copy(c.k_ref.at[b, kb, hk], st)
    # The rest of the key phase: the query tile's bias/mask tile of this
    # key block, released with the keys.
    staged_src = lambda src: src.at[(*batch_head(src, b, h),
                                     pl.ds(qi * c.tile_q, c.tile_q), kb)]
    if c.stage_bias:
      keys.producer_copy(staged_src(c.bias_ref), st, "bias")
    if c.stage_mask:
      keys.producer_copy(staged_src(c.mask_ref), st, "mask")
    values.producer_acquire(st)
    values.producer_copy(c.v_ref.at[b, kb, hk], st)

  pl.loop(lb, ub)(fill)
  return prev_iters + (ub - lb)


def prefetch_queries(c: Kernel, b, h, qi, step, piece=None):
  """Warp 1: the tile's queries, once the previous tile's are consumed (a
  piece's are the whole tile's)."""
  for w in range(c.cw):
    if c.config.persistent:
      c.queries.producer_acquire(w, step > 0)
    rows = pl.ds((c.cw * qi + w) * c.block_q, c.block_q)
    c.queries.producer_copy(c.q_ref.at[b, rows, h], w)
  return step + 1


# -- the compute warpgroups ------------------------------------------------------

def compute_warpgroup(c: Kernel):
  """COMPUTE_REGISTERS; the tiles of this block, one query tile each."""
  plgpu.set_max_registers(COMPUTE_REGISTERS[c.cw], action="increase")
  # The pingpong is one token passed round the compute warpgroups (0, 1,
  # 0, ... or 0, 1, 2, 0, ...): warpgroup 0 starts holding it.  Each
  # warpgroup strictly alternates "acquire" (bar.sync on its own barrier)
  # and "pass" (bar.arrive on the next one's), across tile boundaries too,
  # so every generation of a named barrier is one pass plus one acquire.
  # Were a warpgroup to pass twice in a row, its 2 x 128 arrivals would
  # complete a generation on their own and the next warpgroup's acquire
  # would wait forever.  Hence the one acquire before the first tile of
  # every warpgroup but 0, and the one pass after the last loop (before the
  # epilogue of a non-persistent block) of every warpgroup but the last,
  # not one per tile.
  # Two compute warpgroups keep the conditions they were measured and
  # proved with (wg == 1, the other one); three take the general ones.
  if c.cw == 2:
    pl.when(c.wg == 1)(lambda: barriers.schedule_sync(c.wg))
  else:
    pl.when(c.wg > 0)(lambda: barriers.schedule_sync(c.wg, c.cw))
  for_each_tile(c, functools.partial(compute_tile, c), 0)
  if c.config.persistent:
    pass_token_for_the_last_time(c)
  if c.config.persistent:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def pass_token_for_the_last_time(c: Kernel):
  """Every warpgroup but the last passes once more than it acquires: the
  next one's last acquire (before its last PV) waits for it."""
  last = c.wg == 0 if c.cw == 2 else c.wg < c.cw - 1
  pl.when(last)(lambda: barriers.schedule_release_other(c.wg, c.cw))


def compute_tile(c: Kernel, b, h, qi, prev_iters, piece=None):
  """One query tile (or a split tail's piece of one) on this warpgroup: the
  prologue (its queries and first keys waited for, the first QK), the key
  loop, the epilogue."""
  t, acc, m_i, l_i = tile_start(c, b, h, qi, prev_iters, piece)
  s0, pending, plain = tile_prologue(c, t, m_i)
  acc, m_i, l_i, pending = key_loop(c, t, s0, acc, m_i, l_i, pending, plain)
  epilogue(c, t, acc, m_i, l_i, pending)
  return prev_iters + (t.ub - t.lb)


def tile_start(c: Kernel, b, h, qi, prev_iters, piece=None):
  """The tile's indices and key ranges, the zeroed softmax state and
  accumulator; then wait for its queries and its first key block."""
  lb, ub, k_start_max, k_end_min = tile_range(c, qi, b, h, piece)
  q_base = (c.cw * qi + c.wg) * c.block_q
  rows = pl.ds(q_base, c.block_q)
  row_values = lambda ref: None if ref is None else load_broadcast(
      ref, (b, h, rows), (c.block_q,), ROW)
  t = Tile(b, h, qi, prev_iters, lb, ub, k_start_max, k_end_min, q_base, rows,
           k_start=row_values(c.ks_ref), k_end=row_values(c.ke_ref),
           slot=None if piece is None else piece[2])
  m_i = plgpu.layout_cast(jnp.full((c.block_q,), NEG_INF, jnp.float32), ROW)
  l_i = plgpu.layout_cast(jnp.zeros((c.block_q,), jnp.float32), ROW)
  zeros = lambda cols: plgpu.layout_cast(jnp.zeros((c.block_q, cols), jnp.float32), WGMMA)
  if c.layout.untiled_copies:  # one accumulator per column part of the values
    parts, _, cols = c.layout.v.shape[1:]
    acc = tuple(zeros(cols) for _ in range(parts))
  else:
    acc = zeros(c.head_dim_out)

  c.queries.consumer_wait(c.wg)

  @pl.when(ub > lb)
  def _():
    c.keys.consumer_wait(key_position(c, t, lb))

  return t, acc, m_i, l_i


def tile_prologue(c: Kernel, t: Tile, m_i):
  """QK of the tile's first block (the loop issues each next one); the
  pending scale, if carried; the end of the blocks that need no mask."""
  s0 = plgpu.layout_cast(jnp.zeros(c.bq_kv, jnp.float32), WGMMA)

  def first_qk():
    s = qk(c, t, t.lb)
    if not c.staged:
      c.keys.consumer_release(key_position(c, t, t.lb))
    release_query_after(c, t, t.lb)
    return s

  s0 = lax.cond(t.ub > t.lb, first_qk, lambda: s0)
  if c.config.persistent:
    # A tile without key blocks still passes and then acquires the token
    # once, as a one-block tile would: otherwise warpgroup 0 runs a tile
    # ahead, its query refill waits on warpgroup 1's release, and
    # warpgroup 1 waits on warpgroup 0's pass (a deadlock the protocol model
    # found with trip counts [0, 0, 0]).
    @pl.when(t.ub == t.lb)
    def _():
      barriers.schedule_release_other(c.wg, c.cw)
      barriers.schedule_sync(c.wg, c.cw)

  # m_scale, the pending scale acc and l_i are relative to, is carried only
  # when the threshold can leave it behind m_i.
  pending = [] if c.always_rescale else [m_i]
  return s0, pending, plain_blocks(c, t)


def plain_blocks(c: Kernel, t: Tile):
  """(lo, hi): the tile's blocks [lo, hi) need no mask: entirely below
  the diagonal for this warpgroup, holding no padded key, and inside
  every row's key range of the super-tile (from its largest start to its
  smallest end).  Empty (lo >= hi) where every block needs one.

  With key ranges every block once took the masked path.  Measured on the
  H200, `python -m harness bench --grid --sections windows-segments`,
  window 1024 at 16k (d128, 16 heads): 0.518 against 0.557 ms non-causal,
  0.354 against 0.361 ms causal; 7 packed documents unchanged within the
  run's noise, 0.572 against 0.550 ms with cuDNN 0.411 against 0.399
  (2026-12-02, 9f26468 against 3944b85, two processes)."""
  block_kv = jnp.int32(c.block_kv)
  lo, hi = t.lb, t.ub
  if c.f.is_causal:
    hi = lax.min(hi, lax.div(t.q_base + 1, block_kv))
  if c.ragged_kv:
    hi = lax.min(hi, jnp.int32(c.f.seq_kv // c.block_kv))
  if t.k_end is not None:
    hi = lax.min(hi, lax.div(lax.max(t.k_end_min, 0), block_kv))
  if c.has_edge:
    hi = lax.max(t.lb, hi)
  if t.k_start is not None:  # the first block whose keys all start at or after it
    lo = lax.max(lo, lax.div(lax.max(t.k_start_max, 0) + block_kv - 1, block_kv))
  return lo, hi


def iota(c: Kernel, dim):
  return plgpu.broadcasted_iota(jnp.int32, c.bq_kv, dim, layout=WGMMA)


def safe(x):
  # exp2(x - base) with base = -inf would be NaN; rows that have seen no
  # unmasked key use base 0, where every p is exp2(-inf) = 0.
  return jnp.where(x == NEG_INF, 0.0, x)


def rescaled(acc, factor):
  """acc with row i times factor[i]: at every key block, whatever
  ``rescale_threshold``.  Skipping the multiply in every warp whose rows all
  have a factor of exactly 1 (below threshold 1, most warps after a tile's
  first blocks) gives the same bits, but the branch (``vote.sync.any`` and
  an ``scf.if`` over the 64 accumulator registers) cost more than the
  multiply it saved.  bf16 forward TFLOP/s, multiplied vs skipped, measured
  on the H100 in one process (2026-12-05): d128 4k B4 N16 at threshold 1.0
  611.9 vs 570.5, 0.5 584.6 vs 574.5, 0.0 608.6 vs 580.4; 16k B1 633.3 vs
  601.0 (1.0), 636.2 vs 616.1 (0.0); causal 4k B4 562.2 vs 533.5 (1.0);
  d64 4k B4 N32 458.2 vs 441.8 (1.0); d256 4k B4 N8 620.7 vs 608.4 (1.0),
  613.0 vs 623.0 (0.0, the one gain)."""
  return acc * lax.broadcast_in_dim(factor, acc.shape, [0])


def wait_staged(c: Kernel, st):
  # The rest of the key phase, right after the QK issue: wait k, issue QK,
  # wait bias/mask, pass the token.
  if c.stage_bias:
    c.keys.consumer_wait(st, "bias")
  if c.stage_mask:
    c.keys.consumer_wait(st, "mask")


def staged_tile(c: Kernel, t: Tile, buffer, ki):
  """This warpgroup's rows of key block ki's staged bias/mask tile
  (waited for in wait_staged; released with the keys after this)."""
  tile = c.keys.slot(key_position(c, t, ki), buffer)
  rows = lambda w: lambda: plgpu.load(tile.at[pl.ds(w * c.block_q, c.block_q)],
                                      layout=WGMMA, optimized=False)
  if c.cw == 2:
    return lax.cond(c.wg == 0, rows(0), rows(1))
  return lax.switch(c.wg, [rows(w) for w in range(c.cw)])


def qk(c: Kernel, t: Tile, ki):
  """Issue QK^T of key block ki, let the other warpgroup issue, wait."""
  st = key_position(c, t, ki)

  def compute_qk(s_ref):
    issue_qk(c, s_ref, st)
    wait_staged(c, st)
    barriers.schedule_release_other(c.wg, c.cw)
    return s_ref[...]

  return pl.run_scoped(compute_qk, plgpu.ACC(c.bq_kv, jnp.float32))


def issue_qk(c: Kernel, s_ref, st):
  """wgmma of this warpgroup's queries by the keys in ring slot ``st``
  (transposed) into ``s_ref``: under untiled copies one per column part
  (kernel.plan.copy_parts), the instructions one wgmma over whole rows
  issues."""
  q, k = c.queries.slot(c.wg), c.keys.slot(st)
  if not c.layout.untiled_copies:
    plgpu.wgmma(s_ref, q, k.T)
    return
  for part in range(q.shape[0]):
    plgpu.wgmma(s_ref, q.at[part], k.at[part].T)


def issue_pv(c: Kernel, acc_ref, p16, st):
  """wgmma of p16 by the values in ring slot ``st`` into ``acc_ref``: under
  untiled copies a tuple of accumulators, one per column part."""
  v = c.values.slot(st)
  if not c.layout.untiled_copies:
    plgpu.wgmma(acc_ref, p16, v)
    return
  for part, ref in enumerate(acc_ref):
    plgpu.wgmma(ref, p16, v.at[part])


def each_part(fn, acc):
  """``fn`` of the accumulator, or of each of its parts (a tuple under
  untiled copies)."""
  return tuple(map(fn, acc)) if isinstance(acc, tuple) else fn(acc)


def release_query_after(c: Kernel, t: Tile, ki):
  if c.config.persistent and not c.layout.overlay_q_with_output:
    # The tile's last QK has completed: the query slot may be refilled.
    pl.when(ki + 1 == t.ub)(lambda: c.queries.consumer_release(c.wg))


def logits(c: Kernel, t: Tile, s, ki, *, edge):
  """Scaled base-2 logits of one block, masked to -inf; returns (s, sc)
  with the true logits being s * sc (deferred so exp2 fuses, where sc > 0:
  the row max of s * sc is then the row max of s times sc).
  ``edge``: the block may reach the diagonal or the last (ragged) key."""
  f, block_kv, bq_kv = c.f, c.block_kv, c.bq_kv
  k_base = ki * block_kv
  sc = f.scale
  if c.stage_bias:
    bias = staged_tile(c, t, "bias", ki)
    s, sc = s * sc + bias.astype(jnp.float32), 1.0
  elif c.bias_ref is not None:
    bias = load_broadcast(c.bias_ref, (t.b, t.h, t.rows, pl.ds(k_base, block_kv)),
                          bq_kv, WGMMA)
    s, sc = s * sc + bias.astype(jnp.float32), 1.0
  if f.logits_soft_cap is not None:
    s, sc = jnp.tanh(s * (sc / f.logits_soft_cap)), f.logits_soft_cap
  sc *= LOG2E
  if sc > 0 and not (c.masks_any_block or edge):
    return s, sc
  s = s * sc
  key = k_base + iota(c, 1)
  if edge and f.is_causal:
    # Index arrays here, not masks.causal_select as in the backward: the
    # forward has registers to spare and the asm select measured slower on
    # the H200, causal 16k forward 1.828 vs 1.763 ms (d128) and 1.763 vs
    # 1.694 ms (d256), d64 within noise (2026-12-03).
    s = jnp.where(t.q_base + iota(c, 0) >= key, s, NEG_INF)
  if edge and c.ragged_kv:
    s = lax.cond(k_base + block_kv > f.seq_kv,
                 lambda: jnp.where(key < f.seq_kv, s, NEG_INF), lambda: s)
  if t.k_start is not None:
    s = lax.cond(
        k_base < t.k_start_max,
        lambda: jnp.where(key >= lax.broadcast_in_dim(t.k_start, bq_kv, [0]), s, NEG_INF),
        lambda: s)
  if t.k_end is not None:
    s = lax.cond(
        k_base + block_kv > t.k_end_min,
        lambda: jnp.where(key < lax.broadcast_in_dim(t.k_end, bq_kv, [0]), s, NEG_INF),
        lambda: s)
  if c.stage_mask:
    keep = staged_tile(c, t, "mask", ki)
    s = jnp.where(keep != 0, s, NEG_INF)
  elif c.mask_ref is not None:
    keep = load_broadcast(c.mask_ref, (t.b, t.h, t.rows, pl.ds(k_base, block_kv)),
                          bq_kv, WGMMA)
    s = jnp.where(keep != 0, s, NEG_INF)
  return s, 1.0


def softmax(c: Kernel, t: Tile, s, ki, m_i, l_i, pending, *, edge):
  """Online softmax of key block ki's raw logits s: returns the factor
  that brings the accumulator (and, already applied, l_i) to the new
  reference max, p, and the new (m_i, l_i, pending).

  Every exp2 goes to the MUFU unit.  Emulating every n-th one with a cubic
  on the FMA pipe (as FlashAttention-3 does on Blackwell) measured slower on
  the H200 at every shape tried (2026-12-03), e.g. d64 4k B4 434.8 (n=0) vs
  410.7 (n=3) and 419.5 (n=8) TFLOP/s, d128 4k 604.7 vs 550.8 and 594.1:
  this loop is issue- and latency-bound, not MUFU-bound."""
  s, sc = logits(c, t, s, ki, edge=edge)
  m_ij = jnp.maximum(m_i, s.max(axis=1) * sc)
  if c.always_rescale:
    base = safe(m_ij)
    factor = jnp.exp2(m_i - base)
    l_i = l_i * factor
  else:
    (m_scale,) = pending
    alpha = jnp.exp2(m_scale - safe(m_ij))
    rescale = (alpha < c.threshold) | (m_scale == NEG_INF)
    factor = jnp.where(rescale, alpha, 1.0)
    l_i = l_i * factor
    m_scale = jnp.where(rescale, m_ij, m_scale)
    pending = [m_scale]
    base = safe(m_scale)
  p = jnp.exp2(s * sc - lax.broadcast_in_dim(base, s.shape, [0]))
  return factor, p, m_ij, l_i, pending


def key_loop(c: Kernel, t: Tile, s0, acc, m_i, l_i, pending, plain):
  """The tile's key blocks lb .. ub - 1 given the first one's logits s0:
  its softmax, the loop over blocks lb .. ub - 2 (PV of ki, QK and
  softmax of ki + 1), then the last block's PV alone.  The blocks
  ``plain`` = [lo, hi) take the unmasked path, the others the masked one
  (``edge``)."""
  lb, ub = t.lb, t.ub
  lo_plain, ub_plain = plain

  def first_softmax(edge):
    _, p, m, l, pend = softmax(c, t, s0, lb, m_i, l_i, pending, edge=edge)
    if c.staged:  # its staged tiles are read: release the key-phase slot
      c.keys.consumer_release(key_position(c, t, lb))
    return p.astype(c.dtype), m, l + p.sum(axis=1), pend

  if c.has_edge:
    is_plain = lambda: lb < ub_plain if t.k_start is None else (lo_plain <= lb) & (lb < ub_plain)
    first = lambda: lax.cond(is_plain(),
                             functools.partial(first_softmax, False),
                             functools.partial(first_softmax, True))
  else:
    first = functools.partial(first_softmax, False)

  p16 = plgpu.layout_cast(jnp.zeros(c.bq_kv, c.dtype), WGMMA)
  p16, m, l, pend = lax.cond(ub > lb, first, lambda: (p16, m_i, l_i, pending))
  carry = (acc, p16, m, l, *pend)
  last = lax.max(lb, ub - 1)
  body = functools.partial(loop_body, c, t)
  if c.has_edge:
    # Iteration ki masks block ki + 1: plain while lo_plain <= ki + 1 < ub_plain.
    split = lax.min(last, lax.max(lb, ub_plain - 1))
    if t.k_start is not None:
      start = lax.min(split, lax.max(lb, lo_plain - 1))
      carry = lax.fori_loop(lb, start, functools.partial(body, edge=True), carry)
    else:
      start = lb
    carry = lax.fori_loop(start, split, functools.partial(body, edge=False), carry)
    carry = lax.fori_loop(split, last, functools.partial(body, edge=True), carry)
  else:
    carry = lax.fori_loop(lb, last, functools.partial(body, edge=False), carry)
  acc, p16, m, l, *pend = carry
  acc = lax.cond(ub > lb, functools.partial(last_pv, c, t, last, p16), lambda a: a, acc)
  return acc, m, l, pend


def loop_body(c: Kernel, t: Tile, ki, carry, *, edge):
  """PV of key block ki and QK of block ki + 1 in one turn on the tensor
  cores (QK issued first), then the softmax of block ki + 1 as soon as
  its QK completes, while the PV still runs (FlashAttention-3's
  intra-warpgroup overlap); the PV's result is rescaled once it
  completes.  ``edge``: whether block ki + 1 may reach the diagonal or
  the last key (the masked path)."""
  acc, p16, m_i, l_i, *pending = carry
  st, next_st = key_position(c, t, ki), key_position(c, t, ki + 1)
  c.values.consumer_wait(st)
  barriers.schedule_sync(c.wg, c.cw)

  def issue_then_softmax(refs):
    acc_ref, s_ref, factor_ref, p_ref, m_ref_, l_ref_, *pending_refs = refs
    c.keys.consumer_wait(next_st)
    issue_qk(c, s_ref, next_st)
    issue_pv(c, acc_ref, p16, st)
    wait_staged(c, next_st)
    barriers.schedule_release_other(c.wg, c.cw)
    # wgmma groups complete in issue order: at most one in flight means
    # the QK is done, the PV may still run.
    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
    factor, p, m_new, l_new, pend = softmax(
        c, t, s, ki + 1, m_ref_[...], l_ref_[...], [r[...] for r in pending_refs],
        edge=edge)
    factor_ref[...] = factor
    # p stays float32 here; the operand cast waits for the PV below.
    # The PV still in flight reads this block's p16 from registers, and
    # the register allocator may give the next p16 those very registers:
    # written while the PV runs, ptxas then serialises every wgmma of
    # the kernel (C7513; measured on the H200, 2026-12-01: d256 causal
    # forward at half the non-causal TFLOP/s, every HGMMA followed by a
    # wait).  Cast after the PV completes, no register it reads is
    # rewritten in flight.
    p_ref[...] = p
    m_ref_[...] = m_new
    l_ref_[...] = l_new + p.sum(axis=1)
    for r, v in zip(pending_refs, pend):
      r[...] = v

  # run_state returns once both products completed.  (m_i stands in as
  # the initial value of the factor, a row vector like it.)
  p_init = plgpu.layout_cast(jnp.zeros(c.bq_kv, jnp.float32), WGMMA)
  acc, _, factor, p, m_i, l_i, *pending = pl.run_state(issue_then_softmax)(
      (each_part(plgpu.ACC.init, acc), plgpu.ACC.init(jnp.zeros(c.bq_kv, jnp.float32)),
       m_i, p_init, m_i, l_i, *pending))
  p16 = p.astype(c.dtype)
  # Releases: v of block ki, then k
  # (and a staged tile, read by the softmax) of block ki + 1, then the
  # queries after a persistent tile's last QK.
  c.values.consumer_release(st)
  c.keys.consumer_release(next_st)
  release_query_after(c, t, ki + 1)
  return (each_part(lambda a: rescaled(a, factor), acc), p16, m_i, l_i, *pending)


def last_pv(c: Kernel, t: Tile, last, p16, acc):
  """The PV of the tile's last key block, alone."""
  st = key_position(c, t, last)
  c.values.consumer_wait(st)
  barriers.schedule_sync(c.wg, c.cw)

  def pv(acc_ref):
    issue_pv(c, acc_ref, p16, st)
  acc = pl.run_state(pv)(each_part(plgpu.ACC.init, acc))
  c.values.consumer_release(st)
  return acc


def epilogue(c: Kernel, t: Tile, acc, m_i, l_i, pending):
  """Normalise (or bring to m_i), stage in shared memory, TMA to global."""
  f, wg, layout = c.f, c.wg, c.layout
  m_scale = m_i if c.always_rescale else pending[0]
  if not c.config.persistent:
    # Before the epilogue: warpgroup 1's last PV waits for this pass, and
    # the output overlay's epilogue barrier waits for warpgroup 1.
    pass_token_for_the_last_time(c)

  # acc and l_i are relative to m_scale; alpha brings them to m_i.
  if c.always_rescale:
    l_res = l_i
  else:
    l_res = l_i * jnp.exp2(m_scale - safe(m_i))
  if f.normalize_output:
    # The pending factor cancels in acc / l_i; tiny keeps 0/0 at 0 for
    # fully masked rows (acc is 0 there).
    inv = 1.0 / (l_i + float(np.finfo(np.float32).tiny))
    out = each_part(lambda a: a * lax.broadcast_in_dim(inv, a.shape, [0]), acc)
  elif c.always_rescale:
    out = acc
  else:
    alpha = jnp.exp2(m_scale - safe(m_i))
    out = each_part(lambda a: a * lax.broadcast_in_dim(alpha, a.shape, [0]), acc)

  if f.poisons_rows:
    poisoned = t.k_start == POISONED_START
    out = each_part(
        lambda o: jnp.where(lax.broadcast_in_dim(poisoned, o.shape, [0]), jnp.nan, o), out)
    m_i = jnp.where(poisoned, jnp.nan, m_i)
    l_res = jnp.where(poisoned, jnp.nan, l_res)

  if c.config.persistent and not layout.overlay_q_with_output:
    # A tile without key blocks never ran a QK: release the query slot here.
    pl.when(t.ub == t.lb)(lambda: c.queries.consumer_release(wg))
  if c.config.persistent:
    # The previous tile's output copy must have read o/m/l before we
    # overwrite them (it drained while this tile computed).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if layout.overlay_qk_with_output:
    barriers.epilogue_sync(c.cw)  # every compute warpgroup is done with q and k
  o_smems, m_smems, l_smems = c.out_smems
  # The staging stored into and the view of it the TMA store reads.
  o_smem, o_copied = o_smems.at[wg], c.o_copy_smems.at[wg]
  if isinstance(out, tuple):  # untiled copies: the output's column parts
    for part, o in enumerate(out):
      o_smem.at[part][...] = o.astype(c.dtype)
  else:
    o_smem[...] = out.astype(c.dtype)
  if f.return_residuals:
    m_smems.at[wg][...] = m_i * (1.0 / LOG2E)
    l_smems.at[wg][...] = l_res

  def store(out_at, m_at, l_at):
    # One place issues the stores, wherever they go: the proof reads the
    # same events (by source line) from a tile's stores and a piece's.
    plgpu.copy_smem_to_gmem(o_copied, out_at())
    if f.return_residuals:
      plgpu.copy_smem_to_gmem(m_smems.at[wg], m_at())
      plgpu.copy_smem_to_gmem(l_smems.at[wg], l_at())

  def into_output():
    store(lambda: c.out_ref.at[t.b, t.rows, t.h], lambda: c.m_ref.at[t.b, t.h, t.rows],
          lambda: c.l_ref.at[t.b, t.h, t.rows])

  def into_slot():
    # A split tail's piece: this warpgroup's rows of its slot.
    slot, mine = lax.max(t.slot, 0), pl.ds(wg * c.block_q, c.block_q)
    p_out, p_m, p_l = c.piece_refs
    store(lambda: p_out.at[slot, mine], lambda: p_m.at[slot, mine], lambda: p_l.at[slot, mine])

  plgpu.commit_smem()
  if t.slot is None:
    into_output()
  else:
    pl.when(t.slot < 0)(into_output)
    pl.when(t.slot >= 0)(into_slot)
  if not c.config.persistent:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  elif layout.overlay_q_with_output:
    # The output was staged in the query slot: refill it only once the
    # copy has read it.  The next tile's keys and values are already
    # streaming; only its query load is exposed.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    c.queries.consumer_release(wg)
