"""Where the fused backward's time goes at the headline shape, in one process
(session 5, run 2): the forward with and without residuals, the glue around
the kernels (the per-row inputs, the dQ accumulator's zero-fill and final
cast) with two ways of forming delta, and the dK/dV + fused dQ kernel on the
eager and early rendezvous.  Prints JSON lines; writes argv[1] when given."""
import json
import math
import sys

import jax
import jax.numpy as jnp

from harness.bench import DEFAULT_SHAPES, _inputs, time_fns
from kernel import api, backward as bwd, plan as plan_lib

shape = DEFAULT_SHAPES[0]
f = bwd.BackwardFeatures(scale=1.0 / math.sqrt(shape.head_dim), is_causal=False,
                         logits_soft_cap=None, seq_q=shape.seq, seq_kv=shape.seq)
d = plan_lib.padded_head_dim(shape.head_dim)
blocks = bwd.blocks_for(d, d)


def rows_multiply_sum(m, l, out, d_out, t_pad):
  """residual_rows with delta as an elementwise product summed over the head
  dim (one fused reduction) instead of an einsum (a batched dot)."""
  live = l > 0
  lse2 = jnp.where(live, m * bwd.LOG2E + jnp.log2(jnp.where(live, l, 1.0)), jnp.inf)
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = jnp.swapaxes(delta, 1, 2)
  return jnp.stack([lse2, delta], axis=2).astype(jnp.float32)


inputs = []
for i, (q, k, v) in enumerate(_inputs(shape, 3)):
  do = jax.random.normal(jax.random.PRNGKey(100 + i), q.shape, jnp.float32).astype(q.dtype)
  out, (m, l) = api.dot_product_attention(q, k, v, return_residuals=True)
  rows = bwd.residual_rows(m, l, out, do, shape.seq)
  acc = jnp.ones(q.shape, jnp.float32)
  inputs.append((q, k, v, do, out, m, l, rows, acc))

q0, k0, v0, do0, out0, m0, l0, ref, _ = inputs[0]
alt = jax.jit(rows_multiply_sum, static_argnums=4)(m0, l0, out0, do0, shape.seq)
print(json.dumps({"rows_max_abs_diff": float(jnp.max(jnp.abs(alt - ref))),
                  "delta_max_abs": float(jnp.max(jnp.abs(ref[:, :, 1])))}), flush=True)


def fused(schedule):
  def run(q, k, v, do, out, m, l, rows, acc):
    a = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
    r = bwd.dkv_call(q, k, v, do, rows, None, None, None, None, f=f, blocks=blocks,
                     outputs=("dk", "dv"), dq_accum=a, dq_schedule=schedule)
    return r, a[...]
  return jax.jit(run)


fns = {
    "forward": jax.jit(lambda q, k, v, *_: api.dot_product_attention(q, k, v)),
    "forward+residuals": jax.jit(lambda q, k, v, *_: api.dot_product_attention(
        q, k, v, return_residuals=True)),
    "rows (einsum delta)": jax.jit(lambda q, k, v, do, out, m, l, *_: bwd.residual_rows(
        m, l, out, do, shape.seq)),
    "rows (multiply-sum delta)": jax.jit(lambda q, k, v, do, out, m, l, *_: rows_multiply_sum(
        m, l, out, do, shape.seq)),
    "zeros f32": jax.jit(lambda q, *_: jnp.zeros(q.shape, jnp.float32)),
    "scale+cast dq": jax.jit(lambda *a: (a[-1] * f.scale).astype(jnp.bfloat16)),
    "dkv+fused-dq eager": fused("eager"),
    "dkv+fused-dq early": fused("early"),
}
ms = {name: t * 1e3 for name, t in time_fns(fns, inputs).items()}
print(json.dumps(ms, indent=1), flush=True)
if len(sys.argv) > 1:
  with open(sys.argv[1], "w") as fh:
    json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "shape": str(shape), "ms": ms}, fh, indent=1)
