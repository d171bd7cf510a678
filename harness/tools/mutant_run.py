"""Run the kernel of this tree on case sets built to expose known defects.

``python -m harness.tools.mutant_run SET`` prints one JSON line per case:
``{"case": ..., "passed": bool, "detail": ..., "arrays": {name: passed}}``
and exits 0 once every case has run, whatever the verdicts.  The tests of
properties/gpu/test_mutants_gpu.py run it in a patched copy of the package
(harness/tools/mutants.py) and in the shipped one, in child processes under a time
limit: a mutant may hang the GPU (a producer that no longer waits can leave a
consumer waiting on a fill that never comes), and a timeout or a crash counts
as the mutant being caught.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def carry_cases():
  """Persistent cases with several tiles per SM and trip counts that vary
  from tile to tile, are not multiples of num_stages, and include zero:
  the cases a missing prev_iters carry breaks (GUIDE, first bug class)."""
  from harness.numerics.conformance import random_case
  from kernel.tiling.config import Config
  rng = np.random.default_rng(2674)
  big = dict(batch=4, heads=8, kv_heads=2, head_dim=64)
  cases = []
  c = random_case(rng, seq_q=2048, seq_kv=384, **big)           # 3 blocks a tile
  cases.append(("3-blocks-per-tile", c, Config(64, 128, 2, True)))
  c = random_case(rng, seq_q=2048, seq_kv=2048, is_causal=True, **big)  # 1..16
  cases.append(("causal-1-to-16", c, Config(64, 128, 2, True)))
  c = random_case(rng, seq_q=1536, seq_kv=1536, is_causal=True, **big)
  cases.append(("causal-3-stages", c, Config(64, 64, 3, True)))
  c = random_case(rng, seq_q=2048, seq_kv=1024, **big)
  t = c.query.shape[1]
  # Per tile of 128 rows a random key range; every third tile empty.
  tile_start = rng.integers(0, 1024, (4, 8, t // 128))
  tile_len = rng.integers(1, 700, (4, 8, t // 128))
  # An empty tile must visit no key block (lb == ub): its range starts and
  # ends on a block boundary (an unaligned empty range still visits the
  # block it falls in, all masked, and is no empty tile).
  tile_len[:, :, ::3] = 0
  tile_start[:, :, ::3] = 128 * rng.integers(0, 8, tile_start[:, :, ::3].shape)
  c = c.replace(k_start=np.repeat(tile_start, 128, axis=2).astype(np.int32),
                k_end=np.repeat(np.minimum(tile_start + tile_len, 1024), 128,
                                axis=2).astype(np.int32))
  cases.append(("key-ranges-with-empty-tiles", c, Config(64, 128, 2, True)))
  return cases


def residual_cases():
  """A plain case where only the base of the m residual can go wrong."""
  from harness.numerics.conformance import random_case
  c = random_case(np.random.default_rng(3), seq_q=256, seq_kv=512, heads=2, kv_heads=1,
                  head_dim=128)
  return [("plain-d128", c, None)]


def gradient_cases():
  """A plain case for the gradients through the kernel's custom_vjp."""
  from harness.numerics import strategies as hs
  spec = hs.CaseSpec(shapes=hs.AttentionShapes(B=1, T=256, N=2, H=64, S=384, K=1, Hv=64),
                     dtype="bfloat16", seed=9, input_std=2.0)
  return [("plain-d64-gradients", hs.build_case(spec), None)]


CASE_SETS = {"carry": carry_cases, "residuals": residual_cases, "gradients": gradient_cases}


def _forward_line(name, case, config):
  from harness.numerics.conformance import check_forward, poison_device_memory, run_kernel
  poison_device_memory(4 * case.query.nbytes)
  out, m, l = run_kernel(case, config=config)
  report = check_forward(case, out, m, l)
  arrays = {a: getattr(report, a).passed for a in ("out", "m", "l")}
  return dict(case=name, passed=report.passed, detail=report.summary(), arrays=arrays)


def _gradient_line(name, case, config):
  import jax
  import jax.numpy as jnp
  from harness.numerics.conformance import gradient_reports
  from kernel import api
  kw = case.kwargs
  d_out = jnp.asarray(case.d_out, jnp.float32)

  def loss(q, k, v):
    out = api.dot_product_attention(q, k, v, scale=kw["scale"], is_causal=kw["is_causal"],
                                    logits_soft_cap=kw["logits_soft_cap"], config=config)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  got = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in case.args[:3]))
  got = [np.asarray(g.astype(jnp.float32), np.float64) for g in got] + [None]
  reports = gradient_reports(case, got)
  arrays = {r.name: bool(r.passed) for r in reports}
  return dict(case=name, passed=all(arrays.values()), arrays=arrays,
              detail="; ".join(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}"
                               for r in reports))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.tools.mutant_run")
  parser.add_argument("cases", choices=sorted(CASE_SETS))
  args = parser.parse_args(argv)
  run = _gradient_line if args.cases == "gradients" else _forward_line
  for name, case, config in CASE_SETS[args.cases]():
    try:
      line = run(name, case, config)
    except Exception as err:  # a crash is a caught mutant too
      line = dict(case=name, passed=False, detail=f"{type(err).__name__}: {err}"[:300])
    print(json.dumps(line), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
