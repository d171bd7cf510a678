"""One thread block of the forward: the scratch that kernel/tiling/plan.py
lays out, the rings over it (kernel/sync/ring.py, whose verbs are the only
handshakes), and each warpgroup's role: the memory warpgroup
(kernel/forward/producer.py) and the compute warpgroups, each running every
tile of the block through its prologue, key loop and epilogue."""

from __future__ import annotations

import dataclasses
import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from kernel import common
from kernel.common import smem
from kernel.sync import barriers, ring as ring_lib
from kernel.forward.context import COMPUTE_REGISTERS, ForwardContext, for_each_tile
from kernel.forward.epilogue import epilogue
from kernel.forward.mainloop import (key_loop, pass_token_for_the_last_time, tile_prologue,
                                     tile_start)
from kernel.forward.producer import memory_warpgroup


def _kernel(c: ForwardContext, mbarriers, q_ref, k_ref, v_ref, bias_ref, mask_ref, ks_ref, ke_ref,
            tiles_ref, sched_ref, counts_ref, *rest):
  """The kernel's entry: allocate the scratch of kernel/tiling/plan.py's layout and
  mbarrier plan, build the rings over it, and dispatch the warpgroups.  After
  the inputs, FP8's descales; then the outputs."""
  descale_ref, (out_ref, *residual_refs) = (rest[0], rest[1:]) if c.problem.fp8 else (None, rest)
  m_ref, l_ref = residual_refs[:2] if residual_refs else (None, None)
  piece_refs = tuple(residual_refs[2:]) or None   # split tail: the pieces' out, m, l
  layout = c.layout
  m_buf = layout.m if c.problem.return_residuals else None
  l_buf = layout.l if c.problem.return_residuals else None
  # A group of buffers as RefUnion groups: the tiled one wgmma reads, and
  # under untiled copies a mirror of it, the views the TMA copies use.
  untiled = layout.untiled_copies

  def groups(*bufs):
    tiled = tuple(None if b is None else smem(b) for b in bufs)
    return (tiled, tuple(map(common.untiled_smem, bufs))) if untiled else (tiled,)

  qk, out, v = groups(layout.q, layout.k), groups(layout.o, m_buf, l_buf), groups(layout.v)
  union = lambda gs: plgpu.RefUnion(*gs) if untiled else gs[0]
  if layout.overlay_qk_with_output:
    overlay = plgpu.RefUnion(qk[0], out[0], *qk[1:], *out[1:])
  else:
    overlay = (union(qk), union(out))
  mb = {b_.name: plgpu.Barrier(num_arrivals=b_.num_arrivals, num_barriers=b_.num_barriers)
        for b_ in mbarriers}
  staged = lambda buf: None if buf is None else smem(buf)
  refs = dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, bias_ref=bias_ref, mask_ref=mask_ref,
              ks_ref=ks_ref, ke_ref=ke_ref, tiles_ref=tiles_ref, sched_ref=sched_ref,
              counts_ref=counts_ref, descale_ref=descale_ref, out_ref=out_ref, m_ref=m_ref,
              l_ref=l_ref,
              piece_refs=piece_refs)
  # FP8's V^T is copied whole under untiled copies too (a copy made whole)
  v_alloc = plgpu.RefUnion(*v) if untiled and not c.problem.fp8 else smem(layout.v)
  pl.run_scoped(
      lambda *scoped: _dispatch(c, refs, *scoped),
      (overlay, v_alloc, staged(layout.bias), staged(layout.mask)),
      (mb["q_produced"], mb.get("q_consumed"), mb["k_produced"], mb["v_produced"],
       mb["k_consumed"], mb["v_consumed"], mb.get("bias_produced"), mb.get("mask_produced")),
      collective_axes="wg",
  )


def _scratch_views(c: ForwardContext, smems):
  """{name: (the ref read, the view copied)} of q, k, v, o from the
  allocated scratch (_kernel's structure), and m, l, bias, mask.  Without
  untiled copies both are one ref; with them the copied view is the
  untiled mirror, its parts moved behind its rows (kernel.tiling.plan.copy_parts:
  a copy's rows land as (rows, parts, columns) of the global array)."""
  overlay, v, bias, mask = smems
  if not c.layout.untiled_copies:
    ((q, k), (o, m, l)) = overlay
    pairs = dict(q=(q, q), k=(k, k), v=(v, v), o=(o, o))
  else:
    if c.layout.overlay_qk_with_output:
      qk_t, out_t, qk_u, out_u = overlay
    else:
      (qk_t, qk_u), (out_t, out_u) = overlay
    behind = lambda x: None if x is None else x.transpose((0, 2, 1, 3))
    pairs = dict(q=(qk_t[0], behind(qk_u[0])), k=(qk_t[1], behind(qk_u[1])),
                 o=(out_t[0], behind(out_u[0])))
    if c.problem.fp8:   # V^T whole (_kernel)
      pairs["v"] = (v, v)
    else:
      v_t, v_u = v
      pairs["v"] = (v_t[0], behind(v_u[0]))
    m, l = out_t[1], out_t[2]
  if c.layout.overlay_q_with_output:
    pairs["o"] = pairs["q"]  # each warpgroup stages its output in its query slot
  return pairs, m, l, bias, mask


def _dispatch(c: ForwardContext, refs: dict, smems, mbars):
  """The rings over the allocated scratch, then each warpgroup's role."""
  wg = lax.axis_index("wg")
  views, m_smems, l_smems, bias_smems, mask_smems = _scratch_views(c, smems)
  (q_smems, q_copy), (k_smems, k_copy), (v_smems, v_copy), (o_smems, o_copy) = (
      views[name] for name in "qkvo")
  (q_produced, q_consumed, k_produced, v_produced, k_consumed, v_consumed,
   bias_produced, mask_produced) = mbars
  # The key phase: k and the staged bias/mask tiles of the same key block,
  # released together; the value phase at the same positions.
  key_buffers = {"k": (k_smems, k_produced)}
  if bias_smems is not None:
    key_buffers["bias"] = (bias_smems, bias_produced)
  if mask_smems is not None:
    key_buffers["mask"] = (mask_smems, mask_produced)
  # Only where the copies have views of their own, so that the shipped
  # kernel traces as before.
  copy_views = lambda name, view, read: {name: view} if view is not read else {}
  c = dataclasses.replace(
      c, wg=wg, **refs,
      queries=ring_lib.WarpgroupSlots({"q": (q_smems, q_produced)}, q_consumed,
                                      copy_views("q", q_copy, q_smems)),
      keys=ring_lib.Ring(c.stages, key_buffers, k_consumed, copy_views("k", k_copy, k_smems)),
      values=ring_lib.Ring(c.stages, {"v": (v_smems, v_produced)}, v_consumed,
                           copy_views("v", v_copy, v_smems)),
      out_smems=(o_smems, m_smems, l_smems), o_copy_smems=o_copy)
  pl.when(wg < c.cw)(functools.partial(compute_warpgroup, c))
  pl.when(wg == c.cw)(functools.partial(memory_warpgroup, c))


# -- the compute warpgroups ------------------------------------------------------

def compute_warpgroup(c: ForwardContext):
  """COMPUTE_REGISTERS; the tiles of this block, one query tile each."""
  plgpu.set_max_registers(COMPUTE_REGISTERS[c.cw], action="increase")
  # The pingpong is one token passed round the compute warpgroups (0, 1,
  # 0, ... or 0, 1, 2, 0, ...): warpgroup 0 starts holding it.  Each
  # warpgroup strictly alternates "acquire" (bar.sync on its own barrier)
  # and "pass" (bar.arrive on the next one's), across tile boundaries too,
  # so every generation of a named barrier is one pass plus one acquire.
  # Were a warpgroup to pass twice in a row, its 2 x 128 arrivals would
  # complete a generation on their own and the next warpgroup's acquire
  # would wait forever.  Hence the one acquire before the first tile of
  # every warpgroup but 0, and the one pass after the last loop (before the
  # epilogue of a non-persistent block) of every warpgroup but the last,
  # not one per tile.
  # Two compute warpgroups keep the conditions they were timed and
  # proved with (wg == 1, the other one); three take the general ones.
  if c.cw == 2:
    pl.when(c.wg == 1)(lambda: barriers.schedule_sync(c.wg))
  else:
    pl.when(c.wg > 0)(lambda: barriers.schedule_sync(c.wg, c.cw))
  for_each_tile(c, functools.partial(compute_tile, c), 0)
  if c.config.persistent:
    pass_token_for_the_last_time(c)
  if c.config.persistent:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def compute_tile(c: ForwardContext, b, h, qi, prev_iters, piece=None):
  """One query tile (or a split tail's piece of one) on this warpgroup: the
  prologue (its queries and first keys waited for, the first QK), the key
  loop, the epilogue."""
  t, acc, m_i, l_i = tile_start(c, b, h, qi, prev_iters, piece)
  s0, pending, plain = tile_prologue(c, t, m_i)
  acc, m_i, l_i, pending = key_loop(c, t, s0, acc, m_i, l_i, pending, plain)
  epilogue(c, t, acc, m_i, l_i, pending)
  return prev_iters + (t.ub - t.lb)
