"""The backward kernels apply the causal mask only on the steps whose tile
meets the diagonal (kernel.masks.selects.meets_diagonal); every other step
runs without it.  That is right only if a step the predicate lets through has no
pair the mask would drop.  CPU: the predicate is index arithmetic the kernels
trace, checked here on Python ints and on traced int32 against every pair of
the tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernel.masks import selects
from kernel.sync.seams import seam


def _pairs_the_mask_drops(key_base, num_keys, query_base, num_queries):
  keys = key_base + np.arange(num_keys)[:, None]
  queries = query_base + np.arange(num_queries)[None, :]
  return int(np.sum(keys > queries))


@given(key_base=st.integers(0, 4096), num_keys=st.sampled_from([1, 64, 128]),
       query_base=st.integers(0, 4096), num_queries=st.sampled_from([1, 64, 128]))
def test_a_step_off_the_diagonal_has_nothing_to_mask(key_base, num_keys, query_base,
                                                     num_queries):
  dropped = _pairs_the_mask_drops(key_base, num_keys, query_base, num_queries)
  meets = selects.meets_diagonal(key_base, num_keys, query_base)
  traced = jax.jit(selects.meets_diagonal, static_argnums=1)(
      jnp.int32(key_base), num_keys, jnp.int32(query_base))
  assert bool(traced) == meets
  # Sound: a step run without the mask drops nothing.  Tight: a step that
  # meets the diagonal has something to drop (else it pays for the mask for
  # nothing).
  assert meets == (dropped > 0)


# A seam: the mutants' runner edits this test into one that hangs
# (properties/tools/test_mutants_catalog.py).
@seam("tests.predicate_corners")
def test_the_predicate_sees_the_corners():
  """The tile whose last key is the block's first query is below the
  diagonal; one key further is on it."""
  assert not selects.meets_diagonal(0, 64, 63)
  assert selects.meets_diagonal(0, 64, 62)
  assert selects.meets_diagonal(64, 64, 0)
  assert not selects.meets_diagonal(0, 128, 127)


BLOCK_Q, KEY_TILE = 64, 128   # the dK/dV kernel's streamed query block and key tile


def _drawn_ranges(data, layout, group, per_head, *, reach=0, long_documents=False):
  """(nq, tiles, t, s, heads, k_start, k_end): per-row key ranges (1, heads,
  t or 1) of a drawn ``layout`` over t = nq whole query blocks and s keys
  (no multiple of the key tile, often).  ``reach``: how far past s ends and
  windows may go; ``long_documents``: document cuts four times as far apart
  (documents that hold whole key tiles)."""
  nq = data.draw(st.integers(1, 6), label="query blocks")
  tiles = data.draw(st.integers(1, 4), label="key tiles")
  t, s = nq * BLOCK_Q, tiles * KEY_TILE - data.draw(st.integers(0, KEY_TILE - 1), label="cut")
  heads = 2 * group if per_head else 1
  rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16), label="seed"))
  i = np.arange(t)
  if layout == "random":
    ks = rng.integers(-5, s + 5, (1, heads, t))
    ke = ks + rng.integers(-3, s + reach, (1, heads, t))
  elif layout == "one range":   # one range for every row: a query axis of 1
    ks = rng.integers(-5, s + 5, (1, heads, 1))
    ke = ks + rng.integers(-3, s + reach, (1, heads, 1))
  elif layout == "window":
    left = int(rng.integers(0, s + reach))
    right = int(rng.integers(0, 2))
    ks = np.broadcast_to(i - left, (1, heads, t))
    ke = np.broadcast_to(i + right + 1, (1, heads, t))
  else:
    cuts = np.sort(rng.choice(np.arange(1, t), size=min(2 if long_documents else 3, t - 1),
                              replace=False))
    if long_documents:
      cuts = cuts[cuts * 4 < t] * 4
    doc = np.searchsorted(cuts, i, side="right")
    starts = np.concatenate([[0], cuts])[doc]
    ends = np.concatenate([cuts, [t]])[doc]
    ks, ke = (np.broadcast_to(np.minimum(x, s), (1, heads, t)) for x in (starts, ends))
  return nq, tiles, t, s, heads, ks, ke


@given(data=st.data(), layout=st.sampled_from(["random", "window", "documents", "one range"]),
       group=st.sampled_from([1, 2]), per_head=st.booleans())
def test_a_key_tiles_query_band_holds_every_row_that_sees_it(data, layout, group, per_head):
  """kernel.padding.query_block_ranges: every (row, key) pair a row's range
  [k_start, k_end) admits lies in a query block inside its key tile's band
  (the dK/dV kernel streams only that band), over the kv head's group of
  query heads; a tile no row sees has the empty band (0, 0); for a window
  or packed documents the band is exactly the blocks that see the tile."""
  from kernel import padding
  nq, tiles, t, s, heads, ks, ke = _drawn_ranges(data, layout, group, per_head)
  lo, hi = (np.asarray(x) for x in padding.query_block_ranges(
      jnp.asarray(ks, jnp.int32), jnp.asarray(ke, jnp.int32), seq_kv=s, num_rows=t,
      block_q=BLOCK_Q, key_tile=KEY_TILE, num_key_tiles=tiles, group=group))
  kv_heads = heads // group if per_head else 1
  assert lo.shape == (1, kv_heads, tiles) and hi.shape == lo.shape
  seen = np.zeros((kv_heads, tiles, nq), bool)
  for h in range(heads):
    for r in range(t):
      row = r if ks.shape[2] > 1 else 0
      keys = np.arange(max(ks[0, h, row], 0), min(ke[0, h, row], s))
      for tile in np.unique(keys // KEY_TILE):
        seen[h // group if per_head else 0, tile, r // BLOCK_Q] = True
  for hk in range(kv_heads):
    for tile in range(tiles):
      blocks = np.flatnonzero(seen[hk, tile])
      if blocks.size == 0:
        assert (lo[0, hk, tile], hi[0, hk, tile]) == (0, 0)
      else:
        assert lo[0, hk, tile] <= blocks.min() and blocks.max() < hi[0, hk, tile]
        if layout != "random":  # a block's rows then see one interval: the band is tight
          assert (lo[0, hk, tile], hi[0, hk, tile]) == (blocks.min(), blocks.max() + 1)


@given(data=st.data(), layout=st.sampled_from(["random", "window", "documents", "one range"]),
       group=st.sampled_from([1, 2]), per_head=st.booleans())
def test_a_step_judged_inside_every_range_drops_nothing(data, layout, group, per_head):
  """kernel.padding.query_block_inner_bounds: the dK/dV kernel's steps over
  a key tile's inner run of query blocks skip the range and padded-key
  terms, so every (row, key) pair of such a step, for every query head of
  the group, must be admitted by its row's range and be a real key.  For a
  window or packed documents the run is every block that is inside (the
  saving is not left on the table)."""
  nq, tiles, t, s, heads, ks, ke = _drawn_ranges(data, layout, group, per_head, reach=200,
                                                 long_documents=True)
  _check_inner_run(ks, ke, nq=nq, tiles=tiles, s=s, heads=heads, group=group,
                   per_head=per_head, tight=layout != "random")


# A window whose edges fall one key before, on and after a tile's bounds, so
# that an off-by-one in the table is met (random draws rarely land there).
EDGE_WINDOWS = [(left, 10 ** 4) for left in (62, 63, 64, 126, 127, 128, 190, 191, 192)] + [
    (10 ** 4, right) for right in (126, 127, 128, 190, 191, 192, 254, 255, 256)]


@pytest.mark.parametrize("left,right", EDGE_WINDOWS)
def test_the_inner_run_at_a_windows_edges(left, right):
  """query_block_inner_bounds for windows whose edges meet the block and tile
  grid: sound and all of the inside blocks, as in the property above."""
  t, s = 6 * BLOCK_Q, 3 * KEY_TILE
  i = np.arange(t)
  ks, ke = np.broadcast_to(i - left, (1, 1, t)), np.broadcast_to(i + right + 1, (1, 1, t))
  _check_inner_run(ks, ke, nq=6, tiles=3, s=s, heads=1, group=1, per_head=False, tight=True)


def _check_inner_run(ks, ke, *, nq, tiles, s, heads, group, per_head, tight):
  """Every block of each key tile's inner run has every pair admitted (for
  every head of the group) and no padded key; with ``tight``, the run is
  every such block."""
  from kernel import padding
  t = nq * BLOCK_Q
  i = np.arange(t)
  inner = np.asarray(padding.query_block_inner_bounds(
      jnp.asarray(ks, jnp.int32), jnp.asarray(ke, jnp.int32), seq_kv=s, num_rows=t,
      block_q=BLOCK_Q, key_tile=KEY_TILE, num_key_tiles=tiles, group=group))
  kv_heads = heads // group if per_head else 1
  assert inner.shape == (1, kv_heads, 2, tiles)
  # inside[hk, tile, block]: every pair of the step is admitted, for every head.
  inside = np.ones((kv_heads, tiles, nq), bool)
  for h in range(heads):
    row = i if ks.shape[2] > 1 else np.zeros_like(i)
    start, end = ks[0, h, row], ke[0, h, row]
    for tile in range(tiles):
      keys = tile * KEY_TILE + np.arange(KEY_TILE)
      ok = (keys[None] >= start[:, None]) & (keys[None] < end[:, None]) & (keys[None] < s)
      per_block = ok.reshape(nq, BLOCK_Q * KEY_TILE).all(axis=1)
      inside[h // group if per_head else 0, tile] &= per_block
  for hk in range(kv_heads):
    for tile in range(tiles):
      lo, hi = inner[0, hk, :, tile]
      assert 0 <= lo <= hi <= nq
      assert inside[hk, tile, lo:hi].all(), (hk, tile, lo, hi)   # sound
      if tight:   # one run of inside blocks: all of it
        assert hi - lo == inside[hk, tile].sum(), (hk, tile, lo, hi, inside[hk, tile])
