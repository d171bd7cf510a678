"""The kernel on a mesh of host devices, lowered for CUDA and partitioned by XLA.

``python -m harness.tools.mesh_lowering`` prints, as JSON, for each case of
:data:`CASES`: every kernel launch of the partitioned program (operand and
result shapes), every collective in it, and the same launches of the
single-device program at one device's local shapes; and for each case of
:data:`REFUSALS`, the error the partitioning rule raised.
``properties/kernel/test_sharding.py`` runs it in a subprocess and holds it to the
contract of ``kernel/sharding.py``.

How a CUDA program is partitioned on a CPU-only host (jax 0.11.2): ``jit(f)
.trace(*sharded ShapeDtypeStructs).lower(lowering_platforms=("cuda",))``
lowers for CUDA with the kernels' Mosaic GPU custom calls, and ``compile()``
on the host devices runs XLA's whole pipeline on it (Shardy propagation, the
SPMD partitioner, which calls ``kernel/sharding.py``'s rule and lowers each
device's kernel at its local shape, then the optimisation passes); only the
last step fails, when XLA looks up a host implementation of the
``mosaic_gpu_v2`` custom call.  The program as it stood after the
optimisations is written by XLA's dump (``xla_dump_to``), and read here.
``jax.export`` cannot be used instead: it stops before partitioning (the
exported module keeps the partitioner's placeholder custom call).

The host count has to be set (``--xla_force_host_platform_device_count``)
before jax initialises its CPU backend, hence a process of its own.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
import tempfile

HOST_DEVICES = 4
KERNEL_TARGET = "mosaic_gpu_v2"
# Collectives of XLA's HLO (synchronous and async forms).
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter",
               "all-reduce", "collective-broadcast", "ragged-all-to-all")
_MISSING_HOST_KERNEL = f"No FFI handler registered for {KERNEL_TARGET}"


@dataclasses.dataclass(frozen=True)
class Case:
  """One program: shapes (B, T, N, H, S, K), a mesh (axis name -> size), the
  query/key/value spec and the optional operands' (shape, spec)."""
  name: str
  mesh: tuple[tuple[str, int], ...]
  dims: tuple[int, int, int, int, int, int]
  qkv_spec: tuple
  bias: tuple | None = None        # (shape, spec)
  mask: tuple | None = None
  k_start: tuple | None = None
  gradients: bool = True
  kwargs: tuple = ()               # API keyword arguments, as (name, value) pairs
  explicit: bool = False           # a mesh of Explicit axes (jax.set_mesh): shard_map


B_, H_ = "data", "model"
CASES = (
    # GQA (4 query heads on 2 kv heads), a broadcast mask; batch over 4 devices.
    Case("batch", ((B_, 4),), (4, 256, 4, 64, 256, 2), (B_, None, None, None),
         mask=((1, 1, 256, 256), ()), kwargs=(("is_causal", True),)),
    # Non-causal, no bias or mask (the fused dQ: its float32 accumulator is
    # partitioned with the kernels); heads over 4 devices.
    Case("heads-fused", ((H_, 4),), (2, 256, 8, 64, 256, 4), (None, None, H_, None)),
    # Heads over 4 devices: 8 query heads, 4 kv heads (groups of 2 stay
    # local); a per-head bias (its gradient sharded like it), per-head key
    # ranges broadcast over the batch.
    Case("heads", ((H_, 4),), (2, 256, 8, 64, 256, 4), (None, None, H_, None),
         bias=((1, 8, 256, 256), (None, H_)), k_start=((1, 8, 256), (None, H_))),
    # Batch x heads: a bias broadcast over the batch (its gradient summed over
    # the batch axis, the one collective the user's sharding asks for), a
    # per-batch mask broadcast over heads, full key ranges.
    Case("batch-x-heads", ((B_, 2), (H_, 2)), (4, 256, 4, 64, 256, 2), (B_, None, H_, None),
         bias=((1, 4, 256, 256), (None, H_)), mask=((4, 1, 256, 256), (B_,)),
         k_start=((4, 4, 256), (B_, H_))),
    # The forward alone (no residuals), and unsharded optional operands the
    # rule must slice locally (a replicated full bias).
    Case("batch-x-heads-forward", ((B_, 2), (H_, 2)), (4, 256, 4, 64, 256, 2),
         (B_, None, H_, None), bias=((4, 4, 256, 256), ()), gradients=False),
    # Explicit sharding (types carry it): the same contract through shard_map.
    Case("batch-x-heads-explicit", ((B_, 2), (H_, 2)), (4, 256, 4, 64, 256, 2),
         (B_, None, H_, None), bias=((1, 4, 256, 256), (None, H_)),
         mask=((4, 1, 256, 256), (B_,)), explicit=True),
)

# (name, case, the text the error must hold)
REFUSALS = (
    ("query-seq", Case("q-seq", ((B_, 4),), (2, 256, 4, 64, 256, 2), (None, B_, None, None),
                       gradients=False), "query: axis 1 (seq_q) is sharded over mesh axes ('data',)"),
    ("key-seq", Case("k-seq", ((B_, 4),), (2, 256, 4, 64, 256, 2), (None, None, None, None),
                     gradients=False, kwargs=(("_key_spec", (None, B_, None, None)),)),
     "key: axis 1 (seq_kv) is sharded over mesh axes ('data',)"),
    ("bias-seq", Case("bias-seq", ((B_, 4),), (4, 256, 4, 64, 256, 2), (B_, None, None, None),
                      bias=((1, 1, 256, 256), (None, None, None, B_)), gradients=False),
     "bias: axis 3 (seq_kv) is sharded over mesh axes ('data',)"),
    ("head-dim", Case("head-dim", ((H_, 4),), (2, 256, 4, 64, 256, 4), (None, None, None, H_),
                      gradients=False), "query: axis 3 (head_dim) is sharded over mesh axes ('model',)"),
    # Explicit sharding: refused while tracing, with the ValueError itself.
    ("query-seq-explicit", Case("q-seq-x", ((B_, 4),), (2, 256, 4, 64, 256, 2),
                                (None, B_, None, None), gradients=False, explicit=True),
     "query: axis 1 (seq_q) is sharded over mesh axes ('data',)"),
    ("gqa-split", Case("gqa", ((H_, 4),), (2, 256, 4, 64, 256, 2), (None, None, H_, None),
                       gradients=False, kwargs=(("_key_spec", (None, None, None, None)),)),
     "query/key: heads sharded 4 ways over mesh axes ('model',), but 4 query heads and 2 kv "
     "heads are not both divisible by 4"),
)


def _arguments(case: Case, mesh, *, local: bool):
  """Abstract arguments: global and sharded, or one device's local shapes."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  B, T, N, H, S, K = case.dims
  kw = dict(case.kwargs)
  key_spec = kw.get("_key_spec", case.qkv_spec)
  specs = [("query", (B, T, N, H), case.qkv_spec, jnp.bfloat16),
           ("key", (B, S, K, H), key_spec, jnp.bfloat16),
           ("value", (B, S, K, H), key_spec, jnp.bfloat16)]
  for name, dtype in (("bias", jnp.bfloat16), ("mask", jnp.bool_), ("k_start", jnp.int32)):
    given = getattr(case, name)
    if given is not None:
      specs.append((name, given[0], given[1], dtype))
  names, args = [], []
  for name, shape, spec, dtype in specs:
    if local:
      args.append(jax.ShapeDtypeStruct(_local_shape(case, mesh, name, shape), dtype))
    else:
      args.append(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec))))
    names.append(name)
  return names, args


# Batch and head positions of each operand's full (B, N[, ...]) axes,
# right-aligned for the broadcastable ones.
_FULL_AXES = {"query": ("batch", None, "heads", None), "key": ("batch", None, "kv_heads", None),
              "value": ("batch", None, "kv_heads", None),
              "bias": ("batch", "heads", None, None), "mask": ("batch", "heads", None, None),
              "k_start": ("batch", "heads", None)}


def _local_shape(case: Case, mesh, name, shape):
  """One device's shard as the contract says: the batch and the heads split
  over the mesh axes the query's are, on every operand where they are at
  full size; everything else whole."""
  B, _, N, _, _, K = case.dims
  count = lambda entry: 1 if entry is None else (
      mesh.shape[entry] if isinstance(entry, str) else __import__("math").prod(mesh.shape[a] for a in entry))
  split = {"batch": (B, count(case.qkv_spec[0])), "heads": (N, count(case.qkv_spec[2])),
           "kv_heads": (K, count(case.qkv_spec[2]))}
  roles = _FULL_AXES[name][len(_FULL_AXES[name]) - len(shape):]
  return tuple(size // split[r][1] if r in split and size == split[r][0] else size
               for r, size in zip(roles, shape))


def _program(case: Case, names):
  import jax
  import jax.numpy as jnp
  from kernel import api
  kwargs = {k: v for k, v in case.kwargs if not k.startswith("_")}

  def attention(q, k, v, *rest):
    extra = dict(zip(names[3:], rest))
    return api.dot_product_attention(q, k, v, extra.pop("bias", None), extra.pop("mask", None),
                                     **extra, **kwargs)

  if not case.gradients:
    return attention
  wrt = (0, 1, 2) + ((3,) if "bias" in names else ())
  return jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=wrt)


def optimized_hlo(fn, args, mesh=None) -> str:
  """The program XLA made of ``fn`` for these (possibly sharded) abstract
  arguments, lowered for CUDA and compiled by the host's pipeline up to the
  point where it needs the kernel's host implementation (module docstring).
  ``mesh``: set as the context mesh (for Explicit axes)."""
  import contextlib
  import jax
  from kernel import api
  with api.lowering_only(), (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    with tempfile.TemporaryDirectory() as dump:
      try:
        lowered.compile(compiler_options={"xla_dump_to": dump})
      except jax.errors.JaxRuntimeError as err:
        if _MISSING_HOST_KERNEL not in str(err):
          raise
      else:
        raise RuntimeError("the program compiled for the host: it holds no kernel launch")
      found = glob.glob(os.path.join(dump, "*after_optimizations.txt"))
      if len(found) != 1:
        raise RuntimeError(f"expected one optimised module in XLA's dump, found {found}")
      with open(found[0]) as f:
        return f.read()


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+([a-z][a-z0-9-]*)\(", re.M)


def kernel_launches(hlo: str) -> list[dict]:
  """Each Mosaic GPU launch: its result type and its operands' shapes (the
  ``operand_layout_constraints`` XLA records for custom calls)."""
  launches = []
  for line in hlo.splitlines():
    if f'custom_call_target="{KERNEL_TARGET}"' not in line:
      continue
    m = _INSTRUCTION.match(line)
    launches.append({"result": _strip_layouts(m.group(1)),
                     "operands": _strip_layouts(_braced(line, "operand_layout_constraints="))})
  return launches


def _braced(line: str, key: str) -> str | None:
  """The text inside the balanced braces after ``key`` in ``line``."""
  start = line.find(key + "{")
  if start < 0:
    return None
  i = start + len(key)
  depth = 0
  for j in range(i, len(line)):
    depth += {"{": 1, "}": -1}.get(line[j], 0)
    if depth == 0:
      return line[i + 1:j]
  raise ValueError(f"unbalanced braces after {key} in: {line[:200]}")


def _strip_layouts(text: str) -> str:
  return re.sub(r"\{[0-9,]*\}", "", text).replace(" ", "")


def collectives(hlo: str) -> list[dict]:
  """Each collective instruction: its op, result type and replica groups."""
  found = []
  for m in _INSTRUCTION.finditer(hlo):
    op = m.group(2)
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base in COLLECTIVES:
      line = hlo[m.start():hlo.find("\n", m.start())]
      groups = re.search(r"replica_groups=(\S+(?: \{[^}]*\})?)", line)
      found.append({"op": base, "result": _strip_layouts(m.group(1)),
                    "groups": groups.group(1) if groups else None})
  return found


def _mesh(case: Case):
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh
  sizes = tuple(n for _, n in case.mesh)
  devices = np.array(jax.devices()[:int(np.prod(sizes))]).reshape(sizes)
  kind = AxisType.Explicit if case.explicit else AxisType.Auto
  return Mesh(devices, tuple(a for a, _ in case.mesh), axis_types=(kind,) * len(sizes))


def report(cases=CASES, refusals=REFUSALS) -> dict:
  out = {"cases": {}, "refusals": {}, "stand_in": {}}
  for case in cases:
    mesh = _mesh(case)
    names, sharded = _arguments(case, mesh, local=False)
    _, local = _arguments(case, mesh, local=True)
    hlo = optimized_hlo(_program(case, names), sharded, mesh if case.explicit else None)
    single = optimized_hlo(_program(case, names), local)
    out["cases"][case.name] = {
        "launches": kernel_launches(hlo),
        "local_launches": kernel_launches(single),
        "collectives": collectives(hlo),
        "local_shapes": {n: list(a.shape) for n, a in zip(names, local)},
    }
    if case.gradients:
      out["stand_in"][case.name] = stand_in_differences(case)
  for name, case, _ in refusals:
    mesh = _mesh(case)
    names, sharded = _arguments(case, mesh, local=False)
    try:
      optimized_hlo(_program(case, names), sharded, mesh if case.explicit else None)
    except Exception as err:  # the rule's ValueError, wrapped by XLA's callback
      out["refusals"][name] = f"{type(err).__name__}: {err}"
    else:
      out["refusals"][name] = None
  return out


# ---------------------------------------------------------------------------
# The rule executed: a stand-in for the kernels, run on the host devices.

def _stand_in_forward(q, k, v, bias, mask, k_start, k_end):
  """Attention in plain jnp with the kernels' operands and results (out,
  (m, l)): what the partitioned program runs per device here, so the rule's
  shardings, GQA grouping and dbias sum are executed, not only lowered."""
  import jax.numpy as jnp
  from jax import lax
  del k_end
  g = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kk) * q.shape[3] ** -0.5
  if bias is not None:
    s = s + lax.broadcast_to_rank(bias, 4)
  keep = jnp.ones(s.shape, bool)
  if mask is not None:
    keep &= lax.broadcast_to_rank(mask, 4)
  if k_start is not None:
    keep &= jnp.arange(s.shape[3]) >= lax.broadcast_to_rank(k_start, 3)[..., None]
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("bnts,bsnh->btnh", p / l[..., None], vv)
  return out, (m, l)


def _stand_in_backward(q, k, v, bias, mask, k_start, k_end, out, m, l, d_out):
  import jax
  del out, m, l
  f = lambda q, k, v, bias: _stand_in_forward(q, k, v, bias, mask, k_start, k_end)[0]
  if bias is None:
    _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None), q, k, v)
    return (*vjp(d_out), None)
  _, vjp = jax.vjp(f, q, k, v, bias)
  return vjp(d_out)


def _stand_in_program(names):
  import jax
  from kernel import sharding

  def program(*args):
    a = dict(zip(names, args))
    operands = [a.get(n) for n in ("query", "key", "value", "bias", "mask", "k_start")]
    out, (m, l) = sharding.forward(_stand_in_forward, *operands, None, residuals=True)
    d_out = jax.numpy.cos(out)   # some cotangent that depends on every output row
    grads = sharding.backward(_stand_in_backward, *operands, None, out, m, l, d_out)
    return (out, m, l) + tuple(g for g in grads if g is not None)
  return program


def stand_in_differences(case: Case) -> dict:
  """Max |sharded - one device| of out, m, l and the gradients, the kernels
  replaced by :func:`_stand_in_forward` (float32), executed on the host
  devices; and how many devices the sharded output spans."""
  import contextlib
  import jax
  import numpy as np
  mesh = _mesh(case)
  names, sharded = _arguments(case, mesh, local=False)
  rng = np.random.default_rng(0)
  values = []
  for name, a in zip(names, sharded):
    if name == "mask":
      x = rng.random(a.shape) > 0.2
      x[..., 0] = True   # no fully masked row (the stand-in would give NaN)
    elif name == "k_start":
      x = rng.integers(0, a.shape[-1] // 2, a.shape).astype(np.int32)
    else:
      x = rng.standard_normal(a.shape).astype(np.float32)
    values.append(x)
  program = jax.jit(_stand_in_program(names))
  one = program(*(jax.device_put(x, jax.devices()[0]) for x in values))
  ctx = jax.set_mesh(mesh) if case.explicit else contextlib.nullcontext()
  with ctx:
    many = program(*(jax.device_put(x, a.sharding) for x, a in zip(values, sharded)))
  labels = ("out", "m", "l", "dq", "dk", "dv", "dbias")
  return {"max_abs_diff": {n: float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                           for n, x, y in zip(labels, many, one)},
          "max_abs": {n: float(np.max(np.abs(np.asarray(y)))) for n, y in zip(labels, one)},
          "out_devices": len(many[0].sharding.device_set)}


def main(argv=None) -> int:
  flag = f"--xla_force_host_platform_device_count={HOST_DEVICES}"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    # jax must not be initialised yet in this process: re-run with the flag.
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip(),
               JAX_PLATFORMS="cpu")
    os.execve(sys.executable, [sys.executable, "-m", "harness.tools.mesh_lowering", *(argv or [])], env)
  json.dump(report(), sys.stdout, indent=1)
  print()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
