"""Run the kernel on one case and hold it to the float64 reference.

Shared by the GPU properties, the golden check and the device scripts, so
every comparison of kernel output goes through the same code and the same
tolerance rule (``harness/numerics/tolerance.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from harness.numerics import reference as ref_lib
from harness.numerics import tolerance
from kernel.call import Call, api_variants


def compute_dtype(dtype) -> np.dtype:
  """The kernel computes f32 inputs in bf16 (kernel/api.py)."""
  import ml_dtypes
  dtype = np.dtype(dtype)
  return np.dtype(ml_dtypes.bfloat16) if dtype == np.float32 else dtype


def random_case(rng: np.random.Generator, *, batch=1, seq_q=256, seq_kv=256, heads=2,
                kv_heads=1, head_dim=64, head_dim_out=None, dtype="bfloat16",
                **kwargs) -> Call:
  """A call of normal inputs of these sizes; ``kwargs`` are the call's own."""
  import ml_dtypes
  dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  hv = head_dim if head_dim_out is None else head_dim_out
  q = rng.standard_normal((batch, seq_q, heads, head_dim)).astype(dt)
  k = rng.standard_normal((batch, seq_kv, kv_heads, head_dim)).astype(dt)
  v = rng.standard_normal((batch, seq_kv, kv_heads, hv)).astype(dt)
  return Call(q, k, v, **kwargs)


def _descale_kwargs(case: Call) -> dict:
  """An FP8 call's descales and output dtype as the API takes them."""
  if not case.fp8:
    return {}
  import jax.numpy as jnp
  return dict({n: jnp.asarray(getattr(case, n), jnp.float32)
               for n in ("q_descale", "k_descale", "v_descale")}, out_dtype=case.out_dtype)


def run_kernel(case: Call, *, config=None, return_residuals=True, stage_2d=True,
               untiled_copies=None, ranges_always=False):
  """(out, m, l) as NumPy float64 (m, l None without residuals).

  ``stage_2d`` the staging of 2-D bias/mask through the ring (the API's
  default; False reads them from global memory, kernel.experiments' stage_2d);
  ``untiled_copies`` (None: where the API takes them) and ``ranges_always``
  kernel.experiments' switches.
  """
  import jax
  import jax.numpy as jnp
  from kernel import experiments
  args = [jnp.asarray(x) for x in (case.query, case.key, case.value)]
  result = experiments.dot_product_attention(
      *args, None if case.bias is None else jnp.asarray(case.bias),
      None if case.mask is None else jnp.asarray(case.mask),
      scale=case.scale, is_causal=case.is_causal,
      k_start=None if case.k_start is None else jnp.asarray(case.k_start),
      k_end=None if case.k_end is None else jnp.asarray(case.k_end),
      logits_soft_cap=case.logits_soft_cap, rescale_threshold=case.rescale_threshold,
      normalize_output=case.normalize_output, return_residuals=return_residuals,
      config=config, stage_2d=stage_2d, untiled_copies=untiled_copies,
      ranges_always=ranges_always,
      segment_layout=case.segment_layout, **_descale_kwargs(case),
      **api_variants(case.variants))
  result = jax.block_until_ready(result)
  if return_residuals:
    out, (m, l) = result
    return (np.asarray(out.astype(jnp.float32), np.float64), np.asarray(m, np.float64),
            np.asarray(l, np.float64))
  return np.asarray(result.astype(jnp.float32), np.float64), None, None


def poison_device_memory(nbytes: int) -> None:
  """Fill and free a NaN buffer so the next allocation likely reuses NaN
  bytes: an output element the kernel forgets to write then shows up as NaN
  rather than as a stale right answer."""
  import jax
  import jax.numpy as jnp
  x = jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32)
  jax.block_until_ready(x)
  x.delete()


# Where the gate collects every float64 comparison's error ratio (a folder;
# unset: nothing is recorded).  One JSON line per array compared, tagged with
# the pytest test that made it; harness/tools/gate.py tabulates the worst ratio per
# property.
RATIO_LOG_ENV = "FLASH_ERROR_RATIO_LOG"


def log_ratios(reports) -> None:
  """Record ``reports`` (tolerance.ToleranceReport) for the gate, if asked."""
  folder = os.environ.get(RATIO_LOG_ENV)
  if not folder:
    return
  # PYTEST_CURRENT_TEST is "path::test[params] (call)".
  test = os.environ.get("PYTEST_CURRENT_TEST", "outside pytest").rsplit(" (", 1)[0]
  lines = [json.dumps({"test": test, "array": r.name, "ratio": r.ratio, "passed": r.passed})
           for r in reports if r is not None]
  with open(Path(folder) / f"ratios-{os.getpid()}.jsonl", "a") as fh:
    fh.write("".join(line + "\n" for line in lines))


@dataclasses.dataclass
class ForwardReport:
  out: tolerance.ToleranceReport
  m: tolerance.ToleranceReport | None
  l: tolerance.ToleranceReport | None

  @property
  def passed(self) -> bool:
    return all(r.passed for r in (self.out, self.m, self.l) if r is not None)

  def worst_ratio(self) -> float:
    return max(r.ratio for r in (self.out, self.m, self.l) if r is not None)

  def summary(self) -> str:
    return "; ".join(
        f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g} ratio {r.ratio:.3f}"
        for r in (self.out, self.m, self.l) if r is not None)


def check_forward(case: Call, out, m=None, l=None) -> ForwardReport:
  """Compare kernel results for ``case`` with the float64 reference under
  the rule."""
  ref = ref_lib.attention_reference(case)
  n_out, n_m, n_l = tolerance.naive_forward(case, compute_dtype(case.query.dtype))
  dt = tolerance.floor_dtype(compute_dtype(case.query.dtype), case.result_dtype)
  rtol = tolerance.rtol_for(case.logits_soft_cap)
  ref_out = ref.out
  if not case.normalize_output:
    # Unnormalised output = normalised output * l, per row.
    scale_rows = lambda o, l_: o * np.transpose(l_, (0, 2, 1))[..., None]
    ref_out, n_out = scale_rows(ref.out, ref.l), scale_rows(n_out, n_l)
  r_out = tolerance.check_tolerance(out, ref_out, n_out, dt, rtol=rtol, name="out")
  r_m = None if m is None else tolerance.check_tolerance(m, ref.m, n_m, dt, rtol=rtol, name="m")
  r_l = None if l is None else tolerance.check_tolerance(l, ref.l, n_l, dt, rtol=rtol, name="l")
  log_ratios((r_out, r_m, r_l))
  return ForwardReport(r_out, r_m, r_l)


def run_and_check_forward(case: Call, *, config=None) -> ForwardReport:
  """The kernel's out, m and l for ``case`` on poisoned memory (an element
  it forgets to write shows as NaN), checked against float64 by
  :func:`check_forward`."""
  poison_device_memory(4 * case.query.nbytes)
  return check_forward(case, *run_kernel(case, config=config))


def gradient_reports(case, grads) -> list[tolerance.ToleranceReport]:
  """(dq, dk, dv, dbias) of a strategies.AttentionCase against float64 under
  the rule (see :func:`check_gradients`)."""
  return check_gradients(case.call, case.d_out, grads, rtol=case.rtol)


def check_gradients(call: Call, d_out, grads, *, rtol) -> list[tolerance.ToleranceReport]:
  """Gradients ``grads`` = (dq, dk, dv, dbias) of sum(out * d_out) for
  ``call`` against float64 under the rule, with
  ref_lib.naive_gradient_yardstick as the naive side; dbias is skipped
  where it is cancellation noise (ref_lib.dbias_is_noise)."""
  want = ref_lib.attention_reference_vjp(call, d_out)
  dt = compute_dtype(call.query.dtype)
  naive = ref_lib.naive_gradient_yardstick(call, d_out, dtype=dt)
  bias = call.bias
  reports = []
  for name, got in zip(("dq", "dk", "dv", "dbias"), grads):
    ref = getattr(want, name)
    if ref is None or (name == "dbias" and ref_lib.dbias_is_noise(np.shape(bias))):
      continue
    reports.append(tolerance.check_tolerance(np.asarray(got, np.float64), ref, naive[name], dt,
                                             rtol=rtol, name=name))
  log_ratios(reports)
  return reports


@dataclasses.dataclass
class ApiRun:
  """What the public API returned for one call, as float64 NumPy: out,
  jax.nn's log-sum-exp (B, T, N), m and l (B, N, T), and, for a 16-bit call,
  the gradients (dq, dk, dv, dbias or None) of sum(out * d_out) with
  ``d_out`` the cotangent as it was fed (rounded to the compute dtype)."""
  out: np.ndarray
  lse: np.ndarray
  m: np.ndarray
  l: np.ndarray
  grads: tuple | None = None
  d_out: np.ndarray | None = None


def api_program(case, *, config=None, deterministic: bool = False, gradients: bool = True):
  """(program, arguments): ``program(*arguments)`` runs ``case`` (a
  strategies.AttentionCase) through ``kernel.api.dot_product_attention`` as
  a user calls it -- jax.nn's arguments (lengths, window, segment ids), the
  chunk, bias, mask, key ranges, soft cap, FP8 descales, both residual
  forms, ``config`` (None: what config=None runs), ``deterministic`` -- and
  returns (out, lse, m, l, grads): the gradients (dq, dk, dv, and dbias
  where there is a bias) of sum(out * d_out) from one ``jax.vjp``, or ()
  for FP8 or without ``gradients``.  The arguments are q, k, v, the bias
  (where there is one) and d_out, as JAX arrays; ``jax.export`` lowers the
  program for CUDA on any host (under ``api.lowering_only()``)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  call = case.call
  j = lambda x: None if x is None else jnp.asarray(x)
  with_bias = call.bias is not None
  backward = gradients and not call.fp8

  def attend(q, k, v, bias):
    out, lse, (m, l) = api.dot_product_attention(
        q, k, v, bias, j(call.mask), scale=call.scale, is_causal=call.is_causal,
        k_start=j(call.k_start), k_end=j(call.k_end), logits_soft_cap=call.logits_soft_cap,
        rescale_threshold=call.rescale_threshold, normalize_output=call.normalize_output,
        segment_layout=call.segment_layout, return_residual=True, return_residuals=True,
        config=config, deterministic=deterministic, **_descale_kwargs(call),
        **api_variants(call.variants))
    return out, (lse, m, l)

  def program(q, k, v, *rest):
    *bias, d_out = rest       # the bias where the call has one, then d_out
    if not backward:
      out, (lse, m, l) = attend(q, k, v, *bias or [None])
      return out, lse, m, l, ()
    differentiated = attend if with_bias else (lambda q, k, v: attend(q, k, v, None))
    out, pullback, (lse, m, l) = jax.vjp(differentiated, q, k, v, *bias, has_aux=True)
    return out, lse, m, l, pullback(d_out)

  d_out = jnp.asarray(case.d_out, compute_dtype(call.query.dtype))
  arguments = [jnp.asarray(x) for x in (call.query, call.key, call.value)]
  return program, arguments + ([jnp.asarray(call.bias)] if with_bias else []) + [d_out]


def run_api(case, *, config=None, deterministic: bool = False,
            gradients: bool = True) -> ApiRun:
  """:func:`api_program` of ``case`` run, as float64 NumPy."""
  import jax
  import jax.numpy as jnp
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  program, arguments = api_program(case, config=config, deterministic=deterministic,
                                   gradients=gradients)
  out, lse, m, l, grads = jax.block_until_ready(program(*arguments))
  if not grads:
    return ApiRun(f64(out), f64(lse), f64(m), f64(l))
  grads = tuple(f64(g) for g in grads) + (None,) * (4 - len(grads))
  return ApiRun(f64(out), f64(lse), f64(m), f64(l), grads, f64(arguments[-1]))


def check_api_run(case, run: ApiRun) -> list[tolerance.ToleranceReport]:
  """Every array of ``run`` against float64 under the rule: out, m, l
  (:func:`check_forward`), the log-sum-exp, and the gradients where they
  were taken (:func:`check_gradients`)."""
  call = case.call
  forward = check_forward(call, run.out, run.m, run.l)
  ref = ref_lib.attention_reference(call)
  _, n_m, n_l = tolerance.naive_forward(call, compute_dtype(call.query.dtype))
  with np.errstate(divide="ignore"):
    lse_of = lambda m_, l_: np.transpose(m_ + np.log(l_), (0, 2, 1))
    want_lse, naive_lse = lse_of(ref.m, ref.l), lse_of(n_m, n_l)
  dt = tolerance.floor_dtype(compute_dtype(call.query.dtype), call.result_dtype)
  lse = tolerance.check_tolerance(run.lse, want_lse, naive_lse, dt,
                                  rtol=tolerance.rtol_for(call.logits_soft_cap), name="lse")
  log_ratios([lse])
  reports = [r for r in (forward.out, forward.m, forward.l, lse) if r is not None]
  if run.grads is not None:
    reports += check_gradients(call, run.d_out, run.grads, rtol=case.rtol)
  return reports
