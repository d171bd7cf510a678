"""The forward's memory warpgroup: warp 0 streams each tile's keys and values
(and staged bias and mask tiles) through the ring, warp 1 prefetches each
tile's queries.  It does no arithmetic, and keeps few registers so that the
compute warpgroups can have many."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.common import batch_head
from kernel.forward.context import (ForwardContext, MEMORY_REGISTERS, for_each_tile, ring_state,
                                    tile_range)
from kernel.sync.seams import seam


# -- the memory warpgroup --------------------------------------------------------

def memory_warpgroup(c: ForwardContext):
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


@seam("producer.tile")
def produce_tile(c: ForwardContext, b, h, qi, prev_iters, piece=None):
  """Warp 0: every key/value TMA of the tile into the ring."""
  lb, ub, _, _ = tile_range(c, qi, b, h, piece)
  hk = lax.div(h, jnp.int32(c.group))
  keys, values = c.keys, c.values

  @seam("producer.fill")
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
    if c.problem.fp8:  # V^T: (Dv, block_kv), keys fastest
      values.producer_copy(c.v_ref.at[b, hk, :, kb], st)
    else:
      values.producer_copy(c.v_ref.at[b, kb, hk], st)

  pl.loop(lb, ub)(fill)
  return prev_iters + (ub - lb)


@seam("producer.prefetch_queries")
def prefetch_queries(c: ForwardContext, b, h, qi, step, piece=None):
  """Warp 1: the tile's queries, once the previous tile's are consumed (a
  piece's are the whole tile's)."""
  for w in range(c.cw):
    if c.config.persistent:
      c.queries.producer_acquire(w, step > 0)
    rows = pl.ds((c.cw * qi + w) * c.block_q, c.block_q)
    c.queries.producer_copy(c.q_ref.at[b, rows, h], w)
  return step + 1
