"""jax.nn's lengths and window and packed segments on the GPU (marker ``gpu``;
skipped, visibly, elsewhere), and the same calls lowered for CUDA on any host.

Each named case runs forward (out, m, l and jax.nn's log-sum-exp) and
gradients against the float64 reference under the tolerance rule, and, where
cuDNN has the variant (lengths; a left window under causal), cuDNN through
``jax.nn.dot_product_attention(implementation="cudnn")`` is held to the same
rule on the rows that see a key, so a disagreement says which side is off.
The window and segment cases also run under the persistent longest-first
schedule.  A Hypothesis property draws lengths, windows and segment layouts
on two fixed shapes: the variants reach the kernel as key-range arrays, so
new draws reuse compiled kernels and the examples stay cheap.

Bounded for an H200: about 12 kernel compiles for the named cases, and at
most ``VARIANT_EXAMPLES`` drawn examples (small shapes).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import reference as ref_lib
from harness.numerics import strategies as hs
from harness.numerics import tolerance
from harness.numerics.conformance import (api_program, check_api_run, compute_dtype,
                                          run_api)
from kernel import api
from kernel.tiling.config import Config
from kernel.call import AttentionShapes, api_variants

LONGEST_FIRST = Config(64, 128, 2, persistent=True, schedule="longest-first")
VARIANT_EXAMPLES = int(os.environ.get("VARIANT_EXAMPLES", "12"))

_RAGGED = AttentionShapes(B=2, T=1000, N=4, H=128, S=777, K=2, Hv=128)
_SQUARE = AttentionShapes(B=2, T=1000, N=4, H=128, S=1000, K=2, Hv=128)
_WIDE = AttentionShapes(B=1, T=777, N=2, H=64, S=1000, K=1, Hv=64)


def _docs(*runs):
  """Segment runs ((id, length), ...) shared by queries and keys, per row."""
  return hs.SegmentSpec(kv_runs=runs, q_runs=runs)


@dataclasses.dataclass(frozen=True)
class Named:
  shapes: AttentionShapes
  is_causal: bool
  variants: hs.VariantSpec
  cudnn: bool = False        # jax.nn's cuDNN path takes this variant
  config: Config | None = None


_PACKED = _docs(((7, 300), (3, 1), (9, 450), (1, 249)),
                ((0, 1000),))
# Id 4 split by id 5 (a hole): only the dense-mask layout serves it.
_SPLIT = hs.SegmentSpec(kv_runs=(((4, 200), (5, 100), (4, 700)), ((2, 1000),)),
                        q_runs=(((4, 500), (5, 500)), ((2, 999), (8, 1))))

NAMED = {
    "lengths": Named(_RAGGED, False, hs.VariantSpec(query_seq_lengths=(1000, 517),
                                                    key_value_seq_lengths=(401, 777)),
                     cudnn=True),
    "lengths-causal-zero": Named(_SQUARE, True, hs.VariantSpec(
        query_seq_lengths=(1000, 0), key_value_seq_lengths=(1000, 640)), cudnn=True),
    "window-causal": Named(_SQUARE, True, hs.VariantSpec(local_window_size=(128, 0)),
                           cudnn=True),
    "window-causal-longest-first": Named(_SQUARE, True, hs.VariantSpec(
        local_window_size=(128, 0)), config=LONGEST_FIRST),
    "window-pair": Named(_WIDE, False, hs.VariantSpec(local_window_size=(200, 64))),
    "window-wider-than-sequence": Named(_RAGGED, False, hs.VariantSpec(local_window_size=5000)),
    "chunk-window": Named(_RAGGED, False, hs.VariantSpec(attention_chunk=300,
                                                         local_window_size=(223, 0))),
    "segments-causal": Named(_SQUARE, True, hs.VariantSpec(segments=_PACKED)),
    "segments-causal-longest-first": Named(_SQUARE, True, hs.VariantSpec(segments=_PACKED),
                                           config=LONGEST_FIRST),
    "segments-any-layout": Named(_SQUARE, False, hs.VariantSpec(segments=_SPLIT,
                                                                segment_layout="any")),
    "everything": Named(_SQUARE, True, hs.VariantSpec(
        query_seq_lengths=(900, 1000), key_value_seq_lengths=(1000, 333),
        local_window_size=(300, 0), segments=_PACKED)),
}


def _case(named: Named, seed: int = 0) -> hs.AttentionCase:
  return hs.build_case(hs.CaseSpec(shapes=named.shapes, dtype="bfloat16", seed=seed,
                                   is_causal=named.is_causal, variants=named.variants))


def _call(case: hs.AttentionCase, config, q, k, v):
  """Ours with jax.nn's keyword arguments and both residual forms."""
  kw = dict(case.variant_kwargs)
  return api.dot_product_attention(
      q, k, v, is_causal=case.spec.is_causal, return_residual=True, return_residuals=True,
      segment_layout=case.segment_layout, config=config, **api_variants(kw))


def _check_case(case: hs.AttentionCase, config) -> None:
  """out, m, l, the log-sum-exp and the gradients through the public API
  within the rule, every report in the message (a failing array is read
  beside the others)."""
  reports = check_api_run(case, run_api(case, config=config))
  assert all(r.passed for r in reports), "\n".join(str(r) for r in reports)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(NAMED))
def test_named_variant_matches_float64(name):
  """out, m, l, jax.nn's log-sum-exp, dq, dk, dv within the tolerance rule."""
  named = NAMED[name]
  _check_case(_case(named), named.config)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n, c in NAMED.items() if c.cudnn])
def test_named_variant_beside_cudnn(name):
  """jax.nn's cuDNN path, given the same keyword arguments, is within the
  tolerance rule of the same float64 reference on every row that sees a key
  (fully masked rows: jax.nn leaves their value to the implementation), as
  ours is on every row."""
  named = NAMED[name]
  case = _case(named)
  kw = case.variant_kwargs
  args = [jnp.asarray(x) for x in (case.query, case.key, case.value)]
  theirs = jax.nn.dot_product_attention(
      *args, is_causal=named.is_causal, implementation="cudnn",
      query_seq_lengths=None if "query_seq_lengths" not in kw else
      jnp.asarray(kw["query_seq_lengths"]),
      key_value_seq_lengths=None if "key_value_seq_lengths" not in kw else
      jnp.asarray(kw["key_value_seq_lengths"]),
      local_window_size=kw.get("local_window_size"))
  ours = _call(case, None, *args)[0]
  dt = compute_dtype(case.dtype)
  ref = ref_lib.attention_reference(*case.args, **case.kwargs)
  n_out, _, _ = ref_lib.naive_attention(*case.args, dtype=dt, **case.kwargs)
  seen = np.transpose(ref.l > 0, (0, 2, 1))[..., None]  # (B, T, N, 1)
  assert seen.any()
  keep = lambda x: np.where(seen, np.asarray(jnp.asarray(x, jnp.float32), np.float64), 0.0)
  r_theirs = tolerance.check_tolerance(keep(theirs), keep(ref.out), keep(n_out), dt,
                                       name="cudnn out")
  r_ours = tolerance.check_tolerance(np.asarray(jnp.asarray(ours, jnp.float32), np.float64),
                                     ref.out, n_out, dt, name="out")
  gap = float(np.max(np.abs(keep(theirs) - keep(ours))))
  assert r_ours.passed and r_theirs.passed, (
      f"{r_theirs}\n{r_ours}\nmax |ours - cudnn| on rows that see a key: {gap:.3g}")


@pytest.mark.gpu
def test_rows_the_contiguous_layout_cannot_serve_are_nan():
  """Ids in several runs of the keys under ``segment_layout="contiguous"``:
  the rows with such an id are NaN in out, m, l, the log-sum-exp and dq
  (written by the kernel's epilogue), every other output row is within the
  tolerance rule of the float64 reference, and no other row is NaN."""
  case = _case(Named(_SQUARE, True, hs.VariantSpec(segments=_SPLIT)))
  q_ids, kv_ids = _SPLIT.build()
  holes = np.zeros(q_ids.shape, bool)
  for b, i in np.ndindex(*holes.shape):
    where = np.nonzero(kv_ids[b] == q_ids[b, i])[0]
    holes[b, i] = where.size > 0 and where[-1] - where[0] + 1 > where.size
  assert holes.any() and not holes.all()
  run = run_api(case)
  out, lse, m, l, dq = run.out, run.lse, run.m, run.l, run.grads[0]
  rows = holes[:, :, None]                       # (B, T, 1) against (B, T, N)
  assert np.isnan(out[holes]).all() and np.isnan(lse[np.broadcast_to(rows, lse.shape)]).all()
  assert np.isnan(dq[holes]).all()
  per_head = np.broadcast_to(holes[:, None, :], m.shape)
  assert np.isnan(m[per_head]).all() and np.isnan(l[per_head]).all()
  assert not np.isnan(out[~holes]).any() and not np.isnan(m[~per_head]).any()
  dt = compute_dtype(case.dtype)
  ref = ref_lib.attention_reference(*case.args, **case.kwargs)
  n_out, _, _ = ref_lib.naive_attention(*case.args, dtype=dt, **case.kwargs)
  keep = lambda x: np.where(holes[:, :, None, None], 0.0, x)
  report = tolerance.check_tolerance(keep(out), keep(ref.out), keep(n_out), dt, name="out")
  assert report.passed, str(report)


_DRAWN_SHAPES = (AttentionShapes(B=2, T=300, N=2, H=64, S=333, K=1, Hv=64),
                 AttentionShapes(B=1, T=256, N=4, H=128, S=256, K=2, Hv=128))


@pytest.mark.gpu
@settings(max_examples=VARIANT_EXAMPLES, deadline=None)
@given(data=st.data())
def test_drawn_variants_match_float64(data):
  """Any lengths (0, ragged, full, past the end), window (0, wider than
  the sequences, one-sided) and segment layout (one-token and
  empty segments, ids the keys lack; contiguous ids, or any ids through the
  dense-mask layout), forward and gradients, within the rule."""
  shapes = data.draw(st.sampled_from(_DRAWN_SHAPES), label="shapes")
  layout = data.draw(st.sampled_from(("contiguous", "any")), label="layout")
  spec = data.draw(hs.variant_specs(shapes, layout=layout), label="variants")
  named = Named(shapes, data.draw(st.booleans(), label="causal"), spec)
  case = _case(named, seed=data.draw(st.integers(0, 2**16), label="seed"))
  note(case.describe())
  _check_case(case, None)


# ---------------------------------------------------------------------------
# Any host: every named case lowers for CUDA, forward and backward.


# Every second named case under the ci profile (docs/decisions/cpu-suite-time.md).
@pytest.mark.parametrize("name", hs.ci_sample(NAMED, 2))
def test_named_variant_lowers_for_cuda(name):
  """The named cases' forward (both residual forms) and vjp lower to one
  program of Mosaic GPU kernels, with the key ranges fed to them."""
  named = NAMED[name]
  case = _case(named)
  program, arguments = api_program(case, config=named.config)
  with api.lowering_only():
    exported = jax.export.export(jax.jit(program), platforms=["cuda"])(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arguments])
  sh = named.shapes
  shapes = [tuple(a.shape) for a in exported.out_avals]
  assert shapes == [(sh.B, sh.T, sh.N, sh.Hv), (sh.B, sh.T, sh.N), (sh.B, sh.N, sh.T),
                    (sh.B, sh.N, sh.T), (sh.B, sh.T, sh.N, sh.H), (sh.B, sh.S, sh.K, sh.H),
                    (sh.B, sh.S, sh.K, sh.Hv)]
  text = exported.mlir_module()
  # Forward and at least one backward kernel.
  assert text.count("mosaic_gpu") >= 2
