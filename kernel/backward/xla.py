"""The attention backward pass in plain JAX, from the forward's residuals.

It reads exactly what the forward kernel stores — ``out``, ``m`` (the row max
in NATURAL-log space) and ``l`` — and recomputes P = exp(s - m) / l one key
chunk at a time, so its memory is O(T * chunk) per head rather than O(T * S).
It is the executable specification of the Pallas backward kernels
(``kernel/backward/``; ``kernel.experiments.dot_product_attention(..., backward="xla")`` runs
it instead of them): a forward that leaves ``m`` in base 2 gives wrong gradients
here exactly as it would there.

Contract (the reference's): a fully masked row (l == 0) contributes nothing;
``dk``/``dv`` are summed over the query heads that share a key head; ``dbias``
is summed down to the bias's own shape.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

CHUNK = 512


def _pad_keys(x, axis, size):
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def xla_backward(problem, query, key, value, bias, mask, k_start, k_end, out, m, l, d_out, *,
                 chunk=CHUNK):
  """Gradients (dq, dk, dv, dbias) of sum(out * d_out); dbias is None
  without a bias.  Shapes as in kernel/call.py; m, l are (B, N, T).  Reads
  the problem's scale, mask (kernel.masks.Mask.keep) and soft cap
  (kernel.tiling.plan.Problem)."""
  scale, logits_soft_cap = problem.scale, problem.logits_soft_cap
  f32 = jnp.float32
  batch, t, heads, _ = query.shape
  s_len, kv_heads = key.shape[1], key.shape[2]
  group = heads // kv_heads
  chunk = min(chunk, s_len)
  n_chunks = -(-s_len // chunk)
  s_pad = n_chunks * chunk

  q = query.astype(f32).transpose(0, 2, 1, 3)                     # B N T H
  k = _pad_keys(key.astype(f32), 1, s_pad).transpose(0, 2, 1, 3)  # B K S H
  v = _pad_keys(value.astype(f32), 1, s_pad).transpose(0, 2, 1, 3)
  do = d_out.astype(f32).transpose(0, 2, 1, 3)                    # B N T Hv
  o = out.astype(f32).transpose(0, 2, 1, 3)
  delta = jnp.sum(do * o, axis=-1)                                # B N T
  live = l != 0
  m_safe = jnp.where(live, m, 0.0)
  inv_l = jnp.where(live, 1.0 / jnp.where(live, l, 1.0), 0.0)

  bias4, mask4 = _rank4_operands(bias, mask, s_pad)
  rows = jnp.arange(t)[:, None]

  def by_group(x):  # (B, K, c, D) -> (B, N, c, D): query head n reads key head n // G
    return jnp.repeat(x, group, axis=1)

  def sum_groups(x):  # (B, N, c, D) -> (B, K, c, D)
    return x.reshape(batch, kv_heads, group, *x.shape[2:]).sum(axis=2)

  def step(c, carry):
    dq, dk, dv, dbias = carry
    c0 = c * chunk
    kc = by_group(lax.dynamic_slice_in_dim(k, c0, chunk, 2))
    vc = by_group(lax.dynamic_slice_in_dim(v, c0, chunk, 2))
    u = scale * jnp.einsum("bnth,bnch->bntc", q, kc)
    if bias4 is not None:
      u = u + _chunk_of(bias4, c0, chunk, 3)
    s = u if logits_soft_cap is None else logits_soft_cap * jnp.tanh(u / logits_soft_cap)
    cols = c0 + jnp.arange(chunk)[None, :]
    visible = _visible(problem, rows, cols, c0, mask4=mask4, k_start=k_start, k_end=k_end,
                       live=live)
    p = jnp.where(visible, jnp.exp(jnp.where(visible, s, 0.0) - m_safe[..., None]), 0.0)
    p = p * inv_l[..., None]
    dv_c = jnp.einsum("bntc,bntd->bncd", p, do)
    dp = jnp.einsum("bntd,bncd->bntc", do, vc)
    ds = p * (dp - delta[..., None])
    if logits_soft_cap is not None:
      ds = ds * (1.0 - jnp.tanh(u / logits_soft_cap) ** 2)
    ds = jnp.where(visible, ds, 0.0)
    dq = dq + scale * jnp.einsum("bntc,bnch->bnth", ds, kc)
    dk_c = scale * jnp.einsum("bntc,bnth->bnch", ds, q)
    dk = lax.dynamic_update_slice_in_dim(dk, sum_groups(dk_c), c0, 2)
    dv = lax.dynamic_update_slice_in_dim(dv, sum_groups(dv_c), c0, 2)
    if dbias is not None:
      dbias = _summed_into_dbias(dbias, ds, c0)
    return dq, dk, dv, dbias

  dbias0 = None
  if bias4 is not None:
    dbias0 = jnp.zeros(bias4.shape, f32)
  init = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), dbias0)
  dq, dk, dv, dbias = lax.fori_loop(0, n_chunks, step, init)
  dq = dq.transpose(0, 2, 1, 3).astype(query.dtype)
  dk = dk[:, :, :s_len].transpose(0, 2, 1, 3).astype(key.dtype)
  dv = dv[:, :, :s_len].transpose(0, 2, 1, 3).astype(value.dtype)
  if dbias is not None:
    if dbias.shape[3] != 1:
      dbias = dbias[..., :s_len]
    dbias = dbias.reshape(bias.shape).astype(bias.dtype)
  return dq, dk, dv, dbias


def _rank4_operands(bias, mask, s_pad):
  """(bias, mask) at rank 4, bias in float32, each padded to ``s_pad`` keys
  where it has more than one."""
  bias4 = None if bias is None else lax.broadcast_to_rank(bias.astype(jnp.float32), 4)
  mask4 = None if mask is None else lax.broadcast_to_rank(mask, 4)
  if bias4 is not None and bias4.shape[3] != 1:
    bias4 = _pad_keys(bias4, 3, s_pad)
  if mask4 is not None and mask4.shape[3] != 1:
    mask4 = _pad_keys(mask4, 3, s_pad)
  return bias4, mask4


def _chunk_of(x, c0, chunk, axis):
  """The ``chunk`` keys from ``c0`` along ``axis``, unless ``x`` broadcasts along it."""
  return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, c0, chunk, axis)


def _visible(problem, rows, cols, c0, *, mask4, k_start, k_end, live):
  """(B, N, T, chunk) bool: the pairs of ``rows`` and the chunk's ``cols``
  the problem's mask, ``mask4`` and the key ranges keep, in live rows."""
  t, chunk = rows.shape[0], cols.shape[1]
  visible = jnp.broadcast_to(problem.mask.keep(rows, cols), (t, chunk))[None, None]
  if mask4 is not None:
    visible = visible & _chunk_of(mask4, c0, chunk, 3)
  if k_start is not None:
    visible = visible & (cols[None, None] >= lax.broadcast_to_rank(k_start, 3)[..., None])
  if k_end is not None:
    visible = visible & (cols[None, None] < lax.broadcast_to_rank(k_end, 3)[..., None])
  return visible & live[..., None]


def _summed_into_dbias(dbias, ds, c0):
  """``dbias`` with the chunk's dS (from key ``c0``) summed down to its shape."""
  keep = tuple(i for i, d in enumerate(dbias.shape[:3]) if d != 1)
  red = jnp.sum(ds, axis=tuple(i for i in range(3) if i not in keep), keepdims=True)
  if dbias.shape[3] == 1:
    return dbias + jnp.sum(red, axis=3, keepdims=True)
  return lax.dynamic_update_slice_in_dim(dbias, red, c0, 3)
