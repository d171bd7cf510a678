"""TFLOP/s of the kernel (forward, or forward + backward) side by side with
cuDNN, in one process; with --backward-parts, where the backward's time goes.

``python -m harness.tools.bench [--shapes default|headline|headline-both] [--backward] [--backward-parts] [--out results.json]``;
``python -m harness bench --grid [--backward] [--sections dense,windows-segments] --out-dir docs``
times the whole grid (harness/tools/bench_grid.py) and local windows / packed
segments (harness/tools/bench_windows_segments.py); ``--grid --dtype
float8_e4m3fn`` the FP8 page (harness/tools/bench_fp8.py).

Method (METHOD.md of the device notes): random normal inputs (never zeros),
several input sets rotated so repeated calls do not measure the L2 cache,
warm-up calls excluded, each trial times a burst of calls between two
``block_until_ready`` and the reported time is the median over trials.
FLOPs = 4 * B * N * T * S * D, half of it when causal.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp


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
SHAPE_SETS = {"default": DEFAULT_SHAPES, "headline": DEFAULT_SHAPES[:1],
              "headline-both": DEFAULT_SHAPES[:2]}


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


def time_fns(fns: dict, input_sets, *, warmup: int = 3, trials: int = 12,
             burst: int = 40) -> dict:
  """Median seconds per call of each function.

  Trials of the functions are interleaved (A, B, A, B, ...) so that clock or
  thermal drift during the run hits every function alike.  A burst of calls
  is timed between two ``block_until_ready``; with ~0.2 ms calls, a burst of
  40 keeps host dispatch hidden behind device work.
  """
  for fn in fns.values():
    for i in range(warmup):
      jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
  samples = {name: [] for name in fns}
  for t in range(trials):
    for name, fn in fns.items():
      start = time.perf_counter()
      for j in range(burst):
        r = fn(*input_sets[(t * burst + j) % len(input_sets)])
      jax.block_until_ready(r)
      samples[name].append((time.perf_counter() - start) / burst)
  return {name: statistics.median(v) for name, v in samples.items()}


# Forward + backward is counted as 3.5x the forward's FLOPs (the forward's two
# matrix products plus the backward's five), as FlashAttention reports it.
BACKWARD_FLOP_FACTOR = 3.5


def _with_backward(attention):
  """q, k, v, bias, d_out -> (dq, dk, dv) of sum(out * d_out): one forward
  and one backward per call (bias, when given, is held constant)."""
  def grads(q, k, v, bias, d_out):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, bias).astype(jnp.float32) * d_out)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return grads


@dataclasses.dataclass(frozen=True)
class BenchRow:
  """What one row of ours runs: a config (None: what config=None runs), whether a
  2-D bias goes through the stage ring (kernel.experiments' stage_2d), and with
  --backward, which backward (kernel.experiments.BACKWARDS; None: --backward-impl)."""
  config: object = None
  stage_2d: bool = True
  backward: str | None = None

  def describe(self) -> str:
    return f"{self.config or 'auto'}{'' if self.stage_2d else ' unstaged'}"


def bench_shape(shape: BenchShape, configs=(None,), sets: int = 3,
                rescale_threshold: float = 1.0, backward: bool = False,
                backward_impl: str = "pallas", bias_2d: bool = False) -> list[dict]:
  """One row per config (or :class:`BenchRow`), each with cuDNN timed in the
  same interleaved trials.  With ``backward``, each call is a forward plus a
  backward (jax.grad); with ``bias_2d``, every call gets a random (B, N, T, S)
  bias."""
  from kernel import experiments
  ours = [c if isinstance(c, BenchRow) else BenchRow(c) for c in configs]
  ours = [row if row.backward else dataclasses.replace(row, backward=backward_impl)
          for row in ours]
  inputs = []
  for i, (q, k, v) in enumerate(_inputs(shape, sets)):
    bias = None
    if bias_2d:
      bias = jax.random.normal(jax.random.PRNGKey(200 + i),
                               (shape.batch, shape.heads, shape.seq, shape.seq),
                               jnp.float32).astype(q.dtype)
    extra = (jax.random.normal(jax.random.PRNGKey(100 + i), q.shape, jnp.float32),) \
        if backward else ()
    inputs.append((q, k, v, bias, *extra))
  wrap = _with_backward if backward else (lambda f: f)
  fns = {"cudnn": jax.jit(wrap(lambda q, k, v, bias: jax.nn.dot_product_attention(
      q, k, v, bias=bias, is_causal=shape.causal, implementation="cudnn")))}
  errors = {}
  flops = shape.flops * (BACKWARD_FLOP_FACTOR if backward else 1.0)
  for i, runs in enumerate(ours):
    fn = jax.jit(wrap(lambda q, k, v, bias, runs=runs: experiments.dot_product_attention(
        q, k, v, bias, is_causal=shape.causal, config=runs.config,
        rescale_threshold=rescale_threshold, backward=runs.backward,
        stage_2d=runs.stage_2d)))
    try:
      jax.block_until_ready(fn(*inputs[0]))
      fns[i] = fn
    except Exception as err:  # a config that does not fit: say so in the table
      errors[i] = f"{type(err).__name__}: {str(err)[:160]}"
  try:
    times = time_fns(fns, inputs)
  except Exception as err:
    fns.pop("cudnn")
    times = time_fns(fns, inputs)
    times["cudnn_error"] = f"{type(err).__name__}: {str(err)[:160]}"
  rows = []
  for i, runs in enumerate(ours):
    row = dataclasses.asdict(shape)
    row["config"] = None if runs.config is None else str(runs.config)
    row["stage_2d"] = runs.stage_2d
    row["bias_2d"] = bias_2d
    row["rescale_threshold"] = rescale_threshold
    row["pass"] = f"forward+backward ({runs.backward})" if backward else "forward"
    if i in times:
      row["ours_ms"] = times[i] * 1e3
      row["ours_tflops"] = flops / times[i] / 1e12
    else:
      row["ours_error"] = errors.get(i, "not timed")
    if "cudnn" in times:
      row["cudnn_ms"] = times["cudnn"] * 1e3
      row["cudnn_tflops"] = flops / times["cudnn"] / 1e12
    else:
      row["cudnn_error"] = times.get("cudnn_error", "not timed")
    rows.append(row)
  return rows


# The parts of one forward + backward that backward_parts times, in the order
# the shipped backward runs them; "dkv", "dq kernel" and "dkv+fused dQ" are
# the kernels alone, so that the launch the backward does not make shows too.
PART_INPUTS = ("q", "k", "v", "do", "out", "m", "l", "rows", "acc")


def backward_part_fns(shape: BenchShape) -> dict:
  """Each part of one forward + backward at ``shape`` as a function of
  PART_INPUTS (q, k, v, dO and out (B, T, N, D); m, l (B, N, T); rows
  (B, N, 2, T), the per-row inputs; acc (B, T, N, D) f32, a dQ accumulator):
  the forward with and without residuals, the glue around the backward
  kernels (per-row inputs, the f32 dQ accumulator's zero-fill, its scale and
  cast), the kernels alone, and the whole forward + backward through the API
  (``jax.vjp`` with dO).  ``shape.seq`` must be a multiple of the kernels'
  tiles (128), as every benchmark shape is: no padding."""
  import math
  from kernel import api, padding
  from kernel.backward import launch as bwd_launch
  from kernel.tiling import backward_plan
  from kernel.backward import fused_dq
  from kernel.backward import dkv as bwd_dkv
  from kernel.backward import dq as bwd_dq
  from kernel.tiling import plan as plan_lib
  problem = plan_lib.problem_for(jnp.dtype(shape.dtype), shape.head_dim, shape.head_dim,
                                 shape.seq, shape.seq, is_causal=shape.causal,
                                 scale=1.0 / math.sqrt(shape.head_dim))
  d = plan_lib.backward_head_dims(shape.head_dim, shape.head_dim)[0]
  blocks = backward_plan.blocks_for(d, d, causal=shape.causal)
  tiles = padding.key_ranges(None, None, seq_kv=shape.seq, tile=blocks.dq_tile,
                             num_tiles=shape.seq // blocks.dq_tile)[2]
  dtype = jnp.dtype(shape.dtype)
  attention = lambda q, k, v, **kw: api.dot_product_attention(q, k, v, is_causal=shape.causal,
                                                              **kw)

  def dkv(q, k, v, do, rows, acc=None):
    return bwd_dkv.dkv_call(problem, blocks, q, k, v, do, rows, None, None, None, None,
                            dq_accum=acc)

  def fused(q, k, v, do, rows):
    acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    return dkv(q, k, v, do, rows, acc), acc[...]

  def forward_backward(q, k, v, do):
    out, pullback = jax.vjp(attention, q, k, v)
    return out, pullback(do)

  fns = {
      "forward": lambda q, k, v, *_: attention(q, k, v),
      "forward+residuals": lambda q, k, v, *_: attention(q, k, v, return_residuals=True),
      "rows": lambda q, k, v, do, out, m, l, *_: bwd_launch.residual_rows(m, l, out, do, shape.seq),
      "zeros": lambda q, *_: jnp.zeros(q.shape, jnp.float32),
      "scale+cast": lambda *a: (a[-1] * problem.scale).astype(dtype),
      "dkv": lambda q, k, v, do, out, m, l, rows, acc: dkv(q, k, v, do, rows),
      "dq kernel": lambda q, k, v, do, out, m, l, rows, acc: bwd_dq.dq_call(
          problem, blocks, q, k, v, do, rows, None, None, None, None, tiles, want_ds=False)[0],
  }
  # The fused kernel is timed wherever it can run (causal too), so that the
  # path the backward does not take shows too; so is deterministic=True's
  # fixed point (the rows with its scales, its int32 sum).
  if backward_plan.fused_dq_fits(blocks, with_bias=False):
    fns["dkv+fused dQ"] = lambda q, k, v, do, out, m, l, rows, acc: fused(q, k, v, do, rows)

    def scales(k, v, do, out, m, l):
      rows = bwd_launch.residual_rows(m, l, out, do, shape.seq)
      return rows, fused_dq.fixed_point_scales(k, v, do, rows, 1)

    def fixed_point(q, k, v, do, rows, c):
      acc = jax.new_ref(jnp.zeros(q.shape, jnp.int32))
      return bwd_dkv.dkv_call(problem, blocks, q, k, v, do, rows, None, None, None, None,
                              dq_accum=acc, dq_scales=c), acc[...]

    fns["rows+scales"] = lambda q, k, v, do, out, m, l, *_: scales(k, v, do, out, m, l)
    # Scales of 1 take the launch's every instruction, as real scales do.
    fns["dkv+fixed-point dQ"] = lambda q, k, v, do, out, m, l, rows, acc: fixed_point(
        q, k, v, do, rows, jnp.ones(rows[:, :, 0].shape, jnp.float32))
    fns["forward+backward deterministic"] = lambda q, k, v, do, *_: jax.vjp(
        functools.partial(attention, deterministic=True), q, k, v)[1](do)
  fns["forward+backward"] = lambda q, k, v, do, *_: forward_backward(q, k, v, do)
  return {name: jax.jit(fn) for name, fn in fns.items()}


def shipped_parts(shape: BenchShape) -> tuple[str, ...]:
  """The parts of backward_part_fns(shape) that the shipped forward +
  backward runs at ``shape`` (kernel.tiling.backward_plan.fuses_dq decides): their sum
  against "forward+backward" shows what the parts leave out."""
  from kernel.tiling import backward_plan
  from kernel.tiling import plan as plan_lib
  d = plan_lib.backward_head_dims(shape.head_dim, shape.head_dim)[0]
  fused = backward_plan.fuses_dq(backward_plan.blocks_for(d, d, causal=shape.causal),
                                 with_bias=False, causal=shape.causal)
  kernels = ("zeros", "dkv+fused dQ", "scale+cast") if fused else ("dkv", "dq kernel")
  return ("forward+residuals", "rows") + kernels


def backward_parts(shape: BenchShape, sets: int = 3) -> dict:
  """Milliseconds of each part of backward_part_fns at ``shape``, timed
  interleaved in one process, plus "shipped parts" (their sum for the parts
  the shipped backward runs) and "unaccounted" (forward + backward less
  that sum)."""
  from kernel import api
  from kernel.backward import launch as bwd_launch
  fns = backward_part_fns(shape)
  inputs = []
  for i, (q, k, v) in enumerate(_inputs(shape, sets)):
    do = jax.random.normal(jax.random.PRNGKey(100 + i), q.shape, jnp.float32).astype(q.dtype)
    out, (m, l) = api.dot_product_attention(q, k, v, is_causal=shape.causal,
                                            return_residuals=True)
    rows = bwd_launch.residual_rows(m, l, out, do, shape.seq)
    acc = jax.random.normal(jax.random.PRNGKey(300 + i), q.shape, jnp.float32)
    inputs.append((q, k, v, do, out, m, l, rows, acc))
  ms = {name: t * 1e3 for name, t in time_fns(fns, inputs).items()}
  ms["shipped parts"] = sum(ms[p] for p in shipped_parts(shape))
  ms["unaccounted"] = ms["forward+backward"] - ms["shipped parts"]
  return ms


def render_parts(results: list[tuple[BenchShape, dict]]) -> str:
  """Markdown: one row per shape, one column per part (ms)."""
  names = []
  for _, ms in results:
    names += [n for n in ms if n not in names]
  lines = ["| B | seq | heads | D | causal | " + " | ".join(names) + " |",
           "|---|---|---|---|---|" + "---|" * len(names)]
  for shape, ms in results:
    cells = [f"{ms[n]:.3f}" if n in ms else "-" for n in names]
    lines.append(f"| {shape.batch} | {shape.seq} | {shape.heads} | {shape.head_dim} | "
                 f"{shape.causal} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def render(rows: list[dict]) -> str:
  lines = ["| B | seq | heads | D | causal | pass | config | ours TFLOP/s | cuDNN TFLOP/s | ours/cuDNN |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ours, cudnn = r.get("ours_tflops"), r.get("cudnn_tflops")
    ratio = f"{ours / cudnn:.3f}" if ours and cudnn else "-"
    fmt = lambda x, k: f"{x:.1f}" if x else r.get(f"{k}_error", "-")
    lines.append(f"| {r['batch']} | {r['seq']} | {r['heads']} | {r['head_dim']} | "
                 f"{r['causal']} | {r.get('pass', 'forward')}{' bias2d' if r.get('bias_2d') else ''} | "
                 f"{r.get('config') or 'default'}{'' if r.get('stage_2d', True) else ' unstaged'} | {fmt(ours, 'ours')} | {fmt(cudnn, 'cudnn')} | {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.grid:
    return _run_grid(parser, args, argv)
  shapes = SHAPE_SETS[args.shapes]
  if args.backward_parts:
    return _run_backward_parts(shapes, args.out)
  configs = [dataclasses.replace(c, backward=impl)
             for impl in args.backward_impl.split(",") for c in _bench_rows(args.configs)]
  rows = [row for s in shapes
          for row in bench_shape(s, configs, rescale_threshold=args.threshold,
                                 backward=args.backward, bias_2d=args.bias_2d)]
  dev = jax.devices()[0]
  meta = {"device": dev.device_kind, "jax": jax.__version__, "rows": rows}
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(meta, fh, indent=1)
  print(f"device {dev.device_kind}, jax {jax.__version__}")
  print(render(rows))
  return 0


def _parser() -> argparse.ArgumentParser:
  """The command's arguments: the shapes' bench, then --grid's."""
  parser = argparse.ArgumentParser(prog="python -m harness.tools.bench")
  parser.add_argument("--shapes", choices=tuple(SHAPE_SETS), default="default",
                      help="default: every benchmark shape; headline: the issues' shape; "
                           "headline-both: it non-causal and causal")
  parser.add_argument("--out", default=None)
  parser.add_argument("--configs", default=None,
                      help="semicolon-separated block_q,block_kv,num_stages[,p] or 'auto' "
                           "(config=None), each optionally ending in ',u' (read a 2-D bias from "
                           "global memory instead of staging it through the ring, the "
                           "kernel.experiments' stage_2d=False), to sweep instead of the default config")
  parser.add_argument("--threshold", type=float, default=1.0, help="rescale_threshold")
  parser.add_argument("--backward", action="store_true",
                      help="time forward + backward (jax.grad), counted as 3.5x the forward FLOPs")
  parser.add_argument("--bias-2d", action="store_true",
                      help="give every call a random (B, N, T, S) bias")
  parser.add_argument("--backward-impl", default="pallas",
                      help="with --backward: comma-separated kernel.experiments.BACKWARDS names "
                           "(pallas, pallas-two-kernel, pallas-serial, xla), each timed "
                           "with every config in the same process")
  parser.add_argument("--backward-parts", action="store_true",
                      help="per shape: the forward, the backward's glue and kernels alone, "
                           "and the whole forward + backward (ms; where the time goes)")
  _add_grid_arguments(parser)
  return parser


def _add_grid_arguments(parser: argparse.ArgumentParser) -> None:
  """--grid and the arguments only the grid reads."""
  grid = parser.add_argument_group("--grid: the whole performance grid (harness/tools/bench_grid.py)")
  grid.add_argument("--grid", action="store_true",
                    help="time the grid: head dims x seq x causal, ours beside cuDNN and JAX's "
                         "example kernel; with --backward also forward + backward")
  grid.add_argument("--variants", default="auto",
                    help="semicolon-separated configs of ours: auto, auto,st (auto's "
                         "config with the split-tail schedule where it runs), heuristic "
                         "(the seed's rule, config=None's last fallback), or "
                         "block_q,block_kv,num_stages[,p][,lf|rr|st][,w3]; a trailing ,det "
                         "(auto,det) times deterministic=True, a trailing ,fs the "
                         "longest-first order with its L2 sections filled, not evened, "
                         "a trailing ,lt or ,lo that order with its light tiles last "
                         "or in order (by default where the schedule's model says), a "
                         "trailing ,ut or ,pc the copies through untiled views or padded at "
                         "every length no multiple of 8 (by default where "
                         "kernel.tiling.plan.untiled_copies_pay says), a trailing ,up the backward reading q, "
                         "k, v and dO unpadded where the forward does (kernel.experiments' "
                         "pallas-unpadded)")
  grid.add_argument("--out-dir", default=None,
                    help="write performance.json/.md/.png here (docs/ for the committed page)")
  grid.add_argument("--commit", default=None, help="the commit measured, named in the outputs")
  grid.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
  grid.add_argument("--head-dims", default="64,128,256")
  grid.add_argument("--no-ragged", action="store_true",
                    help="leave out the lengths that are no multiple of a block")
  masking = grid.add_mutually_exclusive_group()
  masking.add_argument("--causal-only", action="store_true", help="only the causal points")
  masking.add_argument("--non-causal-only", action="store_true",
                       help="only the points without a causal mask")
  grid.add_argument("--seqs", default=None,
                    help="comma-separated sequence lengths instead of the grid's")
  grid.add_argument("--no-example", action="store_true",
                    help="leave JAX's example Mosaic GPU kernel out (one compile less per point)")
  grid.add_argument("--backward-only", dest="forward_only_backward", action="store_true",
                    help="only the forward + backward grid (with --out-dir, the forward rows "
                         "of an existing performance.json stay, with their own provenance)")
  grid.add_argument("--sections", default="dense",
                    help="comma-separated: dense (the grid) and/or windows-segments (local "
                         "windows and packed segments beside the dense-mask route and cuDNN, "
                         "harness/tools/bench_windows_segments.py); --out-dir keeps the parts of an "
                         "existing performance.json this run does not time")
  grid.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"),
                    help="float8_e4m3fn: the FP8 page, ours in FP8 beside ours in bfloat16 and "
                         "cuDNN's FP8 attention, and the V^T transpose alone "
                         "(harness/tools/bench_fp8.py; the forward grid only)")
  grid.add_argument("--section-head-dims", default=None,
                    help="comma-separated head dims of the windows-segments section "
                         "(default: bench_windows_segments.HEAD_DIMS, 128)")


def _run_grid(parser: argparse.ArgumentParser, args, argv) -> int:
  """--grid: the FP8 page (harness/tools/bench_fp8.py), or the grid and its
  sections (harness/tools/bench_grid.py)."""
  if args.dtype != "bfloat16":
    if args.backward or args.forward_only_backward or args.sections != "dense":
      parser.error("--dtype float8_e4m3fn times the forward grid only (no --backward, "
                   "--backward-only or --sections)")
    if args.variants not in ("auto", "auto;auto,ut"):
      parser.error(f"--variants: the FP8 grid times auto, or auto;auto,ut (the untiled "
                   f"copies beside it), got {args.variants!r}")
    from harness.tools import bench_fp8
    args.raw_argv = list(argv if argv is not None else sys.argv[1:])
    return bench_fp8.main(args)
  from harness.tools import bench_grid, bench_windows_segments
  sections = {bench_windows_segments.NAME: bench_windows_segments}
  try:
    bench_grid.chosen_sections(args.sections, sections)
  except ValueError as err:
    parser.error(str(err))
  args.raw_argv = list(argv if argv is not None else sys.argv[1:])
  return bench_grid.main(args, sections)


def _run_backward_parts(shapes, out: str | None) -> int:
  """--backward-parts: each shape's table as it is timed, then all of them."""
  results = []
  for shape in shapes:
    results.append((shape, backward_parts(shape)))
    print(render_parts(results[-1:]), flush=True)
  print(render_parts(results))
  if out:
    with open(out, "w") as fh:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "parts": [{"shape": dataclasses.asdict(sh), "ms": ms}
                           for sh, ms in results]}, fh, indent=1)
  return 0


def _bench_rows(configs: str | None) -> list[BenchRow]:
  """--configs as rows of ours (one of config=None without it)."""
  if not configs:
    return [BenchRow(None)]
  from kernel.tiling.config import Config
  rows = []
  for item in configs.split(";"):
    fields = item.split(",")
    staged = fields[-1] != "u"  # a trailing ",u": 2-D bias unstaged (stage_2d=False)
    fields = fields if staged else fields[:-1]
    if fields == ["auto"]:  # what config=None runs: the autotune cache, else the heuristic
      rows.append(BenchRow(None, staged))
      continue
    bq, bkv, st, *p = fields
    rows.append(BenchRow(Config(int(bq), int(bkv), int(st),
                                persistent=bool(p and p[0] == "p")), staged))
  return rows


if __name__ == "__main__":
  raise SystemExit(main())
