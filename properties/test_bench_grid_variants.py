"""bench --grid's variant syntax (harness/tools/bench_grid.py), checked on the CPU:
each variant names the call it times, and the deterministic one lowers to
the two-kernel backward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from harness.tools import bench_grid as bg
from kernel import api
from kernel.config import Config


@pytest.mark.parametrize("text,config,det", [
    ("auto", None, False),
    ("auto,det", None, True),
    ("64,128,2", Config(64, 128, 2, False), False),
    ("64,128,2,p,lf,det", Config(64, 128, 2, True, "longest-first"), True),
])
def test_variants_parse(text, config, det):
  assert bg.parse_variant(text) == config
  assert bg.is_deterministic(text) is det


@pytest.mark.parametrize("text", ["x", "64,128", "64,128,2,q", "auto,p"])
def test_bad_variants_are_refused_by_text(text):
  with pytest.raises(ValueError, match="--variants"):
    bg.parse_variant(text)


def test_the_deterministic_variant_times_the_two_kernel_backward():
  point = bg.Point(64, 1024, False)
  fns = bg.implementations(point, ["auto", "auto,det"], backward=True, example=False)
  sds = jax.ShapeDtypeStruct
  q = sds((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  counts = {}
  for name in ("ours auto", "ours auto,det"):
    with api.lowering_only():
      text = jax.export.export(fns[name], platforms=["cuda"])(q, q, q, q).mlir_module()
    counts[name] = len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text))
  assert counts == {"ours auto": 2, "ours auto,det": 3}
