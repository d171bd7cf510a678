"""Run a kernel mutant (kernel/mutants.py) on cases built to expose it.

``python -m harness.mutant_run NAME [--cases SET]`` prints one JSON line per
case: ``{"case": ..., "passed": bool, "detail": ...}`` and exits 0 once every
case has run, whatever the verdicts.  A mutant may also hang the GPU (a
producer that no longer waits can leave a consumer waiting on a fill that
never comes), so tests run this in a child process under a timeout and count
a timeout, or a crash, as the mutant being caught.
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
  from harness.conformance import random_case
  from kernel.config import Config
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
  tile_len[:, :, ::3] = 0
  c.k_start = np.repeat(tile_start, 128, axis=2).astype(np.int32)
  c.k_end = np.repeat(np.minimum(tile_start + tile_len, 1024), 128, axis=2).astype(np.int32)
  cases.append(("key-ranges-with-empty-tiles", c, Config(64, 128, 2, True)))
  return cases


CASE_SETS = {"carry": carry_cases}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.mutant_run")
  parser.add_argument("mutant", help="a name from kernel.mutants.ALL, or 'none'")
  parser.add_argument("--cases", default="carry", choices=sorted(CASE_SETS))
  args = parser.parse_args(argv)
  from harness.conformance import check_forward, poison_device_memory, run_kernel
  mutant = None if args.mutant == "none" else args.mutant
  for name, case, config in CASE_SETS[args.cases]():
    poison_device_memory(4 * case.query.nbytes)
    try:
      out, m, l = run_kernel(case, config=config, mutant=mutant)
      report = check_forward(case, out, m, l)
      line = dict(case=name, passed=report.passed, detail=report.summary())
    except Exception as err:  # a crash is a caught mutant too
      line = dict(case=name, passed=False, detail=f"{type(err).__name__}: {err}"[:300])
    print(json.dumps(line), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
