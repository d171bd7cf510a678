"""The FP8 page: ``python -m harness bench --grid --dtype float8_e4m3fn``.

Forward TFLOP/s of this kernel's FP8 path beside its bf16 path and cuDNN's
FP8 attention (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``
with ``fp8_params``), interleaved per point in one process
(harness/tools/bench_grid.py's method and grid: head dims 64 / 128 / 256
with 32 / 16 / 8 heads, 16k tokens per batch, 1k to 16k and the ragged
lengths, causal and not).  Beside them the V^T transpose the FP8 call makes
before its kernel is timed alone (``kernel.padding.values_transposed``): what
a transpose in shared memory could save at most
(docs/decisions/fp8-values-transposed-in-hbm.md).

Inputs: random normal values rounded to e4m3 with per-tensor descales (the
values are as they are, so the descales are 1 / 4, 1 / 2 and 1), bf16 inputs
of the same values for the bf16 path; cuDNN's route gets the same descales,
quantises P at 2^8 as ours does, and writes its output in e4m3 (what it
offers) where ours writes bfloat16.  A point cuDNN refuses is "not run",
with its reason.

The page states the issue's targets: FP8 at least 1.5 x our bf16 at head
dims 128 and 256 from 4k tokens, at least 1.05 x cuDNN's FP8 at every point
it runs, and 1,000 TFLOP/s at head dim 256, 16k tokens, not causal.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from harness.tools import bench_grid

OURS, BF16, CUDNN, TRANSPOSE = "ours fp8", "ours bf16", "cudnn fp8", "V^T transpose"
# With --variants "auto;auto,ut": q and k copied through untiled views
# (kernel.experiments' untiled_copies), the A/B of docs/decisions/fp8-untiled-copies.md.
UNTILED = "ours fp8 untiled"
DTYPE = "float8_e4m3fn"
DESCALES = (0.25, 0.5, 1.0)   # q, k, v
P_SCALE = 256.0               # cuDNN's scale_s: P quantised at 2^8, as ours
# The targets (#57).
OVER_BF16, OVER_BF16_HEAD_DIMS, OVER_BF16_FROM_SEQ = 1.5, (128, 256), 4096
OVER_CUDNN = 1.05
HEADLINE = dict(head_dim=256, seq=16384, causal=False, tflops=1000.0)


def _inputs(point: bench_grid.Point, sets: int):
  """``sets`` tuples (q8, k8, v8, q16, k16, v16): e4m3 values and the same
  values in bfloat16."""
  import jax.numpy as jnp
  out = []
  for q, k, v in bench_grid._inputs(point, jnp.float32, sets, backward=False):
    fp8 = [x.astype(jnp.float8_e4m3fn) for x in (q, k, v)]
    out.append((*fp8, *(x.astype(jnp.bfloat16) for x in fp8)))
  return out


def _cudnn_fp8(point: bench_grid.Point, descales=DESCALES, scale_o: float = 1.0):
  """cuDNN's FP8 forward of (q8, k8, v8) with per-tensor ``descales`` (q, k,
  v; the page's by default), its output in e4m3 at ``scale_o`` times its
  value."""
  import jax.numpy as jnp
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  one = lambda x: jnp.full((1, 1, 1, 1), x, jnp.float32)
  params = {k: one(1.0) for k in cudnn.fp8_params_keys}
  params.update(descale_q=one(descales[0]), descale_k=one(descales[1]),
                descale_v=one(descales[2]), scale_s=one(P_SCALE), descale_s=one(1 / P_SCALE),
                scale_o=one(scale_o))
  mask = cudnn.MaskType.CAUSAL if point.causal else cudnn.MaskType.NO_MASK

  def run(q, k, v):
    out, _, _ = cudnn.dot_product_attention(q, k, v, fp8_params=params,
                                            scale=point.head_dim ** -0.5, mask_type=mask,
                                            use_fp8=True)
    return out
  return run


def implementations(point: bench_grid.Point, untiled: bool = False) -> dict:
  """name -> jitted function of (q8, k8, v8, q16, k16, v16) for one point;
  ``untiled``: with :data:`UNTILED` too."""
  import jax
  import jax.numpy as jnp
  from kernel import api, experiments, padding
  qd, kd, vd = (jnp.float32(d) for d in DESCALES)

  def ours(q8, k8, v8, *_):
    return api.dot_product_attention(q8, k8, v8, is_causal=point.causal, q_descale=qd,
                                     k_descale=kd, v_descale=vd)

  def ours_untiled(q8, k8, v8, *_):
    return experiments.dot_product_attention(q8, k8, v8, is_causal=point.causal, q_descale=qd,
                                             k_descale=kd, v_descale=vd, untiled_copies=True)

  def bf16(_q8, _k8, _v8, q, k, v):
    return api.dot_product_attention(q, k, v, is_causal=point.causal)

  def transpose(q8, k8, v8, *_):
    config = api.chosen_config(q8, k8, v8, is_causal=point.causal)
    return padding.values_transposed(v8, head_dim_out=point.head_dim,
                                     block_kv=config.block_kv)

  cudnn = _cudnn_fp8(point)
  return {OURS: jax.jit(ours), BF16: jax.jit(bf16),
          CUDNN: jax.jit(lambda q8, k8, v8, *_: cudnn(q8, k8, v8)),
          TRANSPOSE: jax.jit(transpose),
          **({UNTILED: jax.jit(ours_untiled)} if untiled else {})}


def run_grid(points, *, sets: int = 3, log=print, on_row=None, untiled: bool = False) -> list[dict]:
  """One row per point (bench_grid's row format; the transpose in ms only)."""
  rows = []
  for point in points:
    fns = implementations(point, untiled=untiled)
    times, errors = bench_grid.time_interleaved(fns, _inputs(point, sets))
    row = dict(dataclasses.asdict(point), heads=point.heads, kv_heads=point.kv_heads, batch=point.batch,
               dtype=DTYPE, pass_="forward", results={})
    for name in fns:
      if name not in times:
        row["results"][name] = dict(error=errors.get(name, "not timed"))
      elif name == TRANSPOSE:
        row["results"][name] = dict(ms=times[name] * 1e3)
      else:
        row["results"][name] = dict(ms=times[name] * 1e3,
                                    tflops=point.flops(False) / times[name] / 1e12)
    rows.append(row)
    log(render_rows([row], header=len(rows) == 1), flush=True)
    if on_row is not None:
      on_row(row)
  return rows


def _tflops(row, name):
  return row["results"].get(name, {}).get("tflops")


def _label(row) -> str:
  return bench_grid.Point(row["head_dim"], row["seq"], row["causal"]).label()


def ratios(rows, num: str, den: str, keep=lambda row: True) -> list[tuple[float, dict]]:
  """(num's TFLOP/s over den's, row) at every kept point where both ran."""
  out = []
  for r in rows:
    a, b = _tflops(r, num), _tflops(r, den)
    if keep(r) and a and b:
      out.append((a / b, r))
  return out


def summary_line(rows, den: str, title: str) -> str | None:
  pairs = ratios(rows, OURS, den)
  if not pairs:
    return None
  worst, at = min(pairs, key=lambda p: p[0])
  return (f"- **{OURS}** over {title}: worst {worst:.2f} ({_label(at)}), median "
          f"{statistics.median(x for x, _ in pairs):.2f}, ≥ 1.0 at "
          f"{sum(x >= 1.0 for x, _ in pairs)} of {len(pairs)} points.")


def targets(rows) -> list[str]:
  """The issue's targets, each met or not, with its worst point."""
  lines = []
  wide = ratios(rows, OURS, BF16, lambda r: r["head_dim"] in OVER_BF16_HEAD_DIMS
                and r["seq"] >= OVER_BF16_FROM_SEQ)
  for want, pairs, what in (
      (OVER_BF16, wide, f"ours bf16 at head dims {', '.join(map(str, OVER_BF16_HEAD_DIMS))} "
                        f"from {OVER_BF16_FROM_SEQ // 1024}k tokens"),
      (OVER_CUDNN, ratios(rows, OURS, CUDNN), "cuDNN's FP8 at every point it runs")):
    if not pairs:
      lines.append(f"- ≥ {want:.2f} × {what}: no point measured")
      continue
    worst, at = min(pairs, key=lambda p: p[0])
    met = sum(x >= want for x, _ in pairs)
    lines.append(f"- ≥ {want:.2f} × {what}: {'met' if met == len(pairs) else 'NOT met'} "
                 f"({met} of {len(pairs)} points; worst {worst:.2f} at {_label(at)})")
  head = [r for r in rows if all(r[k] == HEADLINE[k] for k in ("head_dim", "seq", "causal"))]
  got = _tflops(head[0], OURS) if head else None
  what = (f"≥ {HEADLINE['tflops']:,.0f} TFLOP/s at head dim {HEADLINE['head_dim']}, "
          f"{HEADLINE['seq'] // 1024}k tokens, not causal")
  lines.append(f"- {what}: " + ("no point measured" if got is None else
                                f"{'met' if got >= HEADLINE['tflops'] else 'NOT met'} "
                                f"({got:.1f})"))
  return lines


def _cell(result):
  if not result:
    return "-"
  if "error" in result:
    return "not run"
  return f"{result['tflops']:.1f}" if "tflops" in result else f"{result['ms']:.3f}"


def render_rows(rows, header: bool = True) -> str:
  """Markdown: TFLOP/s of each (the transpose in ms), FP8 over bf16 and over
  cuDNN's FP8, and the transpose's share of the FP8 call."""
  lines = []
  untiled = any(UNTILED in r["results"] for r in rows)
  extra = [UNTILED, "untiled / fp8"] if untiled else []
  if header:
    lines += bench_grid.markdown_header(
        ("D", "seq", "causal", "B", "N/K"),
        [OURS, BF16, CUDNN, f"{TRANSPOSE} ms", "fp8 / bf16", "fp8 / cudnn fp8",
         "transpose / fp8 call", *extra])
  ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
  for r in rows:
    res = r["results"]
    ours_ms, vt_ms = res.get(OURS, {}).get("ms"), res.get(TRANSPOSE, {}).get("ms")
    more = ((_cell(res.get(UNTILED)), ratio(_tflops(r, UNTILED), _tflops(r, OURS)))
            if untiled else ())
    lines.append(bench_grid.markdown_row(
        (r["head_dim"], r["seq"], "yes" if r["causal"] else "no", r["batch"],
         f"{r['heads']}/{r['kv_heads']}"),
        [_cell(res.get(n)) for n in (OURS, BF16, CUDNN, TRANSPOSE)],
        (ratio(_tflops(r, OURS), _tflops(r, BF16)), ratio(_tflops(r, OURS), _tflops(r, CUDNN)),
         ratio(vt_ms, ours_ms), *more)))
  return "\n".join(lines)


def write(record: dict, out_dir: Path) -> None:
  """performance.json, performance.md and performance.png of the FP8 page."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "performance.json").write_text(json.dumps(record, indent=1) + "\n")
  rows = record["rows"]
  lines = ["# FP8 performance", "", bench_grid._provenance(record), "",
           "TFLOP/s; FLOPs = 4·B·N·T·S·D, half when causal.  Ours in FP8 (float8_e4m3fn "
           "with per-tensor descales, bfloat16 output) beside ours in bfloat16 and cuDNN's "
           "FP8 attention (e4m3 output); the V^T transpose ours makes before its kernel, "
           "alone, in ms.", ""]
  lines += [line for line in (summary_line(rows, CUDNN, "cuDNN"),
                              summary_line(rows, BF16, "ours bf16")) if line]
  lines += ["", "Targets:", ""] + targets(rows) + ["", render_rows(rows), ""]
  refused = [(r, r["results"][CUDNN]["error"]) for r in rows
             if "error" in r["results"].get(CUDNN, {})]
  if refused:
    lines += ["cuDNN's FP8 not run:", ""]
    lines += [f"- {_label(r)}: {why}" for r, why in refused] + [""]
  shown = [dict(r, results={n: x for n, x in r["results"].items() if n != TRANSPOSE})
           for r in rows]
  title = (f"{record['device']}, jax {record['jax']}, commit {record['commit']}, "
           f"{record['date']}, float8_e4m3fn")
  if bench_grid.plot(bench_grid.dense_panels(shown), out_dir / "performance.png", title):
    lines += ["![TFLOP/s per point](performance.png)", ""]
  (out_dir / "performance.md").write_text("\n".join(lines))


def main(args) -> int:
  """Called by ``harness.tools.bench`` for ``--grid --dtype float8_e4m3fn``."""
  import datetime
  import os
  import jax
  head_dims = tuple(int(d) for d in args.head_dims.split(","))
  seqs = tuple(int(x) for x in args.seqs.split(",")) if args.seqs else None
  points = bench_grid.grid_points(backward=False, ragged=not args.no_ragged, gqa=args.gqa,
                                  head_dims=head_dims, seqs=seqs)
  if args.causal_only:
    points = [p for p in points if p.causal]
  if args.non_causal_only:
    points = [p for p in points if not p.causal]
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              commit=args.commit or os.environ.get("FLASH_COMMIT", "unknown"),
              date=datetime.date.today().isoformat(), dtype=DTYPE,
              command="python -m harness bench " + " ".join(
                  bench_grid._portable(args.raw_argv)))
  out_dir = Path(args.out_dir) if args.out_dir else None
  untiled = "auto,ut" in args.variants.split(";")
  rows = run_grid(points, on_row=bench_grid.partial_writer(out_dir, meta), untiled=untiled)
  if out_dir is not None:
    write(dict(meta, rows=rows), out_dir)
    (out_dir / bench_grid.PARTIAL).unlink(missing_ok=True)
  print("\n".join(line for line in (summary_line(rows, CUDNN, "cuDNN"),
                                    summary_line(rows, BF16, "ours bf16")) if line))
  print("\n".join(targets(rows)))
  return 0
