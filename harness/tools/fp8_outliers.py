"""FlashAttention-3's outlier experiment, on an sm90 GPU: ``docs/fp8/outliers.md``.

  python -m harness.tools.fp8_outliers --out docs/fp8   (an sm90 GPU; about a minute at most)

q, k and v are drawn as N(0, 1) + N(0, 100)·Bernoulli(0.001) (the outliers'
variance 100: standard deviation 10), rounded to float32, at batch 1, 4096
queries and keys, 8 heads, head dim 128, not causal (``--seq``, ``--heads``,
``--head-dim``, ``--seed``).  Each route attends to the same float32 values,
and its output's RMSE is taken against attention in float64 of those
values (``harness.numerics.reference.attention_reference``, one head at a
time: a few seconds on the GPU host's CPU):

- ours in FP8, quantised by ``kernel.fp8.quantize_qkv`` per tensor and per
  (batch, kv head), each without and with the rotation (one random-sign
  Hadamard rotation of q and k, from ``--seed``);
- cuDNN's FP8 attention (``harness.tools.bench_fp8``'s route; per-tensor
  descales only), on the same per-tensor e4m3 inputs and on the rotated
  ones.  Its output is e4m3, all it offers, scaled by the power of two that
  brings the float64 output's amax closest under 448 (what delayed output
  scaling converges to), read back as float32 divided by that scale;
- ours in bfloat16, unquantised, for the floor.

FlashAttention-3's paper reports 2.4e-2 for plain FP8 attention and 9.1e-3
for its FP8 with block quantisation and the rotation (at its own shape).
The targets (#70): ours with the rotation at most 9.1e-3 and at
most cuDNN's FP8 on the same inputs.  Writes ``outliers.json`` and
``outliers.md`` in ``--out``; without an sm90 GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

OUTLIER_P, OUTLIER_STD = 0.001, 10.0
SHAPE = dict(batch=1, seq=4096, heads=8, head_dim=128)
PAPER = (("FlashAttention-3 paper: plain FP8 attention", 2.4e-2),
         ("FlashAttention-3 paper: FP8 with block quantisation and the rotation", 9.1e-3))
TARGET = 9.1e-3
# (name, per, rotated): ours in FP8.
OURS = (("ours fp8 per tensor", "tensor", False), ("ours fp8 per tensor, rotated", "tensor", True),
        ("ours fp8 per head", "head", False), ("ours fp8 per head, rotated", "head", True))
# (name, rotated): cuDNN's FP8 route, per tensor.
CUDNN = (("cuDNN fp8 per tensor", False), ("cuDNN fp8 per tensor, rotated", True))
BF16 = "ours bf16, unquantised"
COMMAND = "python -m harness.tools.fp8_outliers --out docs/fp8"


def draw(shape, rng: np.random.Generator) -> np.ndarray:
  """N(0, 1) + N(0, 100)·Bernoulli(0.001), rounded to float32."""
  x = rng.standard_normal(shape)
  outliers = rng.random(shape) < OUTLIER_P
  return (x + OUTLIER_STD * rng.standard_normal(shape) * outliers).astype(np.float32)


def inputs(seed: int, batch: int, seq: int, heads: int, head_dim: int):
  """(q, k, v), each (batch, seq, heads, head_dim) float32."""
  rng = np.random.default_rng(seed)
  return tuple(draw((batch, seq, heads, head_dim), rng) for _ in range(3))


def reference(q, k, v) -> np.ndarray:
  """Attention in float64 of (q, k, v), one head at a time so that the
  logits of one (seq x seq) head are all that is held."""
  from harness.numerics.reference import attention_reference
  f64 = lambda x: np.asarray(x, np.float64)
  return np.concatenate([attention_reference(f64(q[:, :, h:h + 1]), f64(k[:, :, h:h + 1]),
                                             f64(v[:, :, h:h + 1])).out
                         for h in range(q.shape[2])], axis=2)


def rmse(out, ref) -> float:
  return float(np.sqrt(np.mean((np.asarray(out, np.float64) - ref) ** 2)))


def output_scale(ref) -> float:
  """The power of two that brings ``ref``'s amax closest under e4m3's 448."""
  amax = float(np.abs(ref).max())
  return float(2.0 ** np.floor(np.log2(448.0 / amax))) if amax > 0 else 1.0


def ours(per: str, rotated: bool, seed: int):
  """Ours in FP8, quantised inside the jitted call: float32 (q, k, v) -> float32 out."""
  import jax
  import jax.numpy as jnp
  from kernel import api, fp8
  rotation = jax.random.key(seed) if rotated else None

  def run(q, k, v):
    q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, per, rotation=rotation)
    return api.dot_product_attention(q8, k8, v8, **descales).astype(jnp.float32)
  return jax.jit(run)


def ours_bf16():
  import jax
  import jax.numpy as jnp
  from kernel import api
  bf = lambda x: x.astype(jnp.bfloat16)
  return jax.jit(lambda q, k, v: api.dot_product_attention(bf(q), bf(k), bf(v))
                 .astype(jnp.float32))


def cudnn(q, k, v, *, rotated: bool, seed: int, scale_o: float) -> np.ndarray:
  """cuDNN's FP8 route on ``quantize_qkv``'s per-tensor inputs, read back as float32."""
  import jax
  import jax.numpy as jnp
  from harness.tools import bench_fp8, bench_grid
  from kernel import fp8
  rotation = jax.random.key(seed) if rotated else None
  q8, k8, v8, d = jax.jit(lambda q, k, v: fp8.quantize_qkv(q, k, v, "tensor",
                                                           rotation=rotation))(q, k, v)
  run = bench_fp8._cudnn_fp8(bench_grid.Point(q.shape[-1], q.shape[1], False),
                             descales=(d["q_descale"], d["k_descale"], d["v_descale"]),
                             scale_o=scale_o)
  out8 = jax.jit(run)(q8, k8, v8)
  return np.asarray(out8.astype(jnp.float32)) / scale_o


def measure(seed: int, batch: int, seq: int, heads: int, head_dim: int, log=print) -> dict:
  """The record: the shape, the seed and one row per route (its RMSE, or why it did not run)."""
  import jax.numpy as jnp
  q, k, v = inputs(seed, batch, seq, heads, head_dim)
  ref = reference(q, k, v)
  scale_o = output_scale(ref)
  args = tuple(jnp.asarray(x) for x in (q, k, v))
  routes = [(name, lambda per=per, rot=rot: ours(per, rot, seed)(*args), per, rot)
            for name, per, rot in OURS]
  routes += [(name, lambda rot=rot: cudnn(*args, rotated=rot, seed=seed, scale_o=scale_o),
              "tensor", rot) for name, rot in CUDNN]
  routes.append((BF16, lambda: ours_bf16()(*args), None, False))
  rows = []
  for name, run, per, rotated in routes:
    row = dict(route=name, descales=per, rotated=rotated)
    try:
      out = np.asarray(run())
      row["rmse"] = rmse(out, ref)
    except Exception as e:  # noqa: BLE001 -- a route that cannot run is a row that says why
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    log(json.dumps(row), flush=True)
    rows.append(row)
  return dict(seed=seed, shape=dict(batch=batch, seq=seq, heads=heads, head_dim=head_dim),
              outlier_p=OUTLIER_P, outlier_std=OUTLIER_STD, cudnn_scale_o=scale_o, rows=rows)


def _rmse_of(record, name):
  return next((r.get("rmse") for r in record["rows"] if r["route"] == name), None)


def targets(record) -> list[str]:
  """Each rotated row of ours against FlashAttention-3's 9.1e-3 and cuDNN's FP8."""
  theirs = _rmse_of(record, CUDNN[0][0])
  lines = []
  for name, _, rotated in OURS:
    if not rotated:
      continue
    got = _rmse_of(record, name)
    if got is None:
      lines.append(f"- {name}: not run")
      continue
    vs_cudnn = (": not run" if theirs is None else
                f" ({theirs:.2e}) {'met' if got <= theirs else 'NOT met'}")
    lines.append(f"- {name} ({got:.2e}): ≤ {TARGET:.1e} "
                 f"{'met' if got <= TARGET else 'NOT met'}; ≤ {CUDNN[0][0]}{vs_cudnn}")
  return lines


INTRO = [
    "# FP8 attention with outliers",
    "",
    "FlashAttention-3's numerical-error experiment: q, k, v ~ N(0, 1) + "
    "N(0, 100)·Bernoulli(0.001) (the outliers' standard deviation 10), and the RMSE of "
    "each route's output against attention in float64 of the same, unquantised inputs.  "
    "Ours quantises with `kernel.fp8.quantize_qkv` per tensor or per (batch, kv head), "
    "with and without the rotation of q and k (`kernel.fp8.rotate`, a random-sign "
    "Hadamard rotation); cuDNN's FP8 attention takes per-tensor descales only and "
    "writes e4m3.  `harness/tools/fp8_outliers.py` says how each is run.",
    "",
]


def render(record: dict | None) -> str:
  """The page: the experiment, then the table of ``record``, or where none is
  measured yet, the command that fills it."""
  lines = list(INTRO)
  if record is None:
    return "\n".join(lines + [f"Not measured yet: `{COMMAND}` on an sm90 GPU fills the "
                              f"table.", ""])
  shape = record["shape"]
  lines += [f"Generated by `{record['command']}` on {record['device']}, "
            f"{record['provenance']}.  Do not edit: run the command again.", "",
            f"Batch {shape['batch']}, {shape['seq']} queries and keys, {shape['heads']} heads, "
            f"head dim {shape['head_dim']}, not causal, seed {record['seed']}; cuDNN's output "
            f"scale {record['cudnn_scale_o']:g}.", "",
            "| route | descales | rotation | RMSE |", "|---|---|---|---|"]
  for r in record["rows"]:
    value = f"{r['rmse']:.2e}" if "rmse" in r else f"not run ({r['error']})"
    lines.append(f"| {r['route']} | {r['descales'] or '-'} | {'yes' if r['rotated'] else 'no'} "
                 f"| {value} |")
  for name, value in PAPER:
    lines.append(f"| {name} | - | - | {value:.1e} |")
  lines += ["", "Targets:", ""] + targets(record) + [""]
  return "\n".join(lines)


def write(record: dict, out: Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "outliers.json").write_text(json.dumps(record, indent=1) + "\n")
  (out / "outliers.md").write_text(render(record))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the folder for outliers.json and .md")
  parser.add_argument("--seed", type=int, default=0)
  for name, value in SHAPE.items():
    if name != "batch":
      parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
  args = parser.parse_args(argv)
  import jax
  from kernel import api
  if api.sm90_device() is None:
    print("fp8_outliers: needs an sm90 GPU (H100 or H200): ours and cuDNN's FP8 attention "
          "run there only", file=sys.stderr)
    return 2
  from harness.tools.gate import provenance
  record = measure(args.seed, SHAPE["batch"], args.seq, args.heads, args.head_dim)
  flags = sys.argv[1:] if argv is None else list(argv)
  command = " ".join(["python -m harness.tools.fp8_outliers",
                      *("OUTDIR" if i and flags[i - 1] == "--out" else a
                        for i, a in enumerate(flags))])
  record.update(device=jax.devices()[0].device_kind, provenance=provenance(), command=command)
  write(record, Path(args.out))
  print("\n".join(targets(record)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
