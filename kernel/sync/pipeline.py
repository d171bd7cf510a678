"""The stage ring's read/write position: one small object for the kernel and the proof.

Like CUTLASS's ``PipelineState`` (``{index, phase, count}``): ``index`` is the ring
slot, ``phase`` the parity bit of the slot's mbarrier generation, ``count`` the
global number of key blocks this position has moved past.  Advancing wraps the
index at ``num_stages`` and flips the phase on the wrap.

The kernel never derives a slot inline: it builds a state from the *global*
block count (``prev_iters`` plus the tile-local step, so the ring keeps its
phase across the persistent grid loop) and hands it to the verbs of
:class:`kernel.sync.ring.Ring`, which read ``index`` (and :attr:`refills`).

Mosaic GPU tracks mbarrier parity implicitly (one bit per barrier, flipped by
every wait), so the kernel only reads ``index``; the bit it waits on equals
``phase`` as long as every actor waits on the slots in ring order, which is
what the proof checks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kernel.sync.seams import seam


def _rem(x: Any, n: int) -> Any:
  """x mod n for Python ints and traced int32 scalars alike (x >= 0)."""
  if isinstance(x, int):
    return x % n
  from jax import lax  # local: keeps this module importable without tracing
  import jax.numpy as jnp
  return lax.rem(x, jnp.asarray(n, x.dtype))


def _div(x: Any, n: int) -> Any:
  if isinstance(x, int):
    return x // n
  from jax import lax
  import jax.numpy as jnp
  return lax.div(x, jnp.asarray(n, x.dtype))


@dataclasses.dataclass(frozen=True)
class PipelineState:
  """Position in a ``num_stages``-deep ring (see module docstring)."""

  num_stages: int
  index: Any = 0
  phase: Any = 0
  count: Any = 0

  def __post_init__(self):
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")

  @classmethod
  def at(cls, num_stages: int, count: Any) -> "PipelineState":
    """The state reached from the start after ``count`` advances."""
    wraps = _div(count, num_stages)
    return cls(num_stages, _rem(count, num_stages), _rem(wraps, 2), count)

  @classmethod
  def producer_start(cls, num_stages: int) -> "PipelineState":
    """The producer's start: phase 1, so its first round of waits on fresh
    "consumed" barriers is already satisfied (CUTLASS's convention)."""
    return cls(num_stages, 0, 1, 0)

  def advance(self, n: int = 1) -> "PipelineState":
    """Concrete advance (Python ints only): wrap the index, flip the phase."""
    if not isinstance(self.index, int):
      raise TypeError("advance() is for concrete states; use at() for traced counts")
    index, phase = self.index, self.phase
    for _ in range(n):
      index += 1
      if index == self.num_stages:
        index, phase = 0, phase ^ 1
    return PipelineState(self.num_stages, index, phase, self.count + n)

  @functools.cached_property
  @seam("pipeline.refills")
  def refills(self) -> Any:
    """Whether the producer's fill at this position reuses a slot that
    consumers held: from the ``num_stages``-th fill on.  The first round
    finds fresh slots (CUTLASS starts the producer at phase 1 for the same
    effect: :meth:`producer_start`).  Computed once per state: the producer
    asks it for each buffer phase it fills at this position."""
    return self.count >= self.num_stages
