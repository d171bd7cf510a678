"""Every hardware barrier the kernels use (forward and backward), declared once.

Two kinds of barrier synchronise one thread block:

* **Named barriers** (``bar.sync`` / ``bar.arrive``): 16 per block in hardware.
  Mosaic GPU itself uses ID 0 (``gpu.barrier``) and ``1 + warpgroup`` for its
  per-warpgroup barriers (``warpgroup_barrier``, ``commit_smem``), so with three
  warpgroups IDs 0..3 are taken before we start (0..4 with four).  The
  kernel's own IDs are declared by :func:`named_barriers` for a launch's
  number of compute warpgroups and nowhere else (:data:`NAMED_BARRIERS`: two,
  as every launch but the three-warpgroup forward has); :func:`check_budget`
  refuses a plan that would run past the hardware's 16.
* **mbarriers** (shared-memory objects, one per ring slot and role): declared
  by :class:`kernel.tiling.plan.PipelinePlan`, allocated through ``plgpu.Barrier``.

A named barrier completes a generation when ``num_threads`` threads have
arrived (``bar.sync`` arrives and waits, ``bar.arrive`` only arrives); surplus
arrivals count toward the next generation.  That rule is what the proof of
the extracted protocol (``harness/proofs/search_steps.py``) encodes.
"""

from __future__ import annotations

import dataclasses

from kernel.sync.seams import seam

# The compute warpgroup counts a config may ask for (Config.compute_warpgroups):
# the barriers of each are declared below.
COMPUTE_WARPGROUP_COUNTS = (2, 3)

HW_NAMED_BARRIERS = 16  # per thread block, sm90
WARPGROUP_THREADS = 128
# Compute warpgroups of a launch: two everywhere, three in the forward's
# Config(compute_warpgroups=3) (kernel/tiling/config.py).
COMPUTE_WARPGROUPS = 2
MEMORY_WARPGROUPS = 1
NUM_WARPGROUPS = COMPUTE_WARPGROUPS + MEMORY_WARPGROUPS


def reserved_ids(num_warpgroups: int = NUM_WARPGROUPS) -> tuple[int, ...]:
  """gpu.barrier() takes ID 0; Mosaic GPU's warpgroup barrier of warpgroup
  w is 1 + w."""
  return tuple(range(0, 1 + num_warpgroups))



@dataclasses.dataclass(frozen=True)
class NamedBarrier:
  name: str
  id: int
  num_threads: int
  why: str


def _declare(compute_warpgroups: int = COMPUTE_WARPGROUPS) -> tuple[NamedBarrier, ...]:
  cw = compute_warpgroups
  first = len(reserved_ids(cw + MEMORY_WARPGROUPS))
  pair = 2 * WARPGROUP_THREADS
  all_compute = cw * WARPGROUP_THREADS
  both_compute = COMPUTE_WARPGROUPS * WARPGROUP_THREADS
  schedule = tuple(
      # Pingpong: warpgroup w waits on its barrier before issuing its matrix
      # instructions; the warpgroup before it in the round (w - 1 mod cw)
      # arrives on it once it has issued its own.  256 threads: 128 syncing
      # + 128 arriving, with two compute warpgroups or three.
      NamedBarrier(f"schedule_wg{w}", first + w, pair,
                   f"warpgroup {w} may issue wgmma (pingpong)")
      for w in range(cw))
  first += cw
  return schedule + (
      # Every compute warpgroup is past its last read of shared tiles the
      # epilogue reuses: the forward's q/k region that the output overlays
      # (the RefUnion of the non-persistent path), the backward's K tiles that
      # stage dK after the fused dQ's last product read them.
      NamedBarrier("epilogue", first + 0, all_compute,
                   "shared tiles free for the epilogue's staging"),
      # Backward, fused dQ (kernel/backward/fused_dq.py): step t's dS^T tiles are both
      # staged.  One barrier per owner: warpgroup w owns the steps t with
      # t % 2 == w, syncs on ds_ready_w there and arrives on the other's
      # barrier on the other steps, so every generation is one sync and one
      # arrive (one barrier for both would let a warpgroup's arrive of step t
      # and its sync of step t + 1 complete a generation on their own).
      NamedBarrier("ds_ready_wg0", first + 1, both_compute,
                   "the dS^T tiles of an even step are staged (fused dQ)"),
      NamedBarrier("ds_ready_wg1", first + 2, both_compute,
                   "the dS^T tiles of an odd step are staged (fused dQ)"),
      # Backward, head-split dK/dV (kernel/backward/dkv.py, head dims over 128):
      # both warpgroups have staged their halves of a step's P^T and dS^T,
      # which each reads whole.  Both sync: one generation per step.
      NamedBarrier("halves_ready", first + 3, both_compute,
                   "both halves of a step's P^T and dS^T are staged (head split)"),
  )


_DECLARED = {cw: _declare(cw) for cw in COMPUTE_WARPGROUP_COUNTS}


def named_barriers(compute_warpgroups: int = COMPUTE_WARPGROUPS) -> tuple[NamedBarrier, ...]:
  """The named barriers of a launch with ``compute_warpgroups`` compute
  warpgroups (and one memory warpgroup)."""
  if compute_warpgroups not in _DECLARED:
    raise ValueError(f"compute_warpgroups: expected one of {COMPUTE_WARPGROUP_COUNTS}, "
                     f"got {compute_warpgroups!r}")
  return _DECLARED[compute_warpgroups]


def by_name(compute_warpgroups: int = COMPUTE_WARPGROUPS) -> dict[str, NamedBarrier]:
  return {b.name: b for b in named_barriers(compute_warpgroups)}


NAMED_BARRIERS: tuple[NamedBarrier, ...] = named_barriers()
BY_NAME = by_name()


def check_budget(barriers=NAMED_BARRIERS, num_warpgroups: int = NUM_WARPGROUPS) -> None:
  """Raise if the declared IDs collide or exceed the hardware's 16."""
  ids = [b.id for b in barriers]
  reserved = reserved_ids(num_warpgroups)
  if len(set(ids)) != len(ids):
    raise ValueError(f"named barrier IDs collide: {ids}")
  if set(ids) & set(reserved):
    raise ValueError(f"named barrier IDs {ids} overlap Mosaic GPU's {reserved}")
  used = len(reserved) + len(barriers)
  if max(ids, default=0) >= HW_NAMED_BARRIERS or used > HW_NAMED_BARRIERS:
    raise ValueError(
        f"{used} named barriers needed (IDs up to {max(ids)}), hardware has "
        f"{HW_NAMED_BARRIERS} per block")
  for b in barriers:
    if b.num_threads % 32:
      raise ValueError(f"{b.name}: thread count {b.num_threads} is not whole warps")


for _cw in COMPUTE_WARPGROUP_COUNTS:
  check_budget(named_barriers(_cw), _cw + MEMORY_WARPGROUPS)
  # schedule_id and ds_ready_id compute "this warpgroup's" barrier as the
  # first one's id plus the warpgroup index: the declarations keep them
  # adjacent.
  for _name in ("schedule_wg", "ds_ready_wg"):
    _ids = [b.id for b in named_barriers(_cw) if b.name.startswith(_name)]
    assert _ids == list(range(_ids[0], _ids[0] + len(_ids))), (_cw, _name, _ids)


def _bar(kind: str, barrier_id, num_threads: int) -> None:
  """Emit ``bar.sync``/``bar.arrive`` from a warpgroup.

  ``barrier_id`` may be a traced int32 (the pingpong barrier of "this"
  warpgroup is ``schedule_wg0.id + wg``), so it is passed as a register.
  """
  import jax.numpy as jnp
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  @seam("barriers.named")
  def _emit(_ctx, bid):
    mgpu_utils.inline_ptx(
        f"bar.{kind} $0, {num_threads};", bid.registers[()],
        has_side_effects=True)

  _emit(jnp.asarray(barrier_id, jnp.int32))


def schedule_id(wg, compute_warpgroups: int = COMPUTE_WARPGROUPS):
  """The pingpong barrier warpgroup ``wg`` syncs on (``wg`` may be traced)."""
  return by_name(compute_warpgroups)["schedule_wg0"].id + wg


def schedule_sync(wg, compute_warpgroups: int = COMPUTE_WARPGROUPS) -> None:
  """Wait until the warpgroup before ``wg`` in the round lets it issue its
  matrix instructions."""
  _bar("sync", schedule_id(wg, compute_warpgroups),
       by_name(compute_warpgroups)["schedule_wg0"].num_threads)


def schedule_release_other(wg, compute_warpgroups: int = COMPUTE_WARPGROUPS) -> None:
  """``wg`` has issued its matrix instructions: let the next warpgroup of the
  round go (the other one, with two)."""
  if compute_warpgroups == 2:
    following = 1 - wg
  else:
    from jax import lax
    import jax.numpy as jnp
    following = lax.rem(wg + 1, jnp.int32(compute_warpgroups))
  _bar("arrive", schedule_id(following, compute_warpgroups),
       by_name(compute_warpgroups)["schedule_wg0"].num_threads)


def epilogue_sync(compute_warpgroups: int = COMPUTE_WARPGROUPS) -> None:
  b = by_name(compute_warpgroups)["epilogue"]
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
