"""The public API's contract on a machine without a GPU: bad input is a
ValueError naming the argument, a good call on a non-sm90 host is a clear
error (never a crash inside Mosaic GPU), configs are validated."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.numerics.bad_inputs import BAD_INPUT_CASES, base_call
from kernel import api
from kernel.tiling.config import Config


def _call(kwargs):
  kw = dict(kwargs)
  q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
  bias, mask = kw.pop("bias", None), kw.pop("mask", None)
  return api.dot_product_attention(q, k, v, bias, mask, **kw)


@pytest.mark.parametrize("case", BAD_INPUT_CASES, ids=[c.description for c in BAD_INPUT_CASES])
def test_api_rejects_bad_input_naming_the_argument(case):
  kwargs = {**base_call(), **case.changes()}
  with pytest.raises(ValueError, match="^" + re.escape(case.argument) + ": "):
    _call(kwargs)


@pytest.mark.parametrize("name,value", [("is_causal", 1), ("normalize_output", "yes"),
                                        ("return_residuals", None)])
def test_api_rejects_non_bool_flags(name, value):
  with pytest.raises(ValueError, match=f"^{name}: "):
    _call({**base_call(), name: value})


def test_api_rejects_head_dims_over_the_limit():
  call = base_call()
  rng = np.random.default_rng(0)
  call["query"] = rng.standard_normal((1, 8, 4, 320)).astype(call["query"].dtype)
  call["key"] = rng.standard_normal((1, 16, 2, 320)).astype(call["key"].dtype)
  with pytest.raises(ValueError, match="^query: head_dim 320 is over the limit 256"):
    _call(call)


def test_api_rejects_a_config_of_the_wrong_type():
  with pytest.raises(ValueError, match="^config: "):
    _call({**base_call(), "config": (64, 128, 2)})


@pytest.mark.parametrize("fields,match", [
    (dict(block_q=32), "config.block_q"), (dict(block_kv=96), "config.block_kv"),
    (dict(num_stages=1), "config.num_stages"), (dict(num_stages=5), "config.num_stages"),
    (dict(persistent=1), "config.persistent"), (dict(block_q=64.0), "config.block_q")])
def test_config_is_validated(fields, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    Config(**fields)


def test_a_valid_call_without_an_sm90_gpu_is_a_clear_error():
  if api.sm90_device() is not None:
    pytest.skip("this host has an sm90 GPU")
  with pytest.raises(api.UnsupportedDeviceError, match="sm90 GPU"):
    _call(base_call())


def test_vmap_and_jit_lower_for_cuda():
  """Batching adds a leading axis to every input and output."""
  sds = jax.ShapeDtypeStruct

  def f(q, k, v):
    return api.dot_product_attention(q, k, v, is_causal=True, return_residuals=True)

  args = [sds((3, 2, 200, 4, 64), jnp.bfloat16), sds((3, 2, 150, 2, 64), jnp.bfloat16),
          sds((3, 2, 150, 2, 96), jnp.bfloat16)]
  with api.lowering_only():
    exported = jax.export.export(jax.jit(jax.vmap(f)), platforms=["cuda"])(*args)
  out, m, l = exported.out_avals
  assert out.shape == (3, 2, 200, 4, 96)
  assert m.shape == l.shape == (3, 2, 4, 200)


def test_the_public_function_has_no_experiment_hooks():
  """The variants kept for measurement (kernel/experiments.py) are not part of
  the public signature, and a variant name that does not exist is refused."""
  import inspect
  import jax.numpy as jnp
  from kernel import api, experiments
  params = inspect.signature(api.dot_product_attention).parameters
  assert not [p for p in params if p.startswith("_")]
  assert set(inspect.signature(api.chosen_config).parameters) >= {"device_kind"}
  assert not [p for p in inspect.signature(api.chosen_config).parameters if p.startswith("_")]
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="backward"):
    experiments.dot_product_attention(q, q, q, backward="pallas-fast")
  with pytest.raises(TypeError, match="unexpected"):
    experiments.dot_product_attention(q, q, q, stage2d=False)
