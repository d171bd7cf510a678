"""Autotuning on the GPU: time every candidate config, keep the fastest.

The candidates are ``kernel.heuristics.get_autotuning_configs`` (each already
filtered by ``kernel.plan.config_fits``).  The winner is written to the cache
that ``kernel/autotune.py`` reads for ``config=None``, under the signature of
``kernel.autotune.selection_problem``, so what is tuned is what is found.

``python -m harness autotune`` (or ``python -m harness.tools.autotune``) tunes
:data:`COMMON_SHAPES` and writes ``kernel/autotune_cache.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from kernel import autotune, heuristics, plan
from kernel.config import Config


def record(problem: plan.Problem, device_kind: str, config: Config, timings_ms: dict,
           *, path: Path | None = None, **features) -> None:
  path = autotune.CACHE_PATH if path is None else path
  data = autotune.load_cache(path)
  data.setdefault(device_kind, {})[autotune.signature(problem, **features)] = {
      "config": dataclasses.asdict(config),
      "median_ms": timings_ms,
  }
  path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def tune(problem: plan.Problem, run, *, candidates=None) -> tuple[Config, dict]:
  """Time ``run(config) -> seconds`` for every candidate; return the fastest
  and every timing (ms).  Candidates that fail to compile are skipped."""
  candidates = candidates or heuristics.get_autotuning_configs(problem)
  timings = {}
  for config in candidates:
    try:
      timings[str(config)] = run(config) * 1e3
    except Exception as err:  # a candidate the compiler rejects is not the best
      timings[str(config)] = f"{type(err).__name__}: {str(err)[:120]}"
  timed = {c: t for c, t in zip(candidates, (timings[str(c)] for c in candidates))
           if isinstance(t, float)}
  if not timed:
    raise RuntimeError(f"no candidate ran: {timings}")
  best = min(timed, key=timed.get)
  return best, timings


COMMON_SHAPES = (  # (batch, seq, heads, head_dim, causal)
    (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
    (16, 1024, 16, 128, False), (16, 1024, 16, 128, True),
    (1, 16384, 16, 128, False), (1, 16384, 16, 128, True),
    (4, 4096, 32, 64, False), (4, 4096, 8, 256, False),
)


def _shapes(args) -> list[tuple]:
  if args.causal_grid:
    from harness.tools.bench_grid import grid_points
    return [(p.batch, p.seq, p.heads, p.head_dim, True)
            for p in grid_points(backward=False, ragged=False) if p.causal]
  if args.shapes == "all":
    return list(COMMON_SHAPES)
  return [COMMON_SHAPES[int(i)] for i in args.shapes.split(",")]


def main(argv=None) -> int:
  import jax
  import jax.numpy as jnp
  from harness.tools.bench import BenchShape, _inputs, time_fns
  from kernel import api
  parser = argparse.ArgumentParser(prog="python -m harness autotune")
  parser.add_argument("--cache", default=str(autotune.CACHE_PATH))
  parser.add_argument("--shapes", default="all",
                      help="comma-separated indices into COMMON_SHAPES, or 'all'")
  parser.add_argument("--report", default=None,
                      help="JSON file for every timing and the heuristic's")
  parser.add_argument("--causal-grid", action="store_true",
                      help="tune the causal points of bench --grid (head dim 64/128/256, "
                           "1k-16k, 16k tokens per batch) instead of --shapes")
  parser.add_argument("--candidates", default=None,
                      help="';'-separated configs as bench --grid --variants spells them "
                           "(e.g. '64,128,2,p,lf;64,64,2,lf'); those that fit are timed "
                           "beside the heuristic's pick. Default: every autotuning candidate")
  args = parser.parse_args(argv)
  device = api.sm90_device()
  if device is None:
    raise SystemExit("autotune: needs an sm90 GPU")
  shapes = _shapes(args)
  restricted = None
  if args.candidates:
    from harness.tools.bench_grid import parse_variant
    restricted = [parse_variant(t.strip()) for t in args.candidates.split(";") if t.strip()]
    if any(c is None for c in restricted):
      raise SystemExit("autotune: --candidates takes configs, not 'auto'")
  report = []
  for batch, seq, heads, d, causal in shapes:
    shape = BenchShape(batch, seq, heads, d, causal)
    inputs = _inputs(shape, 3)
    problem = autotune.selection_problem(plan.problem_for(
        inputs[0][0].shape, inputs[0][1].shape, inputs[0][2].shape, jnp.bfloat16,
        is_causal=causal))

    def run(config):
      fn = jax.jit(lambda q, k, v: api.dot_product_attention(q, k, v, is_causal=causal,
                                                             config=config))
      return time_fns({"x": fn}, inputs, trials=5, burst=10)["x"]

    candidates = None
    if restricted is not None:
      candidates = [heuristics.get_heuristics_config(problem)]
      candidates += [c for c in restricted
                     if plan.config_fits(problem, c) and c not in candidates]
    best, timings = tune(problem, run, candidates=candidates)
    record(problem, device.device_kind, best, timings, path=Path(args.cache))
    heuristic = heuristics.get_heuristics_config(problem)
    h_ms = timings.get(str(heuristic))
    report.append(dict(shape=(batch, seq, heads, d, causal), signature=autotune.signature(problem),
                       best=str(best), best_ms=timings[str(best)], heuristic=str(heuristic),
                       heuristic_ms=h_ms, timings_ms=timings))
    print(f"{autotune.signature(problem)}: {best} {timings[str(best)]:.3f} ms; heuristic "
          f"{heuristic} {h_ms if isinstance(h_ms, str) else f'{h_ms:.3f} ms'}", flush=True)
    if args.report:
      Path(args.report).write_text(json.dumps(
          dict(device=device.device_kind, jax=jax.__version__, shapes=report), indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
