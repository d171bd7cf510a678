"""The order in which the forward kernel's query tiles run: one object for
the memory and the compute warpgroups alike; and, below, the order in which
the backward's causal grids launch their blocks (:class:`LaunchOrder`).

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
blocks; where key ranges put the work where the static weights cannot see
it (packed documents, lengths), :meth:`Schedule.reranked` re-ranks the
non-persistent launch by the weights the device finds.  A dynamic deal
(each persistent block taking the next tile from a counter in global
memory) needs a fetch-and-add, which the primitives of Pallas Mosaic GPU do
not offer in jax 0.11.2 (``plgpu.atomic_add`` is a store-add that returns
nothing).  PTX's ``atom.add`` through ``plgpu.inline_mgpu`` does work, but
it was not built into the kernel: a persistent launch dealt by each tile's
true work, computed on the host (the best a dynamic deal can match), ran
slower than the non-persistent grid in longest-first order
(docs/decisions/no-dynamic-deal.md).  The non-persistent grid, which the
hardware deals dynamically in launch order, is the dynamic schedule.  The
kernel reads both from small int32 tables in global memory, and
``properties/kernel/test_schedule.py`` checks that every tile is dealt exactly once.
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
# longest_first evens its L2 sections where dealing predicts this much less
# makespan.  Evening never makes a section larger (its K/V still fit L2),
# so it costs nothing the model leaves out; the margin only keeps the
# model's own noise (about 1 % between splits of equal balance) from
# changing orders.
EVEN_SECTIONS_MIN_GAIN = 0.02
# The forward defers a longest-first order's light tiles where
# light_last_gain predicts at least this.  The model under-predicts what
# deferring gains, so the margin is small
# (docs/decisions/defer-light-min-gain.md).
DEFER_LIGHT_MIN_GAIN = 0.005
# FLOPs the forward computes in the time HBM delivers a byte: the forward's
# rate over the H200's HBM bandwidth, below the peak ratio of the module
# docstring (docs/decisions/light-tiles-last.md); light_last_gain prices a
# re-read byte with it.
FLOPS_PER_HBM_BYTE = 150


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
  # (batch, kv head) units per L2 section, in run order (longest_first's).
  sections: tuple[int, ...] = ()

  @property
  def total(self) -> int:
    return self.batch * self.num_heads * self.num_tiles

  def unpack(self, tile):
    """(b, h, qi) of a packed id: NumPy ints and arrays or traced int32 alike."""
    if isinstance(tile, (int, np.integer, np.ndarray)):
      bh, qi = np.divmod(np.asarray(tile, np.int64), self.num_tiles)
      b, h = np.divmod(bh, self.num_heads)
      return (b, h, qi) if isinstance(tile, np.ndarray) else (int(b), int(h), int(qi))
    from jax import lax
    import jax.numpy as jnp
    nt, nh = jnp.int32(self.num_tiles), jnp.int32(self.num_heads)
    bh = lax.div(tile, nt)
    return lax.div(bh, nh), lax.rem(bh, nh), lax.rem(tile, nt)

  def reranked(self, blocks):
    """The order with each (batch, head)'s tiles re-ranked heaviest first by
    ``blocks``: traced int32 (B|1, N|1, num_tiles), the key blocks each
    tile visits as the device finds them (key ranges from lengths or packed
    documents are data, so the static weights only bound them).

    Position by position the launch keeps this schedule's sections and its
    interleaving of heads: where this order runs the r-th tile of a
    (batch, head), the reranked one runs that (batch, head)'s r-th heaviest
    by ``blocks`` (ties: lower qi first).  Each (batch, head) keeps its
    positions and a permutation of its tiles goes into them, so the result
    is a permutation of the same tiles whatever ``blocks`` holds.
    """
    import jax.numpy as jnp
    bh, _ = np.divmod(self.order.astype(np.int64), self.num_tiles)
    b, h = np.divmod(bh, self.num_heads)
    # rank[p]: how many earlier positions belong to the same (batch, head).
    by_unit = np.argsort(bh, kind="stable")
    first = np.searchsorted(bh[by_unit], bh[by_unit], side="left")
    rank = np.empty_like(bh)
    rank[by_unit] = np.arange(bh.size) - first
    blocks = jnp.asarray(blocks, jnp.int32)
    if blocks.ndim != 3 or blocks.shape[2] != self.num_tiles or any(
        n not in (1, full) for n, full in zip(blocks.shape[:2], (self.batch, self.num_heads))):
      raise ValueError(f"blocks: expected (B|1, N|1, {self.num_tiles}) for B={self.batch}, "
                       f"N={self.num_heads}, got {blocks.shape}")
    heaviest = jnp.argsort(-blocks, axis=-1, stable=True).astype(jnp.int32)
    at = lambda idx, n: idx if n > 1 else np.zeros_like(idx)
    qi = heaviest[at(b, blocks.shape[0]), at(h, blocks.shape[1]), rank]
    return (jnp.asarray(bh.astype(np.int32)) * self.num_tiles + qi).astype(jnp.int32)

  def assign(self, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal the order to ``num_blocks`` persistent blocks: each tile, in
    order, to the block with the least work so far (ties: lowest index).

    Returns ``(tiles, counts)``: ``tiles`` (num_blocks, max_count) int32,
    block j runs ``tiles[j, :counts[j]]`` in that order (the rest is -1).
    """
    per_block, _ = self._deal(num_blocks)
    counts = np.array([len(p) for p in per_block], np.int32)
    tiles = np.full((num_blocks, max(1, int(counts.max()))), -1, np.int32)
    for j, p in enumerate(per_block):
      tiles[j, :len(p)] = p
    return tiles, counts

  def makespan(self, num_blocks: int) -> int:
    """The largest load :meth:`assign` deals a block (key blocks, each
    tile counted with ``TILE_OVERHEAD_BLOCKS``)."""
    return max(self._deal(num_blocks)[1])

  def _deal(self, num_blocks: int) -> tuple[list[list[int]], list[int]]:
    """(tiles per block, load per block) of :meth:`assign`'s dealing."""
    if num_blocks < 1:
      raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    heap = [(0, j) for j in range(num_blocks)]
    per_block: list[list[int]] = [[] for _ in range(num_blocks)]
    loads = [0] * num_blocks
    for tile, w in zip(self.order.tolist(), self.weight.tolist()):
      load, j = heapq.heappop(heap)
      per_block[j].append(tile)
      loads[j] = load + w + TILE_OVERHEAD_BLOCKS
      heapq.heappush(heap, (loads[j], j))
    return per_block, loads


def longest_first(*, batch: int, num_heads: int, num_kv_heads: int, num_tiles: int,
                  tile_blocks, kv_bytes_per_head: int,
                  section_bytes: int = L2_SECTION_BYTES,
                  num_sms: int | None = None) -> Schedule:
  """Tiles grouped in L2 sections of (batch, kv head) units, heaviest first
  inside a section; within one weight, the query heads of a unit and then the
  units follow each other so that tiles in flight share K/V.

  ``tile_blocks(qi)`` is the number of key blocks query tile ``qi`` visits
  (the same for every head and batch: causal and ragged lengths depend on qi
  alone).  ``kv_bytes_per_head``: the K and V bytes of one (batch, kv head).

  Sections hold as many units as ``section_bytes`` allows, the last one the
  rest.  Given ``num_sms``, the units are instead split evenly over as many
  sections (sizes differing by at most one) where dealing that order to
  ``min(num_sms, tiles)`` blocks is predicted at least
  :data:`EVEN_SECTIONS_MIN_GAIN` faster (:meth:`Schedule.makespan`).  Why:
  a last section of few units starts its heaviest tiles when every SM is
  nearly done, and they make the tail (docs/decisions/even-sections.md).
  """
  for name, value in (("batch", batch), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads), ("num_tiles", num_tiles)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
  blocks = np.array([int(tile_blocks(qi)) for qi in range(num_tiles)], np.int64)
  units = batch * num_kv_heads
  cap = max(1, section_bytes // max(1, kv_bytes_per_head))
  filled = (cap,) * (units // cap) + ((units % cap,) if units % cap else ())
  schedule = _sectioned(batch, num_heads, num_kv_heads, num_tiles, blocks, filled)
  count = len(filled)
  base, extra = divmod(units, count)
  even = (base + 1,) * extra + (base,) * (count - extra)
  if num_sms is None or even == filled:
    return schedule
  evened = _sectioned(batch, num_heads, num_kv_heads, num_tiles, blocks, even)
  blocks_dealt = min(num_sms, schedule.total)
  gain = schedule.makespan(blocks_dealt) / evened.makespan(blocks_dealt) - 1
  if gain >= EVEN_SECTIONS_MIN_GAIN:
    return evened
  return schedule


def deferred_light(schedule: Schedule) -> Schedule:
  """The same tiles with the light ones (at most half the heaviest tile's
  key blocks) moved after every section's heavy ones, heaviest first (equal
  weights keep their order, so section by section).  Where a section's
  heaviest tiles start late, this shortens the tail (d256 causal, 8 heads,
  B1 at 9522 tokens: largest load 1.157 of the mean in order, 1.027
  deferred), but the deferred tiles of every section run together and read
  their K/V from HBM again; :func:`light_last_gain` weighs the two."""
  weight = schedule.weight
  heavy = 2 * weight > weight.max()
  light = np.flatnonzero(~heavy)
  idx = np.concatenate([np.flatnonzero(heavy), light[np.argsort(-weight[light], kind="stable")]])
  return dataclasses.replace(schedule, order=schedule.order[idx], weight=weight[idx])


def light_last_gain(schedule: Schedule, *, num_sms: int, kv_bytes_per_head: int,
                    flops_per_block: int) -> float:
  """The predicted gain of :func:`deferred_light`'s order over ``schedule``,
  as a fraction of the launch: the makespan dealing saves (on
  ``min(num_sms, tiles)`` blocks), less the time the deferred tiles of every
  section but the last spend re-reading their K/V prefixes from HBM (the
  last section's are still in L2), in key blocks of one SM's compute at
  :data:`FLOPS_PER_HBM_BYTE`.

  Why the re-read counts: where many heads' K/V are re-read for a small
  gain in balance (short sequences, large batches), deferring lost
  (docs/decisions/light-tiles-last.md)."""
  blocks = min(num_sms, schedule.total)
  deferred = deferred_light(schedule)
  before, after = schedule.makespan(blocks), deferred.makespan(blocks)
  weight = schedule.weight
  light = weight[2 * weight <= weight.max()]
  reread_blocks = 0.0
  if light.size:
    reread_bytes = (sum(schedule.sections[:-1]) * kv_bytes_per_head * int(light.max())
                    / int(weight.max()))
    reread_blocks = reread_bytes * FLOPS_PER_HBM_BYTE / (flops_per_block * blocks)
  return (before - after - reread_blocks) / before


def _sectioned(batch: int, num_heads: int, num_kv_heads: int, num_tiles: int,
               blocks: np.ndarray, sections: tuple[int, ...]) -> Schedule:
  """:func:`longest_first`'s order for the given units per section."""
  group = num_heads // num_kv_heads
  units = [(b, hk) for b in range(batch) for hk in range(num_kv_heads)]
  # Heaviest first; a stable sort keeps ascending qi among equal weights.
  qi_order = np.argsort(-blocks, kind="stable")
  order, weight = [], []
  start = 0
  for size in sections:
    section = units[start:start + size]
    start += size
    for qi in qi_order.tolist():
      for b, hk in section:
        for h in range(hk * group, (hk + 1) * group):
          order.append((b * num_heads + h) * num_tiles + qi)
          weight.append(blocks[qi])
  return Schedule(batch, num_heads, num_tiles, np.array(order, np.int32),
                  np.array(weight, np.int64), tuple(sections))


# The split tail (``Config(schedule="split-tail")``, persistent, tiles of
# equal work).  Dealt round-robin, T tiles on S blocks run in ceil(T / S)
# waves and the last one is only (T mod S) / S full: at 16k tokens per batch
# a d128 launch has 2048 tiles of 128 rows, 15.5 waves on the H200's 132
# SMs, a d256 one 1024 (7.8 waves), so the last wave idles a half or a
# quarter of the SMs, about 3 % of the launch.  Here whole tiles are dealt
# round-robin for every wave but the last one or two; the key blocks of the
# remaining tiles are laid end to end and cut into S runs whose lengths
# differ by at most one block, and block j runs run j after its whole tiles.
# A run covers the end of one tile, whole tiles, the start of another: a
# part of a tile is a *piece*, which computes the tile's rows over its key
# blocks [lo, hi) only and writes its normalised output and natural-log
# (m, l) to a slot of its own; kernel.forward.order.merge_pieces combines a
# tile's pieces after the kernel (a log-sum-exp weighting).  Keeping two
# waves for the runs when there are (T >= 2 S) makes every run at least a
# tile long, so no tile has more than two pieces.  With fewer tiles than
# SMs every tile is cut (a split-KV launch: a tile has up to
# ceil(SMs / tiles) + 1 pieces), so every SM takes part.


@dataclasses.dataclass(frozen=True)
class SplitTail:
  """What each persistent block runs under the split tail.

  Block j runs entries ``0 .. counts[j] - 1`` of its row, in order; entry
  e is tile ``tiles[j, e]`` (packed as in :class:`Schedule`) over its key
  blocks ``[lo[j, e], hi[j, e])``, written to the output if
  ``slot[j, e] < 0`` and to piece slot ``slot[j, e]`` otherwise.  Tile
  ``split[i]`` is the merge of slots ``piece_slots[i, :]`` (-1: none).
  Unused entries hold -1 (tiles, slot) and 0 (lo, hi)."""

  batch: int
  num_heads: int
  num_tiles: int
  num_blocks: int          # key blocks of every tile (the static bound)
  tiles: np.ndarray        # (blocks, entries) int32
  lo: np.ndarray           # (blocks, entries) int32
  hi: np.ndarray           # (blocks, entries) int32
  slot: np.ndarray         # (blocks, entries) int32
  counts: np.ndarray       # (blocks,) int32
  split: np.ndarray        # (tiles split,) int32 packed tile ids
  piece_slots: np.ndarray  # (tiles split, max pieces) int32

  unpack = Schedule.unpack

  @property
  def total(self) -> int:
    return self.batch * self.num_heads * self.num_tiles

  @property
  def grid_blocks(self) -> int:
    """The persistent blocks the launch runs: one per row."""
    return len(self.counts)

  @property
  def num_slots(self) -> int:
    return int((self.slot >= 0).sum())

  def table(self) -> np.ndarray:
    """(blocks, 4, entries) int32: tiles, lo, hi, slot, the one table the
    kernel reads (beside ``counts``)."""
    return np.stack([self.tiles, self.lo, self.hi, self.slot], axis=1).astype(np.int32)


def split_tail(*, batch: int, num_heads: int, num_tiles: int, num_blocks: int,
               num_sms: int) -> SplitTail:
  """The split-tail deal of ``batch x num_heads x num_tiles`` tiles of
  ``num_blocks`` key blocks each to ``num_sms`` persistent blocks (notes
  above).  Round-robin order is the packed id's, query tiles fastest, as the
  round-robin schedule walks them."""
  for name, value in (("batch", batch), ("num_heads", num_heads), ("num_tiles", num_tiles),
                      ("num_blocks", num_blocks), ("num_sms", num_sms)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  total = batch * num_heads * num_tiles
  waves, rest = divmod(total, num_sms)
  whole_waves = waves if rest == 0 else max(0, waves - 1)
  entries: list[list[tuple[int, int, int, int]]] = [[] for _ in range(num_sms)]
  for tile in range(whole_waves * num_sms):
    entries[tile % num_sms].append((tile, 0, num_blocks, -1))
  first = whole_waves * num_sms
  tail_blocks = (total - first) * num_blocks
  pieces: dict[int, list[int]] = {}
  next_slot = 0
  for j in range(num_sms):
    start = j * tail_blocks // num_sms
    stop = (j + 1) * tail_blocks // num_sms
    g = start
    while g < stop:
      tile, lo = divmod(g, num_blocks)
      hi = min(num_blocks, lo + (stop - g))
      if lo == 0 and hi == num_blocks:
        slot = -1
      else:
        slot = next_slot
        next_slot += 1
        pieces.setdefault(first + tile, []).append(slot)
      entries[j].append((first + tile, lo, hi, slot))
      g += hi - lo
  counts = np.array([len(e) for e in entries], np.int32)
  width = max(1, int(counts.max()))
  tiles = np.full((num_sms, width), -1, np.int32)
  lo_t = np.zeros((num_sms, width), np.int32)
  hi_t = np.zeros((num_sms, width), np.int32)
  slot_t = np.full((num_sms, width), -1, np.int32)
  for j, row in enumerate(entries):
    for e, (tile, lo, hi, slot) in enumerate(row):
      tiles[j, e], lo_t[j, e], hi_t[j, e], slot_t[j, e] = tile, lo, hi, slot
  split = np.array(sorted(pieces), np.int32)
  most = max((len(v) for v in pieces.values()), default=1)
  piece_slots = np.full((len(split), most), -1, np.int32)
  for i, tile in enumerate(split.tolist()):
    piece_slots[i, :len(pieces[tile])] = pieces[tile]
  return SplitTail(batch, num_heads, num_tiles, num_blocks, tiles, lo_t, hi_t, slot_t,
                   counts, split, piece_slots)


# The backward's launch order.  Its two kernels are plain grids, one thread
# block per tile, and the hardware hands each SM the next block in launch
# order as one finishes: dealing is dynamic, but the order is ours.  Under
# causal a tile's work falls linearly with its rank (a key tile sees fewer
# query blocks the later its keys; a query tile fewer key blocks the
# earlier its rows), so a grid walked head by head, each head heaviest
# first, starts the next head's heaviest tiles just as the last head's light
# ones finish, and its last head's heaviest tiles run alone at the end,
# worst with grouped kv heads (whose dK/dV tiles stream every head of the
# group).  Interleaving the tiles of several heads, heaviest first across
# them, evens the tail out (docs/decisions/backward-causal-launch-order.md:
# the dealing model's numbers and the measurements).

# SMs of the H100 SXM and H200, the count a launch order assumes when it is
# not told (lowering without a GPU).
DEFAULT_NUM_SMS = 132
# Blocks per SM a section's tiles should number at least, so that its
# heaviest tiles can be balanced by its light ones.
BALANCE_WAVES = 2


def section_sizes(units: int, tiles: int, *, unit_bytes: int, num_sms: int,
                  section_bytes: int = L2_SECTION_BYTES) -> tuple[int, ...]:
  """Units per section, in launch order.  ``per``: the fewest units whose
  tiles number ``BALANCE_WAVES * num_sms``, but no more than fit
  ``section_bytes`` of the bytes a unit's tiles re-read.  The units are
  split evenly over ``units // per`` sections (sizes differ by at most
  one): a section holds at least ``per`` units and fewer than twice as
  many, the remainder spread over the sections rather than left to a
  small last one (16 units at ``per`` 5: 6, 5, 5), so a section may pass
  ``section_bytes`` by its share of the remainder."""
  for name, value in (("units", units), ("tiles", tiles), ("num_sms", num_sms)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  want = -(-BALANCE_WAVES * num_sms // tiles)
  cap = max(1, section_bytes // max(1, unit_bytes))
  per = max(1, min(want, cap, units))
  count = units // per
  base, extra = divmod(units, count)
  return (base + 1,) * extra + (base,) * (count - extra)


@dataclasses.dataclass(frozen=True)
class LaunchOrder:
  """A grid of ``units`` x ``tiles`` blocks (a unit: a head of a batch
  entry; a tile's rank: 0 the heaviest) in sectioned, heaviest-first launch
  order: the units form sections (:func:`section_sizes`), a section's blocks
  launch before the next section's, and inside a section rank 0 of each of
  its units, then rank 1 of each, and so on.

  :meth:`locate` maps a block's launch index to its (unit, rank), for NumPy
  and traced int32 alike; ``properties/kernel/test_schedule.py`` checks it is a
  bijection onto units x tiles."""

  units: int
  tiles: int
  sizes: tuple[int, ...]

  def __post_init__(self):
    if sum(self.sizes) != self.units or len(set(self.sizes)) > 2 or (
        max(self.sizes) - min(self.sizes) > 1):
      raise ValueError(f"section sizes {self.sizes} do not split {self.units} units evenly")

  @classmethod
  def for_grid(cls, units: int, tiles: int, *, unit_bytes: int, num_sms: int) -> "LaunchOrder":
    return cls(units, tiles, section_sizes(units, tiles, unit_bytes=unit_bytes,
                                           num_sms=num_sms))

  def locate(self, flat):
    """(unit, rank) of the block launched ``flat``-th."""
    base = min(self.sizes)
    big_count = sum(1 for s in self.sizes if s > base)
    big = base + 1
    split = big_count * big * self.tiles   # launch index where the small sections start
    if isinstance(flat, (int, np.integer, np.ndarray)):
      div, rem = np.floor_divide, np.remainder
      where, const = np.where, np.int64
    else:
      import jax.numpy as jnp
      from jax import lax
      div, rem, where, const = lax.div, lax.rem, jnp.where, jnp.int32

    def within(offset, size, first_unit):
      sec = div(offset, const(size * self.tiles))
      off = rem(offset, const(size * self.tiles))
      return first_unit + sec * const(size) + rem(off, const(size)), div(off, const(size))

    if big_count == 0:
      return within(flat, base, const(0))
    if big_count == len(self.sizes):
      return within(flat, big, const(0))
    in_big = flat < const(split)
    u_big, r_big = within(where(in_big, flat, const(0)), big, const(0))
    u_small, r_small = within(where(in_big, const(0), flat - const(split)), base,
                              const(big_count * big))
    return where(in_big, u_big, u_small), where(in_big, r_big, r_small)


# The sectioned order spreads the blocks in flight over several heads; where
# those blocks also reduce-add into a per-head accumulator (the fused dQ),
# that cost is only repaid by a large gain in balance
# (docs/decisions/backward-sections-min-gain.md).
MIN_SECTION_GAIN = 0.05


def predicted_makespan(order: LaunchOrder, rank_weight, num_sms: int) -> float:
  """The makespan of ``order``'s blocks dealt in launch order to the SM that
  frees first (one block per SM), over the perfectly balanced one: a
  block of rank r costs ``rank_weight[r] + TILE_OVERHEAD_BLOCKS``."""
  weight = np.asarray(rank_weight, np.float64) + TILE_OVERHEAD_BLOCKS
  if weight.shape != (order.tiles,):
    raise ValueError(f"rank_weight has shape {weight.shape}, expected ({order.tiles},)")
  _, rank = order.locate(np.arange(order.units * order.tiles))
  free = [0.0] * min(num_sms, order.units * order.tiles)
  for w in weight[rank].tolist():
    heapq.heapreplace(free, free[0] + w)
  return max(free) / (order.units * weight.sum() / num_sms)


def sections_repay(order: LaunchOrder, rank_weight, num_sms: int,
                   min_gain: float = MIN_SECTION_GAIN) -> bool:
  """Whether ``order`` is predicted at least ``min_gain`` faster than the
  grid's own head-by-head order.  A tail can cost no more than the heaviest
  block over an SM's share of the work; below ``min_gain`` that bound
  answers without dealing (which also keeps large grids cheap to decide)."""
  weight = np.asarray(rank_weight, np.float64) + TILE_OVERHEAD_BLOCKS
  share = order.units * weight.sum() / num_sms
  if weight.max() / share < min_gain:
    return False
  head_by_head = LaunchOrder(order.units, order.tiles, (1,) * order.units)
  return (predicted_makespan(head_by_head, rank_weight, num_sms)
          >= (1 + min_gain) * predicted_makespan(order, rank_weight, num_sms))
