"""What both backward kernels share: the launch context (:class:`_Launch`),
the memory warpgroup that fills their rings, and scratch allocation from the
plan's buffer descriptions."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernel import common
from kernel.common import smem
from kernel.sync import barriers, ring as ring_lib
from kernel.tiling import schedule as schedule_lib
from kernel.tiling.backward_plan import BackwardBlocks
from kernel.tiling.plan import Problem


CW = barriers.COMPUTE_WARPGROUPS


def _memory_warpgroup(load_stationary, fill, start, stop, stream: ring_lib.Ring):
  """The memory warpgroup of both kernels: 40 registers; its warp 0 issues
  the stationary tiles' copies, then fills ring step t in [start, stop) at
  position ``stream.position(t)`` with ``fill(t, st)``.  Steps 0..S-1 find
  fresh slots; every later one first waits for both compute warpgroups to
  release the slot (the forward's rule; harness/proofs/search.py checks it
  on the traced kernels)."""
  plgpu.set_max_registers(40, action="decrease")

  @plgpu.warp_map
  def _(warp):
    @pl.when(warp == 0)
    def _():
      load_stationary()

      @pl.loop(start, stop)
      def _(t):
        st = stream.position(t)
        stream.producer_acquire(st)
        fill(t, st)


def _barrier_refs(plan):
  return tuple(plgpu.Barrier(num_arrivals=b.num_arrivals, num_barriers=b.num_barriers)
               for b in plan)


# The buffers the TMA copies of the inputs fill: under untiled copies each
# allocated beside its untiled view (kernel.common.untiled_smem).
COPIED = ("q", "k", "v", "do")


def _allocate(buffers, untiled: bool = False):
  """Scratch refs for buffer descriptions (None stays None: an unused slot);
  ``untiled``: q, k, v and dO each a RefUnion of the buffer and its
  untiled view, which Mosaic GPU places on the same bytes."""
  def one(b):
    if untiled and b.name in COPIED:
      return plgpu.RefUnion(smem(b), common.untiled_smem(b))
    return smem(b)
  return tuple(None if b is None else one(b) for b in buffers)


def _copy_views(untiled: bool, named: dict):
  """({name: the ref read}, {name: the view its TMA copies use}) of
  ``named``, scratch :func:`_allocate` made: the same refs and no views
  without untiled copies; with them the untiled view, its parts moved
  behind its rows (a copy's rows land as (rows, parts, columns) of the
  global array)."""
  if not untiled:
    return named, {}
  behind = lambda u: u.transpose((0, 2, 1, 3))
  return ({n: t for n, (t, _) in named.items()},
          {n: behind(u) for n, (_, u) in named.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Launch(common.OperandRefs):
  """What the roles of both kernels read (keywords; a kernel's own fields
  come first): the launch's sizes, and inside the kernel the operands as
  refs, the grid point, the rings."""

  problem: Problem
  blocks: BackwardBlocks
  head_dim: int
  dtype: Any
  num_kv_heads: int
  group: int                # query heads per key/value head
  s_pad: int
  # The grid's launch order (None: the grid's own, head by head).
  order: schedule_lib.LaunchOrder | None = None
  # Inside the kernel (beside common.OperandRefs): the grid point, the
  # backward's own operands, and the dS staging.
  b: Any = None
  hk: Any = None
  do_ref: Any = None
  rows_ref: Any = None      # per query row: the base-2 log-sum-exp and delta
  dq_ref: Any = None
  dq_scales_ref: Any = None  # fused dQ in fixed point: per query row, its c_i (2^e)
  qlo_ref: Any = None       # dK/dV: per key tile, the query blocks that see it
  qhi_ref: Any = None
  inner_lo: Any = None      # dK/dV: the tile's query blocks [inner_lo, inner_hi) wholly
  inner_hi: Any = None      # inside every row's key range (None: no table)
  ds_st: Any = None
  exchange: Any = None      # the head split's exchange buffers (dK/dV: P^T and dS^T)
  # Under untiled copies, {buffer: the view its copies use}, which the
  # results staged in q, k or v are stored from too.
  views: Any = None

  @property
  def untiled(self) -> bool:
    return self.blocks.untiled_copies

  def copied(self, name: str, ref):
    """The ref a TMA copy of buffer ``name`` (read as ``ref``) uses:
    ``ref`` itself without untiled copies."""
    return ref if not self.views else self.views[name]
