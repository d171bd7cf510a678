"""sm90 flash attention in Pallas Mosaic GPU.

The public API, importable from the package::

  from kernel import dot_product_attention
  out = dot_product_attention(query, key, value, is_causal=True)

and ``kernel.fp8``, which quantises inputs for its FP8 path.

It is resolved on first use (PEP 562), so that ``import kernel.tiling.plan`` and the
other pure-Python modules (read by the heuristics and their tests)
do not pay for importing JAX and Pallas.
"""

from __future__ import annotations

__all__ = [
    "Config",
    "UnsupportedDeviceError",
    "chosen_config",
    "dot_product_attention",
    "fp8",
    "lowering_only",
    "sm90_device",
]

_FROM_API = frozenset(__all__) - {"Config", "fp8"}


def __getattr__(name: str):
  if name == "Config":
    from kernel.tiling.config import Config
    return Config
  if name == "fp8":
    import importlib
    return importlib.import_module("kernel.fp8")
  if name in _FROM_API:
    from kernel import api
    return getattr(api, name)
  raise AttributeError(f"module 'kernel' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
