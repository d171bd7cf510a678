"""The dK/dV kernel's stream order (kernel/backward.py, notes above
``_dkv_coords``), checked on the CPU: the staggered order visits the same
(query head, query block) steps as the in-order one, each once, and the key
tiles of one head in flight together stream different query blocks."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from harness.tools import bench_grid as bg
from kernel import api
from kernel import backward


@dataclasses.dataclass(frozen=True)
class _At:
  """The fields of a DkvKernel that ``_dkv_coords`` reads, at one key tile."""
  hk: int
  group: int
  lo: int
  per_head: int
  rot: object


def _coords(hk, group, lo, per_head, j, tiles, order):
  i32 = jnp.int32
  rot = None
  if order == "staggered":  # _at_key_tile's rule
    rot = lax.div(i32(j) * i32(per_head), i32(tiles))
  at = _At(i32(hk), i32(group), i32(lo), i32(per_head), rot)
  t = jnp.arange(per_head * group, dtype=i32)
  h, i = backward._dkv_coords(at, t)
  return np.asarray(h), np.asarray(i)


@given(per_head=st.integers(1, 40), lo=st.integers(0, 9), group=st.integers(1, 4),
       hk=st.integers(0, 2), tiles=st.integers(1, 50), data=st.data())
@settings(max_examples=200, deadline=None)
def test_the_staggered_order_visits_every_step_once(per_head, lo, group, hk, tiles, data):
  j = data.draw(st.integers(0, tiles - 1), label="j")
  want = _coords(hk, group, lo, per_head, j, tiles, "in-order")
  got = _coords(hk, group, lo, per_head, j, tiles, "staggered")
  # The group's heads in the same turns, each over the same query blocks.
  np.testing.assert_array_equal(got[0], want[0])
  pairs = sorted(zip(*got))
  assert pairs == sorted(zip(*want)) and len(set(pairs)) == len(pairs)
  assert got[1].min() >= lo and got[1].max() < lo + per_head


@pytest.mark.parametrize("per_head,tiles", [(256, 128), (64, 32), (16, 8), (100, 37)])
def test_tiles_in_flight_together_stream_different_blocks(per_head, tiles):
  """Every key tile of a head at the same step t: in order they all read
  block t, staggered no two read the same block (per_head >= tiles)."""
  blocks = np.stack([_coords(0, 1, 0, per_head, j, tiles, "staggered")[1]
                     for j in range(tiles)])
  for t in range(per_head):
    assert len(set(blocks[:, t])) == tiles, t
  in_order = np.stack([_coords(0, 1, 0, per_head, j, tiles, "in-order")[1]
                       for j in range(tiles)])
  assert all(len(set(in_order[:, t])) == 1 for t in range(per_head))


def test_an_unknown_stream_order_is_refused_by_name():
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  m = l = jnp.zeros((1, 1, 64), jnp.float32)
  with pytest.raises(ValueError, match="stream_order"):
    backward.attention_backward(x, x, x, None, None, None, None, x, m, l, x, scale=1.0,
                                stream_order="sideways")


@pytest.mark.parametrize("text,det", [("auto,stg", False), ("auto,stg,det", True)])
def test_the_staggered_variant_lowers_its_own_kernel(text, det):
  """``auto,stg`` parses as auto and lowers, for CUDA, a dK/dV kernel other
  than ``auto``'s (with ``det``, the fixed-point dQ's int32 accumulator)."""
  assert bg.parse_variant(text) is None and bg.is_deterministic(text) is det
  assert bg.backward_of(text) == "pallas-staggered" and bg.backward_of("auto,det") == "pallas"
  point = bg.Point(128, 1024, False)
  base = "auto,det" if det else "auto"
  fns = bg.implementations(point, [base, text], backward=True, example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  texts = {}
  for name in (base, text):
    with api.lowering_only():
      texts[name] = jax.export.export(fns[f"ours {name}"], platforms=["cuda"])(
          q, q, q, q).mlir_module()
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", texts[name])) == 2, name
    accumulator = f"tensor<{point.batch}x{point.seq}x{point.heads}x{point.head_dim}xi32>"
    assert (accumulator in texts[name]) is det, name
  assert texts[base] != texts[text]
