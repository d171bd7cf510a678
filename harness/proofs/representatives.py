"""Every emitted config at its own sizes against the representative its case is proved at.

``python -m harness prove`` traces each forward case at one representative
config: block sizes, stages, head dims and the 16-bit dtype are taken not to
change its program beyond what the case keeps (docs/proof.md, "What is
assumed").  ``python -m harness.proofs.representatives`` tests that on every
emitted config: each, traced at its own sizes and learned from its probes,
must have its representative's program, up to the names of buffers and
barriers (the shape the search checks).  It exits 1 naming each that does
not.  A test, not a proof: (P) is proved for the representatives' kernels
only; ``prove --every-config`` proves each config's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from harness.proofs import cases


def representative_key(case: cases.ForwardCase):
  """The key of the default case an exact one (``every_config``) refines."""
  dtype = case.dtype if case.dtype.startswith("float8") else "bfloat16"
  return dataclasses.replace(case, exact=False, dtype=dtype).key()


def pairs(problems, representatives, *, differing_only: bool = False) -> list:
  """(exact case, its representative) for every config emitted for
  ``problems`` (``representatives``: the default cases, by key);
  ``differing_only``: those whose block sizes, stages or head dims differ
  from their representative's."""
  sizes = lambda c: (c.block_q, c.block_kv, c.config_stages, c.layout_head_dim,
                     c.layout_head_dim_out)
  out = []
  for case, _ in cases.forward_cases(problems, every_config=True):
    rep = representatives[representative_key(case)]
    if not differing_only or sizes(case) != sizes(rep):
      out.append((case, rep))
  return out


def shape(case: cases.ForwardCase) -> str:
  """The digest of ``case``'s program learned from its probes."""
  from harness.proofs import prove_extracted as pe
  return pe.forward_program(case, premise=False).shape_digest()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.proofs.representatives",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--jobs", type=int, default=None,
                      help="worker processes (default: the CPUs this process may run on)")
  args = parser.parse_args(argv)
  from harness.proofs import prove
  jobs = args.jobs or prove.usable_cpus()
  if jobs < 1:
    parser.error(f"--jobs: {jobs} worker processes; give 1 or more")
  start = time.perf_counter()
  grid = prove.problem_grid()
  representatives = {c.key(): c for c, _ in prove.forward_listing()}
  work = pairs(grid, representatives)
  todo = list(dict.fromkeys([rep for _, rep in work] + [case for case, _ in work]))
  if jobs == 1:
    shapes = {case: shape(case) for case in todo}
  else:
    from harness.proofs import prove_extracted as pe
    with pe.workers(jobs, fork=True) as pool:
      shapes = dict(zip(todo, pool.map(shape, todo, chunksize=16)))
  differ = [(case, rep) for case, rep in work if shapes[case] != shapes[rep]]
  for case, rep in differ:
    print(f"DIFFERS: {case.describe()} learns another program than {rep.describe()}")
  print(f"{len(work) - len(differ)} of {len(work)} emitted configs, each at its own block "
        f"sizes, stages, head dims and dtype, learn the program of the representative their "
        f"case is proved at ({len(representatives)} cases; "
        f"{len({shapes[c] for c, _ in work})} program shapes); wall time "
        f"{time.perf_counter() - start:.1f} s ({jobs} worker(s))")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
