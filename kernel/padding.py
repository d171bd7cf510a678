"""Padding the call's arrays to what the kernels take, and back: the one
place both passes pad (:func:`forward_inputs`, :func:`forward_results`,
:func:`backward_inputs`, :func:`backward_masks`, :func:`backward_results`).

One rule for both: q, k, v (and dO) copied only where a kernel cannot read
them as they are (:func:`_copied`; the shipped backward at every length
short of whole tiles), then with head dims zero-padded to the width the
pass computes with and sequence axes to whole tiles with zeros (padded keys
are masked in the kernels, padded query rows sliced off); past an array's
end the kernels read zeros and cut their stores; broadcast axes of bias and mask
left at size 1 (the kernels read them at index 0), and per-row key ranges
padded with the last real row's range.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

from kernel.sync.seams import seam
from kernel.tiling.plan import ROW_TILING




def _copied(x, width: int, multiple: int, tiling: int) -> bool:
  """Whether ``x`` (B, L, H, D) must be copied padded for a kernel that
  reads it in blocks of ``multiple`` rows at head dim ``width``: a head dim
  computed wider, fewer rows than one block, or rows no multiple of
  ``tiling``; else the kernel reads it as it is, past its end as zeros."""
  return x.shape[3] != width or x.shape[1] < multiple or x.shape[1] % tiling != 0


def whole(size, multiple: int):
  """``size`` rounded up to whole ``multiple``s."""
  return -(-size // multiple) * multiple


def pad_to_multiple(x, axis: int, multiple: int, mode: str = "constant"):
  size = x.shape[axis]
  target = whole(size, multiple)
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


def _per_query_block(k_start, k_end, reduce, caller: str, seq_kv: int, num_rows: int,
                     block_q: int, key_tile: int, num_key_tiles: int):
  """(shape, nq, starts, ends, tile_lo) for the per-key-tile tables below
  (None where neither range is given): the ranges' broadcast (B|1, N|1,
  num_rows), the query blocks, the starts and the ends each reduced over
  each block's rows by ``reduce`` = (its reduction for the starts, for the
  ends), (B|1, N|1, nq), and each key tile's first key.  Ranges are clipped
  to the keys there are: a range reaching past them sees none there."""
  if k_start is None and k_end is None:
    return None
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

  starts, ends = per_block("start", reduce[0]), per_block("end", reduce[1])
  return shape, nq, starts, ends, jnp.arange(num_key_tiles, dtype=jnp.int32) * key_tile


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
  blocks = _per_query_block(k_start, k_end, (jnp.min, jnp.max), "query_block_ranges", seq_kv, num_rows,
                            block_q, key_tile, num_key_tiles)
  if blocks is None:
    return None
  shape, nq, first, end, tile_lo = blocks
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
  Arguments as :func:`query_block_ranges`."""
  blocks = _per_query_block(k_start, k_end, (jnp.max, jnp.min), "query_block_inner_bounds", seq_kv, num_rows,
                            block_q, key_tile, num_key_tiles)
  if blocks is None:
    return None
  shape, nq, start_max, end_min, tile_lo = blocks
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


@seam("padding.values_transposed")
def values_transposed(value, *, head_dim_out: int, block_kv: int):
  """FP8's V^T: (B, S, K, Dv) as (B, K, Dv, S'), the head dim zero-padded to
  ``head_dim_out``, S' whole key blocks (zero keys past S), and every 16
  keys in kernel.tiling.plan.fp8_key_order (key 8b + 2a + c at position
  4a + 2b + c): one XLA transpose, O(S * Dv) bytes
  (docs/decisions/fp8-values-transposed-in-hbm.md)."""
  v = pad_to_multiple(pad_head_dim(value, head_dim_out), 1, block_kv)
  batch, seq, heads, dv = v.shape
  v = v.reshape(batch, seq // 16, 2, 4, 2, heads, dv)      # keys as (group, b, a, c)
  v = jnp.transpose(v, (0, 5, 6, 1, 3, 2, 4))              # (B, K, Dv, group, a, b, c)
  return v.reshape(batch, heads, dv, seq)


def fp8_descales(q_descale, k_descale, v_descale, *, layout: str, batch: int, kv_heads: int):
  """The FP8 forward's (B|1, K|1, 2) float32 operand: q_descale * k_descale
  and v_descale, per tensor ((1, 1, 2), ``layout`` "tensor") or per (batch,
  kv head) ("head": each descale broadcast to (B, K))."""
  shape = (1, 1) if layout == "tensor" else (batch, kv_heads)
  as_rows = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), shape)
  return jnp.stack([as_rows(q_descale) * as_rows(k_descale), as_rows(v_descale)], axis=-1)


def forward_inputs(query, key, value, bias, mask, k_start, k_end, *, problem, config):
  """The forward kernel's operands from the call's arrays: q, k, v in the
  compute dtype at the problem's head dims (FP8: v as V^T,
  :func:`values_transposed`); bias and mask broadcast to rank 4 and padded
  to whole tiles; the key ranges with their per-tile table.
  Returns (q, k, v, bias, mask, k_start, k_end, tiles)."""
  dtype = problem.dtype
  tile, block_kv = config.tile_q, config.block_kv
  s = key.shape[1]
  # Untiled copies (kernel.tiling.plan.copy_parts) take any length
  # (docs/decisions/untiled-copies.md).
  tiling = 1 if problem.untiled_copies else ROW_TILING

  def operand(x, width, multiple):
    x = x.astype(dtype)
    if _copied(x, width, multiple, tiling):
      x = pad_to_multiple(pad_head_dim(x, width), 1, multiple)
    return x
  if problem.fp8:
    q, k = operand(query, problem.head_dim, tile), operand(key, problem.head_dim, block_kv)
    v = values_transposed(value, head_dim_out=problem.head_dim_out, block_kv=block_kv)
  else:
    q, k, v = (operand(query, problem.head_dim, tile), operand(key, problem.head_dim, block_kv),
               operand(value, problem.head_dim_out, block_kv))
    if k.shape[1] != v.shape[1]:  # one of them was padded: both, so they agree
      k, v = pad_to_multiple(k, 1, block_kv), pad_to_multiple(v, 1, block_kv)
  num_tiles = -(-query.shape[1] // tile)
  if bias is not None:
    bias = broadcast_operand(bias, problem.bias_dtype, tile, block_kv)
  if mask is not None:
    mask = broadcast_operand(mask, jnp.int8, tile, block_kv)
  k_start, k_end, tiles = key_ranges(k_start, k_end, seq_kv=s, tile=tile, num_tiles=num_tiles)
  return q, k, v, bias, mask, k_start, k_end, tiles


def forward_results(out, residuals, *, seq_q: int, head_dim_out: int):
  """The forward kernel's out (B, T, N, Dv) and residuals (m, l) cut back
  to the call's length and value head dim."""
  out = out[:, :seq_q, :, :head_dim_out]
  if residuals is not None:
    m, l = residuals
    residuals = (m[:, :, :seq_q], l[:, :, :seq_q])
  return out, residuals


def backward_inputs(query, key, value, d_out, *, head_dims, blocks, whole_tiles: bool = True):
  """q, k, v and dO at the backward's head dims, dO in the compute dtype, and
  (Tp, Sp): the query rows and keys its grids cover, whole tiles of its
  tiling (kernel.tiling.backward_plan.BackwardBlocks).  ``whole_tiles``:
  the arrays padded to (Tp, Sp) at every length; else padded only where
  the forward pads them (:func:`forward_inputs`; under the blocks' untiled
  copies at any length but one shorter than a block), q with dO and k
  with v, the kernels reading past the end as zeros and their stores cut
  at it."""
  d, dv = head_dims
  t_mult, s_mult = blocks.query_multiple, blocks.key_multiple
  t_pad, s_pad = whole(query.shape[1], t_mult), whole(key.shape[1], s_mult)
  # Untiled copies take any length (docs/decisions/backward-untiled-copies.md).
  tiling = 1 if blocks.untiled_copies else ROW_TILING
  # q with dO and k with v: both copied where either is
  pad_q = whole_tiles or _copied(query, d, t_mult, tiling) or \
      _copied(d_out, dv, t_mult, tiling)
  pad_k = whole_tiles or _copied(key, d, s_mult, tiling) or \
      _copied(value, dv, s_mult, tiling)
  padded = lambda x, width, multiple, pad: (pad_to_multiple(pad_head_dim(x, width), 1, multiple)
                                            if pad else x)
  q, k = padded(query, d, t_mult, pad_q), padded(key, d, s_mult, pad_k)
  v = padded(value, dv, s_mult, pad_k)
  do = padded(d_out.astype(query.dtype), dv, t_mult, pad_q)
  return q, k, v, do, (t_pad, s_pad)


def backward_masks(bias, mask, k_start, k_end, *, dtype, seq_kv: int, t_pad: int, blocks):
  """The backward's bias and mask (rank 4, padded to whole tiles) and key
  ranges with the dQ tiles' table: (bias4, mask4, k_start, k_end, tiles)."""
  t_mult, s_mult = blocks.query_multiple, blocks.key_multiple
  bias4 = None if bias is None else broadcast_operand(bias, dtype, t_mult, s_mult)
  mask4 = None if mask is None else broadcast_operand(mask, jnp.int8, t_mult, s_mult)
  tile = blocks.dq_tile
  k_start, k_end, tiles = key_ranges(k_start, k_end, seq_kv=seq_kv, tile=tile,
                                     num_tiles=t_pad // tile)
  return bias4, mask4, k_start, k_end, tiles


def backward_results(dq, dk, dv, *, seq_q: int, seq_kv: int, head_dim: int, head_dim_out: int):
  """dq, dk, dv cut back to the call's lengths and head dims."""
  return (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
          dv[:, :seq_kv, :, :head_dim_out])
