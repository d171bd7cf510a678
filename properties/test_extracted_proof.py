"""The protocol read out of the traced forward kernel (harness/extract.py) and
checked (harness/extracted_proof.py): the shipped kernel proves, each
protocol defect written into a copy of kernel/forward.py is refuted with a
trace naming the mutated file's lines, safe reorderings still prove, and an
unknown primitive is refused rather than skipped."""

import pytest

from harness import extract
from harness import prove_extracted as pe
from harness import protocol_mutants as pmut

ONE_TILE = pe.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
PERSISTENT = pe.ForwardCase(2, True, "round-robin", False, False, False, 64, 128, 2)


def test_shipped_kernel_proves():
  for case in (ONE_TILE, PERSISTENT):
    r = pe.check_case(case)
    assert r.violation is None, r.violation.format()
    assert r.checks > 1 and r.states > 1000  # the environments really ran the ring


@pytest.mark.parametrize("mutant", pmut.MUTANTS, ids=lambda m: m.name)
def test_kernel_mutant_refuted(mutant):
  module = pmut.load(mutant)
  r = pe.check_case(PERSISTENT if mutant.persistent else ONE_TILE, module=module)
  assert r.violation is not None, f"{mutant.name} ({mutant.what}) was not refuted"
  text = r.violation.format()
  assert f"kernel/forward.mutant_{mutant.name}.py:" in text, text


def test_shipped_backward_proves():
  for case in ((64, False, False, True), (64, False, True, False), (256, True, True, False)):
    r = pe.check_backward(*case)
    assert r.violation is None, r.violation.format()
    assert r.states > 1000


@pytest.mark.parametrize("mutant", pmut.BACKWARD_MUTANTS, ids=lambda m: m.name)
def test_backward_mutant_refuted(mutant):
  r = pe.check_backward(*mutant.backward, module=pmut.load(mutant))
  assert r.violation is not None, f"{mutant.name} ({mutant.what}) was not refuted"
  assert f"kernel/backward.mutant_{mutant.name}.py:" in r.violation.format()


@pytest.mark.parametrize("safe", pmut.SAFE, ids=lambda m: m.name)
def test_safe_reordering_proves(safe):
  r = pe.check_case(ONE_TILE, module=pmut.load(safe))
  assert r.violation is None, r.violation.format()


def test_unknown_primitive_refused(monkeypatch):
  # commit_smem stands in for a synchronisation the extractor was never taught.
  monkeypatch.setattr(extract, "HANDLED", extract.HANDLED - {"commit_smem"})
  with pytest.raises(extract.UnknownPrimitive, match="commit_smem"):
    pe.extract_case(ONE_TILE, ((0, 1),))


def test_mutant_edits_match_the_kernel_once():
  # mutated_source raises unless every edit matches exactly once and keeps
  # the line count; a kernel edit that moves a mutated line fails here first.
  for m in pmut.MUTANTS + pmut.BACKWARD_MUTANTS + pmut.SAFE:
    original = open(f"{pmut.KERNEL_DIR}/{m.file}").read()
    src = pmut.mutated_source(m)
    assert src != original and src.count("\n") == original.count("\n"), m.name
