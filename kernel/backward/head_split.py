"""The head split (head dims over 128), in both backward kernels: one block
owns ONE tile of 64 rows, both compute warpgroups work on it, each with half
of the head dim of its accumulators, and they exchange the halves of P^T and
dS^T (dS in the dQ kernel) through shared memory at a named barrier every
step."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernel.backward.context import CW
from kernel.sync.seams import seam
from kernel.tiling.backward_plan import EXCHANGE_BUFFERS


@seam("head_split.exchange_buffer")
def exchange_buffer(t):
  return t % EXCHANGE_BUFFERS


def _shared_slot(c):
  """Slot 0 of the head split's stationary tiles (both kernels), which both
  compute warpgroups read, as a traced index (wg // 2 = 0 for both): the
  products' run_state cannot lower a ref indexed by a Python constant."""
  return lax.div(c.wg, jnp.int32(CW))
