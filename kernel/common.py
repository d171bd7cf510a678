"""What the forward and backward kernels share: Mosaic GPU layouts and
constants, scratch allocation from kernel/tiling/plan.py's buffer descriptions,
broadcast loads, and a split-tail piece's cut of a tile's key blocks (the
blocks themselves are the mask's: kernel.masks.Mask.key_blocks)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from kernel.tiling import plan as plan_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandRefs:
  """The inputs both passes' kernels read, as the kernel's refs, and the
  warpgroup running the role: None outside the kernel and for an operand
  the call lacks (no bias, no mask, no key ranges).  Keywords only, so that
  each kernel's context declares its own sizes first."""

  wg: Any = None
  q_ref: Any = None
  k_ref: Any = None
  v_ref: Any = None
  bias_ref: Any = None
  mask_ref: Any = None
  ks_ref: Any = None        # per-row key-range start and end (k_start, k_end)
  ke_ref: Any = None


LOG2E = math.log2(math.e)
NEG_INF = float("-inf")
# wgmma's accumulator layout, and its row and column vectors.
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


def row_swizzle(columns: int, dtype, what: str = "") -> int:
  """The swizzle (bytes) of a buffer whose rows are ``columns`` wide, where
  its description names none: the widest one a row holds (``what`` names
  the buffer in the error if none does; kernel.tiling.plan.row_swizzle_bytes)."""
  return plan_lib.row_swizzle_bytes(columns, np.dtype(dtype).itemsize, what)


def smem(buf: plan_lib.Buffer):
  """The scratch ref of one buffer description (swizzled for wgmma where
  the description says so)."""
  if not buf.swizzled:
    return plgpu.SMEM(buf.shape, jnp.dtype(buf.dtype))
  bits = np.dtype(buf.dtype).itemsize * 8
  swizzle = _swizzle(buf)
  transforms = (plgpu.TilingTransform((8, 8 * swizzle // bits)),
                plgpu.SwizzleTransform(swizzle))
  return plgpu.SMEM(buf.shape, jnp.dtype(buf.dtype), transforms=transforms)


def untiled_smem(buf: plan_lib.Buffer | None):
  """The view of ``buf``'s bytes a TMA copy writes or reads under
  kernel.tiling.plan's untiled copies: its swizzle without the tiling
  (kernel.tiling.plan.copy_parts says why the bytes are :func:`smem`'s); a buffer
  that is not swizzled as it is; None for None.  Allocated in a RefUnion
  group that mirrors the tiled buffers' group leaf for leaf, so that Mosaic
  GPU places each view at its buffer's first byte (jax 0.11.2's
  flatten_ref_union lays every group out from the union's first byte;
  properties/kernel/test_lowering.py checks it)."""
  if buf is None or not buf.swizzled:
    return None if buf is None else smem(buf)
  return plgpu.SMEM(buf.shape, jnp.dtype(buf.dtype),
                    transforms=(plgpu.SwizzleTransform(_swizzle(buf)),))


def _swizzle(buf: plan_lib.Buffer) -> int:
  return buf.swizzle or row_swizzle(buf.shape[-1], buf.dtype, buf.name)


def load_broadcast(ref, idx, shape, layout):
  """Load ``ref[idx]`` where size-1 dims of ``ref`` broadcast to ``shape``.

  ``idx`` has one entry per dim of ``ref``: an int/scalar or a ``pl.ds``.  The
  sliced dims of the result are the ``pl.ds`` entries, in order; they map onto
  ``shape``.  Size-1 dims of ``ref`` are read at 0 and broadcast.
  """
  new_idx, kept = [], []
  sliced = 0
  for d, ix in zip(ref.shape, idx):
    if isinstance(ix, pl.Slice):
      if d == 1:
        new_idx.append(0)
      else:
        new_idx.append(ix)
        kept.append(sliced)
      sliced += 1
    else:
      new_idx.append(0 if d == 1 else ix)
  new_idx = tuple(new_idx)
  if len(kept) == len(shape):
    value = plgpu.load(ref.at[new_idx], layout=layout, optimized=False)
  elif kept:
    (dim,) = kept
    vector_layout = layout.reduce(1 - dim) if len(shape) == 2 else layout
    value = plgpu.load(ref.at[new_idx], layout=vector_layout, optimized=False)
    value = lax.broadcast_in_dim(value, shape, (dim,))
  else:
    value = ref[new_idx]
    value = lax.broadcast_in_dim(value, shape, ())
  return plgpu.layout_cast(value, layout)


def batch_head(ref, b, h):
  """The (batch, head) index of an operand whose batch or head dim may be 1
  (broadcast): 0 there."""
  return (0 if ref.shape[0] == 1 else b, 0 if ref.shape[1] == 1 else h)


def is_2d(operand) -> bool:
  """A bias or mask that varies along both T and S (the kind that is staged
  through the ring; broadcast ones are read from global memory).  Any rank:
  the shape is read as broadcast to (B, N, T, S).  The API asks this of the
  caller's operand, the kernel of the padded one: one predicate for both."""
  if operand is None:
    return False
  shape = tuple(np.shape(operand))
  shape = (1,) * (4 - len(shape)) + shape
  return shape[2] != 1 and shape[3] != 1


def piece_block_range(lb, ub, lo, hi):
  """A tile's key blocks [lb, ub) cut to a split-tail piece's [lo, hi)
  (kernel/tiling/schedule.py), never a negative range.  Shared by the memory and
  every compute warpgroup and by the proof's environments; Python ints and
  traced int32 scalars alike."""
  ints = all(isinstance(x, int) for x in (lb, ub, lo, hi))
  _max, _min = (max, min) if ints else (lax.max, lax.min)
  lb = _max(lb, lo)
  return lb, _max(lb, _min(ub, hi))


# A key range starting here marks a row the forward kernel writes NaN
# (kernel.tiling.plan.Problem.poisons_rows; kernel.key_ranges sets it on the rows
# one range cannot serve, where every served start is at least 0).
POISONED_START = -1


def tile_key_bounds(tiles_ref, b, h, qi):
  """(start_min, start_max, end_min, end_max) of query tile ``qi``'s key
  ranges, read from the per-tile table (kernel.padding.key_ranges)."""
  start_min, start_max, end_min, end_max = (r[(*batch_head(r, b, h), qi)] for r in tiles_ref)
  return start_min, start_max, end_min, end_max
