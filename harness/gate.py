"""The conformance gate: every check this machine can run, one summary table.

``python -m harness gate [--results DIR] [--steps NAMES] [-- PYTEST_ARGS]``

Steps, in order:

1. **cpu-properties** — ``pytest -n auto properties/ -m "not gpu"``: the float64
   reference, the executable model of the kernel's arithmetic, bad input,
   heuristics, CUDA lowering of every config (no GPU needed).
2. **proofs** — the Z3 proofs of the stage-ring protocol (``harness.prove``).
3. **gpu-properties** — ``pytest -n auto properties/ -m gpu`` on an sm90 GPU.
4. **golden** — the golden-file check on an sm90 GPU (``harness.golden``).

Steps 3 and 4 are reported as SKIPPED, with the reason, on a machine without
an sm90 GPU.  ``--steps`` runs a subset (the others are reported as SKIPPED,
"not selected", and the overall line says the run was partial): where GPU time
is short, ``--steps gpu-properties,golden`` after the CPU steps passed on the
same commit elsewhere.  JUnit XML of each pytest step and
``summary.md`` go to the results folder, and, for each pytest step, the worst error ratio against float64 per
property and array (``<step>-error-ratios.md``, also in ``summary.md``).  The
exit status is non-zero when any step fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import golden
from harness.conformance import RATIO_LOG_ENV

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class StepResult:
  name: str
  status: str                  # PASS, FAIL, SKIPPED
  passed: int = 0
  failed: int = 0
  skipped: int = 0
  seconds: float = 0.0
  detail: str = ""


def gpu_summary() -> tuple[bool, str]:
  """(has an sm90 GPU, description), asked in a child process so this one
  never initialises CUDA or takes GPU memory."""
  code = ("import jax\n"
          "try:\n  ds = jax.devices('gpu')\nexcept RuntimeError:\n  ds = []\n"
          "cc = [getattr(d, 'compute_capability', '?') for d in ds]\n"
          "print(sum(c == '9.0' for c in cc), ' '.join(d.device_kind + ' sm' + c.replace('.', '') for d, c in zip(ds, cc)) or 'no GPU')\n")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env).stdout.strip().splitlines()
    count, desc = out[-1].split(" ", 1)
    return int(count) > 0, desc
  except Exception as err:  # a broken CUDA install must not hide the CPU steps
    return False, f"GPU probe failed: {err}"


def _junit_counts(path: Path) -> tuple[int, int, int]:
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root)
  tests = sum(int(s.get("tests", 0)) for s in suites)
  failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
  skipped = sum(int(s.get("skipped", 0)) for s in suites)
  return tests - failed - skipped, failed, skipped


ARRAYS = ("out", "m", "l", "dq", "dk", "dv", "dbias")


def error_ratio_table(folder: Path) -> str | None:
  """Markdown: per property (test function, parameters folded), how many
  cases it checked against float64 (each case compares each of its arrays
  once, so: the most comparisons of any one array), how many comparisons it
  made and how many of them broke the rule, and the worst error ratio
  (error / the tolerance rule's bound; <= 1 passes) per array, from the JSON
  lines of harness.conformance.log_ratios.  None when nothing was recorded.
  A property that feeds a deliberate defect (and passes by catching it)
  shows broken comparisons and ratios > 1."""
  worst: dict[str, dict[str, float]] = {}
  per_array: dict[str, dict[str, int]] = {}   # comparisons per property and array
  broke: dict[str, int] = {}
  for path in sorted(folder.glob("ratios-*.jsonl")):
    for line in path.read_text().splitlines():
      rec = json.loads(line)
      prop = rec["test"].split("[", 1)[0]
      per = worst.setdefault(prop, {})
      per[rec["array"]] = max(per.get(rec["array"], 0.0), float(rec["ratio"]))
      seen = per_array.setdefault(prop, {})
      seen[rec["array"]] = seen.get(rec["array"], 0) + 1
      broke[prop] = broke.get(prop, 0) + (not rec["passed"])
  if not worst:
    return None
  arrays = [a for a in ARRAYS if any(a in per for per in worst.values())]
  lines = ["| property | cases | comparisons | broke the rule | " + " | ".join(arrays) + " |",
           "|---|---|---|---|" + "---|" * len(arrays)]
  for prop in sorted(worst):
    cells = [f"{worst[prop][a]:.3f}" if a in worst[prop] else "-" for a in arrays]
    counts = per_array[prop].values()
    lines.append(f"| {prop} | {max(counts)} | {sum(counts)} | {broke[prop]} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run_pytest(name: str, marker: str, results: Path, extra: list[str]) -> StepResult:
  junit = results / f"{name}.xml"
  cmd = [sys.executable, "-m", "pytest", "-n", "auto", "properties/", "-m", marker,
         f"--junitxml={junit}", "-q", *extra]
  ratios = results / f"{name}-ratios"
  shutil.rmtree(ratios, ignore_errors=True)
  ratios.mkdir(parents=True)
  start = time.time()
  proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, RATIO_LOG_ENV: str(ratios)})
  seconds = time.time() - start
  table = error_ratio_table(ratios)
  if table is not None:
    (results / f"{name}-error-ratios.md").write_text(
        f"# Worst error ratio per property ({name})\n\n{table}")
  if not junit.exists():
    return StepResult(name, "FAIL", seconds=seconds, detail=f"pytest exited {proc.returncode}, no report")
  passed, failed, skipped = _junit_counts(junit)
  ok = proc.returncode == 0 and failed == 0 and passed > 0
  detail = "" if ok else f"pytest exited {proc.returncode}"
  if passed == 0 and failed == 0:
    detail = "no test ran"
  return StepResult(name, "PASS" if ok else "FAIL", passed, failed, skipped, seconds, detail)


def run_module_step(name: str, module: str, args: list[str], results: Path) -> StepResult:
  """``python -m harness <command>``; its output is shown and kept as
  ``results/<name>.md`` (the golden step's is the drift table)."""
  if importlib.util.find_spec(module) is None:
    return StepResult(name, "FAIL", detail=f"{module} is missing")
  start = time.time()
  proc = subprocess.run([sys.executable, "-m", "harness", module.split(".")[-1], *args],
                        cwd=REPO, capture_output=True, text=True)
  print(proc.stdout, end="")
  print(proc.stderr, end="", file=sys.stderr)
  (results / f"{name}.md").write_text(proc.stdout)
  ok = proc.returncode == 0
  result = StepResult(name, "PASS" if ok else "FAIL", seconds=time.time() - start,
                      detail="" if ok else f"exit status {proc.returncode}")
  # "N/M proven" (prove) and "k identical, ... regression" (golden) become counts.
  if m := re.search(r"(\d+)/(\d+) proven", proc.stdout):
    result.passed, result.failed = int(m[1]), int(m[2]) - int(m[1])
  # golden's closing line counts its verdicts, in golden.STATUSES order.
  if m := re.search(", ".join(rf"(\d+) {s}" for s in golden.STATUSES), proc.stdout):
    n = dict(zip(golden.STATUSES, map(int, m.groups())))
    result.passed = sum(n[s] for s in golden.PASSING)
    result.failed = sum(n.values()) - result.passed
    result.detail = (result.detail + f" {n['reordered']} reordered, {n['drift']} drift").strip()
  return result


STEPS = ("cpu-properties", "proofs", "gpu-properties", "golden")
NOT_SELECTED = "not selected (--steps)"


def selected_steps(spec: str) -> tuple[str, ...]:
  """The step names of a comma-separated ``--steps`` value, checked."""
  names = tuple(n.strip() for n in spec.split(",") if n.strip())
  unknown = [n for n in names if n not in STEPS]
  if unknown or not names:
    raise ValueError(f"--steps: expected a comma-separated subset of {', '.join(STEPS)}, "
                     f"got {spec!r}")
  return names


def render(steps: list[StepResult], device: str) -> str:
  lines = [f"# Conformance gate\n\ndevice: {device}\n",
           "| step | status | passed | failed | skipped | time | detail |",
           "|---|---|---|---|---|---|---|"]
  for s in steps:
    lines.append(f"| {s.name} | {s.status} | {s.passed} | {s.failed} | {s.skipped} "
                 f"| {s.seconds:.0f}s | {s.detail} |")
  overall = "FAIL" if any(s.status == "FAIL" for s in steps) else "PASS"
  left_out = [s.name for s in steps if s.detail == NOT_SELECTED]
  partial = f" (partial: {', '.join(left_out)} not selected)" if left_out else ""
  lines.append(f"\noverall: **{overall}**{partial}")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness gate")
  parser.add_argument("--results", default="results", help="folder for JUnit XML and summary.md")
  parser.add_argument("--steps", default=",".join(STEPS),
                      help=f"comma-separated subset of {', '.join(STEPS)} (default: all)")
  parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest")
  args = parser.parse_args(argv)
  try:
    chosen = selected_steps(args.steps)
  except ValueError as err:
    parser.error(str(err))
  results = (REPO / args.results).resolve()
  results.mkdir(parents=True, exist_ok=True)

  has_gpu, device = gpu_summary()
  runners = {
      "cpu-properties": lambda: run_pytest("cpu-properties", "not gpu", results,
                                           args.pytest_args),
      "proofs": lambda: run_module_step("proofs", "harness.prove", [], results),
      "gpu-properties": lambda: run_pytest("gpu-properties", "gpu", results, args.pytest_args),
      "golden": lambda: run_module_step("golden", "harness.golden", ["check"], results),
  }
  needs_gpu = ("gpu-properties", "golden")
  steps = []
  for name in STEPS:
    if name not in chosen:
      steps.append(StepResult(name, "SKIPPED", detail=NOT_SELECTED))
    elif name in needs_gpu and not has_gpu:
      steps.append(StepResult(name, "SKIPPED", detail=f"no sm90 GPU here ({device})"))
    else:
      steps.append(runners[name]())

  text = render(steps, device)
  for s in steps:
    ratios = results / f"{s.name}-error-ratios.md"
    if s.status != "SKIPPED" and ratios.exists():
      text += "\n" + ratios.read_text().replace("# Worst", "## Worst", 1)
  (results / "summary.md").write_text(text)
  print("\n" + text)
  return 1 if any(s.status == "FAIL" for s in steps) else 0
