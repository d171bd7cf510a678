"""Read the barrier and stage-ring protocol out of a traced kernel (its jaxpr).

The proof in :mod:`harness.proofs.search` is about the code, not about a
model written beside it: a kernel of ``kernel/`` is traced on the CPU
(``jax.make_jaxpr`` under ``kernel.api.lowering_only()``:
:mod:`harness.proofs.forward_traces`, :mod:`harness.proofs.backward_traces`),
and this module runs the jaxpr of its Mosaic GPU kernel (the ``mpmd_map``
whose mesh has the thread axis ``wg``: :func:`harness.proofs.jaxprs.find_kernels`)
abstractly once per role: every warpgroup, and every warp of a ``warp_map``
inside one.  Integer scalars are evaluated (loop counters, ``prev_iters``,
``axis_index``, slot arithmetic, ``while``/``cond`` on them); integers read
from global memory (per-tile key ranges, a tile schedule) come from an
*environment* chosen by the prover; every other value is opaque.
The result per role is its ordered list of protocol events
(:class:`harness.proofs.events.Event`): mbarrier waits (with the parity
Mosaic GPU's per-thread phase bit gives them) and arrivals, TMA copies into
a slot with their barrier, wgmma reads of shared memory and the waits that
retire them, ordinary shared-memory stores and loads, ``commit_smem``
fences, TMA stores and their waits, named-barrier ``bar.sync``/``bar.arrive``
with id and thread count.  Each event carries the kernel source line it was
traced from, for the traces (:mod:`harness.proofs.kernel_lines`), and the
iterations of the while loops around it
(:attr:`harness.proofs.events.Extracted.loops`), which cut a role's events
into tiles and key-loop iterations (:mod:`harness.proofs.role_programs`).

The interpreter runs only the eqns the protocol can see
(:class:`harness.proofs.jaxprs.Program`: register arithmetic without an
integer scalar result is skipped, its value being opaque anyway), with
plain Python values, so that the many environments of a proof cost
milliseconds each.

A primitive outside :data:`harness.proofs.jaxprs.PURE` and the protocol
primitives handled here (:data:`HANDLED`) is refused
(:class:`harness.proofs.events.UnknownPrimitive`): a new kind of
synchronisation cannot slip past the proof.  So is a ``cond`` on an opaque
value whose branches synchronise, and a ``while`` whose trip count is not
an integer.

What this does not see: Mosaic GPU's own lowering below the jaxpr (its
implicit per-thread phase bit, ``arrive.expect_tx`` of a TMA copy, the
``wgmma`` wait at the end of ``run_state``) is encoded once here as the
documented semantics, and ptxas below that.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from jax.extend import core as jex_core

from harness.proofs.events import (OPAQUE, Buffer, Event, Extracted, ExtractionError, RefV,
                                   UnknownPrimitive)
from harness.proofs.jaxprs import (INT, INT_OPS, PURE, const, has_sync, is_register_select,
                                   leading_indices, literal_value, mirror_groups, program,
                                   transform_info)
from harness.proofs.kernel_lines import barrier_family, kernel_frame, name_buffers
from kernel.sync.seams import seam_of
from harness.proofs.memos import IdMemo

# Protocol and control primitives this module interprets.
HANDLED = frozenset("""
axis_index barrier_arrive barrier_wait commit_smem cond copy_gmem_to_smem copy_smem_to_gmem
get inline_mgpu_p jit pjit closed_call load mpmd_map run_scoped run_state scan swap while
wait_smem_to_gmem wgmma_accumulator_deref_p wgmma_ref wgmma_wait commit_group
""".split())
MAX_LOOP_TRIPS = 10_000
# The seam of kernel/sync/barriers.py's emitter of bar.sync and bar.arrive,
# whose closure holds the operation and its thread count.
NAMED_BARRIER = "barriers.named"


_ALLOC_NAMES = IdMemo()  # id(kernel eqn) -> (kernel eqn, {id(jaxpr var): number})


def branches_alike(src, runs: list, words) -> None:
  """Refuse a cond on data whose branches' runs (lists of shared-memory
  accesses) differ, naming the first access that does (``words``)."""
  for other in runs[1:]:
    if other != runs[0]:
      diff = next((f"{words(a)} against {words(b)}" for a, b in zip(runs[0], other) if a != b),
                  f"{len(runs[0])} accesses against {len(other)}")
      raise ExtractionError(f"{src}: a cond on data (which the protocol must not depend on) "
                            f"whose branches touch shared memory differently ({diff})")


def _evaluated(where, leaves, src) -> int:
  """The integer an index (("leaf", k) or ("static", int)) holds here."""
  kind, value = where
  index = leaves[value] if kind == "leaf" else value
  if type(index) not in INT:
    raise ExtractionError(f"{src}: a shared-memory or barrier slot the extractor "
                          f"cannot evaluate (an index computed from data)")
  return int(index)


class _Interp:
  def __init__(self, kernel_eqn, env: Callable, axes: dict, every_index: bool = False):
    self.eqn = kernel_eqn
    # a slot named by every leading integer index (row-major), not the first
    # alone: buffers of other authors indexed [warpgroup, slot]
    self.every_index = every_index
    self.env = env          # (gmem buffer name, index tuple) -> int
    self.axes = dict(axes)  # grid axis name -> value
    self.events: dict[str, list] = {}
    self.event_loops: dict[str, list] = {}
    self.role = None
    self.buffers: dict[str, Buffer] = {}
    # Allocations are named per kernel by the jaxpr variable that holds them,
    # so that every run over one trace (concrete or symbolic, whichever
    # branches it takes) gives a buffer the same name.
    hit = _ALLOC_NAMES.get(id(kernel_eqn))
    if hit is None or hit[0] is not kernel_eqn:
      hit = _ALLOC_NAMES[id(kernel_eqn)] = (kernel_eqn, {})
    self._names = hit[1]
    self.cells: dict[str, Any] = {}     # registers behind run_state's refs
    self.views: dict[str, tuple] = {}   # view -> (allocation, first byte, end, group)
    self.mirrors: dict[str, dict] = {}  # union allocation -> its mirror_groups
    self.loops: tuple = ()               # the enclosing while iterations (Extracted.loops)
    self.site = None                     # the kernel line of the cond whose branch runs
    # per role: (stores in each committed bulk group, oldest first; stores
    # not yet committed), so that a wait on n groups names its stores
    self.store_groups: dict[str, tuple[tuple[int, ...], int]] = {}

  def _buffer(self, aval, var, space_hint=None):
    inner = getattr(aval, "inner_aval", aval)
    dtype = getattr(inner, "dtype", None)
    space = str(getattr(aval, "memory_space", space_hint or "")).lower()
    arrivals = getattr(dtype, "num_arrivals", 0)
    if arrivals:
      kind = "barrier"
    elif "gmem" in space or "any" in space:
      kind = "gmem"
    elif "smem" in space:
      kind = "smem"
    else:
      kind = "regs"
    number = self._names.get(id(var))
    if number is None:
      number = self._names[id(var)] = len(self._names) + 1
    return Buffer(f"{kind}{number}", kind, tuple(getattr(inner, "shape", ())), int(arrivals))

  def _emit(self, ev: Event):
    self.events.setdefault(self.role, []).append(ev)
    self.event_loops.setdefault(self.role, []).append(self.loops)

  # -- running --------------------------------------------------------------
  @staticmethod
  def bound(jaxpr, args, consts):
    """(its program, the environment of one run: literals, consts, arguments)."""
    prog = program(jaxpr)
    env = dict(prog.literals)
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    return prog, env

  def run(self, jaxpr, args, consts=()):
    prog, env = self.bound(jaxpr, args, consts)
    get = env.get
    for eqn, name, keys in prog.eqns:
      ins = [get(k, OPAQUE) for k in keys]
      op = INT_OPS.get(name)
      if op is not None and len(ins) == 2:
        a, b = ins
        if type(a) in INT and type(b) in INT:
          env[eqn.outvars[0]] = op(a, b)
          continue
      outs = self.eqn_(eqn, name, ins, prog)
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [get(v, OPAQUE) if not isinstance(v, jex_core.Literal) else literal_value(v.val)
            for v in jaxpr.outvars]

  def eqn_(self, eqn, name, ins, prog):
    nout = len(eqn.outvars)
    if name == "convert_element_type" and type(ins[0]) in INT:
      import numpy as np
      dt = eqn.params["new_dtype"]
      if np.issubdtype(dt, np.integer):
        return [int(ins[0])]
      if dt == np.bool_:
        return [bool(ins[0])]
      return [OPAQUE]
    if name == "select_n" and all(type(x) in INT for x in ins):
      return [ins[1 + int(ins[0])]]
    if name == "not" and type(ins[0]) is bool:
      return [not ins[0]]
    if name == "neg" and type(ins[0]) is int:
      return [-ins[0]]
    if name in PURE:
      return [OPAQUE] * nout
    src = prog.frames[id(eqn)]
    if src is None:
      src = kernel_frame(eqn.source_info, self.site)
    if name not in HANDLED:
      raise UnknownPrimitive(
          f"{src}: primitive {name!r} is not understood by harness/proofs/extract.py; "
          f"a synchronisation primitive must be modelled before the proof can "
          f"cover the kernel")
    return getattr(self, "p_" + name)(eqn, ins, src)

  # -- control --------------------------------------------------------------
  def p_jit(self, eqn, ins, src):
    sub = eqn.params["jaxpr"]
    return self.run(sub.jaxpr, ins, [const(c) for c in sub.consts])

  p_pjit = p_jit

  def p_closed_call(self, eqn, ins, src):
    sub = eqn.params["call_jaxpr"]
    return self.run(sub.jaxpr, ins, [const(c) for c in sub.consts])

  def p_cond(self, eqn, ins, src):
    branches = eqn.params["branches"]
    index, *ops = ins
    if type(index) in INT:
      b = branches[max(0, min(int(index), len(branches) - 1))]
      outer, self.site = self.site, src
      try:
        return self.run(b.jaxpr, ops, [const(c) for c in b.consts])
      finally:
        self.site = outer
    if any(has_sync(b.jaxpr) for b in branches):
      raise ExtractionError(
          f"{src}: a cond on a value the extractor cannot evaluate (data) has "
          f"synchronisation in a branch")
    return self._data_cond(branches, ops, src, len(eqn.outvars))

  def _data_cond(self, branches, ops, src, nout):
    """A cond on data with no synchronisation in its branches: whichever
    runs, its shared-memory loads and stores are events (the backward's
    rows, read under its range test), so every branch must make the same
    ones, emitted once."""
    role, cells = self.role, dict(self.cells)
    saved = self.events.get(role, []), self.event_loops.get(role, [])
    groups = self.store_groups.get(role)
    runs = []
    outer = self.site
    try:
      for b in branches:
        self.events[role], self.event_loops[role], self.cells = [], [], dict(cells)
        if groups is not None:   # each branch from the stores before the cond
          self.store_groups[role] = groups
        self.site = src
        self.run(b.jaxpr, ops, [const(c) for c in b.consts])
        runs.append((self.events[role], self.event_loops[role]))
    finally:
      self.site = outer
      self.events[role], self.event_loops[role] = saved
      self.cells = cells
    branches_alike(src, [events for events, _ in runs], lambda e: f"{e.src} {e.describe()}")
    for ev, loops in zip(*runs[0]):
      self.events.setdefault(role, []).append(ev)
      self.event_loops.setdefault(role, []).append(loops)
    return [OPAQUE] * nout

  def p_while(self, eqn, ins, src):
    p = eqn.params
    cc, bc = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cc], ins[cc:cc + bc], ins[cc + bc:]
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    cjc, bjc = [const(c) for c in cj.consts], [const(c) for c in bj.consts]
    outer = self.loops
    for trip in range(MAX_LOOP_TRIPS + 1):
      (go,) = self.run(cj.jaxpr, [*cconsts, *carry], cjc)
      if type(go) not in INT:
        if has_sync(bj.jaxpr):
          raise ExtractionError(f"{src}: a while loop with synchronisation whose trip "
                                f"count the extractor cannot evaluate")
        return [OPAQUE] * len(eqn.outvars)
      if not go:
        return carry
      self.loops = outer + ((src, trip),)
      carry = self.run(bj.jaxpr, [*bconsts, *carry], bjc)
      self.loops = outer
    raise ExtractionError(f"{src}: while loop ran past {MAX_LOOP_TRIPS} trips")

  def p_scan(self, eqn, ins, src):
    """A loop of a trip count fixed when tracing (``fori_loop`` over static
    bounds): run like a while, each trip's slices of its inputs opaque, its
    stacked outputs too."""
    p = eqn.params
    # jax 0.11's scan: its operands as a flat tree of (consts, carry, xs)
    consts, carry, xs = map(list, p["ft_in"].update(ins).unpack())
    ncarry = len(carry)
    body = p["jaxpr"]
    body_consts = [const(c) for c in body.consts]
    if p["length"] > MAX_LOOP_TRIPS:
      raise ExtractionError(f"{src}: scan of {p['length']} trips, past {MAX_LOOP_TRIPS}")
    outer = self.loops
    for trip in (reversed(range(p["length"])) if p["reverse"] else range(p["length"])):
      self.loops = outer + ((src, trip),)
      outs = self.run(body.jaxpr, [*consts, *carry, *[OPAQUE] * len(xs)], body_consts)
      carry = outs[:ncarry]
      self.loops = outer
    return [*carry, *[OPAQUE] * (len(eqn.outvars) - ncarry)]

  def p_run_scoped(self, eqn, ins, src):
    sub = eqn.params["jaxpr"]
    args = []
    for v in sub.invars:
      buf = self._buffer(v.aval, v)
      self.buffers[buf.name] = buf
      groups = mirror_groups(getattr(v.aval, "refs", None))
      if groups:
        self.mirrors[buf.name] = groups
      args.append(RefV(buf))
    return self.run(sub, args, ins[:len(sub.constvars)])

  def p_run_state(self, eqn, ins, src):
    sub = eqn.params["jaxpr"]
    args = []
    for v, a in zip(sub.invars, ins):
      if isinstance(a, RefV):
        args.append(a)
      else:  # a value run_state turns into a fresh ref (an accumulator)
        buf = self._buffer(v.aval, v, "regs")
        self.cells[buf.name] = a
        args.append(RefV(buf))
    self.run(sub, args)
    # run_state hands its refs back as values: Mosaic GPU waits for every
    # wgmma group in flight before it reads an accumulator out.
    self._emit(Event("wgmma_wait", self.role, src, n=0))
    return [OPAQUE] * len(eqn.outvars)

  def p_axis_index(self, eqn, ins, src):
    axis = eqn.params["axis_name"]
    if axis in self.axes:
      return [self.axes[axis]]
    raise ExtractionError(f"{src}: axis_index of {axis!r} has no value in the environment")

  def p_mpmd_map(self, eqn, ins, src):
    mesh = eqn.params["meshes"][0]
    if type(mesh).__name__ != "WarpMesh":
      raise ExtractionError(f"{src}: nested mpmd_map over {mesh!r} is not modelled")
    (body,) = eqn.params["jaxprs"]
    outer = self.role
    if self.events.get(outer):
      raise ExtractionError(f"{src}: role {outer} synchronises outside its warp_map too")
    for warp in range(4):
      self.role = f"{outer}.warp{warp}"
      self.axes[mesh.axis_name] = warp
      self.run(body, ins)
    del self.axes[mesh.axis_name]
    self.role = outer
    return [OPAQUE] * len(eqn.outvars)

  # -- memory ---------------------------------------------------------------
  def _ref_and_slot(self, ref, treedef, leaves, src=""):
    """The buffer a (ref, transforms) operand names, and its slot: the first
    integer index of the first indexer of the transform chain."""
    if not isinstance(ref, RefV):
      raise ExtractionError(f"{src}: a ref operand the extractor lost track of: {ref!r}")
    if treedef is None:
      return ref.buf, None
    where, view = transform_info(treedef)
    slot = None
    if where is not None and where[0] in ("leaf", "static"):
      slot = _evaluated(where, leaves, src)
    if self.every_index and slot is not None:
      slot = self._flat_slot(ref.buf, leading_indices(treedef), leaves, src)
    return (self._view(ref.buf, view) if view is not None else ref.buf), slot

  def _flat_slot(self, buf, leading, leaves, src) -> int:
    """The row-major number of the sub-array ``leading`` indices select."""
    slot = 0
    for axis, where in enumerate(leading):
      slot = slot * (buf.shape[axis] if axis < len(buf.shape) else 1) + \
          _evaluated(where, leaves, src)
    return slot

  def _view(self, buf, t):
    """A RefUnion member is a view at a byte offset of one allocation: a buffer
    of its own, whose byte range the checker compares with the others'; the
    members of mirroring groups (:func:`mirror_groups`) at one offset are
    one buffer."""
    import numpy as np
    size = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
    group = self.mirrors.get(buf.name, {}).get(t.alias_group_idx, t.alias_group_idx)
    view = Buffer(f"{buf.name}@{group}+{t.offset}", buf.space, tuple(t.shape))
    self.buffers[view.name] = view
    self.views[view.name] = (buf.name, t.offset, t.offset + size, group)
    return view

  def p_get(self, eqn, ins, src):
    ref, *leaves = ins
    if isinstance(ref, RefV) and ref.buf.space == "gmem":
      out = eqn.outvars[0].aval
      if not out.shape and "int" in str(out.dtype):
        return [self.env(ref.buf.name, tuple(leaves))]
      return [OPAQUE]
    buf, slot = self._ref_and_slot(ref, eqn.params.get("tree"), leaves, src)
    if buf.space == "smem":
      self._emit(Event("smem_load", self.role, src, buf.name, slot))
    if buf.space == "regs" and not leaves:
      return [self.cells.get(buf.name, OPAQUE)]
    return [OPAQUE]

  p_load = p_get

  def p_swap(self, eqn, ins, src):
    ref, val, *leaves = ins
    if isinstance(ref, RefV) and ref.buf.space == "gmem":
      raise ExtractionError(f"{src}: a plain store to global memory is not modelled")
    buf, slot = self._ref_and_slot(ref, eqn.params.get("tree"), leaves, src)
    if buf.space == "regs":
      old = self.cells.get(buf.name, OPAQUE)
      self.cells[buf.name] = val if not leaves else OPAQUE
      return [old]
    if buf.space == "smem":
      self._emit(Event("smem_store", self.role, src, buf.name, slot))
    return [OPAQUE]

  @staticmethod
  def _split_leaves(ins, *treedefs):
    out, i = [], 0
    for td in treedefs:
      n = td.num_leaves if td is not None else 0
      out.append((td, ins[i:i + n]))
      i += n
    return out, ins[i:]

  def p_barrier_wait(self, eqn, ins, src):
    ref, *leaves = ins
    buf, slot = self._ref_and_slot(ref, eqn.params["transforms_treedef"], leaves, src)
    self._emit(Event("wait", self.role, src, buf.name, slot))
    return []

  def p_barrier_arrive(self, eqn, ins, src):
    ref, *rest = ins
    td = eqn.params["transforms_treedef"]
    (parts, pred) = self._split_leaves(rest, td)
    if eqn.params.get("has_user_predicate") and pred and pred[0] is not True:
      if pred[0] is False:
        return []
      raise ExtractionError(f"{src}: a predicated arrive on data is not modelled")
    buf, slot = self._ref_and_slot(ref, td, parts[0][1], src)
    self._emit(Event("arrive", self.role, src, buf.name, slot))
    return []

  def p_copy_gmem_to_smem(self, eqn, ins, src):
    p = eqn.params
    srcref, dst, *rest = ins
    if not p.get("has_barrier", True):
      raise ExtractionError(f"{src}: a TMA load without a barrier is not modelled")
    bar, *rest = rest
    (parts, pred) = self._split_leaves(rest, p["src_transforms_treedef"],
                                       p["dst_transforms_treedef"],
                                       p["barrier_transforms_treedef"])
    if p.get("has_user_predicate"):
      raise ExtractionError(f"{src}: a predicated TMA load is not modelled")
    if p.get("collective_axes"):
      raise ExtractionError(f"{src}: a multicast TMA load is not modelled")
    dbuf, dslot = self._ref_and_slot(dst, *parts[1], src)
    bbuf, bslot = self._ref_and_slot(bar, *parts[2], src)
    self._emit(Event("tma_load", self.role, src, dbuf.name, dslot, bar=bbuf.name,
                     bar_slot=bslot))
    return []

  def p_copy_smem_to_gmem(self, eqn, ins, src):
    p = eqn.params
    srcref, dst, *rest = ins
    (parts, pred) = self._split_leaves(rest, p["src_transforms_treedef"],
                                       p["dst_transforms_treedef"])
    if p.get("has_user_predicate"):
      raise ExtractionError(f"{src}: a predicated TMA store is not modelled")
    sbuf, sslot = self._ref_and_slot(srcref, *parts[0], src)
    self._emit(Event("tma_store", self.role, src, sbuf.name, sslot))
    groups, pending = self.store_groups.get(self.role, ((), 0))
    pending += 1
    if p.get("commit_group", True):   # this store and every one before it not yet committed
      groups, pending = groups + (pending,), 0
    self.store_groups[self.role] = (groups, pending)
    return []

  def p_commit_group(self, eqn, ins, src):
    groups, pending = self.store_groups.get(self.role, ((), 0))
    if pending:
      self.store_groups[self.role] = (groups + (pending,), 0)
    return []

  def p_wait_smem_to_gmem(self, eqn, ins, src):
    """A wait until at most n bulk groups are in flight, as the search
    counts stores: the stores of the last n groups, and any not yet
    committed, stay in flight."""
    n = int(eqn.params["n"])
    groups, pending = self.store_groups.get(self.role, ((), 0))
    kept = groups[len(groups) - n:] if n else ()
    self.store_groups[self.role] = (kept, pending)
    # every store its own group so far: the wait as written, the same event
    # whatever came before it
    alone = not pending and all(size == 1 for size in groups)
    self._emit(Event("store_wait", self.role, src, n=n if alone else sum(kept) + pending))
    return []

  def p_commit_smem(self, eqn, ins, src):
    self._emit(Event("fence", self.role, src))
    return []

  def p_wgmma_ref(self, eqn, ins, src):
    p = eqn.params
    acc, a, b, *rest = ins
    (parts, _) = self._split_leaves(rest, p["acc_transforms_tree"], p["a_transforms_tree"],
                                    p["b_transforms_tree"])
    reads = []
    for opnd, part in ((a, parts[1]), (b, parts[2])):
      if isinstance(opnd, RefV) and opnd.buf.space == "smem":
        buf, slot = self._ref_and_slot(opnd, *part, src)
        reads.append((buf.name, slot))
    self._emit(Event("wgmma", self.role, src, reads=tuple(reads)))
    return []

  def p_wgmma_wait(self, eqn, ins, src):
    """``plgpu.wgmma_wait(n)``: the same wait as an accumulator's load."""
    self._emit(Event("wgmma_wait", self.role, src, n=int(eqn.params["n"])))
    return []

  def p_wgmma_accumulator_deref_p(self, eqn, ins, src):
    self._emit(Event("wgmma_wait", self.role, src, n=int(eqn.params["wait_n"])))
    return [OPAQUE]

  def _barrier_id(self, bid, src):
    if type(bid) is not int:
      raise ExtractionError(f"{src}: named barrier id is not an integer the extractor can evaluate")
    return (bid,)

  def p_inline_mgpu_p(self, eqn, ins, src):
    fn = eqn.params["mgpu_fn"]
    if is_register_select(fn):
      return [OPAQUE] * len(eqn.outvars)
    if seam_of(fn) != NAMED_BARRIER:
      raise UnknownPrimitive(
          f"{src}: inline_mgpu {getattr(fn, '__qualname__', fn)!r} is not the named barrier "
          f"(seam {NAMED_BARRIER!r}) nor register-only; the extractor cannot see what it does")
    closure = inspect.getclosurevars(fn).nonlocals
    kind, threads = closure["kind"], int(closure["num_threads"])
    if kind not in ("sync", "arrive"):
      raise UnknownPrimitive(f"{src}: named barrier operation bar.{kind}")
    (bid,) = self._barrier_id(ins[0], src)
    self._emit(Event("bar_" + kind, self.role, src, bar_id=bid, threads=threads,
                     family=barrier_family(eqn.source_info)))
    return []


def extract_kernel(kernel_eqn, *, env: Callable, grid: dict, name: str = "kernel",
                   every_index: bool = False) -> Extracted:
  """The events of every role of one ``mpmd_map`` kernel for one grid point
  (``grid``: axis name -> index) and environment (``env(buffer, index)``: the
  integer a kernel reads from global memory); ``every_index``: a slot is
  named by every leading integer index of an access, not the first alone."""
  mesh = eqn_mesh = kernel_eqn.params["meshes"][0]
  (body,) = kernel_eqn.params["jaxprs"]
  roles, threads, loops = {}, {}, {}
  all_buffers, views = {}, {}
  for w in range(mesh.num_threads or 1):
    # a kernel of one warpgroup has no thread axis
    thread = {eqn_mesh.thread_name: w} if eqn_mesh.thread_name else {}
    interp = _Interp(kernel_eqn, env, {**grid, **thread}, every_index)
    interp.role = f"wg{w}"
    gm = []
    for v in body.invars:
      buf = Buffer(f"gmem_in{len(gm)}", "gmem", tuple(getattr(v.aval, "shape", ())))
      gm.append(RefV(buf))
    interp.run(body, gm)
    for role, evs in interp.events.items():
      if evs:
        roles[role] = evs
        loops[role] = tuple(interp.event_loops[role])
        threads[role] = 32 if ".warp" in role else 128
    all_buffers.update(interp.buffers)
    views.update(interp.views)
  out = {role: tuple(evs) for role, evs in roles.items()}
  barriers_ = {b.name: b for b in all_buffers.values() if b.space == "barrier"}
  buffers = {b.name: b for b in all_buffers.values() if b.space == "smem"}
  overlaps = {}
  for a, (base_a, lo_a, hi_a, g_a) in views.items():
    for b, (base_b, lo_b, hi_b, g_b) in views.items():
      if a != b and base_a == base_b and g_a != g_b and lo_a < hi_b and lo_b < hi_a:
        overlaps.setdefault(a, set()).add(b)
  return Extracted(name, out, threads, barriers_, buffers,
                   {k: frozenset(v) for k, v in overlaps.items()}, loops, name_buffers(out))
