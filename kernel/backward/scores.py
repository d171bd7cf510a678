"""The arithmetic both backward kernels run on one streamed block, on
transposed tiles: scaled logits, P from the forward's residuals, the kept
pairs (kernel/masks/selects.py: the call's mask, key ranges, a mask
operand) and dS (:func:`_step_scores`)."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.backward import parts
from kernel.common import LOG2E, WGMMA
from kernel.masks.selects import keep_branches, masked_terms, meets_diagonal, pair_keep
from kernel.sync.seams import seam
from kernel.tiling.plan import Problem


@seam("scores.scaled_logits")
def _scaled_logits(s, problem: Problem, bias):
  """(s_final, dsdu): the logits after scale, bias and soft cap, and the soft
  cap's derivative d s_final / d u (None without a cap)."""
  u = s * problem.scale
  if bias is not None:
    u = u + bias.astype(jnp.float32)
  if problem.logits_soft_cap is None:
    return u, None
  t = jnp.tanh(u * (1.0 / problem.logits_soft_cap))
  return t * problem.logits_soft_cap, 1.0 - t * t


def _probabilities(s, lse2, keep):
  """exp2(s * log2 e - lse2) where kept, 0 elsewhere (lse2 broadcast)."""
  p = jnp.exp2(s * LOG2E - lse2)
  return p if keep is None else keep.select(p)


@seam("scores.masked_to_zero")
def _masked_to_zero(ds, keep):
  """dS is exactly 0 for a masked pair, as in the reference: p = 0 there, but
  p * (dP - delta) would be 0 * NaN = NaN when a NaN in dO reaches dP."""
  return ds if keep is None else keep.select(ds)


def _product(shape, a, b):
  """A B^T into a fresh f32 accumulator, waited for (A and B whole, or
  in parts: kernel/backward/parts.py)."""
  def product(acc):
    if isinstance(a, parts.Parts):
      parts.issue_abt(acc, a, b)
    else:
      plgpu.wgmma(acc, a, b.T)
    return acc[...]
  return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _step_scores(problem: Problem, shape, *, s_ops, dp_ops, paired, want_ds, bias_of,
                 terms, key_dim, key_base, num_keys, query_base, lse2_of, delta_of,
                 edge_terms=(), interior=None):
  """The step both kernels share, on tiles transposed to each other: S (and,
  for dS, dP) from shared memory, the logits, the kept (key, query) pairs,
  P = exp2(S log2 e - lse) and dS = P (dP - delta), zero where not kept.

  ``s_ops``, ``dp_ops``: the (A, B) of S = A B^T and dP = A B^T (dp_ops
  unused without ``want_ds``); ``paired``: S and dP issued together and
  waited once; ``bias_of()``: the step's bias tile or None; ``terms``: the
  keep conditions besides causal (kernel.masks.selects.pair_keep);
  ``key_dim``: the tile's dimension along keys, the per-query rows
  ``lse2_of()`` and ``delta_of()`` broadcast along the other (read where
  the arithmetic first needs them); ``edge_terms``: keep conditions that only the steps not
  ``interior()`` (a traced bool; None: every step) apply
  (kernel.masks.selects.masked_terms).  Returns (P, dS), dS None without
  ``want_ds``.
  """
  query_dim = 1 - key_dim
  zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)
  if paired and want_ds:
    # S and dP depend on nothing computed here: issue both, wait once.
    def s_and_dp(refs):
      s_ref, dp_ref = refs
      if isinstance(s_ops[0], parts.Parts):  # rows in parts (untiled copies)
        parts.issue_abt(s_ref, *s_ops)
        parts.issue_abt(dp_ref, *dp_ops)
        return
      plgpu.wgmma(s_ref, s_ops[0], s_ops[1].T)
      plgpu.wgmma(dp_ref, dp_ops[0], dp_ops[1].T)
    s, dp = pl.run_state(s_and_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
  else:
    s, dp = _product(shape, *s_ops), None
  s, dsdu = _scaled_logits(s, problem, bias_of())
  if not edge_terms:
    interior = None
  keep_of = lambda causal, edges: pair_keep(
      shape, key_base, query_base, key_dim, causal=causal,
      terms=[*terms, *edge_terms] if edges else terms)

  def step_terms(keep, dp):
    """P and (for dS) dS of the step, zero where not kept."""
    p = _probabilities(s, lax.broadcast_in_dim(lse2_of(), shape, [query_dim]), keep)
    ds = None
    if want_ds:
      if dp is None:
        dp = _product(shape, *dp_ops)
      ds = p * (dp - lax.broadcast_in_dim(delta_of(), shape, [query_dim]))
      if dsdu is not None:
        ds = ds * dsdu
      ds = _masked_to_zero(ds, keep)
    return p, ds

  if keep_branches(problem.mask, interior) and want_ds and dp is None:
    dp = _product(shape, *dp_ops)  # outside the branch: both sides read it
  return masked_terms(problem.mask, lambda keep: step_terms(keep, dp), keep_of,
                      on_diagonal=lambda: meets_diagonal(key_base, num_keys, query_base),
                      interior=interior)
