"""The harness catches the catalogued kernel defects with the intent each was
added for (harness/tools/mutants.py), on the GPU.

Each mutant is a source patch applied to a temporary copy of the package; the
cases run in a child process there (a mutant may hang), and the same cases
run on the shipped kernel must pass.  The whole catalogue, with the tests
that kill each mutant, is ``python -m harness mutants``; these four keep the
sharper claims: the base-2 residual passes the output check and fails only
the residual and the gradients, the missing carry fails the persistent cases,
and an altered threshold branch fails the golden check the gate runs.
"""

from __future__ import annotations

import json

import pytest

from harness.tools import mutants

pytestmark = pytest.mark.gpu


def _lines(argv, mutant=None, timeout=300):
  rc, out = mutants.run_in_copy(mutant, ["-m", *argv], timeout)
  lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
  return rc, {d["case"]: d for d in lines}, out


def test_carry_removed_variant_fails_the_persistent_properties():
  """With prev_iters dropped (ring position from the tile-local step), the
  persistent kernel returns wrong results, crashes or hangs on tiles whose
  trip counts vary; the kernel as shipped passes the same cases."""
  rc, good, out = _lines(["harness.tools.mutant_run", "carry"])
  assert rc == 0 and good and all(d["passed"] for d in good.values()), out[-3000:]
  rc, bad, out = _lines(["harness.tools.mutant_run", "carry"], mutants.by_name("no-prev-iters-carry"),
                        timeout=150)
  if rc is None:
    return  # hung on a fill that never came: caught
  caught = rc != 0 or len(bad) < len(good) or not all(d["passed"] for d in bad.values())
  assert caught, f"the carry-removed kernel passed every case: {out[-3000:]}"


def test_base2_residual_passes_the_output_and_fails_the_residual():
  """m stored in base 2: out and l stay within the rule, m does not (the bug
  a forward-only check misses); the shipped kernel passes all three."""
  rc, good, out = _lines(["harness.tools.mutant_run", "residuals"])
  assert rc == 0 and all(d["passed"] for d in good.values()), out[-3000:]
  rc, bad, out = _lines(["harness.tools.mutant_run", "residuals"], mutants.by_name("residual-m-base2"))
  (line,) = bad.values()
  assert line["arrays"] == {"out": True, "m": False, "l": True}, out[-3000:]


def test_base2_residual_gets_the_gradients_wrong():
  """The same defect reaches the backward through the residuals: the
  gradients break the rule where the shipped kernel's keep it."""
  rc, good, out = _lines(["harness.tools.mutant_run", "gradients"])
  assert rc == 0 and all(d["passed"] for d in good.values()), out[-3000:]
  rc, bad, out = _lines(["harness.tools.mutant_run", "gradients"], mutants.by_name("residual-m-base2"))
  assert bad and not any(d["passed"] for d in bad.values()), out[-3000:]


def test_deliberate_numerical_change_fails_the_golden_check():
  """The rescale_threshold branch altered (acc rescaled, l not): the golden
  check, run as the gate runs it, reports regression and exits non-zero."""
  if not (mutants.REPO / "golden" / "manifest.json").exists():
    pytest.fail("no goldens committed: run `python -m harness golden update` on an H200")
  rc, out = mutants.run_in_copy(mutants.by_name("threshold-branch-skips-l"),
                                ["-m", "harness", "golden", "check"], 300)
  assert rc is not None and rc != 0, out[-3000:]
  assert "regression" in out, out[-3000:]
