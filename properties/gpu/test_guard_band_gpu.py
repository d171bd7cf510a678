"""Out-of-bounds writes of the forward kernel: guard bands around its outputs.

A fresh output array cannot show a write past its end: the TMA unit drops a
store outside the array it was described with, and the API slices the
padded rows off anyway.  So the kernel is launched here on the inputs the
API prepares (``kernel.api._forward``, unpadded where TMA reads so) with its
outputs placed inside larger, NaN-filled mutable arrays
(``flash_attention_forward(..., outputs=...)``): rows from the last query
tile's end on are a guard band that must stay NaN, and the rows of the real
queries must be, bit for bit, what the API returns.  The cuDNN frontend's
tests surround outputs with NaN guards the same way.

The catalogued mutants ``extra-query-tile`` (the tile count rounded up past
the end: its results through the API are right) and ``l-store-one-row-late``
(harness/tools/mutants.py) write past the end; this property sees those writes.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.numerics.conformance import random_case, run_kernel
from kernel.call import Call
from kernel.tiling.config import Config
from kernel.tiling import plan

GUARD_ROWS = 40   # any positive count catches a write one row past the end


def _api_launch(fc: Call, config: Config):
  """The problem, config and SM count ``dot_product_attention``
  resolves for this case (its own code, up to the launch), copied padded:
  under untiled copies (kernel.tiling.plan.untiled_copies_pay) the output
  is written in column parts into a fresh array, whose end the TMA unit
  clips, and m and l are stored by the same code either way."""
  from unittest import mock
  from kernel import api
  got = {}

  def record(problem, config, backward, num_sms):
    got.update(problem=problem.for_launch(config).replace(untiled_copies=False),
               config=config, num_sms=num_sms)
    return lambda *args: (None, (None, None))  # (out, (m, l)), never used

  with mock.patch.object(api, "_differentiable", record), api.lowering_only():
    q, k, v, bias, mask, k_start, k_end = _arrays(fc)
    api.dot_product_attention(q, k, v, bias, mask, k_start=k_start, k_end=k_end,
                              scale=fc.scale, is_causal=fc.is_causal,
                              logits_soft_cap=fc.logits_soft_cap,
                              rescale_threshold=fc.rescale_threshold,
                              normalize_output=fc.normalize_output, return_residuals=True,
                              config=config)
  return got


def _padded_call(fc: Call, config: Config, guard: int):
  """A function of (q, k, v, bias, mask, k_start, k_end) returning the
  guarded (out, m, l) buffers whole, and the padded lengths (Tp, Dv_pad).

  The inputs are prepared by the API's own ``_forward`` (unpadded along the
  sequence where TMA can read them so); only its launch is replaced by one
  into NaN-filled buffers ``guard`` rows longer than the query tiles."""
  import jax
  import jax.numpy as jnp
  from unittest import mock
  from kernel import api
  from kernel.forward import flash_attention_forward

  launch_kw = _api_launch(fc, config)
  tile = config.tile_q
  t_pad = -(-fc.query.shape[1] // tile) * tile
  dv_pad = -(-fc.value.shape[3] // 64) * 64

  @jax.jit
  def call(q, k, v, bias, mask, k_start, k_end):
    whole = []

    def guarded_launch(problem, config, q, k, v, *rest, **kw):
      B, _, N, _ = q.shape
      rows = t_pad + guard
      refs = (jax.new_ref(jnp.full((B, rows, N, v.shape[3]), jnp.nan, q.dtype)),
              jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)),
              jax.new_ref(jnp.full((B, N, rows), jnp.nan, jnp.float32)))
      flash_attention_forward(problem, config, q, k, v, *rest, outputs=refs, **kw)
      whole.extend(r[...] for r in refs)
      return whole[0], tuple(whole[1:])

    with mock.patch.object(api, "flash_attention_forward", guarded_launch):
      api._forward.__wrapped__(launch_kw["problem"], launch_kw["config"], launch_kw["num_sms"],
                               q, k, v, bias, mask, k_start, k_end)
    return tuple(whole)

  return call, t_pad, dv_pad


def _arrays(fc: Call):
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
    # Lengths TMA reads unpadded (multiples of 8, head dims of 64s): the
    # last tile's stores are clipped only by the array's end.
    c = random_case(rng, batch=2, seq_q=200, seq_kv=328, heads=2, head_dim=128)
    out.append((f"unpadded-200x328-d128-{p}", c, Config(64, 128, 2, persistent)))
    c = random_case(rng, batch=2, seq_q=300, seq_kv=384, heads=2, kv_heads=1, head_dim=64)
    c = c.replace(k_start=rng.integers(0, 384, (2, 2, 300)).astype(np.int32))
    c = c.replace(k_end=(c.k_start + rng.integers(-20, 384, (2, 2, 300))).astype(np.int32))
    c = c.replace(mask=rng.random((2, 1, 300, 384)) < 0.7)
    out.append((f"key-ranges-2d-mask-{p}", c, Config(64, 128, 2, persistent)))
  c = random_case(rng, seq_q=200, seq_kv=150, head_dim=256, dtype="float16")
  out.append(("d256-f16-nonpersistent", c, Config(64, 64, 2, False)))
  # Three compute warpgroups: 192-row tiles, so 1000 rows end in a tile of
  # 40 real rows, and key ranges with empty rows.
  rng = np.random.default_rng(192)
  for persistent in (False, True):
    p = "persistent" if persistent else "nonpersistent"
    c = random_case(rng, batch=2, seq_q=1000, seq_kv=777, heads=4, kv_heads=2, head_dim=64,
                    is_causal=True)
    c = c.replace(k_start=rng.integers(0, 400, (2, 4, 1000)).astype(np.int32))
    c = c.replace(k_end=(c.k_start + rng.integers(-50, 777, (2, 4, 1000))).astype(np.int32))
    out.append((f"three-warpgroups-causal-1000x777-gqa-ranges-{p}", c,
                Config(*plan.THREE_WARPGROUP_TILING, persistent, compute_warpgroups=3)))
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


def _case(name):
  ((fc, config),) = [(c, cfg) for n, c, cfg in _CASES if n == name]
  return fc, config


@pytest.mark.parametrize("name", ["key-ranges-2d-mask-nonpersistent",
                                  "unpadded-200x328-d128-persistent"])
def test_the_guarded_launch_lowers_for_cuda(name):
  """CPU: the guarded launch (outputs as mutable operands, no fresh outputs)
  lowers for CUDA and keeps its Mosaic GPU kernel."""
  import jax
  from kernel import api
  fc, config = _case(name)
  call, t_pad, _ = _padded_call(fc, config, GUARD_ROWS)
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _arrays(fc)]
  with api.lowering_only():
    exported = jax.export.export(call, platforms=["cuda"])(*args)
  assert "mosaic_gpu" in exported.mlir_module()
  out_aval = exported.out_avals[0]
  assert out_aval.shape[1] == t_pad + GUARD_ROWS


def test_outputs_of_the_wrong_shape_are_refused():
  import jax
  from kernel import api
  fc, config = _case("ragged-113x203-d72-dv96-nonpersistent")  # q padded to whole tiles
  call, _, _ = _padded_call(fc, config, -1)   # one row short of the padded length
  args = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _arrays(fc)]
  with api.lowering_only(), pytest.raises(ValueError, match="outputs: out must be"):
    jax.export.export(call, platforms=["cuda"])(*args)
