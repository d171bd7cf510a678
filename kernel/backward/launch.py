"""The sm90 backward: two warp-specialised Pallas Mosaic GPU kernels.

Both kernels have the forward's shape: three warpgroups along ``wg``;
warpgroups 0 and 1 compute at 232 registers, each on its own 64-row slice of
a stationary tile; warpgroup 2 (40 registers) issues every TMA copy, first
the stationary tiles, then the streamed blocks into a ``num_stages``-deep
ring, through the forward's ring verbs (kernel/sync/ring.py): each slot has
one "produced" mbarrier per streamed buffer and one "consumed" mbarrier
that both compute warpgroups arrive on; the producer waits on it before
every refill but the first ``num_stages``.

The kernels are kernel/backward/dkv.py (dK and dV, and dQ where it is
fused: kernel/backward/fused_dq.py) and kernel/backward/dq.py; head dims
over 128 take the head split (kernel/backward/head_split.py); their tiling
is kernel/tiling/backward_plan.py's.

The residuals are the forward's natural-log m and l: ``lse`` (base 2, what
exp2 needs) is formed here as ``m * log2(e) + log2(l)``; a row with l = 0
(fully masked) gets lse = +inf, so its P is exactly 0.  A forward that
stored m in base 2 would yield wrong gradients here (seed 000)."""

from __future__ import annotations


import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from kernel import padding
from kernel.common import LOG2E
from kernel.sync.seams import seam
from kernel.tiling import plan as plan_lib, schedule as schedule_lib
from kernel.backward.dkv import dkv_call
from kernel.backward.dq import dq_call
from kernel.backward.fused_dq import fixed_point_scales
from kernel.tiling.backward_plan import Backward, BackwardBlocks, fuses_dq, smem_estimates


# Gradients summed across thread blocks in float32 in no fixed order (the
# fused dQ's reduce-adds, unless deterministic=True sums them in fixed
# point): their bits may differ from run to run, within
# harness.numerics.tolerance.run_to_run_bound.  Every other output is bitwise
# reproducible.
ORDER_DEPENDENT_GRADIENTS = ("dq",)


@seam("backward.residual_rows")
def residual_rows(m, l, out, d_out, t_pad: int):
  """(B, N, 2, Tp) f32, the per-row inputs the kernels stream: lse in base 2
  from the forward's natural-log residuals (+inf where l = 0, a fully masked
  row, and in padded rows) and delta = rowsum(dO * O) (0 in padded rows)."""
  t = m.shape[2]
  live = l > 0
  lse2 = jnp.where(live, m * LOG2E + jnp.log2(jnp.where(live, l, 1.0)), jnp.inf)
  # delta in the inputs' own (B, T, N) order, fenced off from the transpose
  # and stack below: XLA fused all three into one kernel several times
  # slower (docs/decisions/delta-fenced.md).
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = jnp.swapaxes(lax.optimization_barrier(delta), 1, 2)
  lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, t_pad - t)), constant_values=jnp.inf)
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_pad - t)))
  return jnp.stack([lse2, delta], axis=2).astype(jnp.float32)


@seam("backward.attention")
def attention_backward(problem: plan_lib.Problem, backward: Backward,
                       query, key, value, bias, mask, k_start, k_end, out, m, l, d_out,
                       *, num_sms: int = schedule_lib.DEFAULT_NUM_SMS):
  """Gradients (dq, dk, dv, dbias) of sum(out * d_out), from the forward's
  residuals, on the sm90 kernels, for ``problem`` (the call's static facts:
  its scale, causal mask, soft cap, lengths, window and ``deterministic``).
  Same contract as ``kernel.backward.xla.xla_backward`` (its
  executable specification): inputs in the compute dtype, unpadded; m
  (natural log) and l (B, N, T).

  dQ is accumulated inside the dK/dV kernel where
  kernel.tiling.backward_plan.fuses_dq allows it (and ``blocks.fuse_dq``),
  else formed by the dQ kernel; with ``problem.deterministic`` the fused dQ
  sums in int32 fixed point (bitwise reproducible: kernel/backward/fused_dq.py)
  instead of float32.  ``backward``: the head dims and tiling resolved with
  the forward (kernel.api.resolve_backward).  ``num_sms``: the GPU's SMs, which the causal launch
  order balances over (kernel.tiling.schedule.LaunchOrder), weighing its
  tiles by the problem's mask (its window, which the key ranges came from).
  """
  blocks, (d, dv_dim) = backward.blocks, backward.head_dims
  fuse_dq = blocks.fuse_dq
  dtype = query.dtype
  batch, t, heads, hd = query.shape
  s, hdv = key.shape[1], value.shape[3]
  _check_smem(problem, (d, dv_dim), dtype, with_bias=bias is not None, fuse_dq=fuse_dq,
              head_dims=(hd, hdv))
  q, k, v, do, (t_pad, s_pad) = padding.backward_inputs(
      query, key, value, d_out, head_dims=(d, dv_dim), blocks=blocks,
      whole_tiles=blocks.whole_tiles)

  rows = residual_rows(m, l, out, d_out, t_pad)

  bias4, mask4, ks, ke, tiles = padding.backward_masks(bias, mask, k_start, k_end, dtype=dtype,
                                                       seq_kv=s, t_pad=t_pad, blocks=blocks)

  query_blocks, inner_blocks = _streamed_query_blocks(
      ks, ke, blocks, seq_kv=s, t_pad=t_pad, s_pad=s_pad, group=heads // key.shape[2])
  swap = lambda x: None if x is None else jnp.swapaxes(x, 2, 3)
  fused = fuse_dq and fuses_dq(blocks, with_bias=bias is not None, causal=problem.mask.causal)
  bias_t, mask_t = swap(bias4), swap(mask4)

  def launch(dq_accum=None, dq_scales=None):
    return dkv_call(problem, blocks, q, k, v, do, rows, bias_t, mask_t, ks, ke,
                    dq_accum=dq_accum, dq_scales=dq_scales, query_blocks=query_blocks,
                    inner_blocks=inner_blocks, num_sms=num_sms, padded=(t_pad, s_pad))
  if fused:
    dq, dkv = _fused_dq(problem, launch, q, k, v, do, rows, blocks=blocks, t_pad=t_pad,
                        group=heads // key.shape[2])
    dq, ds = dq.astype(dtype), None
  else:
    dkv = launch()
    dq, ds = dq_call(problem, blocks, q, k, v, do, rows, bias4, mask4, ks, ke, tiles,
                     want_ds=bias is not None, num_sms=num_sms, padded=(t_pad, s_pad))

  dbias = None
  if bias is not None:
    dbias = _bias_gradient(problem, blocks, ds, tiles, bias, seq_q=t, seq_kv=s)
  return (*padding.backward_results(dq, dkv["dk"], dkv["dv"], seq_q=t, seq_kv=s, head_dim=hd,
                                    head_dim_out=hdv), dbias)


def _check_smem(problem: plan_lib.Problem, padded_dims, dtype, *, with_bias: bool, fuse_dq: bool,
                head_dims):
  """Refuse a launch whose estimated shared memory exceeds the limit."""
  (d, dv_dim), (hd, hdv) = padded_dims, head_dims
  for name, est in smem_estimates(d, dv_dim, dtype, with_bias=with_bias,
                                  causal=problem.mask.causal, fuse_dq=fuse_dq).items():
    if not plan_lib.fits_in_smem(est):  # by construction never; said clearly if it were
      raise ValueError(f"backward launch {name} needs an estimated {est} bytes of shared "
                       f"memory for head_dim={hd}, head_dim_out={hdv}; the limit is "
                       f"{plan_lib.SMEM_LIMIT_BYTES} bytes (227 KiB)")


def _streamed_query_blocks(ks, ke, blocks: BackwardBlocks, *, seq_kv, t_pad, s_pad, group):
  """(query_blocks, inner_blocks) of the dK/dV launch: the query blocks each
  key tile streams, and the run of them inside every row's key range."""
  block_args = dict(seq_kv=seq_kv, num_rows=t_pad, block_q=blocks.dkv_stream_q,
                    key_tile=blocks.dkv_tile, num_key_tiles=s_pad // blocks.dkv_tile,
                    group=group)
  query_blocks = padding.query_block_ranges(ks, ke, **block_args)
  inner_blocks = padding.query_block_inner_bounds(ks, ke, **block_args)
  return query_blocks, inner_blocks


@seam("backward.fused_dq")
def _fused_dq(problem: plan_lib.Problem, launch, q, k, v, do, rows, *, blocks: BackwardBlocks,
              t_pad: int, group: int):
  """(dq in float32, {"dk", "dv"}) from the dK/dV launch with dQ accumulated
  in it, in float32 or (``f.deterministic``) int32 fixed point."""
  fixed_point_dq = problem.deterministic
  # The float32 dQ accumulator is a ref of a state scope of its own
  # (run_state, which hands back its final value), not a jax.new_ref of
  # the traced program: custom_partitioning (kernel/sharding.py) cannot
  # lower a program that holds a mutable array's effect.
  scales = fixed_point_scales(k, v, do, rows, group) if fixed_point_dq else None

  def fused_launch(refs):
    acc, dk, dv = refs
    got = launch(dq_accum=acc, dq_scales=scales)
    dk[...], dv[...] = got["dk"], got["dv"]

  acc_dtype = jnp.int32 if fixed_point_dq else jnp.float32
  # Untiled copies leave the f32 reduce-adds tiled: their rows are whole tiles.
  acc_shape = (q.shape[0], t_pad, *q.shape[2:]) if blocks.untiled_copies else q.shape
  dq_acc, dk_pad, dv_pad = pl.run_state(fused_launch)(
      (jnp.zeros(acc_shape, acc_dtype), jnp.zeros_like(k), jnp.zeros_like(v)))
  dkv = {"dk": dk_pad, "dv": dv_pad}
  dq = dq_acc.astype(jnp.float32) * problem.scale
  if fixed_point_dq:
    # the scales cover the grid's Tp rows; dq those of q
    dq = dq / jnp.swapaxes(scales if acc_shape[1] == t_pad else scales[:, :, :acc_shape[1]],
                           1, 2)[..., None]
  return dq, dkv


@seam("backward.bias_gradient")
def _bias_gradient(problem: plan_lib.Problem, blocks: BackwardBlocks, ds, tiles, bias, *,
                   seq_q: int, seq_kv: int):
  """dbias: the dq kernel's dS summed down to the bias's own shape."""
  # Blocks the dq kernel skipped (outside a tile's key range) are unwritten;
  # every logit there is masked, so their gradient is 0.
  visited = _visited_blocks(ds.shape, tiles, problem, blocks)
  ds = jnp.where(visited, ds, 0.0)[:, :, :seq_q, :seq_kv]
  bias_shape = jnp.shape(bias)
  full = lax.broadcast_to_rank(jnp.zeros(bias_shape, jnp.float32), 4).shape
  summed = jnp.sum(ds, axis=tuple(a for a in range(4) if full[a] == 1), keepdims=True)
  return summed.reshape(bias_shape).astype(bias.dtype)


def _visited_blocks(ds_shape, tiles, problem: plan_lib.Problem, blocks: BackwardBlocks):
  """(B|1, N|1, Tp, Sp) bool: the dS entries the dq kernel wrote."""
  _, _, t_pad, s_pad = ds_shape
  tile, bkv = blocks.dq_tile, blocks.dq_stream_kv
  qi = jnp.arange(t_pad // tile, dtype=jnp.int32)
  if tiles is None:
    lb, ub = problem.mask.key_blocks(qi, tile_q=tile, block_kv=bkv)
    lb, ub = (jnp.broadcast_to(x, qi.shape)[None, None] for x in (lb, ub))
  else:
    start_min, _, _, end_max = tiles
    shape = jnp.broadcast_shapes(start_min.shape, end_max.shape)
    qi3 = jnp.broadcast_to(qi, shape)
    lb, ub = problem.mask.key_blocks(qi3, tile_q=tile, block_kv=bkv,
                                     k_start_min=jnp.broadcast_to(start_min, shape),
                                     k_end_max=jnp.broadcast_to(end_max, shape))
  block = jnp.arange(s_pad, dtype=jnp.int32) // bkv                 # (Sp,)
  lb = jnp.repeat(lb, tile, axis=2)[..., None]                        # (.., Tp, 1)
  ub = jnp.repeat(ub, tile, axis=2)[..., None]
  return (block >= lb) & (block < ub)
