"""The split tail (``Config(schedule="split-tail")``, kernel/tiling/schedule.py), on
the CPU: its deal exactly, its merge against float64, its refusals.

The deal is a finite table computed from static shapes, checked whole:
every key block of every tile runs exactly once, on one block, and the
tail's runs are balanced to a block.  The merge
(``kernel.forward.order.merge_pieces``) is checked on pieces computed in float64
the way the kernel computes them (each over its key blocks only, its
output normalised by its own l, or left relative to exp(m) when not
normalised): merged, they give the whole rows' output, m and l.  The
kernel itself runs the pieces on a GPU only: properties/gpu/test_forward_gpu.py
draws split-tail configs among the emitted ones.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import strategies as hs
from kernel.tiling import plan, schedule
from kernel.tiling.config import Config
from kernel.forward.order import merge_pieces

deals = st.fixed_dictionaries({
    "batch": st.integers(1, 3), "num_heads": st.integers(1, 6),
    "num_tiles": st.integers(1, 40), "num_blocks": st.integers(1, 20),
    "num_sms": st.integers(1, 70)})


def _units(split: schedule.SplitTail) -> collections.Counter:
  """(tile, key block) -> how many entries run it."""
  seen = collections.Counter()
  for j in range(len(split.counts)):
    for e in range(split.counts[j]):
      for g in range(split.lo[j, e], split.hi[j, e]):
        seen[(int(split.tiles[j, e]), g)] += 1
  return seen


def _check_deal(split: schedule.SplitTail) -> None:
  """Every key block of every tile runs exactly once; an entry is its
  tile whole (slot -1) or a piece with a slot of its own, listed for the
  merge under its tile and nowhere else."""
  seen = _units(split)
  want = {(t, g) for t in range(split.total) for g in range(split.num_blocks)}
  assert set(seen) == want, "a key block of a tile is dealt to no block, or a block is invented"
  assert all(n == 1 for n in seen.values()), [u for u, n in seen.items() if n > 1][:5]
  slots_of = collections.defaultdict(list)
  for j in range(len(split.counts)):
    assert (split.tiles[j, split.counts[j]:] == -1).all()
    for e in range(split.counts[j]):
      lo, hi, slot = split.lo[j, e], split.hi[j, e], split.slot[j, e]
      assert 0 <= lo < hi <= split.num_blocks
      if slot < 0:
        assert (lo, hi) == (0, split.num_blocks), "a whole tile's entry covers part of it"
      else:
        slots_of[int(split.tiles[j, e])].append(int(slot))
  assert sorted(s for v in slots_of.values() for s in v) == list(range(split.num_slots))
  listed = {int(t): sorted(int(s) for s in row if s >= 0)
            for t, row in zip(split.split, split.piece_slots)}
  assert listed == {t: sorted(v) for t, v in slots_of.items()}
  assert all(len(v) >= 2 for v in listed.values()), "a tile with one piece is not split"


@settings(max_examples=300, deadline=None)
@given(deal=deals)
def test_every_key_block_of_every_tile_runs_exactly_once(deal):
  note(deal)
  _check_deal(schedule.split_tail(**deal))


@settings(max_examples=300, deadline=None)
@given(deal=deals)
def test_the_tail_is_cut_to_a_block_and_whole_waves_stay_whole(deal):
  """Every block runs the same whole tiles' count, then a run of the tail
  whose length differs from every other run's by at most one key block;
  with at least two waves no tile has more than two pieces."""
  split = schedule.split_tail(**deal)
  sms, total, nb = deal["num_sms"], split.total, deal["num_blocks"]
  waves, rest = divmod(total, sms)
  kept = waves if rest == 0 else max(0, waves - 1)
  for j in range(sms):   # round-robin: block j's w-th whole tile is j + w * sms
    assert split.tiles[j, :kept].tolist() == [j + w * sms for w in range(kept)]
    assert (split.slot[j, :kept] == -1).all() and (split.hi[j, :kept] == nb).all()
  loads = [int((split.hi[j] - split.lo[j])[:split.counts[j]].sum()) for j in range(sms)]
  assert max(loads) - min(loads) <= 1, loads
  assert max(loads) <= -(-total // sms) * nb   # never worse than round-robin's last wave
  if total >= 2 * sms:
    assert split.piece_slots.shape[1] <= 2


def test_a_deal_that_drops_or_repeats_a_key_block_is_refuted():
  split = schedule.split_tail(batch=1, num_heads=3, num_tiles=7, num_blocks=5, num_sms=4)
  _check_deal(split)
  j = int(np.argmax(split.slot.max(axis=1)))      # a block that runs a piece
  e = int(np.argmax(split.slot[j]))
  for lo, hi in ((split.lo[j, e] + 1, split.hi[j, e]), (split.lo[j, e], split.hi[j, e] + 1)):
    hi_t, lo_t = split.hi.copy(), split.lo.copy()
    lo_t[j, e], hi_t[j, e] = lo, min(hi, split.num_blocks)
    if (lo_t[j, e], hi_t[j, e]) == (split.lo[j, e], split.hi[j, e]):
      hi_t[j, e] -= 1    # the piece ends the tile: drop its last block instead
    bad = schedule.SplitTail(**{**split.__dict__, "lo": lo_t, "hi": hi_t})
    with pytest.raises(AssertionError):
      _check_deal(bad)


def test_the_h200_grid_points_split_their_last_waves_only():
  """16k tokens per batch on 132 SMs: d128 (16 heads, 128-row tiles) has
  2048 tiles, 15.5 waves; 14 waves stay whole and the last 1.5 waves' key
  blocks are cut evenly, so the busiest block runs 1986 key blocks against
  16 x 128 = 2048 round-robin."""
  split = schedule.split_tail(batch=1, num_heads=16, num_tiles=128, num_blocks=128,
                              num_sms=132)
  loads = (split.hi - split.lo).sum(axis=1)
  assert loads.max() == 1986 and loads.min() == 1985
  assert len(split.split) == 128 and split.num_slots == 256


# -- the merge, against float64 ----------------------------------------------------

def _attend(q, k, v, keep, normalized):
  """float64 rows of q over the kept keys: (out, m, l) in natural log; a
  row that keeps no key gives out 0, m -inf, l 0."""
  s = np.where(keep, q @ k.T, -np.inf)
  m = s.max(axis=1)
  safe = np.where(np.isinf(m), 0.0, m)
  p = np.exp(s - safe[:, None])
  l = p.sum(axis=1)
  o = p @ v
  if normalized:
    o = o / np.where(l > 0, l, 1.0)[:, None]
  return o, m, l


@settings(max_examples=hs.examples(25), deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), seq_q=st.integers(1, 300),
       seq_kv=st.integers(1, 400), sms=st.integers(1, 40), normalized=st.booleans(),
       ranges=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_merged_pieces_give_the_whole_rows(batch, heads, seq_q, seq_kv, sms, normalized, ranges,
                                           seed):
  """Pieces computed over their key blocks alone (with per-row key ranges,
  so that some pieces see no key of a row and some rows none at all),
  merged by ``merge_pieces``, equal the rows computed whole, in out, m, l."""
  tile_q, block_kv, d = 32, 16, 8
  rng = np.random.default_rng(seed)
  num_tiles, num_blocks = -(-seq_q // tile_q), -(-seq_kv // block_kv)
  t_pad = num_tiles * tile_q
  q = rng.standard_normal((batch, t_pad, heads, d))
  k = rng.standard_normal((batch, seq_kv, heads, d))
  v = rng.standard_normal((batch, seq_kv, heads, d))
  keys = np.arange(seq_kv)
  if ranges:
    start = rng.integers(0, seq_kv + 1, (batch, heads, t_pad))
    end = start + rng.integers(-4, seq_kv + 1, (batch, heads, t_pad))
  else:
    start, end = np.zeros((batch, heads, t_pad), int), np.full((batch, heads, t_pad), seq_kv)
  split = schedule.split_tail(batch=batch, num_heads=heads, num_tiles=num_tiles,
                              num_blocks=num_blocks, num_sms=sms)
  out = np.full((batch, seq_q, heads, d), np.nan, np.float32)
  m_out = np.full((batch, heads, t_pad), np.nan, np.float32)
  l_out = np.full((batch, heads, t_pad), np.nan, np.float32)
  slots = max(1, split.num_slots)
  p_out = np.full((slots, tile_q, d), np.nan, np.float32)
  p_m = np.full((slots, tile_q), np.nan, np.float32)
  p_l = np.full((slots, tile_q), np.nan, np.float32)
  want_o = np.zeros((batch, t_pad, heads, d))
  want_m = np.zeros((batch, heads, t_pad))
  want_l = np.zeros((batch, heads, t_pad))
  for tile in range(split.total):
    b, h, qi = split.unpack(tile)
    rows = slice(qi * tile_q, (qi + 1) * tile_q)
    in_range = (keys >= start[b, h, rows, None]) & (keys < end[b, h, rows, None])
    o, m, l = _attend(q[b, rows, h], k[b, :, h], v[b, :, h], in_range, normalized)
    want_o[b, rows, h], want_m[b, h, rows], want_l[b, h, rows] = o, m, l
  for j in range(len(split.counts)):
    for e in range(split.counts[j]):
      b, h, qi = split.unpack(int(split.tiles[j, e]))
      rows = slice(qi * tile_q, (qi + 1) * tile_q)
      lo, hi = split.lo[j, e] * block_kv, split.hi[j, e] * block_kv
      keep = ((keys >= start[b, h, rows, None]) & (keys < end[b, h, rows, None])
              & (keys >= lo) & (keys < hi))
      o, m, l = _attend(q[b, rows, h], k[b, :, h], v[b, :, h], keep, normalized)
      slot = split.slot[j, e]
      if slot < 0:
        n = min(tile_q, seq_q - qi * tile_q)
        out[b, rows, h][:n] = o[:n]
        m_out[b, h, rows], l_out[b, h, rows] = m, l
      else:
        p_out[slot], p_m[slot], p_l[slot] = o, m, l
  got_o, got_m, got_l = merge_pieces(
      jnp.asarray(out), jnp.asarray(m_out), jnp.asarray(l_out),
      (jnp.asarray(p_out), jnp.asarray(p_m), jnp.asarray(p_l)), split, tile_q=tile_q,
      normalized=normalized)
  got_o, got_m, got_l = (np.asarray(x, np.float64) for x in (got_o, got_m, got_l))
  assert not np.isnan(got_o).any() and not np.isnan(got_l).any()
  np.testing.assert_array_equal(np.isneginf(got_m), np.isneginf(want_m))
  finite = np.isfinite(want_m)
  np.testing.assert_allclose(got_m[finite], want_m[finite], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_l, want_l, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got_o, want_o[:, :seq_q], rtol=2e-5, atol=2e-5)


def test_a_nan_in_one_piece_makes_its_rows_nan_and_no_other():
  """Rows the variants poison (kernel/key_ranges.py: NaN in out, m and l) stay
  NaN through the merge, and an unused entry of the slot table (which reads
  slot 0) carries none of slot 0's NaN into another tile."""
  split = schedule.split_tail(batch=1, num_heads=1, num_tiles=3, num_blocks=4, num_sms=2)
  tile_q, d = 8, 4
  slots = split.num_slots
  p_out = np.ones((slots, tile_q, d), np.float32)
  p_m = np.zeros((slots, tile_q), np.float32)
  p_l = np.ones((slots, tile_q), np.float32)
  p_out[0, 2], p_m[0, 2], p_l[0, 2] = np.nan, np.nan, np.nan
  out = np.ones((1, 3 * tile_q, 1, d), np.float32)
  ml = np.ones((1, 1, 3 * tile_q), np.float32)
  o, m, l = merge_pieces(jnp.asarray(out), jnp.asarray(ml), jnp.asarray(ml),
                         tuple(map(jnp.asarray, (p_out, p_m, p_l))), split, tile_q=tile_q,
                         normalized=True)
  o, m = np.asarray(o), np.asarray(m)
  tile0 = int(split.split[np.argmax((split.piece_slots == 0).any(axis=1))])
  row = tile0 * tile_q + 2
  assert np.isnan(o[0, row]).all() and np.isnan(m[0, 0, row])
  assert np.isnan(o).sum() == d and np.isnan(m).sum() == 1


# -- refusals -------------------------------------------------------------------------

def test_the_split_tail_is_refused_by_name_where_it_cannot_run():
  import ml_dtypes
  problem = plan.problem_for(np.dtype(ml_dtypes.bfloat16), 128, 128, 4096, 4096)
  with pytest.raises(ValueError, match=r"config\.schedule: split-tail deals tiles to persistent"):
    plan.check_fits(problem, Config(64, 128, 2, False, "split-tail"))
  causal = plan.problem_for(np.dtype(ml_dtypes.bfloat16), 128, 128, 4096, 4096, is_causal=True)
  with pytest.raises(ValueError, match=r"config\.schedule: .*causal.*longest-first"):
    plan.check_fits(causal, Config(64, 128, 2, True, "split-tail"))
  assert plan.config_fits(problem, Config(64, 128, 2, True, "split-tail"))


def test_the_split_tail_always_allocates_the_residuals_it_merges_by():
  """The kernel returns (m, l) under the split tail whether or not the
  caller asked (kernel.tiling.plan.kernel_problem), and the estimate counts them."""
  import ml_dtypes
  problem = plan.problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, 4096, 4096)
  split = Config(64, 128, 2, True, "split-tail")
  rr = Config(64, 128, 2, True)
  assert plan.scratch_layout(problem, split).m is not None
  assert plan.scratch_layout(problem, rr).m is None
  assert plan.estimate_smem_bytes(problem, split) > plan.estimate_smem_bytes(problem, rr)
  with_res = plan.problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, 4096, 4096,
                              return_residuals=True)
  assert plan.estimate_smem_bytes(problem, split) == plan.estimate_smem_bytes(with_res, rr)


def test_the_split_tail_refuses_guarded_outputs_by_name():
  """The guarded launch writes into the caller's arrays; the split tail
  merges after the kernel into fresh ones, so it is refused by name."""
  import jax
  from kernel import forward
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  problem = plan.problem_for(np.dtype(jnp.bfloat16), 64, 64, 256, 256, scale=0.125)
  out = jax.new_ref(jnp.zeros((1, 384, 2, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="^outputs: the split-tail schedule"):
    forward.flash_attention_forward(problem, Config(64, 128, 2, True, "split-tail"),
                                    q, q, q, None, None, None, None, None, outputs=(out,))
