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


def test_error_ratios_are_tabulated_per_property(tmp_path, monkeypatch):
  """What harness.conformance logs under the gate becomes one row per test
  function (parameters folded), the worst ratio per array."""
  from harness import conformance
  from harness.tolerance import check_tolerance
  import numpy as np

  monkeypatch.setenv(conformance.RATIO_LOG_ENV, str(tmp_path))
  ref = np.linspace(-1.0, 1.0, 64)
  naive = ref + 1e-3
  for shard, err in (("[0]", 1e-4), ("[1]", 5e-4)):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"properties/t.py::test_x{shard} (call)")
    conformance.log_ratios([check_tolerance(ref + err, ref, naive, np.float32, name="dq")])
  monkeypatch.setenv("PYTEST_CURRENT_TEST", "properties/t.py::test_y (call)")
  conformance.log_ratios([check_tolerance(ref, ref, naive, np.float32, name="out")])
  table = gate.error_ratio_table(tmp_path)
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  header, _, *body = table.splitlines()
  assert cells(header) == ["property", "cases", "comparisons", "broke the rule", "out", "dq"]
  rows = {cells(line)[0]: cells(line)[1:] for line in body}
  worst = check_tolerance(ref + 5e-4, ref, naive, np.float32).ratio
  assert rows == {"properties/t.py::test_x": ["2", "2", "0", "-", f"{worst:.3f}"],
                  "properties/t.py::test_y": ["1", "1", "0", "0.000", "-"]}
  monkeypatch.setenv("PYTEST_CURRENT_TEST", "properties/t.py::test_y (call)")
  conformance.log_ratios([check_tolerance(ref + 1.0, ref, naive, np.float32, name="out")])
  # A case comparing two arrays counts once among the cases, twice among
  # the comparisons.
  monkeypatch.setenv("PYTEST_CURRENT_TEST", "properties/t.py::test_z (call)")
  conformance.log_ratios([check_tolerance(ref, ref, naive, np.float32, name="out"),
                          check_tolerance(ref, ref, naive, np.float32, name="dq")])
  rows = {cells(line)[0]: cells(line)[1:] for line in gate.error_ratio_table(tmp_path)
          .splitlines()[2:]}
  y = rows["properties/t.py::test_y"]
  assert y[:3] == ["2", "2", "1"] and float(y[3]) > 1
  assert rows["properties/t.py::test_z"][:3] == ["1", "2", "0"]
  assert gate.error_ratio_table(tmp_path / "empty") is None


def test_nothing_is_logged_unless_the_gate_asks(tmp_path, monkeypatch):
  from harness import conformance
  from harness.tolerance import check_tolerance
  import numpy as np
  monkeypatch.delenv(conformance.RATIO_LOG_ENV, raising=False)
  monkeypatch.chdir(tmp_path)
  ref = np.ones(4)
  conformance.log_ratios([check_tolerance(ref, ref, ref, np.float32)])
  assert list(tmp_path.iterdir()) == []
