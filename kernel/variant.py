"""The switches kept for measurement and tests, not for users, as one record.

:data:`SHIPPED` is what ``dot_product_attention`` runs;
``kernel.experiments.dot_product_attention`` runs any other :class:`Variant`
(its names: ``kernel.experiments.BACKWARDS``).  Every variant computes the
same function: the tests hold each one to the same float64 rule.
"""

from __future__ import annotations

import dataclasses

BACKWARD_IMPLEMENTATIONS = ("pallas", "xla")
BACKWARD_SCHEDULES = ("paired", "serial")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One choice of every switch; the defaults ship."""

  # The custom_vjp's backward: the sm90 kernels, or their executable
  # specification in plain JAX (kernel/backward/xla.py).
  backward: str = "pallas"
  # "paired": the two products that need no register operand are issued
  # together and waited once; "serial": each product waited on its own.
  backward_schedule: str = "paired"
  # False: dQ always by its own kernel, never accumulated in the dK/dV one.
  fuse_dq: bool = True
  # Under causal, fuse dQ wherever it fits (True), nowhere (False), or where
  # kernel.tiling.backward_plan.blocks_for says (None).
  fuse_dq_causal: bool | None = None
  # The backward in the forward's 32-column rows (kernel.tiling.plan.padded_head_dims)
  # instead of whole 64-column rows (kernel.tiling.plan.backward_head_dims).
  narrow_rows: bool = False
  # False reads a 2-D bias or mask from global memory instead of staging it
  # through the ring with the keys (the same bits).
  stage_2d: bool = True
  # How packed segments' key ranges are found: one of
  # kernel.key_ranges.SEGMENT_BOUNDS (None: the shipped method).
  segment_bounds: str | None = None
  # False keeps the longest-first order's L2 sections filled to their byte
  # bound (kernel/tiling/schedule.py's longest_first).
  even_sections: bool = True
  # The longest-first order's light tiles after every section's heavy ones
  # always (True) or never (False); None where the schedule's model
  # predicts that it pays (kernel.tiling.schedule.light_last_gain).
  defer_light: bool | None = None
  # Copies of q, k, v and the output through untiled views of their
  # buffers, in column parts (kernel.tiling.plan.copy_parts): no padded copy
  # at lengths that are no multiple of 8.  Always (True), never (False), or
  # where kernel.tiling.plan.untiled_copies_pay says (None).
  untiled_copies: bool | None = None
  # True: the backward copies q, k, v and dO padded to whole tiles at every
  # length; False: only where the forward pads (a head dim computed wider, a
  # length shorter than a tile or no multiple of 8), the kernels reading
  # past the end as zeros and their stores cut at it.
  backward_whole_tiles: bool = True
  # The backward's copies of q, k, v and dO (and of its results) through
  # untiled views in column parts, as untiled_copies does the forward's: with
  # backward_whole_tiles False, no padded copy at lengths no multiple of 8.
  backward_untiled_copies: bool = False
  # A call without lengths, window or segments runs the kernels that read
  # key ranges, every row's range the whole keys (the proof reads the plain
  # kernels too: docs/proof.md, "Calls without key ranges"); too slow to
  # ship (docs/decisions/ranges-always-not-shipped.md).
  ranges_always: bool = False

  def __post_init__(self):
    for name, allowed in (("backward", BACKWARD_IMPLEMENTATIONS),
                          ("backward_schedule", BACKWARD_SCHEDULES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
    for name in ("fuse_dq", "narrow_rows", "stage_2d", "even_sections",
                 "backward_whole_tiles", "backward_untiled_copies", "ranges_always"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
    for name in ("fuse_dq_causal", "defer_light", "untiled_copies"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool or None, got {value!r}")


SHIPPED = Variant()
