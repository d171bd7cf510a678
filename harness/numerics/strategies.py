"""Hypothesis strategies for attention calls.

Small composable strategies, each named for what it draws:

* :func:`attention_shapes` -- (B, T, N, H, S, K, Hv) with ragged lengths
  (1, primes, 113, 203, 239, ...), GQA ratios 1/2/4 and odd head dims;
* :func:`dtypes`, :func:`thresholds`, :func:`scales`, :func:`soft_caps`,
  :func:`block_kvs`;
* :func:`masks`, :func:`biases`, :func:`key_ranges` for a given shape, in every
  broadcast shape (B|1, N|1, T|1, S|1);
* :func:`attention_cases` -- a whole call as an :class:`AttentionCase`;
* :func:`fp8_specs`, :func:`fp8_cases` -- FP8 calls: e4m3 values with
  outliers up to e4m3's largest, descales over many orders of magnitude,
  per tensor or per (batch, kv head) (:class:`Fp8Spec`);
* :func:`seq_lengths`, :func:`local_windows`, :func:`segment_specs`,
  :func:`variant_specs` -- jax.nn.dot_product_attention's lengths and
  windows and packed-sequence segment ids (:class:`VariantSpec`);
  :func:`variant_cases` -- a whole call with them.

Array contents are never drawn element by element: a case draws a seed and
builds its arrays from ``numpy.random.default_rng(seed)`` (normal values, so
never all zeros). The seed and every structural choice are in the case's
``repr``, so ``build_case(<the printed CaseSpec>)`` rebuilds a failing case
exactly.

Defaults keep cases small enough for a CPU (seq <= 300, head dim <= 128);
``big=True`` (or larger ``max_seq`` / ``max_head_dim``) draws GPU-sized ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import strategies as st

from kernel.call import AttentionShapes, Call, bfloat16, float8_e4m3fn, float16, float32
from kernel.forward import fp8 as fp8_contract

__all__ = [
  "SEQ_LENGTHS",
  "BIG_SEQ_LENGTHS",
  "HEAD_DIMS",
  "GQA_RATIOS",
  "THRESHOLDS",
  "BLOCK_KVS",
  "MaskSpec",
  "BiasSpec",
  "KeyRangeSpec",
  "CaseSpec",
  "AttentionCase",
  "build_case",
  "attention_shapes",
  "dtypes",
  "thresholds",
  "scales",
  "soft_caps",
  "block_kvs",
  "broadcast_shapes",
  "mask_specs",
  "masks",
  "bias_specs",
  "biases",
  "key_range_specs",
  "key_ranges",
  "attention_cases",
  "Fp8Spec",
  "fp8_specs",
  "fp8_cases",
  "SegmentSpec",
  "VariantSpec",
  "seq_lengths",
  "local_windows",
  "segment_specs",
  "variant_specs",
  "variant_cases",
]

# Lengths that are not multiples of 64/128 on purpose, plus the edges.
SEQ_LENGTHS = (1, 2, 3, 7, 13, 31, 63, 64, 65, 113, 127, 128, 129, 203, 239, 256, 257)
BIG_SEQ_LENGTHS = (383, 511, 1000, 1023, 1024, 1031, 2048, 4096)
HEAD_DIMS = (64, 128, 256, 72, 96)
GQA_RATIOS = (1, 2, 4)
# 0: never rescale after the first max; 1e-30: practically never; 0.5;
# the largest float64 below 1 (guarded branch; it rounds to 1.0 in float32,
# so it rescales on any move of the max) and the largest float32 below 1;
# exactly 1.0 (the textbook branch of its own).
THRESHOLDS = (0.0, 1e-30, 0.5, float(np.nextafter(1.0, 0.0)),
              float(np.nextafter(np.float32(1), np.float32(0))), 1.0)
BLOCK_KVS = (16, 32, 64, 128)


# ---------------------------------------------------------------------------
# Scalars.


def dtypes() -> st.SearchStrategy[np.dtype]:
  """The kernel's input dtypes: bfloat16, float16, float32."""
  return st.sampled_from((bfloat16, float16, float32))


def thresholds() -> st.SearchStrategy[float]:
  """rescale_threshold in [0, 1], the edge values most often."""
  return st.one_of(
    st.sampled_from(THRESHOLDS),
    st.floats(0.0, 1.0, allow_nan=False),
  )


def scales() -> st.SearchStrategy[float | None]:
  """None (1/sqrt(H)) most often, else a finite scale, negative ones included."""
  return st.one_of(
    st.none(),
    st.sampled_from((0.05, 0.125, 0.3, 1.0, -0.2)),
    st.floats(-0.5, 0.5, allow_nan=False, allow_infinity=False),
  )


def soft_caps() -> st.SearchStrategy[float | None]:
  """None or a soft cap > 0."""
  return st.one_of(
    st.none(),
    st.sampled_from((1.0, 5.0, 30.0)),
    st.floats(0.5, 50.0, allow_nan=False, allow_infinity=False),
  )


def block_kvs() -> st.SearchStrategy[int]:
  """Key block sizes of the online-softmax model."""
  return st.sampled_from(BLOCK_KVS)


# ---------------------------------------------------------------------------
# Shapes.


@st.composite
def attention_shapes(
  draw,
  *,
  max_batch: int = 2,
  max_seq: int = 300,
  max_head_dim: int = 128,
  max_kv_heads: int = 2,
  big: bool = False,
) -> AttentionShapes:
  """Shapes of one call; ragged sequence lengths on purpose."""
  lengths = SEQ_LENGTHS + (BIG_SEQ_LENGTHS if big else ())
  if big:
    max_seq = max(max_seq, max(BIG_SEQ_LENGTHS))
    max_head_dim = max(max_head_dim, max(HEAD_DIMS))
  lengths = tuple(n for n in lengths if n <= max_seq) or (1,)
  seq = st.one_of(st.sampled_from(lengths), st.integers(1, max_seq))
  head_dims = tuple(h for h in HEAD_DIMS if h <= max_head_dim) or (max_head_dim,)
  B = draw(st.integers(1, max_batch))
  T = draw(seq)
  S = draw(seq)
  K = draw(st.integers(1, max_kv_heads))
  N = K * draw(st.sampled_from(GQA_RATIOS))
  H = draw(st.sampled_from(head_dims))
  Hv = draw(st.one_of(st.just(H), st.sampled_from(head_dims)))
  return AttentionShapes(B=B, T=T, N=N, H=H, S=S, K=K, Hv=Hv)


@st.composite
def broadcast_shapes(draw, target: tuple[int, ...]) -> tuple[int, ...]:
  """A shape broadcastable to ``target``: each dim full or 1, leading 1s
  possibly dropped (rank < len(target))."""
  dims = [draw(st.sampled_from((t, 1))) if t != 1 else 1 for t in target]
  lead = 0
  while lead < len(dims) and dims[lead] == 1 and draw(st.booleans()):
    lead += 1
  return tuple(dims[lead:])


# ---------------------------------------------------------------------------
# Masks, biases, key ranges: specs that build arrays from a seed.


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """A random bool mask: True (attend) with probability ``density``."""

  shape: tuple[int, ...]
  density: float
  seed: int
  empty_rows: float = 0.0  # fraction of rows forced fully False
  keep_first_key: bool = False  # force key 0 visible (no fully masked rows)

  def build(self) -> np.ndarray:
    rng = np.random.default_rng(self.seed)
    mask = rng.random(self.shape) < self.density
    if self.empty_rows and mask.ndim >= 1:
      rows = rng.random(self.shape[:-1]) < self.empty_rows
      mask = mask & ~rows[..., None]
    if self.keep_first_key:
      if mask.ndim == 0:
        return np.array(True)  # a scalar mask can only keep key 0 by keeping all
      mask[..., 0] = True
    return mask


@dataclasses.dataclass(frozen=True)
class BiasSpec:
  """A random normal bias of standard deviation ``std``, a fraction
  ``neg_inf`` of its entries -inf (an additive mask)."""

  shape: tuple[int, ...]
  std: float
  seed: int
  neg_inf: float = 0.0

  def build(self, dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(self.seed)
    bias = rng.standard_normal(self.shape) * self.std
    if self.neg_inf:
      bias = np.where(rng.random(self.shape) < self.neg_inf, -np.inf, bias)
    return bias.astype(dtype)


@dataclasses.dataclass(frozen=True)
class KeyRangeSpec:
  """Per-row key ranges [k_start, k_end), some empty (k_start >= k_end).

  ``which`` is "both", "start" or "end" (the other bound left None).
  """

  shape: tuple[int, ...]
  S: int
  seed: int
  which: str = "both"

  def build(self) -> tuple[np.ndarray | None, np.ndarray | None]:
    rng = np.random.default_rng(self.seed)
    start = rng.integers(-1, self.S + 1, self.shape)
    end = start + rng.integers(-2, self.S + 2, self.shape)
    start, end = start.astype(np.int32), end.astype(np.int32)
    if self.which == "start":
      return start, None
    if self.which == "end":
      return None, np.clip(end, 0, None).astype(np.int32)
    return start, end


_seeds = st.integers(0, 2**32 - 1)


@st.composite
def mask_specs(draw, shapes: AttentionShapes, *, allow_fully_masked: bool = True
               ) -> MaskSpec:
  shape = draw(broadcast_shapes(shapes.logits_shape))
  density = draw(st.sampled_from((0.0, 0.1, 0.5, 0.9, 1.0)))
  empty_rows = 0.0
  if allow_fully_masked:
    empty_rows = draw(st.sampled_from((0.0, 0.0, 0.2)))
  else:
    density = max(density, 0.1)
  return MaskSpec(shape=shape, density=density, seed=draw(_seeds),
                  empty_rows=empty_rows, keep_first_key=not allow_fully_masked)


def masks(shapes: AttentionShapes) -> st.SearchStrategy[np.ndarray | None]:
  """None, or a random bool mask in any shape broadcastable to (B, N, T, S)."""
  return st.one_of(st.none(), mask_specs(shapes).map(lambda spec: spec.build()))


@st.composite
def bias_specs(draw, shapes: AttentionShapes, *, allow_neg_inf: bool = True
               ) -> BiasSpec:
  shape = draw(broadcast_shapes(shapes.logits_shape))
  std = draw(st.sampled_from((0.5, 1.0, 3.0)))
  neg_inf = draw(st.sampled_from((0.0, 0.0, 0.0, 0.1))) if allow_neg_inf else 0.0
  return BiasSpec(shape=shape, std=std, seed=draw(_seeds), neg_inf=neg_inf)


def biases(shapes: AttentionShapes, dtype: Any = float32
           ) -> st.SearchStrategy[np.ndarray | None]:
  """None, or a random bias in any shape broadcastable to (B, N, T, S)."""
  return st.one_of(
    st.none(), bias_specs(shapes).map(lambda spec: spec.build(dtype)))


@st.composite
def key_range_specs(draw, shapes: AttentionShapes) -> KeyRangeSpec:
  shape = draw(broadcast_shapes(shapes.row_shape))
  which = draw(st.sampled_from(("both", "both", "start", "end")))
  return KeyRangeSpec(shape=shape, S=shapes.S, seed=draw(_seeds), which=which)


def key_ranges(shapes: AttentionShapes
               ) -> st.SearchStrategy[tuple[np.ndarray | None, np.ndarray | None]]:
  """(None, None), or per-row (k_start, k_end), empty ranges included."""
  return st.one_of(
    st.just((None, None)),
    key_range_specs(shapes).map(lambda spec: spec.build()),
  )


# ---------------------------------------------------------------------------
# Whole cases.


# FP8 logits stay below this in magnitude (the FP8 contract, kernel/api.py).
FP8_LOGIT_LIMIT = fp8_contract.LOGIT_LIMIT


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
  """How an FP8 case's stored values and descales are made (from the case's
  seed, on a stream of their own).

  Stored values: normal, of standard deviation ``stored_std``, a fraction
  ``outliers`` of them pushed to between 100 and 448 in magnitude, rounded
  to e4m3 with saturation.  Descales: for q and k, ``2 ** (u - log2(stored_std))``
  (a real standard deviation of 2^u), for v ``2 ** u``, each u drawn in
  [-``spread``, ``spread``] around ``log2_q``, ``log2_k``, ``log2_v``; per
  tensor, or per (batch, kv head) (``layout`` "head").  A float16 output
  keeps v's descale at most 2^6, so the real values fit it.  q's and k's
  descales are lowered where the logits could reach
  :data:`FP8_LOGIT_LIMIT` (the FP8 contract's range, kernel/api.py)."""

  layout: str = "tensor"
  stored_std: float = 16.0
  outliers: float = 0.0
  log2_q: float = 0.0
  log2_k: float = 0.0
  log2_v: float = 0.0
  spread: float = 0.0
  out_dtype: str = "bfloat16"

  def build(self, shapes: AttentionShapes, seed: int, scale: float | None = None
            ) -> dict[str, Any]:
    """query, key, value (e4m3) and the call's FP8 arguments (``scale``: the
    call's, None for 1 / sqrt(H))."""
    from harness.numerics.reference import quantise_e4m3
    rng = np.random.default_rng([seed, 8])
    sh = shapes

    def stored(shape):
      x = rng.standard_normal(shape) * self.stored_std
      if self.outliers:
        hit = rng.random(shape) < self.outliers
        x = np.where(hit, np.sign(x + 0.5) * rng.uniform(100.0, 448.0, shape), x)
      return quantise_e4m3(x).astype(float8_e4m3fn)

    def descale(center, relative):
      size = () if self.layout == "tensor" else (sh.B, sh.K)
      u = center + rng.uniform(-self.spread, self.spread, size)
      if relative:
        u = u - np.log2(self.stored_std)
      if self.out_dtype == "float16" and not relative:
        u = np.minimum(u, 6.0)
      return np.asarray(2.0 ** u, np.float32)

    q, k = stored((sh.B, sh.T, sh.N, sh.H)), stored((sh.B, sh.S, sh.K, sh.H))
    v = stored((sh.B, sh.S, sh.K, sh.Hv))
    qd, kd = descale(self.log2_q, True), descale(self.log2_k, True)
    # |q.k| <= |q| |k|: the largest logit the descales allow, within the limit.
    norm = lambda x: float(np.sqrt((x.astype(np.float32) ** 2).sum(-1)).max())
    scale = sh.H ** -0.5 if scale is None else abs(scale)
    reach = scale * float(np.max(qd)) * float(np.max(kd)) * norm(q) * norm(k)
    if reach > FP8_LOGIT_LIMIT:
      shrink = np.float32(np.sqrt(FP8_LOGIT_LIMIT / reach))
      qd, kd = qd * shrink, kd * shrink
    return dict(query=q, key=k, value=v, q_descale=qd, k_descale=kd,
                v_descale=descale(self.log2_v, False),
                out_dtype=np.dtype(bfloat16 if self.out_dtype == "bfloat16" else float16))


@dataclasses.dataclass(frozen=True)
class CaseSpec:
  """Everything that determines an :class:`AttentionCase` (see build_case)."""

  shapes: AttentionShapes
  dtype: str
  seed: int
  scale: float | None = None
  is_causal: bool = False
  logits_soft_cap: float | None = None
  mask: MaskSpec | None = None
  bias: BiasSpec | None = None
  key_range: KeyRangeSpec | None = None
  input_std: float = 1.0
  variants: "VariantSpec | None" = None
  fp8: Fp8Spec | None = None      # FP8 inputs (dtype float8_e4m3fn)


class AttentionCase:
  """One attention call: arrays built from ``spec`` (repr shows only the spec).

  Attributes: query, key, value (in ``dtype``), bias (in ``dtype``) or None,
  mask or None, k_start, k_end (int32) or None, d_out (float64 cotangent for
  gradient tests).
  """

  def __init__(self, spec: CaseSpec):
    self.spec = spec
    sh = spec.shapes
    self.dtype = np.dtype(spec.dtype)
    rng = np.random.default_rng(spec.seed)

    fp8 = {}
    if spec.fp8 is not None:  # its own stream: the draws below stay as they were
      fp8 = spec.fp8.build(sh, spec.seed, spec.scale)
    # FP8's q, k, v replace these below (drawn all the same, for d_out's sake).
    drawn = bfloat16 if fp8 else self.dtype

    def normal(shape):
      return (rng.standard_normal(shape) * spec.input_std).astype(drawn)
    self.query = normal((sh.B, sh.T, sh.N, sh.H))
    self.key = normal((sh.B, sh.S, sh.K, sh.H))
    self.value = normal((sh.B, sh.S, sh.K, sh.Hv))
    self.d_out = rng.standard_normal((sh.B, sh.T, sh.N, sh.Hv))
    if fp8:
      self.query, self.key, self.value = fp8.pop("query"), fp8.pop("key"), fp8.pop("value")
    # A bias is drawn in the compute dtype (bfloat16 beside FP8 inputs).
    self.bias = None if spec.bias is None else spec.bias.build(
        bfloat16 if fp8 else self.dtype)
    self.mask = None if spec.mask is None else spec.mask.build()
    self.k_start, self.k_end = (None, None) if spec.key_range is None \
      else spec.key_range.build()
    self.variant_kwargs = {} if spec.variants is None else spec.variants.build()
    self.segment_layout = "contiguous" if spec.variants is None \
      else spec.variants.segment_layout
    # The call itself, validated once: what the reference, the model and
    # the kernel read.
    self.fp8_kwargs = fp8
    self.call = Call(self.query, self.key, self.value, self.bias, self.mask,
                     scale=spec.scale, is_causal=spec.is_causal, k_start=self.k_start,
                     k_end=self.k_end, logits_soft_cap=spec.logits_soft_cap,
                     segment_layout=self.segment_layout, **self.variant_kwargs, **fp8)

  @property
  def shapes(self) -> AttentionShapes:
    return self.spec.shapes

  @property
  def args(self) -> tuple:
    """(query, key, value, bias, mask): the call's positional arguments."""
    return self.call.arrays

  @property
  def kwargs(self) -> dict[str, Any]:
    """The call's keyword arguments that the reference, the model and the
    kernel share."""
    c = self.call
    return dict(scale=c.scale, is_causal=c.is_causal, k_start=c.k_start, k_end=c.k_end,
                logits_soft_cap=c.logits_soft_cap, **c.variants, **self.fp8_kwargs)

  @property
  def rtol(self) -> float:
    from harness.numerics.tolerance import rtol_for
    return rtol_for(self.spec.logits_soft_cap)

  def describe(self) -> str:
    """One line for hypothesis.note."""
    s = self.spec
    sh = s.shapes
    parts = [
      f"B={sh.B} T={sh.T} N={sh.N} H={sh.H} S={sh.S} K={sh.K} Hv={sh.Hv}",
      f"dtype={s.dtype} seed={s.seed}",
      f"scale={s.scale} causal={s.is_causal} soft_cap={s.logits_soft_cap}",
      f"mask={None if s.mask is None else s.mask.shape}",
      f"bias={None if s.bias is None else s.bias.shape}",
      f"key_range={None if s.key_range is None else (s.key_range.shape, s.key_range.which)}",
    ]
    if s.variants is not None:
      parts.append(f"variants={s.variants!r}")
    if s.fp8 is not None:
      parts.append(f"fp8={s.fp8!r}")
    return "; ".join(parts)

  def __repr__(self) -> str:
    return f"build_case({self.spec!r})"


def build_case(spec: CaseSpec) -> AttentionCase:
  """Rebuild a case from its spec (what a failing example prints)."""
  return AttentionCase(spec)


@st.composite
def attention_cases(
  draw,
  *,
  big: bool = False,
  dtype: Any = None,
  shapes: AttentionShapes | None = None,
  allow_mask: bool = True,
  allow_bias: bool = True,
  allow_causal: bool = True,
  allow_key_ranges: bool = True,
  allow_soft_cap: bool = True,
  allow_fully_masked: bool = True,
  same_head_dims: bool = False,
  max_logits: int | None = 2_000_000,
  **shape_limits: int,
) -> AttentionCase:
  """A whole attention call.

  ``shape_limits`` (``max_batch``, ``max_seq``, ``max_head_dim``,
  ``max_kv_heads``) and ``big`` go to :func:`attention_shapes` unless
  ``shapes`` is given.

  ``allow_fully_masked=False`` guarantees every row sees at least key 0 (it
  also turns off key ranges and -inf biases).  A float8_e4m3fn ``dtype``
  draws an :class:`Fp8Spec` too. ``same_head_dims`` forces
  Hv == H (as jax.nn.dot_product_attention needs). ``max_logits`` bounds
  B*N*T*S so that CPU examples stay fast.
  """
  if shapes is not None and shape_limits:
    raise TypeError(f"attention_cases: {sorted(shape_limits)} limit drawn shapes; got shapes=")
  if shapes is None:
    shapes = draw(attention_shapes(big=big, **shape_limits))
  if same_head_dims and shapes.Hv != shapes.H:
    shapes = dataclasses.replace(shapes, Hv=shapes.H)
  if max_logits is not None and not big:
    # Shrink the lengths rather than reject the example.
    while shapes.B * shapes.N * shapes.T * shapes.S > max_logits:
      shapes = dataclasses.replace(shapes, T=max(1, shapes.T // 2),
                                   S=max(1, shapes.S // 2))
  dt = np.dtype(dtype) if dtype is not None else draw(dtypes())
  seed = draw(_seeds)
  scale = draw(scales())
  is_causal = draw(st.booleans()) if allow_causal else False
  cap = draw(soft_caps()) if allow_soft_cap else None
  mask = draw(st.one_of(st.none(), mask_specs(
    shapes, allow_fully_masked=allow_fully_masked))) if allow_mask else None
  bias = draw(st.one_of(st.none(), bias_specs(
    shapes, allow_neg_inf=allow_fully_masked))) if allow_bias else None
  key_range = None
  if allow_key_ranges and allow_fully_masked:
    key_range = draw(st.one_of(st.none(), key_range_specs(shapes)))
  spec = CaseSpec(shapes=shapes, dtype=str(dt), seed=seed, scale=scale,
                  is_causal=is_causal, logits_soft_cap=cap, mask=mask,
                  bias=bias, key_range=key_range,
                  fp8=draw(fp8_specs()) if dt == float8_e4m3fn else None)
  return build_case(spec)


# ---------------------------------------------------------------------------
# FP8.


@st.composite
def fp8_specs(draw) -> Fp8Spec:
  """Stored values using little or all of e4m3's range, with outliers or
  not; descales per tensor or per (batch, kv head), their logits' scale
  anywhere from 2^-8 to 2^8 (near-uniform rows to one-hot ones), v's from
  2^-12 to 2^12; a bfloat16 or float16 output."""
  out_dtype = draw(st.sampled_from(("bfloat16", "bfloat16", "float16")))
  return Fp8Spec(
      layout=draw(st.sampled_from(("tensor", "head"))),
      stored_std=draw(st.sampled_from((0.5, 4.0, 16.0, 64.0, 200.0))),
      outliers=draw(st.sampled_from((0.0, 0.0, 0.001, 0.02))),
      log2_q=draw(st.floats(-4.0, 4.0)), log2_k=draw(st.floats(-4.0, 4.0)),
      log2_v=draw(st.floats(-12.0, 12.0)),
      spread=draw(st.sampled_from((0.0, 1.0, 4.0))), out_dtype=out_dtype)


def fp8_cases(**case_kwargs) -> st.SearchStrategy[AttentionCase]:
  """:func:`attention_cases` (``case_kwargs``) in float8_e4m3fn, each with
  an :class:`Fp8Spec` (:func:`fp8_specs`)."""
  return attention_cases(dtype=float8_e4m3fn, **case_kwargs)


# ---------------------------------------------------------------------------
# jax.nn.dot_product_attention's lengths and windows; packed segments.


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
  """Segment ids as runs: per batch row, ((id, length), ...) for the keys
  and for the queries (lengths summing to S and T)."""

  kv_runs: tuple[tuple[tuple[int, int], ...], ...]
  q_runs: tuple[tuple[tuple[int, int], ...], ...]

  def build(self) -> tuple[np.ndarray, np.ndarray]:
    ids = lambda rows: np.stack([
      np.concatenate([np.full(n, i, np.int32) for i, n in runs]) for runs in rows])
    return ids(self.q_runs), ids(self.kv_runs)

  @property
  def kv_contiguous(self) -> bool:
    """Each id is one run of the keys (segment_layout="contiguous")."""
    return all(len({i for i, _ in runs}) == len(runs) for runs in self.kv_runs)


@dataclasses.dataclass(frozen=True)
class VariantSpec:
  """The lengths, window, chunk and segments of a call, as plain values."""

  query_seq_lengths: tuple[int, ...] | None = None
  key_value_seq_lengths: tuple[int, ...] | None = None
  local_window_size: int | tuple[int, int] | None = None
  attention_chunk: int | None = None
  segments: SegmentSpec | None = None
  segment_layout: str = "contiguous"

  def build(self) -> dict[str, Any]:
    """Keyword arguments for the reference and the kernel (segment_layout,
    the kernel's alone, left out)."""
    lengths = lambda x: None if x is None else np.asarray(x, np.int32)
    q_ids, kv_ids = (None, None) if self.segments is None else self.segments.build()
    kw = dict(query_seq_lengths=lengths(self.query_seq_lengths),
              key_value_seq_lengths=lengths(self.key_value_seq_lengths),
              local_window_size=self.local_window_size,
              attention_chunk=self.attention_chunk, q_segment_ids=q_ids,
              kv_segment_ids=kv_ids)
    return {k: v for k, v in kw.items() if v is not None}


@st.composite
def seq_lengths(draw, batch: int, length: int) -> tuple[int, ...]:
  """(B,) lengths of a sequence of ``length``: 0, the full length, ragged,
  or past the end (jax.nn reads it as the full length)."""
  one = st.one_of(st.sampled_from((0, length, length + 3)), st.integers(0, length))
  return tuple(draw(one) for _ in range(batch))


@st.composite
def local_windows(draw, T: int, S: int) -> int | tuple[int, int]:
  """An int or a (left, right) window: 0 (the diagonal only), small, or as
  wide as or wider than the sequences (a negative side is refused)."""
  side = st.one_of(st.sampled_from((0, 0, 1, T + S, T + S + 7)),
                   st.integers(0, max(T, S)))
  if draw(st.booleans()):
    return draw(side)
  return draw(side), draw(side)


def attention_chunks(T: int, S: int) -> st.SearchStrategy[int]:
  """A chunk of positions: 1 (each row its own chunk), small, about a
  block, or as long as or longer than the sequences."""
  return st.one_of(st.sampled_from((1, 64, 128, max(T, S), T + S + 5)),
                   st.integers(1, max(T, S)))


@st.composite
def _runs(draw, length: int, max_runs: int = 8) -> list[int]:
  """Run lengths summing to ``length`` (>= 1 each); one-token runs often."""
  if length == 1:
    return [1]
  cuts = draw(st.sets(st.integers(1, length - 1), max_size=min(max_runs, length - 1)))
  if cuts and draw(st.booleans()):  # one-token segments
    cuts |= {c + 1 for c in cuts if c + 1 < length}
  edges = [0, *sorted(cuts), length]
  return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def segment_specs(draw, B: int, T: int, S: int, *, contiguous: bool = True) -> SegmentSpec:
  """Segment ids for a batch: keys in runs, each id one run when
  ``contiguous`` (else, given three runs or more, the first id also ends
  the row, split by another); ids in any order and range.  When T == S the queries often share the keys' ids (packed
  self-attention); otherwise they draw their own runs, whose ids may be
  absent from the keys (rows that see nothing)."""
  kv_rows, q_rows = [], []
  for _ in range(B):
    kv_lengths = draw(_runs(S))
    r = len(kv_lengths)
    base = draw(st.sampled_from((0, 1, -5, 2**30)))
    if contiguous:
      order = draw(st.permutations(range(r)))
    else:
      order = [draw(st.integers(0, max(1, r // 2))) for _ in range(r)]
      if r >= 3:  # one id split by another: a hole in its run
        order[-1], order[1] = order[0], order[0] + 1
    kv_runs = tuple((base + o, n) for o, n in zip(order, kv_lengths))
    if T == S and draw(st.booleans()):
      q_runs = kv_runs
    else:
      pool = sorted({i for i, _ in kv_runs} | {base + r + 1})
      q_runs = tuple((draw(st.sampled_from(pool)), n) for n in draw(_runs(T)))
    kv_rows.append(kv_runs)
    q_rows.append(q_runs)
  return SegmentSpec(tuple(kv_rows), tuple(q_rows))


@st.composite
def variant_specs(draw, shapes: AttentionShapes, *, lengths: bool = True,
                  windows: bool = True, segments: bool = True,
                  layout: str = "contiguous", contiguous_ids: bool | None = None
                  ) -> VariantSpec:
  """Any subset of the lengths, window (with it, the chunk) and segments
  for ``shapes`` (at least one of those allowed).  Key ids are contiguous runs for
  ``layout="contiguous"``, else drawn either way, unless ``contiguous_ids``
  says (False: ids may repeat across runs, whatever the layout)."""
  if contiguous_ids is None:
    contiguous_ids = True if layout == "contiguous" else draw(st.booleans())
  kinds = [k for k, ok in (("q", lengths), ("kv", lengths), ("window", windows),
                           ("chunk", windows), ("segments", segments)) if ok]
  chosen = draw(st.sets(st.sampled_from(kinds), min_size=1))
  B, T, S = shapes.B, shapes.T, shapes.S
  return VariantSpec(
    query_seq_lengths=draw(seq_lengths(B, T)) if "q" in chosen else None,
    key_value_seq_lengths=draw(seq_lengths(B, S)) if "kv" in chosen else None,
    local_window_size=draw(local_windows(T, S)) if "window" in chosen else None,
    attention_chunk=draw(attention_chunks(T, S)) if "chunk" in chosen else None,
    segments=draw(segment_specs(B, T, S, contiguous=contiguous_ids))
    if "segments" in chosen else None,
    segment_layout=layout)


@st.composite
def variant_cases(draw, *, lengths: bool = True, windows: bool = True,
                  segments: bool = True, layout: str = "contiguous",
                  **case_kwargs) -> AttentionCase:
  """:func:`attention_cases` (``case_kwargs``) with lengths, a window or
  segments drawn on top."""
  case = draw(attention_cases(**case_kwargs))
  spec = draw(variant_specs(case.shapes, lengths=lengths, windows=windows,
                            segments=segments, layout=layout))
  return build_case(dataclasses.replace(case.spec, variants=spec))


# Every GPU example compiles kernels, so the big GPU properties are split into
# shards that pytest -n auto runs on separate workers; each shard draws its
# share of the examples (fresh ones per shard under the gpu profile).
GPU_SHARDS = 4


def per_shard(total: int) -> int:
  return max(1, -(-total // GPU_SHARDS))


# How many times more examples a slow CPU property draws under the thorough
# profile than under ci and mutants, whose counts keep the CPU suite within
# CI's 8 minutes (docs/decisions/cpu-suite-time.md).
THOROUGH_FACTOR = 5


def thorough() -> bool:
  """Whether the Hypothesis profile loaded (properties/conftest.py) is
  thorough: the one that draws and lowers everything the others sample."""
  from hypothesis import settings
  return settings.get_current_profile_name() == "thorough"


def examples(ci: int) -> int:
  """The examples a slow CPU property draws: ``ci`` under the ci and mutants
  profiles, :data:`THOROUGH_FACTOR` times as many under thorough."""
  return ci * (THOROUGH_FACTOR if thorough() else 1)


def ci_sample(items, every: int) -> list:
  """What a slow CPU check takes of ``items``: every ``every``-th from the
  first under the ci and mutants profiles, all of them under thorough."""
  items = list(items)
  return items if thorough() or every <= 1 else items[::every]


def ci_pairs(items, choices) -> list[tuple]:
  """(item, choice) pairs a slow CPU check takes: under the ci and mutants
  profiles each item with one choice, in turn (so every choice is taken
  while the items last), under thorough each item with every choice."""
  choices = list(choices)
  return [(item, choice) for i, item in enumerate(items) for j, choice in enumerate(choices)
          if thorough() or i % len(choices) == j]
