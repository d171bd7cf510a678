"""harness/tools/fp8_accumulation.py, the GPU probe of how FP8 wgmma sums
q·k: its kernels lower for CUDA on the CPU, its model of a truncated sum
is exact at float64's precision and not at 13 bits, and without an sm90
GPU it says so and exits 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools import fp8_accumulation as acc


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_both_products_lower_for_cuda(head_dim):
  q = jax.ShapeDtypeStruct((acc.ROWS, head_dim), jnp.float8_e4m3fn)
  k = jax.ShapeDtypeStruct((acc.KEYS, head_dim), jnp.float8_e4m3fn)
  for fn in (acc.qk_whole, acc.qk_parts):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(q, k)
    assert "mosaic_gpu" in exported.mlir_module()


def test_the_truncated_sum_is_exact_at_full_precision_only():
  q8, k8 = acc.operands("one-hot", 128, np.random.default_rng(1))
  exact = q8.astype(np.float64) @ k8.astype(np.float64).T
  assert np.array_equal(acc.truncated_sum(q8, k8, 52), exact)
  err = np.abs(acc.truncated_sum(q8, k8, 13) - exact).max()
  # each of the 4 cuts loses less than one unit in the 13th bit of the sum so far
  parts = 128 // acc.PART
  assert 0 < err < parts * np.abs(exact).max() * 2.0 ** -12, err
  with pytest.raises(ValueError, match="kind"):
    acc.operands("zeros", 64, np.random.default_rng(0))


def test_without_an_sm90_gpu_it_exits_2(capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is visible: the probe would run")
  assert acc.main([]) == 2
  assert "sm90" in capsys.readouterr().err
