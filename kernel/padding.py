"""Padding the public API's arrays to whole kernel tiles.

Shared by the forward's wrapper (``kernel/api.py``) and the backward's
(``kernel/backward.py``), so both kernels see inputs padded by one rule:
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
