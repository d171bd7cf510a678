"""The CI workflow files parse and do what the gate relies on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CI = Path(__file__).resolve().parents[2] / "ci" / "workflows"
WORKFLOWS = sorted(CI.glob("*.yml"))


def _load(path):
  doc = yaml.safe_load(path.read_text())
  # YAML 1.1 reads the key `on` as True.
  if True in doc:
    doc["on"] = doc.pop(True)
  return doc


def test_there_are_a_gpu_and_a_cpu_workflow():
  assert {p.name for p in WORKFLOWS} >= {"gpu-gate.yml", "cpu.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_is_well_formed(path):
  doc = _load(path)
  assert isinstance(doc.get("name"), str)
  assert doc.get("on"), "no trigger"
  jobs = doc.get("jobs")
  assert isinstance(jobs, dict) and jobs
  for name, job in jobs.items():
    assert "runs-on" in job, f"{name}: no runs-on"
    steps = job.get("steps")
    assert isinstance(steps, list) and steps, f"{name}: no steps"
    for step in steps:
      assert ("uses" in step) != ("run" in step), f"{name}: a step needs exactly one of uses/run"
    runs = " ".join(s.get("run", "") for s in steps)
    for token in runs.split():
      if token.startswith("ci/") and token.endswith(".sh"):
        assert (CI.parent.parent / token).exists(), f"{path.name} runs missing {token}"


def test_gpu_gate_runs_on_sm90_for_kernel_changes_and_publishes_results():
  doc = _load(CI / "gpu-gate.yml")
  assert "kernel/**" in doc["on"]["pull_request"]["paths"]
  job = doc["jobs"]["gate"]
  assert "self-hosted" in job["runs-on"] and "sm90" in job["runs-on"]
  runs = " ".join(s.get("run", "") for s in job["steps"])
  assert "ci/tox.sh -e gate-gpu" in runs
  uploads = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
  assert uploads and uploads[0]["with"]["path"] == "results/"
  assert "golden.md" in runs and "gh pr comment" in runs


def test_cpu_workflow_runs_the_readme_test_command():
  doc = _load(CI / "cpu.yml")
  runs = " ".join(s.get("run", "") for job in doc["jobs"].values() for s in job["steps"])
  assert "bash ci/tox.sh -e tests" in runs
  readme = (CI.parent.parent / "README.md").read_text()
  assert "bash ci/tox.sh -e tests" in readme
