"""A compute warpgroup's pass over one query tile: its start and prologue,
the key loop and the last PV.

The key loop overlaps within a warpgroup (FlashAttention-3): each turn on
the tensor cores issues the next block's QK, then this block's PV; the
softmax of the next block runs as soon as its QK completes, while the PV
still runs, and the accumulator is rescaled once the PV completes
(docs/decisions/forward-intra-warpgroup-overlap.md)."""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.common import NEG_INF, ROW, WGMMA, load_broadcast
from kernel.sync import barriers
from kernel.tiling import plan as plan_lib
from kernel.forward import fp8
from kernel.forward.context import ForwardContext, Tile, key_position, tile_range
from kernel.forward.softmax import rescaled, softmax
from kernel.sync.seams import seam


@seam("mainloop.last_token")
def pass_token_for_the_last_time(c: ForwardContext):
  """Every warpgroup but the last passes once more than it acquires: the
  next one's last acquire (before its last PV) waits for it."""
  last = c.wg == 0 if c.cw == 2 else c.wg < c.cw - 1
  pl.when(last)(lambda: barriers.schedule_release_other(c.wg, c.cw))


@seam("mainloop.tile_start")
def tile_start(c: ForwardContext, b, h, qi, prev_iters, piece=None):
  """The tile's indices and key ranges, the zeroed softmax state and
  accumulator; then wait for its queries and its first key block."""
  lb, ub, k_start_max, k_end_min = tile_range(c, qi, b, h, piece)
  q_base = (c.cw * qi + c.wg) * c.block_q
  rows = pl.ds(q_base, c.block_q)
  row_values = lambda ref: None if ref is None else load_broadcast(
      ref, (b, h, rows), (c.block_q,), ROW)
  t = Tile(b, h, qi, prev_iters, lb, ub, k_start_max, k_end_min, q_base, rows,
           k_start=row_values(c.ks_ref), k_end=row_values(c.ke_ref),
           slot=None if piece is None else piece[2],
           descales=fp8.tile_descales(c.descale_ref, b, h, c.group) if c.problem.fp8 else None)
  m_i = plgpu.layout_cast(jnp.full((c.block_q,), NEG_INF, jnp.float32), ROW)
  l_i = plgpu.layout_cast(jnp.zeros((c.block_q,), jnp.float32), ROW)
  zeros = lambda cols: plgpu.layout_cast(jnp.zeros((c.block_q, cols), jnp.float32), WGMMA)
  if c.layout.untiled_copies:  # one accumulator per column part of the output
    parts, cols = plan_lib.copy_parts(c.head_dim_out, c.problem.output_dtype.itemsize)
    acc = tuple(zeros(cols) for _ in range(parts))
  else:
    acc = zeros(c.head_dim_out)

  c.queries.consumer_wait(c.wg)

  @pl.when(ub > lb)
  def _():
    c.keys.consumer_wait(key_position(c, t, lb))

  return t, acc, m_i, l_i


@seam("mainloop.tile_prologue")
def tile_prologue(c: ForwardContext, t: Tile, m_i):
  """QK of the tile's first block (the loop issues each next one); the
  pending scale, if carried; the end of the blocks that need no mask."""
  s0 = plgpu.layout_cast(jnp.zeros(c.bq_kv, jnp.float32), WGMMA)

  @seam("mainloop.first_qk")
  def first_qk():
    s = qk(c, t, t.lb)
    if not c.staged:
      c.keys.consumer_release(key_position(c, t, t.lb))
    release_query_after(c, t, t.lb)
    return s

  s0 = lax.cond(t.ub > t.lb, first_qk, lambda: s0)
  if c.config.persistent:
    # A tile without key blocks still passes and then acquires the token
    # once, as a one-block tile would: otherwise warpgroup 0 runs a tile
    # ahead, its query refill waits on warpgroup 1's release, and
    # warpgroup 1 waits on warpgroup 0's pass (a deadlock the protocol model
    # found with trip counts [0, 0, 0]).
    @pl.when(t.ub == t.lb)
    def _():
      barriers.schedule_release_other(c.wg, c.cw)
      barriers.schedule_sync(c.wg, c.cw)

  # m_scale, the pending scale acc and l_i are relative to, is carried only
  # when the threshold can leave it behind m_i.
  pending = [] if c.always_rescale else [m_i]
  return s0, pending, plain_blocks(c, t)


def plain_blocks(c: ForwardContext, t: Tile):
  """(lo, hi): the tile's blocks [lo, hi) this warpgroup takes unmasked
  (kernel.masks.Mask.plain_blocks): under key ranges too, so that the
  blocks inside every range keep the unmasked path
  (docs/decisions/forward-plain-blocks-under-key-ranges.md)."""
  return c.problem.mask.plain_blocks(
      t.lb, t.ub, q_base=t.q_base, block_kv=c.block_kv, ragged=c.ragged_kv, edge=c.has_edge,
      k_start_max=None if t.k_start is None else t.k_start_max,
      k_end_min=None if t.k_end is None else t.k_end_min)


def wait_staged(c: ForwardContext, st):
  # The rest of the key phase, right after the QK issue: wait k, issue QK,
  # wait bias/mask, pass the token.
  if c.stage_bias:
    c.keys.consumer_wait(st, "bias")
  if c.stage_mask:
    c.keys.consumer_wait(st, "mask")


def qk(c: ForwardContext, t: Tile, ki):
  """Issue QK^T of key block ki, let the other warpgroup issue, wait."""
  st = key_position(c, t, ki)

  @seam("mainloop.compute_qk")
  def compute_qk(s_ref):
    issue_qk(c, s_ref, st)
    wait_staged(c, st)
    barriers.schedule_release_other(c.wg, c.cw)
    return s_ref[...]

  return pl.run_scoped(compute_qk, plgpu.ACC(c.bq_kv, jnp.float32))


def issue_qk(c: ForwardContext, s_ref, st):
  """wgmma of this warpgroup's queries by the keys in ring slot ``st``
  (transposed) into ``s_ref``: under untiled copies one per column part
  (kernel.tiling.plan.copy_parts), the instructions one wgmma over whole rows
  issues."""
  q, k = c.queries.slot(c.wg), c.keys.slot(st)
  if not c.layout.untiled_copies:
    plgpu.wgmma(s_ref, q, k.T)
    return
  for part in range(q.shape[0]):
    plgpu.wgmma(s_ref, q.at[part], k.at[part].T)


def issue_pv(c: ForwardContext, acc_ref, p16, st):
  """wgmma of p16 by the values in ring slot ``st`` into ``acc_ref``: under
  untiled copies a tuple of accumulators, one per column part; FP8's slot
  holds V^T, read K-major as FP8 wgmma must."""
  v = c.values.slot(st)
  if not c.layout.untiled_copies:
    plgpu.wgmma(acc_ref, p16, v.T if c.problem.fp8 else v)
    return
  for part, ref in enumerate(acc_ref):
    if c.problem.fp8:  # V^T's rows of this part of the output's columns
      cols = ref.shape[1]
      plgpu.wgmma(ref, p16, v.at[pl.ds(part * cols, cols)].T)
    else:
      plgpu.wgmma(ref, p16, v.at[part])


def pv_operand(c: ForwardContext, p):
  """P as the PV product reads it: in the input dtype, or FP8's A operand."""
  return fp8.p_operand(p) if c.problem.fp8 else p.astype(c.dtype)


def each_part(fn, acc):
  """``fn`` of the accumulator, or of each of its parts (a tuple under
  untiled copies)."""
  return tuple(map(fn, acc)) if isinstance(acc, tuple) else fn(acc)


@seam("mainloop.release_query")
def release_query_after(c: ForwardContext, t: Tile, ki):
  if c.config.persistent and not c.layout.overlay_q_with_output:
    # The tile's last QK has completed: the query slot may be refilled.
    pl.when(ki + 1 == t.ub)(lambda: c.queries.consumer_release(c.wg))


@seam("mainloop.key_loop")
def key_loop(c: ForwardContext, t: Tile, s0, acc, m_i, l_i, pending, plain):
  """The tile's key blocks lb .. ub - 1 given the first one's logits s0:
  its softmax, the loop over blocks lb .. ub - 2 (PV of ki, QK and
  softmax of ki + 1), then the last block's PV alone.  The blocks
  ``plain`` = [lo, hi) take the unmasked path, the others the masked one
  (``edge``)."""
  lb, ub = t.lb, t.ub
  lo_plain, ub_plain = plain

  def first_softmax(edge):
    _, p, m, l, pend = softmax(c, t, s0, lb, m_i, l_i, pending, edge=edge)
    if c.staged:  # its staged tiles are read: release the key-phase slot
      c.keys.consumer_release(key_position(c, t, lb))
    return pv_operand(c, p), m, l + p.sum(axis=1), pend

  if c.has_edge:
    is_plain = lambda: lb < ub_plain if t.k_start is None else (lo_plain <= lb) & (lb < ub_plain)
    first = lambda: lax.cond(is_plain(),
                             functools.partial(first_softmax, False),
                             functools.partial(first_softmax, True))
  else:
    first = functools.partial(first_softmax, False)

  if c.problem.fp8:
    p16 = fp8.p_zeros(c.bq_kv)
  else:
    p16 = plgpu.layout_cast(jnp.zeros(c.bq_kv, c.dtype), WGMMA)
  p16, m, l, pend = lax.cond(ub > lb, first, lambda: (p16, m_i, l_i, pending))
  carry = (acc, p16, m, l, *pend)
  last = lax.max(lb, ub - 1)
  body = functools.partial(loop_body, c, t)
  if c.has_edge:
    # Iteration ki masks block ki + 1: plain while lo_plain <= ki + 1 < ub_plain.
    split = lax.min(last, lax.max(lb, ub_plain - 1))
    if t.k_start is not None:
      start = lax.min(split, lax.max(lb, lo_plain - 1))
      carry = lax.fori_loop(lb, start, functools.partial(body, edge=True), carry)
    else:
      start = lb
    carry = lax.fori_loop(start, split, functools.partial(body, edge=False), carry)
    carry = lax.fori_loop(split, last, functools.partial(body, edge=True), carry)
  else:
    carry = lax.fori_loop(lb, last, functools.partial(body, edge=False), carry)
  acc, p16, m, l, *pend = carry
  acc = lax.cond(ub > lb, functools.partial(last_pv, c, t, last, p16), lambda a: a, acc)
  return acc, m, l, pend


@seam("mainloop.loop_body")
def loop_body(c: ForwardContext, t: Tile, ki, carry, *, edge):
  """PV of key block ki and QK of block ki + 1 in one turn on the tensor
  cores (QK issued first), then the softmax of block ki + 1 as soon as
  its QK completes, while the PV still runs (FlashAttention-3's
  intra-warpgroup overlap); the PV's result is rescaled once it
  completes.  ``edge``: whether block ki + 1 may reach the diagonal or
  the last key (the masked path)."""
  acc, p16, m_i, l_i, *pending = carry
  st, next_st = key_position(c, t, ki), key_position(c, t, ki + 1)
  c.values.consumer_wait(st)
  barriers.schedule_sync(c.wg, c.cw)

  @seam("mainloop.issue_then_softmax")
  def issue_then_softmax(refs):
    acc_ref, s_ref, factor_ref, p_ref, m_ref_, l_ref_, *pending_refs = refs
    c.keys.consumer_wait(next_st)
    issue_qk(c, s_ref, next_st)
    issue_pv(c, acc_ref, p16, st)
    wait_staged(c, next_st)
    barriers.schedule_release_other(c.wg, c.cw)
    # wgmma groups complete in issue order: at most one in flight means
    # the QK is done, the PV may still run.
    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
    factor, p, m_new, l_new, pend = softmax(
        c, t, s, ki + 1, m_ref_[...], l_ref_[...], [r[...] for r in pending_refs],
        edge=edge)
    factor_ref[...] = factor
    # p stays float32 here; the operand cast waits for the PV below.
    # The PV still in flight reads this block's p16 from registers, and
    # the register allocator may give the next p16 those very registers:
    # written while the PV runs, ptxas then serialises every wgmma of
    # the kernel (warning C7513; docs/decisions/pv-operand-cast-after-pv.md).
    # Cast after the PV completes, no register it reads is rewritten in
    # flight.
    p_ref[...] = p
    m_ref_[...] = m_new
    l_ref_[...] = l_new + p.sum(axis=1)
    for r, v in zip(pending_refs, pend):
      r[...] = v

  # run_state returns once both products completed.  (m_i stands in as
  # the initial value of the factor, a row vector like it.)
  p_init = plgpu.layout_cast(jnp.zeros(c.bq_kv, jnp.float32), WGMMA)
  acc, _, factor, p, m_i, l_i, *pending = pl.run_state(issue_then_softmax)(
      (each_part(plgpu.ACC.init, acc), plgpu.ACC.init(jnp.zeros(c.bq_kv, jnp.float32)),
       m_i, p_init, m_i, l_i, *pending))
  p16 = pv_operand(c, p)
  # Releases: v of block ki, then k
  # (and a staged tile, read by the softmax) of block ki + 1, then the
  # queries after a persistent tile's last QK.
  c.values.consumer_release(st)
  c.keys.consumer_release(next_st)
  release_query_after(c, t, ki + 1)
  return (each_part(lambda a: rescaled(a, factor), acc), p16, m_i, l_i, *pending)


@seam("mainloop.last_pv")
def last_pv(c: ForwardContext, t: Tile, last, p16, acc):
  """The PV of the tile's last key block, alone."""
  st = key_position(c, t, last)
  c.values.consumer_wait(st)
  barriers.schedule_sync(c.wg, c.cw)

  @seam("mainloop.last_pv.pv")
  def pv(acc_ref):
    issue_pv(c, acc_ref, p16, st)
  acc = pl.run_state(pv)(each_part(plgpu.ACC.init, acc))
  c.values.consumer_release(st)
  return acc
