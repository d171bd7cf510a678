"""The mbarrier handshakes of every kernel, behind role verbs.

A :class:`Ring` is ``num_stages`` slots of shared memory, each holding one
block of each of the ring's buffers: the forward's key phase (k and, when
staged, the block's bias and mask tiles), its value phase (v), the
backward's streamed blocks (q, dO and the residual rows, or k and v).  Per
slot and buffer there is one "produced" mbarrier, completed by the TMA copy
that fills it; per slot one "consumed" mbarrier, on which every consumer
warpgroup arrives once it is done with the slot (its arrival count is the
number of consumers: kernel/tiling/plan.py declares both).  Like CUTLASS's
``PipelineTmaAsync``, a kernel sees role verbs only, never a barrier array,
so each protocol step has a name that a reader and the extractor
(harness/proofs/extract.py, which names barrier arrays after the ring and buffer a
verb's call names) can find:

producer (the memory warpgroup's copy warp), at position ``st``:
  ``producer_acquire(st)``: wait until every consumer released the slot;
      skipped for the first ``num_stages`` fills, which find fresh slots
      (:attr:`kernel.sync.pipeline.PipelineState.refills`).
  ``producer_copy(src, st, buffer)``: TMA ``src`` into the slot's buffer;
      the copy itself completes the buffer's produced barrier, so it is also
      CUTLASS's ``producer_commit``.
consumer (each compute warpgroup):
  ``consumer_wait(st, buffer)``: until that buffer's copy into the slot landed;
  ``slot(st, buffer)``: the slot's buffer, to read;
  ``consumer_release(st)``: done with every buffer of the slot.

Positions are :class:`kernel.sync.pipeline.PipelineState` values built from the
global block count (:meth:`Ring.position`): a persistent kernel carries the
count across tiles (``prev_iters``), so the ring keeps its phase.  Mosaic GPU
keeps the wait parity itself (one bit per barrier, flipped by each wait), so
every actor must wait on the slots in ring order; the extracted proof
checks that it does.

There is no ``producer_tail``: CUTLASS's makes the producer wait for the
last releases so that its block does not exit while consumers in other
blocks of a cluster may still arrive on its barriers.  Here every consumer
is in the producer's own block, whose shared memory lives until its last
warp has exited, and no copy is multicast.

:class:`WarpgroupSlots` is the one-slot-per-warpgroup variant: warpgroup w
reads only slot w (the forward's queries, refilled per tile; the backward's
stationary tiles, filled once).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from kernel.sync.pipeline import PipelineState


def _name(buffers, buffer):
  """``buffer``; None: the first, the ring's own."""
  return next(iter(buffers)) if buffer is None else buffer


def _pick(buffers, buffer):
  """(ref, produced) of ``buffer`` (:func:`_name`)."""
  return buffers[_name(buffers, buffer)]


def _copy_target(buffers, copy_views, buffer):
  """(the ref a TMA copy into ``buffer`` writes, its produced barriers):
  its view in ``copy_views`` where it has one, else the ref read."""
  name = _name(buffers, buffer)
  ref, produced = buffers[name]
  return copy_views.get(name, ref), produced


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ``num_stages``-deep stage ring (see the module docstring).

  ``buffers``: name -> (smem ref with the slot as its leading dim, its
  produced mbarriers), in the order the producer fills them; the first is
  the ring's default ``buffer``.  ``consumed``: one mbarrier per slot.
  ``copy_views``: name -> the view of that buffer's bytes its TMA copies
  write, where it is not the ref the consumers read (kernel.tiling.plan's untiled
  copies)."""

  num_stages: int
  buffers: Mapping[str, tuple[Any, Any]]
  consumed: Any
  copy_views: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def position(self, count) -> PipelineState:
    """The position of the ``count``-th block through this ring (global,
    counted from the kernel's start)."""
    return PipelineState.at(self.num_stages, count)

  def _buffer(self, buffer):
    return _pick(self.buffers, buffer)

  # -- producer ----------------------------------------------------------------
  def producer_acquire(self, st: PipelineState) -> None:
    """Wait until every consumer released slot ``st.index`` (not for the first
    ``num_stages`` fills)."""
    pl.when(st.refills)(lambda: plgpu.barrier_wait(self.consumed.at[st.index]))

  def producer_copy(self, src, st: PipelineState, buffer: str | None = None) -> None:
    """TMA ``src`` into the slot's ``buffer``; completes its produced barrier."""
    ref, produced = _copy_target(self.buffers, self.copy_views, buffer)
    plgpu.copy_gmem_to_smem(src, ref.at[st.index], produced.at[st.index])

  # -- consumer ----------------------------------------------------------------
  def consumer_wait(self, st: PipelineState, buffer: str | None = None) -> None:
    """Wait until the copy of ``buffer`` into slot ``st.index`` has landed."""
    plgpu.barrier_wait(self._buffer(buffer)[1].at[st.index])

  def slot(self, st: PipelineState, buffer: str | None = None, *index):
    """The shared memory of ``buffer`` in slot ``st.index`` (``index``: more
    leading indices into it, in the same indexer)."""
    return self._buffer(buffer)[0].at[(st.index, *index)]

  def consumer_release(self, st: PipelineState) -> None:
    """This consumer is done with every buffer of slot ``st.index``."""
    plgpu.barrier_arrive(self.consumed.at[st.index])


@dataclasses.dataclass(frozen=True)
class WarpgroupSlots:
  """One slot per compute warpgroup ``w``, whose barriers warpgroup w waits
  on: ``buffers`` as in :class:`Ring`, with the warpgroup as the leading
  dim; ``consumed`` (one mbarrier per warpgroup, one arrival) where a slot is
  refilled, None where it is filled once; ``copy_views`` as in :class:`Ring`."""

  buffers: Mapping[str, tuple[Any, Any]]
  consumed: Any = None
  copy_views: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def _buffer(self, buffer):
    return _pick(self.buffers, buffer)

  def producer_acquire(self, w, refill) -> None:
    """Where ``refill`` (a traced bool: the slot was filled before), wait
    until warpgroup ``w`` released its slot."""
    pl.when(refill)(lambda: plgpu.barrier_wait(self.consumed.at[w]))

  def producer_copy(self, src, w, buffer: str | None = None) -> None:
    ref, produced = _copy_target(self.buffers, self.copy_views, buffer)
    plgpu.copy_gmem_to_smem(src, ref.at[w], produced.at[w])

  def consumer_wait(self, w, buffer: str | None = None) -> None:
    plgpu.barrier_wait(self._buffer(buffer)[1].at[w])

  def slot(self, w, buffer: str | None = None, *index):
    return self._buffer(buffer)[0].at[(w, *index)]

  def consumer_release(self, w) -> None:
    plgpu.barrier_arrive(self.consumed.at[w])
