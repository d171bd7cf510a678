"""Forward TFLOP/s of the kernel side by side with cuDNN, in one process.

``python -m harness.bench [--shapes default|quick] [--out results.json]``

Method (METHOD.md of the device notes): random normal inputs (never zeros),
several input sets rotated so repeated calls do not measure the L2 cache,
warm-up calls excluded, each trial times a burst of calls between two
``block_until_ready`` and the reported time is the median over trials.
FLOPs = 4 * B * N * T * S * D, half of it when causal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchShape:
  batch: int
  seq: int
  heads: int
  head_dim: int
  causal: bool
  dtype: str = "bfloat16"

  @property
  def flops(self) -> float:
    f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
    return f / 2 if self.causal else f


DEFAULT_SHAPES = (
    BenchShape(4, 4096, 16, 128, False),   # the headline shape
    BenchShape(4, 4096, 16, 128, True),
    BenchShape(16, 1024, 16, 128, False),
    BenchShape(1, 16384, 16, 128, False),
    BenchShape(4, 4096, 32, 64, False),
    BenchShape(4, 4096, 8, 256, False),
)


def _inputs(shape: BenchShape, sets: int, seed: int = 0):
  key = jax.random.PRNGKey(seed)
  dtype = jnp.dtype(shape.dtype)
  out = []
  for i in range(sets):
    kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
    dims = (shape.batch, shape.seq, shape.heads, shape.head_dim)
    out.append(tuple(jax.random.normal(k_, dims, jnp.float32).astype(dtype)
                     for k_ in (kq, kk, kv)))
  return out


def time_fn(fn, input_sets, *, warmup: int = 3, trials: int = 15, burst: int = 5) -> float:
  """Median seconds per call."""
  for i in range(warmup):
    jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
  samples = []
  for t in range(trials):
    start = time.perf_counter()
    for j in range(burst):
      r = fn(*input_sets[(t * burst + j) % len(input_sets)])
    jax.block_until_ready(r)
    samples.append((time.perf_counter() - start) / burst)
  return statistics.median(samples)


def bench_shape(shape: BenchShape, config=None, sets: int = 3) -> dict:
  from kernel import api
  inputs = _inputs(shape, sets)
  ours = jax.jit(lambda q, k, v: api.dot_product_attention(q, k, v, is_causal=shape.causal,
                                                           config=config))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=shape.causal, implementation="cudnn"))
  row = dataclasses.asdict(shape)
  for name, fn in (("ours", ours), ("cudnn", cudnn)):
    try:
      seconds = time_fn(fn, inputs)
      row[f"{name}_ms"] = seconds * 1e3
      row[f"{name}_tflops"] = shape.flops / seconds / 1e12
    except Exception as err:  # cuDNN may refuse a shape; say so in the table
      row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
  return row


def render(rows: list[dict]) -> str:
  lines = ["| B | seq | heads | D | causal | ours TFLOP/s | cuDNN TFLOP/s | ours/cuDNN |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ours, cudnn = r.get("ours_tflops"), r.get("cudnn_tflops")
    ratio = f"{ours / cudnn:.3f}" if ours and cudnn else "-"
    fmt = lambda x, k: f"{x:.1f}" if x else r.get(f"{k}_error", "-")
    lines.append(f"| {r['batch']} | {r['seq']} | {r['heads']} | {r['head_dim']} | "
                 f"{r['causal']} | {fmt(ours, 'ours')} | {fmt(cudnn, 'cudnn')} | {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.bench")
  parser.add_argument("--shapes", choices=("default", "headline"), default="default")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  shapes = DEFAULT_SHAPES if args.shapes == "default" else DEFAULT_SHAPES[:1]
  rows = [bench_shape(s) for s in shapes]
  dev = jax.devices()[0]
  meta = {"device": dev.device_kind, "jax": jax.__version__, "rows": rows}
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(meta, fh, indent=1)
  print(f"device {dev.device_kind}, jax {jax.__version__}")
  print(render(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
