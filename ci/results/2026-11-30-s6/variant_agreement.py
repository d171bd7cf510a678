"""Session 6: do the private backward variants give the shipped backward's
gradients on shapes where they differ from it (the tile groups need a
multiple of G key tiles)?  dk and dv of a grid-order variant must be bitwise
equal (each block sums its own key tile); dq may differ by the reduce-add
order; the folded scale changes the rounding of exp2's argument, so it is
compared with the plain-JAX backward as well.
  python3 ci/results/2026-11-30-s6/variant_agreement.py VARIANT..."""
import sys
import jax, jax.numpy as jnp
import numpy as np
from kernel import api


def grads(name, q, k, v, do, causal):
  def f(q, k, v):
    return api.dot_product_attention(q, k, v, is_causal=causal, _backward=name)
  out, pull = jax.vjp(f, q, k, v)
  return [np.asarray(g.astype(jnp.float32)) for g in pull(do)]


ks = jax.random.split(jax.random.key(6), 4)
q = jax.random.normal(ks[0], (2, 1024, 4, 128), jnp.bfloat16)
k, v = (jax.random.normal(s, (2, 2048, 2, 128), jnp.bfloat16) for s in ks[1:3])
do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
for causal in (False, True):
  base = grads("pallas", q, k, v, do, causal)
  spec = grads("xla", q, k, v, do, causal)
  for name in sys.argv[1:]:
    got = grads(name, q, k, v, do, causal)
    cells = []
    for g, b, s, n in zip(got, base, spec, ("dq", "dk", "dv")):
      scale = float(np.abs(s).max())
      cells.append(f"{n}: bitwise={np.array_equal(g, b)} max|d-shipped|/max={np.abs(g - b).max() / scale:.2e} "
                   f"max|d-xla|/max={np.abs(g - s).max() / scale:.2e} (shipped {np.abs(b - s).max() / scale:.2e})")
    print(f"{name} causal={causal}: " + "; ".join(cells), flush=True)
