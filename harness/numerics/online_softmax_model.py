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
  dtype = _model_dtype(call, block_kv, dtype)
  fp8 = dtype in FP8_DTYPES
  # FP8: inputs are exact in float32, P is rounded to e4m3, the output to
  # the call's output dtype.
  stored = np.dtype(call.result_dtype) if fp8 else dtype

  def rnd(x):
    return np.asarray(x, dtype=np.float32).astype(stored).astype(np.float32)

  rnd_in = (lambda x: np.asarray(x, np.float32)) if fp8 else rnd
  rnd_p = quantise_e4m3 if fp8 else rnd

  q, k, v, bias32 = _operands(call, rnd_in)
  visible = key_visibility(call)
  descales = head_descales(call)
  scaling = _logit_scaling(call, descales, fp8)

  stats = {"max_p": 0.0, "rescaled": 0, "deferred": 0, "blocks": 0}
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    acc, m_i, l_i, m_scale = _key_blocks(call, q, k, v, bias32, visible, scaling,
                                         block_kv=block_kv, fp8=fp8, rnd_p=rnd_p,
                                         fp8_sum_bits=fp8_sum_bits, stats=stats)
    out, m_out, l_out = _epilogue(acc, m_i, l_i, m_scale, call.normalize_output,
                                  descales["v_descale"] if fp8 else None,
                                  residual_m_base2=_residual_m_base2,
                                  residual_l_pending=_residual_l_pending)

  if _stats is not None:
    _stats.update(stats)
  out = rnd(np.swapaxes(out, 1, 2))
  return (out.astype(np.float64), m_out.astype(np.float64),
          l_out.astype(np.float64))


def _key_blocks(call: Call, q, k, v, bias32, visible, scaling: tuple, *, block_kv: int,
                fp8: bool, rnd_p, fp8_sum_bits: int | None, stats: dict) -> tuple:
  """(acc, m_i, l_i, m_scale) after the online softmax over every key block
  of ``block_kv`` keys, as the compute warpgroups run it; ``stats`` counts
  the blocks (:func:`_count`)."""
  B, N, T, S = call.shapes.logits_shape
  always_rescale = float(call.rescale_threshold) == 1.0
  threshold = np.float32(call.rescale_threshold)

  m_i = np.full((B, N, T), -np.inf, dtype=np.float32)
  m_scale = np.full((B, N, T), -np.inf, dtype=np.float32)
  l_i = np.zeros((B, N, T), dtype=np.float32)
  acc = np.zeros((B, N, T, call.shapes.Hv), dtype=np.float32)

  for j0 in range(0, S, block_kv):
    j1 = min(j0 + block_kv, S)
    if fp8_sum_bits is None:
      qk = q @ np.swapaxes(k[:, :, j0:j1], -1, -2)  # float32 accumulation
    else:
      qk = tensor_core_products(q, np.swapaxes(k[:, :, j0:j1], -1, -2), fp8_sum_bits)
    s2 = _base2_logits(qk, None if bias32 is None else bias32[..., j0:j1],
                       visible[..., j0:j1], scaling)

    m_ij = np.maximum(m_i, s2.max(axis=-1))
    acc, l_i, m_scale, alpha, rescale = _rescaled(acc, l_i, m_scale, m_ij,
                                                  always_rescale, threshold)
    m_i = m_ij

    p = np.exp2(s2 - (_safe(m_scale) - np.float32(FP8_P_SCALE_LOG2 if fp8 else 0))[..., None])
    l_i = l_i + p.sum(axis=-1, dtype=np.float32)
    if fp8_sum_bits is None:
      acc = acc + rnd_p(p) @ v[:, :, j0:j1]
    else:  # the kernel's PV wgmma accumulates onto acc itself
      acc = tensor_core_products(rnd_p(p), v[:, :, j0:j1], fp8_sum_bits, init=acc)
    _count(stats, p, m_ij, rescale, alpha)
  return acc, m_i, l_i, m_scale


def _model_dtype(call: Call, block_kv: Any, dtype: Any) -> np.dtype:
  """``dtype`` as a NumPy dtype, with ``block_kv`` and ``dtype`` refused by
  name where the model cannot run them for ``call``."""
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
  return dtype


def _operands(call: Call, rnd_in) -> tuple:
  """(q, k, v, bias) in float32, (B, N, rows, D): q, k and v rounded by
  ``rnd_in``, k and v repeated over each group's query heads, the bias
  broadcast to (B, N, T, S) (or None)."""
  B, N, T, S = call.shapes.logits_shape
  g = call.shapes.group_size
  q = rnd_in(np.swapaxes(np.asarray(call.query).astype(np.float32), 1, 2))
  k = rnd_in(np.repeat(np.swapaxes(np.asarray(call.key).astype(np.float32), 1, 2), g, axis=1))
  v = rnd_in(np.repeat(np.swapaxes(np.asarray(call.value).astype(np.float32), 1, 2), g, axis=1))
  bias32 = None
  if call.bias is not None:
    bias32 = np.broadcast_to(np.asarray(call.bias).astype(np.float32), (B, N, T, S))
  return q, k, v, bias32


def _logit_scaling(call: Call, descales: dict, fp8: bool) -> tuple:
  """The factors that take q.k to base-2 logits: ("scaled", scale * log2(e)),
  or with a soft cap ("capped", scale, 1 / cap, cap * log2(e)), in float32;
  under FP8 the scale times each (batch, head)'s q and k descales."""
  scale = 1.0 / math.sqrt(call.shapes.H) if call.scale is None else float(call.scale)
  if fp8:  # per (batch, head): float32 (B, N, 1, 1)
    scale = (np.float32(scale) * (descales["q_descale"] * descales["k_descale"]).astype(
        np.float32))[..., None, None]
  cap = call.logits_soft_cap
  if cap is None:
    return ("scaled", np.asarray(scale * LOG2E, np.float32))
  return ("capped", np.asarray(scale, np.float32), np.float32(1.0 / float(cap)),
          np.float32(float(cap) * LOG2E))


def _base2_logits(qk: np.ndarray, bias: np.ndarray | None, visible: np.ndarray,
                  scaling: tuple) -> np.ndarray:
  """One key block's logits in base 2 (:func:`_logit_scaling`), the bias
  added in float32, -inf where ``visible`` is False."""
  if scaling[0] == "scaled":
    s2 = qk * scaling[1]
    if bias is not None:
      s2 = s2 + bias * np.float32(LOG2E)
  else:
    _, scale32, inv_cap, cap2 = scaling
    u = qk * scale32
    if bias is not None:
      u = u + bias
    s2 = np.tanh(u * inv_cap) * cap2
  return np.where(visible, s2, np.float32(-np.inf))


def _rescaled(acc, l_i, m_scale, m_ij, always_rescale: bool, threshold) -> tuple:
  """(acc, l_i, m_scale, alpha, rescale) after a block whose running max is
  ``m_ij``: the rows due a rescale (every row, or alpha below the
  threshold, or a first finite max) brought to ``m_ij``."""
  alpha = np.exp2(m_scale - _safe(m_ij))
  if always_rescale:
    rescale = np.ones_like(m_ij, dtype=bool)
  else:
    rescale = (alpha < threshold) | (m_scale == -np.inf)
  acc = np.where(rescale[..., None], acc * alpha[..., None], acc)
  l_i = np.where(rescale, l_i * alpha, l_i)
  m_scale = np.where(rescale, m_ij, m_scale)
  return acc, l_i, m_scale, alpha, rescale


def _count(stats: dict, p, m_ij, rescale, alpha) -> None:
  """Adds one block to the run's counters (``_stats``)."""
  live = np.isfinite(m_ij)
  stats["blocks"] += 1
  stats["max_p"] = max(stats["max_p"], float(np.nanmax(p, initial=0.0)))
  stats["rescaled"] += int((rescale & live & (alpha < 1)).sum())
  stats["deferred"] += int((~rescale & live & (alpha < 1)).sum())


def _epilogue(acc, m_i, l_i, m_scale, normalize_output: bool, v_descale, *,
              residual_m_base2: bool, residual_l_pending: bool) -> tuple:
  """(out, m, l) as the kernel stores them, out still (B, N, T, Hv) and
  unrounded: normalised or brought to the true max, 0 in fully masked rows,
  descaled under FP8 (``v_descale`` not None)."""
  alpha = np.exp2(m_scale - _safe(m_i))
  l_out = l_i if residual_l_pending else l_i * alpha
  empty = m_i == -np.inf
  if normalize_output:
    out = np.where(empty[..., None], np.float32(0),
                   acc / np.where(empty, np.float32(1), l_i)[..., None])
  else:
    out = np.where(empty[..., None], np.float32(0), acc * alpha[..., None])
  l_out = np.where(empty, np.float32(0), l_out)
  if v_descale is not None:
    p_scale = np.float32(2.0 ** FP8_P_SCALE_LOG2)
    v_descale = v_descale.astype(np.float32)[..., None, None]
    out = out * (v_descale if normalize_output else v_descale / p_scale)
    l_out = l_out / p_scale
  m_out = m_i if residual_m_base2 else m_i * np.float32(1.0 / LOG2E)
  return out, m_out, l_out
