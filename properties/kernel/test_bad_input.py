"""Malformed calls are rejected with a ValueError naming the argument.

The cases live in harness/numerics/bad_inputs.py so that the kernel's API test runs the
very same list.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.numerics.bad_inputs import BAD_INPUT_CASES, BadInputCase, base_call
from harness.numerics.online_softmax_model import online_softmax_attention
from harness.numerics.reference import (
  attention_reference,
  attention_reference_vjp,
  backward_from_residuals,
  naive_attention,
)
from kernel import api
from kernel.call import AttentionShapes, bfloat16, broadcastable_to, validate_attention_args

CASES = [pytest.param(c, id=c.description) for c in BAD_INPUT_CASES]
REFERENCE_CASES = [pytest.param(c, id=c.description)
                   for c in BAD_INPUT_CASES if c.reference]


def expect_rejection(case: BadInputCase):
  return pytest.raises(ValueError, match=rf"^{re.escape(case.argument)}: ")


def as_shape_dtype_structs(kwargs):
  """The same call with every array replaced by a jax.ShapeDtypeStruct."""
  out = {}
  for name, x in kwargs.items():
    if isinstance(x, np.ndarray) and x.ndim > 0:
      x = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out[name] = x
  return out


@pytest.mark.parametrize("case", CASES)
def test_validation_rejects(case):
  """validate_attention_args rejects the call, naming the argument, whether
  the arrays are NumPy arrays or ShapeDtypeStructs."""
  kwargs = case.call_kwargs()
  with expect_rejection(case):
    validate_attention_args(**kwargs)
  with expect_rejection(case):
    validate_attention_args(**as_shape_dtype_structs(kwargs))


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_rejects(case):
  """Every public function of the reference rejects the call the same way."""
  kwargs = case.call_kwargs()
  with expect_rejection(case):
    attention_reference(**kwargs)
  args = [kwargs.pop(n) for n in ("query", "key", "value", "bias", "mask")]
  d_out = np.ones((1, 8, 4, 64))
  with expect_rejection(case):
    attention_reference_vjp(*args, d_out, **kwargs)
  with expect_rejection(case):
    naive_attention(*args, dtype=bfloat16, **kwargs)
  with expect_rejection(case):
    backward_from_residuals(*args, d_out, np.zeros((1, 4, 8)), np.ones((1, 4, 8)),
                            d_out, **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_model_rejects(case):
  """The online-softmax model rejects the call (rescale_threshold included)."""
  kwargs = case.call_kwargs(with_threshold=True)
  if not case.reference and not case.sets_threshold:
    pytest.skip("the model, like the reference, accepts float64 inputs")
  with expect_rejection(case):
    online_softmax_attention(**kwargs)


def test_base_call_is_valid():
  """The base call every bad case starts from is itself accepted, as NumPy,
  JAX arrays and ShapeDtypeStructs (so each bad case fails for its one change)."""
  kwargs = base_call()
  want = AttentionShapes(B=1, T=8, N=4, H=64, S=16, K=2, Hv=64)
  assert validate_attention_args(**kwargs, rescale_threshold=0.5) == want
  jax_kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                for n, x in kwargs.items()}
  assert validate_attention_args(**jax_kwargs) == want
  assert validate_attention_args(**as_shape_dtype_structs(kwargs)) == want
  attention_reference(**kwargs)
  online_softmax_attention(**kwargs, rescale_threshold=0.5)


@pytest.mark.parametrize("shape", [
  (), (16,), (8, 16), (1, 16), (8, 1), (4, 1, 1), (1, 4, 8, 16), (1, 1, 1, 1),
])
def test_every_broadcastable_bias_and_mask_shape_is_accepted(shape):
  """Right-aligned NumPy broadcasting to (B, N, T, S) = (1, 4, 8, 16)."""
  kwargs = base_call()
  kwargs["bias"] = np.zeros(shape, bfloat16)
  kwargs["mask"] = np.ones(shape, bool)
  validate_attention_args(**kwargs)
  ref = attention_reference(**kwargs)
  assert ref.out.shape == (1, 8, 4, 64)


def test_broadcastable_to_follows_numpy():
  """broadcastable_to agrees with numpy.broadcast_to on small shapes."""
  target = (2, 3, 1, 4)
  for shape in [(), (4,), (1, 4), (3, 1, 4), (2, 3, 1, 4), (2, 1, 1, 1), (5,),
                (3, 4), (1, 2, 3, 1, 4), (2, 3, 2, 4), (1, 1)]:
    try:
      np.broadcast_to(np.zeros(shape), target)
      ok = True
    except ValueError:
      ok = False
    assert broadcastable_to(shape, target) == ok, shape


@pytest.mark.parametrize("shape,dtype", [((1, 128, 2, 32), "bfloat16"),
                                         ((1, 128, 2, 64), "float32"),
                                         ((1, 128, 2, 64), "int32")],
                         ids=["wrong-shape", "wrong-dtype", "integer"])
def test_a_wrong_cotangent_is_refused_by_name(shape, dtype):
  """jax.vjp's pullback refuses a cotangent that is not out's shape and
  dtype, naming both, before any backward kernel is traced."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((1, 128, 2, 64), jnp.bfloat16), sds((1, 128, 1, 64), jnp.bfloat16)

  def pull(q, k, v, ct):
    _, vjp = jax.vjp(lambda q, k, v: api.dot_product_attention(q, k, v), q, k, v)
    return vjp(ct)

  with pytest.raises(ValueError, match=r"argument to VJP function: got .*expected bfloat16\[1,128,2,64\]"):
    with api.lowering_only():
      jax.export.export(jax.jit(pull), platforms=["cuda"])(q, k, k, sds(shape, jnp.dtype(dtype)))
