"""The longest-first tile schedule (kernel/schedule.py), exactly, on the CPU.

The kernel walks ``Schedule.order`` (non-persistent: one tile per grid
point) or the rows of ``Schedule.assign`` (persistent); both are finite
tables computed from static shapes, so these properties check them whole:
every tile of the logical grid is computed exactly once, by exactly one
block, heaviest first within an L2 section, and the dealt load is balanced.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from kernel import common, schedule


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
  blocks = lambda qi: np.subtract(*common.kv_block_range(
      qi, block_q=block_q, block_kv=block_kv, seq_q=seq_q, seq_kv=seq_kv,
      is_causal=causal)[::-1])
  order = schedule.longest_first(
      batch=batch, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
      num_tiles=num_tiles, tile_blocks=blocks, kv_bytes_per_head=per_head,
      section_bytes=section)
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


@settings(max_examples=150, deadline=None)
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
  per_section = units_per_section * group * order.num_tiles
  for start in range(0, order.total, per_section):
    chunk = order.order[start:start + per_section].tolist()
    weights = [int(blocks(order.unpack(t)[2])) for t in chunk]
    assert all(a >= b for a, b in zip(weights, weights[1:])), weights
    units = {(order.unpack(t)[0], order.unpack(t)[1] // group) for t in chunk}
    assert len(units) <= units_per_section


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


@pytest.mark.parametrize("bad", [dict(batch=0), dict(num_kv_heads=3), dict(num_tiles=-1)])
def test_bad_launch_shapes_are_refused_by_name(bad):
  args = dict(batch=1, num_heads=4, num_kv_heads=2, num_tiles=2, tile_blocks=lambda qi: 1,
              kv_bytes_per_head=1)
  args.update(bad)
  with pytest.raises(ValueError, match="batch|num_heads|num_tiles"):
    schedule.longest_first(**args)
