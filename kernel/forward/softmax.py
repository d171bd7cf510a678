"""One key block's logits and online softmax, in registers.

Logits are scaled with log2(e) folded into the scale once, exp2 everywhere;
the running max ``m_i`` is in base 2, the rescale is guarded by
``rescale_threshold`` with the pending scale ``m_scale``; masked logits are
-inf, and a "safe base" keeps fully masked rows at out = 0, m = -inf, l = 0.
The executable model of this arithmetic is
harness/numerics/online_softmax_model.py."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.common import LOG2E, NEG_INF, WGMMA, load_broadcast
from kernel.forward import fp8
from kernel.forward.context import ForwardContext, Tile, key_position
from kernel.masks.selects import masked_logits
from kernel.sync.seams import seam


@seam("softmax.safe")
def safe(x):
  # exp2(x - base) with base = -inf would be NaN; rows that have seen no
  # unmasked key use base 0, where every p is exp2(-inf) = 0.
  return jnp.where(x == NEG_INF, 0.0, x)


@seam("softmax.rescaled")
def rescaled(acc, factor):
  """acc with row i times factor[i]: at every key block, whatever
  ``rescale_threshold``.  Skipping the multiply in warps whose factors are
  all exactly 1 gives the same bits, but the branch (``vote.sync.any`` and
  an ``scf.if`` over the accumulator registers) costs more than the
  multiply (docs/decisions/rescale-every-block.md)."""
  return acc * lax.broadcast_in_dim(factor, acc.shape, [0])


def staged_tile(c: ForwardContext, t: Tile, buffer, ki):
  """This warpgroup's rows of key block ki's staged bias/mask tile
  (waited for in wait_staged; released with the keys after this)."""
  tile = c.keys.slot(key_position(c, t, ki), buffer)
  rows = lambda w: lambda: plgpu.load(tile.at[pl.ds(w * c.block_q, c.block_q)],
                                      layout=WGMMA, optimized=False)
  if c.cw == 2:
    return lax.cond(c.wg == 0, rows(0), rows(1))
  return lax.switch(c.wg, [rows(w) for w in range(c.cw)])


@seam("softmax.logits")
def logits(c: ForwardContext, t: Tile, s, ki, *, edge):
  """Scaled base-2 logits of one block, masked to -inf; returns (s, sc)
  with the true logits being s * sc (deferred so exp2 fuses, where sc > 0:
  the row max of s * sc is then the row max of s times sc).
  ``edge``: the block may reach the diagonal or the last (ragged) key."""
  problem, block_kv, bq_kv = c.problem, c.block_kv, c.bq_kv
  k_base = ki * block_kv
  sc = problem.scale
  # Descales are > 0 (kernel.call), so sc's sign is known while tracing.
  positive = problem.scale > 0 or c.bias_ref is not None or problem.logits_soft_cap is not None
  if t.descales is not None:  # FP8: q.k of the stored values
    sc = sc * t.descales[0]
  if c.stage_bias:
    bias = staged_tile(c, t, "bias", ki)
    s, sc = s * sc + bias.astype(jnp.float32), 1.0
  elif c.bias_ref is not None:
    bias = load_broadcast(c.bias_ref, (t.b, t.h, t.rows, pl.ds(k_base, block_kv)),
                          bq_kv, WGMMA)
    s, sc = s * sc + bias.astype(jnp.float32), 1.0
  if problem.logits_soft_cap is not None:
    s, sc = jnp.tanh(s * (sc / problem.logits_soft_cap)), problem.logits_soft_cap
  sc *= LOG2E
  if positive and not (c.masks_any_block or edge):
    return s, sc
  s = s * sc
  s = masked_logits(problem.mask, s, q_base=t.q_base, k_base=k_base, edge=edge,
                    ragged=c.ragged_kv, k_start=t.k_start, k_start_max=t.k_start_max,
                    k_end=t.k_end, k_end_min=t.k_end_min)
  if c.stage_mask:
    keep = staged_tile(c, t, "mask", ki)
    s = jnp.where(keep != 0, s, NEG_INF)
  elif c.mask_ref is not None:
    keep = load_broadcast(c.mask_ref, (t.b, t.h, t.rows, pl.ds(k_base, block_kv)),
                          bq_kv, WGMMA)
    s = jnp.where(keep != 0, s, NEG_INF)
  return s, 1.0


@seam("softmax.softmax")
def softmax(c: ForwardContext, t: Tile, s, ki, m_i, l_i, pending, *, edge):
  """Online softmax of key block ki's raw logits s: returns the factor
  that brings the accumulator (and, already applied, l_i) to the new
  reference max, p, and the new (m_i, l_i, pending).

  Every exp2 goes to the MUFU unit: this loop is issue- and latency-bound,
  not MUFU-bound, so emulating some with a cubic on the FMA pipe (as
  FlashAttention-3 does on Blackwell) only slows it
  (docs/decisions/exp2-on-mufu.md)."""
  s, sc = logits(c, t, s, ki, edge=edge)
  m_ij = jnp.maximum(m_i, s.max(axis=1) * sc)
  if c.always_rescale:
    base = safe(m_ij)
    factor = jnp.exp2(m_i - base)
    l_i = l_i * factor
  else:
    (m_scale,) = pending
    alpha = jnp.exp2(m_scale - safe(m_ij))
    rescale = (alpha < c.threshold) | (m_scale == NEG_INF)
    factor = jnp.where(rescale, alpha, 1.0)
    l_i = l_i * factor
    m_scale = jnp.where(rescale, m_ij, m_scale)
    pending = [m_scale]
    base = safe(m_scale)
  if c.problem.fp8:  # P in [0, 2^8] for e4m3
    base = base - fp8.P_SCALE_LOG2
  p = jnp.exp2(s * sc - lax.broadcast_in_dim(base, s.shape, [0]))
  return factor, p, m_ij, l_i, pending
