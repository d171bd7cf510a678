"""Variants of the kernel kept for measurement and tests, not for users.

The public :func:`kernel.api.dot_product_attention` runs the shipped kernels
(kernel.variant.SHIPPED).  The harness and the benchmark reach the others
through :func:`dot_product_attention`, which takes every argument of the
public one and the switches of a :class:`kernel.variant.Variant`
(``stage_2d``, ``segment_bounds``, ``even_sections``, ``defer_light``,
``untiled_copies``, ``ranges_always``), and ``backward``, a name of :data:`BACKWARDS`:

* ``"pallas"``: the shipped sm90 backward;
* ``"pallas-serial"``: each product waited on its own;
* ``"pallas-two-kernel"``: dQ always by its own kernel (the A/B of the fused dQ);
* ``"pallas-fixed-point"``: the fused dQ summed in int32 (``deterministic=True``);
* ``"pallas-fused-causal"``: dQ fused into the dK/dV kernel under causal at
  head dims up to 128 as well (the A/B of kernel.tiling.backward_plan.blocks_for's
  causal choice);
* ``"pallas-narrow-rows"``: the backward in the forward's 32-column rows
  (kernel.tiling.plan.backward_head_dims says why it waits);
* ``"pallas-unpadded"``: q, k, v and dO copied padded only where the forward
  pads them, not to whole tiles at every length (kernel.padding.backward_inputs);
* ``"pallas-untiled"``: q, k, v and dO read unpadded at any length of at least
  one block, copied through untiled views in column parts
  (docs/decisions/backward-untiled-copies.md);
* ``"xla"``: the kernels' executable specification in plain JAX
  (kernel/backward/xla.py), which tests compare them with.

All read the same residuals and compute the same function.
"""

from __future__ import annotations

import dataclasses
import inspect

from kernel import api
from kernel.call import DEFAULT_ALLOWED_DTYPES, Call
from kernel.variant import SHIPPED, Variant

# Each backward name: the variant's backward switches, and whether it runs
# as deterministic=True does.
BACKWARDS = {
    "pallas": ({}, False),
    "pallas-serial": ({"backward_schedule": "serial"}, False),
    "pallas-two-kernel": ({"fuse_dq": False}, False),
    "pallas-fixed-point": ({}, True),
    "pallas-fused-causal": ({"fuse_dq_causal": True}, False),
    "pallas-narrow-rows": ({"narrow_rows": True}, False),
    "pallas-unpadded": ({"backward_whole_tiles": False}, False),
    "pallas-untiled": ({"backward_whole_tiles": False, "backward_untiled_copies": True}, False),
    "xla": ({"backward": "xla"}, False),
}
# The Variant fields this module's dot_product_attention takes by name.
SWITCHES = ("stage_2d", "segment_bounds", "even_sections", "defer_light", "untiled_copies",
            "ranges_always")


def variant_of(backward: str = "pallas", **switches) -> Variant:
  """The Variant of a :data:`BACKWARDS` name and the forward's switches."""
  if backward not in BACKWARDS:
    raise ValueError(f"backward: expected one of {sorted(BACKWARDS)}, got {backward!r}")
  unknown = sorted(set(switches) - set(SWITCHES))
  if unknown:
    raise TypeError(f"variant_of() got unexpected keyword arguments {unknown}")
  return dataclasses.replace(SHIPPED, **BACKWARDS[backward][0], **switches)


def dot_product_attention(query, key, value, bias=None, mask=None, *, backward="pallas",
                          **kwargs):
  """:func:`kernel.api.dot_product_attention` with a variant: ``backward``
  (a :data:`BACKWARDS` name) and the switches of :data:`SWITCHES`; every
  other argument as there, with its default."""
  switches = {k: kwargs.pop(k) for k in SWITCHES if k in kwargs}
  variant = variant_of(backward, **switches)
  params = inspect.signature(api.dot_product_attention).parameters
  unknown = sorted(set(kwargs) - set(params))
  if unknown:
    raise TypeError(f"dot_product_attention() got unexpected keyword arguments {unknown}")
  config = kwargs.pop("config", None)
  deterministic = kwargs.pop("deterministic", False) or BACKWARDS[backward][1]
  call = Call(query, key, value, bias, mask, **kwargs, dtypes=DEFAULT_ALLOWED_DTYPES)
  return api.attend(call, config=config, deterministic=deterministic, variant=variant)


def chosen_config(query, key, value, bias=None, mask=None, *, stage_2d=True, **kwargs):
  """:func:`kernel.api.chosen_config` with ``stage_2d``; every other argument
  as there."""
  return api.chosen_config_source(query, key, value, bias, mask, **kwargs,
                                  variant=variant_of(stage_2d=stage_2d))[0]
