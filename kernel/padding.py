"""Padding the public API's arrays to whole kernel tiles.

Shared by the forward's wrapper (``kernel/api.py``) and the backward's
(``kernel/backward/launch.py``), so both kernels see inputs padded by one rule:
sequence axes to whole tiles with zeros (padded keys are masked in the
kernels, padded query rows sliced off), broadcast axes of bias and mask left
at size 1 (the kernels read them at index 0), and per-row key ranges padded
with the last real row's range.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp


def pad_to_multiple(x, axis: int, multiple: int, mode: str = "constant"):
  size = x.shape[axis]
  target = -(-size // multiple) * multiple
  if target == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, target - size)
  return jnp.pad(x, widths, mode=mode)


def pad_head_dim(x, width: int):
  """q, k, v or dO (B, T, N, D) with D padded with zeros to ``width``, the
  head dim the kernels compute with (:func:`kernel.tiling.plan.padded_head_dims`)."""
  widths = [(0, 0)] * 3 + [(0, width - x.shape[3])]
  return x if width == x.shape[3] else jnp.pad(x, widths)


def broadcast_operand(x, dtype, t_multiple: int, s_multiple: int):
  """A bias or mask as rank 4 (B|1, N|1, T|1, S|1) in ``dtype``: full T and S
  axes padded to whole tiles, size-1 axes kept."""
  x = lax.broadcast_to_rank(jnp.asarray(x), 4).astype(dtype)
  for axis, multiple in ((2, t_multiple), (3, s_multiple)):
    if x.shape[axis] != 1:
      x = pad_to_multiple(x, axis, multiple)
  return x


def key_ranges(k_start, k_end, *, seq_kv: int, tile: int, num_tiles: int):
  """(k_start, k_end, tiles): the per-row ranges as int32 (B|1, N|1, Tp|1),
  None where not given, and per query tile of ``tile`` rows their
  (start min, start max, end min, end max), each (B|1, N|1, num_tiles).

  Padded query rows copy the last real row's range, so they neither widen
  nor narrow their tile's key block range.
  """
  if k_start is None and k_end is None:
    return None, None, None
  rows = lambda x: lax.broadcast_to_rank(jnp.asarray(x).astype(jnp.int32), 3)
  edge = lambda x: x if x.shape[2] == 1 else pad_to_multiple(x, 2, tile, mode="edge")
  ks = edge(rows(0 if k_start is None else k_start))
  ke = edge(rows(seq_kv if k_end is None else k_end))

  def per_tile(x, reduce):
    if x.shape[2] == 1:
      return jnp.broadcast_to(x, (*x.shape[:2], num_tiles))
    return reduce(x.reshape(*x.shape[:2], num_tiles, tile), axis=-1)

  tiles = (per_tile(ks, jnp.min), per_tile(ks, jnp.max), per_tile(ke, jnp.min),
           per_tile(ke, jnp.max))
  return (ks if k_start is not None else None, ke if k_end is not None else None, tiles)


def _per_query_block(k_start, k_end, *, seq_kv: int, num_rows: int, block_q: int,
                     caller: str):
  """(shape, nq, per_block) for the per-key-tile tables below: the ranges'
  broadcast (B|1, N|1, num_rows), the query blocks, and ``per_block(which,
  reduce)``, the starts ("start") or ends ("end") reduced over each block's
  rows, (B|1, N|1, nq).  Ranges are clipped to the keys there are: a range
  reaching past them sees none there."""
  rows = lambda x: lax.broadcast_to_rank(jnp.asarray(x).astype(jnp.int32), 3)
  ranges = {"start": jnp.clip(rows(0 if k_start is None else k_start), 0, seq_kv),
            "end": jnp.clip(rows(seq_kv if k_end is None else k_end), 0, seq_kv)}
  ks, ke = ranges["start"], ranges["end"]
  if num_rows % block_q or any(x.shape[2] not in (1, num_rows) for x in (ks, ke)):
    raise ValueError(f"{caller}: ranges over {ks.shape[2]} and {ke.shape[2]} rows "
                     f"for {num_rows} rows in whole {block_q}-row blocks")
  shape = jnp.broadcast_shapes(ks.shape[:2], ke.shape[:2]) + (num_rows,)
  nq = num_rows // block_q

  def per_block(which, reduce):
    x = jnp.broadcast_to(ranges[which], shape)
    return reduce(x.reshape(*shape[:2], nq, block_q), axis=-1)

  return shape, nq, per_block


def query_block_ranges(k_start, k_end, *, seq_kv: int, num_rows: int, block_q: int,
                       key_tile: int, num_key_tiles: int, group: int):
  """Per key tile of ``key_tile`` keys, the query blocks (``block_q`` rows)
  whose rows may see any of its keys: ``(lo, hi)``, each (B|1, K|1,
  num_key_tiles) int32, the hull [lo, hi) of those blocks over the ``group``
  query heads of each kv head ((0, 0) where none sees the tile).

  ``k_start`` / ``k_end`` are :func:`key_ranges`' per-row ranges (None: the
  whole length), their query axis ``num_rows`` (padded to whole blocks) or
  1 (one range for every row).  A block is seen
  when the union of its rows' ranges meets the tile; blocks inside the hull
  that meet it not are visited and masked, so any layout of ranges is
  served, and ranges that move with the row (a local window, packed
  documents) give each tile the band of blocks that reach it.
  """
  if k_start is None and k_end is None:
    return None
  shape, nq, per_block = _per_query_block(k_start, k_end, seq_kv=seq_kv, num_rows=num_rows,
                                          block_q=block_q, caller="query_block_ranges")
  first, end = per_block("start", jnp.min), per_block("end", jnp.max)  # (B|1, N|1, nq)
  tile_lo = jnp.arange(num_key_tiles, dtype=jnp.int32) * key_tile       # (tiles,)
  seen = ((first[..., None] < tile_lo + key_tile) & (end[..., None] > tile_lo)
          & (end > first)[..., None])                                 # (.., nq, tiles)
  if shape[1] != 1:   # the hull over each kv head's group of query heads
    seen = seen.reshape(shape[0], shape[1] // group, group, nq, num_key_tiles).any(axis=2)
  block = jnp.arange(nq, dtype=jnp.int32)[:, None]
  lo = jnp.min(jnp.where(seen, block, nq), axis=-2)
  hi = jnp.max(jnp.where(seen, block + 1, 0), axis=-2)
  return jnp.where(hi > 0, lo, 0).astype(jnp.int32), hi.astype(jnp.int32)


def query_block_inner_bounds(k_start, k_end, *, seq_kv: int, num_rows: int, block_q: int,
                             key_tile: int, num_key_tiles: int, group: int):
  """Per key tile of ``key_tile`` keys, a run ``[lo, hi)`` of query blocks
  (``block_q`` rows) wholly inside: every row of each block, for every query
  head of the kv head's ``group``, has every key of the tile in its range,
  and the tile holds no key at or past ``seq_kv``.  (B|1, K|1, 2,
  num_key_tiles) int32, [lo, hi) along axis 2 ((0, 0) where no block is
  inside).

  The dK/dV kernel's steps over those blocks skip the range terms (their
  index arithmetic and selects): every pair of such a step is kept by them.
  The run is the first one from the lowest inside block, so any layout of
  ranges is served (a block inside but outside the run only takes the
  masked path); a local window or packed documents give one run per tile.
  Arguments as :func:`query_block_ranges`.
  """
  if k_start is None and k_end is None:
    return None
  shape, nq, per_block = _per_query_block(k_start, k_end, seq_kv=seq_kv, num_rows=num_rows,
                                          block_q=block_q, caller="query_block_inner_bounds")
  start_max, end_min = per_block("start", jnp.max), per_block("end", jnp.min)  # (B|1, N|1, nq)
  tile_lo = jnp.arange(num_key_tiles, dtype=jnp.int32) * key_tile        # (tiles,)
  tile_hi = tile_lo + key_tile
  # Ends are clipped to seq_kv: a tile holding padded keys is inside no range.
  inside = (start_max[..., None] <= tile_lo) & (end_min[..., None] >= tile_hi)  # (.., nq, tiles)
  if shape[1] != 1:   # inside for every query head of each kv head's group
    inside = inside.reshape(shape[0], shape[1] // group, group, nq, num_key_tiles).all(axis=2)
  block = jnp.arange(nq, dtype=jnp.int32)[:, None]
  lo = jnp.min(jnp.where(inside, block, nq), axis=-2)                   # (.., tiles)
  hi = jnp.min(jnp.where(~inside & (block >= lo[..., None, :]), block, nq), axis=-2)
  found = lo < nq
  lo, hi = jnp.where(found, lo, 0), jnp.where(found, hi, 0)
  return jnp.stack([lo, hi], axis=-2).astype(jnp.int32)
