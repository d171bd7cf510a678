"""Every hardware barrier the kernels use (forward and backward), declared once.

Two kinds of barrier synchronise one thread block:

* **Named barriers** (``bar.sync`` / ``bar.arrive``): 16 per block in hardware.
  Mosaic GPU itself uses ID 0 (``gpu.barrier``) and ``1 + warpgroup`` for its
  per-warpgroup barriers (``warpgroup_barrier``, ``commit_smem``), so with three
  warpgroups IDs 0..3 are taken before we start.  The kernel's own IDs are
  listed in :data:`NAMED_BARRIERS` and nowhere else; :func:`check_budget`
  refuses a plan that would run past the hardware's 16.
* **mbarriers** (shared-memory objects, one per ring slot and role): declared
  by :class:`kernel.plan.PipelinePlan`, allocated through ``plgpu.Barrier``.

A named barrier completes a generation when ``num_threads`` threads have
arrived (``bar.sync`` arrives and waits, ``bar.arrive`` only arrives); surplus
arrivals count toward the next generation.  That rule is what the proof of
the extracted protocol (``harness/proofs/extracted_proof.py``) encodes.
"""

from __future__ import annotations

import dataclasses

HW_NAMED_BARRIERS = 16  # per thread block, sm90
WARPGROUP_THREADS = 128
COMPUTE_WARPGROUPS = 2
MEMORY_WARPGROUPS = 1
NUM_WARPGROUPS = COMPUTE_WARPGROUPS + MEMORY_WARPGROUPS
# gpu.barrier() takes ID 0; Mosaic GPU's warpgroup barrier of warpgroup w is 1 + w.
MOSAIC_RESERVED_IDS = tuple(range(0, 1 + NUM_WARPGROUPS))


@dataclasses.dataclass(frozen=True)
class NamedBarrier:
  name: str
  id: int
  num_threads: int
  why: str


def _declare() -> tuple[NamedBarrier, ...]:
  first = len(MOSAIC_RESERVED_IDS)
  both_compute = COMPUTE_WARPGROUPS * WARPGROUP_THREADS
  return (
      # Pingpong: warpgroup w waits on SCHEDULE[w] before issuing its matrix
      # instructions; the other warpgroup arrives on it once it has issued its
      # own.  256 threads: 128 syncing + 128 arriving.
      NamedBarrier("schedule_wg0", first + 0, both_compute,
                   "warpgroup 0 may issue wgmma (pingpong)"),
      NamedBarrier("schedule_wg1", first + 1, both_compute,
                   "warpgroup 1 may issue wgmma (pingpong)"),
      # Both compute warpgroups are past their last read of shared tiles the
      # epilogue reuses: the forward's q/k region that the output overlays
      # (the RefUnion of the non-persistent path), the backward's K tiles that
      # stage dK after the fused dQ's last product read them.
      NamedBarrier("epilogue", first + 2, both_compute,
                   "shared tiles free for the epilogue's staging"),
      # Backward, fused dQ (kernel/backward.py): step t's dS^T tiles are both
      # staged.  One barrier per owner: warpgroup w owns the steps t with
      # t % 2 == w, syncs on ds_ready_w there and arrives on the other's
      # barrier on the other steps, so every generation is one sync and one
      # arrive (one barrier for both would let a warpgroup's arrive of step t
      # and its sync of step t + 1 complete a generation on their own).
      NamedBarrier("ds_ready_wg0", first + 3, both_compute,
                   "the dS^T tiles of an even step are staged (fused dQ)"),
      NamedBarrier("ds_ready_wg1", first + 4, both_compute,
                   "the dS^T tiles of an odd step are staged (fused dQ)"),
      # Backward, head-split dK/dV (kernel/backward.py, head dims over 128):
      # both warpgroups have staged their halves of a step's P^T and dS^T,
      # which each reads whole.  Both sync: one generation per step.
      NamedBarrier("halves_ready", first + 5, both_compute,
                   "both halves of a step's P^T and dS^T are staged (head split)"),
  )


NAMED_BARRIERS: tuple[NamedBarrier, ...] = _declare()
BY_NAME = {b.name: b for b in NAMED_BARRIERS}


def check_budget(barriers=NAMED_BARRIERS) -> None:
  """Raise if the declared IDs collide or exceed the hardware's 16."""
  ids = [b.id for b in barriers]
  if len(set(ids)) != len(ids):
    raise ValueError(f"named barrier IDs collide: {ids}")
  if set(ids) & set(MOSAIC_RESERVED_IDS):
    raise ValueError(f"named barrier IDs {ids} overlap Mosaic GPU's {MOSAIC_RESERVED_IDS}")
  used = len(MOSAIC_RESERVED_IDS) + len(barriers)
  if max(ids, default=0) >= HW_NAMED_BARRIERS or used > HW_NAMED_BARRIERS:
    raise ValueError(
        f"{used} named barriers needed (IDs up to {max(ids)}), hardware has "
        f"{HW_NAMED_BARRIERS} per block")
  for b in barriers:
    if b.num_threads % 32:
      raise ValueError(f"{b.name}: thread count {b.num_threads} is not whole warps")


check_budget()
# schedule_id and ds_ready_id compute "this warpgroup's" barrier as the first
# one's id plus the warpgroup index: the declarations must keep them adjacent.
for _pair in (("schedule_wg0", "schedule_wg1"), ("ds_ready_wg0", "ds_ready_wg1")):
  assert BY_NAME[_pair[1]].id == BY_NAME[_pair[0]].id + 1, _pair


def _bar(kind: str, barrier_id, num_threads: int) -> None:
  """Emit ``bar.sync``/``bar.arrive`` from a warpgroup.

  ``barrier_id`` may be a traced int32 (the pingpong barrier of "this"
  warpgroup is ``schedule_wg0.id + wg``), so it is passed as a register.
  """
  import jax.numpy as jnp
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def _emit(_ctx, bid):
    mgpu_utils.inline_ptx(
        f"bar.{kind} $0, {num_threads};", bid.registers[()],
        has_side_effects=True)

  _emit(jnp.asarray(barrier_id, jnp.int32))


def schedule_id(wg):
  """The pingpong barrier warpgroup ``wg`` syncs on (``wg`` may be traced)."""
  return BY_NAME["schedule_wg0"].id + wg


def schedule_sync(wg) -> None:
  """Wait until the other warpgroup lets ``wg`` issue its matrix instructions."""
  _bar("sync", schedule_id(wg), BY_NAME["schedule_wg0"].num_threads)


def schedule_release_other(wg) -> None:
  """``wg`` has issued its matrix instructions: let the other warpgroup go."""
  _bar("arrive", schedule_id(1 - wg), BY_NAME["schedule_wg0"].num_threads)


def epilogue_sync() -> None:
  b = BY_NAME["epilogue"]
  _bar("sync", b.id, b.num_threads)


def ds_ready(owner, wg) -> None:
  """Step rendezvous of the fused dQ: the step's owner waits until the other
  warpgroup has staged its dS^T; the other only signals (``owner`` and
  ``wg`` traced)."""
  from jax import lax
  b = BY_NAME["ds_ready_wg0"]
  bid = ds_ready_id(owner)
  lax.cond(wg == owner, lambda: _bar("sync", bid, b.num_threads),
           lambda: _bar("arrive", bid, b.num_threads))


def halves_ready() -> None:
  """Step rendezvous of the head-split dK/dV launch: both warpgroups have
  staged their query halves of P^T and dS^T."""
  b = BY_NAME["halves_ready"]
  _bar("sync", b.id, b.num_threads)


def ds_ready_id(owner):
  """The named barrier of the fused dQ steps that ``owner`` owns."""
  return BY_NAME["ds_ready_wg0"].id + owner
