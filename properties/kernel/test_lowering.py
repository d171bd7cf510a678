"""Every config the heuristics and the autotuner emit lowers for CUDA (no GPU
needed), and the shared-memory estimate matches what the lowering allocates.

Margin: the estimate is never below the lowering's count (Mosaic GPU's own
size of the scratch tree, barriers included) and at most SMEM_MARGIN_BYTES
above it.  Today it is exact; the margin leaves room for an allocation rule of
Mosaic GPU's that the estimate rounds up.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from harness.numerics import strategies as hs
from harness.tools.lowering import lower_attention
from kernel.tiling import heuristics, plan
from kernel.tiling.config import Config

SMEM_MARGIN_BYTES = 2048

# Each lowering costs two to five seconds of CPU.  The ci profile lowers,
# of each problem, the heuristic's config and of the autotuner's every
# FULLEST_STRIDE-th for the fullest feature set of each grid (staged bias and
# mask, causal, residuals; the soft cap in the first) and every
# OTHERS_STRIDE-th for its other problems, to keep the suite within CI's 8
# minutes (docs/decisions/cpu-suite-time.md); ``HYPOTHESIS_PROFILE=thorough``
# lowers them all.
# The profile is the one properties/conftest.py loaded.
THOROUGH = hs.thorough()
FULLEST_STRIDE = 18
OTHERS_STRIDE = 48


def _configs_to_lower(problem, *, fullest: bool, may_refuse: bool = False) -> list:
  """The heuristic's config and the autotuner's, sorted; outside the
  thorough profile, every FULLEST_STRIDE-th (``fullest``) or OTHERS_STRIDE-th
  of the autotuner's.  ``may_refuse``: a problem the heuristic finds no
  config for (a staged bias that does not fit) keeps the autotuner's alone."""
  try:
    chosen = {heuristics.get_heuristics_config(problem)}
  except ValueError:
    if not may_refuse:
      raise
    chosen = set()
  others = sorted(set(heuristics.get_autotuning_configs(problem)) - chosen, key=str)
  if not THOROUGH:
    # A split-tail candidate is its round-robin twin with another schedule:
    # test_split_tail_configs_lower_and_the_estimate_holds lowers its own.
    others = [c for c in others if c.schedule != "split-tail"]
    others = others[::FULLEST_STRIDE if fullest else OTHERS_STRIDE]
  return sorted(chosen | set(others), key=str)

SHAPE_CLASSES = {  # name: (head_dim, head_dim_out)
    "d64": (64, 64),
    "d128": (128, 128),
    "d256": (256, 256),
    "d72-dv96": (72, 96),
}
SEQ = 1024


def _features(T, S, N=2):
  return {
      "plain": dict(),
      "everything": dict(is_causal=True, return_residuals=True, logits_soft_cap=20.0,
                         rescale_threshold=0.5, normalize_output=False,
                         bias_shape=(1, N, T, S), mask_shape=(1, 1, T, S),
                         k_range_shape=(1, N, T)),
  }


def _problem(q_shape, k_shape, v_shape, kw, dtype="bfloat16"):
  """The problem the API runs for these arguments (kernel.api.resolved_problem):
  2-D bias and mask staged through the ring where a config fits with them;
  an FP8 ``dtype`` with per-tensor descales and a bfloat16 bias."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  sds = lambda shape, dt=jnp.bfloat16: None if shape is None else jax.ShapeDtypeStruct(shape, dt)
  dt = jnp.dtype(dtype)
  fp8 = ({n: 1.0 for n in ("q_descale", "k_descale", "v_descale")} if dt.itemsize == 1 else {})
  return api.resolved_problem(
      sds(q_shape, dt), sds(k_shape, dt), sds(v_shape, dt), sds(kw.get("bias_shape")),
      sds(kw.get("mask_shape"), jnp.bool_), is_causal=kw.get("is_causal", False),
      return_residuals=kw.get("return_residuals", False),
      k_start=sds(kw.get("k_range_shape"), jnp.int32), k_end=sds(kw.get("k_range_shape"), jnp.int32),
      stage_2d=kw.get("stage_2d", True), **fp8)


def _cfg_tag(cfg) -> str:
  """A config in a test id: every field that tells two emitted configs apart."""
  return (f"q{cfg.block_q}-kv{cfg.block_kv}-s{cfg.num_stages}-{'p' if cfg.persistent else 'np'}"
          f"{'-lf' if cfg.schedule == 'longest-first' else ''}"
          f"{'-st' if cfg.schedule == 'split-tail' else ''}"
          f"{'-w%d' % cfg.compute_warpgroups if cfg.compute_warpgroups != 2 else ''}")


def _grid():
  features = _features(SEQ, SEQ)
  # The 2-D bias and mask read from global memory (the private stage_2d=False,
  # and what the API falls back to where staging does not fit): its configs too.
  features["everything-unstaged"] = dict(features["everything"], stage_2d=False)
  for cls, (d, dv) in SHAPE_CLASSES.items():
    for feat, kw in features.items():
      problem = _problem((1, SEQ, 2, d), (1, SEQ, 1, d), (1, SEQ, 1, dv), kw)
      for cfg in _configs_to_lower(problem, fullest=feat == "everything"):
        tag = f"{cls}-{feat}-{_cfg_tag(cfg)}"
        yield pytest.param(d, dv, kw, problem, cfg, id=tag)


@pytest.mark.parametrize("d,dv,kw,problem,cfg", list(_grid()))
def test_the_emitted_configs_lower_and_the_estimate_holds(d, dv, kw, problem, cfg):
  shapes = dict(B=1, T=SEQ, N=2, H=d, S=SEQ, K=1, Hv=dv)
  lowered = lower_attention(shapes, config=cfg, **kw)
  est = plan.estimate_smem_bytes(problem, cfg)
  assert lowered.smem_bytes <= est <= lowered.smem_bytes + SMEM_MARGIN_BYTES, (
      f"estimate {est} vs lowering {lowered.smem_bytes}")


# The split tail's own lowerings (the ci profile leaves its twins out of
# the sample above): two and three compute warpgroups, the output staged in
# the query slot at head dim 256, and residuals, ranges, a threshold and
# staged operands; at SEQ every tile is cut into pieces (fewer tiles than
# SMs), so the pieces' slots are allocated and stored.
SPLIT_TAIL = [
    ("d64-w3", "d64", "plain", Config(64, 128, 2, True, "split-tail", 3)),
    ("d128", "d128", "plain", Config(64, 128, 2, True, "split-tail")),
    ("d256-output-in-query-slot", "d256", "plain", Config(64, 64, 2, True, "split-tail")),
    ("d72-dv96-staged", "d72-dv96", "non-causal-everything",
     Config(64, 64, 3, True, "split-tail")),
]


@pytest.mark.parametrize("name,cls,feat,cfg", SPLIT_TAIL, ids=[n for n, *_ in SPLIT_TAIL])
def test_split_tail_configs_lower_and_the_estimate_holds(name, cls, feat, cfg):
  d, dv = SHAPE_CLASSES[cls]
  features = _features(SEQ, SEQ)
  features["non-causal-everything"] = dict(features["everything"], is_causal=False)
  kw = features[feat]
  problem = _problem((1, SEQ, 2, d), (1, SEQ, 1, d), (1, SEQ, 1, dv), kw)
  assert cfg in heuristics.get_autotuning_configs(problem)
  lowered = lower_attention(dict(B=1, T=SEQ, N=2, H=d, S=SEQ, K=1, Hv=dv), config=cfg, **kw)
  est = plan.estimate_smem_bytes(problem, cfg)
  assert lowered.smem_bytes <= est <= lowered.smem_bytes + SMEM_MARGIN_BYTES, (
      f"estimate {est} vs lowering {lowered.smem_bytes}")


# FP8: the heuristic's config of each problem of the grid and, for the
# plain features, every FP8_STRIDE-th of the autotuner's (the thorough
# profile: all of them, and the ragged shapes below).  One-byte rows admit
# configs 16-bit ones cannot (wider key blocks, deeper rings); a lowering
# with every feature takes several seconds, so the ci profile samples.
FP8_STRIDE = 64


def _fp8_grid():
  for cls, (d, dv) in SHAPE_CLASSES.items():
    for feat, kw in _features(SEQ, SEQ).items():
      problem = _problem((1, SEQ, 2, d), (1, SEQ, 1, d), (1, SEQ, 1, dv), kw,
                         dtype="float8_e4m3fn")
      chosen = {heuristics.get_heuristics_config(problem)}
      others = sorted(set(heuristics.get_autotuning_configs(problem)) - chosen, key=str)
      sample = others if THOROUGH else others[::FP8_STRIDE] if feat == "plain" else []
      for cfg in sorted(chosen | set(sample), key=str):
        yield pytest.param(d, dv, kw, problem, cfg, id=f"fp8-{cls}-{feat}-{_cfg_tag(cfg)}")


@pytest.mark.parametrize("d,dv,kw,problem,cfg", list(_fp8_grid()))
def test_the_emitted_fp8_configs_lower_and_the_estimate_holds(d, dv, kw, problem, cfg):
  """FP8 (float8_e4m3fn, V^T in the value slots, a bfloat16 output staged)
  lowers for CUDA with every config emitted for it, within the estimate."""
  shapes = dict(B=1, T=SEQ, N=2, H=d, S=SEQ, K=1, Hv=dv)
  lowered = lower_attention(shapes, dtype="float8_e4m3fn", config=cfg, **kw)
  est = plan.estimate_smem_bytes(problem, cfg)
  assert lowered.smem_bytes <= est <= lowered.smem_bytes + SMEM_MARGIN_BYTES, (
      f"estimate {est} vs lowering {lowered.smem_bytes}")


@pytest.mark.parametrize("out_dtype", ["float16"])
def test_fp8_per_head_descales_and_output_dtypes_lower(out_dtype):
  """Per (batch, kv head) descales over GQA at ragged lengths and padded
  head dims, and the output dtype other than the default."""
  import jax.numpy as jnp
  lowered = lower_attention(dict(B=2, T=113, N=4, H=72, S=203, K=2, Hv=96),
                            dtype="float8_e4m3fn", descales="head", is_causal=True,
                            return_residuals=True, out_dtype=jnp.dtype(out_dtype))
  assert lowered.smem_bytes > 0


RAGGED = [(113, 203), (239, 1), (1, 1), (1023, 1024), (300, 77)]


# bfloat16 with the plain features and with every feature at every length;
# float16 and float32 (cast to a 16-bit kernel) with every feature at every
# other length each, so that together they take every length; the thorough
# profile adds them at every length, the plain features in both, and FP8.
_RAGGED_KINDS = [(T, S, dtype, feat) for i, (T, S) in enumerate(RAGGED)
                 for dtype in ("bfloat16", "float16", "float32", "float8_e4m3fn")
                 for feat in ("plain", "everything")
                 if THOROUGH or dtype == "bfloat16"
                 or (feat == "everything" and dtype == ("float16", "float32")[i % 2])]


@pytest.mark.parametrize("T,S,dtype,feat", _RAGGED_KINDS,
                         ids=[f"{d}-{f}-{T}-{S}" for T, S, d, f in _RAGGED_KINDS])
def test_ragged_shapes_lower_with_the_heuristic_config(T, S, feat, dtype):
  kw = _features(T, S, N=4)[feat]
  lowered = lower_attention(dict(B=2, T=T, N=4, H=72, S=S, K=2, Hv=96), dtype=dtype, **kw)
  assert lowered.smem_bytes > 0


# Copies through untiled views (kernel.tiling.plan.untiled_copies_pay): lengths
# no multiple of 8, under every kind of schedule and with every feature,
# at head dims of one column part (64) and of several (kernel.tiling.plan.copy_parts:
# 128 in two of 64, 96 in three of 32, 256 in four), the value's parts
# unlike the queries' (72 and 96: three of 32 each; 64 and 256).
UNTILED = [
    ("heuristic", "plain", None, (64, 64)),
    ("persistent-w3", "everything", Config(64, 128, 2, True, "longest-first", 3), (64, 64)),
    ("one-tile", "everything", Config(64, 128, 2, False), (64, 64)),
    ("split-tail", "plain", Config(64, 128, 2, True, "split-tail"), (64, 64)),
    ("output-in-query-slot", "residuals", Config(64, 256, 3, True), (64, 64)),
    ("d128-heuristic", "everything", None, (128, 128)),
    ("d128-split-tail", "residuals", Config(64, 128, 2, True, "split-tail"), (128, 128)),
    ("d96-one-tile", "plain", Config(64, 128, 2, False), (96, 96)),
    ("d72-dv96-persistent", "everything", Config(64, 128, 2, True, "longest-first"), (72, 96)),
    ("d256-output-in-query-slot", "residuals", Config(64, 64, 2, True), (256, 256)),
    ("d64-dv256-output-over-keys", "residuals", Config(64, 64, 2, False), (64, 256)),
]


def _jaxpr_text(shapes, gradients=False, **kw):
  """The jaxpr of the API's call on bfloat16 q, k, v of ``shapes`` (with
  ``gradients``, of jax.grad of its sum with respect to them)."""
  import jax
  import jax.numpy as jnp
  from kernel import api, experiments
  sds = jax.ShapeDtypeStruct
  B, T, N, H, S, K, Hv = (shapes[x] for x in ("B", "T", "N", "H", "S", "K", "Hv"))
  args = (sds((B, T, N, H), jnp.bfloat16), sds((B, S, K, H), jnp.bfloat16),
          sds((B, S, K, Hv), jnp.bfloat16))
  call = lambda q, k, v: experiments.dot_product_attention(q, k, v, **kw)
  if gradients:
    call = jax.grad(lambda q, k, v: experiments.dot_product_attention(q, k, v, **kw).astype(
        jnp.float32).sum(), argnums=(0, 1, 2))
  with api.lowering_only():
    return str(jax.make_jaxpr(call)(*args))


@pytest.mark.parametrize("name,feat,cfg,dims", UNTILED, ids=[n for n, *_ in UNTILED])
def test_untiled_copies_lower_at_any_length_without_padded_copies(name, feat, cfg, dims):
  T, S = 1001, 777
  d, dv = dims
  shapes = dict(B=2, T=T, N=4, H=d, S=S, K=2, Hv=dv)
  kw = _features(T, S, N=4).get(feat, dict(return_residuals=True))
  if "bias_shape" in kw:  # staged operands are padded copies of their own
    kw = {k: v for k, v in kw.items() if k not in ("bias_shape", "mask_shape")}
  problem = _problem((2, T, 4, d), (2, S, 2, d), (2, S, 2, dv), kw).replace(
      untiled_copies=True)
  cfg = cfg or heuristics.get_heuristics_config(problem)
  layout = plan.scratch_layout(problem, cfg)
  if "output-in-query-slot" in name:
    assert layout.overlay_q_with_output
  if "output-over-keys" in name:
    assert layout.output_reaches_keys
  parts, columns = plan.copy_parts(problem.head_dim, 2)
  assert layout.q.shape[1:] == (parts, cfg.block_q, columns)
  lowered = lower_attention(shapes, config=cfg, untiled_copies=True, **kw)
  est = plan.estimate_smem_bytes(problem, cfg)
  assert lowered.smem_bytes <= est <= lowered.smem_bytes + SMEM_MARGIN_BYTES, (
      f"estimate {est} vs lowering {lowered.smem_bytes}")
  range_kw = {k: v for k, v in kw.items() if k != "k_range_shape"}
  untiled = _jaxpr_text(shapes, config=cfg, untiled_copies=True, **range_kw)
  tiled = _jaxpr_text(shapes, config=cfg, untiled_copies=False, **range_kw)
  # Where the head dims compute as they are, the padded path pads the
  # queries to whole tiles and untiled copies pad nothing.  (Where they
  # compute wider, 72 as 96, both copy q, k and v to pad the head dim, and
  # pad the length in the same copy.)
  if (d, dv) == plan.padded_head_dims(d, dv):
    assert f"bf16[2,{-(-T // cfg.tile_q) * cfg.tile_q},4,{d}]" in tiled
    assert " pad[" not in untiled


# The shipped API's forward at lengths no multiple of 8: q, k and v read
# unpadded through untiled views, but where the padded copy wins (rows
# wider than 128 columns, no causal, from 8192 keys:
# kernel.tiling.plan.untiled_copies_pay); at aligned lengths nothing is copied.
_SHIPPED_LENGTHS = [(d, T, S, causal) for d in (64, 128, 256) for causal in (False, True)
                    for T, S in ((1001, 777), (4001, 4001), (12017, 12017), (1024, 1024))]


@pytest.mark.parametrize("d,T,S,causal", _SHIPPED_LENGTHS,
                         ids=[f"d{d}-{T}x{S}{'-causal' if c else ''}"
                              for d, T, S, c in _SHIPPED_LENGTHS])
def test_the_api_forward_copies_no_padded_operand_where_untiled_copies_pay(d, T, S, causal):
  import jax
  import jax.numpy as jnp
  from kernel import api
  sds = jax.ShapeDtypeStruct
  q, k = sds((1, T, 4, d), jnp.bfloat16), sds((1, S, 2, d), jnp.bfloat16)
  problem = _problem(q.shape, k.shape, k.shape, dict(is_causal=causal))
  with api.lowering_only():
    text = str(jax.make_jaxpr(lambda q, k, v: api.dot_product_attention(
        q, k, v, is_causal=causal))(q, k, k))
  padded_wins = d > 128 and not causal and S >= plan.UNTILED_WIDE_NONCAUSAL_KEYS
  ragged = T % 8 or S % 8
  assert problem.untiled_copies == bool(ragged and not padded_wins)
  assert (" pad[" in text) == bool(ragged and padded_wins), text[:2000]


# FP8 through untiled views (kernel.experiments' untiled_copies): queries
# and keys in parts of one-byte swizzle atoms, V^T whole, the output in
# 16-bit parts, at lengths no multiple of 8 under each kind of launch.
FP8_UNTILED = [
    ("d128-one-tile", (128, 128), Config(64, 128, 2, False), dict()),
    ("d128-persistent-lf-causal", (128, 128), Config(64, 128, 2, True, "longest-first"),
     dict(is_causal=True)),
    ("d64-bkv256-residuals", (64, 64), Config(64, 256, 2, True), dict(return_residuals=True)),
    ("d256-one-tile", (256, 256), Config(64, 128, 2, False), dict()),
    ("d64-dv256-heuristic", (64, 256), None, dict()),
    ("d128-split-tail", (128, 128), Config(64, 128, 2, True, "split-tail"), dict()),
]


@pytest.mark.parametrize("name,dims,cfg,kw", FP8_UNTILED, ids=[n for n, *_ in FP8_UNTILED])
def test_fp8_untiled_copies_lower_and_copy_only_the_values_transposed(name, dims, cfg, kw):
  import jax
  import jax.numpy as jnp
  from kernel import api, experiments
  T, S = 1001, 777
  d, dv = dims
  shapes = dict(B=2, T=T, N=4, H=d, S=S, K=2, Hv=dv)
  lowered = lower_attention(shapes, dtype="float8_e4m3fn", config=cfg, untiled_copies=True,
                            **kw)
  assert lowered.smem_bytes > 0
  sds = jax.ShapeDtypeStruct
  f8 = jnp.float8_e4m3fn
  args = (sds((2, T, 4, d), f8), sds((2, S, 2, d), f8), sds((2, S, 2, dv), f8))
  descales = {n: 1.0 for n in ("q_descale", "k_descale", "v_descale")}

  def pads(untiled):
    call = lambda q, k, v: experiments.dot_product_attention(
        q, k, v, config=cfg, untiled_copies=untiled, **descales, **kw)
    with api.lowering_only():   # each jnp.pad a call named _pad (its body printed once)
      return str(jax.make_jaxpr(call)(*args)).count("name=_pad")
  # untiled: V^T's one copy, made whole before the transpose; padded: q and
  # k as well
  assert pads(True) == 1 < pads(False)


@pytest.mark.parametrize("width,parts", [(64, (1, 64)), (96, (3, 32)), (128, (2, 64)),
                                         (192, (3, 64)), (256, (4, 64))])
def test_copy_parts_are_one_swizzle_atom_each(width, parts):
  assert plan.copy_parts(width, 2) == parts
  assert plan.row_swizzle_bytes(parts[1], 2) == parts[1] * 2


def test_a_buffer_and_its_untiled_view_share_their_bytes():
  """The untiled views (kernel.common.untiled_smem) rely on Mosaic GPU
  laying every group of a RefUnion out from its first byte (RefUnion's
  docstring does not promise it: jax 0.11.2's flatten_ref_union does it),
  so that a group of views mirroring the buffers' group leaf for leaf puts
  each view on its buffer's bytes; and on each view differing from its
  buffer by the tiling alone, which for rows of one swizzle atom is the
  row-major order."""
  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from kernel import common
  bf16 = np.dtype(ml_dtypes.bfloat16)
  bufs = (plan.Buffer("q", (2, 2, 64, 64), bf16), plan.Buffer("k", (3, 2, 128, 64), bf16),
          plan.Buffer("m", (2, 64), np.dtype(np.float32), swizzled=False))
  tiled = tuple(common.smem(b) for b in bufs)
  untiled = tuple(common.untiled_smem(b) for b in bufs)
  for t, u in zip(tiled[:2], untiled[:2]):
    assert [type(x) for x in t.transforms] == [plgpu.TilingTransform, plgpu.SwizzleTransform]
    assert t.transforms[0].tiling == (8, 64)
    assert u.transforms == t.transforms[1:]
  union = plgpu.RefUnion(tiled, untiled)
  members = mgpu_core.flatten_ref_union(union.get_ref_aval())
  offsets = [[m.transforms[0].offset for m in group] for group in members]
  assert offsets[0] == offsets[1] and offsets[0][0] == 0 and len(set(offsets[0])) == 3
  for group in members:
    assert [tuple(m.shape) for m in group] == [b.shape for b in bufs]


def test_three_compute_warpgroups_above_head_dim_64_are_refused_by_name():
  from kernel.tiling.config import Config
  with pytest.raises(ValueError, match=r"^config.compute_warpgroups: 3 compute warpgroups"):
    lower_attention(dict(B=1, T=256, N=2, H=128, S=256, K=2, Hv=128),
                    config=Config(64, 128, 2, compute_warpgroups=3))


def test_a_config_that_does_not_fit_is_refused_with_its_estimate():
  from kernel.tiling.config import Config
  with pytest.raises(ValueError, match=r"config .* needs an estimated \d+ bytes"):
    lower_attention(dict(B=1, T=256, N=1, H=256, S=1024, K=1, Hv=256),
                    config=Config(128, 256, 4, persistent=True))


BACKWARD_HEAD_DIMS = [(64, 64), (128, 128), (72, 96), (256, 256), (256, 128), (128, 256)]


# Under the ci profile each head-dim class with one feature set, alternating
# (docs/decisions/cpu-suite-time.md); thorough, both.
_BACKWARD_FEATURES = [(d, dv, feat) for (d, dv), feat in
                      hs.ci_pairs(BACKWARD_HEAD_DIMS, ("plain", "everything"))]


@pytest.mark.parametrize("d,dv,feat", _BACKWARD_FEATURES,
                         ids=[f"{feat}-d{d}-dv{dv}" for d, dv, feat in _BACKWARD_FEATURES])
def test_the_backward_kernels_lower_and_fit(d, dv, feat):
  """jax.grad through the API lowers for CUDA (forward + the dK/dV and dQ
  kernels of kernel/backward/) for every head-dim class, with every
  feature; every kernel fits in 227 KiB."""
  T, S = 300, 200
  kw = _features(T, S, N=4)[feat]
  kw = {k: v for k, v in kw.items() if k not in ("normalize_output", "return_residuals")}
  lowered = lower_attention(dict(B=2, T=T, N=4, H=d, S=S, K=2, Hv=dv), gradients=True, **kw)
  assert lowered.smem_bytes > 0 and plan.fits_in_smem(lowered.smem_bytes)


def test_the_fused_causal_experiment_lowers_without_the_dq_kernel():
  """kernel.experiments' "pallas-fused-causal" (the A/B of blocks_for's
  causal choice at head dim 128) lowers for CUDA and accumulates dQ in the
  dK/dV launch: one kernel less than the shipped causal backward, each
  within 227 KiB."""
  shapes = dict(B=1, T=300, N=4, H=128, S=300, K=2, Hv=128)
  shipped = lower_attention(shapes, gradients=True, is_causal=True)
  fused = lower_attention(shapes, gradients=True, is_causal=True,
                          backward="pallas-fused-causal")
  assert len(fused.kernel_smem) == len(shipped.kernel_smem) - 1, (fused, shipped)
  assert all(plan.fits_in_smem(b) for b in fused.kernel_smem)


NARROW_HEAD_DIMS = [(96, 96), (80, 80), (72, 64), (64, 96)]


# Under the ci profile each head-dim pair full or causal, alternating; thorough, both.
_NARROW = [(d, dv, causal) for (d, dv), causal in hs.ci_pairs(NARROW_HEAD_DIMS, (False, True))]


@pytest.mark.parametrize("d,dv,causal", _NARROW,
                         ids=[f"{'causal' if c else 'full'}-d{d}-dv{dv}" for d, dv, c in _NARROW])
def test_the_backward_lowers_in_narrow_rows(d, dv, causal):
  """kernel.experiments' "pallas-narrow-rows" (the backward in the
  forward's 32-column rows: kernel.tiling.plan.backward_head_dims) lowers for CUDA
  at head dims that are no multiple of 64, each kernel within 227 KiB, and
  computes narrower than the shipped backward's 64-column rows: less
  shared memory in some launch."""
  shapes = dict(B=1, T=256, N=4, H=d, S=256, K=2, Hv=dv)
  shipped = lower_attention(shapes, gradients=True, is_causal=causal)
  narrow = lower_attention(shapes, gradients=True, is_causal=causal,
                           backward="pallas-narrow-rows")
  assert all(plan.fits_in_smem(b) for b in narrow.kernel_smem)
  assert len(narrow.kernel_smem) == len(shipped.kernel_smem)
  assert narrow.kernel_smem[0] == shipped.kernel_smem[0]  # the same forward
  assert sum(narrow.kernel_smem[1:]) < sum(shipped.kernel_smem[1:])


# Lengths that are multiples of 8 but of no backward tile: the fused dQ with
# GQA, causal (the dQ kernel over head dim 64), the head split, the fixed point.
UNPADDED_BACKWARD = [
    ("d64-gqa", dict(B=2, T=1000, N=4, H=64, S=520, K=2, Hv=64), {}),
    ("d128-causal", dict(B=1, T=1000, N=4, H=128, S=1000, K=2, Hv=128), dict(is_causal=True)),
    ("d256-head-split", dict(B=1, T=200, N=2, H=256, S=456, K=1, Hv=256), {}),
    ("d128-fixed-point", dict(B=1, T=1000, N=4, H=128, S=1000, K=2, Hv=128),
     dict(deterministic=True)),
]


def _grad_pads(shapes, **kw) -> list[str]:
  """The shapes of the 16-bit arrays shaped like q, k, v or dO (rank 4,
  heads third) that the program of jax.grad through the API pads."""
  text = _jaxpr_text(shapes, gradients=True, **kw)
  return [m for m in re.findall(r"(bf16\[\d+,\d+,\d+,\d+\]) = pad\[", text)
          if int(m[4:-1].split(",")[2]) in (shapes["N"], shapes["K"])]


@pytest.mark.parametrize("name,shapes,kw", UNPADDED_BACKWARD, ids=[n for n, *_ in UNPADDED_BACKWARD])
def test_the_unpadded_backward_lowers_without_padded_copies(name, shapes, kw):
  """kernel.experiments' "pallas-unpadded" lowers for CUDA at lengths that
  are multiples of 8 but of no tile, every kernel within 227 KiB, and its
  program pads none of q, k, v and dO, which the shipped backward copies
  padded to whole tiles there."""
  lowered = lower_attention(shapes, gradients=True, backward="pallas-unpadded", **kw)
  assert lowered.kernel_smem and all(plan.fits_in_smem(b) for b in lowered.kernel_smem)
  assert _grad_pads(shapes, **kw), "the shipped backward pads nothing here: no test"
  assert _grad_pads(shapes, backward="pallas-unpadded", **kw) == []


# Lengths no multiple of 8 (kernel.experiments' "pallas-untiled" with the
# forward's untiled copies): the fused dQ (GQA, causal at head dim 64, fixed
# point), the dQ kernel under causal, the head split, value head dims unlike
# the queries'.
UNTILED_BACKWARD = [
    ("d64-gqa", dict(B=2, T=1001, N=4, H=64, S=777, K=2, Hv=64), {}),
    ("d64-gqa-causal", dict(B=1, T=4001, N=4, H=64, S=4001, K=2, Hv=64), dict(is_causal=True)),
    ("d128-causal", dict(B=1, T=4001, N=4, H=128, S=4001, K=2, Hv=128), dict(is_causal=True)),
    ("d128-fixed-point", dict(B=1, T=1001, N=4, H=128, S=1001, K=2, Hv=128),
     dict(deterministic=True)),
    ("d256-head-split", dict(B=1, T=12017, N=2, H=256, S=12017, K=1, Hv=256), {}),
    ("d256-gqa-causal", dict(B=1, T=1001, N=4, H=256, S=4001, K=2, Hv=256), dict(is_causal=True)),
    ("d128-dv256", dict(B=1, T=1001, N=2, H=128, S=777, K=1, Hv=256), {}),
]


def _wide_pads(shapes, **kw) -> list[str]:
  """The arrays of rank 4 or more (q, k, v, dO, or their column parts'
  reshapes) that the program of jax.grad through the API pads."""
  text = _jaxpr_text(shapes, gradients=True, **kw)
  return re.findall(r"(\w+\[\d+,\d+,\d+,\d+(?:,\d+)*\]) = pad\[", text)


@pytest.mark.parametrize("name,shapes,kw", UNTILED_BACKWARD, ids=[n for n, *_ in UNTILED_BACKWARD])
def test_the_untiled_backward_lowers_at_any_length_without_padded_copies(name, shapes, kw):
  """kernel.experiments' "pallas-untiled" (the backward's copies through
  untiled views in column parts) lowers for CUDA at lengths no multiple of
  8, every kernel within 227 KiB, and with the forward's untiled copies the
  program of the gradients pads none of q, k, v and dO, which the padded
  backward and the unpadded one both copy padded there."""
  untiled = dict(backward="pallas-untiled", untiled_copies=True, **kw)
  lowered = lower_attention(shapes, gradients=True, **untiled)
  assert lowered.kernel_smem and all(plan.fits_in_smem(b) for b in lowered.kernel_smem)
  assert _wide_pads(shapes, **untiled) == []
  for other in ("pallas", "pallas-unpadded"):
    assert _wide_pads(shapes, backward=other, untiled_copies=True, **kw), other


# Key ranges in every shape the API takes: per row and head, per row for
# every head, one range for every row (a query axis of 1), one per batch row.
RANGE_SHAPES = [(2, 4, 300), (1, 1, 300), (2, 4, 1), (2, 1, 1)]


# Under the ci profile each shape full or causal, alternating; thorough, both.
_RANGED = hs.ci_pairs(RANGE_SHAPES, (False, True))


@pytest.mark.parametrize("shape,causal", _RANGED,
                         ids=[f"{'causal' if c else 'full'}-{'x'.join(map(str, s))}"
                              for s, c in _RANGED])
def test_the_backward_lowers_with_key_ranges_of_every_shape(shape, causal):
  """The dK/dV kernels' query bands (kernel.padding.query_block_ranges) are
  formed from key ranges of every broadcast shape, and the whole backward
  lowers for CUDA with them."""
  lowered = lower_attention(dict(B=2, T=300, N=4, H=64, S=200, K=2, Hv=64), gradients=True,
                            k_range_shape=shape, is_causal=causal)
  assert lowered.smem_bytes > 0


# Under the ci profile each head-dim class on one dQ path, in turn, so that
# every path is checked at two classes; thorough, every path at every class.
_ESTIMATED = [(d, dv, path) for (d, dv), path in
              hs.ci_pairs(BACKWARD_HEAD_DIMS, ("fused-dq", "bias", "causal"))]


@pytest.mark.parametrize("d,dv,path", _ESTIMATED,
                         ids=[f"{path}-d{d}-dv{dv}" for d, dv, path in _ESTIMATED])
def test_the_backward_smem_estimate_matches_each_launch(d, dv, path):
  """kernel.tiling.backward_plan.smem_estimates, computed from the buffer descriptions
  the backward kernels allocate, is never below what the lowering counts for
  its launch and within SMEM_MARGIN_BYTES above it, on each dQ path (fused
  where it fits; the dQ kernel with a bias and under causal)."""
  from kernel.tiling import backward_plan
  T = S = 256
  with_bias, is_causal = path == "bias", path == "causal"
  kw = dict(bias_shape=(1, 4, T, S)) if with_bias else {}
  lowered = lower_attention(dict(B=1, T=T, N=4, H=d, S=S, K=2, Hv=dv), gradients=True,
                            is_causal=is_causal, **kw)
  estimates = backward_plan.smem_estimates(*plan.backward_head_dims(d, dv),
                                      np.dtype(ml_dtypes.bfloat16), with_bias=with_bias,
                                      causal=is_causal)
  # The backward's launches are lowered after the forward, in launch order.
  counted = lowered.kernel_smem[-len(estimates):]
  assert len(lowered.kernel_smem) == 1 + len(estimates), lowered.kernel_smem  # forward first
  for (name, est), got in zip(estimates.items(), counted):
    assert got <= est <= got + SMEM_MARGIN_BYTES, (name, est, got, lowered.kernel_smem)


def _staged_grid():
  T = S = 1000
  for name, kw in {"bias": dict(bias_shape=(1, 2, T, S)),
                   "mask": dict(mask_shape=(2, 1, T, S)),
                   "both-causal": dict(bias_shape=(2, 2, T, S), mask_shape=(1, 2, T, S),
                                       is_causal=True)}.items():
    for d in (64, 128):
      problem = plan.problem_of_shapes(
          (2, T, 2, d), (2, S, 1, d), (2, S, 1, d), "bfloat16",
          is_causal=kw.get("is_causal", False), return_residuals=True,
          bias_2d="bias_shape" in kw, mask_2d="mask_shape" in kw)
      for cfg in _configs_to_lower(problem, fullest=name == "both-causal", may_refuse=True):
        yield pytest.param(d, kw, problem, cfg,
                           id=f"{name}-d{d}-{_cfg_tag(cfg)}")


@pytest.mark.parametrize("d,kw,problem,cfg", list(_staged_grid()))
def test_staged_bias_and_mask_lower_and_the_estimate_holds(d, kw, problem, cfg):
  """With staging (the default: bias/mask tiles through the ring with the keys), every
  config emitted for the staged problem lowers, and the shared-memory estimate
  (which counts the staged buffers) still bounds the lowering's allocation."""
  lowered = lower_attention(dict(B=2, T=1000, N=2, H=d, S=1000, K=1, Hv=d), config=cfg,
                            return_residuals=True, stage_2d=True, **kw)
  est = plan.estimate_smem_bytes(problem, cfg)
  assert lowered.smem_bytes <= est <= lowered.smem_bytes + SMEM_MARGIN_BYTES, (
      f"estimate {est} vs lowering {lowered.smem_bytes}")


def _kernel_int_operands(**kw):
  """The integer operands of every Mosaic GPU kernel of one call's forward
  and backward (their shapes), traced on the CPU."""
  import jax
  import jax.numpy as jnp
  from harness.proofs import jaxprs
  from kernel import api, experiments
  sds = jax.ShapeDtypeStruct
  args = (sds((2, 1000, 4, 64), jnp.bfloat16), sds((2, 1000, 2, 64), jnp.bfloat16),
          sds((2, 1000, 2, 64), jnp.bfloat16))

  def grads(q, k, v):
    loss = lambda q, k, v: experiments.dot_product_attention(q, k, v, **kw).astype(
        jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  with api.lowering_only():
    closed = jax.make_jaxpr(grads)(*args)
  return [[tuple(v.aval.shape) for v in kernel.invars if jnp.issubdtype(v.aval.dtype, jnp.integer)]
          for kernel in jaxprs.find_kernels(closed.jaxpr)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ranges_always_launches_the_kernels_the_proof_traces(causal):
  """kernel.experiments' ranges_always: a call without lengths, window or
  segments lowers for CUDA, forward and backward, and each of its kernels
  reads per-row key ranges, (1, 1, rows) as the kernels ``python -m harness
  prove`` traces do (harness/proofs/forward_traces.py's trace_forward); the
  shipped call's kernels read none, and are not the ones proved
  (docs/proof.md)."""
  shapes = dict(B=2, T=1000, N=4, H=64, S=1000, K=2, Hv=64)
  lowered = lower_attention(shapes, gradients=True, is_causal=causal, ranges_always=True)
  assert all(plan.fits_in_smem(b) for b in lowered.kernel_smem)
  ranged = _kernel_int_operands(is_causal=causal, ranges_always=True)
  plain = _kernel_int_operands(is_causal=causal)
  assert len(ranged) == len(plain) >= 2
  assert all(ints == [] for ints in plain), plain
  rows = (1, 1, 1024)   # 1000 query rows, padded to whole tiles
  assert all(ints[:2] == [rows, rows] for ints in ranged), ranged


def test_ranges_always_keeps_the_plain_calls_static_order():
  """kernel.experiments' ranges_always: the whole keys are known when
  tracing (Problem.static_ranges), so a causal call one tile per block
  keeps the static longest-first order, as the plain call does, where key
  lengths (known only on the device) re-rank the tiles with a sort."""
  import jax
  import jax.numpy as jnp
  from kernel import api, experiments
  from kernel.tiling.config import Config
  sds = jax.ShapeDtypeStruct
  q, k = sds((2, 3000, 4, 64), jnp.bfloat16), sds((2, 3000, 2, 64), jnp.bfloat16)
  cfg = Config(block_q=64, block_kv=128, num_stages=2, persistent=False,
               schedule="longest-first")

  def sorts(**kw):
    f = lambda q, k, v: experiments.dot_product_attention(q, k, v, is_causal=True, config=cfg,
                                                          **kw)
    with api.lowering_only():
      return re.findall(r"\bsort\[", str(jax.make_jaxpr(f)(q, k, k)))  # nested jaxprs too

  assert sorts(key_value_seq_lengths=jnp.full((2,), 2999, jnp.int32))
  assert not sorts(ranges_always=True)
