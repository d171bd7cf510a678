"""The backward's tiling and shared-memory plan, as data.

:func:`blocks_for` chooses the two kernels' tiling; the buffer and mbarrier
descriptions here are what kernel/backward/dkv.py and dq.py allocate, so the
estimate (:func:`smem_estimates`) is computed from the scratch the kernels
allocate, under the forward's fit predicate (kernel.tiling.plan.fits_in_smem).
Pure Python, like the forward's plan."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from kernel.sync.barriers import COMPUTE_WARPGROUPS as CW
from kernel.tiling import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class BackwardBlocks:
  """Tiling of the two kernels.  Each compute warpgroup owns 64 stationary
  rows (wgmma's M); the streamed block is the other matmul dimension."""

  dkv_stream_q: int     # query rows per streamed block in dkv
  dq_stream_kv: int     # key rows per streamed block in dq
  num_stages: int
  rows: int = 64        # stationary rows per compute warpgroup
  # "paired": the two products that need no register operand (S and dP) are
  # issued together and waited once, and so are the two that update the
  # accumulators; "serial": each product waited on its own (the first version,
  # kept to measure the difference in one process).
  schedule: str = "paired"
  # Under causal: whether dK/dV's kernel also accumulates dQ (where it fits:
  # fused_dq_fits): head dims up to 64 (docs/decisions/fused-dq-causal.md).
  fuse_dq_causal: bool = False
  # Both kernels' compute warpgroups share ONE stationary tile of 64 rows
  # and split the head dim of its accumulators (the notes above
  # EXCHANGE_BUFFERS, and kernel/backward/dq.py's on the head-split dQ
  # kernel): head dims over 128, whose whole dK and dV would not
  # fit in 232 registers.
  head_split: bool = False
  # False: dQ always by its own kernel, never accumulated in the dK/dV one
  # (where fuses_dq would allow it).
  fuse_dq: bool = True
  # True: q, k, v and dO copied padded to whole tiles at every length;
  # False: only where the forward pads them (kernel.padding.backward_inputs).
  whole_tiles: bool = True
  # q, k, v and dO (and the results staged in their buffers) copied through
  # untiled views in column parts (:func:`part_rows`): no padded copy at a length
  # that is no multiple of 8 (docs/decisions/backward-untiled-copies.md).
  untiled_copies: bool = False

  @property
  def dq_tile(self) -> int:
    """Query rows per dQ block (both compute warpgroups; one shared tile
    under ``head_split``), the tile of the key-range bounds and of the dS
    blocks the dQ kernel writes."""
    return self.rows if self.head_split else CW * self.rows

  @property
  def dkv_tile(self) -> int:
    """Keys per dK/dV block (both compute warpgroups; one shared tile
    under ``head_split``)."""
    return self.rows if self.head_split else CW * self.rows

  @property
  def query_multiple(self) -> int:
    """Query rows are padded to a multiple of this: whole dQ tiles and
    whole streamed blocks of the dK/dV kernel."""
    return math.lcm(self.dq_tile, self.dkv_stream_q)

  @property
  def key_multiple(self) -> int:
    """Keys are padded to a multiple of this: whole dK/dV tiles and whole
    streamed blocks of the dQ kernel."""
    return math.lcm(self.dkv_tile, self.dq_stream_kv)


def blocks_for(head_dim: int, head_dim_out: int, *, causal: bool) -> BackwardBlocks:
  """Streamed blocks are 64 rows, but for the dK/dV kernel's at head dims
  up to 64 without causal (below).  Head dims over 128 take the head split,
  with two stages in both kernels.

  The dK/dV kernel streams 128 query rows per block at head dims up to 64
  when not causal: S^T = K Q^T and dP^T = V dO^T, both operands in shared
  memory, are then wgmma's of N = 128.  At N = 64 an instruction's
  shared-memory reads take about as long as its tensor-core work, so any
  other shared-memory traffic stalls the products; at N = 128 they are
  compute-bound (S^T and dP^T take 64 registers each, dK and dV 32 each:
  it fits in 232).  Under causal the 128-row kernel spills (register
  pressure, even with the register selects of kernel/masks), and what it
  loses at ragged GQA lengths outweighs what it gains elsewhere, so causal
  stays at 64 rows (docs/decisions/dkv-128-query-rows.md).  The dQ kernel
  streams 64 keys per block: 128 changed nothing beyond noise
  (docs/decisions/dq-64-key-blocks.md).

  Head dims over 128 take the head split in both kernels, two stages each:
  dK and dV in separate launches beside a one-stage dQ kernel ran slower,
  and so did accumulating dQ in the dK/dV launch as well (whose f32
  staging leaves room for one stage only), so it is not offered there
  (docs/decisions/head-split.md).

  Under causal, head dims up to 64 fuse dQ into the dK/dV kernel; at head
  dim 128 the dQ kernel stays: there the fused dQ's per-step reduce-adds
  weigh more against the dQ kernel's recomputed S and dP, and it won at too
  few shapes, with no reason known, for a rule by length
  (docs/decisions/fused-dq-causal.md).

  Under causal both kernels' grids launch in sections of heads, heaviest
  tiles first across a section (:func:`dkv_launch_order`,
  :func:`dq_launch_order`; the fused dQ, and any grid under a local
  window, only where the dealing model predicts a gain:
  docs/decisions/backward-causal-launch-order.md)."""
  width = max(head_dim, head_dim_out)
  wide = width > 128
  return BackwardBlocks(dkv_stream_q=128 if width <= 64 and not causal else 64,
                        dq_stream_kv=64, num_stages=2,
                        fuse_dq_causal=width <= 64, head_split=wide)


def _mbarriers(kind: str, stages: int, streamed: tuple[str, ...],
               stationary: tuple[str, ...], *,
               stationary_tiles: int = CW) -> tuple[plan_lib.MBarrier, ...]:
  """The backward's mbarrier plan, in the forward's vocabulary (plan.MBarrier)."""
  mb = [plan_lib.MBarrier(f"{n}_stationary", stationary_tiles, 1,
                          f"{kind}: TMA of a stationary {n} tile landed")
        for n in stationary]
  mb += [plan_lib.MBarrier(f"{n}_produced", stages, 1, f"{kind}: TMA of {n} into a slot landed")
         for n in streamed]
  mb.append(plan_lib.MBarrier("consumed", stages, CW,
                              f"{kind}: both warpgroups finished with a slot"))
  return tuple(mb)


def dkv_mbarriers(blocks: BackwardBlocks) -> tuple[plan_lib.MBarrier, ...]:
  """The dK/dV kernel's mbarriers, allocated by :func:`dkv_call` (and
  counted by :func:`launch_smem_bytes`)."""
  return _mbarriers("dkv", blocks.num_stages, ("q", "do", "rows"), ("k", "v"),
                    stationary_tiles=1 if blocks.head_split else CW)


def dq_mbarriers(blocks: BackwardBlocks) -> tuple[plan_lib.MBarrier, ...]:
  """The dQ kernel's mbarriers (see :func:`dkv_mbarriers`)."""
  return _mbarriers("dq", blocks.num_stages, ("k", "v"), ("q", "do", "rows"),
                    stationary_tiles=1 if blocks.head_split else CW)


def launches(head_dim: int, head_dim_out: int, *, with_bias: bool = True,
             causal: bool = True,
             fuse_dq: bool = True) -> list[tuple[str, tuple[plan_lib.MBarrier, ...]]]:
  """Every kernel launch of one backward, with its mbarrier plan, in order
  (the dQ kernel only where the fused dQ does not apply: :func:`fuses_dq`,
  or ``fuse_dq`` is False: kernel.experiments' "pallas-two-kernel").  The
  defaults give every
  launch kind there is."""
  blocks = blocks_for(head_dim, head_dim_out, causal=causal)
  out = [("dkv", dkv_mbarriers(blocks))]
  if fuse_dq and fuses_dq(blocks, with_bias=with_bias, causal=causal):
    return out
  return out + [("dq", dq_mbarriers(blocks))]


def fused_dq_fits(blocks: BackwardBlocks, *, with_bias: bool) -> bool:
  """Whether the dK/dV kernel can accumulate dQ at all: not under the head
  split (its f32 staging would leave room for one stage only, and that ran
  slower than the dQ kernel: :func:`blocks_for`), nor with a bias, whose
  gradient needs the f32 dS that the dQ kernel writes."""
  return not blocks.head_split and not with_bias


def fuses_dq(blocks: BackwardBlocks, *, with_bias: bool, causal: bool) -> bool:
  """Whether the backward accumulates dQ in the dK/dV kernel: where it fits
  (:func:`fused_dq_fits`), and under causal only where ``blocks`` says so
  (:func:`blocks_for`).  Without causal it spares the dQ kernel's second
  pass over S and dP wherever it fits (docs/decisions/fused-dq.md)."""
  return fused_dq_fits(blocks, with_bias=with_bias) and (not causal or blocks.fuse_dq_causal)


def part_rows(blocks: BackwardBlocks, n: int, width: int, dtype, swizzle: int | None = None):
  """The shape of ``n`` rows of ``width`` columns of q, k, v or dO in a
  buffer: whole, or under ``blocks.untiled_copies`` in
  kernel.tiling.plan.copy_parts' parts of one ``swizzle`` atom,
  (parts, n, columns)."""
  if not blocks.untiled_copies:
    return (n, width)
  parts, columns = plan_lib.copy_parts(width, np.dtype(dtype).itemsize, swizzle)
  return (parts, n, columns)


def copy_row(blocks: BackwardBlocks, width: int, dtype) -> tuple[int, ...]:
  """A row of q, k, v, dO or a result in global memory as the kernels'
  copies read or write it: (width,), or under untiled copies the
  (parts, columns) of :func:`part_rows` (a free reshape)."""
  if not blocks.untiled_copies:
    return (width,)
  parts, _, columns = part_rows(blocks, 0, width, dtype,
                                WIDE_SWIZZLE if blocks.head_split else None)
  return (parts, columns)


def dkv_buffers(blocks: BackwardBlocks, head_dim: int, head_dim_out: int, dtype, *,
                fused: bool, dq_dtype=np.float32) -> tuple:
  """The dK/dV kernel's shared memory, as :func:`dkv_call` allocates it
  (and :func:`launch_smem_bytes` counts it)."""
  bkv, bq, stages = blocks.rows, blocks.dkv_stream_q, blocks.num_stages
  B, dt = plan_lib.Buffer, np.dtype(dtype)
  if blocks.head_split:
    return _wide_buffers(blocks, head_dim, head_dim_out, dtype)
  r = functools.partial(part_rows, blocks, dtype=dt)
  return (B("k", (CW, *r(bkv, head_dim)), dt),
          B("v", (CW, *r(bkv, head_dim_out)), dt),
          B("q", (stages, *r(bq, head_dim)), dt),
          B("do", (stages, *r(bq, head_dim_out)), dt),
          B("rows", (stages, 2, bq), np.dtype(np.float32), swizzled=False),
          *(_fused_dq_buffers(bkv, bq, head_dim, dtype, dq_dtype) if fused else (None, None)))


def dq_buffers(blocks: BackwardBlocks, head_dim: int, head_dim_out: int, dtype, *,
               want_ds: bool) -> tuple:
  """The dQ kernel's shared memory, as :func:`dq_call` allocates it: the
  stationary tiles, the ring, the head split's exchange buffers (None
  without it) and the f32 staging of dS."""
  bq, bkv, stages = blocks.rows, blocks.dq_stream_kv, blocks.num_stages
  B, dt, f32 = plan_lib.Buffer, np.dtype(dtype), np.dtype(np.float32)
  if blocks.head_split:
    W = functools.partial(B, swizzle=WIDE_SWIZZLE)
    w = functools.partial(part_rows, blocks, dtype=dt, swizzle=WIDE_SWIZZLE)
    return (W("q", (1, *w(bq, head_dim)), dt), W("do", (1, *w(bq, head_dim_out)), dt),
            B("rows", (1, 2, bq), f32, swizzled=False),
            W("k", (stages, *w(bkv, head_dim)), dt), W("v", (stages, *w(bkv, head_dim_out)), dt),
            W("ds_exchange", (EXCHANGE_BUFFERS, bq, bkv), dt),
            B("ds", (CW, bq, bkv // CW), f32) if want_ds else None)
  r = functools.partial(part_rows, blocks, dtype=dt)
  return (B("q", (CW, *r(bq, head_dim)), dt), B("do", (CW, *r(bq, head_dim_out)), dt),
          B("rows", (CW, 2, bq), f32, swizzled=False),
          B("k", (stages, *r(bkv, head_dim)), dt),
          B("v", (stages, *r(bkv, head_dim_out)), dt), None,
          B("ds", (CW, bq, bkv), f32) if want_ds else None)


def launch_smem_bytes(buffers, mbarriers) -> int:
  """Shared memory of one launch from the descriptions it allocates: every
  buffer at a SMEM_ALIGNMENT boundary, then the mbarriers (the forward's
  rule, kernel.tiling.plan.estimate_smem_bytes, without its reduction scratch: the
  backward reduces nothing across warps)."""
  pad = lambda n: -(-n // plan_lib.SMEM_ALIGNMENT) * plan_lib.SMEM_ALIGNMENT
  total = pad(sum(pad(b.nbytes) for b in buffers if b is not None))
  return total + plan_lib.MBARRIER_BYTES * sum(b.num_barriers for b in mbarriers)


def smem_estimates(head_dim: int, head_dim_out: int, dtype, *,
                   with_bias: bool, causal: bool, fuse_dq: bool = True) -> dict[str, int]:
  """Bytes of shared memory of every launch of one backward (padded head
  dims), keyed as :func:`launches` names them."""
  blocks = blocks_for(head_dim, head_dim_out, causal=causal)
  fused = fuse_dq and fuses_dq(blocks, with_bias=with_bias, causal=causal)
  out = {}
  for name, mbarriers in launches(head_dim, head_dim_out, with_bias=with_bias,
                                  causal=causal, fuse_dq=fuse_dq):
    if name == "dq":
      bufs = dq_buffers(blocks, head_dim, head_dim_out, dtype, want_ds=with_bias)
    else:
      bufs = dkv_buffers(blocks, head_dim, head_dim_out, dtype, fused=fused)
    out[name] = launch_smem_bytes(bufs, mbarriers)
  return out


# The fused dQ's schedule: step t stages dS^T in buffer ds_buffer(t) and is
# owned by warpgroup dq_owner(t).  Both work on ints and traced int32 alike
# (t >= 0); the extracted proof checks the handoff they schedule.
DS_BUFFERS = 2


def _fused_dq_buffers(bkv, bq, head_dim, dtype, dq_dtype):
  """The fused dQ's shared memory: DS_BUFFERS dS^T staging buffers of both
  warpgroups' tiles, and per warpgroup a staging tile for its reduce-add
  (f32, or int32 in fixed point: the same bytes)."""
  # dS^T meets the K tiles in the dQ product, both from shared memory: one
  # swizzle, K's (64 bytes where its rows are 96 or 32 columns).
  k_swizzle = plan_lib.row_swizzle_bytes(head_dim, np.dtype(dtype).itemsize)
  return (plan_lib.Buffer("ds", (DS_BUFFERS, CW, bkv, bq), np.dtype(dtype),
                          swizzle=k_swizzle if k_swizzle < 128 else None),
          plan_lib.Buffer("dq", (CW, bq, head_dim), np.dtype(dq_dtype)))


# The head-split dK/dV launch (head dims over 128).  One block owns ONE tile
# of 64 keys; both compute warpgroups work on it, so that each holds half of
# the head dim of dK and of dV (64 keys x D/2 each, f32: 64 registers per
# thread each at D = 256, where a whole dK and dV would take 256).  The work
# of a step is split too, with nothing computed twice:
#
# * warpgroup w forms S^T and dP^T of the tile against its own 32 queries of
#   the step's block (64 keys x 32 queries: wgmma's N = 32), then P^T and
#   dS^T, and stages them, in the compute dtype, into columns [32 w, 32 w +
#   32) of the step's exchange buffers ``pt`` and ``ds`` (64 keys x 64
#   queries);
# * the rendezvous (barriers.halves_ready: both warpgroups sync) makes both
#   halves visible;
# * warpgroup w forms its columns of dV += P^T dO and dK += dS^T Q over all
#   64 queries.
#
# Four products per step, against five with dK and dV in separate launches
# (each recomputed S^T); dQ is the head-split dQ kernel's (notes in
# kernel/backward/dq.py), and the ring has two stages, which a one-stage ring with
# the fused dQ's f32 staging beside it did not reach (blocks_for).  wgmma
# takes both shared-memory operands of a product in one swizzle, and the
# exchange buffers' halves are 32 columns (64 bytes) wide: every tile of
# this launch is 64-byte swizzled.
# Two exchange buffers, step t uses t % 2: warpgroup w writes buffer t % 2
# again at step t + 2 only after the rendezvous of step t + 1, which the
# other warpgroup reaches only after its products of step t (which read the
# buffer) completed.
EXCHANGE_BUFFERS = 2


WIDE_SWIZZLE = 64


def _wide_buffers(blocks: BackwardBlocks, head_dim: int, head_dim_out: int, dtype) -> tuple:
  """The head-split launch's shared memory (same order as dkv_buffers)."""
  bkv, bq, stages = blocks.rows, blocks.dkv_stream_q, blocks.num_stages
  dt, f32 = np.dtype(dtype), np.dtype(np.float32)
  B = functools.partial(plan_lib.Buffer, swizzle=WIDE_SWIZZLE)
  w = functools.partial(part_rows, blocks, dtype=dt, swizzle=WIDE_SWIZZLE)
  return (B("k", (1, *w(bkv, head_dim)), dt), B("v", (1, *w(bkv, head_dim_out)), dt),
          B("q", (stages, *w(bq, head_dim)), dt), B("do", (stages, *w(bq, head_dim_out)), dt),
          plan_lib.Buffer("rows", (stages, 2, bq), f32, swizzled=False),
          B("pt", (EXCHANGE_BUFFERS, bkv, bq), dt), B("ds", (EXCHANGE_BUFFERS, bkv, bq), dt))


def computed_head_dims(head_dim: int, head_dim_out: int, *,
                       narrow_rows: bool = False) -> tuple[int, int]:
  """The head dims the backward computes with: whole 64-column rows
  (kernel.tiling.plan.backward_head_dims), or with ``narrow_rows`` the
  forward's rule (kernel.tiling.plan.padded_head_dims)."""
  rule = plan_lib.padded_head_dims if narrow_rows else plan_lib.backward_head_dims
  return rule(head_dim, head_dim_out)


@dataclasses.dataclass(frozen=True)
class Backward:
  """How a call's gradient is computed, resolved once with its forward
  (kernel.api.resolve_backward): by the sm90 kernels at these head dims and
  tiling, or by their executable specification in plain JAX
  (``implementation`` "xla", kernel/backward/xla.py)."""

  implementation: str
  head_dims: tuple[int, int]
  blocks: BackwardBlocks
