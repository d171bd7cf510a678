"""The golden-file tool's logic, on the CPU, with a stand-in for the kernel.

The stand-in returns the float64 reference rounded to the kernel's storage
dtypes, so every classification (identical, reordered, drift, regression,
missing) and
the update's refusal to store a wrong golden can be exercised without a GPU.
The real goldens are generated on the H200 (`python -m harness golden update`,
run by ci/device/produce.sh).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import golden
from harness.conformance import compute_dtype
from harness.reference import attention_reference, attention_reference_vjp

CORPUS = tuple(s for s in golden.CORPUS if s.name in (
    "plain-d64", "ragged-239x1", "mask-full-empty-row", "threshold-zero-unnormalised",
    "f32-inputs", "bias-row-mask-keys"))


def reference_runner(spec):
  case = spec.build()
  ref = attention_reference(case.query, case.key, case.value, case.bias, case.mask,
                            **case.reference_kwargs())
  out = ref.out
  if not case.normalize_output:
    out = out * np.transpose(ref.l, (0, 2, 1))[..., None]
  out_dtype = case.query.dtype  # f32 inputs come back as f32
  rounded = lambda x: x.astype(compute_dtype(out_dtype)).astype(out_dtype)
  result = {"out": rounded(out), "m": ref.m.astype(np.float32), "l": ref.l.astype(np.float32)}
  if spec.has_gradients:
    grads = attention_reference_vjp(case.query, case.key, case.value, case.bias, case.mask,
                                    spec.d_out().astype(np.float64), **case.reference_kwargs())
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
  verdicts = golden.update(perturbed(reference_runner, ulps=1), CORPUS, stored)
  assert {v.status for v in verdicts} == {"drift"}
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
  on an H200 when the corpus changes)."""
  manifest = json.loads((golden.GOLDEN_DIR / "manifest.json").read_text())
  assert set(manifest) == {s.name for s in golden.CORPUS}
  for spec in golden.CORPUS:
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
