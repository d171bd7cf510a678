"""The longest-first tile schedule (kernel/tiling/schedule.py), exactly, on the CPU.

The kernel walks ``Schedule.order`` (non-persistent: one tile per grid
point) or the rows of ``Schedule.assign`` (persistent); both are finite
tables computed from static shapes, so these properties check them whole:
every tile of the logical grid is computed exactly once, by exactly one
block, heaviest first within an L2 section, and the dealt load is balanced.
"""

from __future__ import annotations

import collections
import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, note, settings, strategies as st

from harness.numerics import strategies as hs
from kernel.masks import Mask
from kernel.tiling import schedule
from kernel.tiling.plan import problem_for


@st.composite
def launches(draw):
  """A forward launch's static shape: batch, heads (GQA groups), query
  tiles, block sizes, causal, a key length that may be ragged, and an L2
  section size from one unit per section to all units in one."""
  num_kv_heads = draw(st.integers(1, 4), label="kv_heads")
  group = draw(st.sampled_from([1, 2, 4]), label="group")
  batch = draw(st.integers(1, 3), label="batch")
  block_q = draw(st.sampled_from([64, 128]), label="block_q")
  block_kv = draw(st.sampled_from([64, 128, 256]), label="block_kv")
  seq_q = draw(st.integers(1, 2600), label="seq_q")
  seq_kv = draw(st.integers(1, 2600), label="seq_kv")
  causal = draw(st.booleans(), label="causal")
  num_tiles = -(-seq_q // (2 * block_q))
  s_pad = -(-seq_kv // block_kv) * block_kv
  per_head = s_pad * 256 * 2
  section = draw(st.sampled_from([per_head, 3 * per_head, schedule.L2_SECTION_BYTES]),
                 label="section_bytes")
  blocks = lambda qi: np.subtract(*Mask(seq_q, seq_kv, causal=causal).key_blocks(
      qi, tile_q=2 * block_q, block_kv=block_kv)[::-1])
  # With the SMs given, the sections may be evened (longest_first).
  num_sms = draw(st.sampled_from([None, 3, 16, 132]), label="num_sms")
  order = schedule.longest_first(
      batch=batch, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
      num_tiles=num_tiles, tile_blocks=blocks, kv_bytes_per_head=per_head,
      section_bytes=section, num_sms=num_sms)
  return order, blocks, per_head, section, group


@settings(max_examples=150, deadline=None)
@given(launches(), st.integers(1, 140))
def test_every_tile_runs_exactly_once(launch, num_blocks):
  """Each (b, h, qi) of the logical grid appears exactly once in the order
  and exactly once among the blocks' dealt rows, and the rows hold nothing
  else."""
  order, _, _, _, _ = launch
  note(f"total={order.total} blocks={num_blocks}")
  _check_exactly_once(order, min(num_blocks, order.total))


def _check_exactly_once(order: schedule.Schedule, num_blocks: int) -> None:
  everything = collections.Counter(range(order.total))
  assert collections.Counter(order.order.tolist()) == everything, "order"
  tiles, counts = order.assign(num_blocks)
  dealt = [t for j in range(num_blocks) for t in tiles[j, :counts[j]].tolist()]
  assert collections.Counter(dealt) == everything, "dealt"
  assert (tiles[np.arange(tiles.shape[1])[None, :] >= counts[:, None]] == -1).all()
  assert counts.sum() == order.total


@settings(max_examples=50, deadline=None)
@given(launches())
def test_unpack_inverts_the_packing(launch):
  """``unpack`` gives every tile's (b, h, qi) back, in range, on Python
  ints and on traced int32 alike."""
  import jax
  import jax.numpy as jnp
  order, _, _, _, _ = launch
  triples = [order.unpack(t) for t in order.order.tolist()]
  assert len(set(triples)) == order.total
  for b, h, qi in triples:
    assert 0 <= b < order.batch and 0 <= h < order.num_heads and 0 <= qi < order.num_tiles
  traced = jax.jit(jax.vmap(lambda t: jnp.stack(order.unpack(t))))(jnp.asarray(order.order))
  assert np.array_equal(np.asarray(traced), np.array(triples))


@settings(max_examples=150, deadline=None)
@given(launches())
def test_heaviest_first_within_each_section_and_units_kept_together(launch):
  """Within an L2 section the key-block counts never increase along the
  order; a section holds at most the (batch, kv head) units whose K/V fit
  the section bytes; the query heads of one kv head stay in one section."""
  order, blocks, per_head, section, group = launch
  units_per_section = max(1, section // per_head)
  sizes = order.sections
  assert sum(sizes) == order.batch * order.num_heads // group
  assert max(sizes) <= units_per_section
  # the sections as many as the bytes force: all full but the last, or evened
  assert len(sizes) == -(-sum(sizes) // units_per_section)
  assert (set(sizes[:-1]) <= {units_per_section}) or max(sizes) - min(sizes) <= 1, sizes
  start = 0
  for size in sizes:
    per_section = size * group * order.num_tiles
    chunk = order.order[start:start + per_section].tolist()
    start += per_section
    weights = [int(blocks(order.unpack(t)[2])) for t in chunk]
    assert all(a >= b for a, b in zip(weights, weights[1:])), weights
    units = {(order.unpack(t)[0], order.unpack(t)[1] // group) for t in chunk}
    assert len(units) == size


def test_dealt_load_is_balanced_under_causal():
  """Greedy dealing of a heaviest-first order: no block's load exceeds the
  average by more than one tile's work (the list-scheduling bound), at the
  shapes of the benchmark grid."""
  for seq, heads, block_kv in ((16384, 16, 128), (8192, 32, 64), (2048, 128, 128)):
    blocks = lambda qi: qi + 1
    num_tiles = seq // 128
    order = schedule.longest_first(batch=16384 // seq, num_heads=heads, num_kv_heads=heads,
                                   num_tiles=num_tiles, tile_blocks=blocks,
                                   kv_bytes_per_head=seq * 512)
    tiles, counts = order.assign(132)
    cost = lambda t: blocks(order.unpack(t)[2]) + schedule.TILE_OVERHEAD_BLOCKS
    loads = [sum(cost(t) for t in tiles[j, :counts[j]].tolist()) for j in range(132)]
    assert max(loads) - np.mean(loads) <= max(cost(t) for t in order.order.tolist())


def test_a_last_section_of_few_heads_is_evened_where_the_deal_predicts_it_pays():
  """Causal d128, 16 heads, B1: at 12017 tokens sections of 5, 5, 5 and 1
  heads leave the lone head's heaviest tiles for the end (largest load 620
  key blocks on 132 SMs, mean 564): four sections of 4 deal to 566.  At
  7000 tokens (B2) sections of 9, 9, 9 and 5 heads deal within 1 % of
  the mean: they are kept."""
  def launch(seq, batch, num_sms):
    tiles = -(-seq // 128)
    s_pad = tiles * 128
    blocks = lambda qi: np.subtract(*Mask(seq, seq, causal=True).key_blocks(
        qi, tile_q=128, block_kv=128)[::-1])
    return schedule.longest_first(batch=batch, num_heads=16, num_kv_heads=16,
                                  num_tiles=tiles, tile_blocks=blocks,
                                  kv_bytes_per_head=s_pad * 512, num_sms=num_sms)
  filled, evened = launch(12017, 1, None), launch(12017, 1, 132)
  assert filled.sections == (5, 5, 5, 1) and evened.sections == (4, 4, 4, 4)
  assert (filled.makespan(132), evened.makespan(132)) == (620, 566)
  _check_exactly_once(evened, 132)
  assert launch(7000, 2, 132).sections == launch(7000, 2, None).sections == (9, 9, 9, 5)


@settings(max_examples=60, deadline=None)
@given(launches(), st.integers(1, 140))
def test_deferring_the_light_tiles_keeps_every_tile_and_runs_them_last(launch, num_blocks):
  """deferred_light: the same tiles, dealt exactly once; the heavy ones
  (over half the heaviest tile's key blocks) in their order, then the
  light ones heaviest first."""
  order = launch[0]
  deferred = schedule.deferred_light(order)
  _check_exactly_once(deferred, min(num_blocks, deferred.total))
  heavy = 2 * order.weight > order.weight.max()
  n = int(heavy.sum())
  assert deferred.order[:n].tolist() == order.order[heavy].tolist()
  assert (2 * deferred.weight[n:] <= order.weight.max()).all()
  assert (np.diff(deferred.weight[n:]) <= 0).all()
  assert dict(zip(deferred.order.tolist(), deferred.weight.tolist())) == dict(
      zip(order.order.tolist(), order.weight.tolist()))


def test_deferring_the_light_tiles_shortens_the_modelled_d256_tail():
  """The model's case for deferred_light (its docstring): d256 causal, 8
  heads, B1, 9522 tokens, 128-row tiles, 64-key blocks."""
  seq, tiles = 9522, -(-9522 // 128)
  blocks = lambda qi: np.subtract(*Mask(seq, seq, causal=True).key_blocks(
      qi, tile_q=128, block_kv=64)[::-1])
  order = schedule.longest_first(batch=1, num_heads=8, num_kv_heads=8, num_tiles=tiles,
                                 tile_blocks=blocks, kv_bytes_per_head=-(-seq // 64) * 64 * 1024,
                                 num_sms=132)
  mean = (order.weight.sum() + schedule.TILE_OVERHEAD_BLOCKS * order.total) / 132
  assert order.makespan(132) / mean == pytest.approx(1.157, abs=0.001)
  assert schedule.deferred_light(order).makespan(132) / mean == pytest.approx(1.027, abs=0.001)


def test_a_schedule_that_drops_or_repeats_a_tile_is_refuted():
  """The exactly-once check fails on a schedule that repeats one tile in
  place of another (the mutant a balanced dealer could make)."""
  import dataclasses
  order = schedule.longest_first(batch=2, num_heads=4, num_kv_heads=2, num_tiles=5,
                                 tile_blocks=lambda qi: qi + 1, kv_bytes_per_head=1)
  _check_exactly_once(order, 7)
  repeated = order.order.copy()
  repeated[3] = repeated[4]
  with pytest.raises(AssertionError, match="order"):
    _check_exactly_once(dataclasses.replace(order, order=repeated), 7)
  dropped = dataclasses.replace(order, order=order.order[:-1], weight=order.weight[:-1])
  with pytest.raises(AssertionError, match="order"):
    _check_exactly_once(dropped, 7)


@settings(max_examples=60, deadline=None)
@given(launches(), st.data())
def test_reranking_by_device_weights_keeps_every_tile_and_each_heads_positions(launch, data):
  """``Schedule.reranked``: whatever weights the device finds (any shape
  (B|1, N|1, tiles), ties included) the launch is a permutation of the
  tiles; each (batch, head) keeps the positions the static order gave it and
  fills them heaviest first (ties: lower qi first); and weights equal to the
  static ones give the static order back."""
  order, blocks, _, _, _ = launch
  static = np.array([int(blocks(qi)) for qi in range(order.num_tiles)], np.int32)
  assert np.array_equal(np.asarray(order.reranked(static[None, None, :])), order.order)
  shape = (data.draw(st.sampled_from([1, order.batch]), label="B"),
           data.draw(st.sampled_from([1, order.num_heads]), label="N"), order.num_tiles)
  weights = np.array(data.draw(st.lists(st.integers(0, 6), min_size=int(np.prod(shape)),
                                        max_size=int(np.prod(shape))), label="weights"),
                     np.int32).reshape(shape)
  got = np.asarray(order.reranked(weights))
  assert collections.Counter(got.tolist()) == collections.Counter(range(order.total))
  unit = lambda t: t // order.num_tiles
  assert np.array_equal(unit(got), unit(order.order))
  for u in np.unique(unit(got)).tolist():
    b, h = divmod(u, order.num_heads)
    w = weights[b % shape[0], h % shape[1]]
    qis = (got[unit(got) == u] % order.num_tiles).tolist()
    keys = [(-int(w[qi]), qi) for qi in qis]
    assert keys == sorted(keys), (u, qis)


def test_reranking_refuses_weights_of_another_shape():
  order = schedule.longest_first(batch=2, num_heads=4, num_kv_heads=2, num_tiles=5,
                                 tile_blocks=lambda qi: qi + 1, kv_bytes_per_head=1)
  with pytest.raises(ValueError, match="blocks"):
    order.reranked(np.zeros((2, 3, 5), np.int32))


@pytest.mark.parametrize("bad", [dict(batch=0), dict(num_kv_heads=3), dict(num_tiles=-1)])
def test_bad_launch_shapes_are_refused_by_name(bad):
  args = dict(batch=1, num_heads=4, num_kv_heads=2, num_tiles=2, tile_blocks=lambda qi: 1,
              kv_bytes_per_head=1)
  args.update(bad)
  with pytest.raises(ValueError, match="batch|num_heads|num_tiles"):
    schedule.longest_first(**args)


# The backward's launch order (schedule.LaunchOrder): a bijection from a
# plain grid's launch indices onto (unit, rank), in sections.

@st.composite
def launch_orders(draw):
  units = draw(st.integers(1, 160), label="units")
  tiles = draw(st.integers(1, 160), label="tiles")
  unit_bytes = draw(st.sampled_from([1, 1 << 20, 8 << 20, 64 << 20]), label="unit_bytes")
  num_sms = draw(st.sampled_from([1, 114, 132]), label="num_sms")
  return schedule.LaunchOrder.for_grid(units, tiles, unit_bytes=unit_bytes, num_sms=num_sms)


def _check_launch_order(order: schedule.LaunchOrder) -> None:
  """Every (unit, rank) exactly once; a section's units contiguous, its
  blocks rank by rank (each rank over all the section's units before the
  next), sections in unit order."""
  flat = np.arange(order.units * order.tiles)
  unit, rank = order.locate(flat)
  pairs = collections.Counter(zip(unit.tolist(), rank.tolist()))
  assert pairs == collections.Counter(
      (u, r) for u in range(order.units) for r in range(order.tiles)), "exactly once"
  start = 0
  for size in order.sizes:
    stop = start + size * order.tiles
    u, r = unit[start:stop], rank[start:stop]
    first = int(u.min())
    assert set(u.tolist()) == set(range(first, first + size)), "section units"
    assert np.array_equal(r, np.repeat(np.arange(order.tiles), size)), "heaviest first"
    assert np.array_equal(u, np.tile(np.arange(first, first + size), order.tiles)), "unit order"
    start = stop


@settings(max_examples=100, deadline=None)
@given(launch_orders())
def test_launch_order_runs_every_block_once_heaviest_first(order):
  note(f"units={order.units} tiles={order.tiles} sizes={order.sizes}")
  _check_launch_order(order)


@settings(max_examples=20, deadline=None)
@given(launch_orders())
def test_launch_order_traced_equals_numpy(order):
  """The kernel's traced int32 arithmetic (lax.div / rem / where) maps
  every launch index as the NumPy form the properties check."""
  import jax
  import jax.numpy as jnp
  flat = np.arange(order.units * order.tiles)
  traced = jax.jit(jax.vmap(lambda f: jnp.stack(order.locate(f))))(jnp.asarray(flat, jnp.int32))
  assert np.array_equal(np.asarray(traced), np.stack(order.locate(flat), axis=1))


def test_launch_order_sections_balance_and_fit_l2():
  """Sizes differ by at most one; a section holds the fewest units whose
  tiles cover BALANCE_WAVES blocks per SM, unless L2 caps it; the causal
  benchmark shapes get more than one section where a head's tiles are many."""
  o = schedule.LaunchOrder.for_grid(64, 32, unit_bytes=2 << 20, num_sms=132)
  assert o.sizes == (10, 9, 9, 9, 9, 9, 9)           # ceil(264 / 32) = 9 units
  o = schedule.LaunchOrder.for_grid(16, 128, unit_bytes=8 << 20, num_sms=132)
  assert o.sizes == (4, 3, 3, 3, 3)                  # ceil(264 / 128) = 3, L2 allows 4
  o = schedule.LaunchOrder.for_grid(16, 8, unit_bytes=16 << 20, num_sms=132)
  assert o.sizes == (2,) * 8                         # L2 caps 33 units at 2
  assert schedule.LaunchOrder.for_grid(5, 2, unit_bytes=1, num_sms=132).sizes == (5,)


def test_a_launch_order_that_repeats_a_block_is_refuted():
  """The exactly-once check fails when locate maps two launch indices to
  one block (a mutant that folds the last unit's blocks onto the one before),
  and bad section sizes or shapes are refused by name."""
  order = schedule.LaunchOrder.for_grid(10, 6, unit_bytes=1, num_sms=4)
  _check_launch_order(order)

  class Mutant(schedule.LaunchOrder):
    def locate(self, flat):
      unit, rank = super().locate(flat)
      return np.minimum(unit, self.units - 2), rank

  with pytest.raises(AssertionError, match="exactly once"):
    _check_launch_order(Mutant(order.units, order.tiles, order.sizes))
  with pytest.raises(ValueError, match="section sizes"):
    schedule.LaunchOrder(10, 6, (4, 6))
  with pytest.raises(ValueError, match="tiles"):
    schedule.LaunchOrder.for_grid(10, 0, unit_bytes=1, num_sms=4)


@pytest.mark.parametrize("head_dim,seq,batch,heads,kv_heads,dkv_sections", [
    (64, 1024, 16, 32, 32, False),    # fused dQ, MHA: a 2-3 % model gain does not repay
    (64, 16384, 1, 32, 32, False),
    (64, 16384, 1, 32, 8, False),
    (64, 3008, 5, 32, 8, True),       # fused dQ, GQA: the head-by-head tail is 15 %
    (64, 7040, 2, 32, 8, True),
    (128, 4096, 4, 16, 16, True),     # the dQ kernel's path: sections under causal
    (128, 16384, 1, 16, 16, True),
    (256, 4096, 4, 8, 8, True),
])
def test_backward_launch_orders_where_measured(head_dim, seq, batch, heads, kv_heads,
                                               dkv_sections):
  """The backward's grids take the sectioned order under causal where it
  was measured faster (kernel.backward.dkv.dkv_call's notes), never without
  causal, and the orders cover their grids."""
  from kernel.tiling import backward_plan
  from kernel.backward import dkv as bwd_dkv
  from kernel.backward import dq as bwd_dq
  for causal in (False, True):
    problem = problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, seq, seq, is_causal=causal,
                          scale=0.1)
    blocks = backward_plan.blocks_for(head_dim, head_dim, causal=causal)
    fused = backward_plan.fuses_dq(blocks, with_bias=False, causal=causal)
    common_args = dict(batch=batch, group=heads // kv_heads, t_pad=seq, s_pad=seq,
                       head_dims=(head_dim, head_dim), dtype="bfloat16", num_sms=132)
    dkv = bwd_dkv.dkv_launch_order(problem, blocks, num_kv_heads=kv_heads, fused=fused,
                                    **common_args)
    dq = bwd_dq.dq_launch_order(problem, blocks, num_heads=heads, **common_args)
    if not causal:
      assert dkv is None and dq is None
      continue
    assert (dkv is not None) == dkv_sections
    if dkv is not None:
      assert (dkv.units, dkv.tiles) == (batch * kv_heads, seq // blocks.dkv_tile)
      _check_launch_order(dkv)
    if not fused:
      assert dq is not None and (dq.units, dq.tiles) == (batch * heads, seq // blocks.dq_tile)
      _check_launch_order(dq)


@settings(max_examples=hs.examples(12), deadline=None)
# A window edge one key past a block boundary, on either side.
@example(head_dim=128, seq_q=384, seq_kv=384, left=1, right=1, causal=False, group=1)
@example(head_dim=64, seq_q=896, seq_kv=896, left=65, right=129, causal=False, group=2)
# Ragged and unequal lengths: the last key tile holds 9 real keys, padded
# query rows copy the last real row's range.
@example(head_dim=64, seq_q=1000, seq_kv=777, left=0, right=1, causal=True, group=1)
@example(head_dim=256, seq_q=129, seq_kv=1100, left=300, right=129, causal=False, group=2)
@given(st.sampled_from([64, 128, 256]), st.integers(1, 1600), st.integers(1, 1600),
       st.integers(0, 700), st.integers(0, 700), st.booleans(), st.sampled_from([1, 2]))
def test_launch_order_weights_are_the_kernels_steps(head_dim, seq_q, seq_kv, left, right,
                                                   causal, group):
  """The tile weights the backward's launch order balances
  (kernel.backward.dkv.key_tile_weights, query_tile_weights) are the steps the
  kernels take, at any lengths (ragged, T != S): the dK/dV kernel's query
  blocks per key tile from the tables a local window's key ranges give
  (kernel.padding, padded as attention_backward pads them, read as
  _at_key_tile reads them), and the dQ kernel's key blocks per query tile
  from kernel.masks.Mask.key_blocks, for every rank of the launch order."""
  import jax.numpy as jnp
  from kernel import padding, key_ranges as variants
  from kernel.tiling import backward_plan
  from kernel.backward import dkv as bwd_dkv
  from kernel.backward import dq as bwd_dq
  from kernel.call import AttentionShapes
  blocks = backward_plan.blocks_for(head_dim, head_dim, causal=causal)
  whole = lambda n, m: -(-n // m) * m
  t_pad, s_pad = whole(seq_q, blocks.query_multiple), whole(seq_kv, blocks.key_multiple)
  problem = problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, seq_q, seq_kv, is_causal=causal,
                        scale=0.1, window=(left, right))
  shapes = AttentionShapes(B=1, T=seq_q, S=seq_kv, N=group, K=1, H=head_dim, Hv=head_dim)
  ks, ke, _ = variants.row_ranges(shapes, window=(left, right))
  ks, ke, (start_min, _, _, end_max) = padding.key_ranges(
      ks, ke, seq_kv=seq_kv, tile=blocks.dq_tile, num_tiles=t_pad // blocks.dq_tile)
  lo, hi = padding.query_block_ranges(
      ks, ke, seq_kv=seq_kv, num_rows=t_pad, block_q=blocks.dkv_stream_q,
      key_tile=blocks.dkv_tile, num_key_tiles=s_pad // blocks.dkv_tile, group=group)
  nq = t_pad // blocks.dkv_stream_q
  steps = []
  for j in range(s_pad // blocks.dkv_tile):
    first = j * blocks.dkv_tile // blocks.dkv_stream_q if causal else 0
    start, stop = max(first, int(lo[0, 0, j])), min(nq, int(hi[0, 0, j]))
    steps.append(group * max(stop - start, 0))
  assert bwd_dkv.key_tile_weights(problem, blocks, group=group, t_pad=t_pad, s_pad=s_pad) == steps
  qi = jnp.arange(t_pad // blocks.dq_tile, dtype=jnp.int32)
  lb, ub = Mask(seq_q, seq_kv, causal=causal).key_blocks(
      qi, tile_q=blocks.dq_tile, block_kv=blocks.dq_stream_kv, k_start_min=start_min[0, 0],
      k_end_max=end_max[0, 0])
  steps = np.maximum(np.asarray(ub) - np.asarray(lb), 0)[::-1].tolist()
  assert bwd_dq.query_tile_weights(problem, blocks, t_pad=t_pad) == steps


@pytest.mark.parametrize("head_dim,seq,batch,heads,window", [
    (128, 16384, 1, 16, (1024, 1024)),   # measured head by head (dkv_call's notes)
    (128, 4096, 4, 16, (512, 512)),
    (64, 8192, 2, 32, (1024, 0)),
])
def test_a_local_window_launches_head_by_head(head_dim, seq, batch, heads, window):
  """Under a local window the tiles' work is even (but near the ends), so
  sections cannot repay their spread and both grids launch head by head;
  the same causal shape without the window keeps its sectioned orders."""
  from kernel.tiling import backward_plan
  from kernel.backward import dkv as bwd_dkv
  from kernel.backward import dq as bwd_dq
  windowed = lambda w: problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, seq, seq,
                                   is_causal=True, scale=0.1, window=w)
  blocks = backward_plan.blocks_for(head_dim, head_dim, causal=True)
  fused = backward_plan.fuses_dq(blocks, with_bias=False, causal=True)
  args = dict(batch=batch, group=1, t_pad=seq, s_pad=seq, head_dims=(head_dim, head_dim),
              dtype="bfloat16", num_sms=132)
  dkv = lambda w: bwd_dkv.dkv_launch_order(windowed(w), blocks, num_kv_heads=heads,
                                            fused=fused, **args)
  dq = lambda w: bwd_dq.dq_launch_order(windowed(w), blocks, num_heads=heads, **args)
  assert dkv(window) is None and dq(window) is None
  assert dq(None) is not None
  assert (dkv(None) is not None) == (not fused)


def test_mosaic_gpu_launches_the_last_grid_axis_fastest():
  """The launch orders above, and the grids' axis orders measured in
  kernel/backward/ and kernel/forward/, rest on Mosaic GPU putting a
  kernel's LAST grid axis on blockIdx.x, which the hardware hands out
  fastest.  Lowered here, a (2, 3, 5) grid named (a, b, c) launches as CUDA
  grid (x, y, z) = (5, 3, 2), and axis_index reads c from blockIdx.x, b from
  y, a from z; the dK/dV launch puts its key tiles on x.  A jax upgrade
  that changed this would silently void the measured orders: it fails here."""
  import jax
  import jax.numpy as jnp
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
  from kernel import api
  from kernel.tiling import backward_plan
  from kernel.backward import dkv as bwd_dkv

  grids, reads = [], {}
  lower_kernel = mgpu_lowering.mgpu_core._lower_as_gpu_kernel
  to_grid_id = mgpu_lowering.block_id_to_grid_id

  def spy_launch(*args, **kwargs):
    grids.append(tuple(kwargs["grid"]))
    return lower_kernel(*args, **kwargs)

  def spy_axis(ctx, block_ids, axis_name):
    reads[axis_name] = to_grid_id(ctx, ("x", "y", "z"), axis_name)
    return to_grid_id(ctx, block_ids, axis_name)

  def body(o_ref):
    a, b, c = (jax.lax.axis_index(n) for n in ("a", "b", "c"))
    o_ref[...] = jnp.full(o_ref.shape, a * 100 + b * 10 + c, jnp.int32)

  toy = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.int32),
                     grid=(2, 3, 5), grid_names=("a", "b", "c"))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(mgpu_lowering.mgpu_core, "_lower_as_gpu_kernel", spy_launch)
    mp.setattr(mgpu_lowering, "block_id_to_grid_id", spy_axis)
    with api.lowering_only():
      jax.export.export(jax.jit(toy), platforms=["cuda"])()
    assert grids == [(5, 3, 2)] and reads == {"a": "z", "b": "y", "c": "x"}
    grids.clear()
    problem = problem_for(np.dtype(ml_dtypes.bfloat16), 64, 64, 512, 768, is_causal=False,
                          scale=0.1)
    blocks = backward_plan.blocks_for(64, 64, causal=False)
    sds = lambda s, n, dt=jnp.bfloat16: jax.ShapeDtypeStruct((2, s, n, 64), dt)
    dkv = lambda q, k, v, do, rows: bwd_dkv.dkv_call(problem, blocks, q, k, v, do, rows, None, None,
                                                      None, None)
    with api.lowering_only():
      jax.export.export(jax.jit(dkv), platforms=["cuda"])(
          sds(512, 4), sds(768, 2), sds(768, 2), sds(512, 4),
          jax.ShapeDtypeStruct((2, 4, 2, 512), jnp.float32))
  assert grids == [(768 // blocks.dkv_tile, 2, 2)], grids   # (kv_tiles, batch, kv_heads)


def _d256_causal(seq, batch):
  """The longest-first order of d256 causal, 8 heads, 128-row tiles over
  64-key blocks, and light_last_gain's keywords for it."""
  tiles, s_pad = -(-seq // 128), -(-seq // 64) * 64
  blocks = lambda qi: np.subtract(*Mask(seq, seq, causal=True).key_blocks(
      qi, tile_q=128, block_kv=64)[::-1])
  order = schedule.longest_first(batch=batch, num_heads=8, num_kv_heads=8, num_tiles=tiles,
                                 tile_blocks=blocks, kv_bytes_per_head=s_pad * 1024,
                                 num_sms=132)
  return order, dict(num_sms=132, kv_bytes_per_head=s_pad * 1024,
                     flops_per_block=2 * 128 * 64 * 512)


def test_the_light_last_gain_weighs_the_tail_against_the_re_read():
  """Where a section's heaviest tiles start late (B1 at 9522 tokens:
  sections of 3, 3 and 2 heads) deferring is predicted to pay; at 1024
  tokens (B16: 128 heads' K/V re-read) the re-read outweighs a tail 0.03
  shorter.  Without the re-read term both would defer, as measured they
  must not (light_last_gain's docstring)."""
  long, kw = _d256_causal(9522, 1)
  assert long.sections == (3, 3, 2)
  assert schedule.light_last_gain(long, **kw) == pytest.approx(0.103, abs=0.002)
  short, kw_short = _d256_causal(1024, 16)
  gain = schedule.light_last_gain(short, **kw_short)
  assert gain < 0 < schedule.light_last_gain(short, **{**kw_short, "kv_bytes_per_head": 0})
  # One section re-reads nothing: the gain is the makespan's alone.
  one = dataclasses.replace(long, sections=(8,))
  before = one.makespan(132)
  assert schedule.light_last_gain(one, **kw) == pytest.approx(
      (before - schedule.deferred_light(one).makespan(132)) / before)
