"""What the forward does differently for FP8 (float8_e4m3fn) inputs, beside
V^T (kernel.tiling.plan.fp8_key_order, made in kernel/padding.py): P is
quantised to e4m3 for the PV product at 2^P_SCALE_LOG2 times its value and
handed to it as wgmma's 8-bit A operand, and each tile reads its descales.

The descales of a tile are two float32 scalars: q_descale * k_descale, which
multiplies the logits' scale, and v_descale, which multiplies the output
(kernel/padding.py forms them, per tensor or per (batch, kv head))."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernel.common import batch_head
from kernel.sync.seams import seam
from kernel.tiling.plan import FP8_P_SCALE_LOG2

# P = exp2(s - m + 8) lies in [0, 2^8]: e4m3's normal range (up to 448)
# instead of [0, 1], whose small values would be subnormal or zero, as
# FlashAttention-3 does (docs/decisions/fp8-p-scale.md).  l sums the same
# scaled P, so the normalised output does not see the scale; the
# unnormalised output and the residual l are divided by it.
P_SCALE_LOG2 = FP8_P_SCALE_LOG2
P_SCALE = float(2 ** P_SCALE_LOG2)
E4M3 = jnp.float8_e4m3fn
# A deferred rescale leaves P up to P_SCALE / rescale_threshold; e4m3 holds
# up to 448, so the API raises an FP8 call's threshold to this
# (P <= 409.6).
MIN_THRESHOLD = 0.625
# The FP8 contract's range of the logits (descales included): past it
# float32 cannot hold P's 2^P_SCALE_LOG2 offset beside the row's max.
LOGIT_LIMIT = 2.0 ** 24


def p_operand(p):
  """P (f32, wgmma's accumulator layout) as the PV product's 8-bit A
  operand: rounded to e4m3 (saturating), its registers relabelled."""
  return relabel(p.astype(E4M3))


def p_zeros(shape):
  """An A operand of zeros (the carry before a tile's first block)."""
  return plgpu.layout_cast(jnp.zeros(shape, E4M3), plgpu.Layout.WGMMA_8BIT)


def relabel(p8):
  """The e4m3 values of ``p8`` (accumulator layout: a thread holds keys 2q,
  2q + 1 and 8 + 2q, 9 + 2q of every 16 in two registers of two bytes) as
  one four-byte register per 16 keys in the 8-bit A layout, which reads
  them as keys 4q .. 4q + 3: no shuffle between threads, each thread's two
  halves packed into one register.  The keys come out
  in kernel.tiling.plan.fp8_key_order, the order V^T is stored in."""
  shape = p8.shape

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(shape, E4M3,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  @seam("fp8.regroup")
  def regroup(_ctx, x):
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    regs = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape(shape), dtype=object)
    for idx in np.ndindex(*regs.shape):
      pair = [x.registers[(idx[0], 2 * idx[1] + i, *idx[2:])] for i in range(2)]
      regs[idx] = mgpu_utils.vector_concat(pair)
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return regroup(p8)


def register_pairs(shape) -> dict[tuple, tuple[tuple, tuple]]:
  """{8-bit A register index: the two accumulator-layout register indices
  :func:`relabel` joins into it}, for a (64, n) tile: what the CPU tests
  hold against the layouts' own definitions."""
  from jax.experimental.mosaic import gpu as mgpu
  out = {}
  for idx in np.ndindex(*mgpu.WGMMA_LAYOUT_8BIT.registers_shape(shape)):
    out[idx] = tuple((idx[0], 2 * idx[1] + i, *idx[2:]) for i in range(2))
  return out


def tile_descales(descale_ref, b, h, group: int):
  """(q_descale * k_descale, v_descale) of (batch b, query head h), read from
  the (B|1, K|1, 2) float32 operand."""
  hk = lax.div(h, jnp.int32(group))
  at = batch_head(descale_ref, b, hk)
  return descale_ref[(*at, 0)], descale_ref[(*at, 1)]
