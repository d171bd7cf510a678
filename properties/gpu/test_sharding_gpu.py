"""Attention on a mesh of GPUs equals attention on one GPU (marker ``gpu``).

``jax.jit`` over inputs sharded by batch, by heads, or both
(``kernel/sharding.py``'s rule runs each device's kernels on its shard) gives
the single-device program's results: out, m, l, dK, dV bitwise; dQ bitwise
with the two-kernel backward (``backward="pallas-two-kernel"``) and within
``harness.numerics.tolerance.run_to_run_bound`` with the shipped fused dQ (its float32
reduce-adds run in no fixed order, single device or not); dbias bitwise
where the bias is sharded like the query, and within a few bf16 roundings
where it broadcasts over a sharded axis (2^-5 of its largest entry: the
per-device partial sums are rounded to the bias dtype before their
all-reduce).

Explicit mesh axes (``jax.set_mesh``, a shard_map inside) are held to the
same results.  The one-device mesh runs on any sm90 host.  The others need as many GPUs in
this process: run this file with ``-n 0`` (under pytest-xdist each worker is
given one GPU, properties/conftest.py) on a host with 2 or more; elsewhere
they are skipped, saying why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from harness.numerics.tolerance import run_to_run_bound
from kernel import experiments

pytestmark = pytest.mark.gpu

# name -> (batch shards, head shards) as a function of the device count n;
# None where the host has too few devices for that mesh to shard anything.
MESHES = {
    "one-device": lambda n: (1, 1),
    "batch": lambda n: (n, 1) if n >= 2 else None,
    "heads": lambda n: (1, n) if n >= 2 else None,
    "batch-x-heads": lambda n: (2, n // 2) if n >= 4 and n % 2 == 0 else None,
}


def _mesh(name, explicit=False):
  n = len(jax.devices())
  dims = MESHES[name](n)
  if dims is None:
    pytest.skip(f"mesh {name!r} needs more GPUs than the {n} this process sees "
                "(run with -n 0 on a host with 2 or more; 4 for batch-x-heads)")
  nb, nh = dims
  devices = np.array(jax.devices()[:nb * nh]).reshape(nb, nh)
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return Mesh(devices, ("data", "model"), axis_types=(kind, kind)), nb, nh


def _inputs(nb, nh, *, bias_batch, seed=0):
  """Per device: batch 2, 4 query heads on 2 kv heads; ragged T and S (the
  padding runs per shard too).  A bias of (B|1, N, T, S)."""
  rng = np.random.default_rng(seed)
  B, T, N, K, S, H = 2 * nb, 300, 4 * nh, 2 * nh, 200, 64
  r = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32)).astype(jnp.bfloat16)
  bias = r(B if bias_batch else 1, N, T, S)
  mask = jnp.asarray(rng.random((B, 1, T, S)) > 0.1)
  return dict(q=r(B, T, N, H), k=r(B, S, K, H), v=r(B, S, K, H), bias=bias, mask=mask,
              d_out=r(B, T, N, H))


def _specs(bias_batch):
  qkv = P("data", None, "model", None)
  return dict(q=qkv, k=qkv, v=qkv, bias=P("data" if bias_batch else None, "model"),
              mask=P("data"), d_out=qkv)


def _program(backward, is_causal):
  def forward(q, k, v, bias, mask):
    return experiments.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal,
                                     return_residuals=True, backward=backward)

  def grads(q, k, v, bias, mask, d_out):
    def loss(q, k, v, bias):
      out = experiments.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal,
                                      backward=backward)
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  return jax.jit(forward), jax.jit(grads)


def _run(mesh, inputs, specs, backward, is_causal):
  fwd, grads = _program(backward, is_causal)
  if mesh is None:
    dev = jax.devices()[0]
    placed = {n: jax.device_put(x, dev) for n, x in inputs.items()}
  else:
    placed = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in inputs.items()}
  out, (m, l) = fwd(*(placed[n] for n in ("q", "k", "v", "bias", "mask")))
  dq, dk, dv, dbias = grads(*(placed[n] for n in ("q", "k", "v", "bias", "mask", "d_out")))
  if mesh is not None:
    # The results stay where the rule put them: sharded like the query.
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["q"]), out.ndim), out.sharding
  as_np = lambda x: np.asarray(x.astype(jnp.float32))
  return {n: as_np(x) for n, x in dict(out=out, m=m, l=l, dq=dq, dk=dk, dv=dv,
                                         dbias=dbias).items()}


def _bitwise(name, got, want):
  assert got.shape == want.shape, (name, got.shape, want.shape)
  same = (got == want) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (f"{name}: {np.count_nonzero(~same)} of {same.size} entries differ, "
                      f"max |diff| {np.nanmax(np.abs(got - want))}")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backward", ["pallas-two-kernel", "pallas"])
@pytest.mark.parametrize("bias_batch", [True, False], ids=["bias-per-batch", "bias-broadcast"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_equals_single_device(mesh_name, bias_batch, backward, is_causal):
  """jit over batch/head-sharded inputs gives the one-device results: out,
  m, l, dK, dV (and dQ with the two-kernel backward) bitwise."""
  mesh, nb, nh = _mesh(mesh_name)
  inputs = _inputs(nb, nh, bias_batch=bias_batch)
  specs = _specs(bias_batch)
  want = _run(None, inputs, specs, backward, is_causal)
  got = _run(mesh, inputs, specs, backward, is_causal)
  for name in ("out", "m", "l", "dk", "dv"):
    _bitwise(name, got[name], want[name])
  if backward == "pallas-two-kernel":
    _bitwise("dq", got["dq"], want["dq"])
  else:
    ratio = run_to_run_bound(got["dq"], want["dq"], jnp.bfloat16)
    assert ratio <= 1.0, f"dq: {ratio:.3g} x the run-to-run bound"
  if bias_batch or nb == 1:
    _bitwise("dbias", got["dbias"], want["dbias"])
  else:
    # The nb per-device partial sums are rounded to bf16 (2^-8 relative)
    # before the all-reduce: a few roundings of |dbias|, where a missing or
    # doubled partial sum is off by about |dbias| itself.
    scale = np.max(np.abs(want["dbias"]))
    err = np.max(np.abs(got["dbias"] - want["dbias"]))
    assert err <= 2.0 ** -5 * scale, (err, scale)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_explicit_sharding_equals_single_device(mesh_name):
  """With Explicit mesh axes (``jax.set_mesh``; the call goes through a
  shard_map) the results are the one-device results, bitwise."""
  mesh, nb, nh = _mesh(mesh_name, explicit=True)
  inputs = _inputs(nb, nh, bias_batch=True)
  specs = _specs(True)
  want = _run(None, inputs, specs, "pallas-two-kernel", False)
  with jax.set_mesh(mesh):
    got = _run(mesh, inputs, specs, "pallas-two-kernel", False)
  for name in ("out", "m", "l", "dq", "dk", "dv", "dbias"):
    _bitwise(name, got[name], want[name])
