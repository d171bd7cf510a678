"""What the extractor (:mod:`harness.proofs.extract`) knows of a jaxpr: the
primitives that are register arithmetic (:data:`PURE`), the integer ops it
evaluates, which eqns the protocol can see (:class:`Program`), where a ref
transform chain takes its slot, which sub-jaxprs synchronise, and the
groups of a ``RefUnion`` that mirror each other."""

from __future__ import annotations

from jax import tree_util
from jax.extend import core as jex_core

from harness.proofs.events import OPAQUE, ExtractionError
from harness.proofs.kernel_lines import kernel_frame_uncached
from kernel.sync.seams import seam_of
from harness.proofs.memos import IdMemo

# Primitives with no synchronisation or shared-memory effect: arithmetic on
# registers.  Anything else must be understood below or is refused.
PURE = frozenset("""
abs add and argmax argmin bitcast_convert_type broadcast_in_dim broadcasted_iota ceil clamp
concatenate convert_element_type copy copy_p cos cumsum div dot_general eq erf exp exp2
expand_dims floor ge gt imag integer_pow iota is_finite layout_cast le log log1p log2 logistic
lt max min mul ne neg nextafter not optimization_barrier or pad pow real reduce_and reduce_max
reduce_min reduce_or reduce_precision reduce_sum rem reshape round rsqrt select_n
set_max_registers_p shift_left shift_right_arithmetic shift_right_logical sign sin slice sqrt
square squeeze stack sub tanh transpose xor
""".split())
INT_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "max": max, "min": min,
    "div": lambda a, b: cdiv(a, b),  # C division (toward zero), like lax.div
    "rem": lambda a, b: a - b * cdiv(a, b),
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "and": lambda a, b: a & b if not isinstance(a, bool) else a and b,
    "or": lambda a, b: a | b if not isinstance(a, bool) else a or b,
}


def cdiv(a, b):
  if not b:
    raise ExtractionError("integer division by zero while evaluating the kernel's index arithmetic")
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


def const(c):
  import numpy as np
  if np.ndim(c) == 0 and np.issubdtype(np.asarray(c).dtype, np.integer):
    return int(c)
  return OPAQUE

def subjaxprs(params):
  for p in params.values():
    for s in (p if isinstance(p, (tuple, list)) else [p]):
      if isinstance(s, jex_core.ClosedJaxpr):
        yield s.jaxpr
      elif isinstance(s, jex_core.Jaxpr):
        yield s


def find_kernels(jaxpr, *, one_thread_too: bool = False) -> list:
  """Every Mosaic GPU kernel (``mpmd_map`` over a thread axis) in the jaxpr,
  in order; ``one_thread_too``: and those of one warpgroup, without one."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "mpmd_map":
      mesh = eqn.params["meshes"][0]
      if getattr(mesh, "thread_name", None) or (one_thread_too and hasattr(mesh, "num_threads")):
        found.append(eqn)
        continue
    for sub in subjaxprs(eqn.params):
      found += find_kernels(sub, one_thread_too=one_thread_too)
  return found


SYNC_PRIMS = frozenset("""barrier_arrive barrier_wait commit_smem copy_gmem_to_smem
copy_smem_to_gmem inline_mgpu_p wait_smem_to_gmem wgmma_ref wgmma_accumulator_deref_p
run_state swap wgmma_wait commit_group""".split())


# The seams (kernel/sync/seams.py) of the inline_mgpu functions on registers
# alone (no ref operand, no barrier), so they neither synchronise nor touch
# memory: the masks' register selects (a setp and a selp per element) and
# FP8's relabelling of P's registers (within each thread).
REGISTER_ONLY = frozenset(("masks.register_select", "fp8.regroup"))


def is_register_select(fn) -> bool:
  """One of :data:`REGISTER_ONLY`'s inline_mgpu functions, by its seam."""
  return seam_of(fn) in REGISTER_ONLY


def has_sync(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "inline_mgpu_p"
        and is_register_select(eqn.params["mgpu_fn"])):
      continue
    if eqn.primitive.name in SYNC_PRIMS:
      return True
    if any(has_sync(s) for s in subjaxprs(eqn.params)):
      return True
  return False


CALLS = ("pjit", "jit", "closed_call")
INT = (int, bool)


_INT_DTYPES: dict = {}  # dtype -> integer or bool


def int_scalar(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if getattr(aval, "shape", None) != () or dtype is None:
    return False
  try:
    hit = _INT_DTYPES.get(dtype)
  except TypeError:  # an unhashable dtype: not cached
    hit = None
  if hit is None:
    import numpy as np
    try:
      hit = bool(np.issubdtype(dtype, np.integer) or dtype == np.bool_)
    except TypeError:
      hit = False
    try:
      _INT_DTYPES[dtype] = hit
    except TypeError:
      pass
  return hit


def literal_value(val):
  import numpy as np
  try:
    if np.ndim(val) == 0 and np.issubdtype(np.asarray(val).dtype, np.integer):
      return int(val)
    if np.ndim(val) == 0 and np.asarray(val).dtype == bool:
      return bool(val)
  except TypeError:
    pass
  return OPAQUE


class _LiteralKey:
  __slots__ = ()


class Program:
  """One jaxpr, prepared for the interpreter: the eqns whose effect the
  protocol can see (every one but register arithmetic with no integer scalar
  result, whose values are opaque anyway: a variable never bound reads as
  opaque, and calls of only such arithmetic), and its literals' values.
  Unknown primitives stay, so that running them refuses them."""

  __slots__ = ("jaxpr", "eqns", "literals", "frames")

  def __init__(self, jaxpr):
    self.jaxpr = jaxpr
    self.eqns, self.literals = [], {}
    self.frames = {}  # id(eqn) -> its innermost kernel line, or None (see kernel_frame)
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if not any(int_scalar(v.aval) for v in eqn.outvars):
        if name in PURE:
          continue
        if name in CALLS:
          sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
          if not program(getattr(sub, "jaxpr", sub)).eqns:
            continue
        if name == "cond" and not any(program(b.jaxpr).eqns for b in eqn.params["branches"]):
          continue
      keys = []
      for v in eqn.invars:
        if isinstance(v, jex_core.Literal):  # unhashable: a key of its own
          key = _LiteralKey()
          self.literals[key] = literal_value(v.val)
          keys.append(key)
        else:
          keys.append(v)
      self.eqns.append((eqn, eqn.primitive.name, tuple(keys)))
      if name not in PURE:
        self.frames[id(eqn)] = kernel_frame_uncached(eqn.source_info)


_PROGRAMS = IdMemo()  # id(jaxpr) -> Program (which keeps the jaxpr alive)


def program(jaxpr) -> Program:
  hit = _PROGRAMS.get(id(jaxpr))
  if hit is None or hit.jaxpr is not jaxpr:
    hit = _PROGRAMS[id(jaxpr)] = Program(jaxpr)
  return hit


class _Leaf:
  """A placeholder leaf: where in a transform chain an operand lands."""

  __slots__ = ("k",)

  def __init__(self, k):
    self.k = k


_TRANSFORMS = IdMemo()  # id(treedef) -> (treedef, where the slot comes from, view)


def _unflattened(treedef) -> list:
  """A chain of ref transforms with each leaf a :class:`_Leaf` naming its place."""
  try:
    transforms = tree_util.tree_unflatten(treedef, [_Leaf(k) for k in range(treedef.num_leaves)])
  except Exception as e:  # noqa: BLE001 -- reported with context
    raise ExtractionError(f"cannot read the transforms {treedef}: {e}") from e
  return list(transforms) if isinstance(transforms, (tuple, list)) else [transforms]


def _integer_index(i):
  """("leaf", k) or ("static", int) for an integer index, else None (a slice)."""
  if isinstance(i, _Leaf):
    return ("leaf", i.k)
  if isinstance(i, int) and not isinstance(i, bool):
    return ("static", i)
  return None


def transform_info(treedef):
  """For a chain of ref transforms: where its slot comes from (the first
  index of its first indexer: ("leaf", k), ("static", int) or ("none",)) and
  the RefUnion member it selects, if any (an ExtractAliasedRef)."""
  hit = _TRANSFORMS.get(id(treedef))
  if hit is not None and hit[0] is treedef:
    return hit[1], hit[2]
  slot, view = None, None
  for t in _unflattened(treedef):
    if type(t).__name__ == "ExtractAliasedRef":
      view = view or t
      continue
    indices = getattr(t, "indices", None)
    if indices is None or slot is not None:
      continue
    slot = (_integer_index(indices[0]) if indices else None) or ("none",)
  _TRANSFORMS[id(treedef)] = (treedef, slot, view)
  return slot, view


def leading_indices(treedef) -> tuple:
  """The integer indices that lead the first indexer of a chain of ref
  transforms, up to its first slice: ("leaf", k) or ("static", int) each."""
  for t in _unflattened(treedef):
    indices = getattr(t, "indices", None)
    if indices is None or type(t).__name__ == "ExtractAliasedRef":
      continue
    out = []
    for i in indices:
      index = _integer_index(i)
      if index is None:
        break
      out.append(index)
    return tuple(out)
  return ()


def mirror_groups(groups) -> dict[int, int]:
  """For a RefUnion's groups (None: no union), each group that mirrors an
  earlier one -> the first it mirrors (empty where none does).  A group
  mirrors another when it holds refs of the same shapes and dtypes in the
  same order: Mosaic GPU lays every group out from the union's first byte,
  so member i of each is the same bytes, and only the transforms differ
  (kernel.common.untiled_smem: the views wgmma reads and the ones the TMA
  copies use).  A copy into one and a read of the other are then a copy
  into and a read of one buffer; the bytes of groups that do not mirror
  each other are compared as an overlay."""
  import jax
  layout = lambda g: tuple((tuple(r.shape), str(r.dtype)) for r in jax.tree.leaves(g))
  first: dict = {}
  mirrors = {}
  for i, g in enumerate(groups or ()):
    j = first.setdefault(layout(g), i)
    if j != i:
      mirrors[i] = j
  return mirrors
