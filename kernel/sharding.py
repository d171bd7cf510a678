"""Attention on a mesh: a partitioning rule for the kernel's forward and backward.

Under ``jax.jit`` with inputs sharded by a ``NamedSharding``, XLA's
partitioner sees each kernel launch as one opaque custom call and, without a
rule, would gather every operand onto every device.  Rows of attention are
independent across batch and heads, so a device holding a slice of the batch
and/or of the heads has everything its slice of the output needs: the rule
below (``jax.experimental.custom_partitioning``) tells the partitioner so, and
each device launches the kernel on its local shard, forward and backward, with
no collective on q, k, v, bias, mask or the key ranges.

What may be sharded, per operand (layout of ``kernel.api``):

* query / out / dO (B, T, N, H), key / value (B, S, K, H): B and the heads.
  Query heads and their kv heads are sharded together, over the same mesh
  axes: with GQA both N and K must be divisible by the head shards, so query
  head h's kv head h // (N / K) is on the same device.
* bias / mask (B|1, N|1, T|1, S|1), k_start / k_end (B|1, N|1, T|1): their B
  and N axes follow the query's where they are full, and stay replicated where
  they broadcast (size 1).
* m, l (B, N, T): like the query.

Sharding a sequence axis (T or S of any operand) or a head-dim axis is
refused with a ValueError naming the operand, the axis and the mesh axes:
flash attention over a sharded sequence needs a ring or an all-gather of the
keys, which this rule does not do behind the user's back.

The backward needs one collective only where the user's sharding asks for
it: a bias broadcast over a sharded axis (say (1, N, T, S) with the batch
sharded) gets its gradient summed over that axis (a psum, an all-reduce).

Two ways in, one contract:

* Auto mesh axes (the default; shardings given to ``jax.jit`` or carried by
  the arrays): a ``custom_partitioning`` rule.  Shardings are known only when
  XLA partitions, so a refused sharding surfaces at compile time, as a
  ``JaxRuntimeError`` that holds the rule's ValueError.  Shardy (jax's
  default) reads :func:`_sharding_rule`, GSPMD :func:`_infer`; both then call
  :func:`_partition`.
* Explicit mesh axes (``jax.set_mesh``; the types carry the shardings): a
  ``shard_map`` over the same specs, and a refused sharding is a ValueError
  at the call.

Under ``jax.vmap`` (auto axes) the per-device computation is vmapped whole,
as before this rule existed: custom_partitioning has no batching rule.

The rule does not change what is computed: each device runs the same config
(chosen from the global shapes, which differ from the local ones only in B
and N, which no config choice reads) on its rows, so out, dK, dV and the
two-kernel dQ are bitwise those of one device (properties/gpu/test_sharding_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

# Positions of the operands of the two partitioned calls.
_INPUTS = ("query", "key", "value", "bias", "mask", "k_start", "k_end")
FORWARD_OPERANDS = _INPUTS + ("descales",)
BACKWARD_OPERANDS = _INPUTS + ("out", "m", "l", "d_out")

# Axis roles of each operand, right-aligned for the broadcast ones (bias,
# mask, key ranges may have a lower rank).
_ROLES = {
    "query": ("batch", "seq_q", "heads", "head_dim"),
    "key": ("batch", "seq_kv", "kv_heads", "head_dim"),
    "value": ("batch", "seq_kv", "kv_heads", "head_dim"),
    "bias": ("batch", "heads", "seq_q", "seq_kv"),
    "mask": ("batch", "heads", "seq_q", "seq_kv"),
    "k_start": ("batch", "heads", "seq_q"),
    "k_end": ("batch", "heads", "seq_q"),
    # FP8: (B|1, K|1, 2), q_descale * k_descale and v_descale per kv head.
    "descales": ("batch", "kv_heads", "descale"),
    "out": ("batch", "seq_q", "heads", "head_dim"),
    "m": ("batch", "heads", "seq_q"),
    "l": ("batch", "heads", "seq_q"),
    "d_out": ("batch", "seq_q", "heads", "head_dim"),
}
_SHARDABLE = ("batch", "heads", "kv_heads")


@dataclasses.dataclass(frozen=True, eq=False)
class Local:
  """The computation one device runs on its shard (local shapes), which of
  the two partitioned calls it is, and the names of its operands and results
  that are present (an absent bias, mask or key range is no operand)."""
  fn: Callable
  kind: str                   # "forward" | "backward"
  operands: tuple[str, ...]
  results: tuple[str, ...]


def _present(names, values):
  return tuple(n for n, v in zip(names, values) if v is not None)


def forward(local_fn, query, key, value, bias, mask, k_start, k_end, *, residuals: bool,
            descales=None):
  """``local_fn(q, k, v, bias, mask, k_start, k_end[, descales]) -> (out,
  (m, l) | None)`` run on each device's batch/head shard (the whole call
  where there is one device); ``descales`` FP8's, passed only where given."""
  args = (query, key, value, bias, mask, k_start, k_end) + (
      () if descales is None else (descales,))
  local = Local(local_fn, "forward", _present(FORWARD_OPERANDS, args),
                ("out", "m", "l") if residuals else ("out",))
  return _dispatch(local, args)


def backward(local_fn, query, key, value, bias, mask, k_start, k_end, out, m, l, d_out):
  """``local_fn(...) -> (dq, dk, dv, dbias | None)`` on each device's shard;
  dbias summed over the mesh axes its broadcast dimensions hide."""
  args = (query, key, value, bias, mask, k_start, k_end, out, m, l, d_out)
  local = Local(local_fn, "backward", _present(BACKWARD_OPERANDS, args),
                ("dq", "dk", "dv") + (("dbias",) if bias is not None else ()))
  return _dispatch(local, args)


def _dispatch(local: Local, args):
  mesh = _explicit_mesh(args[0])
  if mesh is not None:
    return _shard_mapped(local, mesh, args)
  return _batchable(local, args)


def _explicit_mesh(query):
  """The mesh of a query whose type carries its sharding (a mesh with
  Explicit axes, ``jax.set_mesh``), else None."""
  mesh = getattr(getattr(jax.typeof(query), "sharding", None), "mesh", None)
  if mesh is None or mesh.empty or not mesh._any_axis_explicit:
    return None
  return mesh


def _shard_mapped(local: Local, mesh, args):
  """Explicit sharding: the shardings are known while tracing, so the rule
  applies here, as a shard_map over the layout's specs, and a refused
  sharding is a ValueError at the call."""
  names = _names(local)
  typed = [None if a is None else _Typed(tuple(a.shape), jax.typeof(a).sharding) for a in args]
  layout = layout_of(mesh, names, typed)
  present = [i for i, a in enumerate(args) if a is not None]
  specs = [layout.spec(names[i]) for i in present]
  operands = [jax.sharding.reshard(args[i], NamedSharding(mesh, spec))
              for i, spec in zip(present, specs)]
  per_device = _per_device(local, layout)

  def body(*shards):
    full = [None] * len(args)
    for i, x in zip(present, shards):
      full[i] = x
    return per_device(*full)

  return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                       out_specs=_result_specs(local, layout), check_vma=False)(*operands)


@dataclasses.dataclass(frozen=True)
class _Typed:
  shape: tuple
  sharding: object


def _batchable(local: Local, args):
  """The partitioned call, and under ``jax.vmap`` the per-device computation
  vmapped as a whole (custom_partitioning has no batching rule): vmap keeps
  working as before the rule existed, without the rule's partitioning."""

  @custom_vmap
  def call(*args):
    return _partitioned(local, *args)

  @call.def_vmap
  def _(axis_size, in_batched, *args):
    in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, batched)
                    for batched in in_batched)
    out = jax.vmap(local.fn, in_axes=in_axes, axis_size=axis_size)(*args)
    return out, jax.tree.map(lambda _: True, out)

  return call(*args)


def _call(local: Local, *operands):
  return local.fn(*operands)


_partitioned = custom_partitioning(_call, static_argnums=(0,))


# ---------------------------------------------------------------------------
# The layout: which mesh axes hold the batch and the heads.

@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh axes of the batch and the heads (each a tuple, possibly empty),
  and the operands' shapes (None for an absent one)."""
  mesh: object
  batch: tuple[str, ...]
  heads: tuple[str, ...]
  shapes: dict

  def shards(self, axes) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  def spec(self, name: str) -> PartitionSpec | None:
    """The sharding the rule asks of operand ``name``: its full batch/head
    axes split like the query's, every other axis replicated."""
    shape = self.shapes.get(name)
    if shape is None:
      return None
    roles = _ROLES[name][len(_ROLES[name]) - len(shape):]
    full = {"batch": self.shapes["query"][0], "heads": self.shapes["query"][2],
            "kv_heads": self.shapes["key"][2]}
    axes = {"batch": self.batch, "heads": self.heads, "kv_heads": self.heads}
    dims = [_entry(axes[role]) if role in axes and size == full[role] else None
            for role, size in zip(roles, shape)]
    return PartitionSpec(*dims)


def _entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _spec_axes(sharding, rank: int) -> list[tuple[str, ...]]:
  if not isinstance(sharding, NamedSharding):
    raise ValueError(
        "dot_product_attention on a mesh: the operands' sharding must be a "
        f"jax.sharding.NamedSharding on a Mesh, got {type(sharding).__name__}")
  spec = tuple(sharding.spec) + (None,) * (rank - len(tuple(sharding.spec)))
  return [_axes(e) for e in spec]


def layout_of(mesh, names, arg_shapes) -> Layout:
  """The batch and head mesh axes the query is sharded over, with every
  operand's sharding checked: a sharded sequence or head-dim axis is refused
  (ValueError naming the operand, the axis and the mesh axes), and so are
  batch/head shard counts that do not divide B, N and K."""
  shapes = {n: (None if a is None else tuple(a.shape)) for n, a in zip(names, arg_shapes)}
  per_operand = {}
  for name, arg in zip(names, arg_shapes):
    if arg is None or arg.sharding is None:
      continue
    rank = len(arg.shape)
    roles = _ROLES[name][len(_ROLES[name]) - rank:]
    axes = _spec_axes(arg.sharding, rank)
    for dim, (role, used) in enumerate(zip(roles, axes)):
      if used and role not in _SHARDABLE:
        raise ValueError(
            f"{name}: axis {dim} ({role}) is sharded over mesh axes {used}; "
            "dot_product_attention shards over batch and heads only (sharding "
            f"the {'sequence' if role.startswith('seq') else 'head dim'} is not "
            "supported): replicate that axis")
    per_operand[name] = dict(zip(roles, axes))
  q = per_operand.get("query", {})
  batch, heads = q.get("batch", ()), q.get("heads", ())
  layout = Layout(mesh=mesh, batch=batch, heads=heads, shapes=shapes)
  B, _, N, _ = shapes["query"]
  K = shapes["key"][2]
  if B % layout.shards(batch):
    raise ValueError(f"query: batch {B} is not divisible by its {layout.shards(batch)} "
                     f"shards over mesh axes {batch}")
  nh = layout.shards(heads)
  if N % nh or K % nh:
    raise ValueError(
        f"query/key: heads sharded {nh} ways over mesh axes {heads}, but "
        f"{N} query heads and {K} kv heads are not both divisible by {nh}; "
        "query heads and their kv heads (GQA groups of "
        f"{N // K if K and N % K == 0 else '?'}) must be sharded together")
  return layout


# ---------------------------------------------------------------------------
# The partitioning rule.

def _result_specs(local: Local, layout: Layout):
  """PartitionSpecs of the results, as a tree like theirs (None where a
  result is absent): out like the query, m and l (B, N, T) like its rows,
  each gradient like its operand."""
  q = layout.spec("query")
  if local.kind == "forward":
    rows = PartitionSpec(q[0], q[2], None)
    return (q, (rows, rows) if "m" in local.results else None)
  return (q, layout.spec("key"), layout.spec("value"), layout.spec("bias"))


def _names(local: Local):
  return FORWARD_OPERANDS if local.kind == "forward" else BACKWARD_OPERANDS


def _named(mesh, spec):
  return None if spec is None else NamedSharding(mesh, spec)


def _partition(local: Local, mesh, arg_shapes, result_shape):
  names = _names(local)
  layout = layout_of(mesh, names, arg_shapes)
  arg_shardings = tuple(_named(mesh, layout.spec(n)) if a is not None else None
                        for n, a in zip(names, arg_shapes))
  result_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                  _result_specs(local, layout))
  return mesh, _per_device(local, layout), result_shardings, arg_shardings


def _per_device(local: Local, layout: Layout):
  """What each device runs on its shard: the local computation, and in the
  backward the sum of dbias over the mesh axes its broadcast hides."""
  reduce_axes = _dbias_reduce_axes(layout) if local.kind == "backward" else ()
  if not reduce_axes:
    return local.fn

  def run(*operands):
    dq, dk, dv, dbias = local.fn(*operands)
    return dq, dk, dv, (None if dbias is None else lax.psum(dbias, reduce_axes))
  return run


def _dbias_reduce_axes(layout: Layout) -> tuple[str, ...]:
  """Mesh axes a broadcast bias dimension hides: each device's dbias is a
  partial sum over its local batch/heads, the gradient the sum over them."""
  shape = layout.shapes.get("bias")
  if shape is None:
    return ()
  full = (1,) * (4 - len(shape)) + tuple(shape)
  axes = ()
  if full[0] == 1:
    axes += layout.batch
  if full[1] == 1:
    axes += layout.heads
  return axes


def _infer(local: Local, mesh, arg_shapes, result_shape):
  """GSPMD's propagation callback (Shardy reads :func:`_sharding_rule`)."""
  try:
    layout = layout_of(mesh, _names(local), arg_shapes)
  except ValueError:
    # An exception here aborts the process (a CHECK in XLA's callback
    # glue); answering "replicated" lets :func:`_partition`, whose errors
    # XLA returns to Python, refuse the call with the same message.
    layout = Layout(mesh=mesh, batch=(), heads=(),
                    shapes={n: (None if a is None else tuple(a.shape))
                            for n, a in zip(_names(local), arg_shapes)})
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), _result_specs(local, layout))


_RESULT_ROLES = {
    "out": _ROLES["out"], "m": _ROLES["m"], "l": _ROLES["l"],
    "dq": _ROLES["query"], "dk": _ROLES["key"], "dv": _ROLES["value"], "dbias": _ROLES["bias"],
}
# The head dim of value, out and dO (Hv) may differ from query's and key's (H).
_VALUE_LIKE = ("value", "out", "d_out", "dv")


def _sharding_rule(local: Local, mesh, value_types, result_types):
  """Shardy factors: ``b`` (batch), ``kh`` (kv heads) and ``g`` (query heads
  per kv head; query heads are the compound (kh, g), so sharding them shards
  the kv heads alike), ``t``, ``s``, ``h``, ``hv``, each shared by the
  operands and results that have that axis at full size.  A broadcast axis
  (size 1 against a larger full size) gets a factor of its own, so it never
  takes the batch's or the heads' sharding."""
  shapes = dict(zip(local.operands, (tuple(ir_shape(t)) for t in value_types)))
  B, T, N, H = shapes["query"]
  S, K = shapes["key"][1], shapes["key"][2]
  g = N // K
  full = {"batch": B, "seq_q": T, "heads": N, "kv_heads": K, "seq_kv": S}
  factor = {"batch": "b", "seq_q": "t", "heads": CompoundFactor("kh", "g") if g > 1 else "kh",
            "kv_heads": "kh", "seq_kv": "s"}
  unique = iter(range(10_000))

  def mapping(name, roles, shape):
    roles = roles[len(roles) - len(shape):]
    dims = []
    for role, size in zip(roles, shape):
      if role == "head_dim":
        dims.append("hv" if name in _VALUE_LIKE else "h")
      elif role not in full:   # the descales' pair: never sharded
        dims.append(f"x{next(unique)}")
      elif size == full[role]:
        dims.append(factor[role])
      else:
        dims.append(f"x{next(unique)}")
    return ArrayMapping(*dims)

  operands = tuple(mapping(n, _ROLES[n], shapes[n]) for n in local.operands)
  results = tuple(mapping(n, _RESULT_ROLES[n], tuple(ir_shape(t)))
                  for n, t in zip(local.results, result_types))
  return SdyShardingRule(operands, results, **({"g": g} if g > 1 else {}))


def ir_shape(t):
  from jax._src.lib.mlir import ir
  return ir.RankedTensorType(t).shape


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=_sharding_rule)
