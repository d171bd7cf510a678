"""The symbolic dimensions a trace of the proof takes: the queries' and the
keys' lengths and the grid's counts (batches, key/value heads, the group of
query heads), each a ``jax.export`` symbol within its bounds, read by
:func:`harness.proofs.symbolic.dim_term` as a variable; and, while such a
trace runs, divisions of a length made exact where the bounds decide them
(:func:`exact_divisions`), and every equality the kernel asks of a length
decided for every length (:func:`decided_lengths`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys

import numpy as np

from harness.proofs.events import ExtractionError

# The counts of every symbolic trace's grid (the forward's and the
# backward's), symbolic dimensions from these lower bounds (grid_counts):
# batches, key/value heads, and the group of query heads over each, so
# that a grid index read as a variable (symbolic.grid_index) takes every
# place in a group of every size.  The probes' traces have one of each
# (their events at every other grid point are held to the same tables).
# A count of 1 is left out for batches and key/value heads only:
# kernel/common.py's batch_head reads a dim of 1 at index 0, its only
# index, so the trace at 2 and more stands for it (docs/proof.md, "What is
# assumed").
GRID_COUNTS = {"batches": 2, "kv_heads": 2, "group": 1}


# The persistent grid's size, its blocks (min(SMs, tiles), or the split
# tail's table's rows), a symbolic dimension from 1 like the counts: the
# walk's stride (plgpu.nd_loop) and lax.axis_size("sm") are then terms of
# it (symbolic_axis_sizes), so no defect keyed on the grid's size hides
# behind the probes' PROBE_SMS.
PERSISTENT_GRID = {"sms": 1}


def grid_counts(symbols: dict) -> dict:
  """forward_traces.trace_forward's batch, heads and kv_heads: the symbols of
  :data:`GRID_COUNTS` where traced, else :data:`GQA_GRID`'s."""
  if "group" not in symbols:
    return GQA_GRID
  return {"batch": symbols["batches"], "kv_heads": symbols["kv_heads"],
          "heads": symbols["kv_heads"] * symbols["group"]}


# Counts where the host needs integers while the trace's are symbolic (the
# split tail's entry table, built at these and read as global-memory
# indices), and the trace's own where GRID_COUNTS is emptied (a test).
GQA_GRID = {"batch": 2, "heads": 8, "kv_heads": 2}


def dimensions(dims: dict, at_least: tuple = ()) -> tuple[dict, dict]:
  """(values, bounds): per name of ``dims`` (its lower bound, or (lower,
  upper)) a length of jax.export's symbolic dimensions taking every value
  within them, and the bounds of the dimension variables it is made of,
  for :func:`harness.proofs.symbolic.dim_term`.  JAX takes every dimension
  variable to be at least 1, so a length from ``lo`` is the variable plus
  ``lo - 1``: one that may be 0 (no whole key block of a one-stage ring,
  no row short of a whole tile) is traced as such.  ``at_least``: pairs
  (names whose lengths' product, name) of lengths the first is at least
  the second (a persistent grid's tiles and its blocks), a constraint of
  every length the trace stands for."""
  from jax import export
  names = sorted(dims)
  if not names:
    return {}, {}
  bounds = {n: dims[n] if isinstance(dims[n], tuple) else (dims[n], None) for n in names}
  constraints = tuple(f"{n} <= {hi - lo + 1}" for n, (lo, hi) in bounds.items()
                      if hi is not None)
  constraints += tuple(f"{_expanded(product, bounds)} >= {_expanded((least,), bounds)}"
                       for product, least in at_least)
  variables = export.symbolic_shape(", ".join(names), constraints=constraints)
  values = {n: v + (bounds[n][0] - 1) for n, v in zip(names, variables)}
  _OFFSETS.update({n: bounds[n][0] - 1 for n in names})
  return values, {n: 1 if hi is None else (1, hi - lo + 1) for n, (lo, hi) in bounds.items()}


# Each dimension's length less its variable, as the latest trace made it
# (a name keeps its lower bound: GRID_COUNTS, PERSISTENT_GRID, the
# windows'), for a counterexample's words.
_OFFSETS: dict = {}


def length(name: str, variable: int) -> int:
  """The length of dimension ``name`` whose variable is ``variable``."""
  return variable + _OFFSETS.get(name, 0)


def _expanded(names, bounds) -> str:
  """The product of the lengths ``names`` (each its variable plus its lower
  bound less 1) as a sum of monomials of the variables, the form JAX's
  constraints parse."""
  monomials = []
  for chosen in itertools.product((False, True), repeat=len(names)):
    coeff = math.prod(bounds[n][0] - 1 for n, c in zip(names, chosen) if not c)
    if coeff:
      monomials.append("*".join([str(coeff)] + [n for n, c in zip(names, chosen) if c]))
  return " + ".join(monomials)


@contextlib.contextmanager
def exact_divisions():
  """While a kernel is traced with symbolic lengths: a floor division or
  remainder of a length by a constant d is exact wherever the symbols'
  bounds decide it.  JAX divides the terms d divides and leaves the rest
  as floordiv(...) and mod(...), which no comparison decides and no term
  of the proof reads; but the rest's bounds (a ragged remainder r in
  [1, d - 1]) often fix its quotient, and then ``(d*m + r) // d`` is
  ``m`` and ``(d*m + r) % d`` is ``r``, for every length the symbols
  stand for.  Where they do not, JAX's answer stands."""
  from jax._src.export import shape_poly
  cls = shape_poly._DimExpr
  original = cls._divmod

  def divmod_(self, divisor):
    quotient, remainder = original(self, divisor)
    if not (shape_poly.is_symbolic_dim(quotient) or shape_poly.is_symbolic_dim(remainder)) \
            or shape_poly.is_symbolic_dim(divisor) or int(divisor) <= 0:
      return quotient, remainder
    d = int(divisor)
    whole, rest = 0, 0   # self = d * whole + rest
    for term, count in self._sorted_terms:
      if term.is_constant:
        rest += count
      elif count % d == 0:
        whole += cls._from_term(term, count // d, self.scope)
      else:
        rest += cls._from_term(term, count, self.scope)
    if not shape_poly.is_symbolic_dim(rest):
      return quotient, remainder
    lo, hi = shape_poly._bounds_decision(rest, shape_poly.BoundsPrecision.BEST)
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo // d != hi // d:
      return quotient, remainder
    return whole + int(lo // d), rest - d * int(lo // d)

  cls._divmod = divmod_
  try:
    yield
  finally:
    cls._divmod = original


@contextlib.contextmanager
def symbolic_axis_sizes(sizes: dict):
  """While a kernel is traced on a grid of symbolic size: ``lax.axis_size``
  of each axis of ``sizes`` (a persistent grid's ``sm``) is that size, as
  on the GPU it is the launch's, where JAX asks the traced grid for an
  integer; a walk's stride (plgpu.nd_loop) or the kernel's own question
  is then a term of it."""
  from jax._src.lax import parallel
  original = parallel._axis_size

  def axis_size(axis_name, *groups):
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not groups and names and all(n in sizes for n in names):
      return math.prod(sizes[n] for n in names)
    return original(axis_name, *groups)

  parallel._axis_size = axis_size
  try:
    yield
  finally:
    parallel._axis_size = original


@contextlib.contextmanager
def decided_lengths(what: str):
  """While a kernel is traced with symbolic lengths: every ``==`` or
  ``!=`` the kernel's own Python code asks of them must hold, or fail,
  for every length the symbols stand for.  JAX answers an equality it
  cannot decide False (its documented shape_poly convention), which
  would trace one branch for all lengths; the trace then fails, naming
  the kernel's line.  Comparisons JAX makes itself (broadcasting's
  ``d == 1``) follow that convention and are not the kernel's branches."""
  import traceback
  from jax._src.export import shape_poly
  import kernel
  kernel_dir = os.path.dirname(os.path.abspath(kernel.__file__)) + os.sep
  line = lambda path, n: f"{os.path.relpath(path, os.path.dirname(kernel_dir[:-1]))}:{n}"
  cls, original = shape_poly._DimExpr, shape_poly._DimExpr.__eq__
  undecided: list = []

  def eq(self, other):
    answer = original(self, other)
    if answer or not (isinstance(other, cls) and self.scope is other.scope
                      or shape_poly.core.is_constant_dim(other)):
      return answer   # decided, or not a length
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == shape_poly.__file__:
      frame = frame.f_back   # __ne__, reflected comparisons
    if frame is None or not os.path.abspath(frame.f_code.co_filename).startswith(kernel_dir):
      return answer
    diff = self - other
    if shape_poly.is_symbolic_dim(diff):
      lo, hi = shape_poly._bounds_decision(diff, shape_poly.BoundsPrecision.BEST)
      if lo <= 0 <= hi:
        undecided.append(f"{line(frame.f_code.co_filename, frame.f_lineno)}: {self} == {other}")
    return answer

  cls.__eq__ = eq
  try:
    yield
  except shape_poly.InconclusiveDimensionOperation as err:
    # JAX refuses an undecided order (<, >=, ...) itself: named the same way
    lines = [line(t.filename, t.lineno) for t in traceback.extract_tb(err.__traceback__)
             if os.path.abspath(t.filename).startswith(kernel_dir)]
    undecided.append(f"{lines[-1] if lines else 'JAX'}: {str(err).splitlines()[0]}")
  finally:
    cls.__eq__ = original
  if undecided:
    raise ExtractionError(
        f"{what}: the kernel compares its symbolic lengths where the answer depends on the "
        f"length, so one trace cannot stand for every length: {undecided[0]}"
        + (f" (and {len(undecided) - 1} more)" if len(undecided) > 1 else ""))
