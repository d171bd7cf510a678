"""A fixed list of forward cases run on the GPU: the quick self-check.

``python -m harness.tools.device_check [--out FILE.json]``

Each case: poison, run the kernel, compare out/m/l with float64 under the
tolerance rule, run again and require bitwise-identical output.  Prints one
row per case and exits non-zero on any failure.  The Hypothesis properties in
``properties/gpu/test_forward_gpu.py`` draw far more cases; this list is the
named, reproducible core (the FlashAttention suites' ragged shapes included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def fixed_cases():
  """(name, case-builder kwargs, config) triples."""
  from kernel.tiling.config import Config
  rng_cases = [
      ("basic-d64", dict(seq_q=256, seq_kv=256, heads=2, kv_heads=1, head_dim=64), None),
      ("d128-gqa", dict(batch=2, seq_q=1024, seq_kv=1024, heads=4, kv_heads=2, head_dim=128), None),
      ("causal-1024", dict(seq_q=1024, seq_kv=1024, heads=2, kv_heads=2, head_dim=128, is_causal=True), None),
      ("ragged-113x203-d72-dv96", dict(seq_q=113, seq_kv=203, head_dim=72, head_dim_out=96), None),
      ("ragged-239x1", dict(seq_q=239, seq_kv=1, head_dim=64), None),
      # Head dims in 32-column rows (kernel.tiling.plan.padded_head_dims): 96 at its
      # own width, causal with GQA; 80 computed at 96; 32 at 64.
      ("d96-causal-gqa-1000", dict(batch=2, seq_q=1000, seq_kv=1000, heads=4, kv_heads=2,
                                   head_dim=96, is_causal=True), None),
      ("d32-ragged-300x700", dict(seq_q=300, seq_kv=700, heads=2, head_dim=32), None),
      ("d80-dv64-512", dict(seq_q=512, seq_kv=512, head_dim=80, head_dim_out=64), None),
      ("ragged-1023x1024-causal", dict(seq_q=1023, seq_kv=1024, head_dim=128, is_causal=True), None),
      ("single-1x1-f32", dict(seq_q=1, seq_kv=1, head_dim=64, dtype="float32"), None),
      ("f16-d256-bkv64", dict(seq_q=512, seq_kv=384, head_dim=256, dtype="float16"), Config(64, 64, 2)),
      ("bq128-3stages", dict(seq_q=512, seq_kv=1024, heads=2, head_dim=128), Config(128, 64, 3)),
      ("4stages-bkv64", dict(seq_q=300, seq_kv=700, head_dim=64), Config(64, 64, 4)),
      ("threshold-0", dict(seq_q=256, seq_kv=1024, head_dim=64, rescale_threshold=0.0), None),
      ("f16-threshold-0", dict(seq_q=256, seq_kv=1024, head_dim=64, dtype="float16",
                               rescale_threshold=0.0), None),
      ("threshold-tiny", dict(seq_q=256, seq_kv=1024, head_dim=64, rescale_threshold=1e-30), None),
      ("threshold-0.5-unnormalised", dict(seq_q=256, seq_kv=1024, head_dim=64, rescale_threshold=0.5,
                                          normalize_output=False), None),
      ("threshold-below-1", dict(seq_q=256, seq_kv=512, head_dim=128,
                                 rescale_threshold=float(np.nextafter(1.0, 0.0))), None),
      # Lengths that are multiples of 8 but of no block: read unpadded by TMA
      # (zeros past the end, stores clipped), causal and GQA.
      ("ragged-1000-causal-gqa", dict(batch=2, seq_q=1000, seq_kv=1000, heads=4, kv_heads=2,
                                      head_dim=128, is_causal=True), None),
      ("ragged-776x1304-d64", dict(seq_q=776, seq_kv=1304, heads=2, kv_heads=1, head_dim=64), None),
      ("ragged-1000x3000-causal-d256", dict(seq_q=1000, seq_kv=3000, head_dim=256,
                                            is_causal=True), None),
      ("softcap-scale", dict(seq_q=256, seq_kv=256, head_dim=128, logits_soft_cap=5.0, scale=0.5), None),
      # A negative scale through unmasked key blocks: the row max is then the
      # scaled minimum of the raw logits (a defect there once gave wrong m
      # and l while the normalised output stayed right).
      ("negative-scale", dict(seq_q=256, seq_kv=1024, head_dim=64, scale=-0.2), None),
      ("negative-scale-threshold-0.5", dict(seq_q=256, seq_kv=1024, head_dim=64, scale=-0.2,
                                            rescale_threshold=0.5), None),
      # The split tail (kernel/tiling/schedule.py): 288 tiles on 132 SMs, one wave
      # whole and the rest cut into pieces; fewer tiles than SMs, every tile
      # cut (three compute warpgroups; head dim 256, whose output is staged
      # in the query slot, unnormalised under a threshold).
      ("split-tail-d128-gqa", dict(seq_q=2200, seq_kv=2200, heads=16, kv_heads=4, head_dim=128),
       Config(64, 128, 2, True, "split-tail")),
      ("split-tail-d64-three-warpgroups", dict(batch=2, seq_q=1000, seq_kv=1000, heads=6,
                                               kv_heads=2, head_dim=64),
       Config(64, 128, 2, True, "split-tail", 3)),
      ("split-tail-d256-threshold-0.5-unnormalised",
       dict(seq_q=700, seq_kv=900, heads=4, kv_heads=4, head_dim=256, rescale_threshold=0.5,
            normalize_output=False), Config(64, 64, 2, True, "split-tail")),
  ]
  return rng_cases


def extra_cases(rng):
  """Cases with bias, masks and key ranges (arrays drawn here)."""
  from harness.numerics.conformance import random_case
  out = []
  b, t, s, n = 2, 256, 384, 2
  base = dict(batch=b, seq_q=t, seq_kv=s, heads=n, kv_heads=1, head_dim=64)
  c = random_case(rng, **base)
  c = c.replace(bias=rng.standard_normal((b, n, t, s)).astype(c.query.dtype))
  out.append(("bias-full", c, None))
  c = random_case(rng, **base)
  c = c.replace(bias=rng.standard_normal((1, 1, 1, s)).astype(np.float32))
  out.append(("bias-row-f32", c, None))
  c = random_case(rng, **base)
  c = c.replace(bias=rng.standard_normal((b, 1, t, 1)).astype(c.query.dtype))
  out.append(("bias-col", c, None))
  c = random_case(rng, **base)
  c = c.replace(mask=rng.random((b, 1, t, s)) < 0.7)
  c.mask[:, :, 5, :] = False  # a fully masked row
  out.append(("mask-2d-with-empty-row", c, None))
  c = random_case(rng, **base)
  c = c.replace(mask=rng.random((s,)) < 0.5)
  out.append(("mask-keys-only", c, None))
  c = random_case(rng, **base)
  c = c.replace(k_start=rng.integers(0, s, (b, n, t)).astype(np.int32))
  c = c.replace(k_end=(c.k_start + rng.integers(-20, s, (b, n, t))).astype(np.int32))  # some empty
  out.append(("key-ranges-with-empty", c, None))
  from kernel.tiling.config import Config
  c = random_case(rng, **base)
  c = c.replace(k_start=rng.integers(0, s, (b, n, t)).astype(np.int32))
  c = c.replace(k_end=(c.k_start + rng.integers(-20, s, (b, n, t))).astype(np.int32))  # some empty
  out.append(("split-tail-key-ranges-with-empty", c, Config(64, 64, 2, True, "split-tail")))
  c = random_case(rng, **base, is_causal=True)
  c = c.replace(k_end=np.array([200], np.int32))
  c = c.replace(bias=rng.standard_normal((b, n, t, s)).astype(c.query.dtype))
  c = c.replace(logits_soft_cap=10.0)
  c = c.replace(rescale_threshold=0.25)
  out.append(("causal-kend-bias-softcap-threshold", c, None))
  return out


def _variant(cfg, variant: str, case):
  """The config a case runs under for one variant of the sweep."""
  import dataclasses
  from kernel.tiling import heuristics
  if variant == "as-is":
    return cfg
  if cfg is None:
    cfg = heuristics.get_heuristics_config(problem_of(case))
  persistent = variant == "persistent"
  schedule = cfg.schedule if persistent or cfg.schedule != "split-tail" else "round-robin"
  return dataclasses.replace(cfg, persistent=persistent, schedule=schedule)


def problem_of(case):
  from kernel.tiling import plan
  return plan.problem_of_shapes(case.query.shape, case.key.shape, case.value.shape,
                                case.query.dtype, is_causal=case.is_causal,
                                return_residuals=True)


def emitted_configs(call) -> list:
  """Every config the heuristics and the autotuner could hand this call."""
  from kernel.tiling import heuristics
  problem = problem_of(call)
  configs = {heuristics.get_heuristics_config(problem)}
  configs.update(heuristics.get_autotuning_configs(problem))
  return sorted(configs, key=str)


def selected(cases, select=()):
  """The (name, ...) cases whose name holds one of ``select``'s substrings
  (every case when ``select`` is empty); refuses a selection that keeps none."""
  if not select:
    return list(cases)
  kept = [c for c in cases if any(part in c[0] for part in select)]
  if not kept:
    raise SystemExit(f"--select: no case name holds any of {list(select)}")
  return kept


def run(out_path: str | None = None, variants=("as-is",), select=()) -> int:
  """Run the cases (only those whose name holds one of ``select``'s
  substrings, where given) under each variant; 1 if any failed."""
  import jax
  from harness.numerics.conformance import check_forward, poison_device_memory, random_case, run_kernel
  rng = np.random.default_rng(2026)
  cases = [(n, random_case(rng, **kw), cfg) for n, kw, cfg in fixed_cases()]
  cases += extra_cases(rng)
  cases = selected(cases, select)
  rows, failures = [], 0
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
  from kernel.tiling import plan
  swept = []
  for name, case, cfg in cases:
    for v in variants:
      vcfg = _variant(cfg, v, case)
      # A variant that does not fit in shared memory is not a case (the
      # refusal itself is tested on the CPU).
      if vcfg is None or plan.config_fits(problem_of(case), vcfg):
        swept.append((f"{name}[{v}]", case, vcfg))
  cases = swept
  for name, case, cfg in cases:
    start = time.time()
    try:
      poison_device_memory(case.query.nbytes * 4)
      out, m, l = run_kernel(case, config=cfg)
      rep = check_forward(case, out, m, l)
      out2, _, _ = run_kernel(case, config=cfg)
      bitwise = bool(np.array_equal(out, out2, equal_nan=True))
      nan = bool(np.isnan(out).any())
      ok = rep.passed and bitwise
      row = dict(case=name, passed=ok, bitwise=bitwise, any_nan=nan,
                 worst_ratio=rep.worst_ratio(), detail=rep.summary())
    except Exception as err:
      ok = False
      row = dict(case=name, passed=False, error=f"{type(err).__name__}: {str(err)[:2000]}")
    row["seconds"] = round(time.time() - start, 2)
    failures += not ok
    rows.append(row)
    print(("PASS " if ok else "FAIL ") + json.dumps(row), flush=True)
  if out_path:
    with open(out_path, "w") as fh:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "rows": rows}, fh, indent=1)
  print(f"{len(rows) - failures} passed, {failures} failed")
  return 1 if failures else 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m harness.tools.device_check")
  p.add_argument("--out", default=None)
  p.add_argument("--variants", default="as-is",
                 help="comma list of as-is, persistent, non-persistent")
  p.add_argument("--select", default="",
                 help="comma list of substrings: only the cases whose name holds one")
  a = p.parse_args(argv)
  return run(a.out, tuple(a.variants.split(",")),
             tuple(part for part in a.select.split(",") if part))


if __name__ == "__main__":
  sys.exit(main())
