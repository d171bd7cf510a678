"""The static mask of one call as one record (:class:`Mask`), and what
follows from it: which keys a query row may see (:meth:`Mask.keep`,
:meth:`Mask.window_range`, :meth:`Mask.chunk_range`), the key blocks a
query tile visits (:meth:`Mask.key_blocks`) and those it can take unmasked
(:meth:`Mask.plain_blocks`), the query blocks that see a key tile, and the
tiles' weights the schedules deal by.

Pure Python over ints, NumPy arrays and traced int32 alike: JAX is imported
only where a traced value arrives, so that kernel.tiling.plan, which makes
the record, stays free of it."""

from __future__ import annotations

import dataclasses

import numpy as np

from kernel.sync.seams import seam


def _jax():
  """(lax, jax.numpy), for the traced bounds only."""
  from jax import lax
  import jax.numpy as jnp
  return lax, jnp


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _visible_blocks(first: int, last: int, block: int, count: int) -> int:
  """How many of ``count`` blocks of ``block`` rows hold a row in [first,
  last] (0 when the interval is empty or outside them)."""
  first, last = max(first, 0), min(last, count * block - 1)
  return max(0, last // block - first // block + 1) if last >= first else 0


@dataclasses.dataclass(frozen=True)
class Mask:
  """Which keys each query row may see, as far as it is known when
  tracing: a call's is made by kernel.tiling.plan.problem_for, which its
  problem holds (kernel.tiling.plan.Problem.mask).

  Row i sees key j iff j < seq_kv, and j <= i under ``causal`` (aligned
  top-left, as jax.nn's), and i - left <= j <= i + right under jax.nn's
  local ``window`` (left, right), and j // C == i // C under ``chunk`` = C
  (FlashAttention-3's ``attention_chunk``: with causal, chunked attention,
  causal inside each chunk of C positions).  The kernels read the window
  as the key ranges kernel/key_ranges.py made of it (traced operands); the
  record keeps it so that the schedules can weigh a windowed tile; the
  chunk likewise (:meth:`chunk_range`)."""

  seq_q: int
  seq_kv: int
  causal: bool = False
  window: tuple[int, int] | None = None
  chunk: int | None = None

  def __post_init__(self):
    if self.chunk is not None and self.chunk < 1:
      raise ValueError(f"chunk: expected a positive number of positions, got {self.chunk!r}")

  # -- which keys a row sees ---------------------------------------------------

  def keep(self, rows, keys):
    """Whether row ``rows`` may see key ``keys``, element by element
    (NumPy, jax.numpy or ints; the result broadcasts against both): the
    definition every bound below agrees with."""
    keep = keys < self.seq_kv
    if self.causal:
      keep = keep & (keys <= rows)
    if self.window is not None:
      left, right = self._window_sides()
      keep = keep & (rows - left <= keys) & (keys <= rows + right)
    if self.chunk is not None:
      keep = keep & (keys // self.chunk == rows // self.chunk)
    return keep

  def _window_sides(self) -> tuple[int, int]:
    # A side past seq_q + seq_kv sees every key: cut there, rows -/+ it
    # stays inside int32.
    return tuple(int(min(w, self.seq_q + self.seq_kv + 2)) for w in self.window)

  def window_range(self, rows):
    """[start, end) of the keys the window lets each of ``rows`` see, not
    cut to the keys there are (int32 for int32 rows)."""
    left, right = self._window_sides()
    return rows - np.int32(left), rows + np.int32(right + 1)

  def chunk_range(self, rows):
    """[start, end) of the keys in the chunk of each of ``rows``, not cut
    to the keys there are (int32 for int32 rows)."""
    size = np.int32(self.chunk)
    start = rows // size * size
    return start, start + size

  def _row_keys(self, row: int) -> tuple[int, int]:
    """[start, end) of the keys the window and the chunk let ``row`` see,
    not cut to the keys there are (Python ints; one of them set)."""
    starts, ends = [], []
    if self.window is not None:
      left, right = self.window
      starts.append(row - left)
      ends.append(row + right + 1)
    if self.chunk is not None:
      starts.append(row // self.chunk * self.chunk)
      ends.append(starts[-1] + self.chunk)
    return max(starts), min(ends)

  def tile_keys(self, qi: int, tile: int) -> tuple[int | None, int | None]:
    """(start min, end max) of the keys the window and the chunk let query
    tile ``qi``'s real rows see (rows ``qi * tile`` on): the tile bounds
    kernel.padding gives their key ranges (a row's start and end never
    fall).  (None, None) without either."""
    if self.window is None and self.chunk is None:
      return None, None
    first, last = qi * tile, min((qi + 1) * tile, self.seq_q) - 1
    return self._row_keys(first)[0], min(self._row_keys(last)[1], self.seq_kv)

  # -- the key blocks of a query tile --------------------------------------------

  def key_blocks(self, qi, *, tile_q: int, block_kv: int, k_start_min=None, k_end_max=None):
    """Key blocks [lb, ub) that query tile ``qi`` (rows ``qi * tile_q`` on)
    visits: those up to its last row's diagonal under causal, and inside
    [k_start_min, k_end_max), the union of its rows' key ranges, where
    given.  Never a negative range.

    Shared by the memory and every compute warpgroup (they must agree), by
    the schedules' weights and by the proof's probes of the forward and the
    backward (harness/proofs/*_probes.py).  Works on Python ints and traced
    int32 scalars."""
    ints = isinstance(qi, int)
    traced = not (ints and isinstance(k_start_min, (int, type(None))))
    lax, jnp = _jax() if traced else (None, None)
    _max = max if ints else lax.max
    _min = min if ints else lax.min
    cdiv = _cdiv if ints else (lambda a, b: lax.div(a + (b - 1), jnp.int32(b)))
    lb, ub = 0, _cdiv(self.seq_kv, block_kv)
    if self.causal:
      last_row = _min((qi + 1) * tile_q, self.seq_q)  # exclusive
      ub = _min(ub, cdiv(last_row, block_kv))
    if k_start_min is not None:
      lb = _max(lb, lax.div(lax.max(k_start_min, 0), jnp.int32(block_kv))
                if not isinstance(k_start_min, int) else max(k_start_min, 0) // block_kv)
    if k_end_max is not None:
      ub = _min(ub, cdiv(_max(k_end_max, 0), block_kv))
    ub = _max(ub, lb)  # an empty range, never a negative one
    return lb, ub

  def tile_blocks(self, qi: int, *, tile_q: int, block_kv: int) -> int:
    """How many key blocks query tile ``qi`` visits by what is known when
    tracing (causal, the key length, the window, the chunk): a schedule's
    weight of the tile.  Other key ranges only narrow it."""
    start_min, end_max = self.tile_keys(qi, tile_q)
    lb, ub = self.key_blocks(qi, tile_q=tile_q, block_kv=block_kv, k_start_min=start_min,
                             k_end_max=end_max)
    return ub - lb

  def plain_blocks(self, lb, ub, *, q_base, block_kv: int, ragged: bool, edge: bool,
                   k_start_max=None, k_end_min=None):
    """(lo, hi): of key blocks [lb, ub), those [lo, hi) no row of a
    compute warpgroup's rows (``q_base`` on) needs masked: entirely below
    the diagonal for its first row, holding no padded key (``ragged``: the
    launch's last block holds some), and inside every row's key range (from
    the largest start, ``k_start_max``, to the smallest end, ``k_end_min``,
    where given).  Traced int32.  ``edge``: whether any block may need a
    select (else hi stays as it is)."""
    lax, jnp = _jax()
    kv = jnp.int32(block_kv)
    lo, hi = lb, ub
    if self.causal:
      hi = lax.min(hi, lax.div(q_base + 1, kv))
    if ragged:
      hi = lax.min(hi, jnp.int32(self.seq_kv // block_kv))
    if k_end_min is not None:
      hi = lax.min(hi, lax.div(lax.max(k_end_min, 0), kv))
    if edge:
      hi = lax.max(lb, hi)
    if k_start_max is not None:  # the first block whose keys all start at or after it
      lo = lax.max(lo, lax.div(lax.max(k_start_max, 0) + kv - 1, kv))
    return lo, hi

  # -- the query blocks of a key tile ---------------------------------------------

  @seam("masks.first_query_block")
  def first_query_block(self, tile, *, key_tile: int, block_q: int):
    """The first query block (of ``block_q`` rows) that may see key tile
    ``tile`` (keys ``tile * key_tile`` on): its first key's row under
    causal, else the first.  Traced int32."""
    lax, jnp = _jax()
    return lax.div(tile * key_tile, jnp.int32(block_q)) if self.causal else jnp.int32(0)

  def key_tile_blocks(self, tile: int, *, key_tile: int, block_q: int, num_blocks: int) -> int:
    """How many of ``num_blocks`` query blocks of ``block_q`` rows (padded
    rows included) see key tile ``tile`` (keys ``tile * key_tile`` on) by
    what is known when tracing: a schedule's weight of the tile.

    Without a window or a chunk every block from
    :meth:`first_query_block`'s on.  Under either, the band the rows' key
    ranges give (kernel.padding's query_block_ranges): only the tile's real
    keys count, only real rows have a range, and the padded rows copy the
    last real row's, so the blocks of padded rows alone count exactly when
    that row sees the tile.  The rows that see keys [a, b] are an interval,
    each bound's own: from a - right and a's chunk's first row, up to
    b + left and b's chunk's last row."""
    first, last = (tile * key_tile if self.causal else 0), num_blocks * block_q - 1
    if self.window is None and self.chunk is None:
      return _visible_blocks(first, last, block_q, num_blocks)
    keys_end = min((tile + 1) * key_tile, self.seq_kv)
    if keys_end <= tile * key_tile:
      return 0
    a, b = tile * key_tile, keys_end - 1
    last = self.seq_q - 1
    if self.window is not None:
      left, right = self.window
      first, last = max(first, a - right), min(last, b + left)
    if self.chunk is not None:
      first = max(first, a // self.chunk * self.chunk)
      last = min(last, (b // self.chunk + 1) * self.chunk - 1)
    seen = _visible_blocks(first, last, block_q, num_blocks)
    if first <= self.seq_q - 1 <= last:
      seen += num_blocks - _cdiv(self.seq_q, block_q)
    return seen
