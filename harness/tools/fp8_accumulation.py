"""How Hopper's FP8 wgmma sums q·k: one 64 x 128 tile of S = Q K^T with
e4m3 operands and a float32 accumulator, as the forward issues it (one
wgmma over the whole head dim) and with one wgmma per 32 columns into
accumulators of their own, summed in float32, and by XLA's FP8 dot at its
default and its highest precision (no yardstick: it summed almost exactly
on the H200); each against float64 of the same e4m3 values, beside
the sum a model truncates to 12, 13 and 22 fraction bits after every 32
columns (harness/numerics/reference.py's ``tensor_core_products``).

The model's 12 bits, the rule's FP8_SUM_BITS, were read off this probe's
run on the H200 (docs/decisions/fp8-yardstick.md).

  python -m harness.tools.fp8_accumulation --out FILE.json   (an sm90 GPU)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

ROWS, KEYS, PART = 64, 128, 32   # one query tile by one key block; FP8 wgmma's K step


def _smem(shape, swizzle):
  import jax.numpy as jnp
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.SMEM(shape, jnp.float8_e4m3fn,
                    transforms=(plgpu.TilingTransform((8, swizzle)),
                                plgpu.SwizzleTransform(swizzle)))


def _swizzle(columns: int) -> int:
  return next(s for s in (128, 64, 32) if columns % s == 0)


def qk_whole(q, k):
  """S = q k^T (q: (64, D), k: (128, D), e4m3) by one wgmma over D."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  d = q.shape[1]
  sw = _swizzle(d)

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((ROWS, KEYS), jnp.float32),
                scratch_types=(_smem((ROWS, d), sw), _smem((KEYS, d), sw),
                               plgpu.SMEM((ROWS, KEYS), jnp.float32),
                               # one arrival per copy: a second on a one-arrival
                               # barrier underflows its count
                               plgpu.Barrier(num_arrivals=2)))
  def kernel(q_g, k_g, o_g, q_s, k_s, o_s, bar):
    plgpu.copy_gmem_to_smem(q_g, q_s, bar)
    plgpu.copy_gmem_to_smem(k_g, k_s, bar)
    plgpu.barrier_wait(bar)

    def product(acc):
      plgpu.wgmma(acc, q_s, k_s.T)
    o_s[...] = pl.run_state(product)(plgpu.ACC.init(jnp.zeros((ROWS, KEYS), jnp.float32)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g)
    plgpu.wait_smem_to_gmem(0)

  return kernel(q, k)


def qk_parts(q, k):
  """S = q k^T with one wgmma per 32 columns of D, each into an accumulator
  of its own, the parts summed in float32 registers."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  d = q.shape[1]
  parts = d // PART
  q_parts = q.reshape(ROWS, parts, PART).transpose(1, 0, 2)
  k_parts = k.reshape(KEYS, parts, PART).transpose(1, 0, 2)

  @plgpu.kernel(out_type=jax.ShapeDtypeStruct((ROWS, KEYS), jnp.float32),
                scratch_types=([_smem((ROWS, PART), PART) for _ in range(parts)],
                               [_smem((KEYS, PART), PART) for _ in range(parts)],
                               plgpu.SMEM((ROWS, KEYS), jnp.float32),
                               plgpu.Barrier(num_arrivals=2 * parts)))
  def kernel(q_g, k_g, o_g, q_s, k_s, o_s, bar):
    for c in range(parts):
      plgpu.copy_gmem_to_smem(q_g.at[c], q_s[c], bar)
      plgpu.copy_gmem_to_smem(k_g.at[c], k_s[c], bar)
    plgpu.barrier_wait(bar)
    total = None
    for c in range(parts):
      def product(acc, c=c):
        plgpu.wgmma(acc, q_s[c], k_s[c].T)
      part = pl.run_state(product)(plgpu.ACC.init(jnp.zeros((ROWS, KEYS), jnp.float32)))
      total = part if total is None else total + part
    o_s[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g)
    plgpu.wait_smem_to_gmem(0)

  return kernel(q_parts, k_parts)


def qk_xla(q, k, precision=None):
  """S = q k^T by XLA's FP8 dot (e4m3 operands, float32 result), measured
  beside the wgmma: on the H200 it sums almost exactly, so the rule's
  yardstick is the model instead (docs/decisions/fp8-yardstick.md).
  ``precision`` is XLA's precision config (cuBLASLt's FP8 fast
  accumulation follows it)."""
  import jax
  import jax.numpy as jnp
  return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def truncated_sum(q8, k8, bits: int) -> np.ndarray:
  """q k^T in float64, the running sum cut to ``bits`` fraction bits (toward
  zero) after every 32 columns."""
  acc = np.zeros((q8.shape[0], k8.shape[0]))
  for c in range(0, q8.shape[1], PART):
    acc = acc + q8[:, c:c + PART].astype(np.float64) @ k8[:, c:c + PART].astype(np.float64).T
    mant, exp = np.frexp(acc)
    acc = np.trunc(mant * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1) * 2.0 ** exp
  return acc


def operands(kind: str, head_dim: int, rng) -> tuple[np.ndarray, np.ndarray]:
  """e4m3 q (64, D) and k (128, D): ``normal``, ``one-hot`` (one large
  entry per query row, as docs/fp8/accuracy.md's one-hot-rows case) or
  ``wide`` (large entries of both signs)."""
  import ml_dtypes
  if kind == "normal":
    q, k = rng.standard_normal((ROWS, head_dim)) * 4, rng.standard_normal((KEYS, head_dim)) * 4
  elif kind == "one-hot":
    q = rng.standard_normal((ROWS, head_dim)) * 0.5
    q[np.arange(ROWS), rng.integers(0, head_dim, ROWS)] = 400.0
    k = rng.standard_normal((KEYS, head_dim)) * 8
  elif kind == "wide":
    q, k = rng.standard_normal((ROWS, head_dim)) * 100, rng.standard_normal((KEYS, head_dim)) * 100
  else:
    raise ValueError(f"kind: expected normal, one-hot or wide, got {kind!r}")
  f8 = ml_dtypes.float8_e4m3fn
  # e4m3fn has no infinity: past 448 a cast gives NaN
  return np.clip(q, -448, 448).astype(f8), np.clip(k, -448, 448).astype(f8)


def measure(head_dims=(64, 128, 256), kinds=("normal", "one-hot", "wide"), seed=0) -> list[dict]:
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  rows = []
  for d in head_dims:
    for kind in kinds:
      q8, k8 = operands(kind, d, rng)
      exact = q8.astype(np.float64) @ k8.astype(np.float64).T
      row = {"head_dim": d, "data": kind, "max |s|": float(np.abs(exact).max())}
      xla = lambda precision: lambda q, k: qk_xla(q, k, precision)
      for name, fn in (("whole", qk_whole), ("parts of 32", qk_parts),
                       ("xla default", xla(None)), ("xla highest", xla("highest"))):
        s = np.asarray(jax.jit(fn)(jnp.asarray(q8), jnp.asarray(k8)), np.float64)
        row[f"{name}: max error"] = float(np.abs(s - exact).max())
      for bits in (12, 13, 22):
        row[f"model, {bits} bits: max error"] = float(
            np.abs(truncated_sum(q8, k8, bits) - exact).max())
      rows.append(row)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="write the rows as JSON here too")
  args = parser.parse_args(argv)
  import jax
  from kernel import api
  if api.sm90_device() is None:
    print("fp8_accumulation: needs an sm90 GPU (FP8 wgmma)", file=sys.stderr)
    return 2
  from harness.tools.gate import provenance
  rows = measure()
  # jax, commit and date as the gate's summaries name them
  record = {"device": jax.devices()[0].device_kind, "provenance": provenance(), "rows": rows}
  for row in rows:
    print(json.dumps(row))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
