"""kernel/masks/register_selects.py without a GPU: the per-register offsets
tile the array with the WGMMA layout's thread bases, and the split
comparisons (one int per thread against one immediate per element) are key
<= query and key < limit exactly.

The GPU side (the asm selects inside a kernel) is covered by the causal and
ragged gradient properties of test_gradients_gpu.py against float64.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.experimental.mosaic.gpu import fragmented_array as fa

from kernel.masks import register_selects

SHAPES = [(64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]


def _thread_bases():
  """(row, col) of each warpgroup thread's first element in the WGMMA
  layout: warp w holds rows 16w..16w+15, lane l starts at row l // 4 of
  them and column 2 (l % 4)."""
  t = np.arange(128)
  warp, lane = t // 32, t % 32
  return np.stack([16 * warp + lane // 4, 2 * (lane % 4)], axis=1)


def _positions(shape):
  """Every (thread, element) position as absolute (row, col)."""
  offsets = register_selects.element_offsets(shape, fa.WGMMA_LAYOUT).reshape(-1, 2)
  return _thread_bases()[:, None, :] + offsets[None, :, :]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_offsets_cover_the_tile_exactly_once(shape):
  pos = _positions(shape).reshape(-1, 2)
  assert pos.shape[0] == shape[0] * shape[1]
  counts = np.zeros(shape, np.int64)
  np.add.at(counts, (pos[:, 0], pos[:, 1]), 1)
  assert (counts == 1).all(), f"{(counts != 1).sum()} positions not covered once"


def _kept_by_split(shape, key_dim, delta, *, causal):
  """What the select keeps, element by element (threads x elements): the
  per-thread z of kernel.masks.register_selects._split_select against its
  per-element bound."""
  offsets = register_selects.element_offsets(shape, fa.WGMMA_LAYOUT).reshape(-1, 2)
  bases = _thread_bases()
  key_t, query_t = bases[:, key_dim], bases[:, 1 - key_dim]
  if causal:
    z, bounds = key_t - query_t - delta, register_selects.causal_bounds(offsets, key_dim)
  else:
    z, bounds = key_t - delta, register_selects.limit_bounds(offsets, key_dim)
  return z[:, None] <= bounds[None, :]


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("key_dim", [0, 1])
@given(key_base=st.integers(-300, 300), query_base=st.integers(-300, 300))
def test_split_comparison_is_key_le_query(shape, key_dim, key_base, query_base):
  kept = _kept_by_split(shape, key_dim, query_base - key_base, causal=True)
  pos = _positions(shape)
  key_pos, query_pos = pos[..., key_dim], pos[..., 1 - key_dim]
  assert (kept == (key_base + key_pos <= query_base + query_pos)).all()


@pytest.mark.parametrize("shape", [(64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("key_dim", [0, 1])
@given(key_base=st.integers(-300, 300), limit=st.integers(-300, 300))
def test_split_limit_is_key_below_limit(shape, key_dim, key_base, limit):
  kept = _kept_by_split(shape, key_dim, limit - 1 - key_base, causal=False)
  key_pos = _positions(shape)[..., key_dim]
  assert (kept == (key_base + key_pos < limit)).all()


@pytest.mark.parametrize("select", [register_selects.causal_select,
                                    register_selects.key_limit_select],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs, name", [
    (dict(fill=1.0, key_dim=1), "fill"),
    (dict(fill=0.0, key_dim=2), "key_dim"),
])
def test_bad_arguments_are_named(select, kwargs, name):
  x = jnp.zeros((64, 128), jnp.float32)
  other = dict(query_base=0) if select is register_selects.causal_select else dict(limit=7)
  with pytest.raises(ValueError, match=name):
    select(x, key_base=0, **other, **kwargs)


def test_a_tile_that_is_not_float32_is_refused():
  x = jnp.zeros((64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="x must be a 2-d float32"):
    register_selects.causal_select(x, key_base=0, query_base=0, key_dim=1, fill=0.0)
