"""Which tiling to run: the forward's default config and the autotuner's
candidates, and the backward's tiling (:func:`get_backward_config`).

One predicate decides both, as in the seed: does the shared-memory plan fit,
``plan.config_fits(problem, config)``.  Nothing is
compiled or timed here; the estimate is computed from the scratch layout the
kernel allocates, so a config these functions emit is one the kernel can
allocate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kernel.tiling import backward_plan, plan
from kernel.tiling.config import COMPUTE_WARPGROUP_COUNTS, Config

BLOCK_Q_CANDIDATES = (64, 128)
BLOCK_KV_CANDIDATES = (64, 128, 256)
NUM_STAGES_CANDIDATES = (2, 3, 4)


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


# FP8 at head dims up to this starts from 256-key blocks: its matrix products
# take half the time of bf16's, so wider blocks amortise the softmax's
# per-block work, as FlashAttention-3's FP8 tiles do (hopper/tile_size.h:
# 160 keys at head dim 64 against 128 for bf16).  Wider heads keep 128: a
# 64 x 256 float32 logits tile beside the accumulator would not stay in
# registers.  The autotuner times every candidate either way.
FP8_WIDE_KEYS_HEAD_DIM = 64


def get_heuristics_config(problem: plan.Problem) -> Config:
  """The config to run when the caller gives none.

  block_q 64, block_kv 128 (FP8 at head dims up to
  :data:`FP8_WIDE_KEYS_HEAD_DIM`: 256 first), 2 stages, persistent unless
  causal (a causal mask makes per-tile work vary too much for a static
  schedule).  If that does not fit, halve block_kv; if that still does not
  fit, drop persistence, which lets the output overlay the query/key region.
  """
  config = Config(block_q=64, block_kv=128, num_stages=2,
                  persistent=not problem.mask.causal)
  tried = []
  wide = []
  if problem.fp8 and max(problem.head_dim, problem.head_dim_out) <= FP8_WIDE_KEYS_HEAD_DIM:
    wide = [lambda c: dataclasses.replace(c, block_kv=256)]
  for fallback in (*wide, lambda c: c,
                   lambda c: dataclasses.replace(c, block_kv=64),
                   lambda c: dataclasses.replace(c, persistent=False)):
    config = fallback(config)
    if plan.config_fits(problem, config):
      return config
    tried.append((config, plan.estimate_smem_bytes(problem, config)))
  config, est = tried[-1]
  raise ValueError(
      f"no heuristic config fits in shared memory: the last fallback {config} "
      f"needs an estimated {est} bytes ({est / 1024:.1f} KiB), the limit is "
      f"{plan.SMEM_LIMIT_BYTES} bytes, for head_dim={problem.head_dim}, "
      f"head_dim_out={problem.head_dim_out}, "
      f"dtype={np.dtype(problem.dtype).name}"
      f"{', staged bias' if problem.bias_2d else ''}"
      f"{', staged mask' if problem.mask_2d else ''}")


def get_autotuning_configs(problem: plan.Problem) -> tuple[Config, ...]:
  """Every candidate the autotuner may time, in a fixed order.

  block_q 128 only when the query length rounds up past 128; block_kv 128/256
  only when the key length rounds up to at least that; a non-persistent block
  with more stages than key blocks would only hold empty slots, so it is
  skipped.  Under a causal mask, where tiles do unequal work, each config
  also comes with the longest-first schedule (kernel/tiling/schedule.py); without
  one each persistent config also comes with the split tail (its last
  waves cut evenly over the SMs).  At head
  dims up to 64 the block_q 64, block_kv 128, two-stage configs also come
  with three compute warpgroups (192-row tiles, 160 registers each: the
  only ones ``plan.warpgroups_refusal`` lets run).  Every survivor fits in
  shared memory.
  """
  block_qs = tuple(b for b in BLOCK_Q_CANDIDATES
                   if b == 64 or _next_pow2(problem.seq_q) > 128)
  block_kvs = tuple(b for b in BLOCK_KV_CANDIDATES
                    if b == 64 or b <= _next_pow2(problem.seq_kv))
  schedules = (("round-robin", "longest-first") if problem.mask.causal
               else ("round-robin", "split-tail"))
  configs = []
  for warpgroups in COMPUTE_WARPGROUP_COUNTS:
    for block_q in block_qs:
      for block_kv in block_kvs:
        for persistent in (False, True):
          for num_stages in NUM_STAGES_CANDIDATES:
            if not persistent and num_stages > problem.num_kv_blocks(block_kv):
              continue
            for schedule in schedules:
              config = Config(block_q=block_q, block_kv=block_kv, num_stages=num_stages,
                              persistent=persistent, schedule=schedule,
                              compute_warpgroups=warpgroups)
              if plan.config_fits(problem, config):
                configs.append(config)
  return tuple(configs)


def get_backward_config(head_dim: int, head_dim_out: int, *, causal: bool,
                        **switches) -> backward_plan.BackwardBlocks:
  """The backward's tiling for these (padded) head dims:
  kernel.tiling.backward_plan.blocks_for's rule, with ``switches``
  (BackwardBlocks' ``schedule``, ``fuse_dq``, ``whole_tiles``, ``untiled_copies``, and
  ``fuse_dq_causal`` where not None) replacing its choices.  Every tiling
  it returns fits shared memory (backward_plan's estimate, checked again at
  the launch)."""
  blocks = backward_plan.blocks_for(head_dim, head_dim_out, causal=causal)
  if switches.get("fuse_dq_causal", False) is None:
    del switches["fuse_dq_causal"]
  return dataclasses.replace(blocks, **switches)
