"""kernel.masks.Mask against the definition of which keys a row sees, by
brute force over every (row, key) pair at ragged lengths, with a window and
chunked attention (FlashAttention-3's ``attention_chunk``): its element
select is the definition, and its row ranges and block bounds are exactly
the blocks that hold a kept pair (CPU, NumPy)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import strategies as hs
from harness.numerics.reference import attention_reference
from kernel.masks import Mask


def _keep(mask: Mask, rows, keys) -> np.ndarray:
  """mask.keep over every pair of ``rows`` and ``keys``."""
  return np.broadcast_to(mask.keep(rows[:, None], keys[None, :]), (rows.size, keys.size))


def _definition(mask: Mask) -> np.ndarray:
  """(seq_q, seq_kv) bool: row i sees key j, as jax.nn defines causal and
  the window, and FlashAttention-3 chunked attention."""
  i, j = np.mgrid[:mask.seq_q, :mask.seq_kv]
  keep = ~(mask.causal & (j > i))
  if mask.window is not None:
    left, right = mask.window
    keep &= (i - left <= j) & (j <= i + right)
  if mask.chunk is not None:
    keep &= j // mask.chunk == i // mask.chunk
  return keep


@st.composite
def masks(draw) -> Mask:
  """A mask at ragged lengths: causal or not, with or without a window,
  with or without a chunk (chunked attention: causal with a chunk)."""
  seq_q, seq_kv = draw(st.integers(1, 300), label="seq_q"), draw(st.integers(1, 300),
                                                                   label="seq_kv")
  window = draw(st.none() | st.tuples(st.integers(0, 150), st.integers(0, 150)),
                label="window")
  chunk = draw(st.none() | st.integers(1, 200), label="chunk")
  return Mask(seq_q, seq_kv, causal=draw(st.booleans(), label="causal"), window=window,
              chunk=chunk)


def _blocks_seen(keep: np.ndarray, block: int, axis: int) -> np.ndarray:
  """Per block of ``block`` keys (axis 1) or rows (axis 0), whether it
  holds a kept pair, for each row (axis 1) or key (axis 0)."""
  n = keep.shape[axis]
  pad = [(0, 0), (0, 0)]
  pad[axis] = (0, -(-n // block) * block - n)
  padded = np.pad(keep, pad)
  if axis == 1:
    return padded.reshape(keep.shape[0], -1, block).any(axis=2)
  return padded.reshape(-1, block, keep.shape[1]).any(axis=1)


def _span(seen: np.ndarray) -> tuple[int, int]:
  """[first, last + 1) of the True entries, (0, 0) where none."""
  hit = np.flatnonzero(seen)
  return (int(hit[0]), int(hit[-1]) + 1) if hit.size else (0, 0)


@settings(max_examples=hs.examples(80), deadline=None)
@given(mask=masks(), tile_q=st.sampled_from([64, 128]), block_kv=st.sampled_from([64, 128]))
def test_the_bounds_are_the_blocks_that_hold_a_kept_pair(mask, tile_q, block_kv):
  """keep is the definition; each real tile's static weight
  (tile_blocks) is the span of key blocks its rows keep a pair in, and its
  key_blocks without key ranges the span causal alone leaves; the window's
  and the chunk's row ranges hold exactly their rows' keys."""
  note(mask)
  rows, keys = np.arange(mask.seq_q), np.arange(mask.seq_kv)
  keep = _keep(mask, rows, keys)
  assert (keep == _definition(mask)).all()
  per_row = _blocks_seen(keep, block_kv, axis=1)
  causal_only = _blocks_seen(_keep(Mask(mask.seq_q, mask.seq_kv, causal=mask.causal), rows,
                                   keys), block_kv, axis=1)
  for qi in range(-(-mask.seq_q // tile_q)):
    tile = slice(qi * tile_q, (qi + 1) * tile_q)
    lo, hi = _span(per_row[tile].any(axis=0))
    got = mask.tile_blocks(qi, tile_q=tile_q, block_kv=block_kv)
    # A tile whose rows' ranges all start past the last key, inside the
    # last (ragged) block, still visits that block, all of it masked.
    assert got == hi - lo or (hi == lo and got == 1 and mask.seq_kv % block_kv), qi
    assert mask.key_blocks(qi, tile_q=tile_q, block_kv=block_kv) == _span(
        causal_only[tile].any(axis=0)), qi
  for kind, ranges in (("window", mask.window_range), ("chunk", mask.chunk_range)):
    if getattr(mask, kind) is not None:
      start, end = ranges(rows.astype(np.int32))
      ranged = (start[:, None] <= keys[None, :]) & (keys[None, :] < end[:, None])
      alone = Mask(mask.seq_q, mask.seq_kv, **{kind: getattr(mask, kind)})
      assert (ranged == _keep(alone, rows, keys)).all(), kind


@settings(max_examples=hs.examples(50), deadline=None)
@given(mask=masks(), block_q=st.sampled_from([64, 128]), key_tile=st.sampled_from([64, 128]))
def test_a_key_tiles_query_blocks_are_those_that_see_it(mask, block_q, key_tile):
  """key_tile_blocks counts the query blocks (padded rows included) with a
  row that sees the key tile: without a window or a chunk the padded rows
  see as the diagonal lets them, and first_query_block is the first such
  block; with either, the padded rows see what the last real row sees
  (they copy its key range)."""
  note(mask)
  num_blocks = -(-mask.seq_q // block_q)
  rows, keys = np.arange(num_blocks * block_q), np.arange(mask.seq_kv)
  keep = _keep(mask, rows, keys).copy()
  ranged = mask.window is not None or mask.chunk is not None
  if ranged:
    keep[mask.seq_q:] = keep[mask.seq_q - 1]
  per_key = _blocks_seen(keep, block_q, axis=0)
  for tile in range(-(-mask.seq_kv // key_tile)):
    seen = per_key[:, tile * key_tile:(tile + 1) * key_tile].any(axis=1)
    assert mask.key_tile_blocks(tile, key_tile=key_tile, block_q=block_q,
                                num_blocks=num_blocks) == seen.sum(), tile
    if not ranged:
      first = _span(seen)[0] if seen.any() else num_blocks   # the kernel clips it there
      got = int(mask.first_query_block(jnp.int32(tile), key_tile=key_tile, block_q=block_q))
      assert min(got, num_blocks) == first, tile


def test_the_reference_reads_chunked_attention_from_the_mask():
  """The float64 reference under ``attention_chunk`` sees exactly the
  chunked keys (j // C == i // C, j <= i) and computes what a dense mask of
  them gives, at ragged lengths."""
  rng = np.random.default_rng(7)
  T, S, C = 77, 93, 16
  q, k, v = (rng.standard_normal(shape) for shape in ((1, T, 2, 8), (1, S, 1, 8), (1, S, 1, 8)))
  i, j = np.mgrid[:T, :S]
  dense = (j // C == i // C) & (j <= i)
  chunked = attention_reference(q, k, v, is_causal=True, attention_chunk=C)
  assert (chunked.visible == dense).all()
  masked = attention_reference(q, k, v, None, np.broadcast_to(dense, (1, 1, T, S)))
  np.testing.assert_array_equal(chunked.out, masked.out)


@pytest.mark.parametrize("chunk,causal", [(64, True), (100, True), (100, False), (1, True)])
def test_chunked_attention_through_the_kernels_key_ranges_meets_the_rule(chunk, causal):
  """The kernel's path for ``attention_chunk`` on the CPU: the key ranges
  kernel/key_ranges.py routes the chunk to, run by the NumPy model of the
  kernel's blocked online softmax (bfloat16, 128-key blocks), meet the
  float64 rule against the reference given the chunk itself, at ragged
  lengths with grouped kv heads."""
  from harness.numerics.online_softmax_model import online_softmax_attention
  from harness.numerics.reference import naive_attention
  from harness.numerics.tolerance import check_tolerance
  from kernel import key_ranges
  from kernel.call import Call
  rng = np.random.default_rng(chunk)
  T, S, N, K, H = 300, 277, 4, 2, 64
  bf16 = jnp.bfloat16
  q, k, v = (np.asarray(jnp.asarray(rng.standard_normal(shape), bf16))
             for shape in ((1, T, N, H), (1, S, K, H), (1, S, K, H)))
  routed = key_ranges.route(Call(q, k, v, is_causal=causal, attention_chunk=chunk))
  ks, ke = np.asarray(routed.k_start), np.asarray(routed.k_end)
  out, m, l = online_softmax_attention(q, k, v, is_causal=causal, k_start=ks, k_end=ke,
                                       block_kv=128, dtype=bf16)
  ref = attention_reference(q, k, v, is_causal=causal, attention_chunk=chunk)
  naive = naive_attention(q, k, v, is_causal=causal, attention_chunk=chunk, dtype=bf16)
  for name, got, want, yardstick in (("out", out, ref.out, naive[0]), ("m", m, ref.m, naive[1]),
                                     ("l", l, ref.l, naive[2])):
    report = check_tolerance(got, want, yardstick, np.dtype(bf16), name=name)
    assert report.passed, str(report)


@settings(max_examples=hs.examples(50), deadline=None)
@given(mask=masks(), data=st.data())
def test_the_plain_blocks_need_no_select(mask, data):
  """Every pair of a block plain_blocks leaves unmasked, for every row of
  a warpgroup's 64 from ``q_base`` inside the drawn key ranges, is kept:
  below the diagonal, no padded key, inside every row's range."""
  block_q, block_kv = 64, data.draw(st.sampled_from([64, 128]), label="block_kv")
  mask = Mask(mask.seq_q, mask.seq_kv, causal=mask.causal)
  q_base = data.draw(st.integers(0, mask.seq_q - 1), label="q_base")
  k_start_max = data.draw(st.none() | st.integers(-5, mask.seq_kv + 5), label="k_start_max")
  k_end_min = data.draw(st.none() | st.integers(-5, mask.seq_kv + 5), label="k_end_min")
  num_blocks = -(-mask.seq_kv // block_kv)
  lo, hi = mask.plain_blocks(
      jnp.int32(0), jnp.int32(num_blocks), q_base=jnp.int32(q_base), block_kv=block_kv,
      ragged=mask.seq_kv % block_kv != 0, edge=True,
      k_start_max=None if k_start_max is None else jnp.int32(k_start_max),
      k_end_min=None if k_end_min is None else jnp.int32(k_end_min))
  rows = np.arange(q_base, q_base + block_q)
  for block in range(int(lo), int(hi)):
    keys = np.arange(block * block_kv, (block + 1) * block_kv)
    kept = _keep(mask, rows, keys).copy()
    if k_start_max is not None:
      kept &= keys[None, :] >= k_start_max
    if k_end_min is not None:
      kept &= keys[None, :] < k_end_min
    assert kept.all(), block
