"""The causal mask and the padded-key mask of a WGMMA-layout tile without
index arrays.

``jnp.where(key <= query, x, fill)`` with ``key`` and ``query`` built from
``broadcasted_iota`` materialises two int32 arrays and a bool array the size
of the tile: at a 64 x 128 float32 tile that is 64 registers each per thread,
and a kept bool array lives from the P select to the dS select: the
backward's dK/dV kernel at 128 streamed query rows, head dim 64, causal,
spilled (docs/decisions/backward-register-masks.md).

Here the comparison is split into its per-thread part and its per-register
part.  In the WGMMA layout a thread's element i lies at (t_row + r_i,
t_col + c_i) where (t_row, t_col) depends only on the thread and (r_i, c_i)
only on i (Mosaic GPU's ``TiledLayout.thread_idxs`` adds a per-register
constant to a per-thread linear offset, without carry across rows since the
tiles partition the array).  So ``key <= query`` becomes ``z <= k_i`` with
one int32 z per thread and an immediate k_i per element; each element is one
``setp`` and one ``selp`` in a single asm statement, so no predicate or bool
array outlives its select.  A key limit (``key < limit``) is the same
comparison with a per-thread key offset alone.

The backward's keep (kernel.masks.selects.Keep) uses both: faster than the
index arrays at most shapes, out, dk and dv bitwise equal
(docs/decisions/backward-register-masks.md).  With both selects the
128-row causal dK/dV kernel at head dim 64 still spills
(kernel.tiling.backward_plan.blocks_for keeps it at 64 rows).

The forward keeps the index arrays (kernel.masks.selects.masked_logits): it
has registers to spare there, and this select was slower in it
(docs/decisions/forward-index-array-masks.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from kernel.sync.seams import seam

_FILL_HEX = {0.0: "0f00000000", float("-inf"): "0fFF800000"}


def element_offsets(shape, layout) -> np.ndarray:
  """(row, col) offset of each register element from the thread's first,
  as an int array of shape registers_shape + (vector length, 2)."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  rows, cols = shape
  strides = mgpu_utils.get_contiguous_strides(shape)
  tile_strides = layout.tiling.tile_strides(strides)
  reg_shape = layout.registers_shape(shape)
  vec = layout.vector_length
  out = np.zeros(tuple(reg_shape) + (vec, 2), np.int64)
  for idx in np.ndindex(*reg_shape):
    lin = sum(i * s for i, s in zip(idx, tile_strides))
    r, c = divmod(lin, cols)
    for e in range(vec):
      out[idx + (e,)] = (r, c + e)
  return out


def causal_bounds(offsets: np.ndarray, key_dim: int) -> np.ndarray:
  """The immediate k_i of each element for the causal mask: with z = key_t -
  query_t - delta per thread (delta = query_base - key_base), the pair counts
  iff z <= k_i.

  key = key_base + key_t + key_i and query = query_base + query_t + query_i,
  so key <= query iff key_t - query_t - delta <= query_i - key_i."""
  rows, cols = offsets[..., 0], offsets[..., 1]
  key_i, query_i = (rows, cols) if key_dim == 0 else (cols, rows)
  return query_i - key_i


def limit_bounds(offsets: np.ndarray, key_dim: int) -> np.ndarray:
  """The immediate k_i of each element for a key limit: with z = key_t -
  (limit - 1 - key_base) per thread, the key counts iff z <= k_i.

  key = key_base + key_t + key_i < limit iff key_t - (limit - 1 - key_base)
  <= -key_i."""
  return -offsets[..., key_dim]


def causal_select(x, *, key_base, query_base, key_dim: int, fill: float):
  """``where(key <= query, x, fill)`` for a float32 (rows, cols) WGMMA-layout
  tile whose dimension ``key_dim`` runs over keys key_base + i and the other
  over queries query_base + j (bases ints or traced int32)."""
  _check(x, key_dim, fill)
  delta = jnp.asarray(query_base, jnp.int32) - jnp.asarray(key_base, jnp.int32)
  return _split_select(x, delta, key_dim=key_dim, fill=fill, causal=True)


def key_limit_select(x, *, key_base, limit, key_dim: int, fill: float):
  """``where(key < limit, x, fill)`` for a float32 WGMMA-layout tile whose
  dimension ``key_dim`` runs over keys key_base + i (the padded keys past
  the sequence: ``limit`` its length)."""
  _check(x, key_dim, fill)
  delta = jnp.asarray(limit, jnp.int32) - 1 - jnp.asarray(key_base, jnp.int32)
  return _split_select(x, delta, key_dim=key_dim, fill=fill, causal=False)


def _check(x, key_dim, fill):
  if fill not in _FILL_HEX:
    raise ValueError(f"fill must be one of {sorted(_FILL_HEX)}, got {fill!r}")
  if key_dim not in (0, 1):
    raise ValueError(f"key_dim must be 0 or 1, got {key_dim!r}")
  if x.ndim != 2 or x.dtype != jnp.float32:
    raise ValueError(f"x must be a 2-d float32 tile, got {x.dtype}{list(x.shape)}")


def _split_select(x, delta, *, key_dim, fill, causal):
  """x where z <= k_i, fill elsewhere: z = key_t - query_t - delta per thread
  under ``causal``, key_t - delta otherwise; k_i from causal_bounds or
  limit_bounds."""
  fill_hex = _FILL_HEX[fill]
  layout = plgpu.Layout.WGMMA
  shape = x.shape

  @plgpu.inline_mgpu(arg_types=(layout, plgpu.Layout.WG_SPLAT),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout))
  @seam("masks.register_select")
  def select(_ctx, xa, d):
    from jax.experimental.mosaic import gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    row0, col0 = (arith.index_cast(i32, v) for v in next(iter(xa.layout.thread_idxs(shape))))
    offsets = element_offsets(shape, xa.layout)
    key_t, query_t = (row0, col0) if key_dim == 0 else (col0, row0)
    if causal:
      bounds = causal_bounds(offsets, key_dim)
      z = arith.subi(arith.subi(key_t, query_t), d.registers[()])
    else:
      bounds = limit_bounds(offsets, key_dim)
      z = arith.subi(key_t, d.registers[()])
    regs = xa.registers
    out = np.empty_like(regs)
    for idx in np.ndindex(*regs.shape):
      v = regs[idx]
      [width] = ir.VectorType(v.type).shape
      res = llvm.mlir_undef(v.type)
      for e in range(width):
        bound = int(bounds[idx + (e,)])
        pos = arith.constant(i32, e)
        el = llvm.extractelement(v, pos)
        el = llvm.inline_asm(
            f32, [z, el],
            "{ .reg .pred %keep; "
            f"setp.le.s32 %keep, $1, {bound}; selp.f32 $0, $2, {fill_hex}, %keep; }}",
            "=f,r,f")
        res = llvm.insertelement(res, el, pos)
      out[idx] = res
    return mgpu.FragmentedArray(_registers=out, _layout=xa.layout, _is_signed=None)

  return select(x, delta)
