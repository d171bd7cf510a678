"""The gate's smoke part: one call of every shipped path through the public
API, against float64 (marker ``gpu`` and ``smoke``; skipped, visibly,
without an sm90 GPU).  ``bash ci/device/verify.sh OUT smoke`` runs it alone,
so that a GPU run too short for the whole gate still says whether the
default path is right; the same calls trace on every host.

Each call runs as a user runs it (``config=None``: what the autotune cache
or the heuristic picks), forward with both residual forms and, for the
16-bit dtypes, its gradients from one ``jax.vjp``: out, m, l, the
log-sum-exp, dq, dk, dv and dbias under the tolerance rule
(harness.numerics.conformance.check_api_run).
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from harness.numerics import strategies as hs
from harness.numerics.conformance import api_program, check_api_run, run_api
from kernel import api
from kernel.call import AttentionShapes


@dataclasses.dataclass(frozen=True)
class Smoke:
  spec: hs.CaseSpec
  deterministic: bool = False


def _spec(seed, shapes, dtype="bfloat16", **kw) -> hs.CaseSpec:
  return hs.CaseSpec(shapes=shapes, dtype=dtype, seed=seed, **kw)


_SQUARE = AttentionShapes(B=2, T=1000, N=4, H=128, S=1000, K=2, Hv=128)
_DOCS = hs.SegmentSpec(kv_runs=(((7, 300), (3, 1), (9, 450), (1, 249)), ((0, 1000),)),
                       q_runs=(((7, 300), (3, 1), (9, 450), (1, 249)), ((0, 1000),)))

# One call per shipped path: dtype, mask, length, head dims, grouping, each
# of jax.nn's and the kernel's own arguments, FP8, both backwards.
SMOKE = {
    "bf16-whole-gqa": Smoke(_spec(1, AttentionShapes(B=2, T=512, N=4, H=128, S=512, K=2,
                                                     Hv=128))),
    "f16-causal-ragged": Smoke(_spec(2, AttentionShapes(B=1, T=300, N=2, H=64, S=457, K=2,
                                                        Hv=64), "float16", is_causal=True)),
    "causal-ragged-mqa-d72-dv96": Smoke(_spec(3, AttentionShapes(B=2, T=113, N=4, H=72, S=203,
                                                                 K=1, Hv=96), is_causal=True)),
    "d256-ragged": Smoke(_spec(4, AttentionShapes(B=1, T=333, N=2, H=256, S=517, K=1, Hv=256))),
    "bias-mask-softcap": Smoke(_spec(5, AttentionShapes(B=2, T=256, N=2, H=64, S=384, K=1,
                                                        Hv=64), logits_soft_cap=20.0,
                                     mask=hs.MaskSpec((2, 1, 256, 384), 0.8, 5),
                                     bias=hs.BiasSpec((1, 2, 256, 384), 1.0, 5))),
    "window-causal": Smoke(_spec(6, _SQUARE, is_causal=True,
                                 variants=hs.VariantSpec(local_window_size=(128, 0)))),
    "chunk-causal": Smoke(_spec(7, _SQUARE, is_causal=True,
                                variants=hs.VariantSpec(attention_chunk=224))),
    "segments-causal": Smoke(_spec(8, _SQUARE, is_causal=True,
                                   variants=hs.VariantSpec(segments=_DOCS))),
    "lengths": Smoke(_spec(9, _SQUARE, variants=hs.VariantSpec(
        query_seq_lengths=(1000, 517), key_value_seq_lengths=(401, 777)))),
    "deterministic-causal": Smoke(_spec(10, AttentionShapes(B=2, T=700, N=4, H=64, S=700, K=2,
                                                            Hv=64), is_causal=True),
                                  deterministic=True),
    "deterministic-d128": Smoke(_spec(11, AttentionShapes(B=1, T=512, N=2, H=128, S=640, K=1,
                                                          Hv=128)), deterministic=True),
    "fp8-gqa-head-descales": Smoke(_spec(12, AttentionShapes(B=2, T=1000, N=4, H=128, S=777,
                                                             K=2, Hv=128), "float8_e4m3fn",
                                         fp8=hs.Fp8Spec(layout="head", spread=2.0))),
    "fp8-causal-d256": Smoke(_spec(13, AttentionShapes(B=1, T=512, N=2, H=256, S=512, K=1,
                                                       Hv=256), "float8_e4m3fn",
                                   is_causal=True, fp8=hs.Fp8Spec())),
}


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("name", list(SMOKE))
def test_smoke_call_matches_float64(name):
  """The call through the public API within the tolerance rule of float64:
  out, m, l, the log-sum-exp and, for 16-bit inputs, every gradient."""
  smoke = SMOKE[name]
  case = hs.build_case(smoke.spec)
  reports = check_api_run(case, run_api(case, deterministic=smoke.deterministic))
  assert reports and all(r.passed for r in reports), "\n".join(str(r) for r in reports)


@pytest.mark.parametrize("name", list(SMOKE))
def test_smoke_call_traces_on_any_host(name):
  """Every smoke call, forward and (16-bit) backward, traces through the
  public API on any host, its kernels' bodies included, to the shapes it
  promises; under the thorough profile it is lowered for CUDA to Mosaic GPU
  kernels as well (a fifth of the cost here: the emitted configs' lowering
  is properties/kernel/test_lowering.py's).  The part runs what the CPU
  checked."""
  smoke = SMOKE[name]
  case = hs.build_case(smoke.spec)
  program, arguments = api_program(case, deterministic=smoke.deterministic)
  sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arguments]
  backward = not case.call.fp8
  with api.lowering_only():
    if hs.thorough():
      exported = jax.export.export(jax.jit(program), platforms=["cuda"])(*sds)
      assert exported.mlir_module().count("mosaic_gpu") >= 1 + backward, name
      shapes = [tuple(a.shape) for a in exported.out_avals]
    else:
      shapes = [tuple(a.shape) for a in jax.tree.leaves(jax.eval_shape(program, *sds))]
  sh = smoke.spec.shapes
  assert shapes[:4] == [(sh.B, sh.T, sh.N, sh.Hv), (sh.B, sh.T, sh.N), (sh.B, sh.N, sh.T),
                        (sh.B, sh.N, sh.T)]
  assert shapes[4:] == ([tuple(a.shape) for a in arguments[:-1]] if backward else [])


@pytest.mark.parametrize("name", ["bias-mask-softcap"])
def test_the_smoke_check_passes_the_reference_and_fails_a_wrong_gradient(name):
  """check_api_run on any host: the float64 reference's own arrays pass every
  comparison (lse and dbias among them), and one element of dk moved by a
  thousand times its bound fails dk alone."""
  import numpy as np
  from harness.numerics import reference as ref_lib
  from harness.numerics.conformance import ApiRun
  case = hs.build_case(SMOKE[name].spec)
  ref = ref_lib.attention_reference(case.call)
  d_out = np.asarray(case.d_out, np.float64)
  want = ref_lib.attention_reference_vjp(case.call, d_out)
  with np.errstate(divide="ignore"):
    lse = np.transpose(ref.m + np.log(ref.l), (0, 2, 1))
  grads = (want.dq, want.dk, want.dv, want.dbias)
  good = check_api_run(case, ApiRun(ref.out, lse, ref.m, ref.l, grads, d_out))
  names = {r.name for r in good}
  assert {"out", "m", "l", "lse", "dq", "dk", "dv"} <= names
  assert all(r.passed for r in good), "\n".join(str(r) for r in good)
  dk = want.dk.copy()
  bound = next(r.bound for r in good if r.name == "dk")
  dk[0, 0, 0, 0] += 1000 * bound
  bad = check_api_run(case, ApiRun(ref.out, lse, ref.m, ref.l,
                                   (want.dq, dk, want.dv, want.dbias), d_out))
  assert [r.name for r in bad if not r.passed] == ["dk"]
