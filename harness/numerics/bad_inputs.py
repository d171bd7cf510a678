"""Malformed attention calls, one per rule of kernel/call.py.

Each :class:`BadInputCase` builds the arguments of one call that must raise
``ValueError`` with a message starting ``"<argument>: "``. The same list is
run against the float64 reference, the online-softmax model and the kernel's
public API, so the three reject the same calls the same way.

The well-formed base call is small but kernel-shaped (head dim 64, bfloat16):
B=1, T=8, N=4, H=64, S=16, K=2, Hv=64. Each case changes one thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from kernel.call import bfloat16

__all__ = ["BadInputCase", "BAD_INPUT_CASES", "FP8_BAD_INPUT_CASES", "base_call", "fp8_base_call",
           "BASE_SHAPES"]

B, T, N, H, S, K, Hv = 1, 8, 4, 64, 16, 2, 64
BASE_SHAPES = dict(B=B, T=T, N=N, H=H, S=S, K=K, Hv=Hv)


def _normal(shape, dtype=bfloat16, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def base_call() -> dict[str, Any]:
  """A well-formed call: query, key, value and every optional argument set."""
  return dict(
    query=_normal((B, T, N, H), seed=1),
    key=_normal((B, S, K, H), seed=2),
    value=_normal((B, S, K, Hv), seed=3),
    bias=_normal((B, N, T, S), seed=4),
    mask=np.ones((B, N, T, S), dtype=bool),
    scale=0.125,
    k_start=np.zeros((B, N, T), dtype=np.int32),
    k_end=np.full((B, N, T), S, dtype=np.int32),
    logits_soft_cap=30.0,
  )


@dataclasses.dataclass(frozen=True)
class BadInputCase:
  """One malformed call.

  description: what is wrong, for test ids.
  argument:    the argument the ValueError must name (message prefix).
  changes:     builds the arguments that replace the base call's.
  reference:   whether the float64 reference rejects it too (it accepts
               float64 inputs and has no rescale_threshold).
  """

  description: str
  argument: str
  changes: Callable[[], dict[str, Any]]
  reference: bool = True

  def call_kwargs(self, *, with_threshold: bool = False) -> dict[str, Any]:
    """The full keyword arguments of the call (base call plus changes).

    ``rescale_threshold`` is only included when ``with_threshold`` or when the
    case sets it.
    """
    kwargs = base_call()
    if with_threshold:
      kwargs["rescale_threshold"] = 1.0
    kwargs.update(self.changes())
    return kwargs

  @property
  def sets_threshold(self) -> bool:
    return "rescale_threshold" in self.changes()

  def __str__(self) -> str:
    return self.description


BAD_INPUT_CASES: tuple[BadInputCase, ...] = (
  # Ranks and sizes.
  BadInputCase("query rank 3", "query",
               lambda: dict(query=_normal((T, N, H)))),
  BadInputCase("query rank 5", "query",
               lambda: dict(query=_normal((B, T, N, H, 1)))),
  BadInputCase("key rank 3", "key", lambda: dict(key=_normal((S, K, H)))),
  BadInputCase("value rank 5", "value",
               lambda: dict(value=_normal((B, S, K, Hv, 1)))),
  BadInputCase("query with zero length", "query",
               lambda: dict(query=_normal((B, 0, N, H)),
                            bias=None, mask=None, k_start=None, k_end=None)),
  BadInputCase("key batch differs from query batch", "key",
               lambda: dict(key=_normal((B + 1, S, K, H)),
                            value=_normal((B + 1, S, K, Hv)))),
  BadInputCase("key head dim differs from query head dim", "key",
               lambda: dict(key=_normal((B, S, K, H + 8)))),
  BadInputCase("value batch differs from query batch", "value",
               lambda: dict(value=_normal((B + 1, S, K, Hv)))),
  BadInputCase("value sequence length differs from key's", "value",
               lambda: dict(value=_normal((B, S + 1, K, Hv)))),
  BadInputCase("value heads differ from key heads", "value",
               lambda: dict(value=_normal((B, S, K + 1, Hv)))),
  BadInputCase("query heads not a multiple of key heads", "key",
               lambda: dict(key=_normal((B, S, 3, H)),
                            value=_normal((B, S, 3, Hv)))),
  # Dtypes.
  BadInputCase("integer query", "query",
               lambda: dict(query=np.ones((B, T, N, H), np.int32),
                            key=np.ones((B, S, K, H), np.int32),
                            value=np.ones((B, S, K, Hv), np.int32))),
  BadInputCase("float64 query (kernel only; the reference takes it)", "query",
               lambda: dict(query=_normal((B, T, N, H), np.float64),
                            key=_normal((B, S, K, H), np.float64),
                            value=_normal((B, S, K, Hv), np.float64)),
               reference=False),
  BadInputCase("key dtype differs from query dtype", "key",
               lambda: dict(key=_normal((B, S, K, H), np.float16))),
  BadInputCase("value dtype differs from query dtype", "value",
               lambda: dict(value=_normal((B, S, K, Hv), np.float32))),
  # Bias.
  BadInputCase("bias rank 5", "bias",
               lambda: dict(bias=_normal((1, B, N, T, S)))),
  BadInputCase("bias key length not broadcastable", "bias",
               lambda: dict(bias=_normal((B, N, T, S + 1)))),
  BadInputCase("bias heads not broadcastable", "bias",
               lambda: dict(bias=_normal((B, 3, T, S)))),
  BadInputCase("bias of rank 2 misaligned (S, T)", "bias",
               lambda: dict(bias=_normal((S, T)))),
  BadInputCase("integer bias", "bias",
               lambda: dict(bias=np.ones((B, N, T, S), np.int32))),
  BadInputCase("bool bias", "bias",
               lambda: dict(bias=np.ones((B, N, T, S), bool))),
  # Mask.
  BadInputCase("float mask", "mask",
               lambda: dict(mask=np.ones((B, N, T, S), np.float32))),
  BadInputCase("integer mask", "mask",
               lambda: dict(mask=np.ones((B, N, T, S), np.int32))),
  BadInputCase("mask query length not broadcastable", "mask",
               lambda: dict(mask=np.ones((B, N, T + 1, S), bool))),
  BadInputCase("mask rank 5", "mask",
               lambda: dict(mask=np.ones((1, B, N, T, S), bool))),
  # Key ranges.
  BadInputCase("float k_start", "k_start",
               lambda: dict(k_start=np.zeros((B, N, T), np.float32))),
  BadInputCase("bool k_start", "k_start",
               lambda: dict(k_start=np.zeros((B, N, T), bool))),
  BadInputCase("float k_end", "k_end",
               lambda: dict(k_end=np.full((B, N, T), S, np.float32))),
  BadInputCase("k_start query length not broadcastable", "k_start",
               lambda: dict(k_start=np.zeros((B, N, T + 1), np.int32))),
  BadInputCase("k_end of rank 4", "k_end",
               lambda: dict(k_end=np.full((B, N, T, 1), S, np.int32))),
  BadInputCase("k_end heads not broadcastable", "k_end",
               lambda: dict(k_end=np.full((B, 3, T), S, np.int32))),
  # Scalars.
  BadInputCase("infinite scale", "scale", lambda: dict(scale=float("inf"))),
  BadInputCase("NaN scale", "scale", lambda: dict(scale=float("nan"))),
  BadInputCase("array scale", "scale",
               lambda: dict(scale=np.array([0.1, 0.2]))),
  BadInputCase("zero soft cap", "logits_soft_cap",
               lambda: dict(logits_soft_cap=0.0)),
  BadInputCase("negative soft cap", "logits_soft_cap",
               lambda: dict(logits_soft_cap=-1.0)),
  BadInputCase("infinite soft cap", "logits_soft_cap",
               lambda: dict(logits_soft_cap=float("inf"))),
  BadInputCase("NaN soft cap", "logits_soft_cap",
               lambda: dict(logits_soft_cap=float("nan"))),
  BadInputCase("negative rescale_threshold", "rescale_threshold",
               lambda: dict(rescale_threshold=-0.1), reference=False),
  BadInputCase("rescale_threshold above 1", "rescale_threshold",
               lambda: dict(rescale_threshold=1.5), reference=False),
  BadInputCase("NaN rescale_threshold", "rescale_threshold",
               lambda: dict(rescale_threshold=float("nan")), reference=False),
)


# ---------------------------------------------------------------------------
# FP8 calls: float8_e4m3fn inputs with their descales.  Run by the API, the
# float64 reference and the NumPy model (properties/numerics/test_fp8.py).

def fp8_base_call() -> dict[str, Any]:
  """A well-formed FP8 call: e4m3 query, key and value, per-tensor q and k
  descales, a per (batch, kv head) v descale, a bfloat16 bias."""
  from kernel.call import float8_e4m3fn
  call = base_call()
  for name in ("query", "key", "value"):
    call[name] = call[name].astype(np.float32).astype(float8_e4m3fn)
  return dict(call, q_descale=np.float32(0.5), k_descale=2.0,
              v_descale=np.full((B, K), 0.25, np.float32))


def _fp8_as(name: str, dtype) -> Callable[[], dict[str, Any]]:
  return lambda: {name: fp8_base_call()[name].astype(np.float32).astype(dtype)}


FP8_BAD_INPUT_CASES: tuple[BadInputCase, ...] = (
  BadInputCase("FP8 query with a bfloat16 key", "key", _fp8_as("key", bfloat16)),
  BadInputCase("FP8 query with a bfloat16 value", "value", _fp8_as("value", bfloat16)),
  BadInputCase("bfloat16 query with FP8 key and value", "key", _fp8_as("query", bfloat16)),
  BadInputCase("float8_e5m2 inputs", "query",
               lambda: {n: fp8_base_call()[n].astype(np.float32).astype(
                   __import__("ml_dtypes").float8_e5m2) for n in ("query", "key", "value")}),
  BadInputCase("missing q_descale", "q_descale", lambda: dict(q_descale=None)),
  BadInputCase("missing k_descale", "k_descale", lambda: dict(k_descale=None)),
  BadInputCase("missing v_descale", "v_descale", lambda: dict(v_descale=None)),
  BadInputCase("infinite q_descale", "q_descale", lambda: dict(q_descale=np.float32(np.inf))),
  BadInputCase("NaN k_descale", "k_descale", lambda: dict(k_descale=float("nan"))),
  BadInputCase("a non-finite entry of a per-head v_descale", "v_descale",
               lambda: dict(v_descale=np.array([[0.25, np.inf]], np.float32))),
  BadInputCase("zero v_descale", "v_descale", lambda: dict(v_descale=0.0)),
  BadInputCase("negative k_descale", "k_descale", lambda: dict(k_descale=-1.0)),
  BadInputCase("float64 q_descale", "q_descale",
               lambda: dict(q_descale=np.array(0.5, np.float64))),
  BadInputCase("q_descale per query head", "q_descale",
               lambda: dict(q_descale=np.ones((B, N), np.float32))),
  BadInputCase("bool k_descale", "k_descale", lambda: dict(k_descale=True)),
  BadInputCase("float32 out_dtype", "out_dtype", lambda: dict(out_dtype=np.float32)),
  BadInputCase("FP8 out_dtype", "out_dtype",
               lambda: dict(out_dtype=__import__("ml_dtypes").float8_e4m3fn)),
  BadInputCase("a descale with bfloat16 inputs", "q_descale",
               lambda: dict({n: base_call()[n] for n in ("query", "key", "value")},
                            k_descale=None, v_descale=None)),
  BadInputCase("out_dtype with bfloat16 inputs", "out_dtype",
               lambda: dict({n: base_call()[n] for n in ("query", "key", "value")},
                            q_descale=None, k_descale=None, v_descale=None,
                            out_dtype=bfloat16)),
)
