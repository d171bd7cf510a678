"""Public entry point: an extension of ``jax.nn.dot_product_attention``.

Layout (B, T, N, H) like ``jax.nn.dot_product_attention``; switching is one
line.  A call becomes one record (kernel.call.Call), validated once; its
lengths, window and segments become key ranges (kernel/key_ranges.py); its
static facts become one Problem (kernel.tiling.plan.Problem), tiled by the
config ``config=None`` picks or the caller gives; the forward runs under a
``jax.custom_vjp`` whose backward reads the forward's own residuals, both
passes padded and cut back by kernel/padding.py.

Contract for a fully masked query row (no key survives mask, causal, key
range): output 0, m = -inf, l = 0, and no NaN.  NaN in an input propagates to
the output rows whose logits or values touch it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import jax
import numpy as np

from kernel import key_ranges, padding, sharding
from kernel.backward.launch import attention_backward
from kernel.backward.xla import xla_backward
from kernel.call import DEFAULT_ALLOWED_DTYPES, Call
from kernel.common import is_2d
from kernel.forward.launch import flash_attention_forward
from kernel.forward import fp8 as fp8_lib
from kernel.sync.seams import seam
from kernel.tiling import backward_plan, plan as plan_lib
from kernel.tiling.config import Config
from kernel.tiling.heuristics import get_backward_config
from kernel.variant import SHIPPED, Variant

_state = threading.local()


@contextlib.contextmanager
def lowering_only():
  """Skip the sm90 device check: for ``jax.export`` lowering on a CPU host."""
  prev = getattr(_state, "lowering_only", False)
  _state.lowering_only = True
  try:
    yield
  finally:
    _state.lowering_only = prev


class UnsupportedDeviceError(RuntimeError):
  pass


def sm90_device():
  """The first sm90 GPU, or None."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return None
  for d in gpus:
    if getattr(d, "compute_capability", None) == "9.0":
      return d
  return None


def _check_device():
  if getattr(_state, "lowering_only", False):
    return
  if sm90_device() is None:
    kinds = sorted({f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()})
    raise UnsupportedDeviceError(
        "dot_product_attention runs on an sm90 GPU (H100/H200) only; this "
        f"process sees {kinds}. Use harness.numerics.reference.attention_reference on "
        "other machines, or kernel.api.lowering_only() to lower for CUDA.")


# A deferred rescale leaves p as large as 1 / rescale_threshold before it is
# cast to the input dtype; float16 overflows past 65504, so for float16 the
# threshold is raised to 2**-14 (p <= 16384).  bf16's range needs no guard.
F16_MIN_THRESHOLD = 2.0 ** -14


@seam("api.effective_threshold")
def _effective_threshold(threshold: float, dtype) -> float:
  # FP8's P, scaled to 2^8 and deferred up to 1 / threshold, must stay
  # within e4m3's 448 (kernel.forward.fp8.MIN_THRESHOLD).
  if np.dtype(dtype).itemsize == 1 and threshold < fp8_lib.MIN_THRESHOLD:
    return fp8_lib.MIN_THRESHOLD
  if np.dtype(dtype) == np.float16 and threshold < F16_MIN_THRESHOLD:
    return F16_MIN_THRESHOLD
  return threshold


def _num_sms() -> int:
  """Streaming multiprocessors of the sm90 GPU (132 on H100 SXM and H200;
  also the value used when lowering without a GPU)."""
  dev = sm90_device()
  return int(getattr(dev, "core_count", 0) or 132)


@seam("api.problem_of")
def problem_of(call: Call, routed: key_ranges.Routed | None = None, *, staged: bool = True,
               deterministic: bool = False, variant: Variant = SHIPPED) -> plan_lib.Problem:
  """The call's static facts, as both passes and the tiling read them: a
  2-D bias or mask staged through the ring where ``staged``; the window,
  its ranges and the poisoned rows as ``routed`` made them (None: the
  call's own, unrouted)."""
  shapes = call.shapes
  dtype = plan_lib.compute_dtype(call.query.dtype)
  return plan_lib.problem_of_shapes(
      (shapes.B, shapes.T, shapes.N, shapes.H), (shapes.B, shapes.S, shapes.K, shapes.H),
      (shapes.B, shapes.S, shapes.K, shapes.Hv), dtype, is_causal=call.is_causal,
      return_residuals=bool(
          routed.kernel_residuals if routed is not None else call.return_residuals),
      bias_2d=staged and is_2d(call.bias),
      mask_2d=staged and is_2d(routed.mask if routed is not None else call.mask),
      untiled_copies=variant.untiled_copies,
      even_sections=variant.even_sections,
      defer_light=variant.defer_light,
      scale=float(shapes.H ** -0.5 if call.scale is None else call.scale),
      logits_soft_cap=None if call.logits_soft_cap is None else float(call.logits_soft_cap),
      rescale_threshold=_effective_threshold(float(call.rescale_threshold), dtype),
      normalize_output=bool(call.normalize_output),
      window=routed.window if routed is not None else call.window,
      chunk=routed.chunk if routed is not None else call.attention_chunk,
      static_ranges=bool(routed is not None and routed.static_ranges),
      poisons_rows=bool(routed is not None and routed.poisoned is not None),
      deterministic=bool(deterministic),
      out_dtype=np.dtype(call.result_dtype) if call.fp8 else None, descales=call.descales)


def resolve(call: Call, routed: key_ranges.Routed | None = None, *, config: Config | None = None,
            variant: Variant = SHIPPED,
            deterministic: bool = False) -> tuple[plan_lib.Problem, Config]:
  """The (problem, config) ``dot_product_attention`` runs for ``call``,
  resolved once: a 2-D bias or mask is staged through the ring with the
  keys where the config (given, or the one ``config=None`` picks for the
  staged problem) fits with it, else read from global memory, with the
  config picked for that problem (head dims of 256 with both a 2-D bias and
  mask, say; the results are the same bits either way,
  properties/gpu/test_forward_gpu.py).  Raises if the config does not fit."""
  def staged_problem(staged):
    return problem_of(call, routed, staged=staged, deterministic=deterministic, variant=variant)

  def config_for(problem):
    if config is not None:
      return config
    return _chosen_config(call, problem, routed, device_kind=None)

  if variant.stage_2d and (is_2d(call.bias) or is_2d(routed.mask if routed else call.mask)):
    problem = staged_problem(True)
    try:
      chosen = config_for(problem)   # the heuristic refuses a problem nothing fits
      if plan_lib.config_fits(problem, chosen):
        return problem, chosen
    except ValueError:
      pass
  problem = staged_problem(False)
  chosen = config_for(problem)
  plan_lib.check_fits(problem, chosen)
  return problem, chosen


def resolve_backward(call: Call, problem: plan_lib.Problem,
                     variant: Variant = SHIPPED) -> backward_plan.Backward:
  """How ``call``'s gradient runs, resolved once beside its forward: the
  variant's implementation, and for the sm90 kernels the head dims they
  compute with and their tiling with the variant's switches
  (kernel.tiling.heuristics.get_backward_config)."""
  dims = backward_plan.computed_head_dims(call.shapes.H, call.shapes.Hv,
                                          narrow_rows=variant.narrow_rows)
  blocks = get_backward_config(*dims, causal=problem.mask.causal,
                               schedule=variant.backward_schedule,
                               fuse_dq_causal=variant.fuse_dq_causal, fuse_dq=variant.fuse_dq,
                               whole_tiles=variant.backward_whole_tiles,
                               untiled_copies=variant.backward_untiled_copies)
  return backward_plan.Backward(variant.backward, dims, blocks)


def resolved_problem(query, key, value, bias=None, mask=None, *, config: Config | None = None,
                     stage_2d: bool = True, **call) -> plan_lib.Problem:
  """The problem :func:`resolve` runs for these arguments (arrays or
  ShapeDtypeStructs; ``call``: the rest of kernel.call.Call's arguments)."""
  c = Call(query, key, value, bias, mask, **call)
  variant = dataclasses.replace(SHIPPED, stage_2d=stage_2d)
  return resolve(c, key_ranges.route(c), config=config, variant=variant)[0]


def chosen_config(query, key, value, bias=None, mask=None, *, is_causal=False,
                  k_start=None, k_end=None, device_kind: str | None = None) -> Config:
  """The config ``dot_product_attention(..., config=None)`` runs for these
  arguments (arrays or ShapeDtypeStructs): the autotuner's cached best for
  this device and signature, else the nearest tuned signature's
  (kernel.tiling.autotune.nearest), else the heuristic.  ``device_kind``
  defaults to the sm90 GPU of this process (none: the heuristic)."""
  return chosen_config_source(query, key, value, bias, mask, is_causal=is_causal,
                              k_start=k_start, k_end=k_end, device_kind=device_kind)[0]


def chosen_config_source(query, key, value, bias=None, mask=None, *, is_causal=False,
                         k_start=None, k_end=None, device_kind: str | None = None,
                         variant: Variant = SHIPPED) -> tuple[Config, str]:
  """:func:`chosen_config` and where it came from (kernel.tiling.autotune.choice:
  "autotune cache", "autotune cache, nearest: SIGNATURE" or "heuristic").
  FP8 arrays are taken with unit descales: no tiling reads their values."""
  unit = ({n: 1.0 for n in ("q_descale", "k_descale", "v_descale")}
          if np.dtype(query.dtype).itemsize == 1 else {})
  call = Call(query, key, value, bias, mask, is_causal=is_causal, k_start=k_start, k_end=k_end,
              dtypes=(np.dtype(query.dtype),), **unit)
  problem = problem_of(call, staged=variant.stage_2d, variant=variant)
  return _chosen_config(call, problem, None, device_kind=device_kind, with_source=True)


def _chosen_config(call: Call, problem: plan_lib.Problem, routed, *, device_kind,
                   with_source=False):
  from kernel.tiling import autotune
  if device_kind is None and not getattr(_state, "lowering_only", False):
    device = sm90_device()
    device_kind = None if device is None else device.device_kind
  k_start = routed.k_start if routed is not None else call.k_start
  k_end = routed.k_end if routed is not None else call.k_end
  mask = routed.mask if routed is not None else call.mask
  config, source = autotune.choice(
      autotune.selection_problem(problem), device_kind, has_bias=call.bias is not None,
      has_mask=mask is not None, has_key_ranges=k_start is not None or k_end is not None)
  if config.schedule == "split-tail":
    # Off config=None's path until its gradients pass on the GPU: the same tiling,
    # round-robin (docs/decisions/split-tail-off-the-default.md).
    config = dataclasses.replace(config, schedule="round-robin")
    source += ", its split tail run round-robin"
  return (config, source) if with_source else config


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          attention_chunk=None, implementation=None, return_residual=False,
                          q_segment_ids=None, kv_segment_ids=None,
                          segment_layout="contiguous", k_start=None, k_end=None,
                          logits_soft_cap=None, rescale_threshold=1.0,
                          normalize_output=True, return_residuals=False,
                          config=None, deterministic=False, q_descale=None, k_descale=None,
                          v_descale=None, out_dtype=None):
  """Flash attention on sm90.  Returns ``out``, ``(out, (m, l))`` with
  ``return_residuals``, ``(out, lse)`` with ``return_residual``, or
  ``(out, lse, (m, l))`` with both.

  m (B, N, T) is the row max of the final logits in natural-log space, l the
  row sum of exp(logits - m); out is normalised by l unless
  ``normalize_output`` is False (then it is the sum of exp(logits - m) * v).

  Every argument of ``jax.nn.dot_product_attention`` (jax 0.11.2) is taken
  with its meaning and default: ``query_seq_lengths``,
  ``key_value_seq_lengths``, ``local_window_size`` and ``return_residual``
  (the natural-log log-sum-exp, (B, T, N), float32); ``implementation`` must
  be None (this kernel; 'xla' and 'cudnn' are refused with a ValueError).
  ``q_segment_ids`` (B, T) and ``kv_segment_ids`` (B, S) restrict each query
  to the keys of its own segment (packed sequences); ``segment_layout``
  "contiguous" (each id one run of kv_segment_ids; rows that break it come
  out NaN) or "any" (a dense mask).  ``attention_chunk`` C
  (FlashAttention-3's chunked attention): row i sees only keys j with
  j // C == i // C; with ``is_causal``, causal inside each chunk.  All of
  them become per-row key ranges (kernel/key_ranges.py).  Rank-3 (T, N, H) inputs, which jax.nn also takes,
  are refused: add the batch axis.

  ``config``: a kernel.Config, or None for the tuned or heuristic one
  (:func:`chosen_config` says which).

  ``deterministic``: True makes the gradients bitwise reproducible from run
  to run on every path.  Where the backward sums dq across thread blocks
  (the fused dQ: head dims up to 128 without causal, up to 64 with it; no
  bias) it then adds in int32 fixed point, each row scaled by a power of
  two from an a-priori bound of its sum (kernel/backward/fused_dq.py),
  within the same float64 tolerance as the default, somewhat slower than it
  on that path (docs/decisions/fixed-point-dq.md), as fast elsewhere.  False
  (the default) adds in float32, and dq may differ by one ulp between runs
  (``harness.numerics.tolerance.run_to_run_bound``).
  With True, on the fused path, a NaN or infinity in any key or value of a
  head (or a cotangent whose norm overflows float32) makes that head's
  (that row's) dq NaN, not only where the logits touch it.  The
  forward is bitwise reproducible either way.

  FP8: ``float8_e4m3fn`` query, key and value (all three; mixed with another
  dtype is a ValueError) stand for their values times ``q_descale``,
  ``k_descale`` and ``v_descale`` (float32 of shape () per tensor or (B, K)
  per batch and kv head, finite and > 0; each required).  P is quantised to
  e4m3 for the PV product at 2^8 times its value (as FlashAttention-3
  does); the output is ``out_dtype`` (bfloat16 by default, or float16);
  m and l as for every dtype.  Every other argument works as it does for
  bfloat16, but a ``rescale_threshold`` below 0.625 is raised to it (P must
  stay within e4m3's range) and gradients are refused (NotImplementedError
  naming ``query``).  The logits (with the descales) must stay below 2^24
  in magnitude: past it float32 cannot hold P's 2^8 offset beside the row's
  max, and the results are unspecified.
  """
  return attend(Call(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
              k_start=k_start, k_end=k_end, query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths,
              local_window_size=local_window_size, attention_chunk=attention_chunk,
              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
              segment_layout=segment_layout, logits_soft_cap=logits_soft_cap, rescale_threshold=rescale_threshold,
              normalize_output=normalize_output, return_residuals=return_residuals,
              return_residual=return_residual, implementation=implementation,
              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
              out_dtype=out_dtype, dtypes=DEFAULT_ALLOWED_DTYPES),
                config=config, deterministic=deterministic)


def attend(call: Call, *, config: Config | None = None, deterministic: bool = False,
           variant: Variant = SHIPPED):
  """Attention for a validated call (:func:`dot_product_attention`'s
  results); ``variant``: kernel.experiments' switches."""
  for name, dim in (("query", call.shapes.H), ("value", call.shapes.Hv)):
    if dim > plan_lib.MAX_HEAD_DIM:
      raise ValueError(f"{name}: head_dim {dim} is over the limit {plan_lib.MAX_HEAD_DIM}")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise ValueError(f"deterministic: expected a bool, got {deterministic!r}")
  if config is not None and not isinstance(config, Config):
    raise ValueError(f"config: expected kernel.tiling.config.Config or None, "
                     f"got {type(config).__name__}")
  routed = key_ranges.route(call, variant.segment_bounds)
  _check_device()
  problem, config = resolve(call, routed, config=config, variant=variant,
                            deterministic=deterministic)
  k_start, k_end = routed.k_start, routed.k_end
  if variant.ranges_always and k_start is None and k_end is None:
    k_start, k_end = key_ranges.whole_keys(call.shapes.T, call.shapes.S)
    # known when tracing: the plain call's static order, not one re-ranked on the device
    problem = problem.replace(static_ranges=True)
  attention = _differentiable(problem, config, resolve_backward(call, problem, variant),
                              _num_sms())
  descales = None
  if problem.fp8:
    descales = padding.fp8_descales(call.q_descale, call.k_descale, call.v_descale,
                                    layout=problem.descales, batch=call.shapes.B,
                                    kv_heads=call.shapes.K)
  out, residuals = attention(call.query, call.key, call.value, call.bias, routed.mask,
                             k_start, k_end, descales)
  return routed.finish(out, residuals)


def _differentiable(problem: plan_lib.Problem, config: Config, backward: backward_plan.Backward,
                    num_sms: int):
  """The forward kernel under a custom_vjp whose backward reads the kernel's
  own residuals (out, and m in natural log, l): ``backward``
  (:func:`_sharded_backward`), for the same problem."""

  @jax.custom_vjp
  def attention(q, k, v, bias, mask, ks, ke, descales):
    return _sharded_forward(problem, config, num_sms,
                            q, k, v, bias, mask, ks, ke, descales)

  def fwd(q, k, v, bias, mask, ks, ke, descales):
    if problem.fp8:
      raise NotImplementedError(
          f"query: {np.dtype(problem.dtype).name} attention has no gradient here (FP8 "
          "training is out of scope); differentiate a bfloat16 call")
    if not problem.normalize_output:
      raise NotImplementedError(
          "normalize_output: gradients are defined for the normalised output only")
    out, (m, l) = _sharded_forward(problem, config, num_sms,
                                   q, k, v, bias, mask, ks, ke, descales, residuals=True)
    primal = (out, (m, l) if problem.return_residuals else None)
    return primal, (q, k, v, bias, mask, ks, ke, out, m, l)

  def bwd(saved, cotangents):
    return _sharded_backward(problem, backward, num_sms, saved, cotangents)

  attention.defvjp(fwd, bwd)
  return attention


def _sharded_forward(problem: plan_lib.Problem, config: Config, num_sms: int,
                     q, k, v, bias, mask, ks, ke, descales, *, residuals: bool = False):
  """The forward on each device's batch/head shard (kernel.sharding), with
  m and l where the call or (``residuals``) the gradient wants them."""
  problem = problem.for_launch(config, residuals=residuals)

  def local(q, k, v, bias, mask, ks, ke, descales=None):
    out, res = _forward(problem, config, num_sms, q, k, v, bias, mask, ks, ke,
                        descales)
    return out.astype(problem.output_dtype if problem.fp8 else q.dtype), res
  return sharding.forward(local, q, k, v, bias, mask, ks, ke,
                          residuals=problem.return_residuals, descales=descales)


def _sharded_backward(problem: plan_lib.Problem, backward: backward_plan.Backward, num_sms: int,
                      saved, cotangents):
  """The custom_vjp's backward: ``backward`` on each device's shard,
  gradients in the inputs' dtypes."""
  # Cotangents of m and l are not propagated: the residuals are outputs
  # for the backward kernel, not differentiable quantities (documented).
  q, k, v, bias, mask, ks, ke, out, m, l = saved
  d_out, _ = cotangents
  # Differentiate the function the kernel computed: of the inputs rounded
  # to the compute dtype (f32 inputs run in bf16), as the forward saw them;
  # mixing unrounded values with the rounded forward's output would leave
  # rounding noise in dP - delta.  The cotangent too: dP = dO V^T is
  # formed from dO in the compute dtype, so delta = rowsum(dO * O) must be,
  # else a row that sees one key (dP - delta exactly 0) keeps dO's
  # rounding, seen as dq, dk and dbias past the float64 bound for float32
  # inputs (docs/decisions/cotangent-in-compute-dtype.md).
  low = lambda x: None if x is None else x.astype(problem.dtype)

  def local(q, k, v, bias, mask, ks, ke, out, m, l, d_out):
    # The sm90 kernels, or their executable specification in plain JAX.
    # deterministic=True sums the fused dQ's parts in int32 fixed point, whose
    # sum does not depend on the order (docs/decisions/fixed-point-dq.md; not
    # kept: a fixed order of float32 reduce-adds,
    # docs/decisions/fixed-order-dq-rejected.md; the dO norms beside delta,
    # docs/decisions/do-norms-own-pass.md).
    if backward.implementation == "xla":
      return xla_backward(problem, q, k, v, bias, mask, ks, ke, out, m, l, d_out)
    return attention_backward(problem, backward, q, k, v, bias, mask, ks, ke, out, m, l, d_out,
                              num_sms=num_sms)
  dq, dk, dv, dbias = sharding.backward(
      local, low(q), low(k), low(v), low(bias), mask, ks, ke, out, m, l, low(d_out))
  back = lambda g, like: None if g is None else g.astype(like.dtype)
  return back(dq, q), back(dk, k), back(dv, v), back(dbias, bias), None, None, None, None


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(problem, config, num_sms, query, key, value, bias, mask, k_start, k_end,
             descales=None):
  q, k, v, bias, mask, k_start, k_end, tiles = padding.forward_inputs(
      query, key, value, bias, mask, k_start, k_end, problem=problem, config=config)
  out, residuals = flash_attention_forward(
      problem, config, q, k, v, bias, mask, k_start, k_end, tiles, num_sms=num_sms,
      **({} if descales is None else {"descales": descales}))
  return padding.forward_results(out, residuals, seq_q=query.shape[1],
                                 head_dim_out=value.shape[3])
