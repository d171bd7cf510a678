"""The forward's launch: one ``plgpu.kernel`` over padded, validated inputs.

One thread block is three warpgroups along the axis ``wg`` (four with
``Config(compute_warpgroups=3)``).  The compute warpgroups share one query
tile of ``Config.tile_q`` rows, ``block_q`` each, and take turns on the
tensor cores through the pingpong barriers of kernel/sync/barriers.py; the
last warpgroup only issues TMA copies into the ``num_stages``-deep ring that
kernel/tiling/plan.py describes.  Automatic barriers are off: every
handshake is placed by hand, and is the protocol the proof reads out of the
traced kernel (harness/proofs/).

The roles live beside this file: kernel/forward/block.py (scratch, rings,
dispatch), producer.py (the memory warpgroup), mainloop.py (a compute
warpgroup's key loop), softmax.py (logits, masks and the online softmax)
and epilogue.py (normalise and store)."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from kernel.sync import barriers
from kernel.sync.seams import seam
from kernel.tiling import plan as plan_lib
from kernel.tiling.config import Config
from kernel.forward.block import _kernel
from kernel.forward.context import ForwardContext
from kernel.forward.order import _schedule, merge_pieces


@seam("launch.extent")
def launch_extent(config: Config, seq_q: int, seq_kv: int) -> tuple[int, int]:
  """(query tiles, padded key length) of a launch: whole tiles of
  ``config.tile_q`` rows, whole blocks of ``config.block_kv`` keys."""
  return -(-seq_q // config.tile_q), -(-seq_kv // config.block_kv) * config.block_kv


# -- the launch ----------------------------------------------------------------

def flash_attention_forward(problem: plan_lib.Problem, config: Config,
                            q, k, v, bias, mask, k_start, k_end, k_range_tiles,
                            *, num_sms: int = 132, outputs=None, descales=None):
  """Launch the kernel on padded, validated inputs, for ``problem`` (the
  call's static facts, kernel.api.problem_of) tiled by ``config``.

  q (B, T, N, D), k (B, S, K, D), v (B, S, K, Dv): D, Dv the problem's
  (kernel.tiling.plan.padded_head_dims), T at least one tile (config.tile_q
  rows) and S at least block_kv, multiples of 8 (Mosaic GPU's tiled TMA;
  any length with ``problem.untiled_copies``) of any length beyond: the TMA
  reads rows past the end as zeros (padded keys are masked, padded query
  rows never stored) and clips the stores of the last tile, so a ragged
  length costs no padded copy.  bias (rank 4, dims 1 or full, T and S
  padded to whole tiles), mask int8 likewise, k_start/k_end int32 (rank 3,
  (B|1, N|1, Tp|1), Tp the padded query length), k_range_tiles: None or
  (start_min, start_max, end_min, end_max) each (B|1, N|1, num_tiles) int32.
  FP8 (``problem.fp8``): q and k float8_e4m3fn, v the values transposed,
  (B, K, Dv, S) with S whole key blocks, each block's keys in
  kernel.tiling.plan.fp8_key_order; ``descales`` (B|1, K|1, 2) float32, per
  (batch, kv head) q_descale * k_descale and v_descale
  (kernel.padding.forward_inputs makes both).
  Returns out (B, T, N, Dv) and, with return_residuals, m and l (B, N, Tp)
  f32, Tp = T rounded up to whole tiles.

  ``outputs``: None, or mutable arrays (``jax.new_ref``) the kernel writes
  instead of returning fresh ones: out (B, To, N, Dv) and, with residuals,
  m and l (B, N, To), with To >= Tp.  Rows from Tp on are a guard band the
  kernel must leave as they were (properties/gpu/test_guard_band_gpu.py: a
  fresh output cannot show a write past its end, which the TMA unit drops).
  Returns (None, None) then.
  """
  wanted = problem
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv_heads, head_dim_out = _value_dims(problem, q, v, descales)
  dtype = q.dtype
  num_tiles, s_pad = launch_extent(config, seq_q, seq_kv)
  # The split tail's pieces are weighed by their (m, l) in the merge, so the
  # kernel may return residuals the caller did not ask for.
  problem = plan_lib.kernel_problem(problem, config)
  pipe = _pipeline(problem, config, k_start=k_start, outputs=outputs)
  order, schedule_tables = _schedule(
      problem, config, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
      num_tiles=num_tiles, s_pad=s_pad, head_dim=head_dim, head_dim_out=head_dim_out,
      itemsize=np.dtype(dtype).itemsize, k_range_tiles=k_range_tiles, num_sms=num_sms)
  kernel = ForwardContext(
      problem=problem, config=config, batch=batch, num_heads=num_heads, num_tiles=num_tiles,
      group=num_heads // num_kv_heads, head_dim_out=head_dim_out, dtype=dtype,
      stages=pipe.num_stages, layout=plan_lib.scratch_layout(problem, config), order=order,
      masks_any_block=mask is not None, key_ranges=k_start is not None or k_end is not None)

  def kernel_body(*refs):
    _kernel(kernel, pipe.mbarriers, *refs)

  q, k, v, out_row = _in_copy_parts(problem, q, k, v, head_dim_out, outputs)
  out_type = _out_type(problem, config, order, batch=batch, seq_q=seq_q, num_heads=num_heads,
                       num_tiles=num_tiles, out_row=out_row,
                       dtype=problem.output_dtype if problem.fp8 else dtype)
  grid, grid_names = _grid(config, order, batch=batch, num_heads=num_heads,
                           num_tiles=num_tiles, num_sms=num_sms)
  launch = functools.partial(
      plgpu.kernel, kernel_body, grid=grid, grid_names=grid_names,
      num_threads=config.compute_warpgroups + barriers.MEMORY_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True))
  operands = (q, k, v, bias, mask, k_start, k_end, k_range_tiles,
              *(schedule_tables or (None, None))) + ((descales,) if problem.fp8 else ())
  if outputs is not None:
    _check_guarded_outputs(outputs, out_type)
    # Operands after the inputs and schedule tables: kernel_body takes them
    # as its outputs.
    launch(out_type=[])(*operands, *outputs)
    return None, None
  results = launch(out_type=out_type)(*operands)
  return _returned(results, problem, config, order, head_dim_out=head_dim_out,
                   residuals=wanted.return_residuals)


def _value_dims(problem: plan_lib.Problem, q, v, descales) -> tuple[int, int, int]:
  """(key length, kv heads, value head dim) read from ``v`` (V^T under FP8),
  with the FP8 descales' shape and q's dtype and head dims checked against
  the problem's."""
  _, _, _, head_dim = q.shape
  if problem.fp8:
    _, num_kv_heads, head_dim_out, seq_kv = v.shape
    if descales is None or descales.ndim != 3 or descales.shape[2] != 2:
      raise ValueError(f"descales: the FP8 forward takes (B|1, K|1, 2) float32 descales, "
                       f"got {None if descales is None else descales.shape}")
  else:
    _, seq_kv, num_kv_heads, head_dim_out = v.shape
  dtype = q.dtype
  if (np.dtype(dtype), head_dim, head_dim_out) != (np.dtype(problem.dtype), problem.head_dim,
                                                   problem.head_dim_out):
    raise ValueError(f"q, v: {np.dtype(dtype).name} with head dims {head_dim}, {head_dim_out}, "
                     f"but the problem is {np.dtype(problem.dtype).name} with "
                     f"{problem.head_dim}, {problem.head_dim_out}")
  return seq_kv, num_kv_heads, head_dim_out


def _pipeline(problem: plan_lib.Problem, config: Config, *, k_start,
              outputs) -> plan_lib.PipelinePlan:
  """The launch's pipeline plan, once the problem is known to fit the
  config and to have the inputs and outputs it needs."""
  plan_lib.check_fits(problem, config)
  if problem.poisons_rows and k_start is None:
    raise ValueError("problem.poisons_rows: the rows to poison are marked in k_start, "
                     "and none was given")
  pipe = plan_lib.pipeline_plan(problem, config)
  if config.schedule == "split-tail" and outputs is not None:
    raise ValueError("outputs: the split-tail schedule merges its pieces after the kernel, "
                     "into fresh arrays; run it without outputs")
  return pipe


def _in_copy_parts(problem: plan_lib.Problem, q, k, v, head_dim_out: int, outputs):
  """(q, k, v, the output's row): whole, or under untiled copies in column
  parts (kernel.tiling.plan.copy_parts), free reshapes."""
  out_row = (head_dim_out,)
  if problem.untiled_copies:
    if outputs is not None:
      raise ValueError("outputs: untiled copies write the output in column parts, "
                       "into a fresh array; run them without outputs")
    in_parts = lambda x: x.reshape(*x.shape[:3], *plan_lib.copy_parts(x.shape[3], x.itemsize))
    # FP8's V^T stays whole: a copy made whole before the kernel
    q, k, v = in_parts(q), in_parts(k), v if problem.fp8 else in_parts(v)
    out_row = plan_lib.copy_parts(head_dim_out, problem.output_dtype.itemsize)
  return q, k, v, out_row


def _returned(results, problem: plan_lib.Problem, config: Config, order, *, head_dim_out: int,
              residuals: bool):
  """(out, (m, l) or None) from the kernel's results: rows made whole again
  under untiled copies, the split tail's pieces merged; ``residuals``: the
  caller asked for m and l."""
  results = tuple(results) if isinstance(results, (list, tuple)) else (results,)
  if problem.untiled_copies:  # the output (and a piece's) back to whole rows
    whole = lambda x: x.reshape(*x.shape[:-2], head_dim_out)
    results = tuple(whole(x) if i in (0, 3) else x for i, x in enumerate(results))
  if config.schedule == "split-tail":
    out, m, l, *pieces = results
    out, m, l = merge_pieces(out, m, l, pieces, order, tile_q=config.tile_q,
                             normalized=problem.normalize_output)
    return out, (m, l) if residuals else None
  if problem.return_residuals:
    out, m, l = results
    return out, (m, l)
  (out,) = results
  return out, None


@seam("launch.out_type")
def _out_type(problem: plan_lib.Problem, config: Config, order, *, batch, seq_q, num_heads,
              num_tiles, out_row, dtype) -> list:
  """The kernel's outputs: out, then m and l with residuals, then the
  split tail's pieces (out, m, l per slot); an output row's shape is
  ``out_row``."""
  tile_q = config.tile_q
  out_type = [jax.ShapeDtypeStruct((batch, seq_q, num_heads, *out_row), dtype)]
  if problem.return_residuals:
    # m and l stay padded to whole tiles: a clipped store of the last
    # tile's rows of a (B, N, T) array was seen to land in the next head's
    # first rows, as if the copy were bounded by the flattened array, not
    # by T (docs/decisions/residuals-padded-to-whole-tiles.md).
    out_type += [jax.ShapeDtypeStruct((batch, num_heads, num_tiles * tile_q),
                                      jnp.float32)] * 2
  if config.schedule == "split-tail":
    slots = max(1, order.num_slots)
    out_type += [jax.ShapeDtypeStruct((slots, tile_q, *out_row), dtype)]
    out_type += [jax.ShapeDtypeStruct((slots, tile_q), jnp.float32)] * 2
  return out_type


def _grid(config: Config, order, *, batch, num_heads, num_tiles, num_sms):
  """(grid, grid_names): a block per SM that deals tiles (persistent, the
  split tail's SMs), a block per tile in the order's launch order, or the
  round-robin (heads, query tiles, batch) grid."""
  if config.schedule == "split-tail":
    return (order.grid_blocks,), ("sm",)
  if config.persistent:
    return (min(num_sms, batch * num_heads * num_tiles),), ("sm",)
  if order is not None:
    return (order.total,), ("tiles",)
  return (num_heads, num_tiles, batch), ("heads", "q_tiles", "batch")


def _check_guarded_outputs(outputs, out_type):
  if len(outputs) != len(out_type):
    raise ValueError(f"outputs: expected {len(out_type)} arrays (out, and m, l with "
                     f"residuals), got {len(outputs)}")
  for ref, want, name in zip(outputs, out_type, ("out", "m", "l")):
    axis = 1 if name == "out" else 2
    shape, dtype = tuple(ref.shape), jnp.dtype(ref.dtype)
    fits = (len(shape) == len(want.shape) and shape[axis] >= want.shape[axis]
            and all(a == b for i, (a, b) in enumerate(zip(shape, want.shape)) if i != axis))
    if not fits or dtype != want.dtype:
      raise ValueError(f"outputs: {name} must be {want.dtype} shaped like {want.shape} with "
                       f"axis {axis} at least as long, got {dtype} {shape}")
