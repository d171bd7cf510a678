"""The harness catches deliberate kernel defects (kernel/mutants.py) on the GPU.

Each test runs a mutant and asserts the *failure*: a property suite that
cannot fail on a known bug class proves nothing.  The residual-base-2 mutant
is covered next to the properties it breaks (test_forward_gpu,
test_gradients_gpu); these two need a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel import mutants

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent


def _child(args, *, env_extra=None, timeout):
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **(env_extra or {}))
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _verdicts(stdout: str) -> dict[str, bool]:
  return {d["case"]: d["passed"] for d in map(json.loads, filter(None, stdout.splitlines()))
          if "case" in d}


def test_carry_removed_variant_fails_the_persistent_properties():
  """With prev_iters dropped (ring position from the tile-local step), the
  persistent kernel returns wrong results, crashes or hangs on tiles whose
  trip counts vary; the kernel as shipped passes the same cases."""
  correct = _child(["harness.mutant_run", "none"], timeout=300)
  assert correct.returncode == 0, correct.stderr[-2000:]
  good = _verdicts(correct.stdout)
  assert good and all(good.values()), correct.stdout
  try:
    broken = _child(["harness.mutant_run", mutants.NO_PREV_ITERS_CARRY], timeout=120)
  except subprocess.TimeoutExpired:
    return  # hung on a fill that never came: caught
  bad = _verdicts(broken.stdout)
  caught = broken.returncode != 0 or len(bad) < len(good) or not all(bad.values())
  assert caught, f"the carry-removed kernel passed every case: {broken.stdout}"


def test_deliberate_numerical_change_fails_the_golden_check():
  """The rescale_threshold branch altered through a private flag: the golden
  check reports regression and exits non-zero, so the gate's golden step
  fails (run here exactly as the gate runs it)."""
  from harness import gate
  if not (REPO / "golden" / "manifest.json").exists():
    pytest.fail("no goldens committed: run `python -m harness golden update` on an H200")
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    os.environ[mutants.ENV] = mutants.THRESHOLD_BRANCH_SKIPS_L
    try:
      step = gate.run_module_step("golden", "harness.golden", ["check"], Path(tmp))
      table = (Path(tmp) / "golden.md").read_text()
    finally:
      del os.environ[mutants.ENV]
  assert step.status == "FAIL", table
  assert "regression" in table and step.failed > 0, table
