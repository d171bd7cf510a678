"""dQ accumulated inside the dK/dV kernel (the fused dQ): each block
reduce-adds its part of dQ into global memory, in float32, or in int32
fixed point where ``deterministic=True`` asks for bits that do not depend on
the order of the adds."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel.backward import parts
from kernel.backward.context import CW
from kernel.sync.seams import seam
from kernel.tiling.backward_plan import DS_BUFFERS


# The fused dQ.  dQ_i = scale * sum_j dS_ij K_j sums over every key tile, and
# the key tiles live in different blocks: each block adds its part (one
# streamed query block x head_dim, f32) into a zeroed f32 array in global
# memory with a TMA reduce-add, and one XLA cast finishes it.  Within a block,
# both warpgroups' dS^T tiles (64 keys x the block's queries each) go through
# shared memory so that ONE warpgroup forms the block's whole part, dS_i,tile
# K_tile, over all 128 keys of the tile: half the reduce-add traffic of a part
# per warpgroup.  The warpgroups take that turn alternately (step t: its owner,
# warpgroup t % 2): right after storing its own dS^T, the owner waits on the
# named barrier ds_ready_<owner> until the other warpgroup, which only
# arrives there right after its store, has stored its dS^T too
# (barriers.ds_ready); the owner's product follows its dK/dV products.  Two
# dS^T buffers (step t uses t % 2): the buffer of
# step t is written again at step t + 2, by the owner of step t itself (in
# program order after its product completed) and by the other warpgroup only
# after it passed its own wait of step t + 1, which needs the owner of step t
# to arrive there, which it does at step t + 1, after its product of step t
# completed.
# Taking turns beats splitting every step's part by columns (both warpgroups
# form half of its columns over all 128 keys after a sync on both staged dS^T
# tiles, the split FlashAttention-3 uses): the turns let the warpgroups run
# offset, one on its products while the other forms its part
# (docs/decisions/fused-dq-turns.md).
# Order across blocks is not fixed, so a float32 dQ is not bitwise
# reproducible (dK, dV are); properties/gpu/test_gradients_gpu.py bounds the
# difference.  deterministic=True sums the same parts in fixed point instead
# (below), where the order does not matter.


# The fused dQ in fixed point (deterministic=True).  Integer addition is
# associative, so int32 reduce-adds give the same bits in any order.  Row i
# of dQ / scale is sum_j dS_ij K_j over the keys, and
#
#   |sum_j dS_ij K_jd| <= sum_j P_ij |dP_ij - delta_i| |K_jd|
#                      <= (|dO_i| max_j |V_j| + |delta_i|) max_jd |K_jd| = U_i
#
# (dP_ij = dO_i . V_j, Cauchy-Schwarz, and sum_j P_ij <= 1), for every subset
# of the keys too, so every partial sum of row i's parts is bounded by U_i.
# fixed_point_scales gives row i the power of two c_i <= 2^FIXED_POINT_BITS
# / U_i (and > half of it); the step's owner adds c_i * part rounded to an
# integer (to_fixed_point: to the nearest up to head dim 64, truncated over
# it), exact but for at most one unit per part, and the sum never leaves
# int32: |sum| <= 2^FIXED_POINT_BITS (times 1 + the float32 and bfloat16
# roundings of P and dS^T) < 2^31.  dq = sum / c_i * scale.  A part is
# resolved to 2^-FIXED_POINT_BITS of U_i, an a-priori bound that exceeds
# max_d |dq_id| by the cancellation of the sum; the error that leaves stays
# under bfloat16's 2^-9 and float16's 2^-11 relative rounding of the result
# (docs/decisions/fixed-point-dq.md has the model's errors and the GPU's).
# A non-finite U_i (a NaN or infinity in dO_i, delta_i, or any key or value of
# the head, or a norm beyond float32's range) makes c_i NaN, and the row's dq
# NaN at the division.
FIXED_POINT_BITS = 29


def fixed_point_scales(k, v, do, rows, group: int):
  """(B, N, Tp) f32: c_i, the power of two each query row's dQ parts are
  multiplied by before their int32 reduce-adds (notes above), from k (B, S,
  K, D), v, do (B, T, N, Dv) and the residual rows' delta (B, N, 2, Tp)."""
  f32 = jnp.float32
  # Each key's max |k| and |v|^2 first (row reductions over the head dim,
  # in one pass over K and V), fenced so that XLA keeps them, then the max
  # over keys of those (B, S, K) arrays: the same bits as one reduction over
  # (S, D), faster (docs/decisions/fixed-point-scales-row-reductions.md).
  k_row = jnp.max(jnp.abs(k.astype(f32)), axis=3)                            # (B, S, K)
  v_row = jnp.sum(jnp.square(v.astype(f32)), axis=3)
  k_row, v_row = lax.optimization_barrier((k_row, v_row))
  k_max = jnp.max(k_row, axis=1)                                             # (B, K)
  v_norm = jnp.sqrt(jnp.max(v_row, axis=1))
  do_norm = jnp.swapaxes(jnp.sqrt(jnp.sum(jnp.square(do.astype(f32)), axis=3)), 1, 2)
  if do_norm.shape[2] != rows.shape[3]:  # dO not padded to the grid's rows: 0 past its end
    do_norm = jnp.pad(do_norm, ((0, 0), (0, 0), (0, rows.shape[3] - do_norm.shape[2])))
  per_head = lambda x: jnp.repeat(x, group, axis=1)[:, :, None]             # (B, N, 1)
  bound = (do_norm * per_head(v_norm) + jnp.abs(rows[:, :, 1])) * per_head(k_max)
  # bound = 0 (padded rows, dO_i = 0): no part is nonzero; the largest exponent.
  exponent = jnp.clip(jnp.floor(FIXED_POINT_BITS - jnp.log2(bound)), -126.0, 126.0)
  # A bound that is not finite leaves no scale to sum in: NaN, so that the
  # row's dq comes out NaN, never a finite value from saturated parts.
  return jnp.where(jnp.isfinite(bound), jnp.exp2(exponent), jnp.nan).astype(f32)


def to_fixed_point(part, scales, width: int | None = None):
  """c_i * part as int32: ``scales`` (the part's rows, ROW layout) are powers
  of two, so y = c_i * part is exact and |y| <= 2^FIXED_POINT_BITS.
  ``width``: the head dim the rounding is chosen by, where ``part`` is one
  column part of it (untiled copies; None: the part's own width).

  Up to head dim 64, y is rounded to the nearest integer by float adds
  (:func:`_round_by_adds`); wider parts are converted (truncated) by cvt,
  whose unit runs at a quarter of the float rate on sm90 and is the one the
  exponentials use; beside a 128-column part the adds' temporaries cost
  more than the conversion (docs/decisions/fixed-point-rounding.md)."""
  y = part * lax.broadcast_in_dim(scales, part.shape, [0])
  if (width or part.shape[1]) > 64:
    return y.astype(jnp.int32)
  return _round_by_adds(y)


def _round_by_adds(y):
  """round(y) as int32 for |y| < 2^30, without a conversion instruction.
  Adding 1.5 * 2^31 rounds y to a multiple of 2^8, and the sum's bits less
  the constant's count those multiples; the remainder r = y - h (exact,
  |r| <= 128) is rounded likewise with 1.5 * 2^23.  It needs float adds
  evaluated as written: Mosaic GPU allows contraction only (x * c + M is
  one fma, exact here); XLA's CPU compiler reassociates them under jit."""
  t = y + HI_MAGIC
  r = y - (t - HI_MAGIC)
  u = r + LO_MAGIC
  bits = lambda x: lax.bitcast_convert_type(x, jnp.int32)
  return bits(t) * 256 + (bits(u) - MAGIC_BITS)


HI_MAGIC = np.float32(1.5 * 2.0 ** 31)


LO_MAGIC = np.float32(1.5 * 2.0 ** 23)


# (bits(HI_MAGIC) << 8) + bits(LO_MAGIC), wrapped to int32 as the kernel's sum is
MAGIC_BITS = np.uint32(((int(HI_MAGIC.view(np.uint32)) << 8) + int(LO_MAGIC.view(np.uint32)))
                       % (1 << 32)).view(np.int32)


@seam("fused_dq.ds_buffer")
def ds_buffer(t):
  return t % DS_BUFFERS


def dq_owner(t):
  return t % CW


def _dq_product(ds_st, buf, k_st, untiled: bool = False):
  """dS_i,tile K_tile (f32, unscaled): the contraction runs over both
  warpgroups' 64 keys, from their dS^T tiles staged in buffer ``buf`` of
  ``ds_st`` (buffers, CW, keys, queries) and the stationary K tiles;
  ``untiled``: K in column parts, the result a tuple of parts."""
  if untiled:
    def product_parts(accs):
      for w in range(CW):
        parts.issue_ab(accs, ds_st.at[buf, w].T, parts.Parts(k_st.at[w]))
      return tuple(acc[...] for acc in accs)
    acc_type = plgpu.ACC((ds_st.shape[3], k_st.shape[-1]), jnp.float32)
    return pl.run_scoped(product_parts, (acc_type,) * k_st.shape[1])

  def product(acc):
    for w in range(CW):
      plgpu.wgmma(acc, ds_st.at[buf, w].T, k_st.at[w])
    return acc[...]
  return pl.run_scoped(product, plgpu.ACC((ds_st.shape[3], k_st.shape[2]), jnp.float32))


def _dq_reduce_add(part, staging, dq_dst):
  """TMA reduce-add of one dQ part through this warpgroup's f32 staging tile."""
  # The previous reduce-add from this staging tile has read it.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if isinstance(part, tuple):  # column parts (untiled copies)
    parts.store_columns(staging, part)
  else:
    staging[...] = part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(staging, dq_dst, reduction_op="add")
