"""The dQ kernel (where the fused dQ does not apply).

A block owns ``2 * block_q`` query rows of one head (Q, dO, lse, delta
stationary) and streams the (K, V) blocks of the forward's key range:
S, P, dP, dS as in the dK/dV kernel and dQ += dS K; with a bias it also
writes dS (the logits gradient, which is dbias before the sum over
broadcast dimensions)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.common import ROW, WGMMA, load_broadcast, tile_key_bounds
from kernel.sync import barriers, ring as ring_lib
from kernel.sync.seams import seam
from kernel.tiling import schedule as schedule_lib
from kernel.backward import parts
from kernel.backward.context import (CW, _Launch, _allocate, _barrier_refs, _copy_views,
                                     _memory_warpgroup)
from kernel.backward.head_split import _shared_slot, exchange_buffer
from kernel.backward.scores import _step_scores
from kernel.masks.selects import KeysBelow
from kernel.tiling.backward_plan import BackwardBlocks, copy_row, dq_buffers, dq_mbarriers
from kernel.tiling.plan import Problem


def query_tile_weights(problem: Problem, blocks: BackwardBlocks, *, t_pad: int) -> list[int]:
  """Per rank of the dQ kernel's launch order (rank r: query tile
  ``tiles - 1 - r``), the key blocks it streams by the call's mask
  (:meth:`kernel.masks.Mask.tile_blocks`: the dQ kernel's own key blocks,
  with the keys a local window lets the tile's rows see)."""
  tile = blocks.dq_tile
  return [problem.mask.tile_blocks(qi, tile_q=tile, block_kv=blocks.dq_stream_kv)
          for qi in reversed(range(t_pad // tile))]


@dataclasses.dataclass(frozen=True)
class DqKernel(_Launch):
  """One dQ launch: its own switch (set by :func:`dq_call`) and, inside the
  kernel, its grid point (set by :func:`_dq_kernel`)."""

  want_ds: bool             # also write dS (the logits gradient)
  num_tiles: int = 0        # query tiles of the grid
  # Inside the kernel:
  qi: Any = None            # the query tile
  h: Any = None
  lb: Any = None            # the tile's key blocks [lb, ub)
  ub: Any = None
  k_start_max: Any = None   # the tile's key-range bounds (None: no ranges)
  k_end_min: Any = None
  ds_ref: Any = None
  stationary: ring_lib.WarpgroupSlots | None = None   # q, dO, rows per compute warpgroup
  stream: ring_lib.Ring | None = None                  # k, v per key block

  # Query rows per warpgroup (stationary), keys per streamed block, S's shape.
  bq = property(lambda self: self.blocks.rows)
  bkv = property(lambda self: self.blocks.dq_stream_kv)
  shape = property(lambda self: (self.bq, self.bkv))


def dq_launch_order(problem: Problem, blocks: BackwardBlocks, *, batch: int,
                    num_heads: int, group: int, t_pad: int, s_pad: int,
                    head_dims: tuple[int, int], dtype,
                    num_sms: int) -> schedule_lib.LaunchOrder | None:
  """The dQ grid's launch order under causal (None: head by head): see
  :func:`dq_call`.  A unit is one query head; the heads of a group,
  adjacent in a section, read the same K and V.  Under the mask's local
  window only where the sections repay (as in :func:`dkv_launch_order`)."""
  if not problem.mask.causal:
    return None
  order = schedule_lib.LaunchOrder.for_grid(
      batch * num_heads, t_pad // blocks.dq_tile, num_sms=num_sms,
      unit_bytes=s_pad * sum(head_dims) * jnp.dtype(dtype).itemsize // group)
  if problem.mask.window is not None and not schedule_lib.sections_repay(
      order, query_tile_weights(problem, blocks, t_pad=t_pad), num_sms):
    return None
  return order


def dq_call(problem: Problem, blocks: BackwardBlocks, q, k, v, do, rows, bias, mask, k_start, k_end,
            k_range_tiles, *, want_ds: bool, num_sms: int = schedule_lib.DEFAULT_NUM_SMS,
            padded: tuple[int, int] | None = None):
  """dQ, as long as q (and dS, the logits gradient, when ``want_ds``).

  Same arguments as :func:`dkv_call`, with bias and mask in their own
  orientation, and k_range_tiles the per-tile key-range bounds for this
  kernel's tiles of 2 * 64 query rows (kernel.padding.key_ranges).
  Returns dq (B, T, N, D) and ds (B, N, Tp, Sp) f32 or None; ds blocks
  outside the tile's key range are not written (the caller zeroes them).
  Under causal the query tiles launch in
  sections of (batch, head) units, heaviest first across a section, as in
  :func:`dkv_call`; a section's units re-read their kv heads' K and V.
  """
  batch, t, num_heads, head_dim = q.shape
  _, s, num_kv_heads, head_dim_out = v.shape
  t_pad, s_pad = padded or (t, s)
  dtype = q.dtype
  group = num_heads // num_kv_heads
  order = dq_launch_order(problem, blocks, batch=batch, num_heads=num_heads, group=group,
                          t_pad=t_pad, s_pad=s_pad, head_dims=(head_dim, head_dim_out),
                          dtype=dtype, num_sms=num_sms)
  kernel = DqKernel(problem=problem, blocks=blocks, want_ds=want_ds, head_dim=head_dim, dtype=dtype,
                    num_kv_heads=num_kv_heads, group=group, s_pad=s_pad,
                    num_tiles=t_pad // blocks.dq_tile, order=order)

  def body(*refs):
    _dq_kernel(kernel, *refs)

  untiled = blocks.untiled_copies
  scratch = _allocate(dq_buffers(blocks, head_dim, head_dim_out, dtype, want_ds=want_ds),
                      untiled)
  out_type = [jax.ShapeDtypeStruct((batch, t, num_heads, *copy_row(blocks, head_dim, dtype)),
                                   dtype)]
  if untiled:  # rows in column parts (kernel.tiling.backward_plan.copy_row): free reshapes
    q, k, v, do = (x.reshape(*x.shape[:3], *copy_row(blocks, x.shape[3], dtype))
                   for x in (q, k, v, do))
  if want_ds:
    out_type.append(jax.ShapeDtypeStruct((batch, num_heads, t_pad, s_pad), jnp.float32))
  results = plgpu.kernel(
      body, out_type=out_type, scratch_types=[scratch, _barrier_refs(dq_mbarriers(blocks))],
      # Mosaic GPU launches the last grid dimension fastest: the query
      # tiles, so that the blocks in flight at once are one head's tiles,
      # which read the same K and V; under causal _dq_kernel walks them
      # heaviest first, so that each head's last blocks are its short tiles
      # (docs/decisions/dq-grid-query-tiles-fastest.md).  Under causal
      # _dq_kernel remaps the launch index through kernel.tiling.schedule
      # (sections of heads, heaviest first across them:
      # docs/decisions/backward-causal-launch-order.md).
      grid=(batch, num_heads, t_pad // blocks.dq_tile), grid_names=("batch", "heads", "q_tiles"),
      num_threads=barriers.NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
  )(q, k, v, do, rows, bias, mask, k_start, k_end, k_range_tiles)
  dq = results[0].reshape(*results[0].shape[:3], -1) if untiled else results[0]
  return (dq, results[1]) if want_ds else (dq, None)


@seam("dq.kernel")
def _dq_kernel(c: DqKernel, q_ref, k_ref, v_ref, do_ref, rows_ref, bias_ref, mask_ref, ks_ref,
               ke_ref, tiles_ref, dq_ref, *rest):
  """The dQ kernel's entry: its rings over the scratch, the query tile of
  this grid point and its key blocks, each warpgroup's role."""
  ds_ref = rest[0] if c.want_ds else None
  (q_st, do_st, rows_st, k_ring, v_ring, exchange, ds_st), bars = (
      rest[1:] if c.want_ds else rest)
  q_stat, do_stat, rows_stat, k_prod, v_prod, consumed = bars
  read, views = _copy_views(c.untiled, dict(q=q_st, do=do_st, k=k_ring, v=v_ring))
  q_st, do_st, k_ring, v_ring = (read[n] for n in ("q", "do", "k", "v"))
  # Q, dO and the residual rows stationary, one tile per compute warpgroup;
  # each step streams a key block's k and v.
  stationary = ring_lib.WarpgroupSlots(
      {"q": (q_st, q_stat), "do": (do_st, do_stat), "rows": (rows_st, rows_stat)},
      copy_views={n: views[n] for n in ("q", "do") if n in views})
  stream = ring_lib.Ring(c.blocks.num_stages, {"k": (k_ring, k_prod), "v": (v_ring, v_prod)},
                         consumed, {n: views[n] for n in ("k", "v") if n in views})
  wg = lax.axis_index("wg")
  qi, h, b = (lax.axis_index(n) for n in ("q_tiles", "heads", "batch"))
  if c.order is not None:
    # The grid launches q_tiles fastest, then heads, then batch: unit
    # u = b * heads + h, and rank r is the r-th heaviest query tile.
    heads = jnp.int32(q_ref.shape[2])
    unit, rank = c.order.locate((b * heads + h) * jnp.int32(c.num_tiles) + qi)
    b, h = lax.div(unit, heads), lax.rem(unit, heads)
    qi = jnp.int32(c.num_tiles - 1) - rank
  elif c.problem.mask.causal:
    # The last query tiles see the most keys: they go first (dq_call).
    qi = jnp.int32(c.num_tiles - 1) - qi
  hk = lax.div(h, jnp.int32(c.group))
  problem = c.problem
  start_max = end_min = None
  tile = c.blocks.dq_tile
  if tiles_ref is None:
    lb, ub = problem.mask.key_blocks(qi, tile_q=tile, block_kv=c.bkv)
  else:
    start_min, start_max, end_min, end_max = tile_key_bounds(tiles_ref, b, h, qi)
    lb, ub = problem.mask.key_blocks(qi, tile_q=tile, block_kv=c.bkv, k_start_min=start_min,
                                     k_end_max=end_max)
  c = dataclasses.replace(
      c, wg=wg, qi=qi, h=h, b=b, hk=hk, lb=lb, ub=ub, k_start_max=start_max,
      k_end_min=end_min, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref,
      do_ref=do_ref, rows_ref=rows_ref, bias_ref=bias_ref, mask_ref=mask_ref, ks_ref=ks_ref,
      ke_ref=ke_ref, dq_ref=dq_ref, ds_ref=ds_ref, ds_st=ds_st, exchange=exchange,
      stationary=stationary, stream=stream, views=views)
  split = c.blocks.head_split
  pl.when(wg < CW)(functools.partial(_wide_dq_compute if split else _dq_compute, c))
  pl.when(wg == CW)(lambda: _memory_warpgroup(
      functools.partial(_wide_dq_load_stationary if split else _dq_load_stationary, c),
      functools.partial(_dq_fill, c), 0, ub - lb, stream))


def _dq_load_stationary(c: DqKernel):
  for w in range(CW):
    rows_w = pl.ds((CW * c.qi + w) * c.bq, c.bq)
    c.stationary.producer_copy(c.q_ref.at[c.b, rows_w, c.h], w, "q")
    c.stationary.producer_copy(c.do_ref.at[c.b, rows_w, c.h], w, "do")
    c.stationary.producer_copy(c.rows_ref.at[c.b, c.h, :, rows_w], w, "rows")


@seam("dq.fill")
def _dq_fill(c: DqKernel, t, st):
  keys = pl.ds((c.lb + t) * c.bkv, c.bkv)
  stream = c.stream
  stream.producer_copy(c.k_ref.at[c.b, keys, c.hk], st, "k")
  stream.producer_copy(c.v_ref.at[c.b, keys, c.hk], st, "v")


@seam("dq.compute")
def _dq_compute(c: DqKernel):
  """A compute warpgroup: its 64 query rows' dQ over the tile's key
  blocks, then staged in its query tile and stored."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  q_base = (CW * c.qi + wg) * c.bq
  rows = pl.ds(q_base, c.bq)
  lse2, delta, ks, ke = _dq_row_inputs(c, wg, rows)
  step = functools.partial(_dq_step, c, q_base, rows, lse2, delta, ks, ke)
  q_st = c.stationary.slot(wg, "q")
  dq_acc = parts.zeros(c.bq, c.head_dim, parts.columns(q_st, c.untiled))
  dq_acc = lax.fori_loop(c.lb, c.ub, step, dq_acc)
  # q is no longer read: it stages dQ.
  if c.untiled:  # column parts (kernel/backward/parts.py)
    parts.store(q_st, tuple((a * c.problem.scale).astype(c.dtype) for a in dq_acc))
  else:
    q_st[...] = (dq_acc * c.problem.scale).astype(c.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(c.copied("q", q_st).at[wg] if c.untiled else q_st,
                          c.dq_ref.at[c.b, rows, c.h])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dq_row_inputs(c: DqKernel, slot, rows):
  """(lse2, delta, k_start, k_end) of the stationary query rows ``rows``,
  per row (ROW layout; the key-range bounds None without ranges), once
  stationary slot ``slot``'s q, dO and rows have landed: both dQ kernels'
  compute warpgroups read them before their key loop."""
  for name in ("q", "do", "rows"):
    c.stationary.consumer_wait(slot, name)
  lse2 = plgpu.load(c.stationary.slot(slot, "rows", 0), layout=ROW, optimized=False)
  delta = plgpu.load(c.stationary.slot(slot, "rows", 1), layout=ROW, optimized=False)
  per_row = lambda ref: None if ref is None else load_broadcast(ref, (c.b, c.h, rows), (c.bq,),
                                                                 ROW)
  return lse2, delta, per_row(c.ks_ref), per_row(c.ke_ref)


def _dq_keep_terms(c: DqKernel, shape, tile, ks, ke, k_base):
  """(edge_terms, terms, interior) of a dQ step's (queries x keys) tile
  (:func:`_step_scores`), for the streamed key block at ``k_base``.  With
  key ranges, only the key blocks that hold a padded key or cross a row's
  range bound (from the tile's largest start to its smallest end) apply the
  range and padded-key terms (_masked_terms); without ranges the padded-key
  term stays on every step, as in the dK/dV kernel."""
  problem = c.problem
  edge_terms, terms = [], []
  if ks is not None:
    edge_terms.append(lambda key: key >= lax.broadcast_in_dim(ks, shape, [0]))
  if ke is not None:
    edge_terms.append(lambda key: key < lax.broadcast_in_dim(ke, shape, [0]))
  padded_keys = bool(problem.seq_kv % c.bkv or c.s_pad != problem.seq_kv)
  if padded_keys:
    (edge_terms if edge_terms else terms).append(KeysBelow(problem.seq_kv))

  def interior():
    inside = (c.k_start_max <= k_base) & (k_base + c.bkv <= c.k_end_min)
    return inside & (k_base + c.bkv <= problem.seq_kv) if padded_keys else inside

  if c.mask_ref is not None:
    terms.append(lambda key: load_broadcast(c.mask_ref, tile, shape, WGMMA) != 0)
  return edge_terms, terms, interior


@seam("dq.step")
def _dq_step(c: DqKernel, q_base, rows, lse2, delta, ks, ke, ki, dq_acc):
  """Key block ki against this warpgroup's query rows: P and dS
  (:func:`_step_scores`), dQ += dS K, and dS stored where wanted."""
  problem, wg, b, h, stream, shape = c.problem, c.wg, c.b, c.h, c.stream, c.shape
  st = stream.position(ki - c.lb)
  k_base = ki * c.bkv
  stream.consumer_wait(st, "k")
  stream.consumer_wait(st, "v")
  k_slot, v_slot = (parts.of(stream.slot(st, n), c.untiled) for n in ("k", "v"))
  tile = (b, h, rows, pl.ds(k_base, c.bkv))
  edge_terms, terms, interior = _dq_keep_terms(c, shape, tile, ks, ke, k_base)
  stationary = lambda name: parts.of(c.stationary.slot(wg, name), c.untiled)
  _, ds = _step_scores(
      problem, shape, s_ops=(stationary("q"), k_slot),
      dp_ops=(stationary("do"), v_slot), paired=c.blocks.schedule == "paired",
      want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(c.bias_ref, tile, shape,
                                                                     WGMMA),
      terms=terms, key_dim=1, key_base=k_base, num_keys=c.bkv, query_base=q_base,
      lse2_of=lambda: lse2, delta_of=lambda: delta, edge_terms=edge_terms,
      interior=interior)

  def dsk(acc):
    if c.untiled:  # dQ in column parts, one wgmma each
      parts.issue_ab(acc, ds.astype(c.dtype), k_slot)
      return
    plgpu.wgmma(acc, ds.astype(c.dtype), k_slot)

  dq_acc = pl.run_state(dsk)(parts.each(plgpu.ACC.init, dq_acc))
  _release_and_store_ds(c, st, ds, rows, pl.ds(k_base, c.bkv))
  return dq_acc


def _release_and_store_ds(c: DqKernel, st, ds, rows, keys):
  """Hands the step's ring slot back, then (want_ds) copies this warpgroup's
  dS of ``rows`` x ``keys`` out through its staging buffer."""
  c.stream.consumer_release(st)
  if c.want_ds:
    # The previous block's dS copy must have read the staging buffer.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    c.ds_st.at[c.wg][...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c.ds_st.at[c.wg], c.ds_ref.at[c.b, c.h, rows, keys])


# The head-split dQ kernel (head dims over 128), the dK/dV launch's split
# turned around: one block owns ONE tile of 64 query rows (Q, dO, lse,
# delta stationary, 64-byte swizzled) for both compute warpgroups and
# streams key blocks of 64 through a two-stage ring.  Warpgroup w forms S
# and dP of the tile against its 32 keys of the block (64 queries x 32 keys),
# dS, and stages dS in the compute dtype into columns [32 w, 32 w + 32) of
# the step's exchange buffer; after the rendezvous (barriers.halves_ready)
# it forms its half of dQ's head dim, dQ[:, cols] += dS K[:, cols], over all
# 64 keys.  Exchange buffers as in the dK/dV launch (step t uses t % 2).


def _wide_dq_load_stationary(c: DqKernel):
  rows = pl.ds(c.qi * c.bq, c.bq)
  c.stationary.producer_copy(c.q_ref.at[c.b, rows, c.h], 0, "q")
  c.stationary.producer_copy(c.do_ref.at[c.b, rows, c.h], 0, "do")
  c.stationary.producer_copy(c.rows_ref.at[c.b, c.h, :, rows], 0, "rows")


def _wide_dq_compute(c: DqKernel):
  """A compute warpgroup of the head-split dQ kernel: its half of dQ's head
  dim over the tile's key blocks, staged in the Q tile, stored by
  warpgroup 0."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  shared = _shared_slot(c)
  q_base = c.qi * c.bq
  rows = pl.ds(q_base, c.bq)
  lse2, delta, ks, ke = _dq_row_inputs(c, shared, rows)
  cols = c.head_dim // CW
  step = functools.partial(_wide_dq_step, c, shared, q_base, rows, lse2, delta, ks, ke)
  q_st = c.stationary.slot(shared, "q")
  dq_acc = parts.zeros(c.bq, cols, parts.columns(q_st, c.untiled))
  dq_acc = lax.fori_loop(c.lb, c.ub, step, dq_acc)
  # Q is free to stage dQ: each step's last read of it (S) precedes its
  # rendezvous, which both warpgroups passed.
  if c.untiled:  # this warpgroup's column parts (kernel/backward/parts.py)
    parts.store(parts.span(q_st, wg * len(dq_acc), len(dq_acc)),
                tuple((a * c.problem.scale).astype(c.dtype) for a in dq_acc))
  else:
    q_st.at[:, pl.ds(wg * cols, cols)][...] = (dq_acc * c.problem.scale).astype(c.dtype)
  plgpu.commit_smem()
  barriers.epilogue_sync()  # both halves staged before the copy reads them

  @pl.when(wg == 0)
  def _():
    plgpu.copy_smem_to_gmem(c.copied("q", q_st).at[shared] if c.untiled else q_st,
                            c.dq_ref.at[c.b, rows, c.h])

  plgpu.wait_smem_to_gmem(0)


@seam("dq.wide_step")
def _wide_dq_step(c: DqKernel, shared, q_base, rows, lse2, delta, ks, ke, ki, dq_acc):
  """Key block ki of the head-split dQ kernel (the notes above)."""
  problem, wg, b, h, stream = c.problem, c.wg, c.b, c.h, c.stream
  t = ki - c.lb
  st = stream.position(t)
  k_base = ki * c.bkv
  stream.consumer_wait(st, "k")
  stream.consumer_wait(st, "v")
  k_slot, v_slot = (parts.of(stream.slot(st, n), c.untiled) for n in ("k", "v"))
  half = c.bkv // CW
  mine = pl.ds(wg * half, half)
  my_base = k_base + wg * half
  shape = (c.bq, half)
  tile = (b, h, rows, pl.ds(my_base, half))
  # interior() judges the whole key block (both halves).
  edge_terms, terms, interior = _dq_keep_terms(c, shape, tile, ks, ke, k_base)
  _, ds = _step_scores(
      problem, shape, s_ops=(parts.of(c.stationary.slot(shared, "q"), c.untiled),
                             parts.rows_at(k_slot, mine)),
      dp_ops=(parts.of(c.stationary.slot(shared, "do"), c.untiled),
              parts.rows_at(v_slot, mine)),
      paired=c.blocks.schedule == "paired", want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(c.bias_ref, tile, shape,
                                                                     WGMMA),
      terms=terms, key_dim=1, key_base=my_base, num_keys=half, query_base=q_base,
      lse2_of=lambda: lse2, delta_of=lambda: delta, edge_terms=edge_terms,
      interior=interior)
  x = exchange_buffer(t)
  c.exchange.at[x, :, mine][...] = ds.astype(c.dtype)
  plgpu.commit_smem()
  barriers.halves_ready()
  if c.untiled:  # this warpgroup's column parts of dQ
    def dsk_in_parts(accs):
      count = len(accs)
      parts.issue_ab(accs, c.exchange.at[x], parts.span(stream.slot(st, "k"), wg * count, count))

    dq_acc = pl.run_state(dsk_in_parts)(tuple(map(plgpu.ACC.init, dq_acc)))
  else:
    cols = pl.ds(wg * dq_acc.shape[1], dq_acc.shape[1])

    def dsk(acc):
      plgpu.wgmma(acc, c.exchange.at[x], k_slot.at[:, cols])

    dq_acc = pl.run_state(dsk)(plgpu.ACC.init(dq_acc))
  _release_and_store_ds(c, st, ds, rows, pl.ds(my_base, half))
  return dq_acc
