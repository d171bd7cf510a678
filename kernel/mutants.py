"""Deliberate defects the harness must catch, switched on only by tests.

Each name is a private variant of the kernel that reproduces one known bug
class (../shared/GUIDE.md).  A test that runs a mutant asserts that the
harness *fails* on it, so the properties are shown able to fail.  Nothing
outside tests and the golden/gate demonstration selects one.

The variable :data:`ENV` lets a child process (``python -m harness golden
check`` run by the gate) run a mutant: ``harness.conformance.run_kernel``
reads it; the public API never does.
"""

from __future__ import annotations

ENV = "FLASH_KERNEL_MUTANT"

# m stored in base 2: outputs right, gradients quietly wrong (seed 000).
RESIDUAL_M_BASE2 = "residual-m-base2"
# The persistent loop forgets prev_iters: the ring position restarts at 0 on
# every tile, so the producer treats a tile's first num_stages slots as fresh
# and refills them without waiting for the consumers (tilelang PR #2674).
NO_PREV_ITERS_CARRY = "no-prev-iters-carry"
# The rescale_threshold branch altered: when it rescales, the accumulator is
# scaled and the running sum l is not.  (Inverting the guard would not do:
# acc and l share the pending scale, so when to rescale changes only rounding;
# this is a deliberate numerical change the golden check must fail.)
THRESHOLD_BRANCH_SKIPS_L = "threshold-branch-skips-l"

ALL = (RESIDUAL_M_BASE2, NO_PREV_ITERS_CARRY, THRESHOLD_BRANCH_SKIPS_L)


def check(name: str | None) -> str | None:
  if name is not None and name not in ALL:
    raise ValueError(f"_mutant: unknown kernel mutant {name!r}; known: {', '.join(ALL)}")
  return name


def from_env() -> str | None:
  """The mutant a harness child process was asked to run (:data:`ENV`)."""
  import os
  return check(os.environ.get(ENV) or None)
