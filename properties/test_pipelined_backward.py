"""The pipelined head-split launches (kernel/backward.py, notes above
``_wide_pipelined_steps`` and ``_wide_dq_pipelined_steps``), checked on the CPU: it lowers for CUDA at the
head dims that take the head split, differs from the shipped launch there
and nowhere else, bench --grid names it ``,pip``, and the proof's backward
cases cover its launches (``python -m harness prove`` proves them)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from harness.proofs import cases
from harness.tools import bench_grid as bg
from kernel import api, backward, experiments


def _lowered(name, head_dim, causal):
  q = jax.ShapeDtypeStruct((1, 333, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 333, 2, head_dim), jnp.bfloat16)

  def grads(q, k, v):
    loss = lambda q, k, v: experiments.dot_product_attention(
        q, k, v, is_causal=causal, backward=name).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  with api.lowering_only():
    # The jaxpr (the kernels' bodies included), not the lowered module,
    # whose serialised kernels differ between two lowerings of one source.
    text = str(jax.make_jaxpr(grads)(q, k, k))
    module = jax.export.export(jax.jit(grads), platforms=["cuda"])(q, k, k).mlir_module()
  return text, len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", module))


@pytest.mark.parametrize("head_dim,causal", [(256, False), (192, True), (128, False)])
def test_pipelined_lowers_and_changes_only_the_head_split(head_dim, causal):
  (shipped, n_shipped), (pipelined, n_pipelined) = (
      _lowered(n, head_dim, causal) for n in ("pallas", "pallas-pipelined"))
  assert n_shipped == n_pipelined >= 2
  split = backward.blocks_for(head_dim, head_dim, is_causal=causal).head_split
  # The partial's own repr names the schedule; the programs are what differ.
  pipelined = pipelined.replace("schedule='pipelined', ", "")
  assert (shipped != pipelined) is split


def test_the_bench_flag_and_the_proof_cases():
  assert bg.backward_of("auto,pip") == "pallas-pipelined"
  assert bg.backward_of("auto,pip,det") == "pallas-pipelined" and bg.parse_variant("auto,pip") is None
  with pytest.raises(ValueError, match="more than one backward"):
    bg.backward_of("auto,stg,pip")
  pipelined = [c for c in cases.backward_cases() if c.schedule == "pipelined"]
  assert pipelined and all(
      backward.blocks_for(c.head_dim, c.head_dim, is_causal=c.causal).head_split
      for c in pipelined)
  assert {(c.causal, c.bias) for c in pipelined} == {(a, b) for a in (False, True)
                                                      for b in (False, True)}
