"""The gate's bookkeeping: JUnit counts, the summary table, the exit rule."""

from __future__ import annotations

from harness.tools import gate


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
  """What harness.numerics.conformance logs under the gate becomes one row per test
  function (parameters folded), the worst ratio per array."""
  from harness.numerics import conformance
  from harness.numerics.tolerance import check_tolerance
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
  from harness.numerics import conformance
  from harness.numerics.tolerance import check_tolerance
  import numpy as np
  monkeypatch.delenv(conformance.RATIO_LOG_ENV, raising=False)
  monkeypatch.chdir(tmp_path)
  ref = np.ones(4)
  conformance.log_ratios([check_tolerance(ref, ref, ref, np.float32)])
  assert list(tmp_path.iterdir()) == []


def _fake_gate(monkeypatch, has_gpu):
  """gate.main with every step replaced by a recorder (no pytest, no z3)."""
  ran = []

  def step(name, *_args, **_kw):
    ran.append(name)
    return gate.StepResult(name, "PASS", passed=1)

  monkeypatch.setattr(gate, "run_pytest", step)
  monkeypatch.setattr(gate, "run_module_step", step)
  monkeypatch.setattr(gate, "gpu_summary", lambda: (has_gpu, "fake device"))
  return ran


def test_steps_runs_the_chosen_steps_and_says_the_run_was_partial(tmp_path, monkeypatch):
  ran = _fake_gate(monkeypatch, has_gpu=True)
  assert gate.main(["--results", str(tmp_path), "--steps", "gpu-properties,golden"]) == 0
  assert ran == ["gpu-properties", "golden"]
  text = (tmp_path / "summary.md").read_text()
  assert text.count(gate.NOT_SELECTED) == 2
  assert "overall: **PASS** (partial: cpu-properties, proofs not selected)" in text


def test_all_steps_run_by_default_and_gpu_steps_skip_without_a_gpu(tmp_path, monkeypatch):
  ran = _fake_gate(monkeypatch, has_gpu=False)
  assert gate.main(["--results", str(tmp_path)]) == 0
  assert ran == ["cpu-properties", "proofs"]
  text = (tmp_path / "summary.md").read_text()
  assert "no sm90 GPU here (fake device)" in text and "partial" not in text


def test_an_unknown_step_is_refused_by_name(tmp_path, monkeypatch, capsys):
  import pytest
  ran = _fake_gate(monkeypatch, has_gpu=True)
  with pytest.raises(SystemExit) as exit_info:
    gate.main(["--results", str(tmp_path), "--steps", "gpu-properties,goldens"])
  assert exit_info.value.code == 2 and ran == []
  assert "--steps" in capsys.readouterr().err


def test_the_golden_steps_counts_come_from_the_golden_tools_own_summary(tmp_path, monkeypatch):
  """The step reads golden.render's closing line (in golden.STATUSES order):
  passing verdicts count as passed, the others as failed."""
  from harness.tools import golden
  verdicts = [golden.Verdict("a", "identical"), golden.Verdict("b", "reordered"),
              golden.Verdict("c", "drift"), golden.Verdict("d", "regression")]
  monkeypatch.setattr(gate, "run_limited",
                      lambda *a, **kw: (1, golden.render(verdicts) + "\n"))
  step = gate.run_module_step("golden", "harness.tools.golden", ["check"], tmp_path)
  assert (step.status, step.passed, step.failed) == ("FAIL", 3, 1)
  assert "1 reordered, 1 drift" in step.detail


def test_the_suite_and_the_proofs_need_no_z3(tmp_path):
  """GPU machines may have no z3-solver (the H200 image has none): with z3 made unimportable every test module still collects, the
  proofs' included, and the proof command's modules import."""
  import os
  import subprocess
  import sys
  from pathlib import Path
  (tmp_path / "z3.py").write_text('raise ImportError("no z3 here (test)")\n')
  root = Path(__file__).resolve().parents[2]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
  run = subprocess.run([sys.executable, "-m", "pytest", "properties/", "--collect-only", "-q",
                        "-p", "no:cacheprovider"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  assert "test_gradients_gpu.py" in run.stdout and "test_extracted_proof.py" in run.stdout
  imp = subprocess.run([sys.executable, "-c", "import harness.proofs.prove, harness.proofs.search"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
  assert imp.returncode == 0, imp.stderr[-2000:]


def test_a_step_past_its_limit_fails_and_a_hung_test_is_named(tmp_path, monkeypatch):
  """The step's limit stops a pytest step (FAIL, said so); a test the
  per-test watchdog stopped is named in the step's detail."""
  from pathlib import Path
  from harness.tools import watchdog

  def hung_run(cmd, *, timeout, env=None, capture=False):
    folder = Path((env or {}).get(watchdog.HANG_DIR_ENV, tmp_path / "elsewhere"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hang-1.txt").write_text("properties/t.py::test_k\n")
    return None, "" if capture else None

  monkeypatch.setattr(gate, "run_limited", hung_run)
  step = gate.run_pytest("gpu-properties", "gpu", tmp_path, [], step_timeout=5, test_timeout=2)
  assert step.status == "FAIL" and "limit of 5 s" in step.detail
  assert "hung (over 2 s): properties/t.py::test_k" in step.detail
  step = gate.run_module_step("golden", "harness.tools.golden", ["check"], tmp_path, step_timeout=5)
  assert step.status == "FAIL" and "limit of 5 s" in step.detail


def test_the_limited_runner_kills_what_overruns():
  import sys
  import time
  start = time.time()
  rc, out = gate.run_limited([sys.executable, "-c", "import time; print('hi', flush=True); "
                              "time.sleep(60)"], timeout=2, capture=True)
  assert rc is None and "hi" in out and time.time() - start < 30


def test_memcheck_reports_skipped_with_the_tools_own_words(tmp_path, monkeypatch):
  monkeypatch.setattr(gate.shutil, "which", lambda name: None)
  assert gate.run_memcheck(tmp_path).status == "SKIPPED"
  monkeypatch.setattr(gate.shutil, "which", lambda name: "/opt/cuda/bin/compute-sanitizer")
  refusal = "========= Error: Target application terminated before first instrumented API call"
  monkeypatch.setattr(gate, "run_limited", lambda *a, **kw: (255, refusal + "\n"))
  step = gate.run_memcheck(tmp_path)
  assert step.status == "SKIPPED" and "terminated before first instrumented" in step.detail
  monkeypatch.setattr(gate, "run_limited",
                      lambda *a, **kw: (3, "========= ERROR SUMMARY: 2 errors\n"))
  assert gate.run_memcheck(tmp_path).status == "FAIL"
  monkeypatch.setattr(gate, "run_limited",
                      lambda *a, **kw: (0, "========= ERROR SUMMARY: 0 errors\n"))
  assert gate.run_memcheck(tmp_path).status == "PASS"


def test_optional_steps_run_only_when_named(tmp_path, monkeypatch):
  ran = _fake_gate(monkeypatch, has_gpu=True)
  monkeypatch.setattr(gate, "run_memcheck",
                      lambda results, **kw: (ran.append("memcheck"),
                                             gate.StepResult("memcheck", "PASS", 1))[1])
  assert gate.main(["--results", str(tmp_path)]) == 0
  assert "mutants" not in ran and "memcheck" not in ran
  (tmp_path / "mutants").mkdir()
  (tmp_path / "mutants" / "mutants.md").write_text("# Kernel mutants\n\nmutation score: 1/1\n")
  assert gate.main(["--results", str(tmp_path), "--steps", "mutants,memcheck"]) == 0
  assert ran[-2:] == ["mutants", "memcheck"]
  assert "## Kernel mutants" in (tmp_path / "summary.md").read_text()


def test_the_summary_names_jax_commit_and_date(monkeypatch):
  monkeypatch.setenv("FLASH_COMMIT", "abc1234")
  about = gate.provenance()
  assert "commit abc1234" in about and "jax " in about
  text = gate.render([gate.StepResult("proofs", "PASS")], "no GPU", about)
  assert text.splitlines()[2] == f"device: no GPU; {about}"


def test_a_part_of_the_gpu_properties_is_named_and_filed_apart(tmp_path, monkeypatch):
  """--part K/N reaches pytest as --part K/N; the step is "gpu-properties
  K/N" and its JUnit file gpu-properties-partKofN.xml, so two parts can
  share a results folder; a malformed part is refused by name."""
  import pytest
  seen = []

  def run(cmd, *, timeout, env=None, capture=False):
    seen.append(cmd)
    junit = next(c.split("=", 1)[1] for c in cmd if c.startswith("--junitxml="))
    Path(junit).write_text('<testsuite tests="3" failures="1" errors="0" skipped="0"/>')
    return 1, None

  from pathlib import Path
  monkeypatch.setattr(gate, "run_limited", run)
  step = gate.run_pytest("gpu-properties", "gpu", tmp_path, ["-rs"], part="2/3")
  assert (step.name, step.status, step.passed, step.failed) == ("gpu-properties 2/3", "FAIL", 2, 1)
  assert seen[0][-3:] == ["-rs", "--part", "2/3"]
  assert (tmp_path / "gpu-properties-part2of3.xml").exists()
  assert gate.step_files(step.name) == "gpu-properties-part2of3"
  for bad in ("0/2", "3/2", "1-2", "a/b"):
    with pytest.raises(ValueError, match="--part"):
      gate.parse_part(bad)


def test_the_smoke_step_runs_the_smoke_marker_only_when_named(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(gate, "run_pytest",
                      lambda name, marker, *a, **kw: (ran.append((name, marker)),
                                                      gate.StepResult(name, "PASS", 1))[1])
  monkeypatch.setattr(gate, "run_module_step", lambda name, *a, **kw: gate.StepResult(name, "PASS", 1))
  monkeypatch.setattr(gate, "gpu_summary", lambda: (True, "fake device"))
  assert gate.main(["--results", str(tmp_path)]) == 0
  assert ("smoke", "gpu and smoke") not in ran
  assert gate.main(["--results", str(tmp_path), "--steps", "smoke"]) == 0
  assert ran[-1] == ("smoke", "gpu and smoke")
