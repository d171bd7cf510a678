"""The backward's q, k, v and dO under untiled copies
(kernel.tiling.backward_plan.part_rows): each buffer in column parts of one
swizzle atom, read as a tuple of its parts' refs, and the products and
stores over them (docs/decisions/backward-untiled-copies.md).  The
kernels keep their whole-row operations where they were, beside a branch
to these, so that the shipped kernels trace as before."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from kernel.common import WGMMA


@dataclasses.dataclass(frozen=True)
class Parts:
  """Rows of q, k, v or dO in column parts: ``ref`` (parts, rows, columns),
  its parts ``first`` .. ``first + count - 1`` (``first`` may be traced: a
  warpgroup's half of the head split's row), rows ``rows`` of each (None:
  all).  The parts' refs are made where a product reads them
  (:meth:`refs`), inside the body of its run_state: a ref indexed by a
  Python constant outside it reaches the lowering as a constant, which
  Mosaic GPU refuses ("Shaped arrays must be represented by ir.Values")."""

  ref: Any
  first: Any = 0
  count: int | None = None
  rows: Any = None

  def refs(self) -> tuple:
    count = self.ref.shape[0] if self.count is None else self.count
    out = tuple(self.ref.at[self.first + p] for p in range(count))
    return out if self.rows is None else tuple(r.at[self.rows] for r in out)

  def at_rows(self, rows) -> "Parts":
    return dataclasses.replace(self, rows=rows)


def of(ref, untiled: bool):
  """``ref`` (rows, width), or under untiled copies ``ref`` (parts, rows,
  columns) as :class:`Parts`."""
  return Parts(ref) if untiled else ref


def span(ref, first, count: int) -> Parts:
  """Parts ``first`` .. ``first + count - 1`` of ``ref`` (parts, rows,
  columns), ``first`` traced: a warpgroup's half of the head split's row."""
  return Parts(ref, first, count)


def rows_at(op, rows):
  """Rows ``rows`` of a whole operand or of each of its parts."""
  return op.at_rows(rows) if isinstance(op, Parts) else op.at[rows]


def each(fn, acc):
  """``fn`` of an accumulator, or of each of its parts (a tuple)."""
  return tuple(map(fn, acc)) if isinstance(acc, tuple) else fn(acc)


def issue_abt(acc_ref, a: Parts, b: Parts):
  """acc += A B^T over rows in parts: one wgmma per part, the
  instructions one wgmma over the whole row issues."""
  for a_part, b_part in zip(a.refs(), b.refs(), strict=True):
    plgpu.wgmma(acc_ref, a_part, b_part.T)


def issue_ab(acc_refs, a, b: Parts):
  """acc += A B, B's rows in parts: one accumulator per part."""
  for ref, b_part in zip(acc_refs, b.refs(), strict=True):
    plgpu.wgmma(ref, a, b_part)


def zeros(rows: int, width: int, columns: int | None = None):
  """A zeroed f32 accumulator of ``rows`` x ``width``: whole, or one per
  part of ``columns`` (untiled copies)."""
  zero = lambda cols: plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), WGMMA)
  if columns is None:
    return zero(width)
  return tuple(zero(columns) for _ in range(width // columns))


def columns(buf, untiled: bool):
  """The columns of one part of ``buf`` (its last dim) under untiled
  copies; None without them."""
  return buf.shape[-1] if untiled else None


def store(ref, value):
  """Each part of ``value`` into its part of ``ref``, :class:`Parts` or a
  ref (parts, rows, columns)."""
  refs = ref.refs() if isinstance(ref, Parts) else Parts(ref).refs()
  for part_ref, part in zip(refs, value, strict=True):
    part_ref[...] = part


def store_columns(ref, value):
  """Each part of ``value`` into its columns of ``ref`` (rows, width): a
  row's parts side by side (the fused dQ's f32 staging)."""
  for p, part in enumerate(value):
    cols = part.shape[1]
    ref.at[:, pl.ds(p * cols, cols)][...] = part
