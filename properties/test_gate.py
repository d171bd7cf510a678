"""The gate's bookkeeping: JUnit counts, the summary table, the exit rule."""

from __future__ import annotations

from harness import gate


def test_junit_counts_are_read(tmp_path):
  xml = tmp_path / "r.xml"
  xml.write_text('<testsuites><testsuite tests="10" failures="1" errors="1" skipped="3"/>'
                 '<testsuite tests="2" failures="0" errors="0" skipped="0"/></testsuites>')
  assert gate._junit_counts(xml) == (7, 2, 3)


def test_summary_fails_when_any_step_fails_and_names_skips():
  steps = [gate.StepResult("cpu-properties", "PASS", 5),
           gate.StepResult("gpu-properties", "SKIPPED", detail="no sm90 GPU here"),
           gate.StepResult("proofs", "FAIL", 23, 1)]
  text = gate.render(steps, "no GPU")
  assert "overall: **FAIL**" in text and "no sm90 GPU here" in text
  assert "overall: **PASS**" in gate.render(steps[:2], "no GPU")
