"""The backward-parts benchmark (``python -m harness.tools.bench --backward-parts``)
traces and lowers for CUDA on every path it times, without a GPU: a tool
that breaks only on the device wastes a lease."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from harness.tools import bench
from kernel import api

# One shape per backward path: fused dQ (d128), causal d128 (the dQ kernel
# shipped, the fused one timed too), two launches of dK/dV plus the dQ kernel
# (d256).
SHAPES = [bench.BenchShape(1, 256, 2, 128, False), bench.BenchShape(1, 256, 2, 128, True),
          bench.BenchShape(1, 256, 2, 256, False)]


def _abstract_inputs(shape: bench.BenchShape):
  sds = jax.ShapeDtypeStruct
  dt = jnp.dtype(shape.dtype)
  big = (shape.batch, shape.seq, shape.heads, shape.head_dim)
  rows = (shape.batch, shape.heads, shape.seq)
  by_name = {"q": sds(big, dt), "k": sds(big, dt), "v": sds(big, dt), "do": sds(big, dt),
             "out": sds(big, dt), "m": sds(rows, jnp.float32), "l": sds(rows, jnp.float32),
             "rows": sds((shape.batch, shape.heads, 2, shape.seq), jnp.float32),
             "acc": sds(big, jnp.float32)}
  return [by_name[n] for n in bench.PART_INPUTS]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s.head_dim}-causal{s.causal}")
def test_every_part_lowers_for_cuda(shape):
  fns = bench.backward_part_fns(shape)
  # The fused kernel is timed wherever it can run; the shipped backward
  # takes it under causal only up to head dim 64 (kernel.tiling.backward_plan.blocks_for).
  assert ("dkv+fused dQ" in fns) == (shape.head_dim <= 128)
  # and so is deterministic=True's fixed point, with the scales it needs
  for part in ("rows+scales", "dkv+fixed-point dQ", "forward+backward deterministic"):
    assert (part in fns) == (shape.head_dim <= 128), part
  shipped = bench.shipped_parts(shape)
  assert set(shipped) <= set(fns)
  assert ("dkv+fused dQ" in shipped) == (shape.head_dim <= 64 if shape.causal
                                         else shape.head_dim <= 128)
  args = _abstract_inputs(shape)
  with api.lowering_only():
    for name, fn in fns.items():
      exported = jax.export.export(fn, platforms=["cuda"])(*args)
      assert exported.out_avals, name


def test_the_parts_table_has_a_row_per_shape_and_a_column_per_part():
  results = [(SHAPES[0], {"forward": 1.0, "dkv": 2.5}), (SHAPES[2], {"forward": 1.5, "rows": 0.05})]
  lines = bench.render_parts(results).splitlines()
  assert lines[0] == "| B | seq | heads | D | causal | forward | dkv | rows |"
  assert lines[2].endswith("| 1.000 | 2.500 | - |")
  assert lines[3].endswith("| 1.500 | - | 0.050 |")
