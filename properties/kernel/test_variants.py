"""jax.nn.dot_product_attention's arguments and packed segments, on the CPU.

* The API takes every argument of jax.nn.dot_product_attention with its
  default, and a table of jax.nn calls is accepted alike (jax.nn runs them on
  the CPU, ours lowers them for CUDA) with the same output shapes.
* The float64 reference's lengths, windows and causal mask agree with
  jax.nn's XLA implementation in float32; its segments with a dense mask
  (and with jax.nn given that mask).
* The kernel-side mapping (kernel/key_ranges.py: per-row key ranges, the
  "any" layout's mask, the rows it poisons) sees exactly the keys the
  reference's elementwise definition does.
* Malformed lengths, windows, segment ids and flags raise a ValueError
  naming the argument, in the reference and in the API.
* Block skipping: the key blocks each query tile of the forward (and the
  dQ kernel) visits under a window or packed segments are exactly those
  holding a key one of its rows sees.
"""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.numerics import reference as ref_lib
from harness.numerics import strategies as hs
from kernel import api, key_ranges as variants
from kernel.call import AttentionShapes, Call, validate_attention_args
from kernel.masks import Mask

# ---------------------------------------------------------------------------
# The signature.


def test_every_jax_nn_argument_is_accepted_with_its_default():
  ours = inspect.signature(api.dot_product_attention).parameters
  theirs = inspect.signature(jax.nn.dot_product_attention).parameters
  for name, p in theirs.items():
    assert name in ours, f"{name}: missing"
    assert ours[name].kind == p.kind, f"{name}: {ours[name].kind} vs {p.kind}"
    assert ours[name].default == p.default, f"{name}: default {ours[name].default!r}"
  # Positional order of the positional parameters is the same too.
  positional = lambda ps: [n for n, p in ps.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
  assert positional(ours) == positional(theirs)


B, T, N, H, S, K = 2, 96, 4, 64, 160, 2


def _arrays(seed=0):
  rng = np.random.default_rng(seed)
  bf = jnp.bfloat16
  return (jnp.asarray(rng.standard_normal((B, T, N, H)), bf),
          jnp.asarray(rng.standard_normal((B, S, K, H)), bf),
          jnp.asarray(rng.standard_normal((B, S, K, H)), bf))


_LEN_Q = np.array([70, 0], np.int32)
_LEN_KV = np.array([160, 33], np.int32)
# jax.nn's keyword arguments, alone and combined.
SIGNATURES = {
    "plain": dict(),
    "scale": dict(scale=0.3),
    "causal": dict(is_causal=True),
    "bias": dict(bias=np.zeros((1, N, T, S), np.float32)),
    "mask": dict(mask=np.tri(T, S, dtype=bool)[None, None]),
    "query_seq_lengths": dict(query_seq_lengths=_LEN_Q),
    "key_value_seq_lengths": dict(key_value_seq_lengths=_LEN_KV),
    "window-int": dict(local_window_size=16),
    "window-pair": dict(local_window_size=(32, 0)),
    "implementation-none": dict(implementation=None),
    "return_residual": dict(return_residual=True),
    "all": dict(scale=0.2, is_causal=True, mask=np.ones((B, 1, T, S), bool),
                query_seq_lengths=_LEN_Q, key_value_seq_lengths=_LEN_KV,
                local_window_size=(24, 8), implementation=None, return_residual=True),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_a_jax_nn_call_is_accepted_alike(name):
  """jax.nn.dot_product_attention (XLA, CPU) runs the call; ours, given the
  same keyword arguments, lowers for CUDA and returns the same shapes."""
  kw = dict(SIGNATURES[name])
  q, k, v = _arrays()
  theirs = jax.nn.dot_product_attention(q, k, v, **kw)
  bias, mask = kw.pop("bias", None), kw.pop("mask", None)
  with api.lowering_only():
    exported = jax.export.export(
        jax.jit(lambda q, k, v: api.dot_product_attention(q, k, v, bias, mask, **kw)),
        platforms=["cuda"])(q, k, v)
  theirs_shapes = [tuple(x.shape) for x in jax.tree.leaves(theirs)]
  assert [tuple(a.shape) for a in exported.out_avals] == theirs_shapes
  assert exported.out_avals[0].dtype == jnp.bfloat16


def test_other_implementations_are_refused_by_name():
  q, k, v = _arrays()
  for impl in ("xla", "cudnn"):
    with pytest.raises(ValueError, match="^implementation: "):
      api.dot_product_attention(q, k, v, implementation=impl)


def test_without_the_new_arguments_the_call_is_unchanged():
  """Without lengths, window or segments, the kernel gets the call's own
  mask and key ranges, untouched (the same objects)."""
  q, k, v = _arrays()
  mask, ks, ke = np.ones((1, 1, T, S), bool), np.zeros((B, N, T), np.int32), None
  routed = variants.route(Call(q, k, v, None, mask, k_start=ks, k_end=ke))
  assert routed.mask is mask and routed.k_start is ks and routed.k_end is None
  assert routed.poisoned is None and not routed.kernel_residuals


def test_packed_segments_lower_forward_and_backward():
  """The segment routes (key ranges; "any": mask) lower with their backward."""
  q, k, v = _arrays()
  qs = np.repeat(np.arange(3), [40, 1, 55])[None].repeat(B, 0).astype(np.int32)
  kvs = np.repeat(np.arange(3), [60, 1, 99])[None].repeat(B, 0).astype(np.int32)
  for layout in ("contiguous", "any"):
    def loss(q, k, v):
      out = api.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=qs,
                                      kv_segment_ids=kvs, segment_layout=layout,
                                      local_window_size=(50, 0))
      return jnp.sum(out.astype(jnp.float32))
    with api.lowering_only():
      exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                   platforms=["cuda"])(q, k, v)
    assert len(exported.out_avals) == 3


@pytest.mark.parametrize("is_causal", [True, False])
def test_chunked_attention_lowers_forward_and_backward(is_causal):
  """attention_chunk (FlashAttention-3's chunked attention) becomes key
  ranges known when tracing: the forward and its gradients lower for CUDA
  at a length no multiple of the chunk or a block, with grouped kv heads."""
  q, k, v = _arrays()

  def loss(q, k, v):
    out = api.dot_product_attention(q, k, v, is_causal=is_causal, attention_chunk=40)
    return jnp.sum(out.astype(jnp.float32))
  with api.lowering_only():
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                 platforms=["cuda"])(q, k, v)
  assert [tuple(a.shape) for a in exported.out_avals] == [q.shape, k.shape, v.shape]
  routed = variants.route(Call(q, k, v, is_causal=is_causal, attention_chunk=40))
  assert routed.static_ranges and routed.chunk == 40
  rows = np.arange(T)
  np.testing.assert_array_equal(np.asarray(routed.k_start)[0, 0], rows // 40 * 40)


# ---------------------------------------------------------------------------
# The reference against jax.nn's XLA implementation.

# A few fixed shapes (ragged, GQA, T < S and T > S), so that jax.nn's
# compiled programs are reused across examples.
_small_shapes = st.sampled_from((
    AttentionShapes(B=2, T=37, N=2, H=16, S=37, K=1, Hv=16),
    AttentionShapes(B=1, T=13, N=4, H=8, S=45, K=2, Hv=8),
    AttentionShapes(B=2, T=40, N=2, H=8, S=7, K=2, Hv=8)))


@functools.partial(jax.jit, static_argnames=("is_causal", "local_window_size", "has_mask"))
def _jax_nn(q, k, v, mask, query_seq_lengths, key_value_seq_lengths, *, is_causal,
            local_window_size, has_mask):
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask if has_mask else None, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, implementation="xla", return_residual=True)


def _f32(shapes: AttentionShapes, seed: int):
  rng = np.random.default_rng(seed)
  sh = shapes
  return (rng.standard_normal((sh.B, sh.T, sh.N, sh.H)).astype(np.float32),
          rng.standard_normal((sh.B, sh.S, sh.K, sh.H)).astype(np.float32),
          rng.standard_normal((sh.B, sh.S, sh.K, sh.H)).astype(np.float32))


@settings(max_examples=20)
@given(shapes=_small_shapes, causal=st.booleans(), seed=st.integers(0, 2**16),
       data=st.data())
def test_reference_lengths_and_windows_match_jax_nn(shapes, causal, seed, data):
  """Output and log-sum-exp of the float64 reference equal jax.nn's XLA
  path in float32 (chunks given to it as a dense mask) (to float32 rounding) on every row that sees a key; padded
  query rows are 0 in both.  (A row that sees no key for another reason is
  0 here by contract, a mean of values in jax.nn: not compared.)"""
  spec = data.draw(hs.variant_specs(shapes, segments=False), label="variants")
  kw = spec.build()
  q, k, v = _f32(shapes, seed)
  ref = ref_lib.attention_reference(q, k, v, is_causal=causal, **kw)
  # jax.nn has no chunked attention: its chunks as a dense mask
  chunk = kw.get("attention_chunk")
  rows, keys = np.arange(shapes.T)[:, None], np.arange(shapes.S)[None, :]
  mask = None if chunk is None else (rows // chunk == keys // chunk)[None, None]
  out, lse = _jax_nn(q, k, v, mask, kw.get("query_seq_lengths"),
                     kw.get("key_value_seq_lengths"), is_causal=causal,
                     local_window_size=kw.get("local_window_size"), has_mask=mask is not None)
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  live = ~np.transpose(ref.fully_masked, (0, 2, 1))  # (B, T, N)
  note(f"{shapes} causal={causal} {spec} live rows {live.sum()}")
  np.testing.assert_allclose(out[live], ref.out[live], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(lse[live], np.transpose(ref.lse, (0, 2, 1))[live],
                             atol=2e-5, rtol=1e-5)
  if "query_seq_lengths" in kw:
    padded = np.arange(shapes.T)[None, :] >= kw["query_seq_lengths"][:, None]
    assert np.all(out[padded] == 0) and np.all(ref.out[padded] == 0)


@settings(max_examples=20)
@given(shapes=_small_shapes, causal=st.booleans(), seed=st.integers(0, 2**16),
       contiguous=st.booleans(), data=st.data())
def test_reference_segments_are_the_dense_equality_mask(shapes, causal, seed, contiguous,
                                                        data):
  """Segment ids in the reference mean mask[b, i, j] = (q_ids[b, i] ==
  kv_ids[b, j]): the same visibility and bits as that mask, and jax.nn given
  that mask agrees on the rows that see a key."""
  seg = data.draw(hs.segment_specs(shapes.B, shapes.T, shapes.S, contiguous=contiguous))
  q_ids, kv_ids = seg.build()
  dense = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  q, k, v = _f32(shapes, seed)
  by_ids = ref_lib.attention_reference(q, k, v, is_causal=causal, q_segment_ids=q_ids,
                                       kv_segment_ids=kv_ids)
  by_mask = ref_lib.attention_reference(q, k, v, mask=dense, is_causal=causal)
  assert np.array_equal(by_ids.visible, by_mask.visible)
  assert np.array_equal(by_ids.out, by_mask.out)
  out = np.asarray(_jax_nn(q, k, v, dense, None, None, is_causal=causal,
                          local_window_size=None, has_mask=True)[0], np.float64)
  live = ~np.transpose(by_ids.fully_masked, (0, 2, 1))
  np.testing.assert_allclose(out[live], by_ids.out[live], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# The kernel-side mapping against the definition.


def _seen_by_route(shapes: AttentionShapes, routed) -> np.ndarray:
  """(B, N, T, S) bool: the keys the kernel lets row i see from what
  route() hands it (key ranges and mask; causal is the kernel's own)."""
  return ref_lib.key_visibility(Call.of_shapes(
      shapes, mask=None if routed.mask is None else np.asarray(routed.mask),
      k_start=None if routed.k_start is None else np.asarray(routed.k_start),
      k_end=None if routed.k_end is None else np.asarray(routed.k_end)))


@st.composite
def _mapping_cases(draw, segments_only=False):
  shapes = draw(st.sampled_from((
      AttentionShapes(B=2, T=37, N=2, H=8, S=37, K=1, Hv=8),
      AttentionShapes(B=1, T=20, N=1, H=8, S=53, K=1, Hv=8),
      AttentionShapes(B=2, T=64, N=2, H=8, S=16, K=2, Hv=8))))
  layout = draw(st.sampled_from(("contiguous", "any")))
  spec = draw(hs.variant_specs(shapes, layout=layout, contiguous_ids=draw(st.booleans()),
                               lengths=not segments_only, windows=not segments_only))
  user = None if segments_only else draw(st.one_of(st.none(), hs.key_range_specs(shapes)))
  return shapes, spec, user


def _qkv(shapes):
  sds = jax.ShapeDtypeStruct
  sh = shapes
  return (sds((sh.B, sh.T, sh.N, sh.H), jnp.bfloat16), sds((sh.B, sh.S, sh.K, sh.H), jnp.bfloat16),
          sds((sh.B, sh.S, sh.K, sh.Hv), jnp.bfloat16))


@settings(max_examples=30)
@given(case=st.one_of(_mapping_cases(), _mapping_cases(segments_only=True)))
def test_key_ranges_see_exactly_the_keys_of_the_definition(case):
  """Per row, the keys kernel/key_ranges.py lets through (key ranges combined
  with the user's, plus the "any" layout's mask) are exactly the keys the
  reference's elementwise definition lets through, on every row the
  contiguous layout does not poison; a poisoned row is one whose allowed
  keys are not one run of the key ids; and the "any" layout's ranges contain every
  allowed key (its block skipping is sound)."""
  shapes, spec, user = case
  kw = spec.build()
  ks, ke = (None, None) if user is None else user.build()
  note(f"{shapes} {spec} user={user}")
  routed = variants.route(Call(*_qkv(shapes), None, None, k_start=ks, k_end=ke,
                               segment_layout=spec.segment_layout, **kw))
  want = ref_lib.key_visibility(Call.of_shapes(shapes, k_start=ks, k_end=ke, **kw))
  got = _seen_by_route(shapes, routed)
  poisoned = (np.zeros((shapes.B, shapes.T), bool) if routed.poisoned is None
              else np.asarray(routed.poisoned))
  rows = np.broadcast_to(poisoned[:, None, :], want.shape[:3])
  assert np.array_equal(got[~rows], want[~rows])
  # Poisoned: exactly the rows whose id's keys are not one run (a hole in
  # their hull), and only in the contiguous layout.
  holes = np.zeros_like(poisoned)
  if spec.segments is not None and spec.segment_layout == "contiguous":
    q_ids, kv_ids = spec.segments.build()
    for b, i in np.ndindex(*holes.shape):
      where = np.nonzero(kv_ids[b] == q_ids[b, i])[0]
      holes[b, i] = where.size > 0 and where[-1] - where[0] + 1 > where.size
  assert np.array_equal(poisoned, holes)
  if spec.segment_layout == "any" and routed.k_start is not None:
    hull = ref_lib.key_visibility(Call.of_shapes(shapes, k_start=np.asarray(routed.k_start),
                                                 k_end=np.asarray(routed.k_end)))
    assert not (want & ~hull).any()


@settings(max_examples=15)
@given(data=st.data(), B=st.integers(1, 3), S=st.integers(1, 40),
       contiguous=st.booleans())
def test_segments_are_contiguous_says_whether_each_id_is_one_run(data, B, S, contiguous):
  seg = data.draw(hs.segment_specs(B, 1, S, contiguous=contiguous))
  _, kv_ids = seg.build()
  want = [all(np.ptp(np.nonzero(row == i)[0]) + 1 == np.sum(row == i) for i in np.unique(row))
          for row in kv_ids]
  assert list(np.asarray(variants.segments_are_contiguous(kv_ids))) == want


@st.composite
def _packed_ids(draw, B: int, S: int):
  """Key ids of packed documents, per row: rising runs (the test of
  variants.runs_are_ids passes), with a trailing padding run of an id none
  before it has (passes), of an id an earlier run has (fails), or ids that
  fall somewhere (fails), or any small ints (either)."""
  rows = []
  for _ in range(B):
    kind = draw(st.sampled_from(["rising", "padded", "reused", "falling", "any"]))
    if kind == "any":
      rows.append(draw(st.lists(st.integers(-2, 3), min_size=S, max_size=S)))
      continue
    cuts = sorted(draw(st.sets(st.integers(1, S - 1), max_size=6))) if S > 1 else []
    lengths = np.diff([0, *cuts, S]).tolist()
    ids = np.cumsum([draw(st.integers(1, 3)) for _ in lengths]).tolist()
    if kind == "padded":
      ids[-1] = draw(st.sampled_from([0, -1, ids[-1] + 7]))
    elif kind == "reused" and len(ids) > 1:
      ids[-1] = ids[0]
    elif kind == "falling" and len(ids) > 2:
      ids[1], ids[2] = ids[2], ids[1]
    rows.append([i for i, n in zip(ids, lengths) for _ in range(n)])
  return np.array(rows, np.int32)


# Jitted, one compile per shape (a few shapes drawn): eagerly, each example
# dispatched every small op anew (72 s for 200 examples).
_bounds = jax.jit(variants.segment_bounds, static_argnums=2)


@settings(max_examples=hs.examples(50), deadline=None)
@given(data=st.data(), B=st.integers(1, 2), S=st.sampled_from([1, 2, 5, 16, 37, 60]))
def test_the_sort_free_bounds_are_the_searched_ones(data, B, S):
  """segment_bounds(..., "runs") gives the searched arrays exactly (start,
  end and whether the id is one run), whichever branch its test takes; and
  the test never takes the sort-free branch where an id has two runs."""
  kv = data.draw(_packed_ids(B, S), label="kv_ids")
  q = kv.copy() if data.draw(st.booleans(), label="q equal") else data.draw(
      _packed_ids(B, S), label="q_ids")
  want = _bounds(q, kv, "searched")
  got = _bounds(q, kv, "runs")
  for name, w, g in zip(("start", "end", "single_run"), want, got):
    assert np.array_equal(np.asarray(w), np.asarray(g)), name
  if bool(variants.runs_are_ids(kv)):
    assert np.asarray(variants.segments_are_contiguous(kv)).all()


def test_the_run_test_refuses_a_trailing_run_of_an_earlier_id():
  """Ids 1 1 2 1: rising up to the last run, whose id the first run has.
  Served by its run alone, the last row would see keys 3..4, not 0..4 with
  a hole (which poisons it): the test must send it to the search."""
  kv = np.array([[1, 1, 2, 1]], np.int32)
  assert not bool(variants.runs_are_ids(kv))
  assert bool(variants.runs_are_ids(np.array([[1, 1, 2, 0]], np.int32)))
  start, end, single = (np.asarray(x) for x in variants.segment_bounds(kv, kv, "runs"))
  assert start[0, 3] == 0 and end[0, 3] == 4 and not single[0, 3]


# ---------------------------------------------------------------------------
# Malformed calls.

_BASE_SHAPES = AttentionShapes(B=2, T=8, N=2, H=64, S=16, K=1, Hv=64)
BAD = [
    ("query_seq_lengths", dict(query_seq_lengths=np.zeros((2,), np.float32))),
    ("query_seq_lengths", dict(query_seq_lengths=np.zeros((3,), np.int32))),
    ("query_seq_lengths", dict(query_seq_lengths=np.zeros((2, 1), np.int32))),
    ("key_value_seq_lengths", dict(key_value_seq_lengths=np.zeros((2,), bool))),
    ("key_value_seq_lengths", dict(key_value_seq_lengths=np.int32(4))),
    ("local_window_size", dict(local_window_size=2.5)),
    ("local_window_size", dict(local_window_size=True)),
    ("local_window_size", dict(local_window_size=(1, 2, 3))),
    ("local_window_size", dict(local_window_size=(1, None))),
    ("local_window_size", dict(local_window_size=-3)),
    ("local_window_size", dict(local_window_size=(4, -2))),
    ("local_window_size", dict(local_window_size=(-1, 4))),
    ("local_window_size", dict(local_window_size=np.array([1, 2]))),
    ("attention_chunk", dict(attention_chunk=0)),
    ("attention_chunk", dict(attention_chunk=-64)),
    ("attention_chunk", dict(attention_chunk=2.5)),
    ("attention_chunk", dict(attention_chunk=True)),
    ("q_segment_ids", dict(q_segment_ids=np.zeros((2, 9), np.int32),
                           kv_segment_ids=np.zeros((2, 16), np.int32))),
    ("kv_segment_ids", dict(q_segment_ids=np.zeros((2, 8), np.int32),
                            kv_segment_ids=np.zeros((2, 16), np.float32))),
    ("kv_segment_ids", dict(q_segment_ids=np.zeros((2, 8), np.int32))),
    ("q_segment_ids", dict(kv_segment_ids=np.zeros((2, 16), np.int32))),
]
API_ONLY_BAD = [
    ("segment_layout", dict(segment_layout="sorted")),
    ("return_residual", dict(return_residual=1)),
    ("implementation", dict(implementation="triton")),
]


def _bad_arrays():
  rng = np.random.default_rng(0)
  sh = _BASE_SHAPES
  return (rng.standard_normal((sh.B, sh.T, sh.N, sh.H)).astype(np.float32),
          rng.standard_normal((sh.B, sh.S, sh.K, sh.H)).astype(np.float32),
          rng.standard_normal((sh.B, sh.S, sh.K, sh.Hv)).astype(np.float32))


@pytest.mark.parametrize("argument,kw", BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD)])
def test_reference_and_api_refuse_malformed_variants(argument, kw):
  pattern = rf"^{re.escape(argument)}: "
  with pytest.raises(ValueError, match=pattern):
    ref_lib.attention_reference(*_bad_arrays(), **kw)
  with pytest.raises(ValueError, match=pattern), api.lowering_only():
    api.dot_product_attention(*_bad_arrays(), **kw)


@pytest.mark.parametrize("argument,kw", API_ONLY_BAD, ids=[a for a, _ in API_ONLY_BAD])
def test_api_refuses_malformed_options(argument, kw):
  with pytest.raises(ValueError, match=rf"^{re.escape(argument)}: "), api.lowering_only():
    api.dot_product_attention(*_bad_arrays(), **kw)


def test_validation_reads_shapes_only():
  """The well-formed variant arguments pass as ShapeDtypeStructs too."""
  shapes = validate_attention_args(*_bad_arrays())
  sds = jax.ShapeDtypeStruct
  from kernel.call import validate_variant_args
  assert validate_variant_args(
      shapes, query_seq_lengths=sds((2,), jnp.int32), key_value_seq_lengths=sds((2,), jnp.int8),
      local_window_size=np.int64(3), q_segment_ids=sds((2, 8), jnp.int32),
      kv_segment_ids=sds((2, 16), jnp.int16)) == (3, 3)


# ---------------------------------------------------------------------------
# Block skipping: the key blocks a query tile visits, from the ranges the
# variants become, are exactly the blocks that hold a key some row of the
# tile sees (read from the definitions, per row, without kernel/key_ranges.py).

_SKIP_BLOCK_Q, _SKIP_BLOCK_KV = 64, 128


def _visited_blocks(T, S, kw, *, is_causal):
  """Per query tile, [lb, ub) of the forward's key loop (kernel.masks.Mask's
  key_blocks on the tile bounds kernel.padding.key_ranges makes; the dQ
  kernel reads the same)."""
  from kernel import padding
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  routed = variants.route(Call(sds(1, T, 1, 64), sds(1, S, 1, 64), sds(1, S, 1, 64), **kw))
  tile = 2 * _SKIP_BLOCK_Q
  num_tiles = -(-T // tile)
  _, _, tiles = padding.key_ranges(routed.k_start, routed.k_end, seq_kv=S, tile=tile,
                                   num_tiles=num_tiles)
  start_min, _, _, end_max = (np.asarray(x)[0, 0] for x in tiles)
  return np.array([Mask(T, S, causal=is_causal).key_blocks(
      qi, tile_q=2 * _SKIP_BLOCK_Q, block_kv=_SKIP_BLOCK_KV, k_start_min=int(start_min[qi]),
      k_end_max=int(end_max[qi])) for qi in range(num_tiles)])


def _needed_blocks(T, S, row_keys):
  """Per query tile, the hull [lb, ub) of the blocks holding a key some of
  its rows see; ``row_keys(i)`` is row i's [first, last + 1), empty if
  first >= last + 1.  A tile whose rows see nothing needs no block."""
  tile = 2 * _SKIP_BLOCK_Q
  out = []
  for qi in range(-(-T // tile)):
    spans = [row_keys(i) for i in range(qi * tile, min((qi + 1) * tile, T))]
    spans = [(a, b) for a, b in spans if a < b]
    if not spans:
      out.append(None)
      continue
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    out.append((lo // _SKIP_BLOCK_KV, -(-hi // _SKIP_BLOCK_KV)))
  return out


def _assert_saves(visited, T, S, is_causal, factor):
  """``visited`` runs at most 1 / ``factor`` of the key blocks the same call
  over every key (lengths that cut nothing) runs."""
  whole = _visited_blocks(T, S, dict(query_seq_lengths=np.array([T], np.int32)),
                          is_causal=is_causal)
  work = lambda v: int(np.sum(v[:, 1] - v[:, 0]))
  assert factor * work(visited) <= work(whole), (work(visited), work(whole))


def _assert_skips_exactly(visited, needed, S):
  last = (S - 1) // _SKIP_BLOCK_KV
  for qi, (got, want) in enumerate(zip(visited.tolist(), needed)):
    if want is None:
      # Mask.key_blocks bounds the loop by the tile's least start and
      # greatest end apart: a tile whose rows all start past the last key,
      # inside the last (partial) block, still runs that block, all masked.
      assert got[1] - got[0] == 0 or got == [last, last + 1], (qi, got)
    else:
      assert tuple(got) == want, (qi, got, want)


@pytest.mark.parametrize("T,S,window,is_causal", [
    (16384, 16384, (1024, 0), True),
    (16384, 16384, 1024, False),
    (1000, 777, (100, 300), False),
])
def test_a_window_visits_only_the_blocks_its_rows_see(T, S, window, is_causal):
  """Windows skip blocks: a 1k window at 16k visits at most a quarter of the
  blocks the same call without it does (the precondition of issue 20's 4x)."""
  left, right = (window, window) if isinstance(window, int) else window

  def row_keys(i):
    hi = min(S - 1, i + right, i if is_causal else S - 1)
    return max(0, i - left), hi + 1

  visited = _visited_blocks(T, S, dict(local_window_size=window), is_causal=is_causal)
  _assert_skips_exactly(visited, _needed_blocks(T, S, row_keys), S)
  if T == 16384:
    _assert_saves(visited, T, S, is_causal, 4)


@pytest.mark.parametrize("T,S,chunk,is_causal", [
    (16384, 16384, 2048, True),
    (1000, 777, 300, False),
    (1000, 1000, 129, True),
])
def test_a_chunk_visits_only_the_blocks_its_rows_see(T, S, chunk, is_causal):
  """Chunked attention (attention_chunk): each tile visits only the blocks
  of the chunks its rows are in (up to the diagonal under causal); at 16k
  in chunks of 2k, causal, at most a sixth of the causal call's blocks."""

  def row_keys(i):
    first = i // chunk * chunk
    return first, min(S, first + chunk, i + 1 if is_causal else S)

  visited = _visited_blocks(T, S, dict(attention_chunk=chunk), is_causal=is_causal)
  _assert_skips_exactly(visited, _needed_blocks(T, S, row_keys), S)
  if T == 16384:
    _assert_saves(visited, T, S, is_causal, 6)


@pytest.mark.parametrize("T,docs,is_causal", [
    (16384, (1024, 4096, 2048, 3000, 1000, 4000, 1216), True),
    (16384, (1024, 4096, 2048, 3000, 1000, 4000, 1216), False),
    (1000, (300, 1, 450, 249), True),
])
def test_packed_segments_visit_only_their_documents_blocks(T, docs, is_causal):
  """Documents of 1k-4k packed into 16k (self-attention, ids in any order):
  each tile visits only the blocks of the documents its rows are in."""
  assert sum(docs) == T
  edges = np.concatenate([[0], np.cumsum(docs)])
  ids = np.repeat(np.random.default_rng(0).permutation(len(docs)), docs)[None].astype(np.int32)
  doc_of = np.repeat(np.arange(len(docs)), docs)

  def row_keys(i):
    first, end = int(edges[doc_of[i]]), int(edges[doc_of[i] + 1])
    return first, min(end, i + 1) if is_causal else end

  visited = _visited_blocks(T, T, dict(q_segment_ids=ids, kv_segment_ids=ids),
                            is_causal=is_causal)
  _assert_skips_exactly(visited, _needed_blocks(T, T, row_keys), T)


# ---------------------------------------------------------------------------
# The longest-first schedule weighs a windowed tile by the blocks it visits.


def _schedule(T, S, window, is_causal, *, heads=1):
  from kernel.forward import order as fwd_order
  from kernel.call import normalize_window
  tile = 2 * _SKIP_BLOCK_Q
  return fwd_order.tile_schedule(
      mask=Mask(T, S, causal=is_causal, window=normalize_window(window)), batch=1,
      num_heads=heads, num_kv_heads=heads, num_tiles=-(-T // tile),
      s_pad=-(-S // _SKIP_BLOCK_KV) * _SKIP_BLOCK_KV, head_dim=128, head_dim_out=128,
      itemsize=2, tile_q=tile, block_kv=_SKIP_BLOCK_KV)


@pytest.mark.parametrize("T,S,window,is_causal", [
    (16384, 16384, (1024, 0), True),
    (16384, 16384, 1024, False),
    (1000, 777, (100, 300), False),
    (1000, 1000, (3, 50), True),
])
def test_longest_first_weighs_window_tiles_by_the_blocks_they_visit(T, S, window, is_causal):
  """Each tile's weight is the length of the key loop the kernel runs for
  it under the window's key ranges."""
  order = _schedule(T, S, window, is_causal)
  weight = dict(zip((order.unpack(t)[2] for t in order.order.tolist()),
                    order.weight.tolist()))
  visited = _visited_blocks(T, S, dict(local_window_size=window), is_causal=is_causal)
  assert [weight[qi] for qi in range(len(visited))] == (visited[:, 1] - visited[:, 0]).tolist()


def test_longest_first_balances_a_causal_window():
  """Dealt to 132 blocks, a causal 1k window at 16k (16 heads) loads no
  block more than one tile's work past the average, counted in the blocks
  the kernel runs; weighed by causal alone (the window unseen) the most
  loaded block carries more (max/mean 1.058 against 1.022)."""
  from kernel.tiling import schedule
  T, heads, window = 16384, 16, (1024, 0)
  visited = _visited_blocks(T, T, dict(local_window_size=window), is_causal=True)
  cost = lambda order, t: (visited[order.unpack(t)[2], 1] - visited[order.unpack(t)[2], 0]
                           + schedule.TILE_OVERHEAD_BLOCKS)

  def loads(order):
    tiles, counts = order.assign(132)
    return [sum(cost(order, t) for t in tiles[j, :counts[j]].tolist()) for j in range(132)]

  aware = _schedule(T, T, window, True, heads=heads)
  seen = loads(aware)
  assert max(seen) - np.mean(seen) <= max(cost(aware, t) for t in aware.order.tolist())
  assert max(seen) < max(loads(_schedule(T, T, None, True, heads=heads)))


@pytest.mark.parametrize("T,kw,is_causal", [
    (1000, dict(segments=((300, 1, 450, 249),)), True),
    (1000, dict(segments=((300, 1, 450, 249),)), False),
    (777, dict(key_value_seq_lengths=(500,)), True),
    (1000, dict(local_window_size=(100, 0)), True),
])
def test_the_launch_ranks_tiles_by_the_blocks_the_kernel_visits(T, kw, is_causal):
  """``fwd_order.range_tile_blocks``, the weights a launch over key ranges is
  ranked by on the device, is each tile's key loop length under the
  ranges (kernel.padding.key_ranges' tile bounds, kernel.common's rule)."""
  from kernel import padding
  from kernel.forward import order as fwd_order
  if "segments" in kw:
    (docs,) = kw.pop("segments")
    ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None, :T].astype(np.int32))
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids)
  elif "key_value_seq_lengths" in kw:
    kw = dict(key_value_seq_lengths=jnp.asarray(kw["key_value_seq_lengths"], jnp.int32))
  visited = _visited_blocks(T, T, kw, is_causal=is_causal)
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  routed = variants.route(Call(sds(1, T, 1, 64), sds(1, T, 1, 64), sds(1, T, 1, 64), **kw))
  tile = 2 * _SKIP_BLOCK_Q
  _, _, tiles = padding.key_ranges(routed.k_start, routed.k_end, seq_kv=T, tile=tile,
                                   num_tiles=-(-T // tile))
  got = fwd_order.range_tile_blocks(Mask(T, T, causal=is_causal), tiles,
                                    num_tiles=-(-T // tile), tile_q=tile,
                                    block_kv=_SKIP_BLOCK_KV)
  assert np.asarray(got)[0, 0].tolist() == (visited[:, 1] - visited[:, 0]).tolist()
  assert len(set(np.asarray(got)[0, 0].tolist())) > 1   # the ranges make the work uneven


def test_only_a_non_persistent_longest_first_launch_over_key_ranges_is_reranked(monkeypatch):
  """Lowered through the API with segment ids: the non-persistent
  longest-first launch takes its order from ``Schedule.reranked``; the
  persistent one deals the static order, and a call without key ranges
  launches the static order."""
  from kernel.tiling import schedule
  from kernel.tiling.config import Config
  calls = []
  real = schedule.Schedule.reranked
  monkeypatch.setattr(schedule.Schedule, "reranked",
                      lambda self, blocks: calls.append(blocks.shape) or real(self, blocks))
  q, k, v = _arrays()
  thirds = lambda n: jnp.asarray(np.repeat(np.arange(3), [n // 3, n // 3, n - 2 * (n // 3)])
                                 [None, :].repeat(B, 0).astype(np.int32))
  seen = []
  lf = Config(64, 128, 2, schedule="longest-first")
  lengths = jnp.asarray([S - 7, 40], jnp.int32)
  for config, kw in ((lf, dict(q_segment_ids=thirds(T), kv_segment_ids=thirds(S))),
                     (Config(64, 128, 2, persistent=True, schedule="longest-first"),
                      dict(q_segment_ids=thirds(T), kv_segment_ids=thirds(S))),
                     (lf, {}),
                     # A window alone: its static order is already the ranked one.
                     (lf, dict(local_window_size=(40, 8))),
                     (lf, dict(local_window_size=(40, 8), key_value_seq_lengths=lengths))):
    with api.lowering_only():
      jax.export.export(jax.jit(lambda q, k, v: api.dot_product_attention(
          q, k, v, is_causal=True, config=config, **kw)), platforms=["cuda"])(q, k, v)
    seen.append(len(calls))
  assert seen == [1, 1, 1, 1, 2], seen


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_window_forward_runs_no_device_work_before_the_kernel(is_causal):
  """Lowered for CUDA, a forward whose key ranges are a window's alone
  computes nothing from an iota and sorts nothing before the kernel: its
  ranges are constants and the tables XLA derives from them fold into the
  executable (an iota-rooted computation does not fold; it ran as kernels
  before every call).  With kv lengths beside the window, traced, the
  device work is back: the check can fail."""
  from kernel.tiling.config import Config
  q, k, v = _arrays()
  specs = jax.ShapeDtypeStruct(q.shape, q.dtype), *(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                    for x in (k, v))

  def ops(**kw):
    with api.lowering_only():
      text = jax.export.export(jax.jit(lambda q, k, v: api.dot_product_attention(
          q, k, v, is_causal=is_causal, config=Config(64, 128, 2, schedule="longest-first"),
          **kw)), platforms=["cuda"])(*specs).mlir_module()
    return set(re.findall(r"= (?:\")?(stablehlo\.[a-z_]+)", text))

  alone = ops(local_window_size=(40, 8))
  assert "stablehlo.custom_call" in alone
  assert not alone & {"stablehlo.iota", "stablehlo.sort"}, alone
  lengths = ops(local_window_size=(40, 8), key_value_seq_lengths=jnp.asarray([S - 7, 40]))
  assert lengths & {"stablehlo.iota", "stablehlo.sort"}, lengths


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 1500), st.integers(1, 1500), st.integers(0, 600), st.integers(0, 600),
       st.booleans(), st.sampled_from([64, 128]))
def test_a_window_alone_is_ranked_at_trace_time(seq_q, seq_kv, left, right, is_causal,
                                                 block_kv):
  """Where the key ranges are a local window's alone, the route computes
  them at trace time (NumPy), and the launch is not re-ranked on the device
  (Problem.static_ranges): the static longest-first order, weighed by the
  window, IS the order ``Schedule.reranked`` gives by the key blocks each
  tile visits under those ranges, at any lengths."""
  from kernel import padding
  from kernel.forward import order as fwd_order
  sds = lambda n: jax.ShapeDtypeStruct((1, n, 2, 64), jnp.bfloat16)
  routed = variants.route(Call(sds(seq_q), sds(seq_kv), sds(seq_kv),
                               local_window_size=(left, right)))
  assert routed.static_ranges
  assert isinstance(routed.k_start, np.ndarray) and isinstance(routed.k_end, np.ndarray)
  block_q = 64
  num_tiles = -(-seq_q // (2 * block_q))
  _, _, tiles = padding.key_ranges(routed.k_start, routed.k_end, seq_kv=seq_kv,
                                   tile=2 * block_q, num_tiles=num_tiles)
  mask = Mask(seq_q, seq_kv, causal=is_causal, window=(left, right))
  order = fwd_order.tile_schedule(
      mask=mask, batch=1, num_heads=2, num_kv_heads=2, num_tiles=num_tiles,
      s_pad=-(-seq_kv // block_kv) * block_kv, head_dim=64, head_dim_out=64, itemsize=2,
      tile_q=2 * block_q, block_kv=block_kv)
  ranked = order.reranked(fwd_order.range_tile_blocks(
      mask, tiles, num_tiles=num_tiles, tile_q=2 * block_q, block_kv=block_kv))
  assert np.asarray(ranked).tolist() == np.asarray(order.order).tolist()


def test_poisoned_rows_without_key_ranges_are_refused_by_name():
  """The rows the epilogue writes NaN are marked in k_start: a launch asked
  to poison rows without one is refused at trace time, not run silently."""
  from kernel import forward
  from kernel.tiling import plan
  from kernel.tiling.config import Config
  problem = plan.problem_for(np.dtype(jnp.bfloat16), 64, 64, 256, 256, is_causal=True,
                             scale=0.125)
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  call = lambda p: jax.make_jaxpr(lambda q, k, v: forward.flash_attention_forward(
      p, Config(), q, k, v, None, None, None, None, None))(
      sds(1, 256, 1, 64), sds(1, 256, 1, 64), sds(1, 256, 1, 64))
  with api.lowering_only():
    call(problem)
    with pytest.raises(ValueError, match="poisons_rows"):
      call(problem.replace(poisons_rows=True))


def test_the_api_hands_the_window_to_the_longest_first_schedule_only(monkeypatch):
  """Lowered through the API: the schedule gets the call's window under
  schedule="longest-first" (and the default schedule takes no window, so a
  window's value keys no compile)."""
  from kernel.forward import order as fwd_order
  from kernel.tiling.config import Config
  seen = []
  real = fwd_order.tile_schedule
  monkeypatch.setattr(fwd_order, "tile_schedule",
                      lambda **kw: seen.append(kw["mask"].window) or real(**kw))
  q, k, v = _arrays()
  for config in (Config(64, 128, 2, persistent=True, schedule="longest-first"),
                 Config(64, 128, 2)):
    with api.lowering_only():
      jax.export.export(jax.jit(lambda q, k, v: api.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(40, 0), config=config)),
          platforms=["cuda"])(q, k, v)
  assert seen == [(40, 0)]
