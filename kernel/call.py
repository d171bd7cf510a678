"""One attention call as a record (:class:`Call`), and the rules it is
validated by.

A :class:`Call` holds the arrays and the static arguments of one call of
``dot_product_attention``, checked once when it is made.  The public API
(``kernel/api.py``), the float64 reference (``harness/numerics/reference.py``),
the executable model of the kernel (``harness/numerics/online_softmax_model.py``)
and the Hypothesis strategies all read a Call, so a malformed call is rejected
with the same message by each of them, and a conformance test can hold each
to the same list of bad inputs (``harness/numerics/bad_inputs.py``).

Layout, with the letters of ``jax.nn.dot_product_attention``::

  query  (B, T, N, H)      B batch, T query length, N query heads, H head dim
  key    (B, S, K, H)      S key length, K key/value heads, N % K == 0 (GQA)
  value  (B, S, K, Hv)     Hv may differ from H
  bias   broadcastable to (B, N, T, S), floating point
  mask   broadcastable to (B, N, T, S), bool (True = the key takes part)
  k_start, k_end   integer, broadcastable to (B, N, T); query row i
                   sees the keys j with k_start <= j < k_end

"Broadcastable to" follows NumPy's rules with the target fixed: the operand
has rank <= the target's, its shape is aligned to the right, and each of its
dimensions is either 1 or equal to the target's.

Only ``.shape`` and ``.dtype`` of the array arguments are read, so NumPy
arrays, JAX arrays and ``jax.ShapeDtypeStruct`` are all accepted (Python
scalars and lists are read through ``numpy.asarray``). Every error is a
``ValueError`` whose message starts with the name of the offending argument,
e.g. ``"key: expected rank 4 (B, S, K, H), got shape (2, 3, 4)"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import ml_dtypes
import numpy as np

__all__ = [
  "AttentionShapes",
  "Call",
  "DEFAULT_ALLOWED_DTYPES",
  "EVERY_DTYPE",
  "FP8_DTYPES",
  "validate_attention_args",
  "broadcastable_to",
]

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)

# What the kernel takes (float32 is computed in bfloat16; float8_e4m3fn with
# its descales); the float64 reference and the NumPy model take float64 too.
DEFAULT_ALLOWED_DTYPES = (float16, bfloat16, float32, float8_e4m3fn)
EVERY_DTYPE = (float16, bfloat16, float32, float64, float8_e4m3fn)
# The 8-bit input dtypes, each taken with q_descale, k_descale and v_descale,
# and the output dtypes such a call may ask for (the first is the default).
FP8_DTYPES = (float8_e4m3fn,)
FP8_OUT_DTYPES = (bfloat16, float16)
DESCALES = ("q_descale", "k_descale", "v_descale")


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
  """The sizes a valid call implies (letters as in the module docstring)."""

  B: int
  T: int
  N: int
  H: int
  S: int
  K: int
  Hv: int

  @property
  def group_size(self) -> int:
    """Query heads per key/value head; query head n reads key head n // group_size."""
    return self.N // self.K

  @property
  def logits_shape(self) -> tuple[int, int, int, int]:
    return (self.B, self.N, self.T, self.S)

  @property
  def row_shape(self) -> tuple[int, int, int]:
    """Shape of the per-row residuals m and l, and of k_start / k_end."""
    return (self.B, self.N, self.T)


def _shape_and_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(int(d) for d in x.shape), np.dtype(x.dtype)
  arr = np.asarray(x)
  return arr.shape, arr.dtype


def _dtype_name(dtype: np.dtype) -> str:
  return str(np.dtype(dtype))


def broadcastable_to(shape: Iterable[int], target: Iterable[int]) -> bool:
  """True when ``shape`` broadcasts to exactly ``target`` (right-aligned)."""
  shape, target = tuple(shape), tuple(target)
  if len(shape) > len(target):
    return False
  tail = target[len(target) - len(shape):]
  return all(s == 1 or s == t for s, t in zip(shape, tail))


def _is_floating(dtype: np.dtype) -> bool:
  # Real floating point only; ml_dtypes.bfloat16 is not a subtype of
  # np.floating (kind "V"), so ask ml_dtypes.finfo for the extension types.
  if dtype.kind == "f":
    return True
  if dtype.kind != "V":
    return False
  try:
    ml_dtypes.finfo(dtype)
  except (ValueError, TypeError):
    return False
  return True


def _check_qkv(name: str, shape: tuple[int, ...], letters: str) -> None:
  if len(shape) != 4:
    raise ValueError(
      f"{name}: expected rank 4 ({', '.join(letters)}), got shape {shape}"
    )
  if any(d <= 0 for d in shape):
    raise ValueError(
      f"{name}: every dimension must be positive, got shape {shape}"
    )


def _check_scalar(name: str, value: Any) -> float:
  if isinstance(value, (bool, np.bool_)) or tuple(getattr(value, "shape", ())) != ():
    raise ValueError(f"{name}: expected a real scalar, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError) as err:
    raise ValueError(f"{name}: expected a real scalar, got {value!r}") from err


def _is_integer(dtype) -> bool:
  return np.issubdtype(dtype, np.integer) and dtype != np.dtype(bool)


def _check_operand(name, x, dtype_ok, dtype_wanted: str, target, target_name: str) -> None:
  """An optional operand that must broadcast to ``target``, with its dtype
  and shape refused by name."""
  if x is None:
    return
  shape, dtype = _shape_and_dtype(x)
  if not dtype_ok(dtype):
    raise ValueError(f"{name}: expected {dtype_wanted}, got {_dtype_name(dtype)}")
  if not broadcastable_to(shape, target):
    raise ValueError(f"{name}: shape {shape} is not broadcastable to {target_name} = {target}")


def validate_attention_args(
  query: Any,
  key: Any,
  value: Any,
  bias: Any = None,
  mask: Any = None,
  *,
  scale: Any = None,
  k_start: Any = None,
  k_end: Any = None,
  logits_soft_cap: Any = None,
  rescale_threshold: Any = None,
  allowed_dtypes: Iterable[Any] = DEFAULT_ALLOWED_DTYPES,
) -> AttentionShapes:
  """Check an attention call and return the sizes it implies.

  Raises ``ValueError`` naming the offending argument for: a wrong rank or a
  zero-sized dimension of query/key/value; a batch, head-dim, key-length or
  head-count mismatch between them; N not a multiple of K; a query dtype not
  in ``allowed_dtypes`` or a key/value dtype different from the query's; a
  bias that is not floating point or not broadcastable to (B, N, T, S); a
  mask that is not bool or not broadcastable to (B, N, T, S); k_start/k_end
  that are not integer or not broadcastable to (B, N, T); a scale that is not
  a finite real; a logits_soft_cap that is not a finite real > 0; a
  rescale_threshold outside [0, 1].
  """
  allowed = tuple(np.dtype(d) for d in allowed_dtypes)

  q_shape, q_dtype = _shape_and_dtype(query)
  k_shape, k_dtype = _shape_and_dtype(key)
  v_shape, v_dtype = _shape_and_dtype(value)

  _check_qkv("query", q_shape, "BTNH")
  _check_qkv("key", k_shape, "BSKH")
  _check_qkv("value", v_shape, ("B", "S", "K", "Hv"))
  _check_qkv_dtypes(q_dtype, k_dtype, v_dtype, allowed)
  shapes = _qkv_shapes(q_shape, k_shape, v_shape)

  _check_operand("bias", bias, _is_floating, "a floating-point dtype",
                 shapes.logits_shape, "(B, N, T, S)")
  _check_operand("mask", mask, lambda d: d == np.dtype(bool), "dtype bool",
                 shapes.logits_shape, "(B, N, T, S)")
  for name, bound in (("k_start", k_start), ("k_end", k_end)):
    _check_operand(name, bound, _is_integer, "an integer dtype", shapes.row_shape, "(B, N, T)")

  _check_scalars(scale, logits_soft_cap, rescale_threshold)
  return shapes


def _check_qkv_dtypes(q_dtype: np.dtype, k_dtype: np.dtype, v_dtype: np.dtype,
                      allowed: tuple[np.dtype, ...]) -> None:
  """Refuse a query dtype outside ``allowed``, and a key or value dtype
  other than the query's."""
  if q_dtype not in allowed:
    raise ValueError(
      f"query: unsupported dtype {_dtype_name(q_dtype)}; expected one of "
      f"{[_dtype_name(d) for d in allowed]}"
    )
  if k_dtype != q_dtype:
    raise ValueError(
      f"key: dtype {_dtype_name(k_dtype)} differs from query dtype "
      f"{_dtype_name(q_dtype)}"
    )
  if v_dtype != q_dtype:
    raise ValueError(
      f"value: dtype {_dtype_name(v_dtype)} differs from query dtype "
      f"{_dtype_name(q_dtype)}"
    )


def _qkv_shapes(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                v_shape: tuple[int, ...]) -> AttentionShapes:
  """The sizes rank-4 query, key and value imply, refused where they
  disagree (batch, head dim, key length, heads, GQA groups)."""
  B, T, N, H = q_shape
  kB, S, K, kH = k_shape
  vB, vS, vK, Hv = v_shape

  if kB != B:
    raise ValueError(f"key: batch {kB} differs from query batch {B}")
  if kH != H:
    raise ValueError(f"key: head dim {kH} differs from query head dim {H}")
  if vB != B:
    raise ValueError(f"value: batch {vB} differs from query batch {B}")
  if vS != S:
    raise ValueError(f"value: sequence length {vS} differs from key sequence length {S}")
  if vK != K:
    raise ValueError(f"value: {vK} heads differ from key's {K} heads")
  if N % K != 0:
    raise ValueError(
      f"key: {K} key/value heads must divide the {N} query heads (GQA)"
    )

  return AttentionShapes(B=B, T=T, N=N, H=H, S=S, K=K, Hv=Hv)


def _check_scalars(scale: Any, logits_soft_cap: Any, rescale_threshold: Any) -> None:
  """Refuse a scale that is not a finite real, a soft cap that is not a
  finite real > 0 and a threshold outside [0, 1]."""
  if scale is not None:
    value_ = _check_scalar("scale", scale)
    if not math.isfinite(value_):
      raise ValueError(f"scale: must be finite, got {value_}")

  if logits_soft_cap is not None:
    cap = _check_scalar("logits_soft_cap", logits_soft_cap)
    if not (math.isfinite(cap) and cap > 0):
      raise ValueError(
        f"logits_soft_cap: must be None or a finite value > 0, got {cap}"
      )

  if rescale_threshold is not None:
    thr = _check_scalar("rescale_threshold", rescale_threshold)
    if not (0.0 <= thr <= 1.0):
      raise ValueError(
        f"rescale_threshold: must be None or in [0, 1], got {thr}"
      )


# ---------------------------------------------------------------------------
# The arguments of jax.nn.dot_product_attention that this API maps onto key
# ranges and masks (kernel/key_ranges.py), and packed-sequence segment ids.

SEGMENT_LAYOUTS = ("contiguous", "any")


def _check_int_array(name: str, x: Any, shape: tuple[int, ...], letters: str) -> None:
  x_shape, x_dtype = _shape_and_dtype(x)
  if not np.issubdtype(x_dtype, np.integer) or x_dtype == np.dtype(bool):
    raise ValueError(f"{name}: expected an integer dtype, got {_dtype_name(x_dtype)}")
  if x_shape != shape:
    raise ValueError(f"{name}: expected shape {letters} = {shape}, got {x_shape}")


def _window_int(value: Any) -> int | None:
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, (int, np.integer)):
    return int(value)
  return None


def normalize_window(local_window_size: Any) -> tuple[int, int] | None:
  """``local_window_size`` as jax.nn.dot_product_attention reads it: None,
  an int w meaning (w, w), or a pair (left, right) of ints.  Python or NumPy
  integers only (the window shapes the kernel's block range, so it is
  static), each at least 0: a negative side shuts out the diagonal, and
  a negative int every key of every row, which jax.nn accepts silently."""
  if local_window_size is None:
    return None
  single = _window_int(local_window_size)
  pair = None
  if single is not None:
    pair = single, single
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    pair = tuple(_window_int(w) for w in local_window_size)
  if pair is not None and None not in pair:
    if min(pair) < 0:
      raise ValueError(
        f"local_window_size: each side must be >= 0 (a negative side sees not even the "
        f"diagonal), got {local_window_size!r}")
    return pair
  raise ValueError(
    "local_window_size: expected None, an int or a pair (left, right) of ints, "
    f"got {local_window_size!r}")


def normalize_chunk(attention_chunk: Any) -> int | None:
  """``attention_chunk`` (FlashAttention-3's chunked attention): None, or
  a Python or NumPy int C >= 1, the chunk of positions a row sees (static:
  it shapes the kernel's block range, as the window does)."""
  if attention_chunk is None:
    return None
  chunk = _window_int(attention_chunk)
  if chunk is None or chunk < 1:
    raise ValueError(f"attention_chunk: expected None or an int >= 1 (positions per chunk), "
                     f"got {attention_chunk!r}")
  return chunk


# jax.nn's window and FlashAttention-3's chunk shape the kernel's block
# range, so they reach it as Python ints; lengths and segment ids are arrays.
STATIC_VARIANTS = ("local_window_size", "attention_chunk")


def api_variants(variants: dict[str, Any]) -> dict[str, Any]:
  """``variants`` (a :attr:`Call.variants`) as the API takes them: the
  static ones as they are, the others as JAX arrays."""
  import jax.numpy as jnp
  return {n: x if n in STATIC_VARIANTS else jnp.asarray(x) for n, x in variants.items()}


def validate_variant_args(
  shapes: AttentionShapes,
  *,
  query_seq_lengths: Any = None,
  key_value_seq_lengths: Any = None,
  local_window_size: int | tuple[int, int] | None = None,
  q_segment_ids: Any = None,
  kv_segment_ids: Any = None,
) -> tuple[int, int] | None:
  """Check the sequence-length, window and segment arguments of a call whose
  sizes are ``shapes``; return the window as (left, right) or None.

  query_seq_lengths, key_value_seq_lengths: integer (B,); q_segment_ids
  integer (B, T) and kv_segment_ids integer (B, S), both or neither.
  Lengths of any value are meaningful (below 0: nothing; past the end:
  everything), as in jax.nn.dot_product_attention.
  """
  B, T, S = shapes.B, shapes.T, shapes.S
  if query_seq_lengths is not None:
    _check_int_array("query_seq_lengths", query_seq_lengths, (B,), "(B,)")
  if key_value_seq_lengths is not None:
    _check_int_array("key_value_seq_lengths", key_value_seq_lengths, (B,), "(B,)")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
    other = "q_segment_ids" if missing == "kv_segment_ids" else "kv_segment_ids"
    raise ValueError(f"{missing}: required when {other} is given")
  if q_segment_ids is not None:
    _check_int_array("q_segment_ids", q_segment_ids, (B, T), "(B, T)")
    _check_int_array("kv_segment_ids", kv_segment_ids, (B, S), "(B, S)")
  return normalize_window(local_window_size)


@dataclasses.dataclass(frozen=True)
class _Shaped:
  """An array's shape and dtype, standing in for it where nothing else is read."""

  shape: tuple[int, ...]
  dtype: np.dtype


def _concrete(x: Any) -> np.ndarray | None:
  """``x``'s values where they are known now (NumPy, Python and concrete JAX
  values), None where only its shape is (a tracer, a ShapeDtypeStruct)."""
  try:
    return np.asarray(x, dtype=np.float64)
  except Exception:  # noqa: BLE001 -- whatever refuses to give values gives none
    return None


def validate_fp8_args(shapes: AttentionShapes, dtype: np.dtype, descales: dict[str, Any],
                      out_dtype: Any) -> str | None:
  """Check the FP8 arguments of a call whose query dtype is ``dtype``;
  return how its descales are laid out: None (no FP8), "tensor" (all three
  per tensor) or "head" (some per (batch, kv head); the others broadcast).

  ``descales``: {"q_descale": ..., "k_descale": ..., "v_descale": ...}, each
  the float32 factor that turns the stored 8-bit values into real ones,
  shape () or (B, K), finite and > 0 (checked where the values are known:
  under ``jax.jit`` a non-finite one makes the outputs NaN).  ``out_dtype``
  None (bfloat16) or one of :data:`FP8_OUT_DTYPES`.  A call in another dtype
  takes none of them."""
  dtype = np.dtype(dtype)
  if dtype not in FP8_DTYPES:
    for name in DESCALES:
      if descales[name] is not None:
        raise ValueError(f"{name}: descales go with {_dtype_name(float8_e4m3fn)} query, key "
                         f"and value; the query is {_dtype_name(dtype)}")
    if out_dtype is not None:
      raise ValueError(f"out_dtype: only {_dtype_name(float8_e4m3fn)} inputs take an output "
                       f"dtype; {_dtype_name(dtype)} inputs return {_dtype_name(dtype)}")
    return None
  per_head = (shapes.B, shapes.K)
  layouts = []
  for name in DESCALES:
    x = descales[name]
    if x is None:
      raise ValueError(f"{name}: required with {_dtype_name(dtype)} query, key and value: the "
                       f"float32 factor that turns the stored values into real ones, of shape "
                       f"() (per tensor) or (B, K) = {per_head} (per batch and kv head)")
    if isinstance(x, (bool, np.bool_)):
      raise ValueError(f"{name}: expected a float32 scalar or array, got {x!r}")
    if isinstance(x, (int, float)):
      shape, got = (), float32
    else:
      shape, got = _shape_and_dtype(x)
    if got != float32:
      raise ValueError(f"{name}: expected float32, got {_dtype_name(got)}")
    if shape not in ((), per_head):
      raise ValueError(f"{name}: expected shape () (per tensor) or (B, K) = {per_head} (per "
                       f"batch and kv head), got {shape}")
    values = _concrete(x)
    if values is not None and not (np.isfinite(values).all() and (values > 0).all()):
      bad = values[~(np.isfinite(values) & (values > 0))].ravel()[0]
      raise ValueError(f"{name}: must be finite and > 0, got {bad}")
    layouts.append(shape)
  if out_dtype is not None:
    try:
      out = np.dtype(out_dtype)
    except TypeError:
      out = None
    if out not in FP8_OUT_DTYPES:
      raise ValueError(f"out_dtype: expected None or one of "
                       f"{[_dtype_name(d) for d in FP8_OUT_DTYPES]}, got {out_dtype!r}")
  return "tensor" if all(s == () for s in layouts) else "head"


def _check_flag(name: str, flag: Any) -> None:
  if not isinstance(flag, (bool, np.bool_)):
    raise ValueError(f"{name}: expected a bool, got {flag!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """One call of ``dot_product_attention``: its arrays and static arguments,
  with jax.nn's meaning and defaults, validated when the record is made.

  ``dtypes``: the input dtypes accepted (:data:`EVERY_DTYPE`, which the
  float64 reference and the NumPy model take; the API asks for the
  kernel's, :data:`DEFAULT_ALLOWED_DTYPES`).
  Derived: ``shapes`` (:class:`AttentionShapes`), ``window``
  (``local_window_size`` as (left, right), or None) and ``descales`` (how
  an FP8 call's descales are laid out, :func:`validate_fp8_args`).

  FP8 (``float8_e4m3fn`` query, key and value): the real inputs are the
  stored values times ``q_descale``, ``k_descale`` and ``v_descale``
  (float32, per tensor or per (batch, kv head)); the output is
  ``out_dtype`` (bfloat16 by default).
  """

  query: Any
  key: Any
  value: Any
  bias: Any = None
  mask: Any = None
  scale: Any = None
  is_causal: bool = False
  k_start: Any = None
  k_end: Any = None
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  local_window_size: Any = None
  attention_chunk: Any = None
  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  segment_layout: str = "contiguous"
  logits_soft_cap: Any = None
  rescale_threshold: Any = 1.0
  normalize_output: bool = True
  return_residuals: bool = False
  return_residual: bool = False
  implementation: Any = None
  q_descale: Any = None
  k_descale: Any = None
  v_descale: Any = None
  out_dtype: Any = None
  dtypes: tuple = dataclasses.field(default=EVERY_DTYPE, repr=False)
  shapes: AttentionShapes = dataclasses.field(init=False, repr=False)
  window: tuple[int, int] | None = dataclasses.field(init=False, repr=False)
  descales: str | None = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    shapes = validate_attention_args(
      self.query, self.key, self.value, self.bias, self.mask, scale=self.scale,
      k_start=self.k_start, k_end=self.k_end, logits_soft_cap=self.logits_soft_cap,
      rescale_threshold=self.rescale_threshold, allowed_dtypes=self.dtypes)
    window = validate_variant_args(
      shapes, query_seq_lengths=self.query_seq_lengths,
      key_value_seq_lengths=self.key_value_seq_lengths,
      local_window_size=self.local_window_size, q_segment_ids=self.q_segment_ids,
      kv_segment_ids=self.kv_segment_ids)
    if self.implementation is not None:
      raise ValueError(
        f"implementation: this kernel is its own implementation; expected None, got "
        f"{self.implementation!r} (call jax.nn.dot_product_attention for 'xla' or 'cudnn')")
    if self.segment_layout not in SEGMENT_LAYOUTS:
      raise ValueError(f"segment_layout: expected one of {list(SEGMENT_LAYOUTS)}, "
                       f"got {self.segment_layout!r}")
    for name in ("return_residual", "return_residuals", "is_causal", "normalize_output"):
      _check_flag(name, getattr(self, name))
    descales = validate_fp8_args(shapes, _shape_and_dtype(self.query)[1],
                                 {n: getattr(self, n) for n in DESCALES}, self.out_dtype)
    object.__setattr__(self, "shapes", shapes)
    object.__setattr__(self, "window", window)
    object.__setattr__(self, "attention_chunk", normalize_chunk(self.attention_chunk))
    object.__setattr__(self, "descales", descales)

  @property
  def fp8(self) -> bool:
    """float8_e4m3fn inputs, with their descales."""
    return np.dtype(self.query.dtype) in FP8_DTYPES

  @property
  def result_dtype(self) -> np.dtype:
    """The output's dtype: ``out_dtype`` (bfloat16 by default) for FP8
    inputs, else the inputs' own (float32 inputs are computed in bfloat16
    and returned in float32)."""
    if not self.fp8:
      return np.dtype(self.query.dtype)
    return np.dtype(self.out_dtype) if self.out_dtype is not None else FP8_OUT_DTYPES[0]

  @property
  def arrays(self) -> tuple:
    """(query, key, value, bias, mask), as the kernels and references take them."""
    return self.query, self.key, self.value, self.bias, self.mask

  @property
  def variants(self) -> dict[str, Any]:
    """jax.nn's lengths and window, the chunk and the segment ids, that are set."""
    names = ("query_seq_lengths", "key_value_seq_lengths", "local_window_size",
             "attention_chunk", "q_segment_ids", "kv_segment_ids")
    return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

  def describe(self) -> str:
    """One line naming the call's shapes and arguments (for notes and errors)."""
    parts = [f"q{tuple(self.query.shape)} k{tuple(self.key.shape)} "
             f"v{tuple(self.value.shape)} {np.dtype(self.query.dtype)}"]
    for name in ("bias", "mask", "k_start", "k_end"):
      x = getattr(self, name)
      if x is not None:
        parts.append(f"{name}{tuple(np.shape(x))}")
    parts.append(f"scale={self.scale} causal={self.is_causal} cap={self.logits_soft_cap} "
                 f"threshold={self.rescale_threshold} normalize={self.normalize_output}")
    for name, x in self.variants.items():
      parts.append(f"{name}={x if np.ndim(x) < 1 or np.size(x) <= 8 else np.shape(x)}")
    if self.q_segment_ids is not None:
      parts.append(f"segment_layout={self.segment_layout}")
    if self.fp8:
      for name in DESCALES:
        x = getattr(self, name)
        parts.append(f"{name}={x if np.size(x) <= 4 else np.shape(x)}")
      parts.append(f"out_dtype={_dtype_name(self.result_dtype)}")
    return " ".join(parts)

  def replace(self, **changes) -> "Call":
    """This call with ``changes``, validated again."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    return Call(**{**fields, **changes})

  @classmethod
  def of_shapes(cls, shapes: AttentionShapes, dtype: Any = bfloat16, **kwargs) -> "Call":
    """A call of these sizes whose query, key and value are placeholders
    (only their shapes and dtype are read): for the readers of its masks and
    ranges alone (harness.numerics.reference.key_visibility)."""
    sh = shapes
    placeholder = lambda *shape: _Shaped(shape, np.dtype(dtype))
    return cls(placeholder(sh.B, sh.T, sh.N, sh.H), placeholder(sh.B, sh.S, sh.K, sh.H),
               placeholder(sh.B, sh.S, sh.K, sh.Hv), **kwargs)

  @classmethod
  def of(cls, *args, **kwargs) -> "Call":
    """``args[0]`` where it is already a Call, else the Call of these
    arguments: what every reader of a call takes."""
    if len(args) == 1 and isinstance(args[0], Call):
      if kwargs:
        raise TypeError(f"a Call and arguments {sorted(kwargs)}: pass one or the other")
      return args[0]
    return cls(*args, **kwargs)
