"""The forward kernel's tiling configuration."""

from __future__ import annotations

import dataclasses

SMEM_LIMIT_BYTES = 227 * 1024  # usable shared memory per block on sm90
MAX_STAGES = 4
# kernel/schedule.py: the order query tiles run in.  "round-robin": the grid's
# own order (persistent: the grid dealt to the SMs in turn, query tiles
# fastest).  "longest-first": heaviest tiles first inside L2 sections of kv
# heads, dealt to the least-loaded SM when persistent.
SCHEDULES = ("round-robin", "longest-first")


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of one thread block.

  block_q: query rows per compute warpgroup (the block handles 2 * block_q).
  block_kv: keys per ring slot.
  num_stages: depth of the key/value ring in shared memory.
  persistent: one block per SM looping over the grid (see kernel/forward.py).
  schedule: the order tiles run in, one of :data:`SCHEDULES`.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  persistent: bool = False
  schedule: str = "round-robin"

  def __post_init__(self):
    for name in ("block_q", "block_kv", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config.{name} must be an int, got {value!r}")
    if self.block_q not in (64, 128):
      raise ValueError(f"config.block_q must be 64 or 128, got {self.block_q}")
    if self.block_kv not in (64, 128, 256):
      raise ValueError(f"config.block_kv must be 64, 128 or 256, got {self.block_kv}")
    if not 2 <= self.num_stages <= MAX_STAGES:
      raise ValueError(
          f"config.num_stages must be in [2, {MAX_STAGES}], got {self.num_stages}")
    if not isinstance(self.persistent, bool):
      raise ValueError(f"config.persistent must be a bool, got {self.persistent!r}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"config.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
