"""Autotuning: time every candidate config on the GPU, keep the fastest.

The candidates are ``kernel.heuristics.get_autotuning_configs`` (each already
filtered by the shared-memory estimate).  Results are kept per
(device, shape signature, dtype, features) in a JSON cache; the cache shipped
with the package (``autotune_cache.json`` beside this file) holds common H200
shapes, and ``config=None`` uses it when it has the call's signature, else the
heuristic (``kernel/api.py``).

``python -m kernel.autotune`` tunes a list of shapes on the GPU and writes the
cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from kernel import heuristics, plan
from kernel.config import Config

CACHE_PATH = Path(__file__).with_name("autotune_cache.json")


def _pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def selection_problem(problem: plan.Problem) -> plan.Problem:
  """The problem a config is chosen (and tuned) for: with residuals, so the
  choice also fits the forward of ``jax.grad``, which stores them for the
  backward.  The API's lookup and the tuner both go through here, so what is
  tuned is what is found."""
  return dataclasses.replace(problem, return_residuals=True)


def signature(problem: plan.Problem, *, has_bias=False, has_mask=False,
              has_key_ranges=False) -> str:
  """Calls that share a signature share a best config: sequence lengths are
  bucketed to the next power of two."""
  return (f"{plan.np.dtype(problem.dtype).name}-d{problem.head_dim}-dv{problem.head_dim_out}"
          f"-q{_pow2(problem.seq_q)}-kv{_pow2(problem.seq_kv)}"
          f"-{'causal' if problem.is_causal else 'full'}"
          f"{'-bias' if has_bias else ''}"
          f"{'-mask' if has_mask else ''}{'-ranges' if has_key_ranges else ''}")


def load_cache(path: Path | None = None) -> dict:
  path = CACHE_PATH if path is None else path
  if not path.exists():
    return {}
  data = json.loads(path.read_text())
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object of device -> signature -> entry")
  return data


def lookup(problem: plan.Problem, device_kind: str, *, path: Path | None = None,
           **features) -> Config | None:
  """The cached best config, if it is still a legal candidate for the problem."""
  entry = load_cache(path).get(device_kind, {}).get(signature(problem, **features))
  if entry is None:
    return None
  config = Config(**entry["config"])
  # A cache written for another shape in the same bucket must still fit.
  if not plan.config_fits(problem, config):
    return None
  return config


def choose(problem: plan.Problem, device_kind: str | None, **features) -> Config:
  """``config=None``: the autotuned config when cached, else the heuristic."""
  if device_kind:
    cached = lookup(problem, device_kind, **features)
    if cached is not None:
      return cached
  return heuristics.get_heuristics_config(problem)


def record(problem: plan.Problem, device_kind: str, config: Config, timings_ms: dict,
           *, path: Path | None = None, **features) -> None:
  path = CACHE_PATH if path is None else path
  data = load_cache(path)
  data.setdefault(device_kind, {})[signature(problem, **features)] = {
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


def main(argv=None) -> int:
  import jax
  import jax.numpy as jnp
  from harness.bench import BenchShape, _inputs, time_fns
  from kernel import api
  parser = argparse.ArgumentParser(prog="python -m kernel.autotune")
  parser.add_argument("--cache", default=str(CACHE_PATH))
  parser.add_argument("--shapes", default="all",
                      help="comma-separated indices into COMMON_SHAPES, or 'all'")
  parser.add_argument("--report", default=None,
                      help="JSON file for every timing and the heuristic's")
  args = parser.parse_args(argv)
  device = api.sm90_device()
  if device is None:
    raise SystemExit("autotune: needs an sm90 GPU")
  picks = (range(len(COMMON_SHAPES)) if args.shapes == "all"
           else [int(i) for i in args.shapes.split(",")])
  report = []
  for index in picks:
    batch, seq, heads, d, causal = COMMON_SHAPES[index]
    shape = BenchShape(batch, seq, heads, d, causal)
    inputs = _inputs(shape, 3)
    problem = selection_problem(plan.problem_for(
        inputs[0][0].shape, inputs[0][1].shape, inputs[0][2].shape, jnp.bfloat16,
        is_causal=causal))

    def run(config):
      fn = jax.jit(lambda q, k, v: api.dot_product_attention(q, k, v, is_causal=causal,
                                                             config=config))
      return time_fns({"x": fn}, inputs, trials=5, burst=10)["x"]

    best, timings = tune(problem, run)
    record(problem, device.device_kind, best, timings, path=Path(args.cache))
    heuristic = heuristics.get_heuristics_config(problem)
    h_ms = timings.get(str(heuristic))
    report.append(dict(shape=COMMON_SHAPES[index], signature=signature(problem),
                       best=str(best), best_ms=timings[str(best)], heuristic=str(heuristic),
                       heuristic_ms=h_ms, timings_ms=timings))
    print(f"{signature(problem)}: {best} {timings[str(best)]:.3f} ms; heuristic "
          f"{heuristic} {h_ms if isinstance(h_ms, str) else f'{h_ms:.3f} ms'}", flush=True)
    if args.report:
      Path(args.report).write_text(json.dumps(
          dict(device=device.device_kind, jax=jax.__version__, shapes=report), indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
