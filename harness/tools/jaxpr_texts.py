"""The jaxprs of the shipped kernels for a fixed set of configs, as text.

``python -m harness.tools.jaxpr_texts OUT.json`` writes {config name: jaxpr text}
(made under ``kernel.api.lowering_only()``, no GPU needed);
``python -m harness.tools.jaxpr_texts --compare A.json B.json`` says which differ.
Used to show that a refactor of the kernel's Python leaves the traced
kernels unchanged: dump at the commit before, dump after, compare.  A case
only the newer file holds (one added since) is listed as new, not as a
difference; one only the older holds (a case lost) fails the comparison.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def cases() -> dict[str, dict]:
  """name: (shapes, API kwargs, operand shapes, with gradients).  Covers each
  specialisation the forward has: causal, bias, mask, key ranges, GQA,
  persistent and not, head dims 64/128/256, a threshold below 1, residuals,
  soft cap, unnormalised output, and the backward kernels through jax.grad."""
  d128 = dict(B=2, T=300, N=4, H=128, S=500, K=2, Hv=128)
  return {**_head_dim_cases(), **_schedule_cases(d128), **_backward_cases(d128),
          **_copy_cases(d128), **_fp8_cases(d128)}


def _head_dim_cases() -> dict[str, tuple]:
  """At head dims 64, 128 and 256: plain, causal with a threshold, bias,
  mask and key ranges, persistent and not, and two gradients."""
  from kernel.tiling.config import Config
  c = {}
  for d in (64, 128, 256):
    base = dict(B=2, T=300, N=4, H=d, S=500, K=2, Hv=d)
    # Only 64 x 64 non-persistent fits 227 KiB at head dim 256.
    for persistent in (False,) if d == 256 else (False, True):
      p = "p" if persistent else "np"
      cfg = Config(64, 64 if d == 256 else 128, 2, persistent)
      c[f"d{d}-{p}-plain"] = (base, dict(config=cfg, return_residuals=True), {}, False)
      c[f"d{d}-{p}-causal-threshold"] = (
          base, dict(config=cfg, is_causal=True, rescale_threshold=0.5, return_residuals=True),
          {}, False)
      c[f"d{d}-{p}-bias-mask-ranges"] = (
          base, dict(config=cfg, logits_soft_cap=20.0, normalize_output=False),
          dict(bias_shape=(1, 4, 300, 500), mask_shape=(2, 1, 300, 500),
               k_range_shape=(2, 4, 300)), False)
    c[f"d{d}-grad-causal"] = (base, dict(is_causal=True), {}, True)
    c[f"d{d}-grad-bias-ranges"] = (base, dict(logits_soft_cap=10.0),
                                   dict(bias_shape=(2, 4, 300, 500), k_range_shape=(2, 1, 300)),
                                   True)
  # Lengths read unpadded (whole 8-row groups, not whole tiles), with the
  # residuals kept padded to whole tiles.
  c["d128-p-unpadded"] = (dict(B=2, T=296, N=4, H=128, S=512, K=2, Hv=128),
                          dict(config=Config(64, 128, 2, True), return_residuals=True), {}, False)
  c["d64-grad-unpadded"] = (dict(B=1, T=296, N=2, H=64, S=512, K=1, Hv=64), {}, {}, True)
  return c


def _schedule_cases(d128: dict) -> dict[str, tuple]:
  """The forward's schedules and staging at head dim 128 (and one at 64)."""
  from kernel.tiling.config import Config
  c = {}
  # The longest-first schedule (its tables, and a local window it weighs
  # tiles by), three stages, 128-row warpgroup blocks, 2-D operands read from
  # global memory instead of staged.
  for persistent in (False, True):
    p = "p" if persistent else "np"
    lf = Config(64, 128, 2, persistent, "longest-first")
    c[f"d128-{p}-longest-first-causal"] = (d128, dict(config=lf, is_causal=True), {}, False)
    c[f"d128-{p}-longest-first-window"] = (
        d128, dict(config=lf, local_window_size=(100, 20), return_residuals=True), {}, False)
  # The split tail: with fewer tiles than SMs every tile is cut into pieces,
  # merged after the kernel (with key ranges, unnormalised; and under the
  # gradient, whose residuals are the merged ones).
  st = Config(64, 128, 2, True, "split-tail")
  c["d128-p-split-tail"] = (d128, dict(config=st), {}, False)
  c["d128-p-split-tail-ranges-unnormalised"] = (
      d128, dict(config=st, normalize_output=False, return_residuals=True),
      dict(k_range_shape=(2, 4, 300)), False)
  c["d128-grad-split-tail"] = (d128, dict(config=st), {}, True)
  c["d128-np-3stages-unstaged-2d"] = (
      d128, dict(config=Config(64, 128, 3, False), stage_2d=False),
      dict(bias_shape=(2, 4, 300, 500), mask_shape=(2, 4, 300, 500)), False)
  c["d64-p-bq128-3stages-staged-mask"] = (
      dict(B=2, T=600, N=4, H=64, S=500, K=2, Hv=64),
      dict(config=Config(128, 64, 3, True), is_causal=True),
      dict(mask_shape=(2, 4, 600, 500)), False)
  return c


def _backward_cases(d128: dict) -> dict[str, tuple]:
  """The backward's variants, chunks, windows, fixed-point dQ and head dim 96."""
  from kernel.tiling.config import Config
  c = {}
  # The private backward variants.
  c["d128-grad-serial-causal-bias"] = (d128, dict(is_causal=True, backward="pallas-serial"),
                                       dict(bias_shape=(1, 4, 300, 500)), True)
  c["d128-grad-two-kernel"] = (d128, dict(backward="pallas-two-kernel"), {}, True)
  # Chunked attention (attention_chunk): static key ranges the
  # longest-first order and the backward's launch order weigh tiles by.
  c["d128-np-longest-first-chunk-causal"] = (
      d128, dict(config=Config(64, 128, 2, False, "longest-first"), is_causal=True,
                 attention_chunk=96), {}, False)
  c["d128-grad-chunk-causal"] = (d128, dict(is_causal=True, attention_chunk=96), {}, True)
  # A local window under causal: the backward's launch order weighs tiles by it.
  c["d128-grad-window-causal"] = (d128, dict(is_causal=True, local_window_size=(100, 0)), {},
                                  True)
  # deterministic=True's fused dQ in fixed point: rounded by float adds at
  # head dim 64, converted over it.
  c["d128-grad-deterministic"] = (d128, dict(deterministic=True), {}, True)
  c["d64-grad-deterministic-causal"] = (dict(B=2, T=300, N=4, H=64, S=500, K=2, Hv=64),
                                        dict(deterministic=True, is_causal=True), {}, True)
  c["d128-grad-fused-mask-ranges"] = (d128, {}, dict(mask_shape=(2, 1, 300, 500),
                                                     k_range_shape=(2, 4, 300)), True)
  c["d96-grad-split-causal"] = (dict(B=1, T=200, N=2, H=96, S=328, K=1, Hv=192),
                                dict(is_causal=True), {}, True)
  # Head dim 96 in 32-column rows (kernel.tiling.plan.padded_head_dims), the
  # backward in its own 64-column rows.
  c["d96-grad-narrow-causal-gqa"] = (dict(B=1, T=200, N=4, H=96, S=328, K=2, Hv=96),
                                     dict(is_causal=True), {}, True)
  return c


def _copy_cases(d128: dict) -> dict[str, tuple]:
  """The output's copies: padded instead of untiled, and the guarded launch."""
  from kernel.tiling.config import Config
  c = {}
  # Lengths no multiple of 8 copied padded (the API copies them through
  # untiled views but in FP8 and for wide rows without causal past 8192 keys).
  c["d128-p-padded-copies"] = (d128, dict(config=Config(64, 128, 2, True), untiled_copies=False,
                                          return_residuals=True), {}, False)
  # The guarded launch (outputs as mutable operands: no fresh outputs).
  c["d128-p-guarded-outputs"] = (d128, dict(config=Config(64, 128, 2, True),
                                            return_residuals=True, _guarded=True), {}, False)
  return c


def _fp8_cases(d128: dict) -> dict[str, tuple]:
  """FP8 (float8_e4m3fn with its descales): per tensor and per (batch, kv
  head), persistent and not, causal with a threshold, staged operands and
  key ranges, 256-key blocks, head dim 256, a float16 output."""
  from kernel.tiling.config import Config
  c = {}
  fp8 = dict(dtype="float8_e4m3fn")
  head = dict(fp8, descales="head")
  c["fp8-d128-p-plain"] = (d128, dict(config=Config(64, 128, 2, True), return_residuals=True),
                           fp8, False)
  c["fp8-d128-np-causal-threshold-head"] = (
      d128, dict(config=Config(64, 128, 2, False), is_causal=True, rescale_threshold=0.7,
                 return_residuals=True), head, False)
  c["fp8-d64-p-bkv256-bias-mask-ranges"] = (
      dict(B=2, T=300, N=4, H=64, S=500, K=2, Hv=64),
      dict(config=Config(64, 256, 2, True), logits_soft_cap=20.0, normalize_output=False),
      dict(fp8, bias_shape=(1, 4, 300, 500), mask_shape=(2, 1, 300, 500),
           k_range_shape=(2, 4, 300)), False)
  c["fp8-d256-np-f16-out"] = (dict(B=2, T=300, N=4, H=256, S=500, K=2, Hv=256),
                              dict(config=Config(64, 128, 2, False), out_dtype="float16"),
                              head, False)
  return c


def jaxpr_text(shapes, kwargs, operands, gradients) -> str:
  import jax
  import jax.numpy as jnp
  from kernel import api, experiments
  sds = jax.ShapeDtypeStruct
  dt = jnp.dtype(operands.get("dtype", "bfloat16"))
  B, T, N, H, S, K, Hv = (shapes[x] for x in ("B", "T", "N", "H", "S", "K", "Hv"))
  args = [sds((B, T, N, H), dt), sds((B, S, K, H), dt), sds((B, S, K, Hv), dt)]
  names = []
  fp8 = dt.itemsize == 1
  if fp8:  # the descales as operands: per tensor, or per (batch, kv head)
    descale = () if operands.get("descales", "tensor") == "tensor" else (B, K)
    operands = dict(operands, **{n: descale for n in ("q_descale", "k_descale", "v_descale")})
  for name, key, adt in (("bias", "bias_shape", jnp.bfloat16 if fp8 else dt),
                         ("mask", "mask_shape", jnp.bool_),
                         ("k_start", "k_range_shape", jnp.int32),
                         ("k_end", "k_range_shape", jnp.int32),
                         *((n, n, jnp.float32) for n in ("q_descale", "k_descale", "v_descale"))):
    if key in operands:
      args.append(sds(operands[key], adt))
      names.append(name)

  def fn(q, k, v, *rest):
    extra = dict(zip(names, rest))
    return experiments.dot_product_attention(q, k, v, extra.pop("bias", None),
                                             extra.pop("mask", None), **extra, **kwargs)

  target = fn
  if kwargs.get("_guarded"):
    target = _guarded(args, {k: v for k, v in kwargs.items() if k != "_guarded"})
  if gradients:
    argnums = (0, 1, 2) + ((3,) if "bias" in names else ())
    target = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)
  with api.lowering_only():
    return str(jax.make_jaxpr(target)(*args))


def _guarded(args, kwargs):
  """The API's own launch (problem, config, SM count as
  ``dot_product_attention`` resolves them), replaced by one into mutable
  outputs 16 rows longer than the padded query length, as
  properties/gpu/test_guard_band_gpu.py does."""
  import jax
  import jax.numpy as jnp
  from unittest import mock
  from kernel import api, experiments
  from kernel.forward import flash_attention_forward
  got = {}

  def record(problem, config, backward, num_sms):
    # copied padded: untiled copies write the output into a fresh array
    got.update(problem=problem.for_launch(config).replace(untiled_copies=False),
               config=config, num_sms=num_sms)
    return lambda *a: (None, (None, None))

  with mock.patch.object(api, "_differentiable", record), api.lowering_only():
    jax.eval_shape(lambda *a: experiments.dot_product_attention(*a, **kwargs), *args)

  def call(q, k, v):
    whole = []

    def guarded_launch(problem, config, q, k, v, *rest, **kw):
      B, _, N, _ = q.shape
      tile = 2 * config.block_q
      rows = -(-q.shape[1] // tile) * tile + 16
      refs = (jax.new_ref(jnp.full((B, rows, N, v.shape[3]), jnp.nan, q.dtype)),
              jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)),
              jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)))
      flash_attention_forward(problem, config, q, k, v, *rest, outputs=refs, **kw)
      whole.extend(r[...] for r in refs)
      return whole[0], tuple(whole[1:])

    with mock.patch.object(api, "flash_attention_forward", guarded_launch):
      api._forward.__wrapped__(got["problem"], got["config"], got["num_sms"],
                               q, k, v, None, None, None, None)
    return tuple(whole)

  return call


# The sharding rule's static argument prints the per-shard Python function it
# runs (a closure's qualified name, or a functools.partial with its keywords:
# the call record's fields); the program it makes is the traced jaxpr beside
# it, which is compared whole.
_LOCAL_FN = re.compile(r"Local\(fn=(?:functools\.partial\(<function \w+ at 0x[0-9A-Fa-fX]+>, .*?\)"
                       r"|<function [\w.<>]+ at 0x[0-9A-Fa-fX]+>), kind=")


def comparable(text: str) -> str:
  """``text`` without what is not the traced program: the Python function
  the sharding rule's static argument names (:data:`_LOCAL_FN`)."""
  return _LOCAL_FN.sub("Local(fn=..., kind=", text)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.tools.jaxpr_texts")
  parser.add_argument("paths", nargs="+", help="OUT.json, or with --compare: A.json B.json")
  parser.add_argument("--compare", action="store_true")
  args = parser.parse_args(argv)
  if args.compare:
    if len(args.paths) != 2:
      parser.error("--compare: expected two files")
    a, b = ({k: comparable(v) for k, v in json.load(open(p)).items()} for p in args.paths)
    shared = a.keys() & b.keys()
    differ = sorted(k for k in shared if a[k] != b[k])
    lost, new = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    print(f"{len(shared) - len(differ)} of {len(shared)} jaxprs identical; differ: "
          f"{differ or 'none'}" + (f"; only in {args.paths[0]}: {lost}" if lost else "")
          + (f"; new in {args.paths[1]}: {new}" if new else ""))
    return 1 if differ or lost else 0
  (path,) = args.paths
  out = {name: jaxpr_text(*spec) for name, spec in cases().items()}
  with open(path, "w") as fh:
    json.dump(out, fh, indent=0, sort_keys=True)
  print(f"{len(out)} jaxprs written to {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
