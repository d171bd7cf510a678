"""FP8 on the CPU: how P's registers meet V^T's keys, the V^T the API
makes, the descales, and the FP8 arguments refused by name.

The relabelling of P's registers (kernel.forward.fp8.relabel) and the key
order V^T is stored in (kernel.tiling.plan.fp8_key_order) must agree
element for element, or the PV product pairs each probability with another
key's values: here both are read from Mosaic GPU's own layout definitions
(its accumulator layout and its 8-bit A layout, jax 0.11.2), thread by
thread, without a GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from harness.numerics import reference, tolerance
from harness.numerics.reference import attention_reference, naive_attention, tensor_core_products
from kernel.tiling import plan

F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def thread_elements(layout, shape) -> dict:
  """{(warp, lane): {(register index, element): (row, col)}} of a Mosaic GPU
  TiledLayout over ``shape``, computed as its ``thread_idxs`` computes them
  (the warp's and lane's offsets along the tiled dims, plus each register's
  and each vector element's)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  contig = tuple(mgpu_utils.get_contiguous_strides(shape))
  strides = layout.tiling.tile_strides(contig)
  tiled = layout.tiled_tiling_shape
  dyn = strides[-layout.tiled_tiling_rank:]

  def delinearize(index, dims):
    sizes = tuple(d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims)
    full = [0] * len(tiled)
    for d, stride, size in zip(dims, mgpu_utils.get_contiguous_strides(sizes), sizes):
      if not isinstance(d, fa.Replicated):
        full[d] = (index // stride) % size
    return full

  out = {}
  for warp, lane in itertools.product(range(4), range(32)):
    base = (sum(i * s for i, s in zip(delinearize(warp, layout.warp_dims), dyn))
            + sum(i * s for i, s in zip(delinearize(lane, layout.lane_dims), dyn)))
    elements = {}
    for reg in np.ndindex(*layout.registers_shape(shape)):
      first = base + sum(i * s for i, s in zip(reg, strides))
      for e in range(layout.vector_length):
        elements[reg, e] = divmod(first + e * strides[layout.vector_dim], shape[1])
    out[warp, lane] = elements
  return out


@pytest.mark.parametrize("keys", [64, 128, 256])
def test_relabelled_p_meets_the_keys_v_transposed_holds(keys):
  """Every thread's e4m3 P element at 8-bit A column j of a 16-key group
  is the probability of key fp8_key_order()[j] of that group, in the same
  row: so the key order V^T is stored in makes PV the product of P and V."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from kernel.forward import fp8
  shape = (64, keys)
  accumulator = thread_elements(fa.WGMMA_LAYOUT, shape)
  operand = thread_elements(fa.WGMMA_LAYOUT_8BIT, shape)
  order = plan.fp8_key_order()
  pairs = fp8.register_pairs(shape)
  seen = set()
  for thread, elements in operand.items():
    for (reg, j), (row, col) in elements.items():
      # relabel: element j of the joined register is element j % 2 of its
      # (j // 2)-th accumulator register
      source = pairs[reg][j // 2]
      src_row, src_col = accumulator[thread][source, j % 2]
      group = col // plan.FP8_KEY_GROUP
      assert src_row == row, (thread, reg, j)
      assert src_col == group * plan.FP8_KEY_GROUP + order[col % plan.FP8_KEY_GROUP], (
          thread, reg, j, col, src_col)
      seen.add((row, col))
  assert len(seen) == 64 * keys


def test_the_key_order_is_a_permutation_within_each_group():
  order = plan.fp8_key_order()
  assert sorted(order) == list(range(plan.FP8_KEY_GROUP)) and order != tuple(range(16))


@pytest.mark.parametrize("seq,dv,pad_to", [(300, 64, 128), (256, 128, 256), (17, 96, 64)])
def test_v_transposed_holds_each_block_in_the_key_order(seq, dv, pad_to):
  """kernel.padding.values_transposed: V^T (B, K, Dv, S'), S' whole key
  blocks of zeros past S, each 16 keys in fp8_key_order, the head dim
  padded with zeros."""
  import jax.numpy as jnp
  from kernel import padding
  rng = np.random.default_rng(seq)
  v = rng.standard_normal((2, seq, 3, dv - 8)).astype(np.float32)
  vt = np.asarray(padding.values_transposed(jnp.asarray(v), head_dim_out=dv, block_kv=pad_to))
  s_pad = -(-seq // pad_to) * pad_to
  assert vt.shape == (2, 3, dv, s_pad)
  full = np.zeros((2, s_pad, 3, dv), np.float32)
  full[:, :seq, :, :dv - 8] = v
  order = np.array(plan.fp8_key_order())
  keys = (np.arange(s_pad) // 16) * 16 + order[np.arange(s_pad) % 16]
  np.testing.assert_array_equal(vt, np.transpose(full[:, keys], (0, 2, 3, 1)))


@pytest.mark.parametrize("layout", ["tensor", "head"])
def test_descales_operand(layout):
  from kernel import padding
  qd, kd, vd = (np.float32(2.0), np.float32(0.25), np.float32(3.0)) if layout == "tensor" else (
      np.arange(1, 7, dtype=np.float32).reshape(2, 3), np.float32(0.5),
      np.full((2, 3), 4.0, np.float32))
  got = np.asarray(padding.fp8_descales(qd, kd, vd, layout=layout, batch=2, kv_heads=3))
  shape = (1, 1) if layout == "tensor" else (2, 3)
  assert got.shape == shape + (2,) and got.dtype == np.float32
  np.testing.assert_array_equal(got[..., 0], np.broadcast_to(qd * kd, shape))
  np.testing.assert_array_equal(got[..., 1], np.broadcast_to(vd, shape))


def _gap_case(seq: int, gap: float):
  """One query row, a top key and seq - 1 keys ``gap`` nats below it, whose
  values are 1 (the top key's 0): the output is their share of the row."""
  from kernel.call import Call
  h = 64
  q = np.zeros((1, 1, 1, h), np.float32)
  q[..., 0] = 1
  k = np.zeros((1, seq, 1, h), np.float32)
  k[0, 1:, 0, 0] = -gap
  v = np.zeros((1, seq, 1, h), np.float32)
  v[0, 1:] = 1.0
  one = np.float32(1)
  return Call(q.astype(F8), (k * 16).astype(F8), v.astype(F8), q_descale=one,
              k_descale=np.float32(1 / 16), v_descale=one, scale=1.0)


@pytest.mark.parametrize("seq", [256, 4096])
@pytest.mark.parametrize("gap", [5.0, 7.0])
def test_p_scale_keeps_probabilities_far_below_the_max(seq, gap, monkeypatch):
  """P at 2^8 times its value (kernel.tiling.plan.FP8_P_SCALE_LOG2) keeps the
  keys 5 and 7 nats below the max within 2 % in the NumPy model of the
  kernel, where P at scale 1 loses 10 % to all of them to e4m3's subnormals
  (docs/decisions/fp8-p-scale.md)."""
  from harness.numerics import online_softmax_model as model
  from harness.numerics.reference import attention_reference
  call = _gap_case(seq, gap)
  ref = attention_reference(call).out
  error = lambda: np.abs(model.online_softmax_attention(call, dtype=F8)[0] - ref).max()
  scaled = error() / np.abs(ref).max()
  monkeypatch.setattr(model, "FP8_P_SCALE_LOG2", 0)
  unscaled = error() / np.abs(ref).max()
  print(f"seq {seq} gap {gap}: scale 1 {unscaled:.2e}, 2^8 {scaled:.2e}")
  assert scaled < 0.02 and unscaled > 0.1


# -- bad FP8 calls, refused by name by the API, the reference and the model --

from harness.numerics.bad_inputs import FP8_BAD_INPUT_CASES, fp8_base_call  # noqa: E402

FP8_CASES = [pytest.param(c, id=c.description) for c in FP8_BAD_INPUT_CASES]


def _split_call(kwargs):
  kw = dict(kwargs)
  return [kw.pop(n) for n in ("query", "key", "value", "bias", "mask")], kw


@pytest.mark.parametrize("case", FP8_CASES)
def test_bad_fp8_calls_are_refused_by_name(case):
  """The API (lowering only, so nothing runs), the float64 reference and the
  NumPy model refuse each bad FP8 call with a ValueError naming the
  argument."""
  import re
  from harness.numerics.online_softmax_model import online_softmax_attention
  from harness.numerics.reference import attention_reference
  from kernel import api
  args, kw = _split_call({**fp8_base_call(), **case.changes()})
  match = f"^{re.escape(case.argument)}: "
  with pytest.raises(ValueError, match=match), api.lowering_only():
    api.dot_product_attention(*args, **kw)
  with pytest.raises(ValueError, match=match):
    attention_reference(*args, **kw)
  with pytest.raises(ValueError, match=match):
    online_softmax_attention(*args, dtype=F8, **kw)


def test_the_fp8_base_call_is_accepted():
  """The call every bad FP8 case changes one thing of: the API's record
  (its dtypes), the reference and the model take it (test_lowering lowers
  such calls for CUDA)."""
  from harness.numerics.online_softmax_model import online_softmax_attention
  from harness.numerics.reference import attention_reference
  from kernel.call import DEFAULT_ALLOWED_DTYPES, Call
  args, kw = _split_call(fp8_base_call())
  assert Call(*args, **kw, dtypes=DEFAULT_ALLOWED_DTYPES).descales == "head"
  attention_reference(*args, **kw)
  online_softmax_attention(*args, dtype=F8, **kw)


@pytest.mark.parametrize("descales", [
    dict(q_descale=float("inf")), dict(v_descale=np.float32(-1))], ids=["inf", "negative"])
def test_a_concrete_bad_descale_under_jit_is_refused_too(descales):
  """A descale whose value is known (a concrete jax array) is checked even
  when the API is called inside jax.jit with it as a closed-over constant."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  args, kw = _split_call(fp8_base_call())
  kw.update({n: jnp.asarray(x, jnp.float32) for n, x in descales.items()})
  (name,) = descales
  with pytest.raises(ValueError, match=f"^{name}: must be finite and > 0"), api.lowering_only():
    jax.jit(lambda *a: api.dot_product_attention(*a, **kw)).lower(*args)


def test_an_fp8_gradient_is_refused_naming_the_query():
  import jax
  import jax.numpy as jnp
  from kernel import api
  args, kw = _split_call(fp8_base_call())
  loss = lambda q: jnp.sum(api.dot_product_attention(q, *args[1:], **kw).astype(jnp.float32))
  with pytest.raises(NotImplementedError, match="^query: float8_e4m3fn attention has no "
                                                 "gradient"), api.lowering_only():
    jax.jit(jax.grad(loss)).lower(args[0])


# -- the named FP8 cases of the GPU tests ----------------------------------

from harness.numerics.fp8_cases import FP8_NAMED, fp8_case  # noqa: E402

# The NumPy model and the float64 reference of the larger cases take too
# long for the CPU suite; those are built only.
SMALL = 2 ** 19


@pytest.mark.parametrize("name", list(FP8_NAMED))
def test_named_fp8_cases_build_and_the_model_meets_the_rule(name):
  """Each named FP8 case is a valid call with its descales; where small, the
  NumPy model of the kernel's FP8 arithmetic meets the tolerance rule on it
  (64-key blocks, at the threshold the API runs), as the kernel must on the
  GPU."""
  from harness.numerics.conformance import check_forward
  from harness.numerics.online_softmax_model import online_softmax_attention
  from kernel import api
  call = fp8_case(name, **FP8_NAMED[name])
  assert call.fp8 and call.descales in ("tensor", "head")
  sh = call.shapes
  if sh.B * sh.N * sh.T * sh.S > SMALL:
    pytest.skip("large: built only on the CPU")
  runs = call.replace(rescale_threshold=api.problem_of(call).rescale_threshold)
  report = check_forward(call, *online_softmax_attention(runs, block_kv=64, dtype=F8,
                                                         fp8_sum_bits=tolerance.FP8_SUM_BITS))
  assert report.passed, report.summary()


def test_the_fp8_yardstick_sums_as_the_h200_does_and_still_fails_a_coarser_sum():
  """The FP8 contract (harness/numerics/tolerance.py): the rule's naive
  computation sums e4m3 products as the hardware does.  On ``one-hot-rows``
  the model of the kernel summing as the H200 does meets it; the same
  model breaks a yardstick that sums exactly (the contract the H200's
  kernel failed, docs/fp8/accuracy.md); a model that keeps two fraction
  bits fewer than the hardware breaks the rule."""
  from harness.numerics.conformance import check_forward
  from harness.numerics.online_softmax_model import online_softmax_attention
  from kernel import api
  call = fp8_case("one-hot-rows", **FP8_NAMED["one-hot-rows"])
  runs = call.replace(rescale_threshold=api.problem_of(call).rescale_threshold)
  model = lambda bits: online_softmax_attention(runs, block_kv=64, dtype=F8, fp8_sum_bits=bits)
  faithful = model(tolerance.FP8_SUM_BITS)
  report = check_forward(call, *faithful)
  assert report.passed, report.summary()
  coarser = check_forward(call, *model(tolerance.FP8_SUM_BITS - 2))
  assert not coarser.passed, coarser.summary()
  # the exact yardstick: the same rule with the products summed in float32
  ref = attention_reference(call)
  _, _, exact_l = naive_attention(call, dtype=np.dtype(F8))
  dt = tolerance.floor_dtype(F8, call.result_dtype)
  assert not tolerance.check_tolerance(faithful[2], ref.l, exact_l, dt, name="l").passed


def test_the_cpu_yardstick_is_the_model_of_the_h200s_sum():
  """Without a GPU, naive_forward's FP8 products are the H200's sum as
  modelled (FP8_SUM_BITS after each FP8_SUM_PART products): equal to
  summing them by reference.tensor_core_products at those bits, and not
  the exact sum, on a case whose logits are large."""
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is visible: its own FP8 dot is the yardstick")
  call = fp8_case("one-hot-rows", seq_q=64, seq_kv=128, **{
      k: v for k, v in FP8_NAMED["one-hot-rows"].items() if k not in ("seq_q", "seq_kv")})
  got = tolerance.naive_forward(call, np.dtype(F8))
  model = naive_attention(call, dtype=np.dtype(F8), fp8_products=lambda a, b:
                          tensor_core_products(a, b, tolerance.FP8_SUM_BITS,
                                               tolerance.FP8_SUM_PART))
  exact = naive_attention(call, dtype=np.dtype(F8))
  for g, w in zip(got, model):
    np.testing.assert_array_equal(g, w)
  assert not np.array_equal(got[1], exact[1])


@pytest.mark.parametrize("bits", [12, 20])
def test_tensor_core_products_cut_each_part_and_carry_the_accumulator(bits):
  """The modelled sum: exact where every partial sum fits the bits kept,
  cut toward zero after each part otherwise, and an accumulator carried in
  is cut with it (the PV wgmma accumulates onto the output)."""
  rng = np.random.default_rng(bits)
  a = reference.quantise_e4m3(rng.standard_normal((3, 64)) * 8)
  b = reference.quantise_e4m3(rng.standard_normal((64, 5)) * 8)
  exact = a.astype(np.float64) @ b
  got = tensor_core_products(a, b, 52)
  np.testing.assert_allclose(got, exact, rtol=2 ** -23)
  cut = tensor_core_products(a, b, bits).astype(np.float64)
  # 2 parts of 32: each cut loses under one unit of the bits-th fraction bit
  bound = 2 * np.abs(exact).max() * 2.0 ** -bits
  assert np.all(np.abs(cut - exact) <= bound)
  assert np.all(np.abs(cut) <= np.abs(exact) + bound)
  # sums in [2^20, 2^21) (every product here is under 2^10): kept to steps of 2^(21 - bits - 1)
  init = np.full((3, 5), 1.5 * 2.0 ** 20, np.float32)
  carried = tensor_core_products(a, b, bits, init=init).astype(np.float64)
  assert np.all(carried % 2.0 ** (20 - bits) == 0)
  np.testing.assert_allclose(carried, exact + init, atol=2 * 2.0 ** (20 - bits))


def test_the_fp8_yardstick_is_the_model_on_every_host(monkeypatch):
  """naive_forward sums an FP8 call's products by the model of the H200's
  wgmma whether or not an sm90 GPU is present (XLA's FP8 dot on the H200
  sums almost exactly: docs/decisions/fp8-yardstick.md), so a GPU run and
  a CPU run hold the kernel to one bound; the model's sum is coarser than
  an exact one on this call."""
  from kernel import api
  call = fp8_case("one-hot-rows", **FP8_NAMED["one-hot-rows"])
  want = naive_attention(call, dtype=np.dtype(F8), fp8_products=tolerance.fp8_products_model)
  exact = naive_attention(call, dtype=np.dtype(F8))
  for device in (None, object()):
    monkeypatch.setattr(api, "sm90_device", lambda device=device: device)
    got = tolerance.naive_forward(call, np.dtype(F8))
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
  assert not np.array_equal(want[0], exact[0])


def test_the_fp8_threshold_floor_keeps_deferred_p_within_e4m3():
  """At rescale_threshold 0 a deferred P of FP8 goes past e4m3's 448 and
  saturates (the NumPy model breaks the rule); at the 0.625 the API runs
  it stays below (kernel.forward.fp8.MIN_THRESHOLD)."""
  from harness.numerics.conformance import check_forward
  from harness.numerics.online_softmax_model import online_softmax_attention
  from kernel import api
  call = fp8_case("threshold-0-unnormalised", **FP8_NAMED["threshold-0-unnormalised"])
  assert call.rescale_threshold == 0.0 and api.problem_of(call).rescale_threshold == 0.625
  stats = {}
  raw = online_softmax_attention(call, dtype=F8, _stats=stats)
  assert stats["max_p"] > 448 and not check_forward(call, *raw).passed
  floored = call.replace(rescale_threshold=0.625)
  stats = {}
  ok = online_softmax_attention(floored, dtype=F8, _stats=stats)
  assert stats["max_p"] <= 448 and check_forward(call, *ok).passed


def test_fp8_golden_cases_have_their_goldens_and_lower():
  """The FP8 corpus cases have goldens written on an H200, of the forward
  only; the call the golden tool runs for the one with the most features
  lowers for CUDA."""
  import jax
  from harness.tools import golden
  from kernel import api
  fp8 = [s for s in golden.CORPUS if s.fp8 is not None]
  assert len(fp8) == 3 and not {s.name for s in fp8} & set(golden.AWAITING_FIRST_GOLDEN)
  assert all(s.arrays() == golden.FORWARD_ARRAYS for s in fp8)
  for s in fp8:
    stored = golden.load_golden(s.name)
    assert stored is not None and set(stored) == set(golden.FORWARD_ARRAYS), s.name
  f, args = golden.kernel_function(next(s for s in fp8 if s.bias and s.mask))
  with api.lowering_only():
    jax.export.export(jax.jit(f), platforms=["cuda"])(*args)


def test_the_jaxpr_comparison_lists_new_cases_and_fails_a_lost_or_changed_one(tmp_path, capsys):
  """harness.tools.jaxpr_texts --compare: a case only the newer dump holds
  (the FP8 ones, added beside the 16-bit ones) is listed as new and passes;
  a changed or a lost case fails."""
  import json
  from harness.tools import jaxpr_texts
  old, new = tmp_path / "old.json", tmp_path / "new.json"
  old.write_text(json.dumps({"a": "x", "b": "y"}))
  new.write_text(json.dumps({"a": "x", "b": "y", "fp8-c": "z"}))
  assert jaxpr_texts.main(["--compare", str(old), str(new)]) == 0
  assert "2 of 2 jaxprs identical; differ: none; new in" in capsys.readouterr().out
  assert jaxpr_texts.main(["--compare", str(new), str(old)]) == 1
  new.write_text(json.dumps({"a": "x", "b": "w", "fp8-c": "z"}))
  assert jaxpr_texts.main(["--compare", str(old), str(new)]) == 1
  assert "differ: ['b']" in capsys.readouterr().out
  assert {n for n in jaxpr_texts.cases() if n.startswith("fp8-")} == {
      "fp8-d128-p-plain", "fp8-d128-np-causal-threshold-head",
      "fp8-d64-p-bkv256-bias-mask-ranges", "fp8-d256-np-f16-out"}


@pytest.mark.parametrize("shape,want", [((4, 2, 2), ("data", "model", None)),
                                        ((1, 1, 2), (None, None, None))],
                         ids=["per-head", "per-tensor"])
def test_the_descales_shard_with_their_batch_and_kv_heads(shape, want):
  """On a mesh (kernel/sharding.py), FP8's (B|1, K|1, 2) descales follow the
  query's batch and kv-head sharding where full, and stay replicated where
  broadcast (per tensor); their last axis is never sharded."""
  from jax.sharding import PartitionSpec
  from kernel import sharding
  layout = sharding.Layout(mesh=None, batch=("data",), heads=("model",), shapes={
      "query": (4, 128, 8, 64), "key": (4, 128, 2, 64), "descales": shape})
  assert layout.spec("descales") == PartitionSpec(*want)
  assert "descales" in sharding.FORWARD_OPERANDS and "descales" not in sharding.BACKWARD_OPERANDS


def test_fp8_under_vmap_and_jit_lowers_for_cuda():
  """jax.vmap over a leading axis of FP8 inputs and their per-head
  descales, under jax.jit, lowers for CUDA (the per-device computation is
  vmapped whole, kernel/sharding.py)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  sds = jax.ShapeDtypeStruct
  f8 = jnp.float8_e4m3fn
  q, kv = sds((3, 1, 200, 2, 64), f8), sds((3, 1, 150, 1, 64), f8)
  d = sds((3, 1, 1), jnp.float32)
  f = lambda q, k, v, dq, dk, dv: api.dot_product_attention(
      q, k, v, is_causal=True, q_descale=dq, k_descale=dk, v_descale=dv, return_residuals=True)
  with api.lowering_only():
    exported = jax.export.export(jax.jit(jax.vmap(f)), platforms=["cuda"])(q, kv, kv, d, d, d)
  out, (m, l) = exported.out_avals[0], exported.out_avals[1:]
  assert (out.shape, out.dtype) == ((3, 1, 200, 2, 64), jnp.bfloat16)
  assert m.shape == l.shape == (3, 1, 2, 200)
  assert "mosaic_gpu" in exported.mlir_module(), "no Mosaic GPU kernel was lowered"


# -- tiling: heuristics, candidates, the estimate, the cache ----------------

def _fp8_problem(head_dim, seq=4096, causal=False, dtype=F8):
  shape = (1, seq, 8, head_dim)
  from kernel.tiling import autotune
  return autotune.selection_problem(plan.problem_of_shapes(shape, shape, shape, dtype,
                                                           is_causal=causal))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_tilings_fit_and_one_byte_rows_make_room(head_dim, causal):
  """Every FP8 config the heuristics and the autotuner emit fits shared
  memory; one-byte rows admit at least every bfloat16 candidate, and more
  (wider key blocks, deeper rings) at head dims 128 and up; up to head dim
  64 the heuristic starts at 256-key blocks."""
  from kernel.tiling import heuristics
  fp8, bf16 = _fp8_problem(head_dim, causal=causal), _fp8_problem(
      head_dim, causal=causal, dtype=np.dtype(ml_dtypes.bfloat16))
  configs = heuristics.get_autotuning_configs(fp8)
  assert configs and all(plan.config_fits(fp8, c) for c in configs)
  assert set(heuristics.get_autotuning_configs(bf16)) <= set(configs)
  if head_dim >= 128:
    assert len(configs) > len(heuristics.get_autotuning_configs(bf16))
  chosen = heuristics.get_heuristics_config(fp8)
  assert plan.config_fits(fp8, chosen)
  assert (chosen.block_kv == 256) == (head_dim <= heuristics.FP8_WIDE_KEYS_HEAD_DIM)


def test_fp8_cache_entries_serve_fp8_calls_only(tmp_path):
  """An FP8 entry of the autotune cache answers an FP8 call of its
  signature, and the nearest FP8 signature another FP8 bucket; a bfloat16
  call never reads it (FP8's tilings are timed apart: kernel.tiling.autotune.FAMILIES)."""
  import json
  from kernel.tiling import autotune
  from kernel.tiling.config import Config
  fp8 = _fp8_problem(128)
  entry = {"config": {"block_q": 64, "block_kv": 128, "num_stages": 3, "persistent": True},
           "median_ms": {}}
  path = tmp_path / "cache.json"
  path.write_text(json.dumps({"NVIDIA H200": {autotune.signature(fp8): entry}}))
  want = Config(64, 128, 3, persistent=True)
  assert autotune.lookup(fp8, "NVIDIA H200", path=path) == want
  assert autotune.signature(fp8).startswith("float8_e4m3fn-d128-dv128-q4096")
  other_bucket = _fp8_problem(128, seq=8192)
  assert autotune.nearest(other_bucket, "NVIDIA H200", path=path) == (
      autotune.signature(fp8), want)
  bf16 = _fp8_problem(128, dtype=np.dtype(ml_dtypes.bfloat16))
  assert autotune.nearest(bf16, "NVIDIA H200", path=path) is None
