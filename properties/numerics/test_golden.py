"""The golden-file tool's logic, on the CPU, with a stand-in for the kernel.

The stand-in returns the float64 reference rounded to the kernel's storage
dtypes, so every classification (identical, reordered, drift, regression,
missing) and
the update's refusal to store a wrong golden can be exercised without a GPU.
The real goldens are generated on the H200 (`python -m harness golden update`,
run by ci/device/produce.sh).  The cases with jax.nn's lengths and windows
and packed segments (``GoldenSpec.variants``) are checked to build, to reach
the public API with every variant (the call the tool runs, lowered for CUDA),
to make the key loops skip blocks, and to go through update and check.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from harness.tools import golden
from harness.numerics.conformance import compute_dtype
from harness.numerics.reference import VARIANT_ARGS, attention_reference, attention_reference_vjp
from kernel import api

CORPUS = tuple(s for s in golden.CORPUS if s.name in (
    "plain-d64", "ragged-239x1", "mask-full-empty-row", "threshold-zero-unnormalised",
    "f32-inputs", "bias-row-mask-keys"))


def reference_runner(spec):
  case = spec.build()
  ref = attention_reference(case)
  out = ref.out
  if not case.normalize_output:
    out = out * np.transpose(ref.l, (0, 2, 1))[..., None]
  out_dtype = case.query.dtype  # f32 inputs come back as f32
  rounded = lambda x: x.astype(compute_dtype(out_dtype)).astype(out_dtype)
  result = {"out": rounded(out), "m": ref.m.astype(np.float32), "l": ref.l.astype(np.float32)}
  if spec.has_gradients:
    grads = attention_reference_vjp(case, spec.d_out().astype(np.float64))
    for name in spec.arrays()[3:]:
      result[name] = rounded(getattr(grads, name))
  return result


def perturbed(runner, *, ulps=0, absolute=0.0, array="out"):
  """``runner`` with ``array``'s largest entry moved by ``ulps`` units in the
  last place, or every entry by ``absolute``."""
  def run(spec):
    r = {k: v.copy() for k, v in runner(spec).items()}
    if array not in r:
      return r
    x = r[array]
    if ulps:
      flat = x.reshape(-1)
      view = flat.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)
      view[int(np.argmax(np.abs(flat.astype(np.float64))))] += ulps
    if absolute:
      r[array] = (x.astype(np.float64) + absolute).astype(x.dtype)
    return r
  return run


@pytest.fixture
def stored(tmp_path):
  golden.update(reference_runner, CORPUS, tmp_path, device="stand-in", jax_version="cpu")
  return tmp_path


def test_update_writes_every_case_with_a_manifest(stored):
  manifest = json.loads((stored / "manifest.json").read_text())
  assert set(manifest) == {s.name for s in CORPUS}
  for spec in CORPUS:
    entry = manifest[spec.name]
    assert entry["seed"] == spec.seed and entry["device"] == "stand-in"
    assert set(entry["checksums"]) == set(spec.arrays())
    assert entry["kernel_source"] == golden.kernel_source_hash()
    assert golden.load_golden(spec.name, stored)["out"].dtype == spec.build().query.dtype


def test_the_same_outputs_are_identical(stored):
  verdicts, ok = golden.check(reference_runner, CORPUS, stored)
  assert ok and {v.status for v in verdicts} == {"identical"}


def test_a_one_ulp_change_is_drift_and_passes(stored):
  verdicts, ok = golden.check(perturbed(reference_runner, ulps=1), CORPUS, stored)
  assert ok
  assert {v.status for v in verdicts} == {"drift"}
  assert all(v.max_ulp == 1 for v in verdicts)


def test_a_one_ulp_change_of_the_order_dependent_dq_is_reordered(stored):
  """dq, summed across blocks in no fixed order, may move by one ulp from run
  to run: 'reordered' (passes), apart from drift; the same change in dk is
  drift, and dq moved by more than the run-to-run bound is drift too."""
  with_grads = [s for s in CORPUS if s.has_gradients]
  verdicts, ok = golden.check(perturbed(reference_runner, ulps=1, array="dq"), with_grads, stored)
  assert ok and {v.status for v in verdicts} == {"reordered"}
  assert "reordered" in golden.render(verdicts)
  verdicts, ok = golden.check(perturbed(reference_runner, ulps=1, array="dk"), with_grads, stored)
  assert ok and {v.status for v in verdicts} == {"drift"}
  verdicts, _ = golden.check(perturbed(reference_runner, ulps=16, array="dq"), with_grads, stored)
  assert "reordered" not in {v.status for v in verdicts}


def test_a_change_beyond_the_rule_is_a_regression_and_fails(stored):
  verdicts, ok = golden.check(perturbed(reference_runner, absolute=0.5), CORPUS, stored)
  assert not ok
  assert {v.status for v in verdicts} == {"regression"}
  assert "regression" in golden.render(verdicts)


def test_a_missing_golden_fails(tmp_path):
  verdicts, ok = golden.check(reference_runner, CORPUS[:1], tmp_path)
  assert not ok and verdicts[0].status == "missing"


def test_update_reports_changes_and_never_stores_a_wrong_output(stored):
  before = (stored / "plain-d64.npz").read_bytes()
  verdicts = golden.update(perturbed(reference_runner, absolute=0.5), CORPUS, stored)
  assert {v.status for v in verdicts} == {"regression"}
  assert (stored / "plain-d64.npz").read_bytes() == before
  assert golden.update_exit_code(verdicts) == 1   # the command fails on a refused case
  verdicts = golden.update(perturbed(reference_runner, ulps=1), CORPUS, stored)
  assert {v.status for v in verdicts} == {"drift"}
  assert golden.update_exit_code(verdicts) == 0
  verdicts, ok = golden.check(perturbed(reference_runner, ulps=1), CORPUS, stored)
  assert ok and {v.status for v in verdicts} == {"identical"}


def test_inputs_are_regenerated_from_the_spec_and_seed():
  a, b = CORPUS[0].build(), CORPUS[0].build()
  assert np.array_equal(a.query, b.query) and np.array_equal(a.value, b.value)
  assert np.any(a.query != 0)


def test_gradients_are_stored_where_the_backward_is_defined():
  by_name = {s.name: s for s in golden.CORPUS}
  assert by_name["plain-d64"].arrays() == ("out", "m", "l", "dq", "dk", "dv")
  assert by_name["bias-row-mask-keys"].arrays()[-1] == "dbias"
  assert by_name["causal-kend-bias-col"].arrays()[-1] == "dv"  # dbias is noise there
  assert by_name["threshold-zero-unnormalised"].arrays() == golden.FORWARD_ARRAYS


def test_a_wrong_gradient_alone_is_a_regression(stored):
  def wrong_dk(spec):
    r = reference_runner(spec)
    if "dk" in r:
      r["dk"] = (r["dk"].astype(np.float64) * 1.5).astype(r["dk"].dtype)
    return r
  verdicts, ok = golden.check(wrong_dk, CORPUS, stored)
  assert not ok
  status = {v.name: v.status for v in verdicts}
  assert status["plain-d64"] == "regression" and "dk" in \
      next(v.detail for v in verdicts if v.name == "plain-d64")
  assert status["threshold-zero-unnormalised"] == "identical"  # no gradients stored


def test_the_committed_goldens_match_the_corpus():
  """Every corpus case has a committed golden holding exactly its arrays, with
  the manifest's checksums (regenerate with `python -m harness golden update`
  on an H200 when the corpus changes), except the cases awaiting their first
  golden, which have none yet (golden.AWAITING_FIRST_GOLDEN: empty it once
  they are written)."""
  manifest = json.loads((golden.GOLDEN_DIR / "manifest.json").read_text())
  awaiting = set(golden.AWAITING_FIRST_GOLDEN)
  assert awaiting <= {s.name for s in golden.CORPUS}
  assert set(manifest) == {s.name for s in golden.CORPUS} - awaiting
  for name in awaiting:
    assert golden.load_golden(name) is None, (
        f"{name} has a golden now: remove it from golden.AWAITING_FIRST_GOLDEN")
  for spec in golden.CORPUS:
    if spec.name in awaiting:
      continue
    stored = golden.load_golden(spec.name)
    assert stored is not None and tuple(sorted(stored)) == tuple(sorted(spec.arrays())), spec.name
    for name, array in stored.items():
      assert golden._checksum(array) == manifest[spec.name]["checksums"][name], (spec.name, name)


def test_a_golden_in_the_first_format_is_read_and_completed_by_update(tmp_path):
  """Goldens written before gradients were stored (out bits + out_dtype, m, l)
  still load; check calls the case missing, update adds the gradients."""
  spec = CORPUS[0]
  new = reference_runner(spec)
  np.savez_compressed(tmp_path / f"{spec.name}.npz", out=new["out"].view(np.uint16),
                      out_dtype=np.array(str(new["out"].dtype)), m=new["m"], l=new["l"])
  old = golden.load_golden(spec.name, tmp_path)
  assert set(old) == {"out", "m", "l"} and np.array_equal(old["out"], new["out"])
  verdicts, ok = golden.check(reference_runner, (spec,), tmp_path)
  assert not ok and verdicts[0].status == "missing"
  golden.update(reference_runner, (spec,), tmp_path)
  verdicts, ok = golden.check(reference_runner, (spec,), tmp_path)
  assert ok and verdicts[0].status == "identical"


# ---------------------------------------------------------------------------
# The variant cases: jax.nn's lengths and windows, packed segments.

VARIANT_CASES = tuple(s for s in golden.CORPUS if s.variants is not None)
BY_NAME = {s.name: s for s in golden.CORPUS}


def test_the_corpus_has_each_variant():
  """Lengths (a full, a ragged and a zero one, queries and keys), int and
  (left, right) windows with and without causal, packed documents under
  causal, and the dense-mask layout's non-contiguous ids."""
  v = lambda name: BY_NAME[name].variants
  lengths = v("lengths-ragged-zero-full")
  case = BY_NAME["lengths-ragged-zero-full"]
  for given, full in ((lengths.query_seq_lengths, case.seq_q),
                      (lengths.key_value_seq_lengths, case.seq_kv)):
    assert 0 in given and full in given and any(0 < n < full for n in given)
  windows = {(isinstance(s.variants.local_window_size, int), s.is_causal)
             for s in VARIANT_CASES if s.variants.local_window_size is not None}
  assert windows == {(True, True), (True, False), (False, True), (False, False)}
  packed = v("segments-packed-causal")
  assert BY_NAME["segments-packed-causal"].is_causal and packed.segment_layout == "contiguous"
  assert packed.segments.kv_contiguous and len(packed.segments.kv_runs[0]) >= 3
  split = v("segments-split-any-layout")
  assert split.segment_layout == "any" and not split.segments.kv_contiguous


@pytest.mark.parametrize("spec", VARIANT_CASES, ids=lambda s: s.name)
def test_a_variant_case_builds_what_the_reference_reads(spec):
  """The spec's variants land in the call's variants under the reference's
  names, with its segment layout, without moving the other arrays (the same
  seed without variants draws the same inputs); gradients are stored."""
  case = spec.build()
  assert case.variants and set(case.variants) <= set(VARIANT_ARGS)
  assert case.segment_layout == spec.variants.segment_layout
  plain = dataclasses.replace(spec, variants=None).build()
  assert np.array_equal(case.query, plain.query) and np.array_equal(case.value, plain.value)
  assert spec.arrays() == ("out", "m", "l", "dq", "dk", "dv")
  # The reference sees fewer keys than without the variants: they reached it.
  ref = attention_reference(case)
  ref_plain = attention_reference(plain)
  assert ref.visible.sum() < ref_plain.visible.sum()


@pytest.mark.parametrize("spec", VARIANT_CASES, ids=lambda s: s.name)
def test_a_variant_case_reaches_the_api_and_lowers_for_cuda(spec, monkeypatch):
  """The call the tool runs (golden.kernel_function) hands every variant and
  the segment layout to kernel.api.dot_product_attention, and lowers for
  CUDA, forward and vjp, into Mosaic GPU kernels with the stored arrays'
  shapes."""
  seen = []
  real = api.dot_product_attention

  def recording(*args, **kwargs):
    seen.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(api, "dot_product_attention", recording)
  f, args = golden.kernel_function(spec)
  with api.lowering_only():
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
  assert seen, "the tool did not call kernel.api.dot_product_attention"
  want = spec.build().variants
  for kwargs in seen:
    assert kwargs["segment_layout"] == spec.variants.segment_layout
    for name, value in want.items():
      assert np.array_equal(np.asarray(kwargs[name]), np.asarray(value)), name
  outs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
  assert tuple(sorted(outs)) == tuple(sorted(spec.arrays()))
  case = spec.build()
  assert outs["out"].shape == case.query.shape[:3] + (case.value.shape[3],)
  assert outs["dk"].shape == case.key.shape and outs["dq"].shape == case.query.shape
  assert exported.mlir_module().count("stablehlo.custom_call @mosaic_gpu") >= 2


def _key_blocks_visited(spec) -> tuple[int, int]:
  """(visited, plain): key blocks the forward's loop runs over every query
  tile of every batch row and head (kernel.masks.Mask.key_blocks on the
  ranges kernel/key_ranges.py makes, with the config the case runs on this
  host), and the same count for the call without the case's variants."""
  from kernel import padding
  from kernel.masks import Mask
  case = spec.build()
  config = golden.config_used(spec)
  block_q, block_kv = config["block_q"], config["block_kv"]
  _, k_start, k_end = golden._kernel_mask_and_ranges(case)
  b, t, n, s = case.query.shape[0], case.query.shape[1], case.query.shape[2], case.key.shape[1]
  num_tiles = -(-t // (2 * block_q))
  _, _, tiles = padding.key_ranges(k_start, k_end, seq_kv=s, tile=2 * block_q,
                                   num_tiles=num_tiles)
  start_min, _, _, end_max = (np.broadcast_to(np.asarray(x), (b, n, num_tiles))
                              for x in tiles)

  def blocks(qi, **ranges):
    lo, hi = Mask(t, s, causal=case.is_causal).key_blocks(qi, tile_q=2 * block_q,
                                                          block_kv=block_kv, **ranges)
    return hi - lo

  visited = sum(blocks(qi, k_start_min=int(start_min[bi, h, qi]),
                       k_end_max=int(end_max[bi, h, qi]))
                for bi in range(b) for h in range(n) for qi in range(num_tiles))
  return visited, b * n * sum(blocks(qi) for qi in range(num_tiles))


@pytest.mark.parametrize("spec", [s for s in VARIANT_CASES
                                  if s.variants.local_window_size is not None
                                  or s.variants.segments is not None], ids=lambda s: s.name)
def test_window_and_segment_cases_skip_key_blocks(spec):
  """Each window and segment case makes some query tile skip a key block it
  would visit without them: the goldens hold the skipping kernel's bits."""
  visited, plain = _key_blocks_visited(spec)
  assert visited < plain, (visited, plain)


def test_a_variant_case_goes_through_update_and_check(tmp_path):
  """Without its golden a variant case is missing (check fails); update
  writes it; the same outputs are then identical, and a wrong dv a
  regression."""
  cases = (BY_NAME["lengths-ragged-zero-full"], BY_NAME["segments-split-any-layout"])
  verdicts, ok = golden.check(reference_runner, cases, tmp_path)
  assert not ok and {v.status for v in verdicts} == {"missing"}
  golden.update(reference_runner, cases, tmp_path)
  verdicts, ok = golden.check(reference_runner, cases, tmp_path)
  assert ok and {v.status for v in verdicts} == {"identical"}
  manifest = json.loads((tmp_path / "manifest.json").read_text())
  assert manifest["segments-split-any-layout"]["spec"]["variants"]["segment_layout"] == "any"

  def wrong_dv(spec):
    r = reference_runner(spec)
    r["dv"] = (r["dv"].astype(np.float64) * 1.5).astype(r["dv"].dtype)
    return r
  verdicts, ok = golden.check(wrong_dv, cases, tmp_path)
  assert not ok and {v.status for v in verdicts} == {"regression"}


def test_select_names_cases_and_update_rewrites_only_them(stored):
  """--select picks cases by name, in corpus order; update given the
  selection rewrites only their files and manifest entries."""
  picked = golden.selected("ragged-239x1,plain-d64", CORPUS)
  assert [s.name for s in picked] == ["plain-d64", "ragged-239x1"]
  assert golden.selected(None, CORPUS) == CORPUS
  others = {s.name: (stored / f"{s.name}.npz").read_bytes() for s in CORPUS
            if s not in picked}
  before = json.loads((stored / "manifest.json").read_text())
  golden.update(perturbed(reference_runner, ulps=1), picked, stored, device="second")
  after = json.loads((stored / "manifest.json").read_text())
  for name, data in others.items():
    assert (stored / f"{name}.npz").read_bytes() == data and after[name] == before[name]
  assert {after[s.name]["device"] for s in picked} == {"second"}


@pytest.mark.parametrize("names", ["no-such-case", "plain-d64,nope", ","])
def test_select_refuses_unknown_names_by_argument(names, capsys):
  with pytest.raises(ValueError, match="^--select: unknown"):
    golden.selected(names)
  with pytest.raises(SystemExit) as stop:  # before any GPU check: a typo fails anywhere
    golden.main(["check", "--select", names])
  assert stop.value.code == 2 and "--select: unknown" in capsys.readouterr().err
