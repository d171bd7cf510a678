"""Golden-file regression for kernel changes.

``python -m harness golden check``   compare the kernel with the stored goldens
``python -m harness golden update``  regenerate them, printing what changed

The corpus (:data:`CORPUS`) names small cases — shapes, dtypes, masks,
biases, key ranges, thresholds, heuristic and explicit configs, persistent and
not, and jax.nn's lengths and windows and packed segment ids
(``harness.numerics.strategies.VariantSpec``, mapped onto key ranges by
kernel/key_ranges.py).  Inputs are regenerated from each case's spec and seed,
never stored.
For each case ``golden/<name>.npz`` holds the kernel's outputs (out in its own
dtype's bits, m and l in float32) and, for cases with gradients, dq, dk, dv
(and dbias) of ``sum(out * d_out)`` through ``jax.vjp`` of the public API, in
the input dtype's bits; ``golden/manifest.json`` holds the spec, seed,
resolved config, device, jax version, kernel source hash and a SHA-256 per
array.

Per case, ``check`` reports one of

* **identical** — every array bit for bit equal to the golden;
* **reordered** — identical except for gradients the kernel sums across
  blocks in no fixed order (``kernel.backward.launch.ORDER_DEPENDENT_GRADIENTS``:
  the fused dQ), and those within ``harness.numerics.tolerance.run_to_run_bound`` of
  the golden (one ulp): what two runs of the same kernel may differ by;
* **drift** — not identical, but within the tolerance rule against float64
  (``harness/numerics/tolerance.py``); the max ulp distance and relative error to the
  golden, and the ratio to the float64 bound, are reported;
* **regression** — beyond the tolerance rule against float64: the check fails;
* **missing** — no golden for the case, or one stored before the case kept
  some of its arrays (fails: run ``update`` and review).

``update`` classifies the new outputs against the old goldens the same way,
prints the table, then writes; nothing is overwritten without the table.
``--select NAME,...`` restricts either to the named cases (``update`` then
rewrites only their files and manifest entries).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from harness.numerics.conformance import check_forward, check_gradients
from kernel.call import Call, api_variants
from harness.numerics.strategies import Fp8Spec, SegmentSpec, VariantSpec
from harness.numerics.tolerance import rtol_for, run_to_run_bound

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "golden"
FORWARD_ARRAYS = ("out", "m", "l")
GRADIENT_ARRAYS = ("dq", "dk", "dv", "dbias")


@dataclasses.dataclass(frozen=True)
class GoldenSpec:
  name: str
  seed: int
  batch: int = 1
  seq_q: int = 256
  seq_kv: int = 256
  heads: int = 2
  kv_heads: int = 1
  head_dim: int = 64
  head_dim_out: int | None = None
  dtype: str = "bfloat16"
  is_causal: bool = False
  bias: str | None = None          # None, "full", "row", "col"
  mask: str | None = None          # None, "full", "keys"
  key_range: bool = False
  logits_soft_cap: float | None = None
  rescale_threshold: float = 1.0
  normalize_output: bool = True
  config: tuple | None = None      # None = heuristic; else Config's fields in order
  gradients: bool = True           # store dq, dk, dv (dbias) too (normalised output only)
  # jax.nn's lengths and window, segment ids and their layout; None: none.
  variants: VariantSpec | None = None
  # FP8 (dtype float8_e4m3fn): how its e4m3 values and descales are made
  # (harness.numerics.strategies.Fp8Spec, from the seed); forward only.
  fp8: Fp8Spec | None = None

  @property
  def has_gradients(self) -> bool:
    return self.gradients and self.normalize_output and self.fp8 is None

  def arrays(self) -> tuple[str, ...]:
    """The arrays stored for this case."""
    if not self.has_gradients:
      return FORWARD_ARRAYS
    from harness.numerics.reference import dbias_is_noise
    bias_shape = self.build().bias.shape if self.bias else None
    with_bias = self.bias is not None and not dbias_is_noise(bias_shape)
    return FORWARD_ARRAYS + GRADIENT_ARRAYS[:4 if with_bias else 3]

  def d_out(self) -> np.ndarray:
    """The cotangent of out, in the input dtype, from its own stream of the seed
    (so adding gradients left the inputs of every case unchanged)."""
    case = self.build()
    hv = self.head_dim if self.head_dim_out is None else self.head_dim_out
    rng = np.random.default_rng([self.seed, 1])
    shape = (self.batch, self.seq_q, self.heads, hv)
    return rng.standard_normal(shape).astype(case.query.dtype)

  def build(self) -> Call:
    import ml_dtypes
    rng = np.random.default_rng(self.seed)
    dt = np.dtype(ml_dtypes.bfloat16) if self.dtype == "bfloat16" else np.dtype(self.dtype)
    b, t, s, n, kh = self.batch, self.seq_q, self.seq_kv, self.heads, self.kv_heads
    hv = self.head_dim if self.head_dim_out is None else self.head_dim_out
    fp8 = {}
    if self.fp8 is not None:  # e4m3 values and descales from a stream of their own
      from kernel.call import AttentionShapes
      shapes = AttentionShapes(B=b, T=t, N=n, H=self.head_dim, S=s, K=kh, Hv=hv)
      fp8 = self.fp8.build(shapes, self.seed)
      dt = np.dtype(ml_dtypes.bfloat16)  # the bias's dtype beside FP8 inputs
    normal = lambda shape: rng.standard_normal(shape).astype(dt)
    arrays = dict(query=normal((b, t, n, self.head_dim)), key=normal((b, s, kh, self.head_dim)),
                  value=normal((b, s, kh, hv)))
    arrays.update(fp8)
    bias_shapes = {"full": (b, n, t, s), "row": (1, 1, 1, s), "col": (b, 1, t, 1)}
    if self.bias:
      arrays["bias"] = rng.standard_normal(bias_shapes[self.bias]).astype(dt)
    if self.mask == "full":
      arrays["mask"] = rng.random((b, 1, t, s)) < 0.7
      arrays["mask"][:, :, 3, :] = False  # a fully masked row
    elif self.mask == "keys":
      arrays["mask"] = rng.random((s,)) < 0.6
    if self.key_range:
      arrays["k_start"] = rng.integers(0, s // 2, (b, n, t)).astype(np.int32)
      arrays["k_end"] = (arrays["k_start"] + rng.integers(-8, s, (b, n, t))).astype(np.int32)
    variants = {}
    if self.variants is not None:  # plain values: no draw from rng, so the arrays above stay
      variants = dict(self.variants.build(), segment_layout=self.variants.segment_layout)
    return Call(**arrays, is_causal=self.is_causal, logits_soft_cap=self.logits_soft_cap,
                rescale_threshold=self.rescale_threshold,
                normalize_output=self.normalize_output, **variants)

  def resolved_config(self):
    from kernel.tiling.config import Config
    return None if self.config is None else Config(*self.config)


def _documents(*rows) -> SegmentSpec:
  """Packed documents: per batch row ((id, length), ...), the same runs for
  queries and keys."""
  return SegmentSpec(kv_runs=rows, q_runs=rows)


CORPUS: tuple[GoldenSpec, ...] = (
    GoldenSpec("plain-d64", 1),
    GoldenSpec("plain-d128-gqa", 2, heads=4, kv_heads=2, head_dim=128),
    # The two largest cases keep out/m/l only: the corpus stays a few MB, and
    # other cases cover causal and d256-free gradients.
    GoldenSpec("causal-d128", 3, seq_q=512, seq_kv=512, head_dim=128, is_causal=True,
               gradients=False),
    GoldenSpec("ragged-113x203-d72-dv96", 4, seq_q=113, seq_kv=203, head_dim=72, head_dim_out=96),
    GoldenSpec("ragged-239x1", 5, seq_q=239, seq_kv=1),
    GoldenSpec("f16-d256", 6, dtype="float16", head_dim=256, seq_kv=320, gradients=False),
    GoldenSpec("f32-inputs", 7, dtype="float32", seq_q=100, seq_kv=130),
    GoldenSpec("bias-full", 8, bias="full"),
    GoldenSpec("bias-row-mask-keys", 9, bias="row", mask="keys"),
    GoldenSpec("mask-full-empty-row", 10, mask="full"),
    GoldenSpec("key-ranges", 11, key_range=True, seq_kv=384),
    GoldenSpec("softcap-threshold-half", 12, logits_soft_cap=8.0, rescale_threshold=0.5),
    GoldenSpec("threshold-zero-unnormalised", 13, rescale_threshold=0.0, normalize_output=False),
    GoldenSpec("causal-kend-bias-col", 14, is_causal=True, bias="col", key_range=True),
    GoldenSpec("cfg-64-64-3-persistent", 15, seq_kv=512, config=(64, 64, 3, True)),
    GoldenSpec("cfg-64-128-2-nonpersistent", 16, seq_kv=512, config=(64, 128, 2, False)),
    GoldenSpec("cfg-128-64-2-nonpersistent", 17, seq_q=512, seq_kv=512, config=(128, 64, 2, False)),
    GoldenSpec("cfg-64-64-4-persistent-causal", 18, seq_q=384, seq_kv=384, is_causal=True,
               config=(64, 64, 4, True)),
    # Shares its autotune signature with a shape the shipped cache holds, so
    # config=None runs the autotuned config on an H200.
    GoldenSpec("autotuned-1024-d128", 19, seq_q=1024, seq_kv=1024, heads=1, head_dim=128,
               gradients=False),  # keeps the corpus small; others cover the backward
    # jax.nn's lengths and windows and packed segments, forward and gradients.
    # Lengths: per batch row a full / ragged / zero query length against a
    # ragged (one past a block) / zero / full key length.
    GoldenSpec("lengths-ragged-zero-full", 20, batch=3, seq_q=160, seq_kv=200,
               variants=VariantSpec(query_seq_lengths=(160, 77, 0),
                                    key_value_seq_lengths=(129, 0, 200))),
    # Windows long enough that query tiles skip key blocks on both sides.
    GoldenSpec("window-int-causal", 21, seq_q=448, seq_kv=448, is_causal=True,
               variants=VariantSpec(local_window_size=100)),
    GoldenSpec("window-int-64x64-blocks", 22, seq_q=384, seq_kv=384, config=(64, 64, 2, False),
               variants=VariantSpec(local_window_size=40)),
    GoldenSpec("window-pair-ragged", 23, seq_q=300, seq_kv=421,
               variants=VariantSpec(local_window_size=(150, 17))),
    # The window reaches the longest-first schedule (Problem.mask).
    GoldenSpec("window-pair-causal-longest-first", 24, seq_q=512, seq_kv=512, is_causal=True,
               config=(64, 128, 2, True, "longest-first"),
               variants=VariantSpec(local_window_size=(130, 64))),
    # Packed documents (each id one run: per-row key ranges), a one-token one
    # among them, boundaries on and off the block grid.
    GoldenSpec("segments-packed-causal", 25, seq_q=448, seq_kv=448, is_causal=True,
               variants=VariantSpec(segments=_documents(
                   ((3, 100), (1, 1), (8, 155), (2, 64), (6, 128))))),
    # Id 4 split by id 5, and a query id the keys lack: only the dense-mask
    # layout serves them.  The first query tile is all id 5, so the hull of
    # its keys still skips a block.
    GoldenSpec("segments-split-any-layout", 26, seq_q=256, seq_kv=320,
               variants=VariantSpec(segments=SegmentSpec(
                   kv_runs=(((4, 90), (5, 70), (4, 160)),),
                   q_runs=(((5, 128), (4, 122), (9, 6)),)), segment_layout="any")),
    GoldenSpec("lengths-window-segments-causal", 27, batch=2, seq_q=320, seq_kv=320,
               is_causal=True,
               variants=VariantSpec(query_seq_lengths=(320, 250),
                                    key_value_seq_lengths=(290, 320),
                                    local_window_size=(120, 0),
                                    segments=_documents(((1, 170), (2, 150)), ((7, 320),)))),
    # Three compute warpgroups (192-row tiles, head dims up to 64), causal
    # over grouped kv heads, at a length that is no multiple of the tile
    # (600 = 3 x 192 + 24) nor of the key block.
    GoldenSpec("cfg-three-warpgroups-causal-gqa", 28, batch=2, seq_q=600, seq_kv=600, heads=4,
               kv_heads=2, is_causal=True, config=(64, 128, 2, True, "longest-first", 3)),
    # FP8 (forward only): per (batch, kv head) descales over GQA; causal at
    # a ragged length with a float16 output and outliers; head dim 256
    # with a 2-D bias and mask and a soft cap.
    GoldenSpec("fp8-d128-gqa-head-descales", 29, batch=2, seq_q=512, seq_kv=512, heads=4,
               kv_heads=2, head_dim=128, dtype="float8_e4m3fn",
               fp8=Fp8Spec(layout="head", spread=2.0, log2_v=-2.0)),
    GoldenSpec("fp8-causal-ragged-f16-outliers", 30, seq_q=1000, seq_kv=1000, is_causal=True,
               dtype="float8_e4m3fn",
               fp8=Fp8Spec(stored_std=64.0, outliers=0.01, log2_q=1.0, out_dtype="float16")),
    GoldenSpec("fp8-d256-mask-bias-softcap", 31, seq_q=256, seq_kv=384, head_dim=256,
               dtype="float8_e4m3fn", bias="full", mask="full", logits_soft_cap=10.0,
               fp8=Fp8Spec(log2_q=2.0, log2_k=1.0)),
)


# Cases in the corpus whose first goldens only an H200 can write: until then
# `golden check` reports them **missing**, so the GPU gate fails on them
# (`python -m harness golden update --select NAMES` on an H200 writes them).
# The CPU suite checks that none of them has a golden yet: once written and
# committed, this tuple must be emptied, so no case stays here unnoticed.
AWAITING_FIRST_GOLDEN: tuple[str, ...] = ()


def kernel_source_hash() -> str:
  h = hashlib.sha256()
  for path in sorted((REPO / "kernel").glob("*.py")):
    h.update(path.name.encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


def _checksum(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def kernel_function(spec: GoldenSpec) -> tuple[Callable, tuple]:
  """``(f, args)``: ``f(*args)`` runs the case through the public API and
  returns its stored arrays by name, as JAX arrays (out, m, l; with
  gradients, dq, dk, dv (dbias) of ``sum(out * d_out)`` through ``jax.vjp``).
  :func:`run_kernel_for` calls it as is; ``jax.jit(f)`` lowers it for CUDA
  on any host (properties/numerics/test_golden.py)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  case = spec.build()
  j = lambda x: None if x is None else jnp.asarray(x)
  variant_kwargs = api_variants(case.variants)

  fp8_kwargs = {}
  if case.fp8:
    fp8_kwargs = dict({n: jnp.asarray(getattr(case, n), jnp.float32)
                       for n in ("q_descale", "k_descale", "v_descale")},
                      out_dtype=case.out_dtype)

  def attention(q, k, v, bias):
    return api.dot_product_attention(
        q, k, v, bias, j(case.mask), is_causal=case.is_causal, k_start=j(case.k_start),
        k_end=j(case.k_end), logits_soft_cap=case.logits_soft_cap,
        rescale_threshold=case.rescale_threshold, normalize_output=case.normalize_output,
        return_residuals=True, config=spec.resolved_config(),
        segment_layout=case.segment_layout, **variant_kwargs, **fp8_kwargs)

  args = (j(case.query), j(case.key), j(case.value), j(case.bias))
  if not spec.has_gradients:
    def forward(q, k, v, bias):
      out, (m, l) = attention(q, k, v, bias)
      return {"out": out, "m": m, "l": l}
    return forward, args

  with_bias = "dbias" in spec.arrays()

  def with_gradients(q, k, v, bias, d_out):
    f = attention if with_bias else (lambda q, k, v: attention(q, k, v, bias))
    primals = (q, k, v, bias) if with_bias else (q, k, v)
    (out, (m, l)), vjp = jax.vjp(f, *primals)
    grads = vjp((d_out, (jnp.zeros_like(m), jnp.zeros_like(l))))
    return {"out": out, "m": m, "l": l, **dict(zip(GRADIENT_ARRAYS, grads))}
  return with_gradients, args + (jnp.asarray(spec.d_out()),)


def run_kernel_for(spec: GoldenSpec) -> dict[str, np.ndarray]:
  """The kernel's outputs in storage form: out and gradients in the input
  dtype, m/l float32."""
  import jax
  f, args = kernel_function(spec)
  arrays = jax.block_until_ready(f(*args))
  return {k: np.asarray(x, np.float32) if k in ("m", "l") else np.asarray(x)
          for k, x in arrays.items()}


def _kernel_mask_and_ranges(case: Call):
  """The mask and key ranges the API hands the kernel for ``case``: its own,
  with the variants mapped onto them (kernel/key_ranges.py)."""
  from kernel import key_ranges
  routed = key_ranges.route(case)
  return routed.mask, routed.k_start, routed.k_end


def config_used(spec: GoldenSpec) -> dict:
  """The config the case ran with, and where it came from: the spec's own
  ("spec"), the autotune cache's entry for this device and signature
  ("autotune cache", even when it equals the heuristic's), the nearest
  entry's ("autotune cache, nearest: SIGNATURE", kernel.tiling.autotune.nearest),
  or the heuristic."""
  if spec.config is not None:
    return {"source": "spec", **dataclasses.asdict(spec.resolved_config())}
  from kernel import api
  case = spec.build()
  mask, k_start, k_end = _kernel_mask_and_ranges(case)
  chosen, source = api.chosen_config_source(case.query, case.key, case.value, case.bias, mask,
                                            is_causal=case.is_causal, k_start=k_start,
                                            k_end=k_end)
  return {"source": source, **dataclasses.asdict(chosen)}


def _ulp_distance(a: np.ndarray, b: np.ndarray) -> int:
  """Max distance in units in the last place between same-dtype arrays."""
  if a.dtype.itemsize == 2:
    ai, bi = a.view(np.int16).astype(np.int64), b.view(np.int16).astype(np.int64)
  else:
    ai, bi = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
  # Map sign-magnitude to a monotone integer line.
  bits = a.dtype.itemsize * 8
  fix = lambda x: np.where(x < 0, -(x & ((1 << (bits - 1)) - 1)), x)
  both = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
  if not both.any():
    return 0
  return int(np.abs(fix(ai) - fix(bi))[both].max())


STATUSES = ("identical", "reordered", "drift", "regression", "missing")
PASSING = STATUSES[:3]   # the verdicts under which ``check`` passes


def _only_reordered(new, old, names) -> bool:
  """Every array bit-identical to the golden except order-dependent
  gradients, and those within one run-to-run bound of it."""
  from kernel.backward.launch import ORDER_DEPENDENT_GRADIENTS
  for k in names:
    if np.array_equal(new[k], old[k], equal_nan=True):
      continue
    if k not in ORDER_DEPENDENT_GRADIENTS or new[k].shape != old[k].shape:
      return False
    if run_to_run_bound(new[k].astype(np.float64), old[k].astype(np.float64),
                        new[k].dtype) > 1.0:
      return False
  return True


@dataclasses.dataclass
class Verdict:
  name: str
  status: str              # identical, reordered, drift, regression, missing
  max_ulp: int = 0
  max_rel_to_golden: float = 0.0
  ratio_to_f64_bound: float = 0.0
  detail: str = ""
  changed: tuple[str, ...] = ()   # arrays not bit-identical to the golden


def classify(spec: GoldenSpec, new: dict[str, np.ndarray],
             old: dict[str, np.ndarray] | None) -> Verdict:
  """Compare new outputs with the golden and with float64 (see module doc)."""
  case = spec.build()
  names = spec.arrays()
  missing = [k for k in names if k not in new]
  if missing:
    return Verdict(spec.name, "regression", detail=f"the kernel returned no {', '.join(missing)}")
  report = check_forward(case, new["out"].astype(np.float64), new["m"].astype(np.float64),
                         new["l"].astype(np.float64))
  reports = [r for r in (report.out, report.m, report.l) if r is not None]
  if spec.has_gradients:
    grads = [new.get(k) for k in GRADIENT_ARRAYS]
    reports += check_gradients(case, spec.d_out().astype(np.float64), grads,
                               rtol=rtol_for(case.logits_soft_cap))
  ratio = max(r.ratio for r in reports)
  failed = [r for r in reports if not r.passed]
  if failed:
    status = "regression"
  elif old is None or not set(old) >= set(names):
    status = "missing"  # no golden, or one from before this case stored these arrays
  elif all(np.array_equal(new[k], old[k], equal_nan=True) for k in names):
    status = "identical"
  elif _only_reordered(new, old, names):
    status = "reordered"
  else:
    status = "drift"
  detail = "; ".join(f"{r.name}: err {r.max_error:.3g} bound {r.bound:.3g}"
                     for r in (failed or reports))
  verdict = Verdict(spec.name, status, ratio_to_f64_bound=ratio, detail=detail)
  if old is not None:
    ulps, rels = [], []
    for k in names:
      if k not in old:
        verdict.detail = f"{k}: not in the golden yet; " + verdict.detail
        continue
      a, b = new[k], old[k]
      if a.shape != b.shape or a.dtype != b.dtype:
        verdict.detail = f"{k}: shape/dtype changed {b.shape}/{b.dtype} -> {a.shape}/{a.dtype}"
        return dataclasses.replace(verdict, status="regression")
      # ulp distances are read where the golden is significant (within 2^10
      # of its largest magnitude): near zero they count representable values
      # between noise and noise and say nothing about the change.
      b_abs = np.abs(b.astype(np.float64))
      finite = np.isfinite(b_abs)
      significant = finite & (b_abs >= (b_abs[finite].max() if finite.any() else 0) * 2.0 ** -10)
      ulps.append(_ulp_distance(a[significant], b[significant]) if significant.any() else 0)
      if not np.array_equal(a, b, equal_nan=True):
        verdict.changed += (k,)
      a64, b64 = a.astype(np.float64), b.astype(np.float64)
      fin = np.isfinite(a64) & np.isfinite(b64)
      if fin.any():
        scale = max(np.abs(b64[fin]).max(), np.abs(a64[fin]).max(), np.finfo(np.float32).tiny)
        rels.append(float(np.abs(a64[fin] - b64[fin]).max() / scale))
    verdict.max_ulp = max(ulps)
    verdict.max_rel_to_golden = max(rels, default=0.0)
  return verdict


def load_golden(name: str, directory: Path = GOLDEN_DIR) -> dict[str, np.ndarray] | None:
  """A stored case: each array viewed back from its bits in its recorded dtype."""
  path = directory / f"{name}.npz"
  if not path.exists():
    return None
  import ml_dtypes
  with np.load(path) as z:
    data = {k: z[k] for k in z.files}
  named = lambda d: np.dtype(ml_dtypes.bfloat16) if d == "bfloat16" else np.dtype(d)
  if "dtypes" not in data:  # the first format: out's bits, its dtype, m and l
    return {"out": data["out"].view(named(str(data["out_dtype"]))), "m": data["m"],
            "l": data["l"]}
  dtypes = json.loads(str(data.pop("dtypes")))
  return {k: data[k].view(named(d)) for k, d in dtypes.items()}


def save_golden(name: str, arrays: dict[str, np.ndarray], directory: Path = GOLDEN_DIR) -> None:
  """Each array as its raw bits (bf16 has no NumPy-native dtype), with a
  table of dtypes to view them back."""
  bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
  dtypes = {k: str(a.dtype) for k, a in arrays.items()}
  np.savez_compressed(directory / f"{name}.npz", dtypes=np.array(json.dumps(dtypes)),
                      **{k: np.ascontiguousarray(a).view(bits[a.dtype.itemsize])
                         for k, a in arrays.items()})


def render(verdicts: list[Verdict]) -> str:
  lines = ["| case | status | changed arrays | max ulp vs golden | max rel vs golden "
           "| error / f64 bound |",
           "|---|---|---|---|---|---|"]
  for v in verdicts:
    lines.append(f"| {v.name} | {v.status} | {', '.join(v.changed) or '-'} | {v.max_ulp} "
                 f"| {v.max_rel_to_golden:.2e} | {v.ratio_to_f64_bound:.3f} |")
  for v in verdicts:
    if v.status in ("regression", "missing"):
      lines.append(f"\n{v.name}: {v.detail}")
  counts = {s: sum(v.status == s for v in verdicts)
            for s in STATUSES}
  lines.append("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
  return "\n".join(lines)


def check(runner: Callable[[GoldenSpec], dict] = run_kernel_for, corpus=CORPUS,
          directory: Path = GOLDEN_DIR) -> tuple[list[Verdict], bool]:
  verdicts = []
  for spec in corpus:
    try:
      verdicts.append(classify(spec, runner(spec), load_golden(spec.name, directory)))
    except Exception as err:
      verdicts.append(Verdict(spec.name, "regression", detail=f"{type(err).__name__}: {err}"))
  ok = all(v.status in PASSING for v in verdicts)
  return verdicts, ok


def update(runner: Callable[[GoldenSpec], dict] = run_kernel_for, corpus=CORPUS,
           directory: Path = GOLDEN_DIR, device: str = "", jax_version: str = "") -> list[Verdict]:
  """Regenerate every golden; returns the verdicts of new against old.

  A case whose new output breaks the tolerance rule is not written: a
  golden must itself be right.
  """
  directory.mkdir(parents=True, exist_ok=True)
  manifest_path = directory / "manifest.json"
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
  verdicts = []
  for spec in corpus:
    new = runner(spec)
    verdict = classify(spec, new, load_golden(spec.name, directory))
    verdicts.append(verdict)
    if verdict.status == "regression":
      continue
    save_golden(spec.name, {k: new[k] for k in spec.arrays()}, directory)
    manifest[spec.name] = {
        "spec": dataclasses.asdict(spec), "seed": spec.seed,
        "config": config_used(spec),
        "device": device, "jax": jax_version, "kernel_source": kernel_source_hash(),
        "checksums": {k: _checksum(new[k]) for k in spec.arrays()},
    }
  manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
  return verdicts


# XLA picks GEMM algorithms by timing them in each process, so the XLA parts
# of a call (the backward's) can round differently from one process to the
# next (docs/decisions/goldens-pin-xla-autotuning.md): goldens are generated
# and checked with the choice made deterministically.
PINNED_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_deterministic_ops=true")


def pin_xla_numerics() -> None:
  """Add PINNED_XLA_FLAGS to XLA_FLAGS; must run before JAX starts its backend."""
  import os
  if "jax" in sys.modules and getattr(sys.modules["jax"], "_src", None) is not None:
    from jax._src import xla_bridge
    if getattr(xla_bridge, "_backends", None):
      raise RuntimeError("golden: XLA flags must be pinned before JAX initialises a backend")
  flags = os.environ.get("XLA_FLAGS", "").split()
  os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in PINNED_XLA_FLAGS if f not in flags])


def selected(names: str | None, corpus=CORPUS) -> tuple[GoldenSpec, ...]:
  """The cases named in ``names`` (comma-separated), in corpus order; None:
  the whole corpus.  An unknown name is refused, naming ``--select``."""
  if names is None:
    return corpus
  wanted = [n.strip() for n in names.split(",") if n.strip()]
  known = {s.name for s in corpus}
  unknown = [n for n in wanted if n not in known]
  if unknown or not wanted:
    raise ValueError(f"--select: unknown case(s) {unknown or [names]}; the corpus has "
                     f"{', '.join(s.name for s in corpus)}")
  return tuple(s for s in corpus if s.name in wanted)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness golden")
  parser.add_argument("action", choices=("check", "update"))
  parser.add_argument("--dir", default=str(GOLDEN_DIR))
  parser.add_argument("--select", default=None, metavar="NAME,...",
                      help="only these corpus cases (update rewrites only their files "
                           "and manifest entries)")
  args = parser.parse_args(argv)
  try:
    corpus = selected(args.select)
  except ValueError as err:
    parser.error(str(err))
  pin_xla_numerics()
  from kernel import api
  if api.sm90_device() is None:
    print("golden: needs an sm90 GPU to run the kernel; nothing checked", file=sys.stderr)
    return 2
  import jax
  directory = Path(args.dir)
  if args.action == "check":
    verdicts, ok = check(corpus=corpus, directory=directory)
    print(render(verdicts))
    return 0 if ok else 1
  verdicts = update(corpus=corpus, directory=directory, device=api.sm90_device().device_kind,
                    jax_version=jax.__version__)
  print("golden update: new outputs against the previous goldens (written unless a regression):")
  print(render(verdicts))
  return update_exit_code(verdicts)


def update_exit_code(verdicts) -> int:
  """0 when every case was written; 1 when a regression was refused (its
  old golden, if any, is kept), so a script that regenerates the goldens
  cannot take a refused case for a written one."""
  refused = [v.name for v in verdicts if v.status == "regression"]
  if refused:
    print(f"golden update: NOT written (regression): {', '.join(refused)}", file=sys.stderr)
  return 1 if refused else 0
