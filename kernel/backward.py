"""The sm90 backward: two warp-specialised Pallas Mosaic GPU kernels.

Both kernels have the forward's shape (``kernel/forward.py``): three
warpgroups along ``wg``; warpgroups 0 and 1 compute at 232 registers, each on
its own 64-row slice of a stationary tile; warpgroup 2 (40 registers) issues
every TMA copy, first the stationary tiles, then the streamed blocks into a
``num_stages``-deep ring.  The ring is the forward's protocol, through the
same verbs (kernel/ring.py): streamed block t sits at position
``stream.position(t)``; each slot has one "produced" mbarrier per streamed
buffer and one "consumed" mbarrier that both compute warpgroups arrive on
once they are done with the slot; the producer waits on it before every
refill (not before the first ``num_stages`` fills).  The stationary tiles
are a :class:`kernel.ring.WarpgroupSlots`, filled once.

Each kernel is a launch (:func:`dkv_call`, :func:`dq_call`) that sizes a
frozen context (:class:`DkvKernel`, :class:`DqKernel`), an entry that builds
the rings over the scratch and dispatches the warpgroups, the memory
warpgroup (:func:`_memory_warpgroup`, shared), and a compute role whose step
(:func:`_dkv_step`, :func:`_dq_step`) runs the arithmetic both kernels share
on their transposed tiles (:func:`_step_scores`) between its own waits,
products and releases.

* ``dkv``: a block owns ``2 * block_kv`` keys of one key/value head (K and V
  stationary) and streams, for every query head of its group and every query
  block that can see its keys, (q, dO, [lse, delta]).  Per block it forms
  S^T = K Q^T, P^T = exp2(S^T - lse) from the forward's residuals, dV += P^T dO,
  dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.  GQA sums over the
  group inside the kernel.  With the fused dQ (head dims up to 128, no bias,
  under causal head dims up to 64: :func:`fuses_dq`) it also forms dQ_i's
  part over its keys, dS_i,tile K_tile, and reduce-adds it in float32 into
  global memory (notes above :func:`_fused_dq_buffers`).
* ``dq`` (where the fused dQ does not apply): a block owns ``2 * block_q``
  query rows of one head (Q, dO, lse, delta stationary) and streams the
  (K, V) blocks of the forward's key range: S, P, dP, dS as above and
  dQ += dS K; with a bias it also writes dS (the logits gradient, which is
  dbias before the sum over broadcast dimensions).

Head dims over 128 take the head split in both kernels
(:attr:`BackwardBlocks.head_split`): a block owns one tile of 64 rows, both
compute warpgroups work on it, each with half of the head dim of its
accumulators, and they exchange the halves of P^T and dS^T (dS in the dQ
kernel) through shared memory at a named barrier every step (notes above
:func:`_wide_step` and :func:`_wide_dq_step`).

The fused dQ does 5 matrix products where the second kernel makes it 7 (it
recomputes S and dP): forward + backward at the headline shape ran at
479.1 TFLOP/s fused against 434.3 with the dQ kernel, in one process
(H200, 2026-11-30), at the price of a dq that is
reproducible to one ulp rather than bitwise (ORDER_DEPENDENT_GRADIENTS),
or, with deterministic=True, of a sum in int32 fixed point (notes above
:data:`FIXED_POINT_BITS`).
Head dims over 128 (no room for the f32 staging), a bias (dbias needs the
f32 dS the dQ kernel writes) and causal attention (where the second kernel
was the faster, H200, 2026-11-30) keep the second kernel.

The residuals are the forward's natural-log m and l: ``lse`` (base 2, what
exp2 needs) is formed here as ``m * log2(e) + log2(l)``; a row with l = 0
(fully masked) gets lse = +inf, so its P is exactly 0.  A forward that stored
m in base 2 yields wrong gradients here (seed 000; the harness keeps that
defect in its catalogue of source patches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from kernel import barriers
from kernel import common
from kernel import masks
from kernel import padding
from kernel import plan as plan_lib
from kernel import ring as ring_lib
from kernel import schedule as schedule_lib
from kernel.common import (COL, LOG2E, ROW, WGMMA, Logits, batch_head, kv_block_range,
                           load_broadcast, smem, tile_key_bounds, window_tile_keys)

# Gradients summed across thread blocks in float32 in no fixed order (the
# fused dQ's reduce-adds, unless deterministic=True sums them in fixed
# point): their bits may differ from run to run, within
# harness.numerics.tolerance.run_to_run_bound.  Every other output is bitwise
# reproducible.
ORDER_DEPENDENT_GRADIENTS = ("dq",)
CW = barriers.COMPUTE_WARPGROUPS


# The backward specialises on the logits alone (no threshold, residuals or
# staging switches of the forward's Features).
BackwardFeatures = Logits


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
  # fused_dq_fits).  blocks_for says where it is measured faster.
  fuse_dq_causal: bool = False
  # Both kernels' compute warpgroups share ONE stationary tile of 64 rows
  # and split the head dim of its accumulators (the notes above _wide_step
  # and _wide_dq_step): head dims over 128, whose whole dK and dV would not
  # fit in 232 registers.
  head_split: bool = False

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


def blocks_for(head_dim: int, head_dim_out: int, *, is_causal: bool) -> BackwardBlocks:
  """Streamed blocks are 64 rows, but for the dK/dV kernel's at head dims
  up to 64 without causal (below).  Head dims over 128 take the head split,
  with two stages in both kernels.

  The dK/dV kernel streams 128 query rows per block at head dims up to 64
  when not causal: S^T = K Q^T and dP^T = V dO^T, both operands in shared
  memory, are then wgmma's of N = 128.  At N = 64 an instruction's
  shared-memory reads take about as long as its tensor-core work, so any
  other shared-memory traffic stalls the products; at N = 128 they are
  compute-bound (S^T and dP^T take 64 registers each, dK and dV 32 each:
  it fits in 232).
  Forward + backward, bf16, d64 N32, measured on the H200 in one process,
  128 against 64 query rows (cuDNN): 4k B4 4.188 vs 4.726 ms (4.578), 16k B1
  16.367 vs 17.876 (17.379), 1k B16 1.239 vs 1.373 (1.432), T=S=3000 B5
  GQA 32/8 3.374 vs 3.834 (3.528), 12000 B1 GQA 32/8 9.947 vs 10.660
  (10.170); deterministic=True (then the dQ kernel) at 4k B4 5.244 vs 5.732; a (512, 512) window at
  8k B2 1.678 vs 1.661 and a (1, 1, T, S) bias at 2k B2 1.291 vs 1.280, both
  within 1 % (2026-12-03).  Under causal it ran slower, 4k B4 2.999 vs 2.587
  ms, 16k B1 10.186 vs 9.126, deterministic 4k 3.212 vs 2.972; the
  cause was register pressure: ptxas spilled 752 bytes there.  With the
  causal and key-limit masks of kernel.masks (no index arrays) it spills 192
  bytes, and 128 rows against 64 measured (2026-12-04): 4k B4 2.525 vs 2.571
  ms, 16k B1 8.894 vs 9.183, 1k B16 0.882 vs 0.898, deterministic 4k 3.027 vs
  3.055, but T=S=3000 B5 GQA 32/8 2.335 vs 2.143 and 7000 B2 GQA 32/8 4.386
  vs 4.014; a 9 % loss at ragged GQA lengths outweighs 2-3 %, so causal stays
  at 64 rows.  At head dim 128, streaming 128 keys per dQ block instead of
  64 changed nothing beyond noise (causal 16k B1 8.431 vs 8.323 ms, 4k B4
  2.314 vs 2.281, deterministic 4k 4.098 vs 4.122).
  Forward + backward, bf16, d256, measured on the H200 against dK and dV in
  separate launches and a one-stage dQ kernel, in one process: 4k B4 N8
  4.992 vs 6.701 ms (cuDNN 4.579), causal 2.643 vs 3.910 (2.601), causal
  16k B1 9.123 vs 13.130 (9.112), causal GQA 8/2 4k B4 2.773 vs 4.447
  (2.607) (2026-12-03).  The kernels alone at 4k B4 causal: dK/dV 1.264 ms
  with two stages, 1.731 with one, 1.999 as two launches; dQ 0.891 against
  1.322.  Accumulating dQ in the dK/dV launch as well (whose f32 staging
  leaves room for one stage only) took 2.971 ms, more than the head-split
  dK/dV and dQ kernels together: it is not offered there.

  Under causal, head dims up to 64 fuse dQ into the dK/dV kernel: forward +
  backward, bf16, measured on the H200 with the dQ kernel vs fused: 16k B1
  10.850 vs 9.132 ms, 4k B4 3.022 vs 2.721, 1k B16 1.022 vs 0.945, GQA 32/8
  at 12017 tokens 6.539 vs 6.384 (2026-12-02).  At head dim 128 the fused dQ
  loses under causal (16k B1 8.367 vs 8.547 ms, 4k B4 2.259 vs 2.588): its
  per-step reduce-adds weigh more there against the dQ kernel's recomputed S
  and dP.  Re-measured with the causal launch order (below), dQ kernel vs
  fused, ms (2026-12-04): 1k B16 0.738 vs 0.855, 4k B4 2.234 vs 2.371, 8k B2
  4.224 vs 4.287, 16k B1 8.241 vs 7.899, GQA 16/4 T=S=3000 B5 1.766 vs
  1.788, 12017 B1 4.869 vs 5.086: the fused dQ wins at 16k B1 alone, so the
  dQ kernel stays.  On the H100, dQ kernel vs fused (kernel.experiments'
  "pallas-fused-causal"), forward + backward, ms (93989d6, 2026-12-05): 1k
  B16 0.813 vs 0.960, 4k B4 2.216 vs 2.503, 8k B2 4.188 vs 4.529, 12017 B1
  4.466 vs 5.312, 16k B1 8.115 vs 8.084, 32k B1 31.665 vs 31.005, GQA 32/8
  16k B1 16.251 vs 15.438 (cuDNN 1.013, 2.290, 3.961, -, 7.402, 28.327,
  14.734); deterministic=True, the dQ kernel vs the fused dQ in fixed point,
  lost 8-25 % fused at every one of them.  The fused dQ gains at 16k keys and
  more, by 0.4-5 %, and loses 16 % at 12017: no rule by length is kept
  without knowing why.

  Under causal both kernels' grids launch in sections of heads, heaviest
  tiles first across a section (:func:`dkv_launch_order`,
  :func:`dq_launch_order`; :func:`dkv_call` has the measurements; the fused
  dQ, and any grid under a local window, only where the dealing model
  predicts a gain)."""
  width = max(head_dim, head_dim_out)
  wide = width > 128
  return BackwardBlocks(dkv_stream_q=128 if width <= 64 and not is_causal else 64,
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
             is_causal: bool = True,
             fuse_dq: bool = True) -> list[tuple[str, tuple[plan_lib.MBarrier, ...]]]:
  """Every kernel launch of one backward, with its mbarrier plan, in order
  (the dQ kernel only where the fused dQ does not apply: :func:`fuses_dq`,
  or ``fuse_dq`` is False: kernel.experiments' "pallas-two-kernel").  The
  defaults give every
  launch kind there is."""
  blocks = blocks_for(head_dim, head_dim_out, is_causal=is_causal)
  out = [("dkv", dkv_mbarriers(blocks))]
  if fuse_dq and fuses_dq(blocks, with_bias=with_bias, is_causal=is_causal):
    return out
  return out + [("dq", dq_mbarriers(blocks))]


def fused_dq_fits(blocks: BackwardBlocks, *, with_bias: bool) -> bool:
  """Whether the dK/dV kernel can accumulate dQ at all: not under the head
  split (its f32 staging would leave room for one stage only, and that ran
  slower than the dQ kernel: :func:`blocks_for`), nor with a bias, whose
  gradient needs the f32 dS that the dQ kernel writes."""
  return not blocks.head_split and not with_bias


def fuses_dq(blocks: BackwardBlocks, *, with_bias: bool, is_causal: bool) -> bool:
  """Whether the backward accumulates dQ in the dK/dV kernel: where it fits
  (:func:`fused_dq_fits`), and under causal only where ``blocks`` says so
  (:func:`blocks_for` has the measurements).  Non-causal at the headline
  shape, forward + backward ran at 518.2 TFLOP/s fused against 458.5 with
  the dQ kernel, in one process on the H200 (2026-11-30)."""
  return fused_dq_fits(blocks, with_bias=with_bias) and (not is_causal or blocks.fuse_dq_causal)


def _memory_warpgroup(load_stationary, fill, start, stop, stream: ring_lib.Ring):
  """The memory warpgroup of both kernels: 40 registers; its warp 0 issues
  the stationary tiles' copies, then fills ring step t in [start, stop) at
  position ``stream.position(t)`` with ``fill(t, st)``.  Steps 0..S-1 find
  fresh slots; every later one first waits for both compute warpgroups to
  release the slot (the forward's rule; harness/proofs/extracted_proof.py checks it
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


def _allocate(buffers):
  """Scratch refs for buffer descriptions (None stays None: an unused slot)."""
  return tuple(None if b is None else smem(b) for b in buffers)


def dkv_buffers(blocks: BackwardBlocks, head_dim: int, head_dim_out: int, dtype, *,
                fused: bool, dq_dtype=np.float32) -> tuple:
  """The dK/dV kernel's shared memory, as :func:`dkv_call` allocates it
  (and :func:`launch_smem_bytes` counts it)."""
  bkv, bq, stages = blocks.rows, blocks.dkv_stream_q, blocks.num_stages
  B, dt = plan_lib.Buffer, np.dtype(dtype)
  if blocks.head_split:
    return _wide_buffers(blocks, head_dim, head_dim_out, dtype)
  return (B("k", (CW, bkv, head_dim), dt),
          B("v", (CW, bkv, head_dim_out), dt),
          B("q", (stages, bq, head_dim), dt),
          B("do", (stages, bq, head_dim_out), dt),
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
    return (W("q", (1, bq, head_dim), dt), W("do", (1, bq, head_dim_out), dt),
            B("rows", (1, 2, bq), f32, swizzled=False),
            W("k", (stages, bkv, head_dim), dt), W("v", (stages, bkv, head_dim_out), dt),
            W("ds_exchange", (EXCHANGE_BUFFERS, bq, bkv), dt),
            B("ds", (CW, bq, bkv // CW), f32) if want_ds else None)
  return (B("q", (CW, bq, head_dim), dt), B("do", (CW, bq, head_dim_out), dt),
          B("rows", (CW, 2, bq), f32, swizzled=False),
          B("k", (stages, bkv, head_dim), dt),
          B("v", (stages, bkv, head_dim_out), dt), None,
          B("ds", (CW, bq, bkv), f32) if want_ds else None)


def launch_smem_bytes(buffers, mbarriers) -> int:
  """Shared memory of one launch from the descriptions it allocates: every
  buffer at a SMEM_ALIGNMENT boundary, then the mbarriers (the forward's
  rule, kernel.plan.estimate_smem_bytes, without its reduction scratch: the
  backward reduces nothing across warps)."""
  pad = lambda n: -(-n // plan_lib.SMEM_ALIGNMENT) * plan_lib.SMEM_ALIGNMENT
  total = pad(sum(pad(b.nbytes) for b in buffers if b is not None))
  return total + plan_lib.MBARRIER_BYTES * sum(b.num_barriers for b in mbarriers)


def smem_estimates(head_dim: int, head_dim_out: int, dtype, *,
                   with_bias: bool, is_causal: bool, fuse_dq: bool = True) -> dict[str, int]:
  """Bytes of shared memory of every launch of one backward (padded head
  dims), keyed as :func:`launches` names them."""
  blocks = blocks_for(head_dim, head_dim_out, is_causal=is_causal)
  fused = fuse_dq and fuses_dq(blocks, with_bias=with_bias, is_causal=is_causal)
  out = {}
  for name, mbarriers in launches(head_dim, head_dim_out, with_bias=with_bias,
                                  is_causal=is_causal, fuse_dq=fuse_dq):
    if name == "dq":
      bufs = dq_buffers(blocks, head_dim, head_dim_out, dtype, want_ds=with_bias)
    else:
      bufs = dkv_buffers(blocks, head_dim, head_dim_out, dtype, fused=fused)
    out[name] = launch_smem_bytes(bufs, mbarriers)
  return out


def _scaled_logits(s, f: BackwardFeatures, bias):
  """(s_final, dsdu): the logits after scale, bias and soft cap, and the soft
  cap's derivative d s_final / d u (None without a cap)."""
  u = s * f.scale
  if bias is not None:
    u = u + bias.astype(jnp.float32)
  if f.logits_soft_cap is None:
    return u, None
  t = jnp.tanh(u * (1.0 / f.logits_soft_cap))
  return t * f.logits_soft_cap, 1.0 - t * t


def _probabilities(s, lse2, keep):
  """exp2(s * log2 e - lse2) where kept, 0 elsewhere (lse2 broadcast)."""
  p = jnp.exp2(s * LOG2E - lse2)
  return p if keep is None else keep.select(p)


def _masked_to_zero(ds, keep):
  """dS is exactly 0 for a masked pair, as in the reference: p = 0 there, but
  p * (dP - delta) would be 0 * NaN = NaN when a NaN in dO reaches dP."""
  return ds if keep is None else keep.select(ds)


def _and(a, b):
  return b if a is None else (a if b is None else a & b)


@dataclasses.dataclass(frozen=True)
class KeysBelow:
  """The keep term key < limit (the padded keys past the sequence), applied
  by kernel.masks without index arrays."""

  limit: Any


@dataclasses.dataclass(frozen=True)
class _Keep:
  """The (key, query) pairs of a step's tile that count: key <= query where
  ``causal`` and key < ``key_limit`` where set (by kernel.masks, without
  index arrays), and ``terms``, a bool array of the other conditions (None:
  none)."""

  causal: bool
  key_base: Any
  query_base: Any
  key_dim: int
  terms: Any
  key_limit: Any = None

  def select(self, x):
    """x where the pair counts, 0 elsewhere."""
    if self.terms is not None:
      x = jnp.where(self.terms, x, 0.0)
    if self.key_limit is not None:
      x = masks.key_limit_select(x, key_base=self.key_base, limit=self.key_limit,
                                 key_dim=self.key_dim, fill=0.0)
    if self.causal:
      x = masks.causal_select(x, key_base=self.key_base, query_base=self.query_base,
                              key_dim=self.key_dim, fill=0.0)
    return x


def _pair_keep(shape, key_base, query_base, key_dim, *, causal, terms):
  """Which (key, query) pairs of a step's tile count (None: all): key <=
  query where ``causal``, and each of ``terms`` (callables of the key
  indices giving bool arrays: key ranges, mask; or a KeysBelow for padded
  keys).  ``key_dim``: the tile's dimension along keys (0 in the dK/dV
  kernel's transposed tiles, 1 in the dQ kernel's)."""
  limits = [t.limit for t in terms if isinstance(t, KeysBelow)]
  arrays = [t for t in terms if not isinstance(t, KeysBelow)]
  if len(limits) > 1:
    raise ValueError(f"at most one KeysBelow term, got {len(limits)}")
  keep = None
  if arrays:
    key = key_base + plgpu.broadcasted_iota(jnp.int32, shape, key_dim, layout=WGMMA)
    for term in arrays:
      keep = _and(keep, term(key))
  if keep is None and not causal and not limits:
    return None
  return _Keep(causal, key_base, query_base, key_dim, keep, limits[0] if limits else None)


def meets_diagonal(key_base, num_keys, query_base):
  """Whether a tile of keys [key_base, key_base + num_keys) holds a key
  above the first query of its block (query_base), i.e. whether the causal
  mask (key <= query) can drop any of its pairs: if not, every key of the
  tile is at or below every query of the block.  Ints or traced int32."""
  return key_base + num_keys - 1 > query_base


def _masked_terms(terms, keep_of, *, causal, on_diagonal, interior=None):
  """``terms(keep)`` for the step's kept pairs, by a branch on what the step
  can drop.  ``keep_of(causal, edges)``: the keep array with the causal mask
  where ``causal`` and the edge terms (key ranges, padded keys) where
  ``edges``.  ``on_diagonal()`` (a traced bool): some key of the tile lies
  above its first query; ``interior()`` (None without edge terms): every
  pair of the step is kept by the edge terms.

  Without edge terms, only the steps on the diagonal pay for the causal
  mask: every other step of a causal backward is wholly below it and skips
  the mask's index arithmetic and selects.  Forward + backward at the
  headline shape, causal: 396.2 against 318.1 TFLOP/s with the mask on every
  step, in one process on the H200 (2026-11-30).  With edge terms, the steps
  that are interior and off the diagonal skip both, every other step pays
  for both (a key range's edge usually meets the diagonal anyway).
  """
  if interior is None:
    if causal:
      return lax.cond(on_diagonal(), lambda: terms(keep_of(True, False)),
                      lambda: terms(keep_of(False, False)))
    return terms(keep_of(False, False))
  edge = ~interior()
  if causal:
    edge = edge | on_diagonal()
  return lax.cond(edge, lambda: terms(keep_of(causal, True)),
                  lambda: terms(keep_of(False, False)))


def _product(shape, a, b):
  """A B^T into a fresh f32 accumulator, waited for."""
  def product(acc):
    plgpu.wgmma(acc, a, b.T)
    return acc[...]
  return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _step_scores(f: BackwardFeatures, shape, *, s_ops, dp_ops, paired, want_ds, bias_of,
                 terms, key_dim, key_base, num_keys, query_base, lse2_of, delta_of,
                 edge_terms=(), interior=None):
  """The step both kernels share, on tiles transposed to each other: S (and,
  for dS, dP) from shared memory, the logits, the kept (key, query) pairs,
  P = exp2(S log2 e - lse) and dS = P (dP - delta), zero where not kept.

  ``s_ops``, ``dp_ops``: the (A, B) of S = A B^T and dP = A B^T (dp_ops
  unused without ``want_ds``); ``paired``: S and dP issued together and
  waited once; ``bias_of()``: the step's bias tile or None; ``terms``: the
  keep conditions besides causal (:func:`_pair_keep`); ``key_dim``: the
  tile's dimension along keys, the per-query rows ``lse2_of()`` and
  ``delta_of()`` broadcast along the other (read where the arithmetic first
  needs them); ``edge_terms``: keep conditions that only the steps not
  ``interior()`` (a traced bool; None: every step) apply
  (:func:`_masked_terms`).  Returns (P, dS), dS None without ``want_ds``.
  """
  query_dim = 1 - key_dim
  zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)
  if paired and want_ds:
    # S and dP depend on nothing computed here: issue both, wait once.
    def s_and_dp(refs):
      s_ref, dp_ref = refs
      plgpu.wgmma(s_ref, s_ops[0], s_ops[1].T)
      plgpu.wgmma(dp_ref, dp_ops[0], dp_ops[1].T)
    s, dp = pl.run_state(s_and_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
  else:
    s, dp = _product(shape, *s_ops), None
  s, dsdu = _scaled_logits(s, f, bias_of())
  if not edge_terms:
    interior = None
  keep_of = lambda causal, edges: _pair_keep(
      shape, key_base, query_base, key_dim, causal=causal,
      terms=[*terms, *edge_terms] if edges else terms)

  def step_terms(keep, dp):
    """P and (for dS) dS of the step, zero where not kept."""
    p = _probabilities(s, lax.broadcast_in_dim(lse2_of(), shape, [query_dim]), keep)
    ds = None
    if want_ds:
      if dp is None:
        dp = _product(shape, *dp_ops)
      ds = p * (dp - lax.broadcast_in_dim(delta_of(), shape, [query_dim]))
      if dsdu is not None:
        ds = ds * dsdu
      ds = _masked_to_zero(ds, keep)
    return p, ds

  if (f.is_causal or interior is not None) and want_ds and dp is None:
    dp = _product(shape, *dp_ops)  # outside the branch: both sides read it
  return _masked_terms(lambda keep: step_terms(keep, dp), keep_of, causal=f.is_causal,
                       on_diagonal=lambda: meets_diagonal(key_base, num_keys, query_base),
                       interior=interior)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Launch(common.OperandRefs):
  """What the roles of both kernels read (keywords; a kernel's own fields
  come first): the launch's sizes, and inside the kernel the operands as
  refs, the grid point, the rings."""

  f: BackwardFeatures
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


@dataclasses.dataclass(frozen=True)
class DkvKernel(_Launch):
  """One dK/dV launch: its own sizes and switches (set by :func:`dkv_call`)
  and, inside the kernel, its grid point (set by :func:`_dkv_kernel`)."""

  head_dim_out: int
  nq: int                   # streamed query blocks of the padded length
  fused: bool               # dQ accumulated here (into dq_ref)
  # Inside the kernel:
  j: Any = None             # the key tile
  lo: Any = None            # the first query block that sees the tile's keys
  per_head: Any = None      # query blocks per query head
  steps: Any = None         # per_head for every query head of the group
  out_refs: tuple = ()
  k_st: Any = None          # the stationary tiles, which stage dK and dV at the end
  v_st: Any = None
  dq_st: Any = None
  stationary: ring_lib.WarpgroupSlots | None = None   # k and v per compute warpgroup
  stream: ring_lib.Ring | None = None                  # q, rows, dO per query block

  # Keys per warpgroup (stationary), queries per streamed block, and S^T's
  # shape (keys x queries).
  bkv = property(lambda self: self.blocks.rows)
  bq = property(lambda self: self.blocks.dkv_stream_q)
  shape_t = property(lambda self: (self.bkv, self.bq))


def _visible_blocks(first: int, last: int, block: int, count: int) -> int:
  """How many of ``count`` blocks of ``block`` rows hold a row in [first,
  last] (0 when the interval is empty or outside them)."""
  first, last = max(first, 0), min(last, count * block - 1)
  return max(0, last // block - first // block + 1) if last >= first else 0


def key_tile_weights(f: BackwardFeatures, blocks: BackwardBlocks, *, group: int, t_pad: int,
                     s_pad: int, window: tuple[int, int] | None = None) -> list[int]:
  """Per key tile, the query blocks the dK/dV kernel streams for it (times
  the group's query heads): key j is seen by the rows i >= j under causal,
  and by i in [j - right, j + left] under jax.nn's local ``window`` (left,
  right)."""
  tile, bq, nq = blocks.dkv_tile, blocks.dkv_stream_q, t_pad // blocks.dkv_stream_q
  weights = []
  for r in range(s_pad // tile):
    first, last = (r * tile if f.is_causal else 0), t_pad - 1
    if window is None:
      weights.append(group * _visible_blocks(first, last, bq, nq))
      continue
    # The band comes from the rows' key ranges (kernel.padding.
    # query_block_ranges): only the tile's real keys count, only real rows
    # have a window, and the padded rows copy the last real row's range, so
    # the blocks of padded rows alone are streamed exactly when that row
    # sees the tile.
    left, right = window
    keys_end = min((r + 1) * tile, f.seq_kv)
    if keys_end <= r * tile:
      weights.append(0)
      continue
    first, last = max(first, r * tile - right), min(f.seq_q - 1, keys_end - 1 + left)
    seen = _visible_blocks(first, last, bq, nq)
    if first <= f.seq_q - 1 <= last:
      seen += nq - -(-f.seq_q // bq)
    weights.append(group * seen)
  return weights


def query_tile_weights(f: BackwardFeatures, blocks: BackwardBlocks, *, t_pad: int,
                       window: tuple[int, int] | None = None) -> list[int]:
  """Per rank of the dQ kernel's launch order (rank r: query tile
  ``tiles - 1 - r``), the key blocks it streams: the dQ kernel's own
  :func:`kernel.common.kv_block_range`, with the keys a local ``window``
  lets the tile's rows see (:func:`kernel.common.window_tile_keys`)."""
  tile = blocks.dq_tile
  weights = []
  for qi in reversed(range(t_pad // tile)):
    start = end = None
    if window is not None:
      start, end = window_tile_keys(qi, tile, window, seq_q=f.seq_q, seq_kv=f.seq_kv)
    lb, ub = kv_block_range(qi, tile_q=tile, block_kv=blocks.dq_stream_kv,
                            seq_q=f.seq_q, seq_kv=f.seq_kv, is_causal=f.is_causal,
                            k_start_min=start, k_end_max=end)
    weights.append(ub - lb)
  return weights


def dkv_launch_order(f: BackwardFeatures, blocks: BackwardBlocks, *, batch: int,
                     num_kv_heads: int, group: int, t_pad: int, s_pad: int,
                     head_dims: tuple[int, int], dtype, fused: bool, num_sms: int,
                     window: tuple[int, int] | None = None) -> schedule_lib.LaunchOrder | None:
  """The dK/dV grid's launch order under causal (None: head by head): see
  :func:`dkv_call`.  ``window``: jax.nn's local window (left, right) that
  the key ranges come from, if any (it evens the tiles' work out)."""
  if not f.is_causal:
    return None
  order = schedule_lib.LaunchOrder.for_grid(
      num_kv_heads * batch, s_pad // blocks.dkv_tile, num_sms=num_sms,
      unit_bytes=group * t_pad * sum(head_dims) * jnp.dtype(dtype).itemsize)
  # With the fused dQ, or under a window, sections only where they repay
  # their spread of the blocks in flight (kernel.schedule.MIN_SECTION_GAIN).
  if (fused or window is not None) and not schedule_lib.sections_repay(
      order, key_tile_weights(f, blocks, group=group, t_pad=t_pad, s_pad=s_pad,
                              window=window), num_sms):
    return None
  return order


def dkv_call(q, k, v, do, rows, bias_t, mask_t, k_start, k_end, *, f: BackwardFeatures,
             blocks: BackwardBlocks, dq_accum=None, dq_scales=None, query_blocks=None,
             inner_blocks=None, num_sms: int = schedule_lib.DEFAULT_NUM_SMS,
             window: tuple[int, int] | None = None):
  """{"dk": dK, "dv": dV} on padded inputs.

  q (B, Tp, N, D), k (B, Sp, K, D), v (B, Sp, K, Dv), do (B, Tp, N, Dv), rows
  (B, N, 2, Tp) f32 = [lse2, delta]; bias_t / mask_t: bias and mask with T and
  S swapped (dims 1 or full); k_start / k_end (B|1, N|1, Tp|1) int32;
  ``query_blocks``: None or (lo, hi), each (B|1, K|1, key tiles) int32, the
  query blocks each key tile streams (kernel.padding.query_block_ranges);
  ``inner_blocks``: None or (B|1, K|1, 2, key tiles) int32, the run of them
  wholly inside every row's range (kernel.padding.query_block_inner_bounds).

  ``dq_accum``: a zeroed (B, Tp, N, D) f32 ref; when given (where
  :func:`fused_dq_fits`), the kernel also adds each key tile's part of
  dQ / scale into it (see the fused dQ notes below).  With ``dq_scales``
  ((B, N, Tp) f32, powers of two: :func:`fixed_point_scales`) ``dq_accum``
  is int32 and each part is added in fixed point, times its row's scale
  (order-independent: the notes above :data:`FIXED_POINT_BITS`).

  Under causal the key tiles launch in
  sections of (kv head, batch) units, heaviest first across a section
  (:class:`kernel.schedule.LaunchOrder` for ``num_sms`` SMs); a section's
  units re-read their query heads' Q and dO.  With the fused dQ only where
  the dealing model predicts a gain of MIN_SECTION_GAIN or more
  (:func:`kernel.schedule.sections_repay`).  Forward + backward, bf16,
  causal, measured on the H200 head by head vs sectioned (cuDNN), ms: d128
  4k B4 N16 2.271 vs 2.221 (2.204), 16k B1 8.226 vs 8.021 (7.371), 1k B16
  0.765 vs 0.765 (0.868), GQA 16/4 T=S=3000 B5 1.920 vs 1.721 (1.659), 8k B2
  4.454 vs 4.088 (4.081), 12017 B1 4.975 vs 4.947; d256 1k B16 N8 0.883 vs
  0.866 (0.990), 4k B4 2.709 vs 2.627 (2.622), 16k B1 9.695 vs 9.699 (9.416);
  deterministic=True d128 4k B4 2.275 vs 2.228, d64 GQA 32/8 T=S=3000 B5
  2.378 vs 2.175 (2026-12-04; the d64 fused dQ's in kernel.schedule).
  Under a local ``window`` (jax.nn's (left, right), which the key ranges
  come from) the tiles' work is even but at the ends, and the sections
  lost: d128 causal, window 1024 at 16k B1 N16 1.389 sectioned vs 1.374 ms
  head by head, (512, 512) at 4k B4 0.888 vs 0.869; so there they are taken
  only where the dealing model, weighing each tile by the window
  (:func:`key_tile_weights`), predicts a gain, as with the fused dQ.
  Packed documents (ranges the launch cannot see) keep them: seven
  documents causal at 16k, 1.802 sectioned vs 1.875 head by head (2026-12-04).
  """
  batch, t_pad, num_heads, head_dim = q.shape
  _, s_pad, num_kv_heads, head_dim_out = v.shape
  dtype = q.dtype
  fused = dq_accum is not None
  if fused and blocks.head_split:
    raise ValueError("the head-split dK/dV launch does not accumulate dQ (fused_dq_fits)")
  group = num_heads // num_kv_heads
  order = dkv_launch_order(f, blocks, batch=batch, num_kv_heads=num_kv_heads, group=group,
                           t_pad=t_pad, s_pad=s_pad, head_dims=(head_dim, head_dim_out),
                           dtype=dtype, fused=fused, num_sms=num_sms, window=window)
  kernel = DkvKernel(f=f, blocks=blocks, head_dim=head_dim,
                     head_dim_out=head_dim_out, dtype=dtype, num_kv_heads=num_kv_heads,
                     group=group, nq=t_pad // blocks.dkv_stream_q, s_pad=s_pad, fused=fused,
                     order=order)

  def body(*refs):
    _dkv_kernel(kernel, *refs)

  if (dq_scales is not None) != (fused and dq_accum.dtype == jnp.int32):
    raise ValueError("the fixed-point dQ takes an int32 dq_accum and dq_scales together")
  scratch = [_allocate(dkv_buffers(blocks, head_dim, head_dim_out, dtype, fused=fused,
                                   dq_dtype=np.float32 if dq_accum is None else dq_accum.dtype)),
             _barrier_refs(dkv_mbarriers(blocks))]
  out_type = [jax.ShapeDtypeStruct((batch, s_pad, num_kv_heads, d), dtype)
              for d in (head_dim, head_dim_out)]
  results = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch,
      # Mosaic GPU launches the LAST grid dimension fastest (blockIdx.x):
      # here the key tiles, so that the blocks in flight at once are the
      # tiles of a few heads, which read the same Q and dO, and under causal
      # each head's tiles with the most query blocks start first.
      # Measured against (kv_tiles, kv_heads, batch) in one process on the
      # H200 (2026-11-30), forward + backward at the
      # headline shape: 496.1 against 468.3 TFLOP/s; causal 323.7 / 313.3.
      # Under causal, _at_key_tile remaps a block's launch index through
      # kernel.order (sections of heads, heaviest first across them).
      grid=(num_kv_heads, batch, s_pad // blocks.dkv_tile),
      grid_names=("kv_heads", "batch", "kv_tiles"),
      num_threads=barriers.NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
  )(q, k, v, do, rows, bias_t, mask_t, k_start, k_end,
    *(query_blocks if query_blocks is not None else (None, None)), inner_blocks, dq_scales,
    dq_accum)
  return dict(zip(("dk", "dv"), results))


def _dkv_kernel(c: DkvKernel, q_ref, k_ref, v_ref, do_ref, rows_ref, bias_ref, mask_ref,
                ks_ref, ke_ref, qlo_ref, qhi_ref, inner_ref, dq_scales_ref, dq_ref, dk_ref, dv_ref,
                scratch, bars):
  """The dK/dV kernel's entry: its rings over the scratch, the key tile of
  this grid point and the query blocks it visits, each warpgroup's role
  (the head split's where ``c.blocks.head_split``)."""
  k_st, v_st, q_ring, do_ring, rows_ring, *staging = scratch
  k_stat, v_stat, q_prod, do_prod, rows_prod, consumed = bars
  # K and V stationary, filled once: one tile per compute warpgroup, or one
  # for both under the head split; each step streams a query block's q,
  # residual rows and dO.
  stationary = ring_lib.WarpgroupSlots({"k": (k_st, k_stat), "v": (v_st, v_stat)})
  stream = ring_lib.Ring(c.blocks.num_stages, {"q": (q_ring, q_prod),
                                               "rows": (rows_ring, rows_prod),
                                               "do": (do_ring, do_prod)}, consumed)
  split = c.blocks.head_split
  # The rest of the scratch: the fused dQ's dS^T and f32 staging (None
  # without it), or the head split's exchange buffers of P^T and dS^T.
  ds_st, dq_st = (None, None) if split else staging
  c = dataclasses.replace(
      _at_key_tile(c, qlo_ref, qhi_ref, inner_ref),
      q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, do_ref=do_ref, rows_ref=rows_ref,
      bias_ref=bias_ref, mask_ref=mask_ref, ks_ref=ks_ref, ke_ref=ke_ref, dq_ref=dq_ref,
      dq_scales_ref=dq_scales_ref, out_refs=(dk_ref, dv_ref), k_st=k_st, v_st=v_st, ds_st=ds_st,
      dq_st=dq_st,
      exchange=tuple(staging) if split else None, stationary=stationary, stream=stream)
  pl.when(c.wg < CW)(functools.partial(_wide_compute if split else _dkv_compute, c))
  pl.when(c.wg == CW)(lambda: _memory_warpgroup(
      functools.partial(_wide_load_stationary if split else _dkv_load_stationary, c),
      functools.partial(_dkv_fill, c), 0, c.steps, stream))


def _at_key_tile(c: DkvKernel, qlo_ref, qhi_ref, inner_ref) -> DkvKernel:
  """``c`` at this grid point: the warpgroup, the key tile, and the query
  blocks that can see any of the tile's keys (causal: from the tile's first
  key on; key ranges: the band the table gives, which a local window or
  packed documents narrow to the blocks that reach the tile), for every
  query head of the group in turn."""
  wg = lax.axis_index("wg")
  j, hk, b = (lax.axis_index(n) for n in ("kv_tiles", "kv_heads", "batch"))
  if c.order is not None:
    # The grid launches kv_tiles fastest, then batch, then kv_heads; unit
    # u = hk * batch + b, and rank r is key tile r (the most query blocks
    # see the first).
    batch = jnp.int32(c.order.units // c.num_kv_heads)
    unit, j = c.order.locate((hk * batch + b) * jnp.int32(c.order.tiles) + j)
    hk, b = lax.div(unit, batch), lax.rem(unit, batch)
  lo = lax.div(j * c.blocks.dkv_tile, jnp.int32(c.bq)) if c.f.is_causal else jnp.int32(0)
  hi = jnp.int32(c.nq)
  if qlo_ref is not None:
    lo = lax.max(lo, qlo_ref[(*batch_head(qlo_ref, b, hk), j)])
    hi = lax.min(hi, qhi_ref[(*batch_head(qhi_ref, b, hk), j)])
  lo = lax.min(lo, jnp.int32(c.nq))
  inner_lo = inner_hi = None
  if inner_ref is not None:
    bh = batch_head(inner_ref, b, hk)
    inner_lo, inner_hi = inner_ref[(*bh, 0, j)], inner_ref[(*bh, 1, j)]
  per_head = lax.max(hi - lo, jnp.int32(0))
  return dataclasses.replace(c, wg=wg, j=j, hk=hk, b=b, lo=lo, per_head=per_head,
                             steps=per_head * c.group, qlo_ref=qlo_ref, qhi_ref=qhi_ref,
                             inner_lo=inner_lo, inner_hi=inner_hi)


def _dkv_coords(c: DkvKernel, t):
  """(query head, query block) of step t: every key tile walks its query
  blocks in order, so without causal the tiles in flight add their dQ parts
  into the same block at about the same time.  Starting key tile j's walk
  at block j instead (wrapping around), so that they add into different
  blocks, gained nothing: forward + backward without causal, bf16 TFLOP/s
  in order vs staggered, measured on the H100 in one process (2026-12-05):
  d128 16k B1 N16 542.9 vs 547.0, 4k B4 517.1 vs 508.4, 1k B16 430.6 vs
  422.3, d64 16k B1 N32 487.7 vs 487.5, GQA 16/4 T=S=3000 B5 459.5 vs
  428.6; the reduce-adds do not wait on each other."""
  return c.hk * c.group + lax.div(t, c.per_head), c.lo + lax.rem(t, c.per_head)


def _dkv_load_stationary(c: DkvKernel):
  for w in range(CW):
    rows_w = pl.ds((CW * c.j + w) * c.bkv, c.bkv)
    c.stationary.producer_copy(c.k_ref.at[c.b, rows_w, c.hk], w, "k")
    c.stationary.producer_copy(c.v_ref.at[c.b, rows_w, c.hk], w, "v")


def _dkv_fill(c: DkvKernel, t, st):
  h, i = _dkv_coords(c, t)
  qrows = pl.ds(i * c.bq, c.bq)
  stream = c.stream
  stream.producer_copy(c.q_ref.at[c.b, qrows, h], st, "q")
  stream.producer_copy(c.rows_ref.at[c.b, h, :, qrows], st, "rows")
  stream.producer_copy(c.do_ref.at[c.b, qrows, h], st, "do")


def _dkv_compute(c: DkvKernel):
  """A compute warpgroup: its 64 keys' dK/dV over every step, then the
  results staged in the stationary tiles and stored."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  kv_base = (CW * c.j + wg) * c.bkv
  c.stationary.consumer_wait(wg, "k")
  c.stationary.consumer_wait(wg, "v")
  zeros = lambda d: plgpu.layout_cast(jnp.zeros((c.bkv, d), jnp.float32), WGMMA)
  dk_acc, dv_acc = zeros(c.head_dim), zeros(c.head_dim_out)
  dk_acc, dv_acc = lax.fori_loop(0, c.steps, functools.partial(_dkv_step, c, kv_base),
                                 (dk_acc, dv_acc))
  if c.fused:  # the last dQ product has read both K tiles before they stage dK
    barriers.epilogue_sync()
  # The stationary tiles are no longer read: they stage the results.
  rows_out = pl.ds(kv_base, c.bkv)
  results = {"dk": (dk_acc, c.k_st), "dv": (dv_acc, c.v_st)}
  for name, ref in zip(("dk", "dv"), c.out_refs):
    acc, buf = results[name]
    if name == "dk":
      acc = acc * c.f.scale
    buf.at[wg][...] = acc.astype(c.dtype)
  plgpu.commit_smem()
  for name, ref in zip(("dk", "dv"), c.out_refs):
    plgpu.copy_smem_to_gmem(results[name][1].at[wg], ref.at[c.b, rows_out, c.hk])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if c.fused:  # the last dQ reduce-add has landed before the kernel ends
    plgpu.wait_smem_to_gmem(0)


def _dkv_step(c: DkvKernel, kv_base, t, carry):
  """Step t: query block i of query head h against this warpgroup's keys:
  P^T and dS^T (:func:`_step_scores`), dV += P^T dO and dK += dS^T Q, and
  with the fused dQ this block's part of dQ by the step's owner."""
  dk_acc, dv_acc = carry
  wg, b, stream = c.wg, c.b, c.stream
  st = stream.position(t)
  h, i = _dkv_coords(c, t)
  q_base = i * c.bq
  stream.consumer_wait(st, "q")
  stream.consumer_wait(st, "rows")
  stream.consumer_wait(st, "do")
  q_slot, do_slot = stream.slot(st, "q"), stream.slot(st, "do")
  scales = None
  if c.dq_scales_ref is not None:  # loaded early: the owner needs it last
    scales = load_broadcast(c.dq_scales_ref, (b, h, pl.ds(q_base, c.bq)), (c.bq,), ROW)
  p, ds = _dkv_scores(c, st, i, h, kv_base, q_base, c.bq,
                      s_ops=(c.stationary.slot(wg, "k"), q_slot),
                      dp_ops=(c.stationary.slot(wg, "v"), do_slot),
                      rows=lambda r: stream.slot(st, "rows", r))
  if c.fused:
    # This warpgroup's dS^T into the step's staging buffer, visible to
    # the tensor cores (fence), then the step's rendezvous: right after
    # the store, so that the owner waits for the other warpgroup's
    # dS^T and not for its dK/dV products as well (3.04 against
    # 3.21 ms for the kernel at the headline shape, H200, 2026-11-30).
    c.ds_st.at[ds_buffer(t), wg][...] = ds.astype(c.dtype)
    plgpu.commit_smem()
    barriers.ds_ready(dq_owner(t), wg)
  # dV += P^T dO and dK += dS^T Q: issued together, waited once.
  accs = {"dv": dv_acc, "dk": dk_acc}

  def grads(refs):
    if "dv" in refs:
      plgpu.wgmma(refs["dv"], p.astype(c.dtype), do_slot)
    if "dk" in refs:
      plgpu.wgmma(refs["dk"], ds.astype(c.dtype), q_slot)

  if c.blocks.schedule == "paired":
    accs = pl.run_state(grads)({n: plgpu.ACC.init(a) for n, a in accs.items()})
  else:
    for n in list(accs):
      accs[n] = pl.run_state(grads)({n: plgpu.ACC.init(accs[n])})[n]
  dv_acc, dk_acc = accs.get("dv"), accs.get("dk")
  # Every product reading the slot has completed (run_state waits).
  stream.consumer_release(st)
  if c.fused:
    # The step's owner forms its dQ part (both dS^T tiles are staged:
    # the rendezvous above) and reduce-adds it.
    @pl.when(wg == dq_owner(t))
    def _():
      part = _dq_product(c.ds_st, ds_buffer(t), c.k_st)
      if scales is not None:
        part = to_fixed_point(part, scales)
      _dq_reduce_add(part, c.dq_st.at[wg], c.dq_ref.at[b, pl.ds(q_base, c.bq), h])
  return dk_acc, dv_acc


def _dkv_scores(c: DkvKernel, st, i, h, kv_base, q_base, num_queries, *, s_ops, dp_ops, rows):
  """P^T and dS^T (None without dK) of one step's (keys x queries) tile:
  the tile's keep terms, then :func:`_step_scores`.  ``q_base``,
  ``num_queries``: the tile's queries (a part of query block ``i``);
  ``rows(r)``: their lse2 (r = 0) and delta (r = 1) in shared memory."""
  b = c.b
  shape = (c.bkv, num_queries)
  tile = (b, h, pl.ds(kv_base, c.bkv), pl.ds(q_base, num_queries))

  def per_query(ref):  # k_start / k_end of the tile's queries, along the tile
    v = load_broadcast(ref, (b, h, pl.ds(q_base, num_queries)), (num_queries,), COL)
    return lax.broadcast_in_dim(v, shape, [1])

  # With key ranges, only the steps outside the tile's run of query blocks
  # wholly inside every row's range (c.inner_lo, c.inner_hi; the table
  # leaves out tiles with padded keys) apply the range and padded-key terms
  # (_masked_terms).  Without ranges the padded-key term stays on every
  # step: a branch on the tile holding padded keys instead ran slower, 3.05
  # against 2.95 ms forward + backward at B5 T=S=3000 N16 D128 on the H200
  # (2026-12-02).
  edge_terms, terms = [], []
  if c.ks_ref is not None:
    edge_terms.append(lambda key: key >= per_query(c.ks_ref))
  if c.ke_ref is not None:
    edge_terms.append(lambda key: key < per_query(c.ke_ref))
  if c.mask_ref is not None:
    terms.append(lambda key: load_broadcast(c.mask_ref, tile, shape, WGMMA) != 0)
  if c.fused and (c.f.seq_kv % c.bkv or c.s_pad != c.f.seq_kv):
    # padded keys add nothing to dQ
    (edge_terms if edge_terms else terms).append(KeysBelow(c.f.seq_kv))
  inside = None
  if edge_terms:
    inside = lambda: (c.inner_lo <= i) & (i < c.inner_hi)
  return _step_scores(
      c.f, shape, s_ops=s_ops, dp_ops=dp_ops, paired=c.blocks.schedule == "paired",
      want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(
          c.bias_ref, tile, shape, WGMMA),
      terms=terms, key_dim=0, key_base=kv_base, num_keys=c.bkv, query_base=q_base,
      edge_terms=edge_terms, interior=inside,
      lse2_of=lambda: plgpu.load(rows(0), layout=COL, optimized=False),
      delta_of=lambda: plgpu.load(rows(1), layout=COL, optimized=False))


# The fused dQ.  dQ_i = scale * sum_j dS_ij K_j sums over every key tile, and
# the key tiles live in different blocks: each block adds its part (one
# streamed query block x head_dim, f32) into a zeroed f32 array in global
# memory with a TMA reduce-add, and one XLA cast finishes it.  Within a block,
# both warpgroups' dS^T tiles (64 keys x the block's queries each) go through
# shared memory so that ONE warpgroup forms the block's whole part, dS_i,tile
# K_tile, over all 128 keys of the tile: half the reduce-add traffic of a part
# per warpgroup.  The warpgroups take that turn alternately (step t: its owner,
# warpgroup t % 2): right after storing its own dS^T, the owner waits on the
# named barrier ds_ready_<owner> until the other warpgroup, which only
# arrives there right after its store, has stored its dS^T too
# (barriers.ds_ready); the owner's product follows its dK/dV products.  Two
# dS^T buffers (step t uses t % 2): the buffer of
# step t is written again at step t + 2, by the owner of step t itself (in
# program order after its product completed) and by the other warpgroup only
# after it passed its own wait of step t + 1, which needs the owner of step t
# to arrive there, which it does at step t + 1, after its product of step t
# completed.
# Taking turns beats splitting every step's part by columns (both warpgroups
# form half of its columns over all 128 keys after a sync on both staged dS^T
# tiles, the split FlashAttention-3 uses): forward + backward, d128, bf16,
# TFLOP/s, turns vs columns, measured on the H100 in one process (6424e59,
# 2026-12-05): 1k B16 N16 428.0 vs 392.5, 4k B4 500.8 vs 462.0, 16k B1 544.0
# vs 511.1, GQA 16/4 T=S=3000 B5 444.5 vs 405.5; with three stages, which
# the halved f32 staging leaves room for, 360.2, 434.4, 447.2, 363.3.  Under
# causal (the fused dQ there: kernel.experiments' "pallas-fused-causal") at
# 16k, turns vs columns 475.4 vs 498.3 (N16) and 504.6 vs 492.4 (GQA 32/8),
# the dQ kernel 480.5 and 478.3, cuDNN 526.7 and 525.6.  The turns let the
# warpgroups run offset, one on its products while the other forms its part.
# Order across blocks is not fixed, so a float32 dQ is not bitwise
# reproducible (dK, dV are); properties/test_gradients_gpu.py bounds the
# difference.  deterministic=True sums the same parts in fixed point instead
# (below), where the order does not matter.


# The fused dQ in fixed point (deterministic=True).  Integer addition is
# associative, so int32 reduce-adds give the same bits in any order.  Row i
# of dQ / scale is sum_j dS_ij K_j over the keys, and
#
#   |sum_j dS_ij K_jd| <= sum_j P_ij |dP_ij - delta_i| |K_jd|
#                      <= (|dO_i| max_j |V_j| + |delta_i|) max_jd |K_jd| = U_i
#
# (dP_ij = dO_i . V_j, Cauchy-Schwarz, and sum_j P_ij <= 1), for every subset
# of the keys too, so every partial sum of row i's parts is bounded by U_i.
# fixed_point_scales gives row i the power of two c_i <= 2^FIXED_POINT_BITS
# / U_i (and > half of it); the step's owner adds c_i * part rounded to an
# integer (to_fixed_point: to the nearest up to head dim 64, truncated over
# it), exact but for at most one unit per part, and the sum never leaves
# int32: |sum| <= 2^FIXED_POINT_BITS (times 1 + the float32 and bfloat16
# roundings of P and dS^T) < 2^31.  dq = sum / c_i * scale.  A part is
# resolved to 2^-FIXED_POINT_BITS of U_i, an a-priori bound that exceeds
# max_d |dq_id| by the cancellation of the sum (about 300 at 1k keys and
# 2000 at 16k with random normal inputs): in a float64 model of the sum over
# 128-key tiles the error reached 2.9e-6 of max|dq| at 1k keys, 7.7e-5 at
# 16k (d64) and 1.1e-4 (d128), under bfloat16's 2^-9 and float16's 2^-11
# relative rounding of the result.  On the H200 at 16k keys (d64), dq
# differed from the float32 sum's by at most one bfloat16 ulp of max|dq|, as
# the dQ kernel's does (2026-12-04).  A
# non-finite U_i (a NaN or infinity in dO_i, delta_i, or any key or value of
# the head, or a norm beyond float32's range) makes c_i NaN, and the row's dq
# NaN at the division.
FIXED_POINT_BITS = 29


def fixed_point_scales(k, v, do, rows, group: int):
  """(B, N, Tp) f32: c_i, the power of two each query row's dQ parts are
  multiplied by before their int32 reduce-adds (notes above), from the padded
  k (B, Sp, K, D), v, do (B, Tp, N, Dv) and the residual rows' delta."""
  f32 = jnp.float32
  # Each key's max |k| and |v|^2 first (row reductions over the head dim,
  # in one pass over K and V), fenced so that XLA keeps them, then the max
  # over keys of those (B, S, K) arrays.  Measured on the H100 in one
  # process against one reduction over (S, D) for K and the norms' max over
  # S for V (2026-12-05), the same bits, ms: d128 4k B4 N16 0.059 vs 0.074,
  # 16k B1 0.059 vs 0.070, d64 1k B16 N32 0.061 vs 0.070.
  k_row = jnp.max(jnp.abs(k.astype(f32)), axis=3)                            # (B, S, K)
  v_row = jnp.sum(jnp.square(v.astype(f32)), axis=3)
  k_row, v_row = lax.optimization_barrier((k_row, v_row))
  k_max = jnp.max(k_row, axis=1)                                             # (B, K)
  v_norm = jnp.sqrt(jnp.max(v_row, axis=1))
  do_norm = jnp.swapaxes(jnp.sqrt(jnp.sum(jnp.square(do.astype(f32)), axis=3)), 1, 2)
  per_head = lambda x: jnp.repeat(x, group, axis=1)[:, :, None]             # (B, N, 1)
  bound = (do_norm * per_head(v_norm) + jnp.abs(rows[:, :, 1])) * per_head(k_max)
  # bound = 0 (padded rows, dO_i = 0): no part is nonzero; the largest exponent.
  exponent = jnp.clip(jnp.floor(FIXED_POINT_BITS - jnp.log2(bound)), -126.0, 126.0)
  # A bound that is not finite leaves no scale to sum in: NaN, so that the
  # row's dq comes out NaN, never a finite value from saturated parts.
  return jnp.where(jnp.isfinite(bound), jnp.exp2(exponent), jnp.nan).astype(f32)


def to_fixed_point(part, scales):
  """c_i * part as int32: ``scales`` (the part's rows, ROW layout) are powers
  of two, so y = c_i * part is exact and |y| <= 2^FIXED_POINT_BITS.

  Up to head dim 64, y is rounded to the nearest integer by float adds
  (:func:`_round_by_adds`); wider parts are converted (truncated) by cvt,
  whose unit runs at a quarter of the float rate on sm90 and is the one the
  exponentials use.  Forward + backward with deterministic=True over the
  default, bf16, measured on the H200 in one process (2026-12-04), adds vs
  cvt: d64 1k B16 0.909 vs 0.899, 16k B1 0.923 vs 0.915, causal 4k B4 0.939
  vs 0.920, causal 16k B1 0.968 vs 0.939, causal GQA 32/8 T=S=3000 B5 0.914
  vs 0.894; d128 4k B4 0.905 vs 0.931, GQA 16/4 T=S=3000 B5 0.874 vs 0.913
  (the adds' temporaries beside a 128-column part)."""
  y = part * lax.broadcast_in_dim(scales, part.shape, [0])
  if part.shape[1] > 64:
    return y.astype(jnp.int32)
  return _round_by_adds(y)


def _round_by_adds(y):
  """round(y) as int32 for |y| < 2^30, without a conversion instruction.
  Adding 1.5 * 2^31 rounds y to a multiple of 2^8, and the sum's bits less
  the constant's count those multiples; the remainder r = y - h (exact,
  |r| <= 128) is rounded likewise with 1.5 * 2^23.  It needs float adds
  evaluated as written: Mosaic GPU allows contraction only (x * c + M is
  one fma, exact here); XLA's CPU compiler reassociates them under jit."""
  t = y + HI_MAGIC
  r = y - (t - HI_MAGIC)
  u = r + LO_MAGIC
  bits = lambda x: lax.bitcast_convert_type(x, jnp.int32)
  return bits(t) * 256 + (bits(u) - MAGIC_BITS)


HI_MAGIC = np.float32(1.5 * 2.0 ** 31)
LO_MAGIC = np.float32(1.5 * 2.0 ** 23)
# (bits(HI_MAGIC) << 8) + bits(LO_MAGIC), wrapped to int32 as the kernel's sum is
MAGIC_BITS = np.uint32(((int(HI_MAGIC.view(np.uint32)) << 8) + int(LO_MAGIC.view(np.uint32)))
                       % (1 << 32)).view(np.int32)


# The fused dQ's schedule: step t stages dS^T in buffer ds_buffer(t) and is
# owned by warpgroup dq_owner(t).  Both work on ints and traced int32 alike
# (t >= 0); the extracted proof checks the handoff they schedule.
DS_BUFFERS = 2


def ds_buffer(t):
  return t % DS_BUFFERS


def dq_owner(t):
  return t % CW


def _fused_dq_buffers(bkv, bq, head_dim, dtype, dq_dtype):
  """The fused dQ's shared memory: DS_BUFFERS dS^T staging buffers of both
  warpgroups' tiles, and per warpgroup a staging tile for its reduce-add
  (f32, or int32 in fixed point: the same bytes)."""
  # dS^T meets the K tiles in the dQ product, both from shared memory: one
  # swizzle, K's (64 bytes where its rows are 96 or 32 columns).
  k_swizzle = common.row_swizzle(head_dim, dtype)
  return (plan_lib.Buffer("ds", (DS_BUFFERS, CW, bkv, bq), np.dtype(dtype),
                          swizzle=k_swizzle if k_swizzle < 128 else None),
          plan_lib.Buffer("dq", (CW, bq, head_dim), np.dtype(dq_dtype)))


def _dq_product(ds_st, buf, k_st):
  """dS_i,tile K_tile (f32, unscaled): the contraction runs over both
  warpgroups' 64 keys, from their dS^T tiles staged in buffer ``buf`` of
  ``ds_st`` (buffers, CW, keys, queries) and the stationary K tiles."""
  def product(acc):
    for w in range(CW):
      plgpu.wgmma(acc, ds_st.at[buf, w].T, k_st.at[w])
    return acc[...]
  return pl.run_scoped(product, plgpu.ACC((ds_st.shape[3], k_st.shape[2]), jnp.float32))


def _dq_reduce_add(part, staging, dq_dst):
  """TMA reduce-add of one dQ part through this warpgroup's f32 staging tile."""
  # The previous reduce-add from this staging tile has read it.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  staging[...] = part
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(staging, dq_dst, reduction_op="add")


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
# (each recomputed S^T); dQ is the head-split dQ kernel's (notes above
# _wide_dq_step), and the ring has two stages, which a one-stage ring with
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


def exchange_buffer(t):
  return t % EXCHANGE_BUFFERS


def _wide_buffers(blocks: BackwardBlocks, head_dim: int, head_dim_out: int, dtype) -> tuple:
  """The head-split launch's shared memory (same order as dkv_buffers)."""
  bkv, bq, stages = blocks.rows, blocks.dkv_stream_q, blocks.num_stages
  dt, f32 = np.dtype(dtype), np.dtype(np.float32)
  B = functools.partial(plan_lib.Buffer, swizzle=WIDE_SWIZZLE)
  return (B("k", (1, bkv, head_dim), dt), B("v", (1, bkv, head_dim_out), dt),
          B("q", (stages, bq, head_dim), dt), B("do", (stages, bq, head_dim_out), dt),
          plan_lib.Buffer("rows", (stages, 2, bq), f32, swizzled=False),
          B("pt", (EXCHANGE_BUFFERS, bkv, bq), dt), B("ds", (EXCHANGE_BUFFERS, bkv, bq), dt))


def _shared_slot(c):
  """Slot 0 of the head split's stationary tiles (both kernels), which both
  compute warpgroups read, as a traced index (wg // 2 = 0 for both): the
  products' run_state cannot lower a ref indexed by a Python constant."""
  return lax.div(c.wg, jnp.int32(CW))


def _wide_load_stationary(c: DkvKernel):
  keys = pl.ds(c.j * c.bkv, c.bkv)
  c.stationary.producer_copy(c.k_ref.at[c.b, keys, c.hk], 0, "k")
  c.stationary.producer_copy(c.v_ref.at[c.b, keys, c.hk], 0, "v")


def _wide_compute(c: DkvKernel):
  """A compute warpgroup of the head-split launch: its half of the head dim
  of dK and dV over every step, then staged in the stationary tiles and
  stored, one output by each warpgroup."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  c.stationary.consumer_wait(_shared_slot(c), "k")
  c.stationary.consumer_wait(_shared_slot(c), "v")
  dk_cols, dv_cols = c.head_dim // CW, c.head_dim_out // CW
  zeros = lambda d: plgpu.layout_cast(jnp.zeros((c.bkv, d), jnp.float32), WGMMA)
  dk_acc, dv_acc = lax.fori_loop(0, c.steps, functools.partial(_wide_step, c),
                                 (zeros(dk_cols), zeros(dv_cols)))
  # K and V are free to stage dK and dV: each step's last reads of them (S^T
  # and dP^T) precede its rendezvous, which both warpgroups passed.
  c.k_st.at[0, :, pl.ds(wg * dk_cols, dk_cols)][...] = (dk_acc * c.f.scale).astype(c.dtype)
  c.v_st.at[0, :, pl.ds(wg * dv_cols, dv_cols)][...] = dv_acc.astype(c.dtype)
  plgpu.commit_smem()
  barriers.epilogue_sync()  # both halves staged before the copy reads them
  keys = pl.ds(c.j * c.bkv, c.bkv)
  dk_ref, dv_ref = c.out_refs

  @pl.when(wg == 0)
  def _():
    plgpu.copy_smem_to_gmem(c.k_st.at[0], dk_ref.at[c.b, keys, c.hk])

  @pl.when(wg == 1)
  def _():
    plgpu.copy_smem_to_gmem(c.v_st.at[0], dv_ref.at[c.b, keys, c.hk])

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _wide_step(c: DkvKernel, t, carry):
  """Step t of the head-split launch (the notes above)."""
  dk_acc, dv_acc = carry
  wg, stream = c.wg, c.stream
  pt_st, ds_st = c.exchange
  st = stream.position(t)
  h, i = _dkv_coords(c, t)
  q_base = i * c.bq
  stream.consumer_wait(st, "q")
  stream.consumer_wait(st, "rows")
  stream.consumer_wait(st, "do")
  q_slot, do_slot = stream.slot(st, "q"), stream.slot(st, "do")
  half = c.bq // CW
  mine = pl.ds(wg * half, half)
  kv_base = c.j * c.bkv
  p, ds = _dkv_scores(c, st, i, h, kv_base, q_base + wg * half, half,
                      s_ops=(c.stationary.slot(_shared_slot(c), "k"), q_slot.at[mine]),
                      dp_ops=(c.stationary.slot(_shared_slot(c), "v"), do_slot.at[mine]),
                      rows=lambda r: stream.slot(st, "rows", r).at[mine])
  x = exchange_buffer(t)
  pt_st.at[x, :, mine][...] = p.astype(c.dtype)
  ds_st.at[x, :, mine][...] = ds.astype(c.dtype)
  plgpu.commit_smem()
  barriers.halves_ready()
  dk_cols = pl.ds(wg * dk_acc.shape[1], dk_acc.shape[1])
  dv_cols = pl.ds(wg * dv_acc.shape[1], dv_acc.shape[1])

  def grads(refs):
    plgpu.wgmma(refs["dv"], pt_st.at[x], do_slot.at[:, dv_cols])
    plgpu.wgmma(refs["dk"], ds_st.at[x], q_slot.at[:, dk_cols])

  accs = pl.run_state(grads)({"dv": plgpu.ACC.init(dv_acc), "dk": plgpu.ACC.init(dk_acc)})
  # Both products that read the slot have completed (run_state waits).
  stream.consumer_release(st)
  return accs["dk"], accs["dv"]


@dataclasses.dataclass(frozen=True)
class DqKernel(_Launch):
  """One dQ launch: its own switch (set by :func:`dq_call`) and, inside the
  kernel, its grid point (set by :func:`_dq_kernel`)."""

  want_ds: bool             # also write dS (the logits gradient)
  num_tiles: int = 0        # query tiles of the grid
  # Inside the kernel:
  qi: Any = None            # the query tile
  h: Any = None
  lb: Any = None            # the tile's key blocks [lb, ub)
  ub: Any = None
  k_start_max: Any = None   # the tile's key-range bounds (None: no ranges)
  k_end_min: Any = None
  ds_ref: Any = None
  stationary: ring_lib.WarpgroupSlots | None = None   # q, dO, rows per compute warpgroup
  stream: ring_lib.Ring | None = None                  # k, v per key block

  # Query rows per warpgroup (stationary), keys per streamed block, S's shape.
  bq = property(lambda self: self.blocks.rows)
  bkv = property(lambda self: self.blocks.dq_stream_kv)
  shape = property(lambda self: (self.bq, self.bkv))


def dq_launch_order(f: BackwardFeatures, blocks: BackwardBlocks, *, batch: int,
                    num_heads: int, group: int, t_pad: int, s_pad: int,
                    head_dims: tuple[int, int], dtype, num_sms: int,
                    window: tuple[int, int] | None = None) -> schedule_lib.LaunchOrder | None:
  """The dQ grid's launch order under causal (None: head by head): see
  :func:`dq_call`.  A unit is one query head; the heads of a group,
  adjacent in a section, read the same K and V.  Under a local ``window``
  only where the sections repay (as in :func:`dkv_launch_order`)."""
  if not f.is_causal:
    return None
  order = schedule_lib.LaunchOrder.for_grid(
      batch * num_heads, t_pad // blocks.dq_tile, num_sms=num_sms,
      unit_bytes=s_pad * sum(head_dims) * jnp.dtype(dtype).itemsize // group)
  if window is not None and not schedule_lib.sections_repay(
      order, query_tile_weights(f, blocks, t_pad=t_pad, window=window), num_sms):
    return None
  return order


def dq_call(q, k, v, do, rows, bias, mask, k_start, k_end, k_range_tiles, *,
            f: BackwardFeatures, blocks: BackwardBlocks, want_ds: bool,
            num_sms: int = schedule_lib.DEFAULT_NUM_SMS,
            window: tuple[int, int] | None = None):
  """dQ (and dS, the logits gradient, when ``want_ds``) on padded inputs.

  Same arguments as :func:`dkv_call`, with bias and mask in their own
  orientation, and k_range_tiles the per-tile key-range bounds for this
  kernel's tiles of 2 * 64 query rows (kernel.padding.key_ranges).
  Returns dq (B, Tp, N, D) and ds (B, N, Tp, Sp) f32 or None; ds blocks
  outside the tile's key range are not written (the caller zeroes them).
  Under causal the query tiles launch in
  sections of (batch, head) units, heaviest first across a section, as in
  :func:`dkv_call`; a section's units re-read their kv heads' K and V.
  """
  batch, t_pad, num_heads, head_dim = q.shape
  _, s_pad, num_kv_heads, head_dim_out = v.shape
  dtype = q.dtype
  group = num_heads // num_kv_heads
  order = dq_launch_order(f, blocks, batch=batch, num_heads=num_heads, group=group,
                          t_pad=t_pad, s_pad=s_pad, head_dims=(head_dim, head_dim_out),
                          dtype=dtype, num_sms=num_sms, window=window)
  kernel = DqKernel(f=f, blocks=blocks, want_ds=want_ds, head_dim=head_dim, dtype=dtype,
                    num_kv_heads=num_kv_heads, group=group, s_pad=s_pad,
                    num_tiles=t_pad // blocks.dq_tile, order=order)

  def body(*refs):
    _dq_kernel(kernel, *refs)

  scratch = _allocate(dq_buffers(blocks, head_dim, head_dim_out, dtype, want_ds=want_ds))
  out_type = [jax.ShapeDtypeStruct((batch, t_pad, num_heads, head_dim), dtype)]
  if want_ds:
    out_type.append(jax.ShapeDtypeStruct((batch, num_heads, t_pad, s_pad), jnp.float32))
  results = plgpu.kernel(
      body, out_type=out_type, scratch_types=[scratch, _barrier_refs(dq_mbarriers(blocks))],
      # Mosaic GPU launches the last grid dimension fastest: the query
      # tiles, so that the blocks in flight at once are one head's tiles,
      # which read the same K and V; under causal _dq_kernel walks them
      # heaviest first, so that each head's last blocks are its short tiles.
      # Forward + backward, bf16, ms, measured on the H200 in one process
      # (2026-12-04) against the query tiles slowest, walked heaviest first
      # at head dims over 128 only (cuDNN): d128 causal 4k B4 N16 2.273 vs 2.402
      # (2.215), 16k B1 8.060 vs 8.532 (7.420), GQA 16/4 8k B2 4.438 vs 4.478
      # (4.065), T=S=3000 B5 GQA 16/4 1.857 vs 1.906 (1.624); d256 causal
      # 16k B1 9.702 vs 9.865 (9.409), d256 4k B4 5.064 vs 5.181 (4.744);
      # d64 4k B4 deterministic=True (then this kernel) 5.071 vs 5.331.
      # Walked lightest first, the same grid took 2.332 and 8.161 ms at
      # d128 causal 4k and 16k.  Under causal _dq_kernel remaps the launch
      # index through kernel.order (sections of heads, heaviest first across
      # them: dkv_call has the measurements).
      grid=(batch, num_heads, t_pad // blocks.dq_tile), grid_names=("batch", "heads", "q_tiles"),
      num_threads=barriers.NUM_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
  )(q, k, v, do, rows, bias, mask, k_start, k_end, k_range_tiles)
  return (results[0], results[1]) if want_ds else (results[0], None)


def _dq_kernel(c: DqKernel, q_ref, k_ref, v_ref, do_ref, rows_ref, bias_ref, mask_ref, ks_ref,
               ke_ref, tiles_ref, dq_ref, *rest):
  """The dQ kernel's entry: its rings over the scratch, the query tile of
  this grid point and its key blocks, each warpgroup's role."""
  ds_ref = rest[0] if c.want_ds else None
  (q_st, do_st, rows_st, k_ring, v_ring, exchange, ds_st), bars = (
      rest[1:] if c.want_ds else rest)
  q_stat, do_stat, rows_stat, k_prod, v_prod, consumed = bars
  # Q, dO and the residual rows stationary, one tile per compute warpgroup;
  # each step streams a key block's k and v.
  stationary = ring_lib.WarpgroupSlots(
      {"q": (q_st, q_stat), "do": (do_st, do_stat), "rows": (rows_st, rows_stat)})
  stream = ring_lib.Ring(c.blocks.num_stages, {"k": (k_ring, k_prod), "v": (v_ring, v_prod)},
                         consumed)
  wg = lax.axis_index("wg")
  qi, h, b = (lax.axis_index(n) for n in ("q_tiles", "heads", "batch"))
  if c.order is not None:
    # The grid launches q_tiles fastest, then heads, then batch: unit
    # u = b * heads + h, and rank r is the r-th heaviest query tile.
    heads = jnp.int32(q_ref.shape[2])
    unit, rank = c.order.locate((b * heads + h) * jnp.int32(c.num_tiles) + qi)
    b, h = lax.div(unit, heads), lax.rem(unit, heads)
    qi = jnp.int32(c.num_tiles - 1) - rank
  elif c.f.is_causal:
    # The last query tiles see the most keys: they go first (dq_call).
    qi = jnp.int32(c.num_tiles - 1) - qi
  hk = lax.div(h, jnp.int32(c.group))
  f = c.f
  start_max = end_min = None
  tile = c.blocks.dq_tile
  if tiles_ref is None:
    lb, ub = kv_block_range(qi, tile_q=tile, block_kv=c.bkv, seq_q=f.seq_q,
                            seq_kv=f.seq_kv, is_causal=f.is_causal)
  else:
    start_min, start_max, end_min, end_max = tile_key_bounds(tiles_ref, b, h, qi)
    lb, ub = kv_block_range(qi, tile_q=tile, block_kv=c.bkv, seq_q=f.seq_q,
                            seq_kv=f.seq_kv, is_causal=f.is_causal, k_start_min=start_min,
                            k_end_max=end_max)
  c = dataclasses.replace(
      c, wg=wg, qi=qi, h=h, b=b, hk=hk, lb=lb, ub=ub, k_start_max=start_max,
      k_end_min=end_min, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref,
      do_ref=do_ref, rows_ref=rows_ref, bias_ref=bias_ref, mask_ref=mask_ref, ks_ref=ks_ref,
      ke_ref=ke_ref, dq_ref=dq_ref, ds_ref=ds_ref, ds_st=ds_st, exchange=exchange,
      stationary=stationary, stream=stream)
  split = c.blocks.head_split
  pl.when(wg < CW)(functools.partial(_wide_dq_compute if split else _dq_compute, c))
  pl.when(wg == CW)(lambda: _memory_warpgroup(
      functools.partial(_wide_dq_load_stationary if split else _dq_load_stationary, c),
      functools.partial(_dq_fill, c), 0, ub - lb, stream))


def _dq_load_stationary(c: DqKernel):
  for w in range(CW):
    rows_w = pl.ds((CW * c.qi + w) * c.bq, c.bq)
    c.stationary.producer_copy(c.q_ref.at[c.b, rows_w, c.h], w, "q")
    c.stationary.producer_copy(c.do_ref.at[c.b, rows_w, c.h], w, "do")
    c.stationary.producer_copy(c.rows_ref.at[c.b, c.h, :, rows_w], w, "rows")


def _dq_fill(c: DqKernel, t, st):
  keys = pl.ds((c.lb + t) * c.bkv, c.bkv)
  stream = c.stream
  stream.producer_copy(c.k_ref.at[c.b, keys, c.hk], st, "k")
  stream.producer_copy(c.v_ref.at[c.b, keys, c.hk], st, "v")


def _dq_compute(c: DqKernel):
  """A compute warpgroup: its 64 query rows' dQ over the tile's key
  blocks, then staged in its query tile and stored."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  q_base = (CW * c.qi + wg) * c.bq
  rows = pl.ds(q_base, c.bq)
  lse2, delta, ks, ke = _dq_row_inputs(c, wg, rows)
  step = functools.partial(_dq_step, c, q_base, rows, lse2, delta, ks, ke)
  dq_acc = plgpu.layout_cast(jnp.zeros((c.bq, c.head_dim), jnp.float32), WGMMA)
  dq_acc = lax.fori_loop(c.lb, c.ub, step, dq_acc)
  # q is no longer read: it stages dQ.
  q_st = c.stationary.slot(wg, "q")
  q_st[...] = (dq_acc * c.f.scale).astype(c.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_st, c.dq_ref.at[c.b, rows, c.h])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dq_row_inputs(c: DqKernel, slot, rows):
  """(lse2, delta, k_start, k_end) of the stationary query rows ``rows``,
  per row (ROW layout; the key-range bounds None without ranges), once
  stationary slot ``slot``'s q, dO and rows have landed: both dQ kernels'
  compute warpgroups read them before their key loop."""
  for name in ("q", "do", "rows"):
    c.stationary.consumer_wait(slot, name)
  lse2 = plgpu.load(c.stationary.slot(slot, "rows", 0), layout=ROW, optimized=False)
  delta = plgpu.load(c.stationary.slot(slot, "rows", 1), layout=ROW, optimized=False)
  per_row = lambda ref: None if ref is None else load_broadcast(ref, (c.b, c.h, rows), (c.bq,),
                                                                 ROW)
  return lse2, delta, per_row(c.ks_ref), per_row(c.ke_ref)


def _dq_keep_terms(c: DqKernel, shape, tile, ks, ke, k_base):
  """(edge_terms, terms, interior) of a dQ step's (queries x keys) tile
  (:func:`_step_scores`), for the streamed key block at ``k_base``.  With
  key ranges, only the key blocks that hold a padded key or cross a row's
  range bound (from the tile's largest start to its smallest end) apply the
  range and padded-key terms (_masked_terms); without ranges the padded-key
  term stays on every step, as in the dK/dV kernel."""
  f = c.f
  edge_terms, terms = [], []
  if ks is not None:
    edge_terms.append(lambda key: key >= lax.broadcast_in_dim(ks, shape, [0]))
  if ke is not None:
    edge_terms.append(lambda key: key < lax.broadcast_in_dim(ke, shape, [0]))
  padded_keys = bool(f.seq_kv % c.bkv or c.s_pad != f.seq_kv)
  if padded_keys:
    (edge_terms if edge_terms else terms).append(KeysBelow(f.seq_kv))

  def interior():
    inside = (c.k_start_max <= k_base) & (k_base + c.bkv <= c.k_end_min)
    return inside & (k_base + c.bkv <= f.seq_kv) if padded_keys else inside

  if c.mask_ref is not None:
    terms.append(lambda key: load_broadcast(c.mask_ref, tile, shape, WGMMA) != 0)
  return edge_terms, terms, interior


def _dq_step(c: DqKernel, q_base, rows, lse2, delta, ks, ke, ki, dq_acc):
  """Key block ki against this warpgroup's query rows: P and dS
  (:func:`_step_scores`), dQ += dS K, and dS stored where wanted."""
  f, wg, b, h, stream, shape = c.f, c.wg, c.b, c.h, c.stream, c.shape
  st = stream.position(ki - c.lb)
  k_base = ki * c.bkv
  stream.consumer_wait(st, "k")
  stream.consumer_wait(st, "v")
  k_slot, v_slot = stream.slot(st, "k"), stream.slot(st, "v")
  tile = (b, h, rows, pl.ds(k_base, c.bkv))
  edge_terms, terms, interior = _dq_keep_terms(c, shape, tile, ks, ke, k_base)
  _, ds = _step_scores(
      f, shape, s_ops=(c.stationary.slot(wg, "q"), k_slot),
      dp_ops=(c.stationary.slot(wg, "do"), v_slot), paired=c.blocks.schedule == "paired",
      want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(c.bias_ref, tile, shape,
                                                                     WGMMA),
      terms=terms, key_dim=1, key_base=k_base, num_keys=c.bkv, query_base=q_base,
      lse2_of=lambda: lse2, delta_of=lambda: delta, edge_terms=edge_terms,
      interior=interior)

  def dsk(acc):
    plgpu.wgmma(acc, ds.astype(c.dtype), k_slot)

  dq_acc = pl.run_state(dsk)(plgpu.ACC.init(dq_acc))
  stream.consumer_release(st)
  if c.want_ds:
    # The previous block's dS copy must have read the staging buffer.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    c.ds_st.at[wg][...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c.ds_st.at[wg], c.ds_ref.at[b, h, rows, pl.ds(k_base, c.bkv)])
  return dq_acc


# The head-split dQ kernel (head dims over 128), the dK/dV launch's split
# turned around: one block owns ONE tile of 64 query rows (Q, dO, lse,
# delta stationary, 64-byte swizzled) for both compute warpgroups and
# streams key blocks of 64 through a two-stage ring.  Warpgroup w forms S
# and dP of the tile against its 32 keys of the block (64 queries x 32 keys),
# dS, and stages dS in the compute dtype into columns [32 w, 32 w + 32) of
# the step's exchange buffer; after the rendezvous (barriers.halves_ready)
# it forms its half of dQ's head dim, dQ[:, cols] += dS K[:, cols], over all
# 64 keys.  Exchange buffers as in the dK/dV launch (step t uses t % 2).


def _wide_dq_load_stationary(c: DqKernel):
  rows = pl.ds(c.qi * c.bq, c.bq)
  c.stationary.producer_copy(c.q_ref.at[c.b, rows, c.h], 0, "q")
  c.stationary.producer_copy(c.do_ref.at[c.b, rows, c.h], 0, "do")
  c.stationary.producer_copy(c.rows_ref.at[c.b, c.h, :, rows], 0, "rows")


def _wide_dq_compute(c: DqKernel):
  """A compute warpgroup of the head-split dQ kernel: its half of dQ's head
  dim over the tile's key blocks, staged in the Q tile, stored by
  warpgroup 0."""
  plgpu.set_max_registers(232, action="increase")
  wg = c.wg
  shared = _shared_slot(c)
  q_base = c.qi * c.bq
  rows = pl.ds(q_base, c.bq)
  lse2, delta, ks, ke = _dq_row_inputs(c, shared, rows)
  cols = c.head_dim // CW
  step = functools.partial(_wide_dq_step, c, shared, q_base, rows, lse2, delta, ks, ke)
  dq_acc = plgpu.layout_cast(jnp.zeros((c.bq, cols), jnp.float32), WGMMA)
  dq_acc = lax.fori_loop(c.lb, c.ub, step, dq_acc)
  q_st = c.stationary.slot(shared, "q")
  # Q is free to stage dQ: each step's last read of it (S) precedes its
  # rendezvous, which both warpgroups passed.
  q_st.at[:, pl.ds(wg * cols, cols)][...] = (dq_acc * c.f.scale).astype(c.dtype)
  plgpu.commit_smem()
  barriers.epilogue_sync()  # both halves staged before the copy reads them

  @pl.when(wg == 0)
  def _():
    plgpu.copy_smem_to_gmem(q_st, c.dq_ref.at[c.b, rows, c.h])

  plgpu.wait_smem_to_gmem(0)


def _wide_dq_step(c: DqKernel, shared, q_base, rows, lse2, delta, ks, ke, ki, dq_acc):
  """Key block ki of the head-split dQ kernel (the notes above)."""
  f, wg, b, h, stream = c.f, c.wg, c.b, c.h, c.stream
  t = ki - c.lb
  st = stream.position(t)
  k_base = ki * c.bkv
  stream.consumer_wait(st, "k")
  stream.consumer_wait(st, "v")
  k_slot, v_slot = stream.slot(st, "k"), stream.slot(st, "v")
  half = c.bkv // CW
  mine = pl.ds(wg * half, half)
  my_base = k_base + wg * half
  shape = (c.bq, half)
  tile = (b, h, rows, pl.ds(my_base, half))
  # interior() judges the whole key block (both halves).
  edge_terms, terms, interior = _dq_keep_terms(c, shape, tile, ks, ke, k_base)
  _, ds = _step_scores(
      f, shape, s_ops=(c.stationary.slot(shared, "q"), k_slot.at[mine]),
      dp_ops=(c.stationary.slot(shared, "do"), v_slot.at[mine]),
      paired=c.blocks.schedule == "paired", want_ds=True,
      bias_of=lambda: None if c.bias_ref is None else load_broadcast(c.bias_ref, tile, shape,
                                                                     WGMMA),
      terms=terms, key_dim=1, key_base=my_base, num_keys=half, query_base=q_base,
      lse2_of=lambda: lse2, delta_of=lambda: delta, edge_terms=edge_terms,
      interior=interior)
  x = exchange_buffer(t)
  c.exchange.at[x, :, mine][...] = ds.astype(c.dtype)
  plgpu.commit_smem()
  barriers.halves_ready()
  cols = pl.ds(wg * dq_acc.shape[1], dq_acc.shape[1])

  def dsk(acc):
    plgpu.wgmma(acc, c.exchange.at[x], k_slot.at[:, cols])

  dq_acc = pl.run_state(dsk)(plgpu.ACC.init(dq_acc))
  stream.consumer_release(st)
  if c.want_ds:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    c.ds_st.at[wg][...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c.ds_st.at[wg], c.ds_ref.at[b, h, rows, pl.ds(my_base, half)])
  return dq_acc


def residual_rows(m, l, out, d_out, t_pad: int):
  """(B, N, 2, Tp) f32, the per-row inputs the kernels stream: lse in base 2
  from the forward's natural-log residuals (+inf where l = 0, a fully masked
  row, and in padded rows) and delta = rowsum(dO * O) (0 in padded rows)."""
  t = m.shape[2]
  live = l > 0
  lse2 = jnp.where(live, m * LOG2E + jnp.log2(jnp.where(live, l, 1.0)), jnp.inf)
  # delta in the inputs' own (B, T, N) order, fenced off from the transpose
  # and stack below: XLA fused all three into one kernel that took 0.29 ms
  # at the headline shape, against 0.05 ms this way (H200, 2026-11-30).
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = jnp.swapaxes(lax.optimization_barrier(delta), 1, 2)
  lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, t_pad - t)), constant_values=jnp.inf)
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, t_pad - t)))
  return jnp.stack([lse2, delta], axis=2).astype(jnp.float32)


def attention_backward(query, key, value, bias, mask, k_start, k_end, out, m, l, d_out,
                       *, scale, is_causal=False, logits_soft_cap=None, schedule="paired",
                       fuse_dq=True, fixed_point_dq=False, fuse_dq_causal: bool | None = None,
                       head_dims=plan_lib.backward_head_dims,
                       num_sms: int = schedule_lib.DEFAULT_NUM_SMS,
                       window: tuple[int, int] | None = None):
  """Gradients (dq, dk, dv, dbias) of sum(out * d_out), from the forward's
  residuals, on the sm90 kernels above.  Same contract and arguments as
  ``kernel.backward_xla.attention_backward`` (its executable specification):
  inputs in the compute dtype, unpadded; m (natural log) and l (B, N, T).

  dQ is accumulated inside the dK/dV kernel (see the fused dQ notes below) when
  ``fuse_dq`` and :func:`fuses_dq` allow it, else formed by the dQ kernel.
  ``fixed_point_dq``: the fused dQ sums in int32 fixed point (bitwise
  reproducible: the notes above :data:`FIXED_POINT_BITS`) instead of
  float32.  ``fuse_dq_causal``: under causal, fuse dQ wherever it fits
  (True) or nowhere (False) instead of where :func:`blocks_for` says
  (kernel.experiments' A/B).  ``head_dims``: the rule of the head dims
  computed with (kernel.plan.backward_head_dims; kernel.experiments'
  "pallas-narrow-rows" takes the forward's).  ``num_sms``: the GPU's SMs,
  which the causal launch order balances over (kernel.schedule.LaunchOrder).
  ``window``: jax.nn's local window (left, right) when the key ranges come
  from one, which the launch order weighs the tiles by (the kernels read
  the ranges alone).
  """
  dtype = query.dtype
  batch, t, heads, hd = query.shape
  s, hdv = key.shape[1], value.shape[3]
  f = BackwardFeatures(scale=float(scale), is_causal=bool(is_causal),
                       logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                       seq_q=t, seq_kv=s)
  d, dv_dim = head_dims(hd, hdv)
  blocks = dataclasses.replace(blocks_for(d, dv_dim, is_causal=f.is_causal), schedule=schedule)
  if fuse_dq_causal is not None:
    blocks = dataclasses.replace(blocks, fuse_dq_causal=fuse_dq_causal)
  for name, est in smem_estimates(d, dv_dim, dtype, with_bias=bias is not None,
                                  is_causal=f.is_causal, fuse_dq=fuse_dq).items():
    if not plan_lib.fits_in_smem(est):  # by construction never; said clearly if it were
      raise ValueError(f"backward launch {name} needs an estimated {est} bytes of shared "
                       f"memory for head_dim={hd}, head_dim_out={hdv}; the limit is "
                       f"{plan_lib.SMEM_LIMIT_BYTES} bytes (227 KiB)")
  t_mult, s_mult = blocks.query_multiple, blocks.key_multiple

  pad = padding.pad_to_multiple
  q = pad(padding.pad_head_dim(query, d), 1, t_mult)
  k = pad(padding.pad_head_dim(key, d), 1, s_mult)
  v = pad(padding.pad_head_dim(value, dv_dim), 1, s_mult)
  do = pad(padding.pad_head_dim(d_out.astype(dtype), dv_dim), 1, t_mult)
  t_pad, s_pad = q.shape[1], k.shape[1]

  rows = residual_rows(m, l, out, d_out, t_pad)

  bias4 = None if bias is None else padding.broadcast_operand(bias, dtype, t_mult, s_mult)
  mask4 = None if mask is None else padding.broadcast_operand(mask, jnp.int8, t_mult, s_mult)
  tile = blocks.dq_tile
  ks, ke, tiles = padding.key_ranges(k_start, k_end, seq_kv=s, tile=tile,
                                     num_tiles=t_pad // tile)

  block_args = dict(seq_kv=s, num_rows=t_pad, block_q=blocks.dkv_stream_q,
                    key_tile=blocks.dkv_tile, num_key_tiles=s_pad // blocks.dkv_tile,
                    group=heads // key.shape[2])
  query_blocks = padding.query_block_ranges(ks, ke, **block_args)
  inner_blocks = padding.query_block_inner_bounds(ks, ke, **block_args)
  swap = lambda x: None if x is None else jnp.swapaxes(x, 2, 3)
  fused = fuse_dq and fuses_dq(blocks, with_bias=bias is not None, is_causal=f.is_causal)
  launch = functools.partial(dkv_call, q, k, v, do, rows, swap(bias4), swap(mask4), ks, ke,
                             f=f, blocks=blocks, query_blocks=query_blocks,
                             inner_blocks=inner_blocks, num_sms=num_sms, window=window)
  if fused:
    # The float32 dQ accumulator is a ref of a state scope of its own
    # (run_state, which hands back its final value), not a jax.new_ref of
    # the traced program: custom_partitioning (kernel/sharding.py) cannot
    # lower a program that holds a mutable array's effect.
    scales = (fixed_point_scales(k, v, do, rows, heads // key.shape[2])
              if fixed_point_dq else None)

    def fused_launch(refs):
      acc, dk, dv = refs
      got = launch(dq_accum=acc, dq_scales=scales)
      dk[...], dv[...] = got["dk"], got["dv"]

    acc_dtype = jnp.int32 if fixed_point_dq else jnp.float32
    dq_acc, dk_pad, dv_pad = pl.run_state(fused_launch)(
        (jnp.zeros(q.shape, acc_dtype), jnp.zeros_like(k), jnp.zeros_like(v)))
    dkv = {"dk": dk_pad, "dv": dv_pad}
    dq = dq_acc.astype(jnp.float32) * f.scale
    if fixed_point_dq:
      dq = dq / jnp.swapaxes(scales, 1, 2)[..., None]
    dq, ds = dq.astype(dtype), None
  else:
    dkv = launch()
    dq, ds = dq_call(q, k, v, do, rows, bias4, mask4, ks, ke, tiles, f=f, blocks=blocks,
                     want_ds=bias is not None, num_sms=num_sms, window=window)

  dbias = None
  if bias is not None:
    # Blocks the dq kernel skipped (outside a tile's key range) are unwritten;
    # every logit there is masked, so their gradient is 0.
    visited = _visited_blocks(ds.shape, tiles, f, blocks)
    ds = jnp.where(visited, ds, 0.0)[:, :, :t, :s]
    bias_shape = jnp.shape(bias)
    full = lax.broadcast_to_rank(jnp.zeros(bias_shape, jnp.float32), 4).shape
    summed = jnp.sum(ds, axis=tuple(a for a in range(4) if full[a] == 1), keepdims=True)
    dbias = summed.reshape(bias_shape).astype(bias.dtype)
  return (dq[:, :t, :, :hd], dkv["dk"][:, :s, :, :hd], dkv["dv"][:, :s, :, :hdv], dbias)


def _visited_blocks(ds_shape, tiles, f: BackwardFeatures, blocks: BackwardBlocks):
  """(B|1, N|1, Tp, Sp) bool: the dS entries the dq kernel wrote."""
  _, _, t_pad, s_pad = ds_shape
  tile, bkv = blocks.dq_tile, blocks.dq_stream_kv
  qi = jnp.arange(t_pad // tile, dtype=jnp.int32)
  if tiles is None:
    lb, ub = kv_block_range(qi, tile_q=tile, block_kv=bkv, seq_q=f.seq_q,
                            seq_kv=f.seq_kv, is_causal=f.is_causal)
    lb, ub = (jnp.broadcast_to(x, qi.shape)[None, None] for x in (lb, ub))
  else:
    start_min, _, _, end_max = tiles
    shape = jnp.broadcast_shapes(start_min.shape, end_max.shape)
    qi3 = jnp.broadcast_to(qi, shape)
    lb, ub = kv_block_range(qi3, tile_q=tile, block_kv=bkv, seq_q=f.seq_q,
                            seq_kv=f.seq_kv, is_causal=f.is_causal,
                            k_start_min=jnp.broadcast_to(start_min, shape),
                            k_end_max=jnp.broadcast_to(end_max, shape))
  block = jnp.arange(s_pad, dtype=jnp.int32) // bkv                 # (Sp,)
  lb = jnp.repeat(lb, tile, axis=2)[..., None]                        # (.., Tp, 1)
  ub = jnp.repeat(ub, tile, axis=2)[..., None]
  return (block >= lb) & (block < ub)
