"""Lower the kernel for CUDA on a machine without a GPU (``jax.export``).

All of Pallas' tracing and Mosaic GPU's lowering run, so shape, dtype, layout
and ref errors surface here in well under a second per config; only the
PTX/SASS compile waits for a GPU.  The lowering also reports the shared memory
the kernel really allocates (Mosaic GPU's own count of its scratch tree,
barriers included), which the tests hold ``kernel.tiling.plan.estimate_smem_bytes``
against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Lowered:
  smem_bytes: int       # the largest kernel scratch tree seen while lowering
  seconds: float
  kernel_smem: tuple[int, ...] = ()   # every kernel's scratch tree, in lowering order


@contextlib.contextmanager
def _count_smem(record: list):
  from jax.experimental.mosaic.gpu import core as mgpu_core
  original = mgpu_core._smem_tree_size

  def counting(tree):
    size = original(tree)
    record.append(size)
    return size

  mgpu_core._smem_tree_size = counting
  try:
    yield
  finally:
    mgpu_core._smem_tree_size = original


def abstract_call(attention, shapes: dict, dt, operands, kwargs: dict, gradients: bool):
  """(target, args): ``attention`` (a ``dot_product_attention``) over
  abstract q, k, v of ``shapes`` (B, T, N, H, S, K, Hv) and dtype ``dt``,
  then the ``operands`` ((name, shape, dtype) each; a None shape is left
  out) it takes by name, with ``kwargs``; with ``gradients``, ``jax.grad``
  of the output's sum with respect to q, k, v (and bias)."""
  sds = jax.ShapeDtypeStruct
  B, T, N, H, S, K, Hv = (shapes[x] for x in ("B", "T", "N", "H", "S", "K", "Hv"))
  args = [sds((B, T, N, H), dt), sds((B, S, K, H), dt), sds((B, S, K, Hv), dt)]
  names = []
  for name, shape, adt in operands:
    if shape is not None:
      args.append(sds(tuple(shape), adt))
      names.append(name)

  def fn(q, k, v, *rest):
    extra = dict(zip(names, rest))
    return attention(q, k, v, extra.pop("bias", None), extra.pop("mask", None),
                     **extra, **kwargs)

  if not gradients:
    return fn, args
  float_args = (0, 1, 2) + ((3,) if "bias" in names else ())
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=float_args), args


def lower_attention(shapes: dict, *, dtype="bfloat16", bias_shape=None, mask_shape=None,
                    k_range_shape=None, gradients=False, descales="tensor", **kwargs) -> Lowered:
  """Export ``kernel.api.dot_product_attention`` for CUDA with abstract inputs.

  ``shapes``: dict with B, T, N, H, S, K, Hv.  ``kwargs`` go to the API
  (config, is_causal, logits_soft_cap, ...).  An FP8 ``dtype`` takes its
  three descales as abstract float32 inputs, per tensor (``descales``
  "tensor") or per (batch, kv head) ("head"), and a bfloat16 bias.  With
  ``gradients``, export
  ``jax.grad`` of the output's sum with respect to q, k, v (and bias): the
  forward and the backward kernels; ``smem_bytes`` is then the largest of the
  kernels.
  """
  from kernel import api, experiments
  dt = jnp.dtype(dtype)
  fp8 = dt.itemsize == 1
  descale_shape = () if descales == "tensor" else (shapes["B"], shapes["K"])
  target, args = abstract_call(
      experiments.dot_product_attention, shapes, dt,
      (("bias", bias_shape, jnp.bfloat16 if fp8 else dt),
       ("mask", mask_shape, jnp.bool_),
       ("k_start", k_range_shape, jnp.int32),
       ("k_end", k_range_shape, jnp.int32),
       *((n, descale_shape, jnp.float32)
         for n in (("q_descale", "k_descale", "v_descale") if fp8 else ()))),
      kwargs, gradients)
  record: list[int] = []
  start = time.perf_counter()
  with api.lowering_only(), _count_smem(record):
    jax.export.export(jax.jit(target), platforms=["cuda"])(*args)
  if not record:
    raise RuntimeError("lowering produced no Mosaic GPU kernel")
  return Lowered(smem_bytes=max(record), seconds=time.perf_counter() - start,
                 kernel_smem=tuple(record))
