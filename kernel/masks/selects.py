"""Which (row, key) pairs of a tile count, in the kernels' registers: the
forward's masked logits (:func:`masked_logits`, index arrays) and the
backward's keep of a step's transposed tile (:class:`Keep`, made by
:func:`pair_keep`, chosen per step by :func:`masked_terms`; its causal and
padded-key terms are kernel/masks/register_selects.py's per-register
selects).  The static facts come from the call's :class:`Mask`; the key
ranges and the mask operand are the kernels' traced inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from kernel.common import NEG_INF, WGMMA
from kernel.masks import register_selects
from kernel.masks.mask import Mask
from kernel.sync.seams import seam


def _iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


@seam("masks.masked_logits")
def masked_logits(mask: Mask, s, *, q_base, k_base, edge: bool, ragged: bool,
                  k_start=None, k_start_max=None, k_end=None, k_end_min=None):
  """The forward's (rows, keys) WGMMA tile of logits ``s`` (rows
  ``q_base`` on, keys ``k_base`` on), -inf where the pair does not count.
  ``edge``: the block may reach the diagonal or the padded keys, which are
  masked only then (``ragged``: the launch's last key block holds padded
  keys); ``k_start``/``k_end``: the rows' key ranges (None: none), each
  masked only on the blocks that cross the tile's largest start
  (``k_start_max``) or smallest end (``k_end_min``)."""
  shape = s.shape
  block_kv = shape[1]
  key = k_base + _iota(shape, 1)
  if edge and mask.causal:
    # Index arrays here, not register_selects.causal_select as in the
    # backward: the forward has registers to spare, and the asm select was
    # slower in it (docs/decisions/forward-index-array-masks.md).
    s = jnp.where(q_base + _iota(shape, 0) >= key, s, NEG_INF)
  if edge and ragged:
    s = lax.cond(k_base + block_kv > mask.seq_kv,
                 lambda: jnp.where(key < mask.seq_kv, s, NEG_INF), lambda: s)
  if k_start is not None:
    s = lax.cond(
        k_base < k_start_max,
        lambda: jnp.where(key >= lax.broadcast_in_dim(k_start, shape, [0]), s, NEG_INF),
        lambda: s)
  if k_end is not None:
    s = lax.cond(
        k_base + block_kv > k_end_min,
        lambda: jnp.where(key < lax.broadcast_in_dim(k_end, shape, [0]), s, NEG_INF),
        lambda: s)
  return s


def _and(a, b):
  return b if a is None else (a if b is None else a & b)


@dataclasses.dataclass(frozen=True)
class KeysBelow:
  """The keep term key < limit (the padded keys past the sequence), applied
  by kernel/masks/register_selects.py without index arrays."""

  limit: Any


@dataclasses.dataclass(frozen=True)
class Keep:
  """The (key, query) pairs of a backward step's tile that count: key <=
  query where ``causal`` and key < ``key_limit`` where set (by
  kernel/masks/register_selects.py, without index arrays), and ``terms``, a
  bool array of the other conditions (None: none)."""

  causal: bool
  key_base: Any
  query_base: Any
  key_dim: int
  terms: Any
  key_limit: Any = None

  @seam("masks.keep_select")
  def select(self, x):
    """x where the pair counts, 0 elsewhere."""
    if self.terms is not None:
      x = jnp.where(self.terms, x, 0.0)
    if self.key_limit is not None:
      x = register_selects.key_limit_select(x, key_base=self.key_base, limit=self.key_limit,
                                            key_dim=self.key_dim, fill=0.0)
    if self.causal:
      x = register_selects.causal_select(x, key_base=self.key_base,
                                         query_base=self.query_base, key_dim=self.key_dim,
                                         fill=0.0)
    return x


def pair_keep(shape, key_base, query_base, key_dim, *, causal, terms):
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
    key = key_base + _iota(shape, key_dim)
    for term in arrays:
      keep = _and(keep, term(key))
  if keep is None and not causal and not limits:
    return None
  return Keep(causal, key_base, query_base, key_dim, keep, limits[0] if limits else None)


@seam("masks.meets_diagonal")
def meets_diagonal(key_base, num_keys, query_base):
  """Whether a tile of keys [key_base, key_base + num_keys) holds a key
  above the first query of its block (query_base), i.e. whether the causal
  mask (key <= query) can drop any of its pairs: if not, every key of the
  tile is at or below every query of the block.  Ints or traced int32."""
  return key_base + num_keys - 1 > query_base


def keep_branches(mask: Mask, interior) -> bool:
  """Whether :func:`masked_terms` chooses a step's keep by a branch (then
  both sides read what the step computed before it)."""
  return mask.causal or interior is not None


@seam("masks.masked_terms")
def masked_terms(mask: Mask, terms, keep_of, *, on_diagonal, interior=None):
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
  causal = mask.causal
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
