"""The forward's epilogue: normalise the accumulator (or bring it to the
final max), convert m to natural log, stage the tile in shared memory and
store it with TMA, into the output or a split tail's piece."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel.common import LOG2E, POISONED_START
from kernel.sync import barriers
from kernel.forward import fp8
from kernel.forward.context import ForwardContext, Tile
from kernel.forward.mainloop import each_part, pass_token_for_the_last_time
from kernel.forward.softmax import safe
from kernel.sync.seams import seam


@seam("epilogue.epilogue")
def epilogue(c: ForwardContext, t: Tile, acc, m_i, l_i, pending):
  """Normalise (or bring to m_i), stage in shared memory, TMA to global."""
  problem, wg, layout = c.problem, c.wg, c.layout
  m_scale = m_i if c.always_rescale else pending[0]
  if not c.config.persistent:
    # Before the epilogue: warpgroup 1's last PV waits for this pass, and
    # the output overlay's epilogue barrier waits for warpgroup 1.
    pass_token_for_the_last_time(c)
  out, m_i, l_res = _final_rows(c, t, acc, m_i, l_i, m_scale)

  if c.config.persistent and not layout.overlay_q_with_output:
    # A tile without key blocks never ran a QK: release the query slot here.
    pl.when(t.ub == t.lb)(lambda: c.queries.consumer_release(wg))
  if c.config.persistent:
    # The previous tile's output copy must have read o/m/l before we
    # overwrite them (it drained while this tile computed).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if layout.overlay_qk_with_output:
    barriers.epilogue_sync(c.cw)  # every compute warpgroup is done with q and k
  o_smems, m_smems, l_smems = c.out_smems
  # The staging stored into and the view of it the TMA store reads.
  o_smem, o_copied = o_smems.at[wg], c.o_copy_smems.at[wg]
  if isinstance(out, tuple):  # untiled copies: the output's column parts
    for part, o in enumerate(out):
      o_smem.at[part][...] = o.astype(c.out_dtype)
  else:
    o_smem[...] = out.astype(c.out_dtype)
  if problem.return_residuals:
    m_smems.at[wg][...] = m_i * (1.0 / LOG2E)
    l_smems.at[wg][...] = l_res

  def store(out_at, m_at, l_at):
    # One place issues the stores, wherever they go: the proof reads the
    # same events (by source line) from a tile's stores and a piece's.
    plgpu.copy_smem_to_gmem(o_copied, out_at())
    if problem.return_residuals:
      plgpu.copy_smem_to_gmem(m_smems.at[wg], m_at())
      plgpu.copy_smem_to_gmem(l_smems.at[wg], l_at())

  @seam("epilogue.into_output")
  def into_output():
    store(lambda: c.out_ref.at[t.b, t.rows, t.h], lambda: c.m_ref.at[t.b, t.h, t.rows],
          lambda: c.l_ref.at[t.b, t.h, t.rows])

  def into_slot():
    # A split tail's piece: this warpgroup's rows of its slot.
    slot, mine = lax.max(t.slot, 0), pl.ds(wg * c.block_q, c.block_q)
    p_out, p_m, p_l = c.piece_refs
    store(lambda: p_out.at[slot, mine], lambda: p_m.at[slot, mine], lambda: p_l.at[slot, mine])

  plgpu.commit_smem()
  if t.slot is None:
    into_output()
  else:
    pl.when(t.slot < 0)(into_output)
    pl.when(t.slot >= 0)(into_slot)
  if not c.config.persistent:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  elif layout.overlay_q_with_output:
    # The output was staged in the query slot: refill it only once the
    # copy has read it.  The next tile's keys and values are already
    # streaming; only its query load is exposed.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    c.queries.consumer_release(wg)


@seam("epilogue.final_rows")
def _final_rows(c: ForwardContext, t: Tile, acc, m_i, l_i, m_scale):
  """(out, m_i, l) of the tile's rows as they are stored: normalised (or
  brought to m_i), descaled under FP8, NaN in poisoned rows."""
  problem = c.problem
  # acc and l_i are relative to m_scale; alpha brings them to m_i.
  if c.always_rescale:
    l_res = l_i
  else:
    l_res = l_i * jnp.exp2(m_scale - safe(m_i))
  if problem.normalize_output:
    # The pending factor cancels in acc / l_i; tiny keeps 0/0 at 0 for
    # fully masked rows (acc is 0 there).
    inv = 1.0 / (l_i + float(np.finfo(np.float32).tiny))
    out = each_part(lambda a: a * lax.broadcast_in_dim(inv, a.shape, [0]), acc)
  elif c.always_rescale:
    out = acc
  else:
    alpha = jnp.exp2(m_scale - safe(m_i))
    out = each_part(lambda a: a * lax.broadcast_in_dim(alpha, a.shape, [0]), acc)
  if problem.fp8:
    # V was stored over v_descale, P at P_SCALE times its value (which
    # the normalised output's l_i cancels).
    v_descale = t.descales[1]
    unit = v_descale if problem.normalize_output else v_descale * (1.0 / fp8.P_SCALE)
    out = each_part(lambda a: a * unit, out)
    l_res = l_res * (1.0 / fp8.P_SCALE)

  if problem.poisons_rows:
    poisoned = t.k_start == POISONED_START
    out = each_part(
        lambda o: jnp.where(lax.broadcast_in_dim(poisoned, o.shape, [0]), jnp.nan, o), out)
    m_i = jnp.where(poisoned, jnp.nan, m_i)
    l_res = jnp.where(poisoned, jnp.nan, l_res)
  return out, m_i, l_res
