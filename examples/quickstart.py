import jax, jax.numpy as jnp
from kernel import dot_product_attention

q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 1024, 8, 128), jnp.bfloat16)  # each (batch, seq, heads, head_dim)
attention = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))
out = attention(q, k, v)  # (2, 1024, 8, 128) bf16, on an H100 or H200
