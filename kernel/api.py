"""Public entry point: an extension of ``jax.nn.dot_product_attention``.

Layout (B, T, N, H) like ``jax.nn.dot_product_attention``; switching is one
line.  Everything the kernel cannot take directly is handled here: f32 inputs
are cast to bf16 (the output is cast back), head dims are zero-padded to a
multiple of 32 of at least 64 (of 64 where either is over 128:
kernel.tiling.plan.padded_head_dims; the backward pads its own:
kernel.tiling.plan.backward_head_dims), sequence lengths are padded to whole tiles
(padded keys are masked in the kernel, padded query rows are sliced off),
broadcast bias and mask are passed un-materialised.

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
import jax.numpy as jnp
import numpy as np

from kernel import padding
from kernel.tiling import plan as plan_lib
from kernel import sharding
from kernel import key_ranges as variants
from kernel.tiling.config import Config
from kernel.common import is_2d
from kernel.forward import Features, flash_attention_forward
from kernel.validation import validate_attention_args
from kernel import backward as backward_pallas

# The custom_vjp's backward: the sm90 kernels of kernel/backward/.  Where
# the dK/dV kernel sums dq across thread blocks (the fused dQ), the default
# adds in float32 (one ulp from run to run) and deterministic=True adds the
# same parts in int32 fixed point, whose sum does not depend on the order
# (the notes above kernel.backward.fused_dq.FIXED_POINT_BITS), faster than
# the dQ kernel it took before (docs/decisions/fixed-point-dq.md).
# Not kept: the fused dQ's float32 reduce-adds in a fixed order (a semaphore
# per query block), reproducible but slower than the dQ kernel
# (docs/decisions/fixed-order-dq-rejected.md); ‖dO_i‖ reduced in
# residual_rows' pass beside delta, no faster than a pass of its own
# (docs/decisions/do-norms-own-pass.md).
SHIPPED_BACKWARD = backward_pallas.attention_backward
REPRODUCIBLE_BACKWARD = functools.partial(backward_pallas.attention_backward,
                                          fixed_point_dq=True)

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


def _effective_threshold(threshold: float, dtype) -> float:
  if np.dtype(dtype) == np.float16 and threshold < F16_MIN_THRESHOLD:
    return F16_MIN_THRESHOLD
  return threshold


def _num_sms() -> int:
  """Streaming multiprocessors of the sm90 GPU (132 on H100 SXM and H200;
  also the value used when lowering without a GPU)."""
  dev = sm90_device()
  return int(getattr(dev, "core_count", 0) or 132)


def _problem(query, key, value, bias, mask, *, is_causal, return_residuals, stage_2d):
  return dataclasses.replace(
      plan_lib.problem_for(query.shape, key.shape, value.shape, jnp.dtype(query.dtype),
                           is_causal=is_causal, return_residuals=return_residuals),
      bias_2d=stage_2d and is_2d(bias),
      mask_2d=stage_2d and is_2d(mask))


def resolve(query, key, value, bias=None, mask=None, *, is_causal=False,
            return_residuals=False, k_start=None, k_end=None, config=None,
            stage_2d=True) -> tuple[plan_lib.Problem, Config]:
  """The (problem, config) ``dot_product_attention`` runs for these
  arguments (arrays or ShapeDtypeStructs), resolved once: a 2-D bias or mask
  is staged through the ring with the keys where the config (given, or the
  one ``config=None`` picks for the staged problem) fits with it, else read
  from global memory, with the config picked for that problem (head dims of
  256 with both a 2-D bias and mask, say; the results are the same bits
  either way, properties/test_forward_gpu.py).  Raises if the config does not
  fit."""
  def problem_for(staged):
    return _problem(query, key, value, bias, mask, is_causal=is_causal,
                    return_residuals=return_residuals, stage_2d=staged)

  def config_for(staged):
    if config is not None:
      return config
    return _chosen_config(query, key, value, bias, mask, is_causal=is_causal,
                          k_start=k_start, k_end=k_end, device_kind=None, stage_2d=staged)

  if bool(stage_2d) and (is_2d(bias) or is_2d(mask)):
    problem = problem_for(True)
    try:
      chosen = config_for(True)   # the heuristic refuses a problem nothing fits
      if plan_lib.config_fits(problem, chosen):
        return problem, chosen
    except ValueError:
      pass
  problem, chosen = problem_for(False), config_for(False)
  plan_lib.check_fits(problem, chosen)
  return problem, chosen


def resolved_problem(query, key, value, bias=None, mask=None, **kwargs) -> plan_lib.Problem:
  """The problem of :func:`resolve`."""
  return resolve(query, key, value, bias, mask, **kwargs)[0]


def chosen_config(query, key, value, bias=None, mask=None, *, is_causal=False,
                  k_start=None, k_end=None, device_kind: str | None = None) -> Config:
  """The config ``dot_product_attention(..., config=None)`` runs for these
  arguments (arrays or ShapeDtypeStructs): the autotuner's cached best for
  this device and signature, else the nearest tuned signature's
  (kernel.tiling.autotune.nearest), else the heuristic.  ``device_kind`` defaults
  to the sm90 GPU of this process (none: the heuristic)."""
  return _chosen_config(query, key, value, bias, mask, is_causal=is_causal, k_start=k_start,
                        k_end=k_end, device_kind=device_kind, stage_2d=True)


def chosen_config_source(query, key, value, bias=None, mask=None, *, is_causal=False,
                         k_start=None, k_end=None,
                         device_kind: str | None = None) -> tuple[Config, str]:
  """:func:`chosen_config` and where it came from (kernel.tiling.autotune.choice:
  "autotune cache", "autotune cache, nearest: SIGNATURE" or "heuristic")."""
  return _chosen_config(query, key, value, bias, mask, is_causal=is_causal, k_start=k_start,
                        k_end=k_end, device_kind=device_kind, stage_2d=True, with_source=True)


def _chosen_config(query, key, value, bias, mask, *, is_causal, k_start, k_end,
                   device_kind, stage_2d, with_source=False):
  from kernel.tiling import autotune
  problem = autotune.selection_problem(_problem(
      query, key, value, bias, mask, is_causal=is_causal, return_residuals=False,
      stage_2d=stage_2d))
  if device_kind is None and not getattr(_state, "lowering_only", False):
    device = sm90_device()
    device_kind = None if device is None else device.device_kind
  config, source = autotune.choice(problem, device_kind, has_bias=bias is not None,
                                   has_mask=mask is not None,
                                   has_key_ranges=k_start is not None or k_end is not None)
  return (config, source) if with_source else config


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False,
                          q_segment_ids=None, kv_segment_ids=None,
                          segment_layout="contiguous", k_start=None, k_end=None,
                          logits_soft_cap=None, rescale_threshold=1.0,
                          normalize_output=True, return_residuals=False,
                          config=None, deterministic=False):
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
  out NaN) or "any" (a dense mask).  All of them become per-row key ranges
  (kernel/key_ranges.py).  Rank-3 (T, N, H) inputs, which jax.nn also takes,
  are refused: add the batch axis.

  ``deterministic``: True makes the gradients bitwise reproducible from run
  to run on every path.  Where the backward sums dq across thread blocks
  (the fused dQ: head dims up to 128 without causal, up to 64 with it; no
  bias) it then adds in int32 fixed point, each row scaled by a power of
  two from an a-priori bound of its sum
  (``kernel.backward.fused_dq.FIXED_POINT_BITS``):
  within the same float64 tolerance as the default, somewhat slower than
  it on that path (docs/decisions/fixed-point-dq.md), as fast elsewhere.
  False (the
  default) adds in float32, and dq may differ by one ulp between runs
  (``harness.numerics.tolerance.run_to_run_bound``).
  With True, on the fused path, a NaN or infinity in any key or value of a
  head (or a cotangent whose norm overflows float32) makes that head's
  (that row's) dq NaN, not only where the logits touch it.  The
  forward is bitwise reproducible either way.
  """
  return _attention(**locals(), backward=SHIPPED_BACKWARD,
                    reproducible_backward=REPRODUCIBLE_BACKWARD, stage_2d=True)


def _attention(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
               key_value_seq_lengths, local_window_size, implementation, return_residual,
               q_segment_ids, kv_segment_ids, segment_layout, k_start, k_end,
               logits_soft_cap, rescale_threshold, normalize_output, return_residuals,
               config, deterministic, backward, reproducible_backward, stage_2d: bool,
               segment_bounds: str = variants.SHIPPED_SEGMENT_BOUNDS,
               even_sections: bool = True, defer_light: bool | None = None,
               untiled_copies: bool = False):
  """dot_product_attention with the variants kept for measurement and tests
  (kernel/experiments.py): ``backward`` the custom_vjp's backward,
  ``reproducible_backward`` the one ``deterministic=True`` takes instead
  (None: ``backward`` itself), ``stage_2d`` False reads 2-D bias and mask
  from global memory, ``segment_bounds`` how segments' key ranges are found
  (kernel.key_ranges.SEGMENT_BOUNDS), ``even_sections`` False keeps the
  longest-first order's L2 sections filled, ``defer_light`` True or False
  runs its light tiles last always or never, None where the schedule's
  model predicts that it pays, ``untiled_copies`` True copies q, k, v and
  the output through untiled views, in column parts (kernel.tiling.plan.copy_parts;
  kernel.forward.Features)."""
  routed = variants.route(
      query, key, value, bias, mask, k_start, k_end, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      segment_layout=segment_layout, implementation=implementation,
      return_residual=return_residual, return_residuals=return_residuals,
      segment_bounds_method=segment_bounds)
  mask, k_start, k_end = routed.mask, routed.k_start, routed.k_end
  return_residuals = routed.kernel_residuals
  shapes = validate_attention_args(
      query, key, value, bias, mask, scale=scale, k_start=k_start, k_end=k_end,
      logits_soft_cap=logits_soft_cap, rescale_threshold=rescale_threshold)
  if shapes.H > plan_lib.MAX_HEAD_DIM:
    raise ValueError(f"query: head_dim {shapes.H} is over the limit {plan_lib.MAX_HEAD_DIM}")
  if shapes.Hv > plan_lib.MAX_HEAD_DIM:
    raise ValueError(f"value: head_dim {shapes.Hv} is over the limit {plan_lib.MAX_HEAD_DIM}")
  for name, flag in (("is_causal", is_causal), ("normalize_output", normalize_output),
                     ("return_residuals", return_residuals), ("deterministic", deterministic)):
    if not isinstance(flag, (bool, np.bool_)):
      raise ValueError(f"{name}: expected a bool, got {flag!r}")
  if config is not None and not isinstance(config, Config):
    raise ValueError(f"config: expected kernel.tiling.config.Config or None, got {type(config).__name__}")
  _check_device()

  problem, config = resolve(query, key, value, bias, mask, is_causal=is_causal,
                            return_residuals=return_residuals, k_start=k_start, k_end=k_end,
                            config=config, stage_2d=stage_2d)
  stage_2d = problem.bias_2d or problem.mask_2d
  features = Features(
      scale=float(shapes.H ** -0.5 if scale is None else scale),
      is_causal=bool(is_causal),
      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      rescale_threshold=_effective_threshold(float(rescale_threshold), problem.dtype),
      normalize_output=bool(normalize_output),
      return_residuals=bool(return_residuals),
      seq_q=shapes.T, seq_kv=shapes.S,
      stage_2d=stage_2d,
      window=routed.window if config.schedule == "longest-first" else None,
      poisons_rows=routed.poisoned is not None,
      window_ranges=routed.window_only and config.schedule == "longest-first",
      even_sections=bool(even_sections),
      defer_light=None if defer_light is None else bool(defer_light),
      untiled_copies=bool(untiled_copies))
  if deterministic and reproducible_backward is not None:
    backward = reproducible_backward
  attention = _differentiable(features, config, jnp.dtype(problem.dtype), _num_sms(), problem,
                              backward, window=routed.window)
  out, residuals = attention(query, key, value, bias, mask, k_start, k_end)
  return routed.finish(out, residuals)


def _differentiable(features: Features, config: Config, dtype, num_sms: int,
                    problem: plan_lib.Problem, attention_backward, *,
                    window: tuple[int, int] | None = None):
  """The forward kernel under a custom_vjp whose backward reads the kernel's
  own residuals (out, and m in natural log, l): ``attention_backward``, one
  of kernel.experiments.BACKWARDS.  ``window``: jax.nn's local window the key
  ranges come from, for the backward's launch order (whatever the forward's
  schedule)."""

  def run(f, q, k, v, bias, mask, ks, ke):
    def local(q, k, v, bias, mask, ks, ke):   # on one device's batch/head shard
      out, res = _forward(q, k, v, bias, mask, ks, ke, features=f, config=config,
                          dtype=dtype, num_sms=num_sms)
      return out.astype(q.dtype), res
    return sharding.forward(local, q, k, v, bias, mask, ks, ke,
                            residuals=f.return_residuals)

  @jax.custom_vjp
  def attention(q, k, v, bias, mask, ks, ke):
    return run(features, q, k, v, bias, mask, ks, ke)

  def fwd(q, k, v, bias, mask, ks, ke):
    if not features.normalize_output:
      raise NotImplementedError(
          "normalize_output: gradients are defined for the normalised output only")
    plan_lib.check_fits(dataclasses.replace(problem, return_residuals=True), config)
    with_res = dataclasses.replace(features, return_residuals=True)
    out, (m, l) = run(with_res, q, k, v, bias, mask, ks, ke)
    primal = (out, (m, l) if features.return_residuals else None)
    return primal, (q, k, v, bias, mask, ks, ke, out, m, l)

  def bwd(saved, cotangents):
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
    low = lambda x: None if x is None else x.astype(dtype)
    local = functools.partial(attention_backward, scale=features.scale,
                              is_causal=features.is_causal,
                              logits_soft_cap=features.logits_soft_cap, num_sms=num_sms,
                              window=window)
    dq, dk, dv, dbias = sharding.backward(
        local, low(q), low(k), low(v), low(bias), mask, ks, ke, out, m, l, low(d_out))
    back = lambda g, like: None if g is None else g.astype(like.dtype)
    return back(dq, q), back(dk, k), back(dv, v), back(dbias, bias), None, None, None

  attention.defvjp(fwd, bwd)
  return attention


@functools.partial(jax.jit, static_argnames=("features", "config", "dtype", "num_sms"))
def _forward(query, key, value, bias, mask, k_start, k_end, *, features, config, dtype,
             num_sms):
  f = features
  tile, block_kv = config.tile_q, config.block_kv
  t, s, hv = query.shape[1], key.shape[1], value.shape[3]
  pad = padding.pad_to_multiple
  # The kernel reads past the end of q, k, v as zeros (TMA), so sequence
  # axes are padded only where a copy is made anyway (a head dim computed
  # wider: kernel.tiling.plan.padded_head_dims), where the length is shorter than
  # one tile, or where it is no multiple of the 8-row tiling Mosaic GPU's
  # TMA descriptors need (jax 0.11.2: a copy that indexes one head moves
  # that axis first, so the staging buffers' (8, 64) tiling falls on
  # (sequence, head dim), and the descriptor refuses a sequence length that
  # is no multiple of 8 -- "dimension 2 must have size smaller or a multiple
  # of its tiling 8").
  # Those copies cost (docs/decisions/untiled-copies.md).
  # Features.untiled_copies copies through views
  # with the swizzle alone, which take any length, each buffer in column
  # parts of one swizzle atom (kernel.tiling.plan.copy_parts says why); it is
  # kernel.experiments' untiled_copies until it has run against float64 on
  # a GPU.  RefUnion's docstring allows reading only through the member that
  # wrote, so the union's layout is checked on the CPU
  # (properties/test_lowering.py); the tiled view cannot simply be dropped:
  # buffers with the swizzle alone fail Mosaic GPU's layout inference as
  # wgmma operands (jax 0.11.2).
  d, dv = plan_lib.padded_head_dims(query.shape[3], value.shape[3])

  # Untiled copies (kernel.tiling.plan.copy_parts) take any length.
  tiling = 1 if f.untiled_copies else 8

  def operand(x, width, multiple):
    x = x.astype(dtype)
    if x.shape[3] != width or x.shape[1] < multiple or x.shape[1] % tiling:
      x = pad(padding.pad_head_dim(x, width), 1, multiple)
    return x
  q, k, v = (operand(query, d, tile), operand(key, d, block_kv),
             operand(value, dv, block_kv))
  if k.shape[1] != v.shape[1]:  # one of them was padded: both, so they agree
    k, v = pad(k, 1, block_kv), pad(v, 1, block_kv)
  num_tiles = -(-t // tile)
  if bias is not None:
    bias = padding.broadcast_operand(bias, dtype, tile, block_kv)
  if mask is not None:
    mask = padding.broadcast_operand(mask, jnp.int8, tile, block_kv)
  k_start, k_end, tiles = padding.key_ranges(k_start, k_end, seq_kv=s, tile=tile,
                                             num_tiles=num_tiles)

  out, residuals = flash_attention_forward(
      q, k, v, bias, mask, k_start, k_end, tiles, features=f, config=config,
      num_sms=num_sms)
  out = out[:, :t, :, :hv]
  if residuals is not None:
    m, l = residuals
    residuals = (m[:, :, :t], l[:, :, :t])
  return out, residuals
