"""The order in which the forward kernel's query tiles run: one object for
the memory and the compute warpgroups alike.

A tile is (batch b, query head h, query super-tile qi).  Under a causal mask
(or key ranges) tiles do unequal work: tile qi visits about qi + 1 key blocks.
Two facts decide the order:

* Balance.  Dealing heavy tiles last leaves a tail where a few SMs finish the
  biggest tiles while the rest idle.  Tiles are taken heaviest first
  (longest-processing-time first) and each goes to the SM with the least
  work so far, so the last tiles dealt are the lightest.
* L2 reuse.  Every tile of one (batch, kv head) re-reads that head's keys and
  values; at 128 query rows a tile does ~128 FLOPs per byte of K/V, below the
  H200's ~167 FLOPs per byte of HBM bandwidth, so the K/V must come from L2.
  Tiles are therefore grouped in *sections* of (batch, kv head) units whose
  K/V fit ``L2_SECTION_BYTES``, and a section's tiles run before the next
  section's: the tiles in flight at any moment read the K/V of one or two
  sections.  (A grid with heads fastest, the launch order of the plain
  non-persistent grid, spreads the tiles in flight over every head of a
  batch: 64 MB of K/V at 8k tokens, d128, 16 heads.)

``longest_first`` returns the order as data (NumPy, computed from static
shapes at trace time); :meth:`Schedule.assign` deals it to persistent
blocks.  The kernel reads both from small int32 tables in global memory, and
``properties/test_schedule.py`` checks that every tile is dealt exactly once.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

# FlashAttention-3 sizes its sections at about 32 MB of K/V; the H200's L2 is
# 50 MB and also carries the queries and outputs streaming through.
L2_SECTION_BYTES = 32 * 1024 * 1024
# A tile's fixed cost (query load, epilogue, pipeline fill) in key-block
# equivalents: it keeps a light tile from looking free to the dealer.
TILE_OVERHEAD_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Tiles in run order.  ``order[i]`` is the packed tile id
  ``(b * num_heads + h) * num_tiles + qi`` of the i-th tile; ``weight[i]``
  its key blocks (the static upper bound the dealer balances)."""

  batch: int
  num_heads: int
  num_tiles: int
  order: np.ndarray    # (total,) int32
  weight: np.ndarray   # (total,) int64

  @property
  def total(self) -> int:
    return self.batch * self.num_heads * self.num_tiles

  def unpack(self, tile):
    """(b, h, qi) of a packed id: NumPy ints or traced int32 alike."""
    if isinstance(tile, (int, np.integer)):
      bh, qi = divmod(int(tile), self.num_tiles)
      b, h = divmod(bh, self.num_heads)
      return b, h, qi
    from jax import lax
    import jax.numpy as jnp
    nt, nh = jnp.int32(self.num_tiles), jnp.int32(self.num_heads)
    bh = lax.div(tile, nt)
    return lax.div(bh, nh), lax.rem(bh, nh), lax.rem(tile, nt)

  def assign(self, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal the order to ``num_blocks`` persistent blocks: each tile, in
    order, to the block with the least work so far (ties: lowest index).

    Returns ``(tiles, counts)``: ``tiles`` (num_blocks, max_count) int32,
    block j runs ``tiles[j, :counts[j]]`` in that order (the rest is -1).
    """
    if num_blocks < 1:
      raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    loads = [(0, j) for j in range(num_blocks)]
    per_block: list[list[int]] = [[] for _ in range(num_blocks)]
    for tile, w in zip(self.order.tolist(), self.weight.tolist()):
      load, j = heapq.heappop(loads)
      per_block[j].append(tile)
      heapq.heappush(loads, (load + w + TILE_OVERHEAD_BLOCKS, j))
    counts = np.array([len(p) for p in per_block], np.int32)
    tiles = np.full((num_blocks, max(1, int(counts.max()))), -1, np.int32)
    for j, p in enumerate(per_block):
      tiles[j, :len(p)] = p
    return tiles, counts


def longest_first(*, batch: int, num_heads: int, num_kv_heads: int, num_tiles: int,
                  tile_blocks, kv_bytes_per_head: int,
                  section_bytes: int = L2_SECTION_BYTES) -> Schedule:
  """Tiles grouped in L2 sections of (batch, kv head) units, heaviest first
  inside a section; within one weight, the query heads of a unit and then the
  units follow each other so that tiles in flight share K/V.

  ``tile_blocks(qi)`` is the number of key blocks query tile ``qi`` visits
  (the same for every head and batch: causal and ragged lengths depend on qi
  alone).  ``kv_bytes_per_head``: the K and V bytes of one (batch, kv head).
  """
  for name, value in (("batch", batch), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads), ("num_tiles", num_tiles)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
  group = num_heads // num_kv_heads
  blocks = np.array([int(tile_blocks(qi)) for qi in range(num_tiles)], np.int64)
  units_per_section = max(1, section_bytes // max(1, kv_bytes_per_head))
  units = [(b, hk) for b in range(batch) for hk in range(num_kv_heads)]
  # Heaviest first; a stable sort keeps ascending qi among equal weights.
  qi_order = np.argsort(-blocks, kind="stable")
  order, weight = [], []
  for start in range(0, len(units), units_per_section):
    section = units[start:start + units_per_section]
    for qi in qi_order.tolist():
      for b, hk in section:
        for h in range(hk * group, (hk + 1) * group):
          order.append((b * num_heads + h) * num_tiles + qi)
          weight.append(blocks[qi])
  return Schedule(batch, num_heads, num_tiles, np.array(order, np.int32),
                  np.array(weight, np.int64))
