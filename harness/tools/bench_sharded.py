"""Per-device TFLOP/s of a batch-sharded run against one GPU at the same
per-device shape.

``python -m harness.tools.bench_sharded [--batch-per-device 4] [--seq 4096] [--heads 16]
[--head-dim 128] [--causal] [--backward] [--out results.json]``

Every visible GPU holds ``--batch-per-device`` sequences of a batch sharded
over a one-axis mesh (``kernel/sharding.py`` runs each device's kernels on its
shard); the single-device row runs that per-device shape on the first GPU
alone.  Per-device TFLOP/s of the sharded run is its FLOPs over its time,
divided by the device count; the ratio of the two is what the mesh costs
(issue 21 asks >= 0.95).  Method and FLOP count as ``harness.tools.bench``
(interleaved trials, rotated input sets, medians; forward + backward counted
as 3.5x the forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from harness.tools.bench import BACKWARD_FLOP_FACTOR, BenchShape, _inputs, _with_backward, time_fns

SETS = 3


def _attention(is_causal):
  from kernel import api
  return lambda q, k, v, bias=None: api.dot_product_attention(q, k, v, bias,
                                                              is_causal=is_causal)


def _argument_sets(shape: BenchShape, backward: bool, place):
  sets = []
  for i, (q, k, v) in enumerate(_inputs(shape, SETS)):
    args = (q, k, v)
    if backward:
      d_out = jax.random.normal(jax.random.PRNGKey(1000 + i), q.shape, jnp.float32)
      args = (q, k, v, None, d_out)
    sets.append(tuple(None if a is None else place(a) for a in args))
  return sets


def measure(per_device: BenchShape, *, backward: bool = False) -> dict:
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("data",))
  sharded_shape = dataclasses.replace(per_device, batch=per_device.batch * n)
  attention = _attention(per_device.causal)
  fn = jax.jit(_with_backward(attention) if backward else attention)
  single = _argument_sets(per_device, backward, lambda a: jax.device_put(a, devices[0]))
  batch_sharded = NamedSharding(mesh, P("data"))
  sharded = _argument_sets(sharded_shape, backward, lambda a: jax.device_put(a, batch_sharded))
  # time_fns gives every function the same arguments: an index into each
  # function's own input sets (the look-up is host work hidden by the burst).
  seconds = time_fns({"single": lambda i: fn(*single[i]),
                      "sharded": lambda i: fn(*sharded[i])}, [(i,) for i in range(SETS)])
  factor = BACKWARD_FLOP_FACTOR if backward else 1.0
  single_tflops = factor * per_device.flops / seconds["single"] / 1e12
  sharded_tflops = factor * sharded_shape.flops / seconds["sharded"] / 1e12 / n
  return {"devices": n, "device": devices[0].device_kind, "jax": jax.__version__,
          "per_device_shape": dataclasses.asdict(per_device),
          "pass": "forward+backward" if backward else "forward",
          "single_ms": seconds["single"] * 1e3, "sharded_ms": seconds["sharded"] * 1e3,
          "single_tflops": single_tflops, "sharded_tflops_per_device": sharded_tflops,
          "ratio": sharded_tflops / single_tflops}


def render(r: dict) -> str:
  s = r["per_device_shape"]
  return "\n".join([
      f"device {r['device']} x {r['devices']}, jax {r['jax']}, {r['pass']}",
      "| per-device B | seq | heads | D | causal | single TFLOP/s | sharded TFLOP/s per device | ratio |",
      "|---|---|---|---|---|---|---|---|",
      f"| {s['batch']} | {s['seq']} | {s['heads']} | {s['head_dim']} | {s['causal']} | "
      f"{r['single_tflops']:.1f} | {r['sharded_tflops_per_device']:.1f} | {r['ratio']:.3f} |"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.tools.bench_sharded")
  parser.add_argument("--batch-per-device", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--backward", action="store_true",
                      help="time forward + backward (jax.grad), counted as 3.5x the forward FLOPs")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  shape = BenchShape(args.batch_per_device, args.seq, args.heads, args.head_dim, args.causal)
  result = measure(shape, backward=args.backward)
  print(render(result))
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
