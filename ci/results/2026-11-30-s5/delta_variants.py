"""Ways of forming the backward's per-row inputs (lse2, delta), timed in one
process at the headline shape (session 5, run 4): the 0.33 ms that
residual_rows took in run 3 is far above the ~0.04 ms its 134 MB of reads
need.  Prints JSON; writes argv[1] when given."""
import json
import sys

import jax
import jax.numpy as jnp

from harness.bench import DEFAULT_SHAPES, time_fns
from kernel import backward as bwd

shape = DEFAULT_SHAPES[0]
B, T, N, D = shape.batch, shape.seq, shape.heads, shape.head_dim
f32 = jnp.float32


def lse2_of(m, l):
  live = l > 0
  return jnp.where(live, m * bwd.LOG2E + jnp.log2(jnp.where(live, l, 1.0)), jnp.inf)


def delta_btn(out, do):
  return jnp.sum(do.astype(f32) * out.astype(f32), axis=-1)          # (B, T, N)


variants = {
    "residual_rows": lambda m, l, out, do: bwd.residual_rows(m, l, out, do, T),
    "delta einsum bnt only": lambda m, l, out, do: jnp.einsum(
        "btnd,btnd->bnt", do.astype(f32), out.astype(f32)),
    "delta sum btn only": lambda m, l, out, do: delta_btn(out, do),
    "delta sum btn, barrier, transpose, stack": lambda m, l, out, do: jnp.stack(
        [lse2_of(m, l), jnp.swapaxes(jax.lax.optimization_barrier(delta_btn(out, do)), 1, 2)],
        axis=2),
    "delta via (BTN, D) rows, transpose, stack": lambda m, l, out, do: jnp.stack(
        [lse2_of(m, l), jnp.swapaxes(jnp.sum(
            (do.reshape(-1, D).astype(f32) * out.reshape(-1, D).astype(f32)), axis=1
        ).reshape(B, T, N), 1, 2)], axis=2),
    "delta einsum bf16 operands, f32 result, bnt only": lambda m, l, out, do: jnp.einsum(
        "btnd,btnd->bnt", do, out, preferred_element_type=f32),
    "lse2 + stack only": lambda m, l, out, do: jnp.stack([lse2_of(m, l), m], axis=2),
}
keys = jax.random.split(jax.random.key(0), 4)
inputs = []
for i in range(3):
  ks = jax.random.split(keys[i], 4)
  out = jax.random.normal(ks[0], (B, T, N, D), f32).astype(jnp.bfloat16)
  do = jax.random.normal(ks[1], (B, T, N, D), f32).astype(jnp.bfloat16)
  m = jax.random.normal(ks[2], (B, N, T), f32)
  l = jnp.abs(jax.random.normal(ks[3], (B, N, T), f32)) + 1.0
  inputs.append((m, l, out, do))
fns = {name: jax.jit(fn) for name, fn in variants.items()}
ref = fns["residual_rows"](*inputs[0])
check = {name: float(jnp.max(jnp.abs(fns[name](*inputs[0]) - ref)))
         for name in ("delta sum btn, barrier, transpose, stack",
                      "delta via (BTN, D) rows, transpose, stack")}
print(json.dumps({"max_abs_diff_vs_residual_rows": check}), flush=True)
ms = {name: t * 1e3 for name, t in time_fns(fns, inputs).items()}
print(json.dumps(ms, indent=1), flush=True)
if len(sys.argv) > 1:
  with open(sys.argv[1], "w") as fh:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "check": check, "ms": ms}, fh, indent=1)
