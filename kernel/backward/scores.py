"""The arithmetic both backward kernels run on one streamed block, on
transposed tiles: scaled logits, P from the forward's residuals, the masks
(causal, key ranges, a mask operand) and dS (:func:`_step_scores`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.backward import masks
from kernel.common import LOG2E, WGMMA
from kernel.tiling.plan import Problem


def _scaled_logits(s, f: Problem, bias):
  """(s_final, dsdu): the logits after scale, bias and soft cap, and the soft
  cap's derivative d s_final / d u (None without a cap)."""
  u = s * f.scale
  if bias is not None:
    u = u + bias.astype(jnp.float32)
  if f.logits_soft_cap is None:
    return u, None
  t = jnp.tanh(u * (1.0 / f.logits_soft_cap))
  return t * f.logits_soft_cap, 1.0 - t * t


def _probabilities(s, lse2, keep):
  """exp2(s * log2 e - lse2) where kept, 0 elsewhere (lse2 broadcast)."""
  p = jnp.exp2(s * LOG2E - lse2)
  return p if keep is None else keep.select(p)


def _masked_to_zero(ds, keep):
  """dS is exactly 0 for a masked pair, as in the reference: p = 0 there, but
  p * (dP - delta) would be 0 * NaN = NaN when a NaN in dO reaches dP."""
  return ds if keep is None else keep.select(ds)


def _and(a, b):
  return b if a is None else (a if b is None else a & b)


@dataclasses.dataclass(frozen=True)
class KeysBelow:
  """The keep term key < limit (the padded keys past the sequence), applied
  by kernel.backward.masks without index arrays."""

  limit: Any


@dataclasses.dataclass(frozen=True)
class _Keep:
  """The (key, query) pairs of a step's tile that count: key <= query where
  ``causal`` and key < ``key_limit`` where set (by kernel.backward.masks, without
  index arrays), and ``terms``, a bool array of the other conditions (None:
  none)."""

  causal: bool
  key_base: Any
  query_base: Any
  key_dim: int
  terms: Any
  key_limit: Any = None

  def select(self, x):
    """x where the pair counts, 0 elsewhere."""
    if self.terms is not None:
      x = jnp.where(self.terms, x, 0.0)
    if self.key_limit is not None:
      x = masks.key_limit_select(x, key_base=self.key_base, limit=self.key_limit,
                                 key_dim=self.key_dim, fill=0.0)
    if self.causal:
      x = masks.causal_select(x, key_base=self.key_base, query_base=self.query_base,
                              key_dim=self.key_dim, fill=0.0)
    return x


def _pair_keep(shape, key_base, query_base, key_dim, *, causal, terms):
  """Which (key, query) pairs of a step's tile count (None: all): key <=
  query where ``causal``, and each of ``terms`` (callables of the key
  indices giving bool arrays: key ranges, mask; or a KeysBelow for padded
  keys).  ``key_dim``: the tile's dimension along keys (0 in the dK/dV
  kernel's transposed tiles, 1 in the dQ kernel's)."""
  limits = [t.limit for t in terms if isinstance(t, KeysBelow)]
  arrays = [t for t in terms if not isinstance(t, KeysBelow)]
  if len(limits) > 1:
    raise ValueError(f"at most one KeysBelow term, got {len(limits)}")
  keep = None
  if arrays:
    key = key_base + plgpu.broadcasted_iota(jnp.int32, shape, key_dim, layout=WGMMA)
    for term in arrays:
      keep = _and(keep, term(key))
  if keep is None and not causal and not limits:
    return None
  return _Keep(causal, key_base, query_base, key_dim, keep, limits[0] if limits else None)


def meets_diagonal(key_base, num_keys, query_base):
  """Whether a tile of keys [key_base, key_base + num_keys) holds a key
  above the first query of its block (query_base), i.e. whether the causal
  mask (key <= query) can drop any of its pairs: if not, every key of the
  tile is at or below every query of the block.  Ints or traced int32."""
  return key_base + num_keys - 1 > query_base


def _masked_terms(terms, keep_of, *, causal, on_diagonal, interior=None):
  """``terms(keep)`` for the step's kept pairs, by a branch on what the step
  can drop.  ``keep_of(causal, edges)``: the keep array with the causal mask
  where ``causal`` and the edge terms (key ranges, padded keys) where
  ``edges``.  ``on_diagonal()`` (a traced bool): some key of the tile lies
  above its first query; ``interior()`` (None without edge terms): every
  pair of the step is kept by the edge terms.

  Without edge terms, only the steps on the diagonal pay for the causal
  mask: every other step of a causal backward is wholly below it and skips
  the mask's index arithmetic and selects
  (docs/decisions/backward-causal-mask-on-the-diagonal.md).  With edge terms, the steps
  that are interior and off the diagonal skip both, every other step pays
  for both (a key range's edge usually meets the diagonal anyway).
  """
  if interior is None:
    if causal:
      return lax.cond(on_diagonal(), lambda: terms(keep_of(True, False)),
                      lambda: terms(keep_of(False, False)))
    return terms(keep_of(False, False))
  edge = ~interior()
  if causal:
    edge = edge | on_diagonal()
  return lax.cond(edge, lambda: terms(keep_of(causal, True)),
                  lambda: terms(keep_of(False, False)))


def _product(shape, a, b):
  """A B^T into a fresh f32 accumulator, waited for."""
  def product(acc):
    plgpu.wgmma(acc, a, b.T)
    return acc[...]
  return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _step_scores(f: Problem, shape, *, s_ops, dp_ops, paired, want_ds, bias_of,
                 terms, key_dim, key_base, num_keys, query_base, lse2_of, delta_of,
                 edge_terms=(), interior=None):
  """The step both kernels share, on tiles transposed to each other: S (and,
  for dS, dP) from shared memory, the logits, the kept (key, query) pairs,
  P = exp2(S log2 e - lse) and dS = P (dP - delta), zero where not kept.

  ``s_ops``, ``dp_ops``: the (A, B) of S = A B^T and dP = A B^T (dp_ops
  unused without ``want_ds``); ``paired``: S and dP issued together and
  waited once; ``bias_of()``: the step's bias tile or None; ``terms``: the
  keep conditions besides causal (:func:`_pair_keep`); ``key_dim``: the
  tile's dimension along keys, the per-query rows ``lse2_of()`` and
  ``delta_of()`` broadcast along the other (read where the arithmetic first
  needs them); ``edge_terms``: keep conditions that only the steps not
  ``interior()`` (a traced bool; None: every step) apply
  (:func:`_masked_terms`).  Returns (P, dS), dS None without ``want_ds``.
  """
  query_dim = 1 - key_dim
  zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)
  if paired and want_ds:
    # S and dP depend on nothing computed here: issue both, wait once.
    def s_and_dp(refs):
      s_ref, dp_ref = refs
      plgpu.wgmma(s_ref, s_ops[0], s_ops[1].T)
      plgpu.wgmma(dp_ref, dp_ops[0], dp_ops[1].T)
    s, dp = pl.run_state(s_and_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
  else:
    s, dp = _product(shape, *s_ops), None
  s, dsdu = _scaled_logits(s, f, bias_of())
  if not edge_terms:
    interior = None
  keep_of = lambda causal, edges: _pair_keep(
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

  if (f.is_causal or interior is not None) and want_ds and dp is None:
    dp = _product(shape, *dp_ops)  # outside the branch: both sides read it
  return _masked_terms(lambda keep: step_terms(keep, dp), keep_of, causal=f.is_causal,
                       on_diagonal=lambda: meets_diagonal(key_base, num_keys, query_base),
                       interior=interior)
