"""Float64 NumPy reference for attention, its residuals and its gradients.

Semantics (the letters and layout are those of ``kernel/call.py``)::

  u[b, n, i, j] = scale * <query[b, i, n], key[b, j, n // G]> + bias[b, n, i, j]
  s = cap * tanh(u / cap)      if logits_soft_cap (= cap) is set, else s = u
  key j takes part in row i iff  mask[b, n, i, j]                (if a mask)
                            and  j <= i                          (if is_causal)
                            and  k_start[b, n, i] <= j < k_end[b, n, i]
                            and  i < query_seq_lengths[b]        (if given)
                            and  j < key_value_seq_lengths[b]    (if given)
                            and  i - left <= j <= i + right      (local_window_size)
                            and  q_segment_ids[b, i] == kv_segment_ids[b, j]
                            and  j // C == i // C                (attention_chunk = C)
  m   = max_j s[.., j]                       over the keys that take part
  l   = sum_j exp(s[.., j] - m)              over the keys that take part
  out = sum_j exp(s[.., j] - m) value[b, j, n // G] / l

``G = N // K`` query heads share a key/value head; ``scale`` defaults to
``1 / sqrt(H)``; the causal mask is aligned top-left, as in
``jax.nn.dot_product_attention`` (row i sees keys 0..i whatever T and S are).
FP8 (``float8_e4m3fn``) inputs stand for their values times their descales
(``q_descale``, ``k_descale``, ``v_descale``, per tensor or per (batch, kv
head)): the reference computes on those dequantised values
(:func:`dequantised`), in float64 as for every dtype.

The lengths and the window are jax.nn.dot_product_attention's (an int window
w means (w, w)); the segment ids are packed sequences' (Flax, tokamax).
They are applied here as the elementwise conditions above, with no key
ranges, so that the kernel's mapping of them onto key ranges
(kernel/key_ranges.py) is checked against an independent reading.  A padded
query row (i >= query_seq_lengths[b]) is a fully masked row.

Residuals: ``m`` and ``l`` have shape (B, N, T). ``m`` is in NATURAL-log space
(the kernel keeps its running max in base 2 and must divide by log2(e) before
storing it, see seed 000). ``l`` is relative to the true row max ``m`` (the
kernel must apply any pending rescale factor before storing it).

FULLY MASKED ROW CONTRACT. A row is fully masked when no key takes part, or
when every key that takes part has logit ``s = -inf`` (e.g. a ``-inf`` bias;
with a soft cap, ``tanh`` maps ``-inf`` to ``-cap``, which is finite). For such
a row::

  out = 0,  m = -inf,  l = 0,
  dq = 0 for that row, and the row adds nothing to dk, dv or dbias.

No NaN or infinity other than ``m = -inf`` appears for such a row, whatever
the values of the masked keys. The kernel follows the same contract.

NaN and infinity in the inputs. The reference uses IEEE arithmetic over the
keys that take part: a NaN in the row's query, or in a key, bias or value entry
that takes part in the row, makes the row's output NaN (and m, l NaN when the
NaN reaches a logit); a ``+inf`` logit gives ``inf - inf = NaN``. A key that
takes part in no way is absent: NaN or infinity in its key, value or bias
entries does not reach the row. A blocked kernel computes ``p @ v`` over whole
key blocks, so a non-finite VALUE of a masked key can still reach the other
rows of its block through ``0 * NaN``; conformance tests therefore put
non-finite inputs only where they take part. The fully masked row contract
holds regardless (out = 0).

Public functions:

* :func:`attention_reference` -- forward pass, float64, with residuals.
* :func:`attention_reference_vjp` -- float64 gradients.
* :func:`backward_from_residuals` -- the backward pass fed with GIVEN
  residuals (out, m, l), so that wrong residuals give wrong gradients.
* :func:`naive_attention` / :func:`naive_attention_vjp` -- the same maths done
  naively in a low-precision dtype, every op's result rounded to it; used only
  as the "naive same-dtype implementation" of the tolerance rule
  (``harness/numerics/tolerance.py``).
* :func:`key_visibility` -- which keys take part in which row.

Nothing here touches global JAX configuration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kernel.call import (EVERY_DTYPE, FP8_DTYPES, AttentionShapes, Call, bfloat16, float16,
                         float32)
from kernel.masks import Mask
from kernel.tiling.plan import FP8_P_SCALE_LOG2

# jax.nn.dot_product_attention's arguments beyond the logits', and the
# packed-sequence segment ids: only key_visibility reads them.
VARIANT_ARGS = ("query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                "attention_chunk", "q_segment_ids", "kv_segment_ids")

__all__ = [
  "REFERENCE_DTYPES",
  "Reference",
  "Gradients",
  "attention_reference",
  "attention_reference_vjp",
  "backward_from_residuals",
  "naive_attention",
  "naive_attention_vjp",
  "key_visibility",
  "dequantised",
  "quantise_e4m3",
  "tensor_core_products",
  "reduce_to_shape",
  "VARIANT_ARGS",
]

# The reference also takes float64 inputs (finite differences need them).
REFERENCE_DTYPES = EVERY_DTYPE


def _split(args: tuple, kwargs: dict, trailing: int) -> tuple[Call, tuple]:
  """The call of ``args`` and ``kwargs`` (a kernel.call.Call, or the
  arguments of one) and the ``trailing`` positional arguments after it."""
  head, tail = (args[:len(args) - trailing], args[len(args) - trailing:]) if trailing \
    else (args, ())
  if len(tail) != trailing:
    raise TypeError(f"expected the call and {trailing} more positional arguments")
  return Call.of(*head, **kwargs), tuple(tail)


@dataclasses.dataclass(frozen=True)
class Reference:
  """Forward result of :func:`attention_reference`, all float64.

  out:     (B, T, N, Hv)
  m:       (B, N, T) row max of the logits, natural log; -inf on fully masked rows
  l:       (B, N, T) sum of exp(s - m); 0 on fully masked rows
  logits:  (B, N, T, S) s (after the soft cap), -inf where the key is masked
  probs:   (B, N, T, S) softmax probabilities, 0 where masked / fully masked
  visible: (B, N, T, S) bool, whether key j takes part in row i
  """

  out: np.ndarray
  m: np.ndarray
  l: np.ndarray
  logits: np.ndarray
  probs: np.ndarray
  visible: np.ndarray

  @property
  def lse(self) -> np.ndarray:
    """Natural log-sum-exp, m + log(l); -inf on fully masked rows."""
    with np.errstate(divide="ignore"):
      return self.m + np.log(self.l)

  @property
  def fully_masked(self) -> np.ndarray:
    """(B, N, T) bool: rows covered by the fully masked row contract."""
    return self.m == -np.inf


@dataclasses.dataclass(frozen=True)
class Gradients:
  """Gradients of sum(out * d_out). dbias has bias's own shape (None without bias)."""

  dq: np.ndarray
  dk: np.ndarray
  dv: np.ndarray
  dbias: np.ndarray | None


# ---------------------------------------------------------------------------
# Shared pieces.


def _f64(x: Any) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def key_visibility(call: Call) -> np.ndarray:
  """(B, N, T, S) bool: key j takes part in row i of ``call`` (mask, causal,
  key range, and the VARIANT_ARGS, each straight from its definition):

  * query_seq_lengths (B,): row i takes part only if i < len[b];
  * key_value_seq_lengths (B,): key j only if j < len[b];
  * local_window_size (left, right), or w for (w, w): i - left <= j <= i + right
    (with causal, kernel.masks.Mask.keep: the element definition the kernels'
    key ranges, block bounds and selects are held to);
  * attention_chunk C (FlashAttention-3's chunked attention): j // C == i // C;
  * q_segment_ids (B, T), kv_segment_ids (B, S): q_ids[b, i] == kv_ids[b, j].
  """
  B, N, T, S = call.shapes.logits_shape
  mask, is_causal, k_start, k_end, window = (call.mask, call.is_causal, call.k_start,
                                             call.k_end, call.window)
  query_seq_lengths, key_value_seq_lengths = call.query_seq_lengths, call.key_value_seq_lengths
  q_segment_ids, kv_segment_ids = call.q_segment_ids, call.kv_segment_ids
  visible = np.ones((B, N, T, S), dtype=bool)
  if mask is not None:
    visible &= np.broadcast_to(np.asarray(mask, dtype=bool), visible.shape)
  i, j = np.arange(T), np.arange(S)
  static = Mask(seq_q=T, seq_kv=S, causal=bool(is_causal), window=window,
                chunk=call.attention_chunk)
  visible &= static.keep(i[:, None], j[None, :])[None, None]
  if k_start is not None:
    start = np.broadcast_to(np.asarray(k_start).astype(np.int64), (B, N, T))
    visible &= j >= start[..., None]
  if k_end is not None:
    end = np.broadcast_to(np.asarray(k_end).astype(np.int64), (B, N, T))
    visible &= j < end[..., None]
  if query_seq_lengths is not None:
    q_len = np.asarray(query_seq_lengths).astype(np.int64)
    visible &= (i[None, :] < q_len[:, None])[:, None, :, None]
  if key_value_seq_lengths is not None:
    kv_len = np.asarray(key_value_seq_lengths).astype(np.int64)
    visible &= (j[None, :] < kv_len[:, None])[:, None, None, :]
  if q_segment_ids is not None:
    q_ids = np.asarray(q_segment_ids).astype(np.int64)
    kv_ids = np.asarray(kv_segment_ids).astype(np.int64)
    visible &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  return visible


def head_descales(call: Call) -> dict[str, np.ndarray] | None:
  """FP8: each descale as float64 (B, N) (a query head reads its kv head's);
  None for other dtypes."""
  if not call.fp8:
    return None
  sh = call.shapes
  per_kv = lambda x: np.broadcast_to(np.asarray(x, np.float64), (sh.B, sh.K))
  return {name: np.repeat(per_kv(getattr(call, name)), sh.group_size, axis=1)
          for name in ("q_descale", "k_descale", "v_descale")}


def dequantised(call: Call) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(query, key, value) as float64 in the call's layout: FP8's stored
  values times their descales (exact in float64), other dtypes as they are."""
  q, k, v = (_f64(x) for x in (call.query, call.key, call.value))
  d = head_descales(call)
  if d is None:
    return q, k, v
  g = call.shapes.group_size
  kv = lambda name: d[name][:, ::g][:, None, :, None]   # (B, 1, K, 1)
  return q * d["q_descale"][:, None, :, None], k * kv("k_descale"), v * kv("v_descale")


E4M3_MAX = 448.0


def quantise_e4m3(x: np.ndarray) -> np.ndarray:
  """``x`` rounded to float8_e4m3fn as the GPU's ``cvt.rn.satfinite`` does
  (to nearest even, beyond +-448 to +-448, NaN kept), back in float32."""
  x = np.asarray(x, np.float32)
  return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPES[0]).astype(np.float32)


def tensor_core_products(a: np.ndarray, b: np.ndarray, bits: int, part: int = 32,
                         init: np.ndarray | None = None) -> np.ndarray:
  """``init + a @ b`` of FP8 values summed as Hopper's FP8 tensor cores sum
  them: ``part`` elements of the contracted axis at a time (one wgmma's K),
  the running sum, ``init`` (an accumulator carried in) included, cut
  toward zero to ``bits`` fraction bits after each part; float32.  The
  tolerance rule's CPU yardstick and the kernel's NumPy model sum both FP8
  products this way (harness/numerics/tolerance.py)."""
  total = np.zeros(a.shape[:-1] + b.shape[-1:], np.float64)
  if init is not None:
    total = total + np.asarray(init, np.float64)
  for c0 in range(0, a.shape[-1], part):
    total = total + a[..., c0:c0 + part].astype(np.float64) @ b[..., c0:c0 + part, :]
    frac, exp = np.frexp(total)
    total = np.ldexp(np.trunc(np.ldexp(frac, bits + 1)), exp - bits - 1)
  return total.astype(np.float32)


def reduce_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """Sum ``x`` over the axes that broadcasting ``shape`` to ``x.shape`` added."""
  shape = tuple(shape)
  lead = x.ndim - len(shape)
  x = x.sum(axis=tuple(range(lead))) if lead else x
  axes = tuple(a for a, d in enumerate(shape) if d == 1 and x.shape[a] != 1)
  if axes:
    x = x.sum(axis=axes, keepdims=True)
  return x.reshape(shape)


def _heads_first(x: np.ndarray) -> np.ndarray:
  """(B, L, heads, D) -> (B, heads, L, D)."""
  return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _expand_kv(x: np.ndarray, group: int) -> np.ndarray:
  """(B, L, K, D) -> (B, N, L, D) with query head n reading kv head n // group."""
  return np.repeat(_heads_first(x), group, axis=1)


def _sum_groups(x: np.ndarray, group: int) -> np.ndarray:
  """(B, N, L, D) -> (B, L, K, D), summing the query heads of each kv head."""
  B, N, L, D = x.shape
  return np.swapaxes(x.reshape(B, N // group, group, L, D).sum(axis=2), 1, 2)


@dataclasses.dataclass(frozen=True)
class _Logits:
  shapes: AttentionShapes
  scale: float
  q: np.ndarray  # (B, N, T, H)
  k: np.ndarray  # (B, N, S, H), expanded over the query heads
  v: np.ndarray  # (B, N, S, Hv), expanded over the query heads
  u: np.ndarray  # (B, N, T, S) before the soft cap
  s: np.ndarray  # (B, N, T, S) after the soft cap, not masked
  visible: np.ndarray  # (B, N, T, S)
  bias_shape: tuple[int, ...] | None
  cap: float | None


def _logits(call: Call) -> _Logits:
  shapes = call.shapes
  query, key, value, bias = call.query, call.key, call.value, call.bias
  logits_soft_cap = call.logits_soft_cap
  scale = 1.0 / math.sqrt(shapes.H) if call.scale is None else float(call.scale)
  g = shapes.group_size
  query, key, value = dequantised(call)
  q = _heads_first(query)
  k = _expand_kv(key, g)
  v = _expand_kv(value, g)
  with np.errstate(invalid="ignore", over="ignore"):
    u = scale * (q @ np.swapaxes(k, -1, -2))
    bias_shape = None
    if bias is not None:
      b = _f64(bias)
      bias_shape = b.shape
      u = u + b
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    s = u if cap is None else cap * np.tanh(u / cap)
  visible = key_visibility(call)
  return _Logits(shapes, scale, q, k, v, u, s, visible, bias_shape, cap)


def _active_matmul(a: np.ndarray, b: np.ndarray, active: np.ndarray) -> np.ndarray:
  """sum_j a[.., i, j] * b[.., j, c] over the ``active`` (i, j) pairs only.

  ``a`` is zero off ``active``. A plain matmul would still turn a
  non-finite entry of ``b`` that only inactive pairs touch into NaN (0 * inf),
  so non-finite entries are zeroed for the matmul and their IEEE effect on
  the active pairs is put back from counts: NaN if an active pair meets a NaN
  or computes 0 * inf (or meets both infinities), otherwise the infinity met.
  """
  finite = np.isfinite(b)
  if finite.all():
    return a @ b
  out = a @ np.where(finite, b, 0.0)
  act = active.astype(np.float64)
  hits = lambda x, y: (x @ y.astype(np.float64)) > 0
  nan = hits(act, np.isnan(b)) | hits(act * (a == 0), np.isinf(b))
  pos = hits(act * (a > 0), b == np.inf) | hits(act * (a < 0), b == -np.inf)
  neg = hits(act * (a > 0), b == -np.inf) | hits(act * (a < 0), b == np.inf)
  out = np.where(pos, np.inf, out)
  out = np.where(neg, -np.inf, out)
  return np.where(nan | (pos & neg), np.nan, out)


# ---------------------------------------------------------------------------
# Forward.


def attention_reference(*call: Any, **kwargs: Any) -> Reference:
  """Attention in float64 with residuals m, l (natural log, (B, N, T)), for
  ``call``: a kernel.call.Call, or its arguments (query, key, value, bias,
  mask, then keywords).

  Inputs of any dtype in ``REFERENCE_DTYPES`` are converted exactly to float64.
  See the module docstring for the semantics and the fully masked row contract.
  """
  lg = _logits(_split(call, kwargs, 0)[0])
  with np.errstate(invalid="ignore", over="ignore"):
    logits = np.where(lg.visible, lg.s, -np.inf)
    m = logits.max(axis=-1)  # NaN propagates through max
    empty = m == -np.inf
    m_safe = np.where(empty, 0.0, m)
    e = np.where(lg.visible, np.exp(logits - m_safe[..., None]), 0.0)
    l = e.sum(axis=-1)
    probs = np.where(empty[..., None], 0.0, e / np.where(empty, 1.0, l)[..., None])
  active = lg.visible & ~empty[..., None]
  out = _heads_first(_active_matmul(probs, lg.v, active))
  return Reference(out=out, m=m, l=l, logits=logits, probs=probs,
                   visible=lg.visible)


# ---------------------------------------------------------------------------
# Backward.


def _check_like(name: str, x: Any, shape: tuple[int, ...]) -> np.ndarray:
  arr = _f64(x)
  if arr.shape != tuple(shape):
    raise ValueError(f"{name}: expected shape {tuple(shape)}, got {arr.shape}")
  return arr


def _backward(lg: _Logits, out, m, l, d_out) -> Gradients:
  sh = lg.shapes
  out = _check_like("out", out, (sh.B, sh.T, sh.N, sh.Hv))
  m = _check_like("m", m, sh.row_shape)
  l = _check_like("l", l, sh.row_shape)
  d_out = _check_like("d_out", d_out, (sh.B, sh.T, sh.N, sh.Hv))
  g = sh.group_size
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    # l == 0 marks a fully masked row: it contributes nothing. Any other l
    # (NaN included) is used as given, so bad residuals show in the gradients.
    live = ~(l == 0)
    use = lg.visible & live[..., None]
    use_t = np.swapaxes(use, -1, -2)
    p = np.where(use, np.exp(lg.s - m[..., None]) / l[..., None], 0.0)
    do = _heads_first(d_out)  # (B, N, T, Hv)
    dv = _sum_groups(_active_matmul(np.swapaxes(p, -1, -2), do, use_t), g)
    dp = do @ np.swapaxes(lg.v, -1, -2)  # (B, N, T, S), read only where used
    delta = np.einsum("btnd,btnd->bnt", d_out, out)
    ds = p * (dp - delta[..., None])
    if lg.cap is not None:
      ds = ds * (1.0 - np.tanh(lg.u / lg.cap) ** 2)
    ds = np.where(use, ds, 0.0)
    dq = _heads_first(lg.scale * _active_matmul(ds, lg.k, use))
    dk = _sum_groups(
      lg.scale * _active_matmul(np.swapaxes(ds, -1, -2), lg.q, use_t), g)
  dbias = None if lg.bias_shape is None else reduce_to_shape(ds, lg.bias_shape)
  return Gradients(dq=dq, dk=dk, dv=dv, dbias=dbias)


def backward_from_residuals(*args: Any, **kwargs: Any) -> Gradients:
  """Float64 gradients of sum(out * d_out) recomputed from GIVEN residuals:
  ``backward_from_residuals(call..., out, m, l, d_out)``, the call as
  :func:`attention_reference` takes it.

  This is what a flash-attention backward kernel does: P = exp(s - m) / l from
  the stored m, l (natural log, (B, N, T)) and delta = rowsum(d_out * out) from
  the stored output. Rows with l == 0 are treated as fully masked. Wrong
  residuals (e.g. m left in base 2) give wrong gradients.
  """
  call, (out, m, l, d_out) = _split(args, kwargs, 4)
  lg = _logits(call)
  return _backward(lg, out, m, l, d_out)


def attention_reference_vjp(*args: Any, **kwargs: Any) -> Gradients:
  """Float64 gradients of sum(out * d_out) w.r.t. query, key, value and bias:
  ``attention_reference_vjp(call..., d_out)``.

  dk, dv are summed over the query heads that share a key/value head; dbias is
  summed down to bias's own shape. Equals :func:`backward_from_residuals`
  applied to the reference's own residuals.
  """
  call, (d_out,) = _split(args, kwargs, 1)
  ref = attention_reference(call)
  lg = _logits(call)
  return _backward(lg, ref.out, ref.m, ref.l, d_out)


# ---------------------------------------------------------------------------
# Naive same-dtype implementation (the tolerance rule's yardstick).


def _rounder(dtype):
  dtype = np.dtype(dtype)
  if dtype not in (float16, bfloat16, float32):
    raise ValueError(f"dtype: naive attention supports float16, bfloat16, "
                     f"float32, got {dtype}")

  def r(x):
    # Compute in float32 (what the hardware accumulates in), store in dtype.
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)

  return r


@dataclasses.dataclass(frozen=True)
class _NaiveForward:
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  u: np.ndarray
  tanh: np.ndarray | None
  visible: np.ndarray
  probs: np.ndarray
  out: np.ndarray  # (B, N, T, Hv)
  m: np.ndarray
  l: np.ndarray
  scale: np.float32
  bias_shape: tuple[int, ...] | None
  shapes: AttentionShapes


def _exact_products(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return np.asarray(a, np.float32) @ np.asarray(b, np.float32)


def _naive_forward(call: Call, dtype, running_max: bool = False,
                   fp8_products=_exact_products) -> _NaiveForward:
  shapes = call.shapes
  query, key, value, bias = call.query, call.key, call.value, call.bias
  scale, logits_soft_cap = call.scale, call.logits_soft_cap
  # FP8: what the textbook computation holds in 8 bits is what the kernel
  # does (the inputs, and P for the PV product, quantised at 2^8 times its
  # value against the row's max, or with ``running_max`` against the max of
  # the keys up to it); the rest is float32, as tensor cores accumulate,
  # and the output is rounded to the call's output dtype.
  fp8 = np.dtype(dtype) in FP8_DTYPES
  r = (lambda x: np.asarray(x, np.float32)) if fp8 else _rounder(dtype)
  g = shapes.group_size
  scale = 1.0 / math.sqrt(shapes.H) if scale is None else float(scale)
  scale32 = r(scale)
  q = r(_heads_first(np.asarray(query).astype(np.float32)))
  k = r(_expand_kv(np.asarray(key).astype(np.float32), g))
  v = r(_expand_kv(np.asarray(value).astype(np.float32), g))
  if fp8:
    d = head_descales(call)
    scale32 = r(scale * d["q_descale"] * d["k_descale"])[..., None, None]   # (B, N, 1, 1)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    qk = fp8_products(q, np.swapaxes(k, -1, -2)) if fp8 else q @ np.swapaxes(k, -1, -2)
    u = r(r(qk) * scale32)
    bias_shape = None
    if bias is not None:
      b = np.asarray(bias).astype(np.float32)
      bias_shape = b.shape
      u = r(u + r(b))
    t = None
    s = u
    if logits_soft_cap is not None:
      cap = r(logits_soft_cap)
      t = r(np.tanh(r(u / cap)))
      s = r(cap * t)
    visible = key_visibility(call)
    s = np.where(visible, s, -np.inf).astype(np.float32)
    m = s.max(axis=-1)
    empty = m == -np.inf
    m_safe = np.where(empty, np.float32(0), m)
    e = r(np.exp(r(s - m_safe[..., None])))
    l = r(e.sum(axis=-1, dtype=np.float32))
    probs = np.where(empty[..., None], np.float32(0),
                     r(e / np.where(empty, np.float32(1), l)[..., None]))
    if fp8:
      # P at 2^8 times its value, saturated to e4m3 (e <= 1: P <= 256), its
      # sum l unquantised; V's descale and P's scale after the product.
      p_scale = np.float32(2.0 ** FP8_P_SCALE_LOG2)
      if running_max:
        # each key's P against the max so far, brought to the row's max
        # after its rounding (the online softmax one key at a time): no
        # longer e4m3 values, so summed in float32
        m_run = np.maximum.accumulate(s, axis=-1)
        m_run = np.where(m_run == -np.inf, np.float32(0), m_run)
        weights = (quantise_e4m3(np.exp(s - m_run) * p_scale)
                   * np.exp(m_run - m_safe[..., None]).astype(np.float32))
        acc = weights @ v
      else:
        acc = fp8_products(quantise_e4m3(e * p_scale), v)
      unit = d["v_descale"][..., None] / (np.where(empty, np.float32(1), l) * p_scale)
      r_out = _rounder(call.result_dtype)
      out = np.where(empty[..., None], np.float32(0), r_out(acc * unit[..., None]))
    else:
      out = r(probs @ v)
  return _NaiveForward(q, k, v, u, t, visible, probs, out, m, l, scale32,
                       bias_shape, shapes)


def naive_attention(*call: Any, dtype: Any, fp8_products=None, **kwargs: Any
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The textbook computation of ``call`` (as :func:`attention_reference`
  takes it) in ``dtype``: (out (B,T,N,Hv), m, l (B,N,T)), float64.

  Inputs are rounded to ``dtype``; each op computes in float32 (matrix
  products accumulate in float32, as tensor cores do) and rounds its result to
  ``dtype``. m is the row max of the rounded logits (natural log), l the
  rounded sum of the rounded exponentials. Follows the fully masked row
  contract. For the tolerance rule only.

  ``dtype`` float8_e4m3fn (an FP8 call): what the computation holds in 8
  bits, the inputs and P for the PV product, as the kernel holds it (P =
  exp(s - m) at 2^8 times its value, rounded to e4m3 with saturation,
  :func:`quantise_e4m3`), everything else in float32, the output rounded to
  the call's output dtype.  Its output is the worse, against float64, of
  two realisations of P's rounding: against the row's max, and against the
  max of the keys up to each (the online softmax one key at a time).  The
  kernel's running max places P's scale block by block, between the two;
  one realisation alone can be luckily small where few values are rounded
  (one row, two key blocks).  ``fp8_products(a, b)`` computes its two
  products of e4m3 values, q k^T and P V, as float32 (default: summed
  exactly); the tolerance rule passes the hardware's sum
  (harness/numerics/tolerance.py's ``naive_forward``).
  """
  call, _ = _split(call, kwargs, 0)
  products = _exact_products if fp8_products is None else fp8_products
  f = _naive_forward(call, dtype, fp8_products=products)
  out = _heads_first(f.out).astype(np.float64)
  if np.dtype(dtype) in FP8_DTYPES:
    ref = attention_reference(call).out
    with np.errstate(invalid="ignore"):
      error = lambda x: np.nanmax(np.abs(np.where(np.isfinite(x), x, ref) - ref), initial=0.0)
    other = _heads_first(_naive_forward(call, dtype, running_max=True,
                                        fp8_products=products).out).astype(np.float64)
    out = other if error(other) > error(out) else out
  return out, f.m.astype(np.float64), f.l.astype(np.float64)


def naive_attention_vjp(*args: Any, dtype: Any, **kwargs: Any) -> Gradients:
  """Textbook backward in ``dtype`` (every op rounded), returned in float64:
  ``naive_attention_vjp(call..., d_out, dtype=...)``.

  The yardstick of the tolerance rule for dq, dk, dv, dbias.
  """
  call, (d_out,) = _split(args, kwargs, 1)
  f = _naive_forward(call, dtype)
  r = _rounder(dtype)
  sh = f.shapes
  g = sh.group_size
  do = _check_like("d_out", d_out, (sh.B, sh.T, sh.N, sh.Hv))
  with np.errstate(invalid="ignore", over="ignore"):
    do = r(_heads_first(do))
    p = f.probs
    dv = r(_sum_groups(r(np.swapaxes(p, -1, -2) @ do), g))
    dp = r(do @ np.swapaxes(f.v, -1, -2))
    delta = r(r(p * dp).sum(axis=-1, dtype=np.float32))
    ds = np.where(f.visible, r(p * r(dp - delta[..., None])), np.float32(0))
    if f.tanh is not None:
      ds = r(ds * r(1 - r(f.tanh * f.tanh)))
    dbias = None
    if f.bias_shape is not None:
      dbias = r(reduce_to_shape(ds, f.bias_shape)).astype(np.float64)
    ds_scaled = r(ds * f.scale)
    dq = r(ds_scaled @ f.k)
    dk = r(_sum_groups(r(np.swapaxes(ds_scaled, -1, -2) @ f.q), g))
  return Gradients(dq=_heads_first(dq).astype(np.float64),
                   dk=dk.astype(np.float64), dv=dv.astype(np.float64),
                   dbias=dbias)


def naive_gradient_yardstick(*args: Any, dtype: Any, **kwargs: Any) -> dict[str, np.ndarray]:
  """The tolerance rule's "naive" gradients for a backward fed with stored
  residuals, per gradient name (``naive_gradient_yardstick(call..., d_out,
  dtype=...)``): the worse (against float64) of

  (a) the float64 backward fed with the naive same-dtype forward's residuals
      (out rounded to ``dtype``, m, l) -- the error that storing the residuals
      in low precision brings by itself -- and
  (b) the naive same-dtype backward (:func:`naive_attention_vjp`), the
      yardstick the FlashAttention rule uses for gradients.

  Either alone was seen to be a few float32 ulps too tight in rare cases.
  """
  call, (d_out,) = _split(args, kwargs, 1)
  want = attention_reference_vjp(call, d_out)
  out, m, l = naive_attention(call, dtype=dtype)
  fed = backward_from_residuals(call, out, m, l, d_out)
  naive = naive_attention_vjp(call, d_out, dtype=dtype)
  picked = {}
  for name in ("dq", "dk", "dv", "dbias"):
    ref = getattr(want, name)
    if ref is None:
      continue
    candidates = (getattr(fed, name), getattr(naive, name))
    with np.errstate(invalid="ignore"):
      errors = [np.nanmax(np.abs(np.where(np.isfinite(x), x, ref) - ref), initial=0.0)
                for x in candidates]
    picked[name] = candidates[int(np.argmax(errors))]
  return picked


def dbias_is_noise(bias_shape) -> bool:
  """A bias constant along the keys shifts a softmax row: its gradient is
  identically 0, every implementation returns cancellation noise, and the
  max-error rule would compare noise with noise.  Such dbias is not checked."""
  return bias_shape is not None and tuple(bias_shape)[-1:] in ((), (1,))
