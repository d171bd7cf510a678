"""The arguments of ``jax.nn.dot_product_attention`` the kernel has no input
for, and packed-sequence segment ids, mapped onto per-row key ranges.

The kernel takes per-query-row key ranges ``[k_start, k_end)`` and skips, per
query tile, every key block outside the union of its rows' ranges
(``kernel.masks.Mask.key_blocks``; the backward honours them too).  Every
variant below is such a range, so it costs no global-memory read per logit
and skips the blocks it excludes:

* ``query_seq_lengths`` (B,): rows ``i >= len[b]`` see no key (k_end = 0):
  the fully masked row contract gives them output 0, m = -inf, l = 0 and no
  gradient contribution (jax.nn's output there is 0 too).
* ``key_value_seq_lengths`` (B,): ``k_end = min(k_end, len[b])``.
* ``local_window_size`` (left, right), or w for (w, w): row i sees keys
  ``i - left <= j <= i + right`` (positions top-left aligned, as jax.nn's
  window and causal mask), so ``[i - left, i + right + 1)``
  (kernel.masks.Mask.window_range).  Combined with the causal mask by
  intersection, as in jax.nn.
* ``attention_chunk`` C (FlashAttention-3's chunked attention): row i sees
  the keys of its chunk, ``[i // C * C, i // C * C + C)``
  (kernel.masks.Mask.chunk_range); with the causal mask, causal inside it.
* ``q_segment_ids`` (B, T), ``kv_segment_ids`` (B, S): row i sees only the
  keys whose id equals its own.  With ``segment_layout="contiguous"`` (the
  default) each id is assumed to occupy ONE contiguous run of
  ``kv_segment_ids`` (packed documents; query ids may be in any order), so
  the keys a row sees are one interval ``[first key with its id, last + 1)``,
  found by a stable sort and binary search (no (T, S) array).  A row whose id
  occurs in several runs of ``kv_segment_ids`` cannot be served by one
  interval: its output, m, l and log-sum-exp are NaN (never a silently wrong
  value), and so are the gradients it reaches.  The kernel writes the NaN
  itself (``Problem.poisons_rows``): such a row's range starts at
  ``kernel.common.POISONED_START`` (-1; every served start is at least 0
  there, the segment's start being in their maximum), so it visits keys
  from 0 and its epilogue selects NaN.  ``segment_layout="any"`` takes any
  ids: it builds the dense (B, 1, T, S) equality mask and passes it with the
  user's mask (one global-memory read per logit), and still passes the
  interval hull of each row's keys as its key range, so blocks outside it
  are skipped.
  :func:`segments_are_contiguous` says, per batch row, whether the
  contiguous layout holds.

All sources are combined with the user's ``k_start``/``k_end`` by the max of
the starts and the min of the ends.  Without any of these arguments the
call's arrays are passed on untouched.

``return_residual`` (jax.nn's) returns the natural-log log-sum-exp
``m + log(l)``, float32, in jax.nn's shape (B, T, N), -inf on fully masked
rows (jax.nn's XLA path returns a large finite negative there), not
differentiated (jax.nn stops its gradient too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from kernel.common import POISONED_START
from kernel.call import AttentionShapes, Call
from kernel.masks import Mask


@dataclasses.dataclass(frozen=True)
class Routed:
  """What the kernel runs for a call: its mask and key ranges, whether it
  must return residuals, and how to shape the results as asked."""

  mask: Any
  k_start: Any
  k_end: Any
  kernel_residuals: bool        # the kernel must return (m, l)
  return_residuals: bool        # this API's (m, l)
  return_residual: bool         # jax.nn's log-sum-exp
  poisoned: Any = None          # (B, T) bool: rows the kernel writes NaN (contiguous layout)
  window: tuple[int, int] | None = None  # (left, right), static: the schedule weighs tiles by it
  chunk: int | None = None      # attention_chunk, static, weighed as the window is
  static_ranges: bool = False   # the key ranges are the window's or chunk's alone (NumPy)

  def finish(self, out, residuals):
    """``out``; ``(out, lse)``; ``(out, (m, l))``; or ``(out, lse, (m, l))``
    when both residual flags are set."""
    if not self.kernel_residuals:
      return out
    m, l = residuals
    if not self.return_residual:
      return out, (m, l)
    lse = lax.stop_gradient(jnp.transpose(m + jnp.log(l), (0, 2, 1)))
    return (out, lse, (m, l)) if self.return_residuals else (out, lse)


def _rows(x) -> jax.Array:
  return lax.broadcast_to_rank(jnp.asarray(x), 3)


# jnp.searchsorted's default ("scan") is a loop XLA runs one launch per
# step, which at long sequences took longer than the kernel's forward;
# unrolled, the steps fuse (docs/decisions/searchsorted-unrolled.md).
SEARCH = "scan_unrolled"


# How segment_bounds finds each row's keys: "searched" (a stable sort of the
# key ids and two binary searches, any ids) or "runs" (where the queries'
# ids equal the keys' (self-attention over packed documents) and a cheap
# test shows every id is one run: without a sort, each row's run of equal
# ids; else searched, chosen on the device by a lax.cond).  The API keeps
# "searched", which takes any ids without a branch: "runs" saved nothing
# worth the branch (XLA's cumulative max and min are windowed reductions),
# and the sort is not made cheaper by its key type
# (docs/decisions/segment-bounds-searched.md; kernel/experiments.py times
# both).
SEGMENT_BOUNDS = ("searched", "runs")
SHIPPED_SEGMENT_BOUNDS = "searched"


def segment_bounds(q_segment_ids, kv_segment_ids, method: str = SHIPPED_SEGMENT_BOUNDS):
  """Per query row, (start, end, single_run), each (B, T): the first key
  with the row's id and one past the last (0, 0 where no key has it), and
  whether those keys form one run (then [start, end) is exactly them).
  ``method``: one of :data:`SEGMENT_BOUNDS`; every method gives the same
  arrays."""
  if method not in SEGMENT_BOUNDS:
    raise ValueError(f"segment_bounds: expected one of {SEGMENT_BOUNDS}, got {method!r}")
  q, kv = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
  if method == "runs" and q.shape == kv.shape:
    # One branch runs: the sort-free one where every row is its own key
    # and every id one run, else the search.
    own = jnp.all(q == kv) & runs_are_ids(kv)
    return lax.cond(own, run_bounds, searched_bounds, q, kv)
  return searched_bounds(q, kv)


def run_bounds(q_segment_ids, kv_segment_ids):
  """:func:`segment_bounds` where every query row's id is its key's (the
  same ids for both, each id one run): the run of equal ids around each
  position, from a running max of run starts and a reversed running min of
  run ends."""
  del q_segment_ids   # equal to the keys' ids
  ids = jnp.asarray(kv_segment_ids)
  b, s = ids.shape
  pos = lax.broadcasted_iota(jnp.int32, (b, s), 1)
  change = ids[:, 1:] != ids[:, :-1]
  edge = jnp.ones((b, 1), bool)
  starts = jnp.concatenate([edge, change], axis=1)
  ends = jnp.concatenate([change, edge], axis=1)
  start = lax.cummax(jnp.where(starts, pos, 0), axis=1)
  end = lax.cummin(jnp.where(ends, pos + 1, s), axis=1, reverse=True)
  return start, end, jnp.ones((b, s), bool)


def runs_are_ids(kv_segment_ids) -> jax.Array:
  """() bool, sufficient (not necessary) for every id of every batch row to
  be one run: the ids never fall, except that the last run (padding, often
  0 or -1) may hold any id none before it has.  Costs two passes over the
  ids, no sort."""
  ids = jnp.asarray(kv_segment_ids)
  b, s = ids.shape
  pos = lax.broadcasted_iota(jnp.int32, (b, s), 1)
  change = jnp.concatenate([jnp.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  last_start = jnp.max(jnp.where(change, pos, 0), axis=1, keepdims=True)
  before = pos < last_start
  rising = jnp.where(before[:, 1:], ids[:, 1:] >= ids[:, :-1], True)
  alone = jnp.where(before, ids != ids[:, -1:], True)
  return jnp.all(rising) & jnp.all(alone)


def searched_bounds(q_segment_ids, kv_segment_ids):
  """:func:`segment_bounds` for any ids: a stable sort of the keys' ids and
  two binary searches per row."""
  dt = jnp.result_type(q_segment_ids, kv_segment_ids)
  s = kv_segment_ids.shape[-1]

  def one(q, kv):
    order = jnp.argsort(kv, stable=True)  # equal ids keep position order
    ids = kv[order]
    lo = jnp.searchsorted(ids, q, side="left", method=SEARCH)
    hi = jnp.searchsorted(ids, q, side="right", method=SEARCH)
    found = hi > lo
    first = order[jnp.clip(lo, 0, s - 1)]
    last = order[jnp.clip(hi - 1, 0, s - 1)]
    start = jnp.where(found, first, 0).astype(jnp.int32)
    end = jnp.where(found, last + 1, 0).astype(jnp.int32)
    return start, end, (end - start) == (hi - lo).astype(jnp.int32)

  return jax.vmap(one)(jnp.asarray(q_segment_ids).astype(dt),
                       jnp.asarray(kv_segment_ids).astype(dt))


def segments_are_contiguous(kv_segment_ids) -> jax.Array:
  """(B,) bool: each id of the batch row occupies one contiguous run of
  ``kv_segment_ids`` (the ``segment_layout="contiguous"`` assumption)."""
  kv = jnp.asarray(kv_segment_ids)
  runs = 1 + jnp.sum(kv[:, 1:] != kv[:, :-1], axis=1)
  ids = jnp.sort(kv, axis=1)
  distinct = 1 + jnp.sum(ids[:, 1:] != ids[:, :-1], axis=1)
  return runs == distinct


def row_ranges(shapes: AttentionShapes, *, query_seq_lengths=None,
               key_value_seq_lengths=None, window: tuple[int, int] | None = None,
               chunk: int | None = None, q_segment_ids=None, kv_segment_ids=None,
               segment_bounds_method=SHIPPED_SEGMENT_BOUNDS):
  """(start, end, single_run) of the new range sources alone: int32 arrays
  broadcastable to (B, 1, T) (None where no source bounds that side), and
  (B, T) bool or None for the segment rows served by one interval.

  The window's and the chunk's ranges are NumPy arrays, computed here at
  trace time, and so are start and end when they are their only sources: XLA folds what
  is computed from constants (the per-tile tables of kernel.padding) into
  the executable, where the same arithmetic on an iota ran as kernels of
  its own before every call."""
  T, S = shapes.T, shapes.S
  starts, ends, single_run = [], [], None
  i = np.arange(T, dtype=np.int32)[None, None, :]
  if window is not None:
    start, end = Mask(seq_q=T, seq_kv=S, window=window).window_range(i)
    starts.append(start)
    ends.append(end)
  if chunk is not None:  # docs/decisions/chunked-attention-as-key-ranges.md
    start, end = Mask(seq_q=T, seq_kv=S, chunk=chunk).chunk_range(i)
    starts.append(start)
    ends.append(end)
  if key_value_seq_lengths is not None:
    kv_len = jnp.clip(jnp.asarray(key_value_seq_lengths), -1, S).astype(jnp.int32)
    ends.append(kv_len[:, None, None])
  if q_segment_ids is not None:
    seg_start, seg_end, single_run = segment_bounds(q_segment_ids, kv_segment_ids,
                                                    segment_bounds_method)
    starts.append(seg_start[:, None, :])
    ends.append(seg_end[:, None, :])
  start = None if not starts else _reduce(jnp.maximum, starts)
  end = None if not ends else _reduce(jnp.minimum, ends)
  if query_seq_lengths is not None:
    q_len = jnp.clip(jnp.asarray(query_seq_lengths), 0, T).astype(jnp.int32)
    end = jnp.where(i < q_len[:, None, None], S if end is None else end, 0)
  return start, end, single_run


def _reduce(op, xs):
  """op (jnp.maximum or jnp.minimum) over xs; NumPy's where every x is a
  NumPy array, so that constants stay constants."""
  if all(isinstance(x, np.ndarray) for x in xs):
    op = getattr(np, op.__name__)
  out = xs[0]
  for x in xs[1:]:
    out = op(out, x)
  return out


def whole_keys(seq_q: int, seq_kv: int):
  """(k_start, k_end) that give every row all ``seq_kv`` keys, as (1, 1,
  seq_q) int32: one range per query row, the shape the proof traces
  (kernel.variant.Variant.ranges_always).  NumPy, as a window's are: known
  when tracing, so their tiles' bounds are too."""
  return (np.zeros((1, 1, seq_q), np.int32), np.full((1, 1, seq_q), seq_kv, np.int32))


def route(call: Call, segment_bounds_method: str | None = None) -> Routed:
  """The kernel's mask and key ranges for ``call``'s jax.nn and segment
  arguments (see the module docstring).
  ``segment_bounds_method``: one of :data:`SEGMENT_BOUNDS` (None: the
  shipped one; kernel.variant.Variant.segment_bounds)."""
  segment_bounds_method = segment_bounds_method or SHIPPED_SEGMENT_BOUNDS
  mask, k_start, k_end = call.mask, call.k_start, call.k_end
  query_seq_lengths, key_value_seq_lengths = call.query_seq_lengths, call.key_value_seq_lengths
  q_segment_ids, kv_segment_ids = call.q_segment_ids, call.kv_segment_ids
  shapes, window, segment_layout = call.shapes, call.window, call.segment_layout
  chunk = call.attention_chunk
  routed = Routed(mask, k_start, k_end, bool(call.return_residuals or call.return_residual),
                  bool(call.return_residuals), bool(call.return_residual))
  if (query_seq_lengths is None and key_value_seq_lengths is None and window is None
      and chunk is None and q_segment_ids is None):
    return routed
  start, end, single_run = row_ranges(
      shapes, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, window=window, chunk=chunk,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      segment_bounds_method=segment_bounds_method)
  poisoned = None
  if q_segment_ids is not None:
    if segment_layout == "any":
      same = (jnp.asarray(q_segment_ids)[:, None, :, None]
              == jnp.asarray(kv_segment_ids)[:, None, None, :])
      mask = same if mask is None else jnp.logical_and(jnp.asarray(mask), same)
    else:
      poisoned = ~single_run
  if start is not None:
    k_start = start if k_start is None else jnp.maximum(_rows(k_start).astype(jnp.int32), start)
  if poisoned is not None:
    # POISONED_START marks the row for the kernel's epilogue.  The segment
    # start (>= 0) is in the maximum above, so no served row starts below 0.
    k_start = jnp.where(poisoned[:, None, :], POISONED_START, k_start)
  if end is not None:
    k_end = end if k_end is None else jnp.minimum(_rows(k_end).astype(jnp.int32), end)
  static_ranges = ((window is not None or chunk is not None)
                   and routed.k_start is None and routed.k_end is None
                   and query_seq_lengths is None and key_value_seq_lengths is None
                   and q_segment_ids is None)
  return dataclasses.replace(routed, mask=mask, k_start=k_start, k_end=k_end,
                             poisoned=poisoned, window=window, chunk=chunk,
                             static_ranges=static_ranges)
