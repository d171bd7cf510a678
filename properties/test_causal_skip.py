"""The backward kernels apply the causal mask only on the steps whose tile
meets the diagonal (kernel.backward.meets_diagonal); every other step runs
without it.  That is right only if a step the predicate lets through has no
pair the mask would drop.  CPU: the predicate is index arithmetic the kernels
trace, checked here on Python ints and on traced int32 against every pair of
the tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from kernel import backward as bwd


def _pairs_the_mask_drops(key_base, num_keys, query_base, num_queries):
  keys = key_base + np.arange(num_keys)[:, None]
  queries = query_base + np.arange(num_queries)[None, :]
  return int(np.sum(keys > queries))


@given(key_base=st.integers(0, 4096), num_keys=st.sampled_from([1, 64, 128]),
       query_base=st.integers(0, 4096), num_queries=st.sampled_from([1, 64, 128]))
def test_a_step_off_the_diagonal_has_nothing_to_mask(key_base, num_keys, query_base,
                                                     num_queries):
  dropped = _pairs_the_mask_drops(key_base, num_keys, query_base, num_queries)
  meets = bwd.meets_diagonal(key_base, num_keys, query_base)
  traced = jax.jit(bwd.meets_diagonal, static_argnums=1)(
      jnp.int32(key_base), num_keys, jnp.int32(query_base))
  assert bool(traced) == meets
  # Sound: a step run without the mask drops nothing.  Tight: a step that
  # meets the diagonal has something to drop (else it pays for the mask for
  # nothing).
  assert meets == (dropped > 0)


def test_the_predicate_sees_the_corners():
  """The tile whose last key is the block's first query is below the
  diagonal; one key further is on it."""
  assert not bwd.meets_diagonal(0, 64, 63)
  assert bwd.meets_diagonal(0, 64, 62)
  assert bwd.meets_diagonal(64, 64, 0)
  assert not bwd.meets_diagonal(0, 128, 127)
