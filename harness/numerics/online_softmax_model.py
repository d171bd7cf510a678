"""Executable NumPy model of the kernel's blocked online softmax (seed 000).

The model does, row by row and key block by key block, the arithmetic the
compute warpgroups do, in the same precisions, so that the algorithm's own
choices can be tested on a CPU before (and independently of) the kernel:

* logits in float32 from q and k rounded to ``dtype`` (float32 accumulation);
  bias added in float32; the soft cap via tanh;
* log2(e) folded into a multiplier once -- ``scale2 = scale * log2(e)``, or the
  cap multiplier ``cap * log2(e)`` when soft-capped -- and ``exp2`` everywhere,
  so the running max ``m_i`` is in base 2;
* masked logits (mask, causal, key range, the padding of the last block) are
  ``-inf``;
* ``m_scale``: the pending scale that ``acc`` and ``l_i`` are relative to.
  With ``rescale_threshold == 1.0`` exactly, the textbook branch rescales every
  block (``m_scale = m_i``). Otherwise ``alpha = exp2(m_scale - m_ij)`` and only
  the rows with ``alpha < rescale_threshold`` (or a first finite max,
  ``m_scale == -inf``) are rescaled; the others keep ``m_scale`` and let
  ``p = exp2(s2 - m_scale)`` absorb the difference. Hence ``p <= 1 /
  rescale_threshold`` on every block (p is cast to ``dtype`` for the second
  matrix product, so in float16 a threshold below 1/65504 can overflow p);
* a "safe base" (0 where the scale is ``-inf``) so that rows with no visible
  key so far never compute ``-inf - (-inf)``;
* ``l_i += rowsum(p)`` in float32; ``acc += p.astype(dtype) @ v`` with float32
  accumulation;
* epilogue: ``alpha = exp2(m_scale - safe(m_i))``; the stored residual is
  ``l = l_i * alpha`` (relative to the true max); the output is ``acc / l_i``
  when ``normalize_output`` (pending factors cancel) and ``acc * alpha``
  otherwise; the stored ``m`` is ``m_i / log2(e)``, natural log -- unless the
  private flag ``_residual_m_base2`` leaves it in base 2, the bug that a
  forward-only test cannot see (seed 000); ``_residual_l_pending`` is the
  sibling bug of forgetting alpha on l;
* fully masked rows (see ``harness/numerics/reference.py``): out 0, l 0, m -inf;
* FP8 (``dtype`` float8_e4m3fn, an FP8 call): q.k of the stored values (exact
  in float32) times ``scale * q_descale * k_descale``; ``p = exp2(s2 - base +
  8)`` (2^8 times its value, kernel.tiling.plan.FP8_P_SCALE_LOG2), rounded to
  e4m3 with saturation for ``acc += p8 @ v`` (the stored values), ``l_i`` the
  sum of the unrounded p; the epilogue multiplies the output by
  ``v_descale`` (and, unnormalised, divides it by 2^8) and stores ``l``
  divided by 2^8; the output is rounded to the call's output dtype.

The output is rounded to ``dtype``; m and l are float32 (as the kernel stores
them). Everything is returned as float64 arrays: out (B, T, N, Hv), m and l
(B, N, T).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from harness.numerics.reference import (head_descales, key_visibility, quantise_e4m3,
                                        tensor_core_products)
from kernel.call import FP8_DTYPES, Call, bfloat16, float16, float32
from kernel.tiling.plan import FP8_P_SCALE_LOG2

__all__ = ["LOG2E", "online_softmax_attention"]

LOG2E = math.log2(math.e)


def _safe(x: np.ndarray) -> np.ndarray:
  """0 where x is -inf: the base that keeps empty rows free of NaN."""
  return np.where(x == -np.inf, np.float32(0), x)


def online_softmax_attention(
  *call: Any,
  block_kv: int = 128,
  dtype: Any = bfloat16,
  _residual_m_base2: bool = False,
  _residual_l_pending: bool = False,
  fp8_sum_bits: int | None = None,
  _stats: dict | None = None,
  **kwargs: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Blocked online-softmax attention of ``call`` (a kernel.call.Call, or its
  arguments, as harness.numerics.reference.attention_reference takes it);
  returns (out, m, l) as float64 arrays.  Reads the call's
  ``rescale_threshold`` and ``normalize_output`` as the kernel does;
  ``block_kv`` and ``dtype`` are the kernel's key block and compute dtype.

  The private flags are deliberate bugs, kept so that tests can show they
  catch them: ``_residual_m_base2`` stores m in base 2 (seed 000's bug);
  ``_residual_l_pending`` stores l_i without the epilogue's alpha, i.e.
  relative to the pending m_scale instead of the true max.
  ``fp8_sum_bits`` (FP8) sums both products, q.k and P V, as Hopper's FP8
  tensor cores do: the running sum cut toward zero to that many fraction
  bits after each 32 elements of the contraction
  (reference.tensor_core_products; the H200's count is
  harness.numerics.tolerance.FP8_SUM_BITS), instead of exactly.

  ``_stats``, when a dict, receives counters of the run: ``max_p`` (largest p
  before its cast to dtype), ``rescaled`` (row-blocks whose accumulator was
  multiplied by alpha < 1), ``deferred`` (row-blocks where the max moved but
  the rescale was skipped), ``blocks``.
  """
  call = Call.of(*call, **kwargs)
  shapes = call.shapes
  query, key, value, bias = call.query, call.key, call.value, call.bias
  scale, logits_soft_cap = call.scale, call.logits_soft_cap
  rescale_threshold, normalize_output = call.rescale_threshold, call.normalize_output
  if isinstance(block_kv, bool) or not isinstance(block_kv, (int, np.integer)) \
      or block_kv <= 0:
    raise ValueError(f"block_kv: must be a positive int, got {block_kv!r}")
  dtype = np.dtype(dtype)
  if dtype not in (float16, bfloat16, float32, *FP8_DTYPES):
    raise ValueError(f"dtype: must be float16, bfloat16, float32 or float8_e4m3fn, got {dtype}")
  fp8 = dtype in FP8_DTYPES
  if fp8 != call.fp8:
    raise ValueError(f"dtype: {dtype} for a {np.dtype(call.query.dtype)} call; an FP8 call is "
                     "modelled in float8_e4m3fn, others in a 16- or 32-bit dtype")
  # FP8: inputs are exact in float32, P is rounded to e4m3, the output to
  # the call's output dtype.
  stored = np.dtype(call.result_dtype) if fp8 else dtype

  def rnd(x):
    return np.asarray(x, dtype=np.float32).astype(stored).astype(np.float32)

  rnd_in = (lambda x: np.asarray(x, np.float32)) if fp8 else rnd
  rnd_p = quantise_e4m3 if fp8 else rnd

  B, N, T, S = shapes.logits_shape
  g = shapes.group_size
  q = rnd_in(np.swapaxes(np.asarray(query).astype(np.float32), 1, 2))
  k = rnd_in(np.repeat(np.swapaxes(np.asarray(key).astype(np.float32), 1, 2), g, axis=1))
  v = rnd_in(np.repeat(np.swapaxes(np.asarray(value).astype(np.float32), 1, 2), g, axis=1))
  bias32 = None
  if bias is not None:
    bias32 = np.broadcast_to(np.asarray(bias).astype(np.float32), (B, N, T, S))
  visible = key_visibility(call)

  scale = 1.0 / math.sqrt(shapes.H) if scale is None else float(scale)
  descales = head_descales(call)
  if fp8:  # per (batch, head): float32 (B, N, 1, 1)
    scale = (np.float32(scale) * (descales["q_descale"] * descales["k_descale"]).astype(
        np.float32))[..., None, None]
  log2e = np.float32(LOG2E)
  if logits_soft_cap is None:
    scale2 = np.asarray(scale * LOG2E, np.float32)
  else:
    scale32 = np.asarray(scale, np.float32)
    inv_cap = np.float32(1.0 / float(logits_soft_cap))
    cap2 = np.float32(float(logits_soft_cap) * LOG2E)

  always_rescale = float(rescale_threshold) == 1.0
  threshold = np.float32(rescale_threshold)

  m_i = np.full((B, N, T), -np.inf, dtype=np.float32)
  m_scale = np.full((B, N, T), -np.inf, dtype=np.float32)
  l_i = np.zeros((B, N, T), dtype=np.float32)
  acc = np.zeros((B, N, T, shapes.Hv), dtype=np.float32)
  stats = {"max_p": 0.0, "rescaled": 0, "deferred": 0, "blocks": 0}

  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    for j0 in range(0, S, block_kv):
      j1 = min(j0 + block_kv, S)
      if fp8_sum_bits is None:
        qk = q @ np.swapaxes(k[:, :, j0:j1], -1, -2)  # float32 accumulation
      else:
        qk = tensor_core_products(q, np.swapaxes(k[:, :, j0:j1], -1, -2), fp8_sum_bits)
      if logits_soft_cap is None:
        s2 = qk * scale2
        if bias32 is not None:
          s2 = s2 + bias32[..., j0:j1] * log2e
      else:
        u = qk * scale32
        if bias32 is not None:
          u = u + bias32[..., j0:j1]
        s2 = np.tanh(u * inv_cap) * cap2
      s2 = np.where(visible[..., j0:j1], s2, np.float32(-np.inf))

      m_ij = np.maximum(m_i, s2.max(axis=-1))
      alpha = np.exp2(m_scale - _safe(m_ij))
      if always_rescale:
        rescale = np.ones_like(m_ij, dtype=bool)
      else:
        rescale = (alpha < threshold) | (m_scale == -np.inf)
      acc = np.where(rescale[..., None], acc * alpha[..., None], acc)
      l_i = np.where(rescale, l_i * alpha, l_i)
      m_scale = np.where(rescale, m_ij, m_scale)
      m_i = m_ij

      p = np.exp2(s2 - (_safe(m_scale) - np.float32(FP8_P_SCALE_LOG2 if fp8 else 0))[..., None])
      l_i = l_i + p.sum(axis=-1, dtype=np.float32)
      if fp8_sum_bits is None:
        acc = acc + rnd_p(p) @ v[:, :, j0:j1]
      else:  # the kernel's PV wgmma accumulates onto acc itself
        acc = tensor_core_products(rnd_p(p), v[:, :, j0:j1], fp8_sum_bits, init=acc)

      live = np.isfinite(m_ij)
      stats["blocks"] += 1
      stats["max_p"] = max(stats["max_p"], float(np.nanmax(p, initial=0.0)))
      stats["rescaled"] += int((rescale & live & (alpha < 1)).sum())
      stats["deferred"] += int((~rescale & live & (alpha < 1)).sum())

    alpha = np.exp2(m_scale - _safe(m_i))
    l_out = l_i if _residual_l_pending else l_i * alpha
    empty = m_i == -np.inf
    if normalize_output:
      out = np.where(empty[..., None], np.float32(0),
                     acc / np.where(empty, np.float32(1), l_i)[..., None])
    else:
      out = np.where(empty[..., None], np.float32(0), acc * alpha[..., None])
    l_out = np.where(empty, np.float32(0), l_out)
    if fp8:
      p_scale = np.float32(2.0 ** FP8_P_SCALE_LOG2)
      v_descale = descales["v_descale"].astype(np.float32)[..., None, None]
      out = out * (v_descale if normalize_output else v_descale / p_scale)
      l_out = l_out / p_scale
    m_out = m_i if _residual_m_base2 else m_i * np.float32(1.0 / LOG2E)

  if _stats is not None:
    _stats.update(stats)
  out = rnd(np.swapaxes(out, 1, 2))
  return (out.astype(np.float64), m_out.astype(np.float64),
          l_out.astype(np.float64))
