"""Blocks above a warpgroup's causal diagonal, checked on the CPU: which
configs have them (kernel/forward.py's ``tiles_reach_past_a_warpgroup``),
that the kernel's per-block test marks only blocks whose every key the
causal rule hides from the warpgroup's every row, and that both forwards
(skip, the shipped one, and ``dead_blocks="compute"``) lower for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from kernel import api, experiments, forward
from kernel.config import Config


def _dead(q_base, block_q, ki, block_kv):
  """kernel/forward.py's softmax test, on Python ints."""
  return forward.above_the_rows(ki, block_kv, q_base, block_q)


@given(block_q=st.sampled_from([64, 128]), block_kv=st.sampled_from([64, 128, 256]),
       cw=st.sampled_from([2, 3]), qi=st.integers(0, 300))
@settings(max_examples=300, deadline=None)
def test_a_dead_block_is_masked_for_every_row_of_the_warpgroup(block_q, block_kv, cw, qi):
  """Every block the test marks dead holds only keys above every row of
  the warpgroup (row r sees keys <= r), and every block it keeps holds a
  key some row sees; the tile's blocks are those its last row reaches."""
  tile_q = cw * block_q
  last_block = (qi * tile_q + tile_q - 1) // block_kv
  for w in range(cw):
    q_base = qi * tile_q + w * block_q
    for ki in range(last_block + 1):
      keys = range(ki * block_kv, (ki + 1) * block_kv)
      seen = any(k <= r for k in keys for r in (q_base + block_q - 1,))
      assert _dead(q_base, block_q, ki, block_kv) == (not seen), (w, ki)


@pytest.mark.parametrize("block_q,block_kv,cw", [(64, 128, 2), (64, 128, 3), (64, 64, 2),
                                                 (64, 64, 3), (128, 128, 2), (128, 64, 2),
                                                 (64, 256, 2), (128, 256, 2)])
def test_which_configs_have_dead_blocks(block_q, block_kv, cw):
  """tiles_reach_past_a_warpgroup against every tile start up to 64
  tiles: some warpgroup of some tile has a dead block of the tile."""
  config = Config(block_q, block_kv, 2, compute_warpgroups=cw)
  tile_q = cw * block_q
  # Some row of the tile sees a key of its last block that no row of
  # warpgroup w sees.
  want = any(((qi * tile_q + tile_q - 1) // block_kv) * block_kv > qi * tile_q + (w + 1) * block_q - 1
             for qi in range(64) for w in range(cw))
  assert forward.tiles_reach_past_a_warpgroup(config) == want
  # The shipped two-warpgroup config has none: 128-row tiles on 128-key blocks.
  assert not forward.tiles_reach_past_a_warpgroup(Config(64, 128, 2))


@pytest.mark.parametrize("config", [Config(64, 128, 2, True, "longest-first", 3),
                                    Config(64, 64, 2)])
def test_both_forwards_lower_and_differ(config):
  q = jax.ShapeDtypeStruct((1, 1000, 2, 64), jnp.bfloat16)
  texts = {}
  for dead in experiments.DEAD_BLOCKS:
    fn = jax.jit(lambda q, k, v: experiments.dot_product_attention(
        q, k, v, is_causal=True, config=config, dead_blocks=dead))
    with api.lowering_only():
      texts[dead] = jax.export.export(fn, platforms=["cuda"])(q, q, q).mlir_module()
    assert "mosaic_gpu" in texts[dead]
  assert texts["skip"] != texts["compute"]


def test_an_unknown_dead_blocks_is_refused_by_name():
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="dead_blocks"):
    experiments.dot_product_attention(x, x, x, is_causal=True, dead_blocks="sometimes")


def test_the_bench_variant_times_the_computing_forward():
  """bench --grid's ``auto,cdb`` lowers the forward with dead_blocks="compute"."""
  from harness.tools import bench_grid as bg
  assert bg.parse_variant("auto,cdb") is None and bg.dead_blocks_of("auto,cdb") == "compute"
  assert bg.dead_blocks_of("auto") == "skip"
  point = bg.Point(64, 4096, True)
  fns = bg.implementations(point, ["64,128,2,p,lf,w3", "64,128,2,p,lf,w3,cdb"], backward=False,
                           example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  with api.lowering_only():
    a, b = (jax.export.export(fns[f"ours {n}"], platforms=["cuda"])(q, q, q).mlir_module()
            for n in ("64,128,2,p,lf,w3", "64,128,2,p,lf,w3,cdb"))
  assert a != b
