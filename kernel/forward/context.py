"""What every role of one forward launch reads: the call's static facts
(kernel.tiling.plan.Problem), the launch's sizes and, inside the kernel, its
refs and rings (:class:`ForwardContext`), one warpgroup's part of a query tile
(:class:`Tile`), and the tile walk and ring positions every role computes
the same way (:func:`for_each_tile`, :func:`ring_state`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel import common
from kernel.common import piece_block_range, tile_key_bounds
from kernel.sync import barriers, ring as ring_lib
from kernel.sync.seams import seam
from kernel.tiling import plan as plan_lib, schedule as schedule_lib
from kernel.tiling.config import Config


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
class ForwardContext(common.OperandRefs):
  """What every role of one launch reads: its sizes and switches (set by
  :func:`flash_attention_forward`) and, inside the kernel, its refs, rings
  and warpgroup index (set by :func:`_dispatch`)."""

  problem: plan_lib.Problem        # the call's static facts, as the kernel runs them
  config: Config
  batch: int
  num_heads: int
  num_tiles: int
  group: int                 # query heads per key/value head
  head_dim_out: int
  dtype: Any
  stages: int                # the ring's depth (kernel.tiling.plan.effective_stages)
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
  descale_ref: Any = None    # FP8: (B|1, K|1, 2) float32 (kernel.forward.fp8.tile_descales)
  queries: ring_lib.WarpgroupSlots | None = None
  keys: ring_lib.Ring | None = None      # k, and the staged bias/mask tiles
  values: ring_lib.Ring | None = None
  out_ref: Any = None
  m_ref: Any = None
  l_ref: Any = None
  # Split tail: the pieces' outputs (slots, tile_q, Dv), m and l (slots, tile_q).
  piece_refs: tuple[Any, Any, Any] | None = None
  # Each compute warpgroup's staging of its output rows: o, m, l; and the
  # view of o its TMA store reads (kernel.tiling.plan's untiled copies; else o).
  out_smems: tuple[Any, Any, Any] | None = None
  o_copy_smems: Any = None

  # The config's fields the roles read most, under short names.
  block_q = property(lambda self: self.config.block_q)
  block_kv = property(lambda self: self.config.block_kv)
  tile_q = property(lambda self: self.config.tile_q)
  cw = property(lambda self: self.config.compute_warpgroups)   # compute warpgroups
  bq_kv = property(lambda self: (self.config.block_q, self.config.block_kv))

  @property
  def out_dtype(self):
    """The output's dtype: the inputs', or FP8's (Problem.output_dtype)."""
    return self.problem.output_dtype if self.problem.fp8 else self.dtype

  @property
  def threshold(self) -> float:
    return float(self.problem.rescale_threshold)

  @property
  @seam("context.always_rescale")
  def always_rescale(self) -> bool:
    return self.threshold == 1.0

  @property
  @seam("context.ragged_kv")
  def ragged_kv(self) -> bool:
    return self.problem.seq_kv % self.config.block_kv != 0

  @property
  def has_edge(self) -> bool:
    return self.problem.mask.causal or self.ragged_kv or self.key_ranges

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
  # FP8: (q_descale * k_descale, v_descale) of the tile's heads; else None.
  descales: Any = None


# -- the tile walk and ring positions, shared by every role ---------------------

def tile_range(c: ForwardContext, qi, b, h, piece=None):
  """(lb, ub, k_start_max, k_end_min): the key blocks of query tile qi of
  (b, h), and the bounds of its key ranges (None without ranges).  A split
  tail's ``piece`` (lo, hi, slot) visits only the blocks in [lo, hi)."""
  if c.tiles_ref is None:
    lb, ub = c.problem.mask.key_blocks(qi, tile_q=c.tile_q, block_kv=c.block_kv)
    start_max = end_min = None
  else:
    start_min, start_max, end_min, end_max = tile_key_bounds(c.tiles_ref, b, h, qi)
    lb, ub = c.problem.mask.key_blocks(qi, tile_q=c.tile_q, block_kv=c.block_kv,
                                       k_start_min=start_min, k_end_max=end_max)
  if piece is not None:
    lb, ub = piece_block_range(lb, ub, *piece[:2])
  return lb, ub, start_max, end_min


def for_each_tile(c: ForwardContext, tile_body, init):
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


@seam("context.ring_state")
def ring_state(keys, prev_iters, lb, ki):
  """The ring position of tile-local key block ki, for producer and
  consumers alike: the global block count, carried across tiles."""
  return keys.position(prev_iters + (ki - lb))


@seam("context.key_position")
def key_position(c: ForwardContext, t: Tile, ki):
  """The position of the tile's key block ki, as a compute warpgroup sees it."""
  return ring_state(c.keys, t.prev_iters, t.lb, ki)
