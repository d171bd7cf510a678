"""What the forward kernel allocates and how its stage ring is wired, as data.

One source of truth for three consumers:

* ``kernel/forward/block.py`` allocates exactly the buffers of
  :func:`scratch_layout` and :attr:`PipelinePlan.mbarriers`, so
* the shared-memory estimate (:func:`estimate_smem_bytes`) that the config
  validation, the heuristics and the autotuner consult is computed from the
  very description the kernel allocates, and
* the proof, which reads the protocol out of the traced kernel
  (``harness/proofs/extract.py``), sees the stages, the staged buffers and the
  barrier arrival counts this plan declares, as the kernel allocates them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from kernel.masks import Mask
from kernel.sync import barriers
from kernel.tiling.config import Config, SMEM_LIMIT_BYTES

MBARRIER_BYTES = 8
SMEM_ALIGNMENT = 1024  # Mosaic GPU aligns the scratch region to this
# Mosaic GPU reserves this much scratch for cross-warp reductions (row max/sum).
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4
# Head dims are computed padded with zero columns to a multiple of these:
# 32 (64-byte swizzled rows) where both head dims are at most 128, else 64
# (the head split halves every tile's columns: kernel/backward/head_split.py); never
# below MIN_HEAD_DIM.
HEAD_DIM_MULTIPLE = 32
WIDE_HEAD_DIM_MULTIPLE = 64
MIN_HEAD_DIM = 64
MAX_HEAD_DIM = 256


def padded_head_dims(head_dim: int, head_dim_out: int) -> tuple[int, int]:
  """The (query/key, value) head dims the forward computes with.

  Up to 128 they are whole 32-column (64-byte) rows of at least 64 columns,
  so that head dim 96 (and 72 or 80, padded to 96) runs at 96 columns, not
  128, and at 96 with no padded copy of q, k and v
  (docs/decisions/forward-32-column-head-dims.md).  A head dim under 64
  keeps 64 columns, and where either is over
  128 both keep whole 64-column rows: the rules the forward was checked
  under against float64 on the GPU there (the backward's head split,
  :func:`backward_head_dims`, halves every tile's columns in 64-byte
  swizzled halves)."""
  m = HEAD_DIM_MULTIPLE if max(head_dim, head_dim_out) <= 128 else WIDE_HEAD_DIM_MULTIPLE
  return tuple(max(MIN_HEAD_DIM, -(-d // m) * m) for d in (head_dim, head_dim_out))


def padded_head_dim(d: int) -> int:
  """:func:`padded_head_dims` of a call whose value head dim is its own."""
  return padded_head_dims(d, d)[0]


def backward_head_dims(head_dim: int, head_dim_out: int) -> tuple[int, int]:
  """The head dims the backward kernels compute with: whole 64-column rows
  (kernel/backward/launch.py pads q, k, v and dO itself; the forward's
  residuals do not depend on its padding).  With :func:`padded_head_dims`'
  rule the backward lowers for every pair of head dims and runs faster
  (docs/decisions/backward-64-column-head-dims.md); it takes that rule once
  its gradients have been checked against float64 on a GPU
  (kernel.experiments' "pallas-narrow-rows": ``bash
  ci/device/compare-backward.sh OUTDIR pallas-narrow-rows``)."""
  m = WIDE_HEAD_DIM_MULTIPLE
  return -(-head_dim // m) * m, -(-head_dim_out // m) * m


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts of one call that the tilings and both passes'
  kernels specialise on, made once by the API (kernel.api.problem_of) from
  the call record (kernel.call.Call).  The tiling reads the layout facts
  (the head dims, the dtype, the lengths, the staged operands, residuals
  and copies); the kernels read them all.  Hashable: the jitted launches
  take it as a static argument.  Made by :func:`problem_for` only, and
  changed by :meth:`replace`, which makes it again."""

  dtype: np.dtype          # bf16, f16 or float8_e4m3fn (f32 inputs are cast before)
  head_dim: int            # padded: padded_head_dims
  head_dim_out: int        # padded likewise
  # Which keys each row may see, as known when tracing: the lengths
  # (unpadded), causal, jax.nn's local window (left, right) and
  # FlashAttention-3's attention_chunk.  The longest-first order and the
  # backward's launch order weigh tiles by the window and the chunk; the
  # kernels read the key ranges they became, traced and so hidden from a
  # schedule (kernel/masks).
  mask: Mask
  bias_2d: bool = False    # bias varies along both T and S (staged through the ring)
  mask_2d: bool = False    # mask varies along both T and S
  return_residuals: bool = False
  # The TMA copies of q, k, v and the output use views of their buffers
  # without the tiling, each buffer in copy_parts' parts
  # (kernel.variant.Variant.untiled_copies).
  untiled_copies: bool = False
  # The longest-first order's switches (kernel/tiling/schedule.py's
  # longest_first): its L2 sections evened out, and its light tiles after
  # every section's heavy ones always (True), never (False) or where its
  # model predicts a gain (None).
  even_sections: bool = True
  defer_light: bool | None = None
  scale: float = 1.0       # the logits' scale, resolved (1 / sqrt(H) by default)
  logits_soft_cap: float | None = None
  # The forward's rescale threshold, as it runs (kernel.api raises it for
  # float16, where deferred probabilities could overflow).
  rescale_threshold: float = 1.0
  normalize_output: bool = True
  # The key ranges are known when tracing, so the static longest-first order
  # already weighs them: a window's or a chunk's alone, or the whole keys
  # (ranges_always).
  static_ranges: bool = False
  # Rows whose key range starts at kernel.common.POISONED_START are written
  # NaN (out, m and l): rows kernel/key_ranges.py cannot serve with one range;
  # the epilogue does it (docs/decisions/poisoned-rows-in-epilogue.md).
  poisons_rows: bool = False
  deterministic: bool = False  # the backward sums dq in int32 fixed point
  # FP8 (dtype float8_e4m3fn): the dtype the output is written in (None:
  # bfloat16), and the descales' layout, "tensor" or "head" (per batch and
  # kv head; kernel.call.validate_fp8_args).
  out_dtype: np.dtype | None = None
  descales: str | None = None

  def replace(self, **changes) -> Problem:
    """This problem with ``changes`` (the facts :func:`problem_for` takes),
    made again by it: its mask follows its lengths."""
    facts = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
             if field.name != "mask"}
    mask = self.mask
    facts.update(seq_q=mask.seq_q, seq_kv=mask.seq_kv, is_causal=mask.causal,
                 window=mask.window, chunk=mask.chunk)
    return problem_for(**{**facts, **changes})

  def for_launch(self, config: Config, *, residuals: bool = False) -> Problem:
    """The problem the forward's launch is compiled for: the window and its
    ranges only where the longest-first order weighs tiles by them, so that
    the window's value keys no other compile; with m and l where the
    gradient (``residuals``) wants them, refused if they do not fit."""
    problem = self
    if config.schedule != "longest-first":
      problem = problem.replace(window=None, chunk=None, static_ranges=False)
    if residuals:
      problem = problem.replace(return_residuals=True)
      check_fits(problem, config)
    return problem

  @property
  def seq_q(self) -> int:
    """The queries' length, unpadded."""
    return self.mask.seq_q

  @property
  def seq_kv(self) -> int:
    """The keys' length, unpadded."""
    return self.mask.seq_kv

  @property
  def itemsize(self) -> int:
    return np.dtype(self.dtype).itemsize

  @property
  def fp8(self) -> bool:
    """One-byte inputs: V reaches the kernel transposed (:func:`fp8_key_order`),
    P is quantised for the PV product, the descales scale the logits and the
    output."""
    return self.itemsize == 1

  @property
  def output_dtype(self) -> np.dtype:
    """What the kernel writes out in: the inputs' dtype, or FP8's output dtype."""
    if not self.fp8:
      return np.dtype(self.dtype)
    import ml_dtypes
    return np.dtype(self.out_dtype or ml_dtypes.bfloat16)

  @property
  def bias_dtype(self) -> np.dtype:
    """A bias is added to float32 logits in the compute dtype, bfloat16 for FP8."""
    return self.output_dtype if self.fp8 else np.dtype(self.dtype)

  def num_kv_blocks(self, block_kv: int) -> int:
    return -(-self.seq_kv // block_kv)


# Mosaic GPU's tiled TMA descriptors take a sequence length that is a
# multiple of 8 rows only (jax 0.11.2: "dimension 2 must have size smaller
# or a multiple of its tiling 8").
ROW_TILING = 8

# Mosaic GPU's swizzles in bytes, widest first (plgpu.find_swizzle's order).
SWIZZLES = (128, 64, 32, 16)


def row_swizzle_bytes(columns: int, itemsize: int, what: str = "") -> int:
  """The widest swizzle (bytes) a row of ``columns`` elements holds: the
  swizzle of a buffer whose description names none (kernel.common.smem)."""
  for swizzle in SWIZZLES:
    if columns * itemsize % swizzle == 0:
      return swizzle
  raise ValueError(f"{what or 'a buffer'}: a row of {columns} elements of {itemsize} bytes "
                   f"holds no swizzle of {SWIZZLES} bytes")


def copy_parts(width: int, itemsize: int, swizzle: int | None = None) -> tuple[int, int]:
  """(parts, columns): a row of ``width`` columns cut into parts of one
  swizzle atom each (``swizzle`` bytes; None: the widest a row holds), as
  :attr:`Problem.untiled_copies` lays out q, k, v and the output, and the
  backward's untiled copies (kernel.tiling.backward_plan) its q, k, v, dO.

  Why parts: Mosaic GPU's tiled TMA views the global array in (8, atom)
  tiles, so it refuses a sequence axis that is no multiple of 8 (jax
  0.11.2: "dimension 2 must have size smaller or a multiple of its tiling
  8"), and the API pays a padded copy of q, k, v and the output there
  (docs/decisions/untiled-copies.md).  A copy with the swizzle alone takes
  any length, and where a buffer's rows are one swizzle atom its (8, atom)
  tiling is the row-major order itself, so the untiled view the copy
  writes and the tiled one wgmma reads are the same bytes
  (kernel.common.untiled_smem).  A wider row interleaves its atoms every 8
  rows, so each part is a buffer of its own: the copy reads the global
  array as (..., parts, columns), a free reshape, into a transposed view,
  QK^T is one wgmma per part into one accumulator (the instructions one
  wgmma over the whole row issues) and PV one per part into an accumulator
  of its own (``columns`` wide, where one wgmma was as wide as the row:
  what that costs is not yet timed)."""
  columns = (swizzle or row_swizzle_bytes(width, itemsize)) // itemsize
  return width // columns, columns


# Past this many keys a row wider than 128 columns without causal keeps
# the padded copy: its column parts' PVs cost more than the copy saves
# (docs/decisions/untiled-copies.md).
UNTILED_WIDE_NONCAUSAL_KEYS = 8192


def untiled_copies_pay(problem: Problem) -> bool:
  """Whether the shipped API copies q, k, v and the output through untiled
  views (:func:`copy_parts`) for ``problem``: where a sequence length is no
  multiple of the TMA's 8-row tiling, and so would be copied padded, but
  not in FP8 (until its GPU run: docs/decisions/fp8-untiled-copies.md) nor
  for rows wider than 128 columns without causal from
  :data:`UNTILED_WIDE_NONCAUSAL_KEYS` keys on (docs/decisions/untiled-copies.md)."""
  ragged = problem.seq_q % ROW_TILING != 0 or problem.seq_kv % ROW_TILING != 0
  wide = max(problem.head_dim, problem.head_dim_out) > 128
  padded_wins = wide and not problem.mask.causal and problem.seq_kv >= UNTILED_WIDE_NONCAUSAL_KEYS
  return ragged and not problem.fp8 and not padded_wins


def problem_for(dtype, head_dim: int, head_dim_out: int, seq_q: int, seq_kv: int, *,
                is_causal: bool = False, window: tuple[int, int] | None = None,
                chunk: int | None = None, **facts) -> Problem:
  """The one maker of a :class:`Problem`: of these facts as they are
  given (the compute dtype, the head dims as computed, and ``facts``, its
  other fields), its mask made here, once, of the lengths, ``is_causal``,
  the window and the chunk.  The API reads a call's through
  :func:`problem_of_shapes`."""
  mask = Mask(seq_q=seq_q, seq_kv=seq_kv, causal=bool(is_causal), window=window, chunk=chunk)
  return Problem(dtype, head_dim, head_dim_out, mask, **facts)


def compute_dtype(dtype) -> np.dtype:
  """The dtype the kernels compute inputs of ``dtype`` in: float32 is cast
  to bfloat16 before them."""
  import ml_dtypes
  dtype = np.dtype(dtype)
  return np.dtype(ml_dtypes.bfloat16) if dtype == np.float32 else dtype


def problem_of_shapes(query_shape, key_shape, value_shape, dtype, *,
                      untiled_copies: bool | None = None, **facts) -> Problem:
  """The Problem of a call with these (B, T, N, H)/(B, S, K, H)/(B, S, K, Hv)
  shapes (:func:`problem_for` of ``facts``); ``dtype`` is the input dtype
  (f32 is computed in bf16: :func:`compute_dtype`), the head dims are
  padded (:func:`padded_head_dims`), FP8 gets per-tensor descales and a
  bfloat16 output unless ``facts`` name its own (kernel.api.problem_of
  does), and the copies are untiled where :func:`untiled_copies_pay`
  (``untiled_copies`` None) or as ``untiled_copies`` says."""
  import ml_dtypes
  dtype = compute_dtype(dtype)
  head_dim, head_dim_out = padded_head_dims(query_shape[-1], value_shape[-1])
  if dtype.itemsize == 1:
    facts = {"out_dtype": np.dtype(ml_dtypes.bfloat16), "descales": "tensor", **facts}
  problem = problem_for(dtype, head_dim, head_dim_out, query_shape[1], key_shape[1],
                        untiled_copies=bool(untiled_copies), **facts)
  if untiled_copies is None:
    return problem.replace(untiled_copies=untiled_copies_pay(problem))
  return problem


# FP8's P enters the PV product as e4m3 at 2^FP8_P_SCALE_LOG2 times its
# value, exp2(s - m + 8) in [0, 256] (docs/decisions/fp8-p-scale.md): the
# kernel (kernel.forward.fp8), the float64 reference's naive yardstick and
# the NumPy model read it here.
FP8_P_SCALE_LOG2 = 8

# FP8 wgmma reads both operands K-major, so PV needs V with the keys
# fastest: V^T, made once in HBM before the kernel (O(S * D) bytes beside
# the kernel's O(T * S * D) flops; docs/decisions/fp8-values-transposed-in-hbm.md).
# P leaves the softmax in wgmma's accumulator layout, which gives a thread
# keys (2q, 2q + 1, 8 + 2q, 9 + 2q) of every 16, and enters PV as its 8-bit
# A operand, which reads them as keys 4q .. 4q + 3: the registers are
# relabelled, not moved between threads (kernel.forward.fp8.p_operand), and V^T's keys are
# stored in the matching order.
FP8_KEY_GROUP = 16


def fp8_key_order() -> tuple[int, ...]:
  """Position j of every 16 keys of a V^T block holds key fp8_key_order()[j]:
  the key P's relabelled registers pair with column j of the A operand."""
  return tuple(2 * (j // 4) + (j % 2) + 8 * ((j % 4) // 2) for j in range(FP8_KEY_GROUP))


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  swizzled: bool = True    # tiled + swizzled for wgmma/TMA
  # The swizzle in bytes; None: the widest one a row holds.  wgmma takes
  # both smem operands of one product in one swizzle, so buffers that meet
  # in a product narrower than a 128-byte row (64 bf16 columns) all say 64.
  swizzle: int | None = None

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MBarrier:
  """``num_barriers`` mbarriers of ``num_arrivals`` arrivals each."""

  name: str
  num_barriers: int
  num_arrivals: int
  why: str


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """The key/value stage ring.

  The memory warpgroup fills slot ``PipelineState.at(S, g).index`` with key
  block g's ``key_phase`` buffers (keys, plus bias/mask when staged), each
  completing on its own "produced" mbarrier, then with its values.  Each
  compute warpgroup waits on the produced barriers, reads, and arrives on
  ``k_consumed`` (after QK, covering every key-phase buffer) and ``v_consumed``
  (after PV); those have one arrival per compute warpgroup.  For g < S the
  producer does not wait (its start is phase 1, like CUTLASS's producer).
  """

  num_stages: int
  key_phase: tuple[str, ...]   # ("k",) + ("bias",)? + ("mask",)?
  value_phase: tuple[str, ...]  # ("v",)
  compute_warpgroups: int
  persistent: bool
  mbarriers: tuple[MBarrier, ...]
  named_barriers: tuple[barriers.NamedBarrier, ...]

  @property
  def staged(self) -> tuple[str, ...]:
    return self.key_phase + self.value_phase

  def mbarrier(self, name: str) -> MBarrier:
    for b in self.mbarriers:
      if b.name == name:
        return b
    raise KeyError(name)


def pipeline_plan(problem: Problem, config: Config) -> PipelinePlan:
  stages = effective_stages(problem, config)
  key_phase = ("k",) + (("bias",) if problem.bias_2d else ()) + (
      ("mask",) if problem.mask_2d else ())
  cw = config.compute_warpgroups
  return PipelinePlan(
      num_stages=stages, key_phase=key_phase, value_phase=("v",),
      compute_warpgroups=cw, persistent=config.persistent,
      mbarriers=_mbarriers(problem, config, overlays_query_with_output(problem, config)),
      named_barriers=barriers.named_barriers(cw))


def _mbarriers(problem: Problem, config: Config, overlay_q: bool) -> tuple[MBarrier, ...]:
  stages = effective_stages(problem, config)
  key_phase = ("k",) + (("bias",) if problem.bias_2d else ()) + (
      ("mask",) if problem.mask_2d else ())
  cw = config.compute_warpgroups
  mb = [MBarrier("q_produced", cw, 1, "each compute warpgroup's query tile landed")]
  if config.persistent:
    if overlay_q:
      mb.append(MBarrier("q_consumed", cw, 1,
                         "a compute warpgroup's output copy has read its query slot, "
                         "where the output was staged: refill its queries"))
    else:
      mb.append(MBarrier("q_consumed", cw, 1,
                         "a compute warpgroup's last QK of the tile completed: refill its queries"))
  for name in key_phase + ("v",):
    mb.append(MBarrier(f"{name}_produced", stages, 1, f"TMA of {name} into a slot landed"))
  mb.append(MBarrier("k_consumed", stages, cw, "every compute warpgroup finished QK on a slot"))
  mb.append(MBarrier("v_consumed", stages, cw, "every compute warpgroup finished PV on a slot"))
  return tuple(mb)


def effective_stages(problem: Problem, config: Config) -> int:
  """More stages than key blocks would only hold empty slots."""
  return _stages_for(problem.seq_kv, config)


def _stages_for(seq_kv: int, config: Config) -> int:
  return max(1, min(config.num_stages, -(-seq_kv // config.block_kv)))


@dataclasses.dataclass(frozen=True)
class ScratchLayout:
  """Shared-memory buffers of one block.  ``overlay`` groups share bytes."""

  q: Buffer
  k: Buffer
  v: Buffer
  o: Buffer
  m: Buffer | None
  l: Buffer | None
  bias: Buffer | None
  mask: Buffer | None
  overlay_qk_with_output: bool  # the non-persistent RefUnion
  # Persistent, when separate buffers do not fit: each compute warpgroup
  # stages its output in its own query slot (o is None), which is refilled
  # only once the output copy has read it.
  overlay_q_with_output: bool = False
  # Problem.untiled_copies: q, k, v and o in copy_parts' parts (a leading
  # dim after the slot's), each allocated beside an untiled view of the
  # same bytes, which their TMA copies use.
  untiled_copies: bool = False

  def buffers(self) -> tuple[Buffer, ...]:
    return tuple(b for b in (self.q, self.k, self.v, self.o, self.m, self.l,
                             self.bias, self.mask) if b is not None)

  @property
  def output_reaches_keys(self) -> bool:
    """Whether the non-persistent overlay's output group (o, then m and l)
    runs past the queries into the keys' bytes: where the value head dim
    is wider than the queries' (or m and l follow an output as long as
    the queries).  Then the epilogue's stores land on key slots, which is
    what epilogue_sync orders (kernel/sync/barriers.py)."""
    if not self.overlay_qk_with_output:
      return False
    return (sum(_allocated(b) for b in (self.o, self.m, self.l) if b is not None)
            > _allocated(self.q))

  def output_overlaps(self, residuals: bool) -> tuple:
    """Under the non-persistent overlay, the slots of q and k each of the
    output's buffers (o, then m and l with ``residuals``) shares bytes with,
    as kernel/forward/block.py's RefUnion lays them out: the slots its
    stores clobber, which the block sizes and head dims decide.  () without
    the overlay."""
    if not self.overlay_qk_with_output:
      return ()
    slots, at = [], 0
    for buf in (self.q, self.k):
      per = buf.nbytes // buf.shape[0]
      slots += [(buf.name, s, at + s * per, at + (s + 1) * per) for s in range(buf.shape[0])]
      at += _allocated(buf)
    out, at = [], 0
    for buf in (self.o, self.m, self.l) if residuals else (self.o,):
      if buf is None:
        continue
      hit = tuple((name, s) for name, s, lo, hi in slots if lo < at + buf.nbytes and at < hi)
      out.append((buf.name, hit))
      at += _allocated(buf)
    return tuple(out)


def output_slots(problem: Problem, config: Config) -> tuple:
  """The query and key slots the output's buffers share bytes with, as the
  kernel runs ``problem`` (:meth:`ScratchLayout.output_overlaps`, with the
  residuals the launch stores)."""
  return scratch_layout(problem, config).output_overlaps(
      kernel_problem(problem, config).return_residuals)


def kernel_problem(problem: Problem, config: Config) -> Problem:
  """The problem as the kernel runs it: under the split tail its pieces'
  (m, l) weigh them in the merge (kernel.forward.order.merge_pieces), so the
  kernel returns the residuals whether or not the caller asked.  The scratch
  layout and the shared-memory estimate read this."""
  if _kernel_residuals(problem, config) and not problem.return_residuals:
    return problem.replace(return_residuals=True)
  return problem


def _kernel_residuals(problem: Problem, config: Config) -> bool:
  """Whether the launch stores (m, l): asked for, or under the split tail."""
  return problem.return_residuals or config.schedule == "split-tail"


def overlays_query_with_output(problem: Problem, config: Config) -> bool:
  """Whether a persistent block stages each warpgroup's output in its query
  slot: only where the query and output tiles have one shape and dtype
  (never for FP8, whose output is wider than its queries) and separate
  buffers would not fit (head dim 256 with 64-row tiles, where otherwise only
  the non-persistent block fits; deeper rings or wider tiles at smaller head
  dims, which the autotuner then measures).  Everywhere else the query slot
  is refilled as soon as the tile's last QK completes, while the output
  drains; here the next tile's query load waits for the output copy."""
  if (not config.persistent or problem.head_dim != problem.head_dim_out
      or problem.output_dtype != np.dtype(problem.dtype)):
    return False
  problem = kernel_problem(problem, config)
  return not fits_in_smem(_estimate(_layout(problem, config, overlay_q=False), problem, config))


def scratch_layout(problem: Problem, config: Config) -> ScratchLayout:
  key = _layout_problem(problem, config)
  if key is None:   # symbolic lengths (the proof's traces): not memoised
    kp = kernel_problem(problem, config)
    return _layout(kp, config, overlay_q=overlays_query_with_output(kp, config))
  return _scratch_layout(key, config)


def _layout_problem(problem: Problem, config: Config) -> tuple | None:
  """The facts of ``problem`` as the kernel runs it (:func:`kernel_problem`)
  that its scratch layout and shared-memory estimate read, its keys cut to
  the blocks the ring holds (:func:`effective_stages`): the key of their
  memo, which the heuristics over a grid of lengths ask many times
  (properties/kernel/test_heuristics.py holds it to the uncut problem's),
  a tuple so that a hit makes no problem; None for symbolic lengths."""
  seq_kv = problem.seq_kv
  if not isinstance(seq_kv, (int, np.integer)):
    return None
  return (problem.dtype, problem.head_dim, problem.head_dim_out,
          _stages_for(seq_kv, config) * config.block_kv, problem.bias_2d, problem.mask_2d,
          _kernel_residuals(problem, config), problem.untiled_copies, problem.out_dtype)


@functools.lru_cache(maxsize=None)
def _layout_key_problem(key: tuple) -> Problem:
  """The problem of a :func:`_layout_problem` key: one query, the keys the ring holds."""
  dtype, d, dv, seq_kv, bias_2d, mask_2d, residuals, untiled, out_dtype = key
  return problem_for(dtype, d, dv, seq_q=1, seq_kv=seq_kv, bias_2d=bias_2d, mask_2d=mask_2d,
                     return_residuals=residuals, untiled_copies=untiled, out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _scratch_layout(key: tuple, config: Config) -> ScratchLayout:
  problem = _layout_key_problem(key)
  return _layout(problem, config, overlay_q=overlays_query_with_output(problem, config))


def _layout(problem: Problem, config: Config, *, overlay_q: bool) -> ScratchLayout:
  cw = config.compute_warpgroups
  s = effective_stages(problem, config)
  bq, bkv = config.block_q, config.block_kv
  dt = np.dtype(problem.dtype)
  res = problem.return_residuals
  def rows(width, n, dtype=dt):
    """n rows of ``width`` columns: whole, or in copy_parts' parts."""
    if not problem.untiled_copies:
      return (n, width)
    parts, columns = copy_parts(width, np.dtype(dtype).itemsize)
    return (parts, n, columns)

  d, dv = problem.head_dim, problem.head_dim_out
  out_dt = problem.output_dtype
  return ScratchLayout(
      q=Buffer("q", (cw, *rows(d, bq)), dt),
      k=Buffer("k", (s, *rows(d, bkv)), dt),
      # FP8: each slot holds V^T, keys fastest (fp8_key_order), whole
      # rows of keys under untiled copies too (V^T is a copy made whole).
      v=Buffer("v", (s, dv, bkv) if problem.fp8 else (s, *rows(dv, bkv)), dt),
      o=None if overlay_q else Buffer("o", (cw, *rows(dv, bq, out_dt)), out_dt),
      m=Buffer("m", (cw, bq), np.dtype(np.float32), swizzled=False) if res else None,
      l=Buffer("l", (cw, bq), np.dtype(np.float32), swizzled=False) if res else None,
      bias=Buffer("bias", (s, cw * bq, bkv), problem.bias_dtype) if problem.bias_2d else None,
      mask=Buffer("mask", (s, cw * bq, bkv), np.dtype(np.int8)) if problem.mask_2d else None,
      # Persistent blocks prefetch the next tile's queries while the output
      # drains, so only the non-persistent path may overlay them.
      overlay_qk_with_output=not config.persistent,
      overlay_q_with_output=overlay_q,
      untiled_copies=problem.untiled_copies,
  )


def _align(n: int, a: int) -> int:
  return -(-n // a) * a


def _allocated(buf: Buffer) -> int:
  """The bytes a buffer takes in its allocation group: Mosaic GPU starts
  every allocation at a SMEM_ALIGNMENT boundary."""
  return _align(buf.nbytes, SMEM_ALIGNMENT)


def estimate_smem_bytes(problem: Problem, config: Config) -> int:
  """Shared memory the kernel allocates for this problem and config.

  Computed from :func:`scratch_layout` and :func:`pipeline_plan`, the very
  descriptions the kernel allocates; the CPU tests check it against the
  lowering's own count (never below it, within a stated margin above).
  """
  key = _layout_problem(problem, config)
  if key is None:   # symbolic lengths (the proof's traces): not memoised
    return _estimate(scratch_layout(problem, config), kernel_problem(problem, config), config)
  return _estimate_of(key, config)


@functools.lru_cache(maxsize=None)
def _estimate_of(key: tuple, config: Config) -> int:
  return _estimate(_scratch_layout(key, config), _layout_key_problem(key), config)


def _estimate(lay: ScratchLayout, problem: Problem, config: Config) -> int:
  mbarriers = _mbarriers(problem, config, lay.overlay_q_with_output)
  pad = _allocated
  qk = pad(lay.q) + pad(lay.k)
  out = sum(pad(b) for b in (lay.o, lay.m, lay.l) if b is not None)
  if lay.overlay_qk_with_output:
    total = max(qk, out)
  else:
    total = qk + out
  total += pad(lay.v)
  total += sum(pad(b) for b in (lay.bias, lay.mask) if b is not None)
  total += REDUCTION_SCRATCH_BYTES
  total = _align(total, SMEM_ALIGNMENT)
  total += MBARRIER_BYTES * sum(b.num_barriers for b in mbarriers)
  return total


def fits_in_smem(nbytes: int) -> bool:
  """The one fit predicate, for every launch of both passes: a block may use
  all of the SMEM_LIMIT_BYTES the hardware gives it, so the boundary is
  inclusive.  (Every estimate is an SMEM_ALIGNMENT multiple plus 8 bytes per
  mbarrier, so no plan lands exactly on the limit.)"""
  return nbytes <= SMEM_LIMIT_BYTES


# Three compute warpgroups get 160 registers per thread (kernel/forward/context.py:
# COMPUTE_REGISTERS): room for a 64 x 128 logits block, its bf16 P and a
# 64 x 64 accumulator, not for wider heads' accumulators.  FlashAttention-3
# runs 192-row tiles at head dim 64 for the same reason: there the softmax
# takes about as long as the two matrix products.
THREE_WARPGROUP_HEAD_DIM = 64
# (block_q, block_kv, num_stages): the one tiling three compute warpgroups
# run: faster than three stages or 64-key blocks
# (docs/decisions/three-warpgroups-one-tiling.md).
# Only this tiling is offered to the autotuner, proved and accepted, so no
# three-warpgroup config runs unproved.
THREE_WARPGROUP_TILING = (64, 128, 2)


def warpgroups_refusal(problem: Problem, config: Config) -> str | None:
  """Why the compute warpgroups cannot run ``config`` on ``problem``, or
  None: two run every tiling; three run head dims up to
  :data:`THREE_WARPGROUP_HEAD_DIM` with :data:`THREE_WARPGROUP_TILING`."""
  if config.compute_warpgroups == 2:
    return None
  n = config.compute_warpgroups
  if max(problem.head_dim, problem.head_dim_out) > THREE_WARPGROUP_HEAD_DIM:
    return (f"{n} compute warpgroups hold head dims up to {THREE_WARPGROUP_HEAD_DIM} in their "
            f"registers; got head_dim={problem.head_dim}, head_dim_out={problem.head_dim_out} "
            f"(use 2)")
  tiling = (config.block_q, config.block_kv, config.num_stages)
  if tiling != THREE_WARPGROUP_TILING:
    want = dict(zip(("block_q", "block_kv", "num_stages"), THREE_WARPGROUP_TILING))
    got = dict(zip(want, tiling))
    return (f"{n} compute warpgroups run {_fields(want)} only (the fastest timed, and proved); "
            f"got {_fields(got)}")
  return None


def _fields(values: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in values.items())


def schedule_refusal(problem: Problem, config: Config) -> str | None:
  """Why ``config.schedule`` cannot run ``problem``, or None: the split tail
  deals a persistent grid of tiles with equal work (no causal mask)."""
  if config.schedule != "split-tail":
    return None
  if not config.persistent:
    return "split-tail deals tiles to persistent blocks: set persistent=True"
  if problem.mask.causal:
    return ("split-tail cuts the last waves evenly by key blocks, which a causal mask makes "
            "unequal: use longest-first")
  return None


def config_fits(problem: Problem, config: Config) -> bool:
  """Whether the forward can run ``config``: its schedule can
  (:func:`schedule_refusal`), its compute warpgroups can
  (:func:`warpgroups_refusal`) and its scratch fits shared memory.  What
  the heuristics filter by, what the autotune cache's entries are
  re-checked with."""
  return (schedule_refusal(problem, config) is None
          and warpgroups_refusal(problem, config) is None
          and fits_in_smem(estimate_smem_bytes(problem, config)))


def check_fits(problem: Problem, config: Config) -> int:
  """:func:`config_fits` as a ValueError naming what does not fit; returns
  the shared-memory estimate."""
  why = schedule_refusal(problem, config)
  if why is not None:
    raise ValueError(f"config.schedule: {why}")
  why = warpgroups_refusal(problem, config)
  if why is not None:
    raise ValueError(f"config.compute_warpgroups: {why}")
  est = estimate_smem_bytes(problem, config)
  if not fits_in_smem(est):
    raise ValueError(
        f"config {config} needs an estimated {est} bytes of shared memory "
        f"({est / 1024:.1f} KiB) for head_dim={problem.head_dim}, "
        f"head_dim_out={problem.head_dim_out}, dtype={np.dtype(problem.dtype).name}"
        f"{', staged bias' if problem.bias_2d else ''}"
        f"{', staged mask' if problem.mask_2d else ''}; the limit is "
        f"{SMEM_LIMIT_BYTES} bytes (227 KiB)")
  return est
