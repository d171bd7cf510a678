"""The order a forward launch runs its query tiles in (kernel/tiling/schedule.py):
the longest-first order's tables, weighed statically or by the key ranges on
the device, and the split tail's pieces, merged after the kernel."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from kernel.common import NEG_INF
from kernel.masks import Mask
from kernel.tiling import plan as plan_lib, schedule as schedule_lib
from kernel.tiling.config import Config


def tile_schedule(*, mask: Mask, batch, num_heads, num_kv_heads, num_tiles, s_pad, head_dim,
                  head_dim_out, itemsize, tile_q, block_kv, num_sms=None, even_sections=True,
                  light_last=None):
  """The longest-first order of this launch's tiles (kernel/tiling/schedule.py),
  weighted by the key blocks each query tile visits by ``mask``
  (:meth:`kernel.masks.Mask.tile_blocks`: causal, the key length and a local
  window are static and counted exactly; other key ranges (lengths,
  segments, the caller's) are data the schedule cannot see, so their tiles
  are weighed at this upper bound).  ``num_sms``: the
  SMs the tiles are dealt to (persistent blocks, or the hardware's deal of
  a grid in launch order), which lets the schedule even its L2 sections
  and defer its light tiles where that balances the deal
  (schedule.longest_first, schedule.light_last_gain; without ``num_sms``
  neither).  ``even_sections`` False keeps the sections filled;
  ``light_last`` True or False defers the light tiles always or never."""
  kv_bytes_per_head = s_pad * (head_dim + head_dim_out) * itemsize
  order = schedule_lib.longest_first(
      batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, num_tiles=num_tiles,
      tile_blocks=functools.partial(mask.tile_blocks, tile_q=tile_q, block_kv=block_kv),
      kv_bytes_per_head=kv_bytes_per_head,
      num_sms=num_sms if even_sections else None)
  if light_last is None:
    light_last = num_sms is not None and schedule_lib.light_last_gain(
        order, num_sms=num_sms, kv_bytes_per_head=kv_bytes_per_head,
        flops_per_block=2 * tile_q * block_kv * (head_dim + head_dim_out),
    ) >= schedule_lib.DEFER_LIGHT_MIN_GAIN
  return schedule_lib.deferred_light(order) if light_last else order


def range_tile_blocks(mask: Mask, k_range_tiles, *, num_tiles, tile_q, block_kv):
  """The key blocks each query tile visits under its key ranges, (B|1, N|1,
  num_tiles) int32, traced: the steps ``tile_range`` gives the kernel.

  The non-persistent longest-first launch re-ranks its tiles by these
  (:meth:`kernel.tiling.schedule.Schedule.reranked`), as the static weights
  cannot see where packed documents or lengths put the work; the
  hardware's dynamic deal of the grid in that order beats a persistent
  deal by the same weights (docs/decisions/forward-reranked-by-device-weights.md).
  Ranges known when tracing are not re-ranked (``Problem.static_ranges``: a
  window alone, or the whole keys): their static order is already this one."""
  start_min, _, _, end_max = k_range_tiles
  qi = jnp.broadcast_to(jnp.arange(num_tiles, dtype=jnp.int32), start_min.shape)
  lb, ub = mask.key_blocks(qi, tile_q=tile_q, block_kv=block_kv, k_start_min=start_min,
                           k_end_max=end_max)
  return ub - lb


def _schedule(problem: plan_lib.Problem, config: Config, *, batch, num_heads, num_kv_heads,
              num_tiles, s_pad, head_dim, head_dim_out, itemsize, k_range_tiles, num_sms):
  """(order, tables): the launch's tile order (kernel/tiling/schedule.py: the
  split tail's, the longest-first one, or None for the round-robin grid)
  and the int32 tables the kernel reads it from (None, or the order or
  each block's entries, and the tiles per block or None)."""
  tile_q, block_kv = config.tile_q, config.block_kv
  if config.schedule == "split-tail":
    # Every SM takes part, even with fewer tiles than SMs (then every tile
    # is cut into pieces, as a split-KV launch would): no more SMs than key
    # blocks, so that none is idle.
    num_blocks = -(-problem.seq_kv // block_kv)
    order = schedule_lib.split_tail(
        batch=batch, num_heads=num_heads, num_tiles=num_tiles, num_blocks=num_blocks,
        num_sms=min(num_sms, batch * num_heads * num_tiles * num_blocks))
    return order, (jnp.asarray(order.table()), jnp.asarray(order.counts))
  if config.schedule != "longest-first":
    return None, None
  light_last = problem.defer_light
  if light_last is None and k_range_tiles is not None and not problem.static_ranges:
    # Key ranges known only on the device: the static weights are upper
    # bounds, so the model's case for deferring does not hold.
    light_last = False
  order = tile_schedule(
      mask=problem.mask, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
      num_tiles=num_tiles, s_pad=s_pad, head_dim=head_dim, head_dim_out=head_dim_out,
      itemsize=itemsize, tile_q=tile_q, block_kv=block_kv, num_sms=num_sms,
      even_sections=problem.even_sections, light_last=light_last)
  if config.persistent:
    dealt, counts = order.assign(min(num_sms, order.total))
    return order, (jnp.asarray(dealt), jnp.asarray(counts))
  if k_range_tiles is not None and not problem.static_ranges:
    return order, (order.reranked(range_tile_blocks(
        problem.mask, k_range_tiles, num_tiles=num_tiles, tile_q=tile_q, block_kv=block_kv)), None)
  return order, (jnp.asarray(order.order), None)


def merge_pieces(out, m, l, pieces, split: schedule_lib.SplitTail, *, tile_q: int,
                 normalized: bool):
  """The split tail's tiles from their pieces (kernel/tiling/schedule.py): out
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
