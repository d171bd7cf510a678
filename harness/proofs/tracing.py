"""What every trace of the proof shares: the kernel modules it traces (the
shipped ones, or a protocol mutant's edit of them), and the clock of what
proving costs by phase, which each learned case reports
(:func:`harness.proofs.prove_pool.prove`)."""

from __future__ import annotations

import collections
import contextlib
import time

# What proving costs, by phase (name: what ``python -m harness prove`` calls
# it when it prints the run's); each learned case reports its share.
PHASES = {"tracing": "JAX traces", "probes": "probes", "premise": "(P) by Z3",
          "search": "search", "configs": "every config at its own sizes"}
SPENT: collections.Counter = collections.Counter()   # this process's CPU seconds, and counts
TRACES = "traces"   # how many JAX traces a learned case made, beside its phases' seconds


@contextlib.contextmanager
def spending(phase: str):
  start = time.process_time()
  try:
    yield
  finally:
    SPENT[phase] += time.process_time() - start
    SPENT[f"{phase} count"] += 1


def shipped_modules():
  """The shipped kernel modules the proof traces, as
  harness.proofs.protocol_mutants.modules gives a mutant's."""
  import types
  from kernel import backward, common, forward
  from kernel.tiling import backward_plan
  return types.SimpleNamespace(forward=forward, backward=backward, common=common,
                               backward_plan=backward_plan)
