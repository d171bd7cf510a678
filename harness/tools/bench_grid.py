"""The whole performance grid in one process: ``python -m harness bench --grid``.

Forward (and with ``--backward``, forward + backward) TFLOP/s of this kernel
beside cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) and
JAX's example Mosaic GPU kernel (``jax.experimental.pallas.ops.gpu.
attention_mgpu``), interleaved per grid point in one process (the method of
``harness/tools/bench.py``: random normal inputs rotated over several sets,
warm-up excluded, medians of interleaved trials).

The grid: head dims 64 / 128 / 256 with 32 / 16 / 8 query heads, 16k tokens
per batch (B = 16384 // seq), causal and not, at seq 1k, 2k, 4k, 8k, 16k
(forward) or 1k, 4k, 16k (backward), plus ragged lengths that are no multiple
of any block size (1000, 3000, 12017).  ``--gqa G`` gives every point G query
heads per kv head.  Results go to ``OUT/performance.json``, a Markdown table
with the ratios (``OUT/performance.md``) and a grouped-bar plot
(``OUT/performance.png``), each naming the device, the jax version and the
commit; the committed ``docs/performance.*`` are written by this command.

``--sections`` picks what is timed: ``dense`` (this grid, the default) and
further sections with their own problems and routes, each written as its own
part of the same three files (``windows-segments``: local windows and packed
segments, harness/tools/bench_windows_segments.py).  A part an existing
``OUT/performance.json`` holds and this run did not time is kept, with the
command, commit and date that made it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

# heads * head_dim at every point: 32, 16 and 8 heads at head dims 64, 128
# and 256 (10 at 192, 21 at 96).
WIDTH = 2048
FORWARD_SEQS = (1024, 2048, 4096, 8192, 16384)
BACKWARD_SEQS = (1024, 4096, 16384)
RAGGED_SEQS = (1000, 3000, 12017)
TOKENS = 16384
BACKWARD_FLOP_FACTOR = 3.5


@dataclasses.dataclass(frozen=True)
class Point:
  head_dim: int
  seq: int
  causal: bool
  kv_heads_ratio: int = 1   # query heads per kv head (GQA)

  @property
  def heads(self) -> int:
    return heads_for(self.head_dim)

  @property
  def kv_heads(self) -> int:
    return self.heads // self.kv_heads_ratio

  @property
  def batch(self) -> int:
    return max(1, TOKENS // self.seq)

  def flops(self, backward: bool) -> float:
    f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
    f = f / 2 if self.causal else f
    return f * (BACKWARD_FLOP_FACTOR if backward else 1.0)

  def label(self) -> str:
    return (f"d{self.head_dim} {'causal ' if self.causal else ''}{self.seq}"
            f"{f' gqa{self.kv_heads_ratio}' if self.kv_heads_ratio > 1 else ''}")


def heads_for(head_dim: int) -> int:
  """The query heads of a point of this head dim (:data:`WIDTH`)."""
  return max(1, WIDTH // head_dim)


# The grid's passes, in the order a page lists them, and the keys of a
# run's provenance (performance.json's top level, and per pass).
PASSES = ("forward", "forward+backward")
META_KEYS = ("device", "jax", "commit", "date", "dtype", "command")


def pass_name(backward: bool) -> str:
  return PASSES[1] if backward else PASSES[0]


def _pass_rank(name: str) -> int:
  return PASSES.index(name) if name in PASSES else len(PASSES)


def grid_points(*, backward: bool, ragged: bool = True, gqa: int = 1,
                head_dims=(64, 128, 256), seqs=None) -> list[Point]:
  """The grid's points; ``seqs`` (``--seqs``), any lengths in the order
  given, replaces the pass's own (and the ragged ones)."""
  if seqs is None:
    seqs = BACKWARD_SEQS if backward else FORWARD_SEQS
    seqs = seqs + (RAGGED_SEQS if ragged else ())
  return [Point(d, s, c, gqa) for d in head_dims for c in (False, True) for s in seqs]


def parse_variant(text: str):
  """``auto`` (config=None) or ``block_q,block_kv,num_stages[,p][,lf|rr|st][,w3]``:
  p persistent, lf / rr / st the longest-first / round-robin / split-tail
  schedule, w3 three compute warpgroups.  A trailing ``,det`` (``auto,det``)
  asks for ``deterministic=True`` (:func:`is_deterministic`), a trailing
  ``,fs`` the longest-first order with its L2 sections filled instead of
  evened (:func:`filled_sections`, kernel.experiments' ``even_sections``
  False: the A/B of the evening), a trailing ``,lt`` that order with its
  light tiles last and ``,lo`` in order, where the shipped order defers
  them where the schedule's model predicts that it pays
  (:func:`deferred_light`, kernel.experiments' ``defer_light``), a
  trailing ``,ut`` copies through untiled views, in column parts, and
  ``,pc`` padded copies, at every length no multiple of 8 (:func:`untiled_copies`,
  kernel.experiments' ``untiled_copies``; by default where
  kernel.tiling.plan.untiled_copies_pay says), a trailing ``,kr`` a call without
  key ranges run by the kernels that read them (:func:`ranges_always`,
  kernel.experiments' ``ranges_always``: the kernels the proof traces);
  ``auto,st``
  times the config ``auto`` picks with the split-tail schedule wherever
  that can run it (:func:`split_tail_of`), else as ``auto``; ``heuristic``
  the seed's rule (:func:`heuristic_of`), the fallback ``auto`` had before
  a GPU without entries of its own read the H200's."""
  from kernel.tiling.config import Config
  fields = _config_fields(text)
  if fields in (["auto"], ["auto", "st"], ["heuristic"]):
    return None
  if len(fields) < 3:
    raise ValueError(f"--variants: expected auto or block_q,block_kv,num_stages[,flags], "
                     f"got {text!r}")
  bq, bkv, st, *flags = fields
  unknown = set(flags) - {"p", "lf", "rr", "st", "w3"}
  if unknown:
    raise ValueError(f"--variants: unknown flag(s) {sorted(unknown)} in {text!r}")
  schedules = [name for flag, name in (("lf", "longest-first"), ("rr", "round-robin"),
                                       ("st", "split-tail")) if flag in flags]
  if len(schedules) > 1:
    raise ValueError(f"--variants: more than one schedule ({', '.join(schedules)}) in {text!r}")
  return Config(int(bq), int(bkv), int(st), persistent="p" in flags,
                schedule=schedules[0] if schedules else "round-robin",
                compute_warpgroups=3 if "w3" in flags else 2)


def splits_auto(text: str) -> bool:
  """Whether ``text`` is ``auto,st`` (with or without :data:`MODIFIERS`)."""
  return _config_fields(text) == ["auto", "st"]


def heuristic_of(q, k, v, *, is_causal: bool):
  """kernel.tiling.heuristics.get_heuristics_config for these arrays (or tracers):
  the config ``config=None`` runs where no autotune entry serves."""
  from kernel import api
  from kernel.tiling import autotune, heuristics
  problem = autotune.selection_problem(api.resolved_problem(q, k, v, is_causal=is_causal))
  return heuristics.get_heuristics_config(problem)


def is_heuristic(text: str) -> bool:
  return _config_fields(text) == ["heuristic"]


def split_tail_of(q, k, v, *, is_causal: bool):
  """The config ``config=None`` picks for these arrays (or tracers), with the
  split-tail schedule where it can run it (persistent, not causal), else as
  picked."""
  import dataclasses
  from kernel import api
  from kernel.tiling import plan
  config = api.chosen_config(q, k, v, is_causal=is_causal)
  split = dataclasses.replace(config, schedule="split-tail")
  problem = api.resolved_problem(q, k, v, is_causal=is_causal)
  return split if plan.config_fits(problem, split) else config


def is_deterministic(text: str) -> bool:
  return "det" in text.split(",")


def filled_sections(text: str) -> bool:
  """Whether ``text`` ends in ``fs``: L2 sections kept filled."""
  return "fs" in text.split(",")


def deferred_light(text: str) -> bool | None:
  """True where ``text`` ends in ``lt`` (light tiles last), False in ``lo``
  (light tiles in order), else None (where the schedule's model says)."""
  fields = text.split(",")
  if "lt" in fields and "lo" in fields:
    raise ValueError(f"--variants: both lt and lo in {text!r}")
  return True if "lt" in fields else False if "lo" in fields else None


def untiled_copies(text: str) -> bool | None:
  """True where ``text`` ends in ``ut`` (copies through untiled views at
  every length), False in ``pc`` (padded copies at every length no multiple
  of 8), else None (where kernel.tiling.plan.untiled_copies_pay says)."""
  fields = text.split(",")
  if "ut" in fields and "pc" in fields:
    raise ValueError(f"--variants: both ut and pc in {text!r}")
  return True if "ut" in fields else False if "pc" in fields else None


def unpadded_backward(text: str) -> bool:
  """Whether ``text`` ends in ``up``: the backward reading q, k, v and dO
  unpadded where the forward does (kernel.experiments' "pallas-unpadded")."""
  return "up" in text.split(",")


def ranges_always(text: str) -> bool:
  """Whether ``text`` ends in ``kr``: the whole keys as every row's key range."""
  return "kr" in text.split(",")


# Trailing flags of a variant that change the call, not the config.
MODIFIERS = ("det", "fs", "lt", "lo", "ut", "pc", "kr", "up")


def _config_fields(text: str) -> list[str]:
  """A variant's fields less its :data:`MODIFIERS`: the config it names."""
  return [f for f in text.split(",") if f not in MODIFIERS]


def _inputs(point: Point, dtype, sets: int, backward: bool):
  """``sets`` tuples (q, k, v[, d_out]) of random normal arrays for anything
  with a Point's batch, seq, heads, kv_heads and head_dim."""
  import jax
  import jax.numpy as jnp
  out = []
  for i in range(sets):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(1000 + i), 4)
    q = jax.random.normal(kq, (point.batch, point.seq, point.heads, point.head_dim),
                          jnp.float32).astype(dtype)
    kshape = (point.batch, point.seq, point.kv_heads, point.head_dim)
    k = jax.random.normal(kk, kshape, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, kshape, jnp.float32).astype(dtype)
    extra = (jax.random.normal(kd, q.shape, jnp.float32).astype(dtype),) if backward else ()
    out.append((q, k, v) + extra)
  return out


def implementations(point: Point, variants, *, backward: bool, example: bool = True) -> dict:
  """name -> jitted function of (q, k, v[, d_out]) for one grid point."""
  import functools
  import jax
  from kernel import api, experiments

  def with_grad(attention):
    if not backward:
      return attention

    def grads(q, k, v, d_out):
      out, pullback = jax.vjp(attention, q, k, v)
      return pullback(d_out)
    return grads

  def ours(q, k, v, config, det, split, heuristic, filled, light_last, untiled, ranges,
           unpadded):
    if split:   # decided at trace time, from the shapes the call sees
      config = split_tail_of(q, k, v, is_causal=point.causal)
    if heuristic:
      config = heuristic_of(q, k, v, is_causal=point.causal)
    if filled or light_last is not None or untiled is not None or ranges or unpadded:
      return experiments.dot_product_attention(q, k, v, is_causal=point.causal, config=config,
                                               deterministic=det, even_sections=not filled,
                                               defer_light=light_last, untiled_copies=untiled,
                                               ranges_always=ranges,
                                               backward="pallas-unpadded" if unpadded
                                               else "pallas")
    return api.dot_product_attention(q, k, v, is_causal=point.causal, config=config,
                                     deterministic=det)

  fns = {}
  for text in variants:
    config, det = parse_variant(text), is_deterministic(text)
    fns[f"ours {text}"] = jax.jit(with_grad(functools.partial(
        ours, config=config, det=det, split=splits_auto(text), heuristic=is_heuristic(text),
        filled=filled_sections(text), light_last=deferred_light(text),
        untiled=untiled_copies(text), ranges=ranges_always(text),
        unpadded=unpadded_backward(text))))
  fns["cudnn"] = jax.jit(with_grad(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=point.causal, implementation="cudnn")))
  reference = _example_kernel(point) if example else None
  if reference is not None:
    fns["jax example"] = jax.jit(with_grad(reference))
  return fns


def _example_kernel(point: Point):
  """JAX's example Mosaic GPU attention at its own tuning (block_q 64,
  block_kv 128, or 64 at head dim 256; 2 stages), or None where it does not
  apply (key lengths that are no multiple of its block)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as example
  block_kv = 64 if point.head_dim == 256 else 128
  if point.seq % block_kv:
    return None
  config = example.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                causal=point.causal)
  return lambda q, k, v: example.attention(q, k, v, config)


def time_interleaved(fns: dict, input_sets, *, target_s: float = 0.02, trials: int = 7,
                     warmup: int = 2) -> dict:
  """Median seconds per call, trials interleaved across functions; each
  trial a burst sized to about ``target_s`` so that host dispatch hides
  behind device work at every size.  A function that fails is reported
  by its error instead."""
  import jax
  times, errors, bursts = {}, {}, {}
  for name, fn in fns.items():
    try:
      for i in range(warmup):
        jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
      start = time.perf_counter()
      jax.block_until_ready(fn(*input_sets[0]))
      once = max(time.perf_counter() - start, 1e-5)
      bursts[name] = max(3, min(60, int(target_s / once)))
    except Exception as err:  # noqa: BLE001  (a variant that cannot run is a table entry)
      errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
  samples = {name: [] for name in bursts}
  for t in range(trials):
    for name in bursts:
      fn, burst = fns[name], bursts[name]
      start = time.perf_counter()
      for j in range(burst):
        r = fn(*input_sets[(t * burst + j) % len(input_sets)])
      jax.block_until_ready(r)
      samples[name].append((time.perf_counter() - start) / burst)
  times = {name: statistics.median(v) for name, v in samples.items()}
  return times, errors


def run_grid(points, variants, *, backward: bool, dtype="bfloat16", sets: int = 3,
             example: bool = True, log=print, on_row=None) -> list[dict]:
  """One row per point; ``on_row(row)`` after each (the partial file)."""
  import jax.numpy as jnp
  rows = []
  for point in points:
    fns = implementations(point, variants, backward=backward, example=example)
    inputs = _inputs(point, jnp.dtype(dtype), sets, backward)
    times, errors = time_interleaved(fns, inputs)
    row = dict(dataclasses.asdict(point), heads=point.heads, kv_heads=point.kv_heads,
               batch=point.batch, dtype=dtype,
               pass_=pass_name(backward), results={})
    for name in fns:
      if name in times:
        row["results"][name] = dict(ms=times[name] * 1e3,
                                    tflops=point.flops(backward) / times[name] / 1e12)
      else:
        row["results"][name] = dict(error=errors.get(name, "not timed"))
    rows.append(row)
    log(render_rows([row], header=not rows[:-1]), flush=True)
    if on_row is not None:
      on_row(row)
  return rows


PARTIAL = "performance.partial.jsonl"


def partial_writer(out_dir: Path | None, meta: dict):
  """``on_row`` for :func:`run_grid`: each row appended to OUT_DIR/
  :data:`PARTIAL` (after a line of the run's meta) as it is timed, so that
  a run stopped by a time limit leaves what it measured; :func:`main`
  removes the file once the page is written.  None without ``--out-dir``."""
  if out_dir is None:
    return None
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / PARTIAL
  path.write_text(json.dumps(dict(meta=meta)) + "\n")

  def append(row: dict) -> None:
    with path.open("a") as f:
      f.write(json.dumps(row) + "\n")
  return append


def _cell(result: dict | None) -> str:
  if not result:
    return "-"
  return f"{result['tflops']:.1f}" if "tflops" in result else "error"


def markdown_row(*groups) -> str:
  """A Markdown table's row: the cells of each group in turn (an empty group
  still takes one empty cell)."""
  return "| " + " | ".join(" | ".join(f"{c}" for c in g) for g in groups) + " |"


def markdown_header(fixed: tuple, cols: list) -> list[str]:
  """A Markdown table's header and rule: the ``fixed`` columns, then ``cols``."""
  return [markdown_row(fixed, cols), "|---" * len(fixed) + "|" + "---|" * len(cols)]


def render_rows(rows: list[dict], header: bool = True) -> str:
  """Markdown: one line per point, TFLOP/s per implementation and each of
  ours over cuDNN."""
  names = []
  for r in rows:
    names += [n for n in r["results"] if n not in names]
  ours = [n for n in names if n.startswith("ours")]
  lines = []
  if header:
    lines += markdown_header(("pass", "D", "seq", "causal", "B", "N/K"),
                             names + [f"{n} / cudnn" for n in ours])
  for r in rows:
    res = r["results"]
    cudnn = res.get("cudnn", {}).get("tflops")
    ratios = []
    for n in ours:
      t = res.get(n, {}).get("tflops")
      ratios.append(f"{t / cudnn:.2f}" if t and cudnn else "-")
    lines.append(markdown_row(
        (r["pass_"], r["head_dim"], r["seq"], "yes" if r["causal"] else "no", r["batch"],
         f"{r['heads']}/{r['kv_heads']}"), [_cell(res.get(n)) for n in names], ratios))
  return "\n".join(lines)


def summary(rows: list[dict], name: str) -> dict:
  """The worst and median ratio of implementation ``name`` over cuDNN."""
  ratios = []
  for r in rows:
    ours, cudnn = r["results"].get(name, {}), r["results"].get("cudnn", {})
    if "tflops" in ours and "tflops" in cudnn:
      ratios.append((ours["tflops"] / cudnn["tflops"], r))
  if not ratios:
    return {}
  worst, at = min(ratios, key=lambda x: x[0])
  return dict(points=len(ratios), worst=worst, worst_at=Point(
      at["head_dim"], at["seq"], at["causal"], at["kv_heads_ratio"]).label() + f" ({at['pass_']})",
      median=statistics.median(x for x, _ in ratios),
      at_least_1=sum(x >= 1.0 for x, _ in ratios))


@dataclasses.dataclass(frozen=True)
class Panel:
  """One panel of the plot: a group of bars per ``groups`` entry, a bar per
  ``series`` name (0 where a series has no value)."""
  title: str
  groups: list[str]
  series: dict[str, list[float]]
  ylabel: str
  fmt: str = "{:.0f}"


def dense_panels(rows: list[dict]) -> list[Panel]:
  """The grid's panels: one per (pass, head dim, causal), a group per
  sequence length, a bar per implementation, TFLOP/s."""
  names = []
  for r in rows:
    names += [n for n in r["results"] if n not in names]
  out = []
  for pass_, d, causal in sorted({(r["pass_"], r["head_dim"], r["causal"]) for r in rows}):
    sub = sorted((r for r in rows if (r["pass_"], r["head_dim"], r["causal"]) == (pass_, d, causal)),
                 key=lambda r: r["seq"])
    out.append(Panel(f"{pass_}, head dim {d}{', causal' if causal else ''}",
                     [str(r["seq"]) for r in sub],
                     {n: [r["results"].get(n, {}).get("tflops", 0.0) for r in sub] for n in names},
                     "TFLOP/s"))
  return out


def plot(panels: list[Panel], path: Path, title: str) -> bool:
  """Grouped bars, two panels a row.  False if matplotlib is missing (the
  JSON and Markdown are still written)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  if not panels:
    return False
  cols = 2
  nrows = -(-len(panels) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 3.2 * nrows), squeeze=False)
  for ax, panel in zip(axes.flat, panels):
    names = list(panel.series)
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
      vals = panel.series[n]
      xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(vals))]
      ax.bar(xs, vals, width, label=n)
      for x, v in zip(xs, vals):
        if v:
          ax.text(x, v, panel.fmt.format(v), ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(panel.groups)), panel.groups)
    ax.set_title(panel.title, fontsize=9)
    ax.set_ylabel(panel.ylabel)
    ax.legend(fontsize=6)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _provenance(meta: dict) -> str:
  return (f"Generated by `{meta['command']}` on {meta['device']}, jax {meta['jax']}, "
          f"commit {meta['commit']}, {meta['date']}, {meta['dtype']}, {TOKENS} tokens per "
          f"batch. Do not edit: run the command again.")


def write(record: dict, out_dir: Path, sections: dict) -> None:
  """``record`` (the grid's meta and rows at the top level, each other
  section's under ``record["sections"][its KEY]``, with its own meta) as
  performance.json, performance.md and performance.png.  ``sections``:
  name -> module with KEY, TITLE, render(section) and panels(section)."""
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "performance.json").write_text(json.dumps(record, indent=1) + "\n")
  rows = record.get("rows", [])
  lines, panels, titles = ["# Performance", ""], [], []
  if rows:
    metas = record.get("pass_meta") or {}
    if len({json.dumps(m, sort_keys=True) for m in metas.values()}) > 1:
      # passes timed by different runs: each names its own
      lines += [f"- {p}: {_provenance(m)}" for p, m in metas.items()]
      titles += [f"{p}: {m['device']}, jax {m['jax']}, commit {m['commit']}, {m['date']}"
                 for p, m in metas.items()]
    else:
      m = next(iter(metas.values()), record)
      lines.append(_provenance(m))
      titles.append(f"{m['device']}, jax {m['jax']}, commit {m['commit']}, {m['date']}")
    lines += ["",
              "TFLOP/s; FLOPs = 4·B·N·T·S·D, half when causal, ×3.5 for forward + backward.", ""]
    for n in sorted({n for r in rows for n in r["results"] if n.startswith("ours")}):
      s = summary(rows, n)
      if s:
        lines.append(f"- **{n}** over cuDNN: worst {s['worst']:.2f} ({s['worst_at']}), median "
                     f"{s['median']:.2f}, ≥ 1.0 at {s['at_least_1']} of {s['points']} points.")
    lines += ["", render_rows(rows), ""]
    panels += dense_panels(rows)
  for module in sections.values():
    section = record.get("sections", {}).get(module.KEY)
    if not section:
      continue
    lines += [f"## {module.TITLE}", "", _provenance(section), ""] + module.render(section)
    panels += module.panels(section)
    title = (f"{section['device']}, jax {section['jax']}, commit {section['commit']}, "
             f"{section['date']}")
    if not rows:
      titles.append(title)
    elif title not in titles:
      # a section timed by another run names its own provenance in the plot too
      titles.append(f"{module.TITLE.lower()}: {title}")
  if plot(panels, out_dir / "performance.png", "; ".join(titles) + ", bfloat16"):
    lines += ["![TFLOP/s and ms per point](performance.png)", ""]
  (out_dir / "performance.md").write_text("\n".join(lines))


def _portable(argv: list[str]) -> list[str]:
  """The command as a reader would rerun it: the output folder, a path of the
  machine that ran it, is written as OUTDIR."""
  out, skip = [], False
  for a in argv:
    if skip:
      out.append("OUTDIR")
      skip = False
    elif a == "--out-dir":
      out.append(a)
      skip = True
    elif a.startswith("--out-dir="):
      out.append("--out-dir=OUTDIR")
    else:
      out.append(a)
  return out


SECTIONS_HELP = "dense (this grid) and the sections passed to main, comma-separated"


def chosen_sections(text: str, sections: dict) -> list[str]:
  """The names of ``--sections`` in order; an unknown one is refused."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  known = ["dense", *sections]
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise ValueError(f"--sections: unknown {unknown or [text]}; expected some of {known}")
  return names


def main(args, sections: dict | None = None) -> int:
  """Called by ``harness.tools.bench`` for ``--grid``.  ``sections``: name ->
  module with KEY, TITLE, run(args, passes=, log=), render, panels (today
  harness/tools/bench_windows_segments.py).  The sections named by
  ``--sections`` are timed; with ``--out-dir``, the parts of an existing
  performance.json there that this run did not time (a pass of the grid,
  a section) are kept, each naming the command, commit and date that made
  it, the rest replaced (:func:`merged_record`)."""
  import datetime
  import jax
  sections = sections or {}
  chosen = chosen_sections(args.sections, sections)
  variants = args.variants.split(";")
  for v in variants:
    parse_variant(v)  # refuse a bad variant before any compile
  passes = [False] + ([True] if args.backward else [])
  if args.forward_only_backward:
    passes = [True]
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              commit=args.commit or os.environ.get("FLASH_COMMIT", "unknown"),
              date=datetime.date.today().isoformat(), dtype="bfloat16",
              command="python -m harness bench " + " ".join(_portable(args.raw_argv)))
  out_dir = Path(args.out_dir) if args.out_dir else None
  existing = {}
  if out_dir is not None and (out_dir / "performance.json").exists():
    existing = json.loads((out_dir / "performance.json").read_text())
  # Refused before anything is timed; merged_record checks the same rule.
  try:
    refuse_other_devices(
        existing, meta["device"],
        passes=tuple(pass_name(b) for b in passes) if "dense" in chosen else None,
        section_keys=[sections[n].KEY for n in chosen if n != "dense"])
  except ValueError as err:
    print(f"harness bench --grid: {err}", file=sys.stderr)
    return 2
  rows = None
  on_row = partial_writer(out_dir, meta)
  if "dense" in chosen:
    rows = []
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    for backward in passes:
      seqs = tuple(int(x) for x in args.seqs.split(",")) if args.seqs else None
      points = grid_points(backward=backward, ragged=not args.no_ragged, gqa=args.gqa,
                           head_dims=head_dims, seqs=seqs)
      if args.causal_only:
        points = [p for p in points if p.causal]
      if args.non_causal_only:
        points = [p for p in points if not p.causal]
      rows += run_grid(points, variants, backward=backward, example=not args.no_example,
                       on_row=on_row)
  timed = {sections[n].KEY: sections[n].run(args, passes=passes) for n in chosen if n != "dense"}
  if out_dir is not None:
    timed_passes = None if rows is None else tuple(pass_name(b) for b in passes)
    write(merged_record(existing, meta, rows=rows, sections=timed, passes=timed_passes),
          out_dir, sections)
    (out_dir / PARTIAL).unlink(missing_ok=True)
  print()
  for n in sorted({n for r in rows or () for n in r["results"] if n.startswith("ours")}):
    print(n, summary(rows, n))
  return 0




def _pass_meta(record: dict) -> dict[str, dict]:
  """{pass: the meta of the run that timed it}; a record written before
  pass_meta credits its rows to its top-level meta."""
  pass_meta = record.get("pass_meta")
  if pass_meta is None:
    top = {k: record[k] for k in META_KEYS if k in record}
    pass_meta = {r["pass_"]: top for r in record.get("rows", [])}
  return pass_meta


def kept_parts(existing: dict, *, passes: tuple[str, ...] | None,
               section_keys) -> dict[str, dict]:
  """{part: its meta} of what a run keeps of ``existing`` (a
  performance.json's content): each pass of the grid it does not time
  (``passes``; None: it times no pass) and each section not among
  ``section_keys``."""
  timed, timed_sections = set(passes or ()), set(section_keys)
  kept = {p: m for p, m in _pass_meta(existing).items() if p not in timed}
  kept.update({f"section {k}": m for k, m in existing.get("sections", {}).items()
               if k not in timed_sections})
  return kept


def refuse_other_devices(existing: dict, device: str, *, passes: tuple[str, ...] | None,
                         section_keys) -> None:
  """A page names one device: a run on ``device`` may not keep parts of
  ``existing`` measured on another (an H100's grid beside an H200's
  section would read as one machine's numbers).  Raises ValueError naming
  the parts and both devices."""
  other = {part: m.get("device") for part, m in kept_parts(
      existing, passes=passes, section_keys=section_keys).items() if m.get("device") != device}
  if other:
    listed = ", ".join(f"{part} ({dev})" for part, dev in other.items())
    raise ValueError(f"--out-dir: this run is on {device}, and the page there keeps {listed} "
                     f"from another device; a page names one device: time those parts too "
                     f"or write to another folder")


def merged_record(existing: dict, meta: dict, *, rows: list | None, sections: dict,
                  passes: tuple[str, ...] | None = None) -> dict:
  """performance.json's content after a run: the grid's ``rows`` (None: not
  timed) replace the existing rows of the passes this run timed
  (``passes``; None: those its rows hold), each pass's provenance kept
  under ``pass_meta[PASS]`` and the run's ``meta`` at the top level; each
  timed section's rows with ``meta`` under ``sections[KEY]``; what
  ``existing`` holds of the passes and sections not timed is kept as it
  was (a record written before ``pass_meta`` credits its rows to its
  top-level meta)."""
  timed_passes = None if rows is None else tuple(
      passes if passes is not None else dict.fromkeys(r["pass_"] for r in rows))
  refuse_other_devices(existing, meta["device"], passes=timed_passes, section_keys=sections)
  record = json.loads(json.dumps(existing))  # a copy
  if rows is not None:
    timed = set(timed_passes)
    old_rows = record.get("rows", [])
    pass_meta = _pass_meta(record)
    kept = [r for r in old_rows if r["pass_"] not in timed]
    pass_meta = {p: m for p, m in pass_meta.items() if p not in timed}
    pass_meta.update({p: dict(meta) for p in timed})
    # sorted is stable: each pass keeps its rows' own order
    merged = sorted(kept + rows, key=lambda r: _pass_rank(r["pass_"]))
    record.update(meta, rows=merged,
                  pass_meta={p: pass_meta[p] for p in sorted(pass_meta, key=_pass_rank)})
  for key, section_rows in sections.items():
    record.setdefault("sections", {})[key] = dict(meta, rows=section_rows)
  return record
