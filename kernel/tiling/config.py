"""The forward kernel's tiling configuration."""

from __future__ import annotations

import dataclasses

# The counts whose barriers the barrier module declares.
from kernel.sync.barriers import COMPUTE_WARPGROUP_COUNTS

SMEM_LIMIT_BYTES = 227 * 1024  # usable shared memory per block on sm90
MAX_STAGES = 4
# kernel/tiling/schedule.py: the order query tiles run in.  "round-robin": the grid's
# own order (persistent: the grid dealt to the SMs in turn, query tiles
# fastest).  "longest-first": heaviest tiles first inside L2 sections of kv
# heads, dealt to the least-loaded SM when persistent.  "split-tail"
# (persistent, non-causal): round-robin but for the last wave or two, whose
# tiles' key blocks are cut evenly over the SMs and merged after the kernel.
SCHEDULES = ("round-robin", "longest-first", "split-tail")


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of one thread block.

  block_q: query rows per compute warpgroup (the block handles
    ``compute_warpgroups * block_q``: :attr:`tile_q`).
  block_kv: keys per ring slot.
  num_stages: depth of the key/value ring in shared memory.
  persistent: one block per SM looping over the grid (kernel/forward/context.py's
    for_each_tile).
  schedule: the order tiles run in, one of :data:`SCHEDULES`
    (kernel/tiling/schedule.py; "split-tail" with persistent blocks only, and not
    under a causal mask: kernel/tiling/plan.py's ``schedule_refusal``).
  compute_warpgroups: 2, or 3 (FlashAttention-3's 192-row tiles at head dim
    64, where the softmax is as long as the matrix products and a third
    warpgroup keeps the tensor cores fed while two run theirs); each then
    gets fewer registers (kernel/forward/context.py: ``COMPUTE_REGISTERS``), so
    three run head dims up to 64 in one tiling (kernel/tiling/plan.py:
    ``warpgroups_refusal``).  Three win at some shapes and lose at others, so
    the autotuner decides (kernel/tiling/autotune_cache.json;
    docs/decisions/three-compute-warpgroups.md).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  persistent: bool = False
  schedule: str = "round-robin"
  compute_warpgroups: int = 2

  @property
  def tile_q(self) -> int:
    """Query rows per tile: one block_q per compute warpgroup."""
    return self.compute_warpgroups * self.block_q

  def __post_init__(self):
    for name in ("block_q", "block_kv", "num_stages", "compute_warpgroups"):
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
    if self.compute_warpgroups not in COMPUTE_WARPGROUP_COUNTS:
      raise ValueError(f"config.compute_warpgroups must be one of {COMPUTE_WARPGROUP_COUNTS}, "
                       f"got {self.compute_warpgroups}")
