"""The longest-first order's variants on the GPU (marker ``gpu``; skipped,
visibly, elsewhere): an order decides which SM runs a tile and when, never
what the tile computes, so every order gives the same bits.

The shapes are the ones where the shipped order differs from the others
(kernel/tiling/schedule.py): d256 causal B1 at 9522 tokens, where the light tiles
run last (``schedule.light_last_gain``), and d128 causal B1 at 12017 tokens,
where the L2 sections are evened (``schedule.longest_first``).  The test
first checks, on the host, that the orders it compares do differ, so it
cannot pass by comparing one order with itself.  The shipped order itself
is checked against float64 by the rest of the GPU suite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools import schedule_report
from kernel import experiments
from kernel.tiling.config import Config

pytestmark = pytest.mark.gpu

# (head dim, tokens, heads, config, the experiments' keyword, its values).
CASES = {
    "light-last-d256-9522": (256, 9522, 8, Config(64, 64, 2, False, "longest-first"),
                             "defer_light", (None, True, False)),
    "even-sections-d128-12017": (128, 12017, 16, Config(64, 128, 2, True, "longest-first"),
                                 "even_sections", (True, False)),
}


def _orders(head_dim, seq, heads, config, keyword, values):
  """The order each value of ``keyword`` gives, as the forward builds it."""
  name = {"defer_light": "light_last", "even_sections": "even_sections"}[keyword]
  return [schedule_report.order_of(config, batch=1, num_heads=heads, num_kv_heads=heads,
                                   head_dim=head_dim, seq=seq, causal=True,
                                   **{name: v}).order for v in values]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_order_gives_the_same_bits(name):
  head_dim, seq, heads, config, keyword, values = CASES[name]
  orders = _orders(head_dim, seq, heads, config, keyword, values)
  assert any(not np.array_equal(orders[0], o) for o in orders[1:]), \
      f"{name}: the orders compared are all the same; the case no longer tests anything"
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
             for key in keys)
  results = []
  for value in values:
    out, (m, l) = experiments.dot_product_attention(
        q, k, v, is_causal=True, config=config, return_residuals=True, **{keyword: value})
    results.append([np.asarray(x.astype(jnp.float32)) for x in (out, m, l)])
  first = results[0]
  assert np.isfinite(first[0]).all() and np.abs(first[0]).max() > 0
  for value, got in zip(values[1:], results[1:]):
    for what, a, b in zip(("out", "m", "l"), first, got):
      assert np.array_equal(a, b), f"{name}: {keyword}={value!r} changed {what}'s bits"
