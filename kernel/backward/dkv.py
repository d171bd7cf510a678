"""The dK/dV kernel.

A block owns ``2 * block_kv`` keys of one key/value head (K and V
stationary) and streams, for every query head of its group and every query
block that can see its keys, (q, dO, [lse, delta]).  Per block it forms
S^T = K Q^T, P^T = exp2(S^T - lse) from the forward's residuals,
dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.  GQA
sums over the group inside the kernel.  With the fused dQ
(kernel.tiling.backward_plan.fuses_dq) it also forms dQ_i's part over its
keys and reduce-adds it (kernel/backward/fused_dq.py)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel.common import COL, ROW, WGMMA, batch_head, load_broadcast
from kernel.sync import barriers, ring as ring_lib
from kernel.sync.seams import seam
from kernel.tiling import schedule as schedule_lib
from kernel.backward import parts
from kernel.backward.context import (CW, _Launch, _allocate, _barrier_refs, _copy_views,
                                     _memory_warpgroup)
from kernel.backward.fused_dq import (_dq_product, _dq_reduce_add, dq_owner, ds_buffer,
                                      to_fixed_point)
from kernel.backward.head_split import _shared_slot, exchange_buffer
from kernel.backward.scores import _step_scores
from kernel.masks.selects import KeysBelow
from kernel.tiling.backward_plan import BackwardBlocks, copy_row, dkv_buffers, dkv_mbarriers
from kernel.tiling.plan import Problem


@dataclasses.dataclass(frozen=True)
class DkvKernel(_Launch):
  """One dK/dV launch: its own sizes and switches (set by :func:`dkv_call`)
  and, inside the kernel, its grid point (set by :func:`_dkv_kernel`)."""

  head_dim_out: int
  nq: int                   # streamed query blocks of the padded length
  fused: bool               # dQ accumulated here (into dq_ref)
  # Inside the kernel:
  j: Any = None             # the key tile
  lo: Any = None            # the first query block that sees the tile's keys
  per_head: Any = None      # query blocks per query head
  steps: Any = None         # per_head for every query head of the group
  out_refs: tuple = ()
  k_st: Any = None          # the stationary tiles, which stage dK and dV at the end
  v_st: Any = None
  dq_st: Any = None
  stationary: ring_lib.WarpgroupSlots | None = None   # k and v per compute warpgroup
  stream: ring_lib.Ring | None = None                  # q, rows, dO per query block

  # Keys per warpgroup (stationary), queries per streamed block, and S^T's
  # shape (keys x queries).
  bkv = property(lambda self: self.blocks.rows)
  bq = property(lambda self: self.blocks.dkv_stream_q)
  shape_t = property(lambda self: (self.bkv, self.bq))


def key_tile_weights(problem: Problem, blocks: BackwardBlocks, *, group: int, t_pad: int,
                     s_pad: int) -> list[int]:
  """Per key tile, the query blocks the dK/dV kernel streams for it (times
  the group's query heads), by the call's mask
  (:meth:`kernel.masks.Mask.key_tile_blocks`)."""
  tile, bq = blocks.dkv_tile, blocks.dkv_stream_q
  return [group * problem.mask.key_tile_blocks(r, key_tile=tile, block_q=bq, num_blocks=t_pad // bq)
          for r in range(s_pad // tile)]


def dkv_launch_order(problem: Problem, blocks: BackwardBlocks, *, batch: int,
                     num_kv_heads: int, group: int, t_pad: int, s_pad: int,
                     head_dims: tuple[int, int], dtype, fused: bool,
                     num_sms: int) -> schedule_lib.LaunchOrder | None:
  """The dK/dV grid's launch order under causal (None: head by head): see
  :func:`dkv_call`.  A local window the key ranges come from (the mask's)
  evens the tiles' work out."""
  if not problem.mask.causal:
    return None
  order = schedule_lib.LaunchOrder.for_grid(
      num_kv_heads * batch, s_pad // blocks.dkv_tile, num_sms=num_sms,
      unit_bytes=group * t_pad * sum(head_dims) * jnp.dtype(dtype).itemsize)
  # With the fused dQ, or under a window, sections only where they repay
  # their spread of the blocks in flight (kernel.tiling.schedule.MIN_SECTION_GAIN).
  if (fused or problem.mask.window is not None) and not schedule_lib.sections_repay(
      order, key_tile_weights(problem, blocks, group=group, t_pad=t_pad, s_pad=s_pad), num_sms):
    return None
  return order


def dkv_call(problem: Problem, blocks: BackwardBlocks, q, k, v, do, rows, bias_t, mask_t, k_start,
             k_end, *, dq_accum=None, dq_scales=None, query_blocks=None,
             inner_blocks=None, num_sms: int = schedule_lib.DEFAULT_NUM_SMS,
             padded: tuple[int, int] | None = None):
  """{"dk": dK, "dv": dV}, each as long as k.

  q (B, T, N, D), k (B, S, K, D), v (B, S, K, Dv), do (B, T, N, Dv), each
  read past its end as zeros up to ``padded`` (Tp, Sp), the whole tiles the
  grid covers (None: T and S are whole tiles); rows
  (B, N, 2, Tp) f32 = [lse2, delta]; bias_t / mask_t: bias and mask with T and
  S swapped (dims 1 or full); k_start / k_end (B|1, N|1, Tp|1) int32;
  ``query_blocks``: None or (lo, hi), each (B|1, K|1, key tiles) int32, the
  query blocks each key tile streams (kernel.padding.query_block_ranges);
  ``inner_blocks``: None or (B|1, K|1, 2, key tiles) int32, the run of them
  wholly inside every row's range (kernel.padding.query_block_inner_bounds).

  ``dq_accum``: a zeroed (B, T, N, D) f32 ref; when given (where
  :func:`fused_dq_fits`), the kernel also adds each key tile's part of
  dQ / scale into it (kernel/backward/fused_dq.py).  With ``dq_scales``
  ((B, N, Tp) f32, powers of two: :func:`fixed_point_scales`) ``dq_accum``
  is int32 and each part is added in fixed point, times its row's scale
  (order-independent: the notes above
  :data:`kernel.backward.fused_dq.FIXED_POINT_BITS`).

  Under causal the key tiles launch in
  sections of (kv head, batch) units, heaviest first across a section
  (:class:`kernel.tiling.schedule.LaunchOrder` for ``num_sms`` SMs); a section's
  units re-read their query heads' Q and dO.  With the fused dQ only where
  the dealing model predicts a gain of MIN_SECTION_GAIN or more
  (:func:`kernel.tiling.schedule.sections_repay`).  Under a local
  window (the mask's: jax.nn's (left, right), which the key ranges come
  from) the tiles' work is even but at the ends, and the sections lost; so there
  they are taken only where the dealing model, weighing each tile by the
  window (:func:`key_tile_weights`), predicts a gain, as with the fused
  dQ.  Packed documents (ranges the launch cannot see) keep them
  (docs/decisions/backward-causal-launch-order.md).
  """
  batch, t, num_heads, head_dim = q.shape
  _, s, num_kv_heads, head_dim_out = v.shape
  t_pad, s_pad = padded or (t, s)
  dtype = q.dtype
  fused = dq_accum is not None
  if fused and blocks.head_split:
    raise ValueError("the head-split dK/dV launch does not accumulate dQ (fused_dq_fits)")
  group = num_heads // num_kv_heads
  order = dkv_launch_order(problem, blocks, batch=batch, num_kv_heads=num_kv_heads, group=group,
                           t_pad=t_pad, s_pad=s_pad, head_dims=(head_dim, head_dim_out),
                           dtype=dtype, fused=fused, num_sms=num_sms)
  kernel = DkvKernel(problem=problem, blocks=blocks, head_dim=head_dim,
                     head_dim_out=head_dim_out, dtype=dtype, num_kv_heads=num_kv_heads,
                     group=group, nq=t_pad // blocks.dkv_stream_q, s_pad=s_pad, fused=fused,
                     order=order)

  if (dq_scales is not None) != (fused and dq_accum.dtype == jnp.int32):
    raise ValueError("the fixed-point dQ takes an int32 dq_accum and dq_scales together")
  untiled = blocks.untiled_copies
  if untiled:  # rows in column parts (kernel.tiling.backward_plan.copy_row): free reshapes
    q, k, v, do = (x.reshape(*x.shape[:3], *copy_row(blocks, x.shape[3], dtype))
                   for x in (q, k, v, do))
  results = _dkv_launch(kernel, batch=batch, seq_kv=s, dq_accum=dq_accum)(
      q, k, v, do, rows, bias_t, mask_t, k_start, k_end,
      *(query_blocks if query_blocks is not None else (None, None)), inner_blocks, dq_scales,
      dq_accum)
  if untiled:
    results = [x.reshape(*x.shape[:3], -1) for x in results]
  return dict(zip(("dk", "dv"), results))


def _dkv_launch(kernel: DkvKernel, *, batch: int, seq_kv: int, dq_accum):
  """The dK/dV ``plgpu.kernel`` of ``kernel``: its scratch, outputs and grid."""
  blocks, dtype, num_kv_heads = kernel.blocks, kernel.dtype, kernel.num_kv_heads
  head_dim, head_dim_out = kernel.head_dim, kernel.head_dim_out

  def body(*refs):
    _dkv_kernel(kernel, *refs)

  scratch = [_allocate(dkv_buffers(blocks, head_dim, head_dim_out, dtype, fused=kernel.fused,
                                   dq_dtype=np.float32 if dq_accum is None else dq_accum.dtype),
                       blocks.untiled_copies),
             _barrier_refs(dkv_mbarriers(blocks))]
  out_type = [jax.ShapeDtypeStruct((batch, seq_kv, num_kv_heads, *copy_row(blocks, d, dtype)),
                                   dtype)
              for d in (head_dim, head_dim_out)]
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch,
      # Mosaic GPU launches the LAST grid dimension fastest (blockIdx.x):
      # here the key tiles, so that the blocks in flight at once are the
      # tiles of a few heads, which read the same Q and dO, and under causal
      # each head's tiles with the most query blocks start first
      # (docs/decisions/dkv-grid-key-tiles-fastest.md).
      # Under causal, _at_key_tile remaps a block's launch index through
      # kernel.tiling.schedule (sections of heads, heaviest first across them).
      grid=(num_kv_heads, batch, kernel.s_pad // blocks.dkv_tile),
      grid_names=("kv_heads", "batch", "kv_tiles"),
      num_threads=barriers.NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
  )


def _dkv_kernel(c: DkvKernel, q_ref, k_ref, v_ref, do_ref, rows_ref, bias_ref, mask_ref,
                ks_ref, ke_ref, qlo_ref, qhi_ref, inner_ref, dq_scales_ref, dq_ref, dk_ref, dv_ref,
                scratch, bars):
  """The dK/dV kernel's entry: its rings over the scratch, the key tile of
  this grid point and the query blocks it visits, each warpgroup's role
  (the head split's where ``c.blocks.head_split``)."""
  k_st, v_st, q_ring, do_ring, rows_ring, *staging = scratch
  k_stat, v_stat, q_prod, do_prod, rows_prod, consumed = bars
  read, views = _copy_views(c.untiled, dict(k=k_st, v=v_st, q=q_ring, do=do_ring))
  k_st, v_st, q_ring, do_ring = (read[n] for n in ("k", "v", "q", "do"))
  # K and V stationary, filled once: one tile per compute warpgroup, or one
  # for both under the head split; each step streams a query block's q,
  # residual rows and dO.
  stationary = ring_lib.WarpgroupSlots({"k": (k_st, k_stat), "v": (v_st, v_stat)},
                                       copy_views={n: views[n] for n in ("k", "v") if n in views})
  stream = ring_lib.Ring(c.blocks.num_stages, {"q": (q_ring, q_prod),
                                               "rows": (rows_ring, rows_prod),
                                               "do": (do_ring, do_prod)}, consumed,
                         {n: views[n] for n in ("q", "do") if n in views})
  split = c.blocks.head_split
  # The rest of the scratch: the fused dQ's dS^T and f32 staging (None
  # without it), or the head split's exchange buffers of P^T and dS^T.
  ds_st, dq_st = (None, None) if split else staging
  c = dataclasses.replace(
      _at_key_tile(c, qlo_ref, qhi_ref, inner_ref),
      q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, do_ref=do_ref, rows_ref=rows_ref,
      bias_ref=bias_ref, mask_ref=mask_ref, ks_ref=ks_ref, ke_ref=ke_ref, dq_ref=dq_ref,
      dq_scales_ref=dq_scales_ref, out_refs=(dk_ref, dv_ref), k_st=k_st, v_st=v_st, ds_st=ds_st,
      dq_st=dq_st,
      exchange=tuple(staging) if split else None, stationary=stationary, stream=stream,
      views=views)
  pl.when(c.wg < CW)(functools.partial(_wide_compute if split else _dkv_compute, c))
  pl.when(c.wg == CW)(lambda: _memory_warpgroup(
      functools.partial(_wide_load_stationary if split else _dkv_load_stationary, c),
      functools.partial(_dkv_fill, c), 0, c.steps, stream))


def _at_key_tile(c: DkvKernel, qlo_ref, qhi_ref, inner_ref) -> DkvKernel:
  """``c`` at this grid point: the warpgroup, the key tile, and the query
  blocks that can see any of the tile's keys (causal: from the tile's first
  key on; key ranges: the band the table gives, which a local window or
  packed documents narrow to the blocks that reach the tile), for every
  query head of the group in turn."""
  wg = lax.axis_index("wg")
  j, hk, b = (lax.axis_index(n) for n in ("kv_tiles", "kv_heads", "batch"))
  if c.order is not None:
    # The grid launches kv_tiles fastest, then batch, then kv_heads; unit
    # u = hk * batch + b, and rank r is key tile r (the most query blocks
    # see the first).
    batch = jnp.int32(c.order.units // c.num_kv_heads)
    unit, j = c.order.locate((hk * batch + b) * jnp.int32(c.order.tiles) + j)
    hk, b = lax.div(unit, batch), lax.rem(unit, batch)
  lo = c.problem.mask.first_query_block(j, key_tile=c.blocks.dkv_tile, block_q=c.bq)
  hi = jnp.int32(c.nq)
  if qlo_ref is not None:
    lo = lax.max(lo, qlo_ref[(*batch_head(qlo_ref, b, hk), j)])
    hi = lax.min(hi, qhi_ref[(*batch_head(qhi_ref, b, hk), j)])
  lo = lax.min(lo, jnp.int32(c.nq))
  inner_lo = inner_hi = None
  if inner_ref is not None:
    bh = batch_head(inner_ref, b, hk)
    inner_lo, inner_hi = inner_ref[(*bh, 0, j)], inner_ref[(*bh, 1, j)]
  per_head = lax.max(hi - lo, jnp.int32(0))
  return dataclasses.replace(c, wg=wg, j=j, hk=hk, b=b, lo=lo, per_head=per_head,
                             steps=per_head * c.group, qlo_ref=qlo_ref, qhi_ref=qhi_ref,
                             inner_lo=inner_lo, inner_hi=inner_hi)


@seam("dkv.coords")
def _dkv_coords(c: DkvKernel, t):
  """(query head, query block) of step t: every key tile walks its query
  blocks in order, so without causal the tiles in flight add their dQ parts
  into the same block at about the same time.  Starting key tile j's walk
  at block j instead (wrapping around), so that they add into different
  blocks, gained nothing: the reduce-adds do not wait on each other
  (docs/decisions/dkv-query-walk-in-order.md)."""
  return c.hk * c.group + lax.div(t, c.per_head), c.lo + lax.rem(t, c.per_head)


def _dkv_load_stationary(c: DkvKernel):
  for w in range(CW):
    rows_w = pl.ds((CW * c.j + w) * c.bkv, c.bkv)
    c.stationary.producer_copy(c.k_ref.at[c.b, rows_w, c.hk], w, "k")
    c.stationary.producer_copy(c.v_ref.at[c.b, rows_w, c.hk], w, "v")


def _dkv_fill(c: DkvKernel, t, st):
  h, i = _dkv_coords(c, t)
  qrows = pl.ds(i * c.bq, c.bq)
  stream = c.stream
  stream.producer_copy(c.q_ref.at[c.b, qrows, h], st, "q")
  stream.producer_copy(c.rows_ref.at[c.b, h, :, qrows], st, "rows")
  stream.producer_copy(c.do_ref.at[c.b, qrows, h], st, "do")


@seam("dkv.compute")
def _dkv_compute(c: DkvKernel):
  """A compute warpgroup: its 64 keys' dK/dV over every step, then the
  results staged in the stationary tiles and stored."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  kv_base = (CW * c.j + wg) * c.bkv
  c.stationary.consumer_wait(wg, "k")
  c.stationary.consumer_wait(wg, "v")
  dk_acc = parts.zeros(c.bkv, c.head_dim, parts.columns(c.k_st, c.untiled))
  dv_acc = parts.zeros(c.bkv, c.head_dim_out, parts.columns(c.v_st, c.untiled))
  dk_acc, dv_acc = lax.fori_loop(0, c.steps, functools.partial(_dkv_step, c, kv_base),
                                 (dk_acc, dv_acc))
  if c.fused:  # the last dQ product has read both K tiles before they stage dK
    barriers.epilogue_sync()
  # The stationary tiles are no longer read: they stage the results.
  rows_out = pl.ds(kv_base, c.bkv)
  results = {"dk": (dk_acc, c.k_st), "dv": (dv_acc, c.v_st)}
  for name, ref in zip(("dk", "dv"), c.out_refs):
    acc, buf = results[name]
    if c.untiled:  # column parts (kernel/backward/parts.py)
      scale = c.problem.scale if name == "dk" else None
      parts.store(buf.at[wg], tuple((a if scale is None else a * scale).astype(c.dtype)
                                    for a in acc))
      continue
    if name == "dk":
      acc = acc * c.problem.scale
    buf.at[wg][...] = acc.astype(c.dtype)
  plgpu.commit_smem()
  for name, ref in zip(("dk", "dv"), c.out_refs):
    staged = c.copied(name[1], results[name][1])
    plgpu.copy_smem_to_gmem(staged.at[wg], ref.at[c.b, rows_out, c.hk])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if c.fused:  # the last dQ reduce-add has landed before the kernel ends
    plgpu.wait_smem_to_gmem(0)


def _step_operands(c: DkvKernel, t):
  """Step t's ring position, query head h, query block i, its first row, and
  its q and dO slots, once the block's q, rows and dO have landed."""
  stream = c.stream
  st = stream.position(t)
  h, i = _dkv_coords(c, t)
  q_base = i * c.bq
  stream.consumer_wait(st, "q")
  stream.consumer_wait(st, "rows")
  stream.consumer_wait(st, "do")
  return (st, h, i, q_base, parts.of(stream.slot(st, "q"), c.untiled),
          parts.of(stream.slot(st, "do"), c.untiled))


@seam("dkv.step")
def _dkv_step(c: DkvKernel, kv_base, t, carry):
  """Step t: query block i of query head h against this warpgroup's keys:
  P^T and dS^T (:func:`_step_scores`), dV += P^T dO and dK += dS^T Q, and
  with the fused dQ this block's part of dQ by the step's owner."""
  dk_acc, dv_acc = carry
  wg, b, stream = c.wg, c.b, c.stream
  st, h, i, q_base, q_slot, do_slot = _step_operands(c, t)
  scales = None
  if c.dq_scales_ref is not None:  # loaded early: the owner needs it last
    scales = load_broadcast(c.dq_scales_ref, (b, h, pl.ds(q_base, c.bq)), (c.bq,), ROW)
  stationary = lambda name: parts.of(c.stationary.slot(wg, name), c.untiled)
  p, ds = _dkv_scores(c, st, i, h, kv_base, q_base, c.bq,
                      s_ops=(stationary("k"), q_slot), dp_ops=(stationary("v"), do_slot),
                      rows=lambda r: stream.slot(st, "rows", r))
  if c.fused:
    # This warpgroup's dS^T into the step's staging buffer, visible to
    # the tensor cores (fence), then the step's rendezvous: right after
    # the store, so that the owner waits for the other warpgroup's
    # dS^T and not for its dK/dV products as well
    # (docs/decisions/fused-dq-rendezvous-after-store.md).
    c.ds_st.at[ds_buffer(t), wg][...] = ds.astype(c.dtype)
    plgpu.commit_smem()
    barriers.ds_ready(dq_owner(t), wg)
  # dV += P^T dO and dK += dS^T Q: issued together, waited once.
  accs = {"dv": dv_acc, "dk": dk_acc}

  @seam("dkv.step.grads")
  def grads(refs):
    if c.untiled:  # dV and dK in column parts, one wgmma each
      for n, (a, b) in (("dv", (p, do_slot)), ("dk", (ds, q_slot))):
        if n in refs:
          parts.issue_ab(refs[n], a.astype(c.dtype), b)
      return
    if "dv" in refs:
      plgpu.wgmma(refs["dv"], p.astype(c.dtype), do_slot)
    if "dk" in refs:
      plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot)

  init = lambda a: parts.each(plgpu.ACC.init, a)
  if c.blocks.schedule == "paired":
    accs = pl.run_state(grads)({n: init(a) for n, a in accs.items()})
  else:
    for n in list(accs):
      accs[n] = pl.run_state(grads)({n: init(accs[n])})[n]
  dv_acc, dk_acc = accs.get("dv"), accs.get("dk")
  # Every product reading the slot has completed (run_state waits).
  stream.consumer_release(st)
  if c.fused:
    # The step's owner forms its dQ part (both dS^T tiles are staged:
    # the rendezvous above) and reduce-adds it.
    @pl.when(wg == dq_owner(t))
    def _():
      part = _dq_product(c.ds_st, ds_buffer(t), c.k_st, c.untiled)
      if scales is not None:
        part = parts.each(lambda x: to_fixed_point(x, scales, c.head_dim), part)
      _dq_reduce_add(part, c.dq_st.at[wg], c.dq_ref.at[b, pl.ds(q_base, c.bq), h])
  return dk_acc, dv_acc


def _dkv_scores(c: DkvKernel, st, i, h, kv_base, q_base, num_queries, *, s_ops, dp_ops, rows):
  """P^T and dS^T (None without dK) of one step's (keys x queries) tile:
  the tile's keep terms, then :func:`_step_scores`.  ``q_base``,
  ``num_queries``: the tile's queries (a part of query block ``i``);
  ``rows(r)``: their lse2 (r = 0) and delta (r = 1) in shared memory."""
  b = c.b
  shape = (c.bkv, num_queries)
  tile = (b, h, pl.ds(kv_base, c.bkv), pl.ds(q_base, num_queries))

  def per_query(ref):  # k_start / k_end of the tile's queries, along the tile
    v = load_broadcast(ref, (b, h, pl.ds(q_base, num_queries)), (num_queries,), COL)
    return lax.broadcast_in_dim(v, shape, [1])

  # With key ranges, only the steps outside the tile's run of query blocks
  # wholly inside every row's range (c.inner_lo, c.inner_hi; the table
  # leaves out tiles with padded keys) apply the range and padded-key terms
  # (_masked_terms).  Without ranges the padded-key term stays on every
  # step: a branch on the tile holding padded keys instead ran slower
  # (docs/decisions/padded-key-term-every-step.md).
  edge_terms, terms = [], []
  if c.ks_ref is not None:
    edge_terms.append(lambda key: key >= per_query(c.ks_ref))
  if c.ke_ref is not None:
    edge_terms.append(lambda key: key < per_query(c.ke_ref))
  if c.mask_ref is not None:
    terms.append(lambda key: load_broadcast(c.mask_ref, tile, shape, WGMMA) != 0)
  if c.fused and (c.problem.seq_kv % c.bkv or c.s_pad != c.problem.seq_kv):
    # padded keys add nothing to dQ
    (edge_terms if edge_terms else terms).append(KeysBelow(c.problem.seq_kv))
  inside = None
  if edge_terms:
    inside = lambda: (c.inner_lo <= i) & (i < c.inner_hi)
  return _step_scores(
      c.problem, shape, s_ops=s_ops, dp_ops=dp_ops, paired=c.blocks.schedule == "paired",
      want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(
          c.bias_ref, tile, shape, WGMMA),
      terms=terms, key_dim=0, key_base=kv_base, num_keys=c.bkv, query_base=q_base,
      edge_terms=edge_terms, interior=inside,
      lse2_of=lambda: plgpu.load(rows(0), layout=COL, optimized=False),
      delta_of=lambda: plgpu.load(rows(1), layout=COL, optimized=False))


def _wide_load_stationary(c: DkvKernel):
  keys = pl.ds(c.j * c.bkv, c.bkv)
  c.stationary.producer_copy(c.k_ref.at[c.b, keys, c.hk], 0, "k")
  c.stationary.producer_copy(c.v_ref.at[c.b, keys, c.hk], 0, "v")


@seam("dkv.wide_compute")
def _wide_compute(c: DkvKernel):
  """A compute warpgroup of the head-split launch: its half of the head dim
  of dK and dV over every step, then staged in the stationary tiles and
  stored, one output by each warpgroup."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  c.stationary.consumer_wait(_shared_slot(c), "k")
  c.stationary.consumer_wait(_shared_slot(c), "v")
  dk_cols, dv_cols = c.head_dim // CW, c.head_dim_out // CW
  zeros = lambda d, buf: parts.zeros(c.bkv, d, parts.columns(buf, c.untiled))
  dk_acc, dv_acc = lax.fori_loop(0, c.steps, functools.partial(_wide_step, c),
                                 (zeros(dk_cols, c.k_st), zeros(dv_cols, c.v_st)))
  # K and V are free to stage dK and dV: each step's last reads of them (S^T
  # and dP^T) precede its rendezvous, which both warpgroups passed.
  if c.untiled:  # this warpgroup's column parts (kernel/backward/parts.py)
    for buf, acc, scale in ((c.k_st, dk_acc, c.problem.scale), (c.v_st, dv_acc, None)):
      parts.store(parts.span(buf.at[0], wg * len(acc), len(acc)),
                  tuple((a if scale is None else a * scale).astype(c.dtype) for a in acc))
  else:
    c.k_st.at[0, :, pl.ds(wg * dk_cols, dk_cols)][...] = (dk_acc * c.problem.scale).astype(c.dtype)
    c.v_st.at[0, :, pl.ds(wg * dv_cols, dv_cols)][...] = dv_acc.astype(c.dtype)
  plgpu.commit_smem()
  barriers.epilogue_sync()  # both halves staged before the copy reads them
  keys = pl.ds(c.j * c.bkv, c.bkv)
  dk_ref, dv_ref = c.out_refs

  @pl.when(wg == 0)
  def _():
    plgpu.copy_smem_to_gmem(c.copied("k", c.k_st).at[0], dk_ref.at[c.b, keys, c.hk])

  @pl.when(wg == 1)
  def _():
    plgpu.copy_smem_to_gmem(c.copied("v", c.v_st).at[0], dv_ref.at[c.b, keys, c.hk])

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@seam("dkv.wide_step")
def _wide_step(c: DkvKernel, t, carry):
  """Step t of the head-split launch (the notes above
  kernel.tiling.backward_plan.EXCHANGE_BUFFERS)."""
  dk_acc, dv_acc = carry
  wg, stream = c.wg, c.stream
  pt_st, ds_st = c.exchange
  st, h, i, q_base, q_slot, do_slot = _step_operands(c, t)
  half = c.bq // CW
  mine = pl.ds(wg * half, half)
  kv_base = c.j * c.bkv
  shared = lambda name: parts.of(c.stationary.slot(_shared_slot(c), name), c.untiled)
  p, ds = _dkv_scores(c, st, i, h, kv_base, q_base + wg * half, half,
                      s_ops=(shared("k"), parts.rows_at(q_slot, mine)),
                      dp_ops=(shared("v"), parts.rows_at(do_slot, mine)),
                      rows=lambda r: stream.slot(st, "rows", r).at[mine])
  x = exchange_buffer(t)
  pt_st.at[x, :, mine][...] = p.astype(c.dtype)
  ds_st.at[x, :, mine][...] = ds.astype(c.dtype)
  plgpu.commit_smem()
  barriers.halves_ready()
  if c.untiled:
    accs = _wide_grads_in_parts(c, st, x, dk_acc, dv_acc)
  else:
    dk_cols = pl.ds(wg * dk_acc.shape[1], dk_acc.shape[1])
    dv_cols = pl.ds(wg * dv_acc.shape[1], dv_acc.shape[1])

    @seam("dkv.wide_step.grads")
    def grads(refs):
      plgpu.wgmma(refs["dv"], pt_st.at[x], do_slot.at[:, dv_cols])
      plgpu.wgmma(refs["dk"], ds_st.at[x], q_slot.at[:, dk_cols])

    accs = pl.run_state(grads)({"dv": plgpu.ACC.init(dv_acc), "dk": plgpu.ACC.init(dk_acc)})
  # Both products that read the slot have completed (run_state waits).
  stream.consumer_release(st)
  return accs["dk"], accs["dv"]


def _wide_grads_in_parts(c: DkvKernel, st, x, dk_acc, dv_acc):
  """dV += P^T dO and dK += dS^T Q of the head split's step in this
  warpgroup's column parts (untiled copies: kernel/backward/parts.py),
  waited for."""
  pt_st, ds_st = c.exchange

  def grads(refs):
    for name, a, b in (("dv", pt_st, "do"), ("dk", ds_st, "q")):
      count = len(refs[name])
      parts.issue_ab(refs[name], a.at[x], parts.span(c.stream.slot(st, b), c.wg * count, count))

  init = lambda acc: tuple(map(plgpu.ACC.init, acc))
  return pl.run_state(grads)({"dv": init(dv_acc), "dk": init(dk_acc)})
