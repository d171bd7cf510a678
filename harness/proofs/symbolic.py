"""The traced kernel run once more, with its integers as terms.

:mod:`harness.proofs.extract` runs each role's jaxpr under one environment
at a time (a probe): loop counters, ``prev_iters`` and the key ranges are
Python integers.  Here they are terms (:mod:`harness.proofs.terms`): every
integer read from global memory is an uninterpreted function of its
indices, every grid index a variable from 0 up (:func:`grid_index`),
and every ``while`` loop whose body synchronises is run once, for a
symbolic iteration, instead of unrolled:

* its condition must read ``counter < bound`` for one loop-carried integer
  that the body advances by 1 (``fori_loop``, ``pl.loop``, ``nd_loop``);
* every other loop-carried integer is classified from what one iteration
  does to it: left alone (an invariant, its value on entry), advanced by a
  constant (a second counter, a linear function of the first), or
  advanced by a term (an accumulator, such as ``prev_iters``: a variable of
  its own, its increment recorded for :mod:`harness.proofs.premise` to
  identify as the ring position);
* the events of the iteration are recorded once, as functions of the
  counter (:class:`Loop`).

A ``cond`` on a symbolic predicate runs every branch, each event guarded by
its path condition (:class:`Ev`), and merges the branches' integer results
into conditional terms.  So one run gives each role's protocol as a tree
of guarded events and loops whose slots, parities, predicates, bounds and
targets are terms; :func:`units` cuts it into the units of
:mod:`harness.proofs.role_programs`.

Nothing is assumed silently: a primitive the extractor does not know is
refused (:class:`harness.proofs.events.UnknownPrimitive`), and an integer
that linear arithmetic cannot express (a product of two loop-dependent
values, a division by one) is opaque; where the protocol depends on an
opaque value (a slot, a guard, a loop bound, a named barrier id) the run
fails, naming the primitive and its source line.  One exception widens
instead: a division or remainder by a symbolic dimension of a plain trace
(:func:`dim_term`: a tile count), or a product with one, is an
uninterpreted function of its operands, any value, equal for equal
operands, as a read from memory is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend import core as jex_core

from harness.proofs import extract as ex
from harness.proofs import jaxprs, kernel_lines
from harness.proofs import term_walks as tw
from harness.proofs import terms as tm
from harness.proofs.events import OPAQUE, Buffer, Event, ExtractionError, Opaque, RefV

_INT = (int, bool)
_SYM = (tm.Lin, tm.Bool)
_TERM = (int, bool, tm.Lin, tm.Bool)


class Unexpressed(Opaque):
  """An integer the terms cannot express: the primitive and line that made it."""

  __slots__ = ("why",)

  def __init__(self, why: str):
    self.why = why

  def __repr__(self):
    return f"?({self.why})"


@dataclasses.dataclass(frozen=True)
class Ev:
  guard: object          # a Bool term or True
  event: Event        # its slot fields may be terms


@dataclasses.dataclass
class Loop:
  """A while loop run for one symbolic iteration: ``counter`` takes every
  value in [lo, hi); ``accumulators``: (variable, value on entry, increment
  per iteration, variable of the value on exit)."""

  guard: object
  src: str = dataclasses.field(compare=False)  # as an event's: a label, not what it does
  counter: str
  lo: object
  hi: object
  body: list
  accumulators: tuple = ()


def _item_words(item) -> str:
  """An item as a failure names it: its source line and what it does."""
  if isinstance(item, Ev):
    return f"{item.event.src} {item.event.describe()}"
  return f"{item.src} a loop"


@dataclasses.dataclass
class SymLaunch:
  """One kernel launch read symbolically: each role's tree of items."""

  roles: dict            # role -> [Ev | Loop]
  threads: dict
  # grid axis -> (its index's term, its size), for a counterexample's words
  grid: dict = dataclasses.field(default_factory=dict)
  # symbolic dimension -> its term (dim_term), for a counterexample's words
  counts: dict = dataclasses.field(default_factory=dict)


def _need(value, what: str, src: str):
  """``value`` as a term, or a loud failure naming why it is none."""
  if type(value) in _TERM:
    return value
  if isinstance(value, Unexpressed):
    raise ExtractionError(f"{src}: {what} depends on {value.why}, which linear "
                          f"integer arithmetic cannot express")
  raise ExtractionError(f"{src}: {what} depends on a value the extractor cannot evaluate "
                        f"(data, not an integer of the protocol)")


def _int_aval(aval) -> bool:
  return jaxprs.int_scalar(aval)


def _items_events(items):
  for it in items:
    if isinstance(it, Ev):
      yield it
    else:
      yield from _items_events(it.body)


def _by_dimension(x) -> bool:
  """Whether the term ``x`` reads a symbolic dimension (:func:`dim_term`)."""
  return any(a.op == "var" and a.args[0].startswith("dim.") for a in tw.atoms_of(x))


class _Linear:
  """A term standing in for a symbol while jax.export evaluates a symbolic
  dimension: sums and integer multiples stay terms, anything else (a
  product of symbols, a division, a max) is refused."""

  __slots__ = ("term",)

  def __init__(self, term):
    self.term = term

  def __add__(self, other):
    other = other.term if isinstance(other, _Linear) else _dim_int(other)
    return _Linear(tm.add(self.term, other))

  __radd__ = __add__

  def __mul__(self, other):
    if isinstance(other, _Linear):
      raise _NotLinear
    return _Linear(tm.mul(self.term, _dim_int(other)))

  __rmul__ = __mul__

  def __getattr__(self, name):
    raise _NotLinear


class _NotLinear(Exception):
  pass


def _dim_int(x) -> int:
  import operator
  try:
    return operator.index(x)
  except TypeError:
    raise _NotLinear from None


def dim_term(dim, bounds: dict, src: str = ""):
  """A symbolic dimension of the trace (jax.export's: the lengths of a
  plain call, :func:`harness.proofs.forward_traces.trace_plain`) as a
  term: symbol s of bound ``lo`` is ``lo + max(0, v_s)``, every value from
  the lower bound the trace was made under up; of bounds ``(lo, hi)``
  (a ragged remainder) ``min(lo + max(0, v_s), hi)``, every value between
  them.  A linear expression of the symbols is a term; a sum of their
  products (of grid counts, such as a persistent walk's batch * heads *
  tiles) is a variable of its own, named by the expression, every value
  from 1 up: wider than the product, so what holds for it holds for the
  product; anything else (a division, a max) is refused."""
  if isinstance(dim, int):
    return dim
  names = sorted(dim._get_vars())
  missing = [v for v in names if v not in bounds]
  if missing:
    raise ExtractionError(f"{src}: symbolic dimension {dim} has no lower bound for "
                          f"{missing[0]}")
  env = {v: _Linear(_bounded(tm.var("dim." + v), bounds[v])) for v in names}
  try:
    out = dim._evaluate(env)
  except _NotLinear:
    if not _counts_product(dim, bounds):
      raise ExtractionError(f"{src}: symbolic dimension {dim} is not linear in its "
                            f"symbols") from None
    return _bounded(tm.var(f"dim.({dim})"), 1)
  return out.term if isinstance(out, _Linear) else _dim_int(out)


def _counts_product(dim, bounds: dict) -> bool:
  """Whether ``dim`` is a sum of products of symbols, each at least 1 by
  ``bounds``, with positive coefficients and a constant >= 0: at least 1."""
  least = lambda v: bounds[v][0] if isinstance(bounds[v], tuple) else bounds[v]
  terms = dim._sorted_terms
  return all(count > 0 and all(f.var is not None and least(f.var) >= 1 for f, _ in term._factors)
             for term, count in terms if not term.is_constant) \
      and all(count >= 0 for term, count in terms if term.is_constant)


def _by_a_dimension(name: str, a, b):
  """``a`` times, or divided toward zero by (div, rem), ``b``, a term that
  reads a symbolic dimension (at least 1): exact, Z3 deciding the product
  (:func:`harness.proofs.terms.mul_by`, :func:`harness.proofs.terms.div_by`)."""
  return {"mul": tm.mul_by, "div": tm.div_by, "rem": tm.rem_by}[name](a, b)


def _bounded(v, bound):
  lo, hi = bound if isinstance(bound, tuple) else (bound, None)
  term = tm.add(lo, tm.pos(v))
  return term if hi is None else tm.min_(term, hi)


class _SymInterp(ex._Interp):
  """The extractor's interpreter over terms (module docstring)."""

  def __init__(self, kernel_eqn, axes: dict, dims: dict | None = None):
    super().__init__(kernel_eqn, env=None, axes=axes)
    self.dims = dims or {}   # symbolic dimension -> its bounds (dim_term)
    self.guard = True
    self.items: list = []
    self.role_items: dict = {}
    self.loop_no = 0

  def _emit(self, ev: Event):
    self.items.append(Ev(self.guard, ev))

  # -- values ---------------------------------------------------------------------
  def run(self, jaxpr, args, consts=()):
    prog, env = self.bound(jaxpr, args, consts)
    get = env.get
    for eqn, name, keys in prog.eqns:
      ins = [get(k, OPAQUE) for k in keys]
      op = jaxprs.INT_OPS.get(name)
      if op is not None and len(ins) == 2:
        a, b = ins
        ta, tb = type(a), type(b)
        if ta in _INT and tb in _INT:
          env[eqn.outvars[0]] = op(a, b)
          continue
        if ta in _TERM and tb in _TERM:
          env[eqn.outvars[0]] = self._binary(name, a, b, eqn, prog)
          continue
      outs = self.eqn_(eqn, name, ins, prog)
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [get(v, OPAQUE) if not isinstance(v, jex_core.Literal)
            else jaxprs.literal_value(v.val) for v in jaxpr.outvars]

  def _src(self, eqn, prog):
    src = prog.frames.get(id(eqn))
    return src or kernel_lines.kernel_frame(eqn.source_info, self.site)

  def _unexpressed(self, name, eqn, prog):
    return Unexpressed(f"primitive {name!r} at {self._src(eqn, prog)}")

  def _binary(self, name, a, b, eqn, prog):
    if name in ("and", "or"):
      if tm.is_bool(a) and tm.is_bool(b):
        return tm.and_(a, b) if name == "and" else tm.or_(a, b)
      return self._unexpressed(name, eqn, prog)   # bitwise, on integers
    if tm.is_bool(a) or tm.is_bool(b):
      if name in ("eq", "ne"):
        return tm.eq(a, b) if name == "eq" else tm.ne(a, b)
      a, b = tm.to_int(a), tm.to_int(b)
    if name == "add":
      return tm.add(a, b)
    if name == "sub":
      return tm.sub(a, b)
    if name == "max":
      return tm.max_(a, b)
    if name == "min":
      return tm.min_(a, b)
    if name in ("mul", "div", "rem"):
      out = {"mul": tm.mul, "div": tm.div, "rem": tm.rem}[name](a, b)
      if out is None and tm.is_int(a) and tm.is_int(b) and (
              _by_dimension(b) if name != "mul" else _by_dimension(a) or _by_dimension(b)):
        # by (or times) a symbolic dimension: a tile count of a plain
        # trace, a group of heads
        return _by_a_dimension(name, a, b)
      return self._unexpressed(name, eqn, prog) if out is None else out
    return {"eq": tm.eq, "ne": tm.ne, "lt": tm.lt, "le": tm.le, "gt": tm.gt,
            "ge": tm.ge}[name](a, b)

  def eqn_(self, eqn, name, ins, prog):
    if name == "dim_as_value":
      return [dim_term(eqn.params["dim"], self.dims, self._src(eqn, prog))]
    if name in jaxprs.PURE and any(_int_aval(v.aval) for v in eqn.outvars):
      why = next((x for x in ins if isinstance(x, Unexpressed)), None)
      if why is not None:  # what it was made from cannot be expressed: nor can it
        return [why] * len(eqn.outvars)
    if any(type(x) in _SYM for x in ins):
      if name == "convert_element_type":
        (x,) = ins
        dt = eqn.params["new_dtype"]
        if np.issubdtype(dt, np.integer):
          return [tm.to_int(x) if tm.is_bool(x) else x]
        if dt == np.bool_:
          return [x if tm.is_bool(x) else tm.ne(x, 0)]
        return [OPAQUE]
      if name == "select_n" and all(type(x) in _TERM for x in ins):
        which, *cases = ins
        out = cases[-1]
        for i in range(len(cases) - 2, -1, -1):  # which == i picks cases[i]
          cond = tm.not_(which) if tm.is_bool(which) else tm.eq(which, i)
          out = tm.ite(cond, cases[i], out)
        return [out]
      if name == "not" and tm.is_bool(ins[0]):
        return [tm.not_(ins[0])]
      if name == "neg" and tm.is_int(ins[0]):
        return [tm.neg(ins[0])]
      if name == "clamp" and all(type(x) in _TERM for x in ins):
        lo, x, hi = ins
        return [tm.min_(tm.max_(x, lo), hi)]
      if name in jaxprs.PURE and any(_int_aval(v.aval) for v in eqn.outvars):
        return [self._unexpressed(name, eqn, prog)] * len(eqn.outvars)
    return super().eqn_(eqn, name, ins, prog)

  # -- the environment --------------------------------------------------------------
  def p_axis_index(self, eqn, ins, src):
    axis = eqn.params["axis_name"]
    if axis in self.axes:
      return [self.axes[axis]]
    return [grid_index(axis)]

  def p_get(self, eqn, ins, src):
    ref, *leaves = ins
    if isinstance(ref, RefV) and ref.buf.space == "gmem":
      out = eqn.outvars[0].aval
      if not out.shape and "int" in str(out.dtype):
        if all(type(x) in _TERM for x in leaves):
          return [tm.read(ref.buf.name, tuple(tm.to_int(x) if tm.is_bool(x) else x
                                              for x in leaves))]
        return [Unexpressed(f"a read of {ref.buf.name} at an index from data, at {src}")]
      return [OPAQUE]
    return super().p_get(eqn, ins, src)

  p_load = p_get

  def _ref_and_slot(self, ref, treedef, leaves, src=""):
    if not isinstance(ref, RefV):
      raise ExtractionError(f"{src}: a ref operand the extractor lost track of: {ref!r}")
    if treedef is None:
      return ref.buf, None
    where, view = jaxprs.transform_info(treedef)
    slot = None
    if where is not None and where[0] == "leaf":
      slot = _need(leaves[where[1]], "a shared-memory or barrier slot", src)
      if tm.is_bool(slot):
        slot = tm.to_int(slot)
    elif where is not None and where[0] == "static":
      slot = where[1]
    return (self._view(ref.buf, view) if view is not None else ref.buf), slot

  def p_barrier_arrive(self, eqn, ins, src):
    ref, *rest = ins
    td = eqn.params["transforms_treedef"]
    (parts, pred) = self._split_leaves(rest, td)
    guard = True
    if eqn.params.get("has_user_predicate") and pred:
      guard = _need(pred[0], "a predicated arrive", src)
      if guard is False:
        return []
      guard = guard if tm.is_bool(guard) else tm.ne(guard, 0)
    buf, slot = self._ref_and_slot(ref, td, parts[0][1], src)
    outer = self.guard
    self.guard = tm.and_(outer, guard)
    try:
      self._emit(Event("arrive", self.role, src, buf.name, slot))
    finally:
      self.guard = outer
    return []

  def _barrier_id(self, bid, src):
    bid = _need(bid, "a named barrier's id", src)
    return (tm.to_int(bid) if tm.is_bool(bid) else bid,)

  def p_mpmd_map(self, eqn, ins, src):
    mesh = eqn.params["meshes"][0]
    if type(mesh).__name__ != "WarpMesh":
      raise ExtractionError(f"{src}: nested mpmd_map over {mesh!r} is not modelled")
    (body,) = eqn.params["jaxprs"]
    outer, outer_items = self.role, self.items
    if any(True for _ in _items_events(outer_items)):
      raise ExtractionError(f"{src}: role {outer} synchronises outside its warp_map too")
    for warp in range(4):
      self.role = f"{outer}.warp{warp}"
      self.axes[mesh.axis_name] = warp
      self.items = self.role_items.setdefault(self.role, [])
      self.run(body, ins)
    del self.axes[mesh.axis_name]
    self.role, self.items = outer, outer_items
    return [OPAQUE] * len(eqn.outvars)

  # -- control ------------------------------------------------------------------------
  def p_cond(self, eqn, ins, src):
    index, *ops = ins
    if type(index) in _INT:
      return super().p_cond(eqn, ins, src)
    branches = eqn.params["branches"]
    if type(index) not in _SYM:
      if any(jaxprs.has_sync(b.jaxpr) for b in branches):
        _need(index, "a cond whose branches synchronise", src)
      return self._data_cond(branches, ops, src, len(eqn.outvars))
    guards = _branch_guards(index, len(branches))
    outer_guard, outer_site, cells = self.guard, self.site, dict(self.cells)
    outer_items = self.items
    taken, runs = [], []
    try:
      for g, b in zip(guards, branches):
        if tm.and_(outer_guard, g) is False:
          continue
        # each branch's items relative to its own path; joined below
        self.guard, self.site, self.cells, self.items = True, src, dict(cells), []
        outs = self.run(b.jaxpr, ops, [jaxprs.const(c) for c in b.consts])
        taken.append((g, outs, self.cells))
        runs.append((g, self.items))
    finally:
      self.guard, self.site, self.items = outer_guard, outer_site, outer_items
    self.items.extend(_join(runs, outer_guard))
    self.cells = _merge_cells(taken, cells)
    return [_merge([(g, outs[i]) for g, outs, _ in taken]) for i in range(len(eqn.outvars))]

  def _data_cond(self, branches, ops, src, nout):
    """As the concrete run's (:meth:`harness.proofs.extract._Interp._data_cond`):
    every branch's shared-memory accesses, which must be alike, once."""
    outer_items, outer_site, cells = self.items, self.site, dict(self.cells)
    runs = []
    try:
      for b in branches:
        self.items, self.site, self.cells = [], src, dict(cells)
        self.run(b.jaxpr, ops, [jaxprs.const(c) for c in b.consts])
        runs.append(self.items)
    finally:
      self.items, self.site, self.cells = outer_items, outer_site, cells
    ex.branches_alike(src, runs, _item_words)
    self.items.extend(runs[0])
    return [OPAQUE] * nout

  def p_while(self, eqn, ins, src):
    p = eqn.params
    cc, bc = p["cond_nconsts"], p["body_nconsts"]
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    if jaxprs.has_sync(cj.jaxpr):  # its events would run once per iteration, unmodelled here
      raise ExtractionError(f"{src}: a while loop whose condition synchronises")
    if not jaxprs.has_sync(bj.jaxpr):
      return super().p_while(eqn, ins, src)
    cconsts, bconsts, carry = ins[:cc], ins[cc:cc + bc], ins[cc + bc:]
    cjc, bjc = [jaxprs.const(c) for c in cj.consts], [jaxprs.const(c) for c in bj.consts]
    self.loop_no += 1
    tag = f"L{self.loop_no}"
    avals = [v.aval for v in eqn.invars[cc + bc:]]
    fresh = []
    for i, (aval, val) in enumerate(zip(avals, carry)):
      if _int_aval(aval):
        fresh.append(tm.var(f"{tag}.c{i}"))
      else:
        fresh.append(val if isinstance(val, RefV) else OPAQUE)
    (go,) = self.run(cj.jaxpr, [*cconsts, *fresh], cjc)
    counter, hi = _counter_and_bound(go, fresh, src)
    outer_items, outer_guard = self.items, self.guard
    self.items, self.guard = [], True
    try:
      outs = self.run(bj.jaxpr, [*bconsts, *fresh], bjc)
      body = self.items
    finally:
      self.items, self.guard = outer_items, outer_guard
    k_key = fresh[counter].mono[0][0].key
    lo = _need(carry[counter], f"the start of the loop at {src}", src)
    step = tm.sub(outs[counter], fresh[counter])
    if step != 1:
      raise ExtractionError(f"{src}: a while loop with synchronisation whose counter "
                            f"advances by {step}, not 1")
    # Classify the other integer carries, substituting those with a closed
    # form until nothing changes (one's increment may mention another).
    mapping: dict = {}
    pending = [i for i in range(len(fresh)) if type(fresh[i]) is tm.Lin and i != counter]
    changed = True
    while changed:
      changed = False
      for i in list(pending):
        key = fresh[i].mono[0][0].key
        if type(outs[i]) not in _TERM:
          continue
        d = tw.subst(tm.sub(outs[i], fresh[i]), mapping)
        if type(d) is int and type(carry[i]) in _TERM:
          steps = tm.sub(fresh[counter], lo)
          mapping[key] = tm.add(carry[i], tm.scale(steps, d)) if d else carry[i]
          pending.remove(i)
          changed = True
    body = _subst_items(body, mapping)
    hi = tw.subst(hi, mapping)
    _need(hi, f"the bound of the loop at {src}", src)
    accumulators, results = [], []
    for i in pending:
      name = fresh[i].mono[0][0].args[0]
      init = carry[i] if type(carry[i]) in _TERM else None
      incr = (tw.subst(tm.sub(outs[i], fresh[i]), mapping) if type(outs[i]) in _TERM
              else None)
      accumulators.append((name, init, incr, f"{name}.end"))
    end = tm.max_(lo, hi)
    for i, val in enumerate(fresh):
      if type(val) is not tm.Lin:
        results.append(OPAQUE)
      elif i == counter:
        results.append(end)
      elif i in pending:
        results.append(tm.var(f"{val.mono[0][0].args[0]}.end"))
      else:
        key = val.mono[0][0].key
        results.append(tw.subst(mapping[key], {k_key: end}))
    self.items.append(Loop(self.guard, src, fresh[counter].mono[0][0].args[0], lo, hi, body,
                           tuple(accumulators)))
    return results


def _branch_guards(index, n: int) -> list:
  """The path condition of each of a cond's ``n`` branches (the index is
  clamped into range, as lax.cond does)."""
  if tm.is_bool(index):
    return [tm.not_(index), index][:n] if n == 2 else [tm.eq(index, i) for i in range(n)]
  c, m = tm.lin(index)
  if n == 2 and c == 0 and len(m) == 1:
    (a, k), = m.items()
    if k == 1 and a.op == "ite" and a.args[1:] == (1, 0):  # a bool converted to 0 / 1
      return [tm.not_(a.args[0]), a.args[0]]
  out = []
  for i in range(n):
    if i == 0:
      out.append(tm.le(index, 0))
    elif i == n - 1:
      out.append(tm.ge(index, n - 1))
    else:
      out.append(tm.eq(index, i))
  return out


def _join(runs, outer):
  """The items of a cond's branches ((path condition, items relative to it),
  exactly one of which runs) as one list: what every branch does at its
  start and at its end unguarded (a cond whose branches synchronise alike,
  like the forward's plain and masked first softmax, is no condition on
  the protocol), the rest under its branch's condition."""
  if len(runs) == 1:
    g, items = runs[0]
    return _guarded(items, tm.and_(outer, g))
  lists = [items for _, items in runs]
  head = 0
  while all(len(x) > head for x in lists) and all(x[head] == lists[0][head] for x in lists):
    head += 1
  tail = 0
  while all(len(x) > head + tail for x in lists) and all(
      x[len(x) - 1 - tail] == lists[0][len(lists[0]) - 1 - tail] for x in lists):
    tail += 1
  out = _guarded(lists[0][:head], outer)
  for g, items in runs:
    out += _guarded(items[head:len(items) - tail], tm.and_(outer, g))
  return out + _guarded(lists[0][len(lists[0]) - tail:], outer)


def _guarded(items, guard):
  if guard is True:
    return list(items)
  out = []
  for it in items:
    g = tm.and_(guard, it.guard)
    if g is not False:
      out.append(dataclasses.replace(it, guard=g))
  return out


def _merge(pairs):
  """One value from the branches' (guard, value) pairs."""
  if not pairs:
    return OPAQUE
  first = pairs[0][1]
  if all(v is first or (type(v) in _TERM and type(first) in _TERM and v == first and
                        type(v) is type(first)) for _, v in pairs):
    return first
  if all(type(v) in _TERM for _, v in pairs):
    out = pairs[-1][1]
    for g, v in reversed(pairs[:-1]):
      out = tm.ite(g, v, out)
    return out
  if all(isinstance(v, RefV) and v == first for _, v in pairs):
    return first
  for _, v in pairs:
    if isinstance(v, Unexpressed):
      return v
  return OPAQUE


def _merge_cells(taken, before):
  keys = set(before)
  for _, _, cells in taken:
    keys |= set(cells)
  return {k: _merge([(g, cells.get(k, OPAQUE)) for g, _, cells in taken]) for k in keys}


def _counter_and_bound(go, fresh, src):
  """(index of the counter carry, the bound) of a condition ``counter < bound``."""
  if type(go) is tm.Bool and go.op == "le0":
    c, m = tm.lin(go.args[0])
    names = {f.mono[0][0].key: i for i, f in enumerate(fresh) if type(f) is tm.Lin}
    ups = [names[a.key] for a, k in m.items() if a.key in names and k == 1]
    if len(ups) == 1:
      i = ups[0]
      # counter + rest <= 0  <=>  counter < 1 - rest
      rest = tm.sub(go.args[0], fresh[i])
      return i, tm.sub(1, rest)
  raise ExtractionError(f"{src}: a while loop with synchronisation whose condition is not "
                        f"`counter < bound` over its carry ({go!r})")


def _subst_event(e: Event, mapping, memo) -> Event:
  slot, bar_slot = tw.subst(e.slot, mapping, memo), tw.subst(e.bar_slot, mapping, memo)
  bar_id = tw.subst(e.bar_id, mapping, memo)
  reads = tuple((b, tw.subst(s, mapping, memo)) for b, s in e.reads)
  if slot is e.slot and bar_slot is e.bar_slot and bar_id is e.bar_id and all(
      r[1] is s for r, (_, s) in zip(reads, e.reads)):
    return e
  return dataclasses.replace(e, slot=slot, bar_slot=bar_slot, bar_id=bar_id, reads=reads)


def _subst_items(items, mapping, memo=None):
  if not mapping:
    return items
  memo = {} if memo is None else memo
  out = []
  for it in items:
    g = tw.subst(it.guard, mapping, memo)
    if g is False:
      continue
    if isinstance(it, Ev):
      e = _subst_event(it.event, mapping, memo)
      out.append(it if g is it.guard and e is it.event else Ev(g, e))
    else:
      sub = lambda x: tw.subst(x, mapping, memo)
      out.append(Loop(g, it.src, it.counter, sub(it.lo), sub(it.hi),
                      _subst_items(it.body, mapping, memo),
                      tuple((v, sub(i), sub(d), e) for v, i, d, e in it.accumulators)))
  return out


def subst_items(items, mapping, memo=None):
  return _subst_items(items, mapping, memo)


def grid_sizes(kernel_eqn) -> dict:
  """The kernel's grid: axis name -> its size (an int, or a symbolic
  dimension)."""
  mesh = kernel_eqn.params["meshes"][0]
  return dict(zip(getattr(mesh, "grid_names", ()) or (), getattr(mesh, "grid", ()) or ()))


def _size_term(n, dims):
  """A grid's size as a term: an int, a linear expression of the symbolic
  counts, or None (a product of counts: N = K * group heads)."""
  if isinstance(n, int):
    return n
  term = dim_term(n, dims)
  return None if any(a.op == "var" and a.args[0].startswith("dim.(")
                     for a in tw.atoms_of(term)) else term


def grid_index(axis: str):
  """Grid index ``axis`` as a term: every value from 0 up, past the traced
  grid's size too (a launch's grid may be larger: more blocks of a
  persistent grid, more heads), so that no point of a grid is left out;
  a counterexample is first sought inside the traced grid
  (:func:`harness.proofs.premise.prove`)."""
  return _bounded(tm.var(f"axis.{axis}"), 0)


def extract_symbolic(kernel_eqn, dims: dict | None = None) -> SymLaunch:
  """Every role of one ``mpmd_map`` kernel, read symbolically (grid indices
  are variables, integers read from global memory uninterpreted
  functions, each symbolic dimension of ``dims`` (its lower bound, or
  both bounds) a variable between them: :func:`dim_term`)."""
  tm.reset()
  mesh = kernel_eqn.params["meshes"][0]
  (body,) = kernel_eqn.params["jaxprs"]
  roles, threads = {}, {}
  for w in range(mesh.num_threads):
    interp = _SymInterp(kernel_eqn, {mesh.thread_name: w}, dims)
    interp.role = f"wg{w}"
    interp.items = interp.role_items.setdefault(interp.role, [])
    gm = [RefV(Buffer(f"gmem_in{i}", "gmem", tuple(getattr(v.aval, "shape", ()))))
          for i, v in enumerate(body.invars)]
    interp.run(body, gm)
    for role, items in interp.role_items.items():
      if any(True for _ in _items_events(items)):
        roles[role] = items
        threads[role] = 32 if ".warp" in role else 128
  grid = {a: (grid_index(a), _size_term(n, dims or {})) for a, n in grid_sizes(kernel_eqn).items()}
  counts = {name: _bounded(tm.var("dim." + name), bound) for name, bound in (dims or {}).items()}
  return SymLaunch(roles, threads, grid, counts)


# -- units --------------------------------------------------------------------------

@dataclasses.dataclass
class RoleUnits:
  """One role's tree cut as :func:`harness.proofs.role_programs.segment` cuts
  its events: ``tile`` the tile loop (persistent), the tile's ``head``
  events, its key ``loops`` (consecutive) and ``tail`` events."""

  name: str
  pre: list
  tile: Loop | None
  head: list
  loops: list
  tail: list
  post: list


def units(name: str, items: list, *, persistent: bool) -> RoleUnits:
  if not persistent:
    head, loops, tail = _tile_body(name, items, "the block")
    return RoleUnits(name, [], None, head, loops, tail, [])
  pre, post, tile = [], [], None
  for it in items:
    if isinstance(it, Loop):
      if tile is not None:
        raise ExtractionError(f"{name}: two loops with synchronisation outside any tile "
                              f"loop ({tile.src} and {it.src}); a persistent role's "
                              f"outermost loop must be its tile loop")
      if it.guard is not True:
        raise ExtractionError(f"{name}: the tile loop at {it.src} runs under a condition "
                              f"({it.guard!r}), which the proof does not model")
      tile = it
    else:
      (post if tile is not None else pre).append(it)
  if tile is None:
    return RoleUnits(name, pre, None, [], [], [], [])
  head, loops, tail = _tile_body(name, tile.body, f"the tile loop at {tile.src}")
  return RoleUnits(name, pre, tile, head, loops, tail, post)


def _tile_body(name, items, where):
  head, loops, tail = [], [], []
  for it in items:
    if isinstance(it, Loop):
      if tail:
        raise ExtractionError(f"{name}: events between two key loops in {where} "
                              f"(at {tail[0].event.src})")
      if it.guard is not True:
        raise ExtractionError(f"{name}: the key loop at {it.src} runs under a condition "
                              f"({it.guard!r}), which the proof does not model")
      for inner in it.body:
        if isinstance(inner, Loop):
          raise ExtractionError(f"{name}: a loop with synchronisation at {inner.src} "
                                f"inside the key loop at {it.src}, which the proof does "
                                f"not model")
      loops.append(it)
    elif loops:
      tail.append(it)
    else:
      head.append(it)
  return head, loops, tail
