"""Out-of-bounds writes of the forward kernel: guard bands around its outputs.

A fresh output array cannot show a write past its end: the TMA unit drops a
store outside the array it was described with, and the API slices the
padded rows off anyway.  So the kernel is launched here on its padded inputs
(as ``kernel.api`` pads them) with its outputs placed inside larger,
NaN-filled mutable arrays (``flash_attention_forward(..., outputs=...)``):
rows from the padded length on are a guard band that must stay NaN, and the
rows of the real queries must be, bit for bit, what the API returns.  The
cuDNN frontend's tests surround outputs with NaN guards the same way.

The catalogued mutant ``extra-query-tile`` (harness/mutants.py) rounds the
tile count up past the padded end: its results through the API are right,
and only this property sees the extra tile's writes.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from harness.conformance import ForwardCase, random_case, run_kernel
from kernel.config import Config

GUARD_ROWS = 40   # any positive count catches a write one row past the end


def _padded_call(fc: ForwardCase, config: Config, guard: int):
  """A function of (q, k, v, bias, mask, k_start, k_end) returning the
  guarded (out, m, l) buffers whole, and the padded lengths (Tp, Dv_pad)."""
  import jax
  import jax.numpy as jnp
  from kernel import api, padding
  from kernel.forward import Features, flash_attention_forward

  B, T, N, H = fc.query.shape
  S, hv = fc.key.shape[1], fc.value.shape[3]
  problem = api.resolved_problem(fc.query, fc.key, fc.value, fc.bias, fc.mask,
                                 is_causal=fc.is_causal, return_residuals=True,
                                 k_start=fc.k_start, k_end=fc.k_end, config=config)
  dtype = jnp.dtype(problem.dtype)
  features = Features(
      scale=float(H ** -0.5 if fc.scale is None else fc.scale), is_causal=fc.is_causal,
      logits_soft_cap=fc.logits_soft_cap,
      rescale_threshold=api._effective_threshold(fc.rescale_threshold, dtype),
      normalize_output=fc.normalize_output, return_residuals=True, seq_q=T, seq_kv=S,
      stage_2d=problem.bias_2d or problem.mask_2d)
  tile = 2 * config.block_q
  t_pad = -(-T // tile) * tile
  dv_pad = -(-hv // 64) * 64

  @jax.jit
  def call(q, k, v, bias, mask, k_start, k_end):
    pad = padding.pad_to_multiple
    q = pad(pad(q.astype(dtype), 3, 64), 1, tile)
    k = pad(pad(k.astype(dtype), 3, 64), 1, config.block_kv)
    v = pad(pad(v.astype(dtype), 3, 64), 1, config.block_kv)
    if bias is not None:
      bias = padding.broadcast_operand(bias, dtype, tile, config.block_kv)
    if mask is not None:
      mask = padding.broadcast_operand(mask, jnp.int8, tile, config.block_kv)
    ks, ke, tiles = padding.key_ranges(k_start, k_end, seq_kv=S, tile=tile,
                                       num_tiles=t_pad // tile)
    rows = t_pad + guard
    outputs = (jax.new_ref(jnp.full((B, rows, N, dv_pad), jnp.nan, dtype)),
               jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)),
               jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)))
    flash_attention_forward(q, k, v, bias, mask, ks, ke, tiles, features=features,
                            config=config, num_sms=api._num_sms(), outputs=outputs)
    return tuple(r[...] for r in outputs)

  return call, t_pad, dv_pad


def _arrays(fc: ForwardCase):
  import jax.numpy as jnp
  j = lambda x: None if x is None else jnp.asarray(x)
  return (j(fc.query), j(fc.key), j(fc.value), j(fc.bias), j(fc.mask), j(fc.k_start),
          j(fc.k_end))


def _cases():
  """(name, case, config): ragged lengths, both schedules, causal, GQA, key
  ranges with empty rows, a 2-D mask, head dims 72/96 and 256."""
  rng = np.random.default_rng(18)
  out = []
  for persistent in (False, True):
    p = "persistent" if persistent else "nonpersistent"
    c = random_case(rng, seq_q=113, seq_kv=203, head_dim=72, head_dim_out=96)
    out.append((f"ragged-113x203-d72-dv96-{p}", c, Config(64, 128, 2, persistent)))
    c = random_case(rng, batch=2, seq_q=239, seq_kv=1, heads=4, kv_heads=2, head_dim=64)
    out.append((f"ragged-239x1-gqa-{p}", c, Config(64, 64, 2, persistent)))
    c = random_case(rng, seq_q=1023, seq_kv=1024, head_dim=128, is_causal=True)
    out.append((f"causal-1023x1024-bq128-{p}", c, Config(128, 64, 3, persistent)))
    c = random_case(rng, batch=2, seq_q=300, seq_kv=384, heads=2, kv_heads=1, head_dim=64)
    c.k_start = rng.integers(0, 384, (2, 2, 300)).astype(np.int32)
    c.k_end = (c.k_start + rng.integers(-20, 384, (2, 2, 300))).astype(np.int32)
    c.mask = rng.random((2, 1, 300, 384)) < 0.7
    out.append((f"key-ranges-2d-mask-{p}", c, Config(64, 128, 2, persistent)))
  c = random_case(rng, seq_q=200, seq_kv=150, head_dim=256, dtype="float16")
  out.append(("d256-f16-nonpersistent", c, Config(64, 64, 2, False)))
  return out


_CASES = _cases()


@pytest.mark.gpu
@pytest.mark.parametrize("name,fc,config", _CASES, ids=[n for n, _, _ in _CASES])
def test_the_forward_writes_nothing_past_its_padded_outputs(name, fc, config):
  """Inside NaN-filled buffers GUARD_ROWS longer than the padded outputs, the
  forward leaves every guard row of out, m and l NaN, writes the padded value
  columns as exact zeros (V is zero there), and gives the real rows the API's
  bits."""
  call, t_pad, dv_pad = _padded_call(fc, config, GUARD_ROWS)
  out, m, l = (np.asarray(x.astype(np.float32) if x.dtype != np.float32 else x)
               for x in call(*_arrays(fc)))
  T, hv = fc.query.shape[1], fc.value.shape[3]
  for what, guard in (("out", out[:, t_pad:]), ("m", m[..., t_pad:]), ("l", l[..., t_pad:])):
    written = ~np.isnan(guard)
    assert not written.any(), (
        f"{what}: {int(written.sum())} guard entries written past row {t_pad}; first at "
        f"{np.argwhere(written)[0].tolist()}")
  assert np.all(out[:, :t_pad, :, hv:dv_pad] == 0.0), "padded value columns not zero"
  want = run_kernel(fc, config=config)
  got = (out[:, :T, :, :hv], m[..., :T], l[..., :T])
  for what, a, b in zip(("out", "m", "l"), got, want):
    assert np.array_equal(np.asarray(a, np.float64), b, equal_nan=True), (
        f"{what}: the guarded launch differs from the API's")


def test_the_guarded_launch_lowers_for_cuda():
  """CPU: the guarded launch (outputs as mutable operands, no fresh outputs)
  lowers for CUDA and keeps its Mosaic GPU kernel."""
  import jax
  from kernel import api
  name, fc, config = _CASES[3]  # key ranges and a 2-D mask, non-persistent
  call, _, _ = _padded_call(fc, config, GUARD_ROWS)
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _arrays(fc)]
  with api.lowering_only():
    exported = jax.export.export(call, platforms=["cuda"])(*args)
  assert "mosaic_gpu" in exported.mlir_module()
  out_aval = exported.out_avals[0]
  assert out_aval.shape[1] == 384 + GUARD_ROWS


def test_outputs_of_the_wrong_shape_are_refused():
  import jax
  import jax.numpy as jnp
  from kernel import api
  name, fc, config = _CASES[0]
  call, _, _ = _padded_call(fc, config, -1)   # one row short of the padded length
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _arrays(fc)]
  with api.lowering_only(), pytest.raises(ValueError, match="outputs: out must be"):
    jax.export.export(call, platforms=["cuda"])(*args)
