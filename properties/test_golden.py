"""The golden-file tool's logic, on the CPU, with a stand-in for the kernel.

The stand-in returns the float64 reference rounded to the kernel's storage
dtypes, so every classification (identical, drift, regression, missing) and
the update's refusal to store a wrong golden can be exercised without a GPU.
The real goldens are generated on the H200 (see ci/results/).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import golden
from harness.conformance import compute_dtype
from harness.reference import attention_reference

CORPUS = tuple(s for s in golden.CORPUS if s.name in (
    "plain-d64", "ragged-239x1", "mask-full-empty-row", "threshold-zero-unnormalised",
    "f32-inputs"))


def reference_runner(spec):
  case = spec.build()
  ref = attention_reference(case.query, case.key, case.value, case.bias, case.mask,
                            **case.reference_kwargs())
  out = ref.out
  if not case.normalize_output:
    out = out * np.transpose(ref.l, (0, 2, 1))[..., None]
  out_dtype = case.query.dtype  # f32 inputs come back as f32
  return {"out": out.astype(compute_dtype(out_dtype)).astype(out_dtype),
          "m": ref.m.astype(np.float32), "l": ref.l.astype(np.float32)}


def perturbed(runner, *, ulps=0, absolute=0.0):
  def run(spec):
    r = {k: v.copy() for k, v in runner(spec).items()}
    out = r["out"]
    if ulps:
      flat = out.reshape(-1)
      view = flat.view(np.uint16 if out.dtype.itemsize == 2 else np.uint32)
      view[0] += ulps
    if absolute:
      r["out"] = (out.astype(np.float64) + absolute).astype(out.dtype)
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
    assert set(entry["checksums"]) == set(golden.ARRAYS)
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
