"""FP8 (float8_e4m3fn) inputs for :func:`kernel.dot_product_attention`: the
values and descales it takes, from arrays in any floating dtype::

  from kernel import dot_product_attention, fp8
  q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, per="head", rotation=jax.random.key(0))
  out = dot_product_attention(q8, k8, v8, **descales)

:func:`quantize` scales each tensor (``per="tensor"``) or each (batch, kv
head) (``per="head"``) so that its largest magnitude lands on e4m3's largest
value, 448, and rounds to e4m3, saturating; the descale (amax / 448) turns
the stored values back into real ones.  ``per="block"`` (a descale per block
of rows, as FlashAttention-3 keeps) is refused: the kernel takes descales
per tensor or per (batch, kv head) only.

:func:`rotate` is FlashAttention-3's incoherent processing: q and k times
the same orthonormal matrix R = diag(signs) H / sqrt(n), with random signs
and H the Hadamard matrix of order n, applied along the head dim, so that
q·kᵀ is unchanged in exact arithmetic and a large entry of q or k is spread
over n of them.  e4m3's error is relative, so the rotation does not shrink
the error of q·kᵀ on average; it moves it away from the largest logits,
where the unrotated error gathers and the softmax looks
(``docs/fp8/outliers.md`` measures it).  For a head dim that is no power of
two, H is block diagonal: one Hadamard matrix per block of n columns, n the
largest power of two dividing the head dim (72 = 9 blocks of 8); an odd head
dim is refused.  v is never rotated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["E4M3_MAX", "PER", "hadamard_block", "quantize", "quantize_qkv", "rotate"]

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
PER = ("tensor", "head")
# float32's smallest normal: a smaller descale would flush to zero on the GPU.
_TINY = float(np.finfo(np.float32).tiny)


def _check_per(per) -> None:
  if per == "block":
    raise ValueError(
        "per: 'block' descales (one per block of rows) are not supported by the kernel yet: "
        "dot_product_attention takes q_descale, k_descale and v_descale per tensor, shape (), "
        "or per (batch, kv head), shape (B, K); use per='tensor' or per='head'")
  if not isinstance(per, str) or per not in PER:
    raise ValueError(f"per: expected one of {list(PER)}, got {per!r}")


def _check_operand(name: str, x):
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is None or dtype is None:
    x = np.asarray(x)
    shape, dtype = x.shape, x.dtype
  if len(shape) != 4:
    raise ValueError(f"{name}: expected rank 4 (batch, seq, heads, head_dim), got shape "
                     f"{tuple(shape)}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name}: expected a floating dtype, got {np.dtype(dtype).name}")
  return x


def quantize(x, per: str = "tensor", *, kv_heads: int | None = None):
  """(values, descale) of ``x`` (batch, seq, heads, head_dim): ``values`` in
  float8_e4m3fn, ``values * descale`` within half an e4m3 step of ``x``.

  ``per="tensor"``: one float32 descale of shape (); ``per="head"``: one
  per (batch, kv head), shape (B, kv_heads), over the ``heads // kv_heads``
  consecutive heads that share a kv head (the query heads of one group under
  GQA); ``kv_heads`` defaults to ``x``'s own heads (key and value, or a
  query without GQA).  The descale is amax / 448, the largest magnitude
  stored as 448; a tensor or head of zeros gets descale 1.  An infinity or
  NaN in ``x`` makes its descale non-finite, which dot_product_attention
  refuses where the values are known (under ``jax.jit`` its outputs go
  NaN).  Works under ``jax.jit`` with ``per`` and ``kv_heads`` static."""
  _check_per(per)
  x = _check_operand("x", x)
  b, t, heads, d = x.shape
  groups = heads if kv_heads is None else kv_heads
  if (isinstance(groups, (bool, np.bool_)) or not isinstance(groups, (int, np.integer))
      or groups < 1 or heads % groups):
    raise ValueError(f"kv_heads: expected a positive divisor of x's {heads} heads, "
                     f"got {kv_heads!r}")
  x = jnp.asarray(x, jnp.float32)
  if per == "tensor":
    amax = jnp.max(jnp.abs(x))
    grouped = x
  else:
    grouped = x.reshape(b, t, groups, heads // groups, d)
    amax = jnp.max(jnp.abs(grouped), axis=(1, 3, 4))
  # A product, not amax / 448: XLA turns a division by a constant into one
  # under jit, and the eager call must give the same descale.
  scale = amax * jnp.float32(1 / E4M3_MAX)
  # Zeros (or amax so small its scale would be no normal float32) keep 1; a
  # NaN compares False and stays, so a bad input is not hidden.
  descale = jnp.where(scale < _TINY, jnp.float32(1.0), scale)
  spread = descale if per == "tensor" else descale[:, None, :, None, None]
  # amax / (amax / 448) may round a hair past 448, where e4m3fn has NaN.
  values = jnp.clip(grouped / spread, -E4M3_MAX, E4M3_MAX).astype(E4M3)
  return values.reshape(x.shape), descale


def hadamard_block(head_dim: int) -> int:
  """The order of the Hadamard blocks :func:`rotate` uses for this head dim:
  its largest power-of-two divisor.  An odd head dim is a ValueError: the
  rotation would only flip signs."""
  if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)) \
      or head_dim < 2 or head_dim % 2:
    raise ValueError(f"head_dim: the rotation needs an even head dim (its Hadamard blocks are "
                     f"the largest power of two dividing it), got {head_dim!r}")
  return int(head_dim & -head_dim)


def _check_rotation(rotation) -> None:
  dtype = getattr(rotation, "dtype", None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  raw = dtype == jnp.uint32 and getattr(rotation, "shape", None) == (2,)
  if not (typed and rotation.shape == () or raw):
    raise ValueError(f"rotation: expected a jax.random key (jax.random.key(seed)) or None, "
                     f"got {rotation!r}")


def rotate(x, rotation):
  """``x`` (batch, seq, heads, head_dim) times R = diag(signs) H / sqrt(n)
  along the head dim, in float32: signs of ±1 drawn from the jax.random key
  ``rotation``, H block diagonal with Hadamard blocks of order
  n = :func:`hadamard_block` (head_dim).  R is orthonormal, so rotating q
  and k with the same key leaves q·kᵀ unchanged but for float32 rounding."""
  x = _check_operand("x", x)
  _check_rotation(rotation)
  d = x.shape[-1]
  try:
    n = hadamard_block(d)
  except ValueError as e:
    raise ValueError(f"x: {e}") from None
  signs = jax.random.rademacher(rotation, (d,), jnp.float32)
  y = jnp.asarray(x, jnp.float32) * signs
  lead = y.shape[:-1]
  # The fast Walsh-Hadamard transform: log2(n) rounds of sums and
  # differences, exact adds in float32 where a matmul could run in TF32.
  h = 1
  while h < n:
    y = y.reshape(*lead, d // (2 * h), 2, h)
    y = jnp.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2)
    h *= 2
  return y.reshape(x.shape) * jnp.float32(1 / np.sqrt(n))


def quantize_qkv(query, key, value, per: str = "tensor", *, rotation=None):
  """(q8, k8, v8, descales) for ``dot_product_attention(q8, k8, v8,
  **descales)``: each of query (B, T, N, H), key (B, S, K, H) and value
  quantised by :func:`quantize` ``per`` tensor or per (batch, kv head), the
  query's per-head descales over each group of N // K query heads.  With
  ``rotation`` (a jax.random key), query and key are first rotated by the
  same :func:`rotate`; the value never is.  The logits are unchanged by it
  (the call's default scale, 1 / sqrt(H), too), so mask, bias and
  causality apply as before."""
  _check_per(per)
  query, key, value = (_check_operand(n, x) for n, x in
                       (("query", query), ("key", key), ("value", value)))
  if query.shape[2] % max(key.shape[2], 1):
    raise ValueError(f"query: its {query.shape[2]} heads must be a multiple of key's "
                     f"{key.shape[2]}")
  if rotation is not None:
    _check_rotation(rotation)
    for name, x in (("query", query), ("key", key)):
      try:
        hadamard_block(x.shape[-1])
      except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    query, key = rotate(query, rotation), rotate(key, rotation)
  q8, q_descale = quantize(query, per, kv_heads=key.shape[2])
  k8, k_descale = quantize(key, per)
  v8, v_descale = quantize(value, per)
  return q8, k8, v8, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
