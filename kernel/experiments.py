"""Variants of the kernel kept for measurement and tests, not for users.

The public :func:`kernel.api.dot_product_attention` runs the shipped kernels.
The harness and the benchmark reach the others through this module:

* ``backward``: the custom_vjp's backward by name (:data:`BACKWARDS`): the
  shipped sm90 kernels ("pallas"), the same with each product waited on its
  own ("pallas-serial"), dQ always by its own kernel ("pallas-two-kernel",
  the A/B of the fused dQ), deterministic=True's ("pallas-fixed-point": the
  fused dQ summed in int32), dQ fused into the dK/dV kernel under causal at
  head dims up to 128 as well ("pallas-fused-causal", the A/B of
  kernel.tiling.backward_plan.blocks_for's causal choice), in the forward's 32-column
  rows ("pallas-narrow-rows": head dim 96 at 96; kernel.tiling.plan.backward_head_dims
  says why it waits), or the kernels' executable specification in plain JAX
  ("xla", kernel/backward/xla.py), which tests compare them with.
  All read the same residuals.
* ``stage_2d``: False reads a 2-D bias or mask from global memory instead of
  staging it through the ring (the A/B of the staging; the same bits).
* ``segment_bounds``: how packed segments' key ranges are found
  (kernel/key_ranges.py's :data:`~kernel.key_ranges.SEGMENT_BOUNDS`: "searched",
  a sort and binary searches, or "runs", sort-free where the queries' ids
  are the keys' own array and every id is one run; the same ranges; by
  default the shipped :data:`~kernel.key_ranges.SHIPPED_SEGMENT_BOUNDS`).
* ``even_sections``: False keeps the longest-first order's L2 sections
  filled to their byte bound, the last one the rest, where the shipped
  order evens them (kernel/tiling/schedule.py's ``longest_first``); the same
  tiles, in another order.
* ``defer_light``: True or False runs the longest-first order's light
  tiles after every section's heavy ones (kernel/tiling/schedule.py's
  ``deferred_light``) always or never, where the shipped order (None)
  does so where ``schedule.light_last_gain`` predicts that it pays; the
  same tiles, in another order.
* ``untiled_copies``: True copies q, k, v and the output of the forward
  through views of their shared memory without the tiling, each buffer in
  column parts of one swizzle atom (kernel/tiling/plan.py's ``copy_parts``: the
  products one wgmma per part), so that a sequence length no multiple of 8
  needs no padded copy; unrun on a GPU so far.
"""

from __future__ import annotations

import functools

from kernel import backward as backward_pallas
from kernel.backward import xla as backward_xla
from kernel.tiling import plan

from kernel import api
from kernel import key_ranges as variants

BACKWARDS = {
    "pallas": api.SHIPPED_BACKWARD,
    "pallas-serial": functools.partial(backward_pallas.attention_backward, schedule="serial"),
    "pallas-two-kernel": functools.partial(backward_pallas.attention_backward, fuse_dq=False),
    "pallas-fixed-point": api.REPRODUCIBLE_BACKWARD,
    "pallas-fused-causal": functools.partial(backward_pallas.attention_backward,
                                             fuse_dq_causal=True),
    "pallas-narrow-rows": functools.partial(backward_pallas.attention_backward,
                                            head_dims=plan.padded_head_dims),
    "xla": backward_xla.attention_backward,
}
# deterministic=True: each backward that may sum dq across thread blocks in
# float32 in no fixed order (the fused dQ) replaced by the same backward
# summing in fixed point.
REPRODUCIBLE = {
    "pallas-narrow-rows": functools.partial(backward_pallas.attention_backward,
                                            head_dims=plan.padded_head_dims,
                                            fixed_point_dq=True),
    "pallas-fused-causal": functools.partial(backward_pallas.attention_backward,
                                             fuse_dq_causal=True, fixed_point_dq=True),
    "pallas": api.REPRODUCIBLE_BACKWARD,
    "pallas-serial": functools.partial(backward_pallas.attention_backward, schedule="serial",
                                       fixed_point_dq=True),
}


def dot_product_attention(query, key, value, bias=None, mask=None, *, backward="pallas",
                          stage_2d=True, segment_bounds=variants.SHIPPED_SEGMENT_BOUNDS,
                          even_sections=True,
                          defer_light=None, untiled_copies=False, **kwargs):
  """:func:`kernel.api.dot_product_attention` with a variant: ``backward``
  (a :data:`BACKWARDS` name), ``stage_2d``, ``segment_bounds``,
  ``even_sections``, ``defer_light`` and ``untiled_copies``; every other
  argument as there, with its default."""
  import inspect
  if backward not in BACKWARDS:
    raise ValueError(f"backward: expected one of {sorted(BACKWARDS)}, got {backward!r}")
  if not isinstance(even_sections, bool):
    raise ValueError(f"even_sections: expected a bool, got {even_sections!r}")
  if defer_light is not None and not isinstance(defer_light, bool):
    raise ValueError(f"defer_light: expected a bool or None, got {defer_light!r}")
  if not isinstance(untiled_copies, bool):
    raise ValueError(f"untiled_copies: expected a bool, got {untiled_copies!r}")
  params = inspect.signature(api.dot_product_attention).parameters
  unknown = sorted(set(kwargs) - set(params))
  if unknown:
    raise TypeError(f"dot_product_attention() got unexpected keyword arguments {unknown}")
  args = {name: p.default for name, p in params.items()
          if p.default is not inspect.Parameter.empty}
  args.update(kwargs)
  return api._attention(query, key, value, bias, mask, **{
      k: v for k, v in args.items() if k not in ("bias", "mask")},
      backward=BACKWARDS[backward], reproducible_backward=REPRODUCIBLE.get(backward),
      stage_2d=stage_2d, segment_bounds=segment_bounds,
      even_sections=even_sections, defer_light=defer_light, untiled_copies=untiled_copies)


def chosen_config(query, key, value, bias=None, mask=None, *, is_causal=False,
                  k_start=None, k_end=None, device_kind=None, stage_2d=True):
  """:func:`kernel.api.chosen_config` with ``stage_2d``."""
  return api._chosen_config(query, key, value, bias, mask, is_causal=is_causal,
                            k_start=k_start, k_end=k_end, device_kind=device_kind,
                            stage_2d=stage_2d)
