"""The conformance gate: every check this machine can run, one summary table.

``python -m harness gate [--results DIR] [--steps NAMES] [-- PYTEST_ARGS]``

Steps, in order:

1. **cpu-properties** — ``pytest -n auto properties/ -m "not gpu"``: the float64
   reference, the executable model of the kernel's arithmetic, bad input,
   heuristics, CUDA lowering of every config (no GPU needed).
2. **proofs** — the barrier and stage-ring protocol of every launch, read out of
   the traced kernels and proved for every environment (``harness.proofs.prove``).
3. **gpu-properties** — ``pytest -n auto properties/ -m gpu`` on an sm90 GPU.
4. **golden** — the golden-file check on an sm90 GPU (``harness.tools.golden``).

Optional steps, run only when named in ``--steps``:

5. **smoke** — ``pytest -n auto properties/ -m "gpu and smoke"``: one call of
   every shipped path through the public API against float64
   (properties/gpu/test_smoke_gpu.py), for a GPU run too short for step 3.
6. **mutants** — ``python -m harness mutants``: every catalogued kernel defect
   against the tests that must kill it; its table and mutation score go into
   the summary (harness/tools/mutants.py).
7. **memcheck** — ``compute-sanitizer --tool memcheck`` on one small forward
   and backward, restricted to the kernels; SKIPPED with the tool's own
   message where it is missing or the runtime refuses it.

``--part K/N`` runs part K of N of step 3 (pytest's ``--part``,
properties/conftest.py; the step is named "gpu-properties K/N" and its files
"gpu-properties-partKofN"): the whole step outgrew one 10-minute command on
the H200.  Steps 3 to 7 are reported as SKIPPED, with the reason, on a machine without
an sm90 GPU.  Every step runs under a time limit (``--step-timeout``), and
every pytest test under a per-test one (``--test-timeout``, the watchdog of
harness/tools/watchdog.py): a hang fails the step and the summary names the test
that hung.  ``--steps`` runs a subset (the others are reported as SKIPPED,
"not selected", and the overall line says the run was partial): where GPU time
is short, ``--steps gpu-properties,golden`` after the CPU steps
passed on the same commit elsewhere.  JUnit XML of each pytest step and
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

from harness.tools import golden, watchdog
from harness.numerics.conformance import RATIO_LOG_ENV

REPO = Path(__file__).resolve().parents[2]


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
  lines of harness.numerics.conformance.log_ratios.  None when nothing was recorded.
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


# Seconds: a whole step, and one pytest test (the watchdog), a few times what
# they took on the H200 (docs/decisions/device-step-time-limits.md).
STEP_TIMEOUT = 1200.0
TEST_TIMEOUT = 300.0


def run_limited(cmd: list[str], *, timeout: float, env=None, capture=False):
  """(returncode or None when the limit stopped it, stdout or None): the
  command in its own process group, all of which is killed at the limit."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)
    out, err = proc.communicate()
    proc.returncode = None
  if capture:
    print(out or "", end="")
    print(err or "", end="", file=sys.stderr)
    return proc.returncode, (out or "") + (err or "")
  return proc.returncode, None


def parse_part(spec: str) -> tuple[int, int]:
  """(K, N) of a ``--part K/N`` value: 1 <= K <= N, else ValueError."""
  m = re.fullmatch(r"(\d+)/(\d+)", spec.strip())
  if m is None or not 1 <= int(m[1]) <= int(m[2]):
    raise ValueError(f"--part: expected K/N with 1 <= K <= N (say 1/2), got {spec!r}")
  return int(m[1]), int(m[2])


def step_files(name: str) -> str:
  """The stem of a step's files: its name, "gpu-properties 1/2" as
  "gpu-properties-part1of2"."""
  step, _, part = name.partition(" ")
  return step if not part else f"{step}-part{part.replace('/', 'of')}"


def run_pytest(name: str, marker: str, results: Path, extra: list[str], *,
               step_timeout: float = STEP_TIMEOUT,
               test_timeout: float = TEST_TIMEOUT, part: str | None = None) -> StepResult:
  if part is not None:
    k, n = parse_part(part)
    name, extra = f"{name} {k}/{n}", [*extra, "--part", f"{k}/{n}"]
  files = step_files(name)
  junit = results / f"{files}.xml"
  cmd = [sys.executable, "-m", "pytest", "-n", "auto", "properties/", "-m", marker,
         f"--junitxml={junit}", "-q", *extra]
  ratios = results / f"{files}-ratios"
  hangs = results / f"{files}-hangs"
  for folder in (ratios, hangs):
    shutil.rmtree(folder, ignore_errors=True)
  ratios.mkdir(parents=True)
  start = time.time()
  env = {**os.environ, RATIO_LOG_ENV: str(ratios), watchdog.TEST_TIMEOUT_ENV: str(test_timeout),
         watchdog.HANG_DIR_ENV: str(hangs)}
  rc, _ = run_limited(cmd, timeout=step_timeout, env=env)
  seconds = time.time() - start
  hung = watchdog.hung_tests(folder=hangs)
  hung_note = f"hung (over {test_timeout:.0f} s): {', '.join(hung)}" if hung else ""
  if rc is None:
    return StepResult(name, "FAIL", seconds=seconds,
                      detail=f"stopped at the step's limit of {step_timeout:.0f} s {hung_note}".strip())
  table = error_ratio_table(ratios)
  if table is not None:
    (results / f"{files}-error-ratios.md").write_text(
        f"# Worst error ratio per property ({name})\n\n{table}")
  if not junit.exists():
    return StepResult(name, "FAIL", seconds=seconds,
                      detail=f"pytest exited {rc}, no report {hung_note}".strip())
  passed, failed, skipped = _junit_counts(junit)
  ok = rc == 0 and failed == 0 and passed > 0 and not hung
  detail = "" if ok else f"pytest exited {rc}"
  if passed == 0 and failed == 0:
    detail = "no test ran"
  detail = f"{detail} {hung_note}".strip()
  return StepResult(name, "PASS" if ok else "FAIL", passed, failed, skipped, seconds, detail)


def run_module_step(name: str, module: str, args: list[str], results: Path, *,
                    step_timeout: float = STEP_TIMEOUT) -> StepResult:
  """``python -m harness <command>``; its output is shown and kept as
  ``results/<name>.md`` (the golden step's is the drift table)."""
  if importlib.util.find_spec(module) is None:
    return StepResult(name, "FAIL", detail=f"{module} is missing")
  start = time.time()
  rc, output = run_limited([sys.executable, "-m", "harness", module.split(".")[-1], *args],
                           timeout=step_timeout, capture=True)
  (results / f"{name}.md").write_text(output)
  ok = rc == 0
  detail = ("" if ok else f"exit status {rc}" if rc is not None
            else f"stopped at the step's limit of {step_timeout:.0f} s")
  result = StepResult(name, "PASS" if ok else "FAIL", seconds=time.time() - start, detail=detail)
  stdout = output
  # "N/M proven" (prove) and "k identical, ... regression" (golden) become counts.
  if m := re.search(r"(\d+)/(\d+) proven", stdout):
    result.passed, result.failed = int(m[1]), int(m[2]) - int(m[1])
  # golden's closing line counts its verdicts, in golden.STATUSES order.
  if m := re.search(", ".join(rf"(\d+) {s}" for s in golden.STATUSES), stdout):
    n = dict(zip(golden.STATUSES, map(int, m.groups())))
    result.passed = sum(n[s] for s in golden.PASSING)
    result.failed = sum(n.values()) - result.passed
    result.detail = (result.detail + f" {n['reordered']} reordered, {n['drift']} drift").strip()
  # "mutation score: k/n = ..." (mutants): caught / not caught.
  if m := re.search(r"mutation score: (\d+)/(\d+)", stdout):
    result.passed, result.failed = int(m[1]), int(m[2]) - int(m[1])
    result.detail = (result.detail + " " + stdout[m.start():].splitlines()[0]).strip()
  return result


# The sanitizer's run: one small forward and backward (a few kernels of a few
# blocks; a whole process under racecheck did not finish in 10 minutes, GUIDE).
MEMCHECK_PROGRAM = """
import jax, jax.numpy as jnp
from kernel import api
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (1, 200, 2, 64), jnp.bfloat16)
k = jax.random.normal(ks[1], (1, 150, 1, 64), jnp.bfloat16)
v = jax.random.normal(ks[2], (1, 150, 1, 64), jnp.bfloat16)
f = lambda q, k, v: jnp.sum(api.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
print(jax.block_until_ready(jax.grad(f, argnums=(0, 1, 2))(q, k, v))[0].shape)
"""
# Mosaic GPU names a launch after its body function (kernel_body in the
# forward, body in the backward's two kernels): a substring filter (kns=).
MEMCHECK_KERNELS = "kns=body"


def run_memcheck(results: Path, *, step_timeout: float = 300.0) -> StepResult:
  """compute-sanitizer memcheck on MEMCHECK_PROGRAM, restricted to the
  kernels: PASS on "ERROR SUMMARY: 0 errors", FAIL on errors, SKIPPED with
  the tool's own words where it is missing or refuses to run."""
  tool = shutil.which("compute-sanitizer")
  if tool is None:
    return StepResult("memcheck", "SKIPPED", detail="compute-sanitizer not found on PATH")
  start = time.time()
  cmd = [tool, "--tool", "memcheck", "--kernel-name", MEMCHECK_KERNELS, "--error-exitcode", "3",
         sys.executable, "-c", MEMCHECK_PROGRAM]
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  rc, output = run_limited(cmd, timeout=step_timeout, env=env, capture=True)
  (results / "memcheck.md").write_text(output)
  seconds = time.time() - start
  summary = re.search(r"ERROR SUMMARY: (\d+) error", output)
  if rc is None:
    return StepResult("memcheck", "FAIL", seconds=seconds,
                      detail=f"stopped at the step's limit of {step_timeout:.0f} s")
  if summary is None or (rc != 0 and rc != 3):
    said = " ".join(l.strip() for l in output.strip().splitlines()[-3:])[-300:]
    return StepResult("memcheck", "SKIPPED", seconds=seconds,
                      detail=f"compute-sanitizer did not run the kernels (exit {rc}): {said}")
  errors = int(summary[1])
  return StepResult("memcheck", "PASS" if errors == 0 and rc == 0 else "FAIL",
                    passed=int(errors == 0), failed=int(errors > 0), seconds=seconds,
                    detail=summary[0])


STEPS = ("cpu-properties", "proofs", "gpu-properties", "golden", "smoke", "mutants",
         "memcheck")
DEFAULT_STEPS = STEPS[:4]
NOT_SELECTED = "not selected (--steps)"


def selected_steps(spec: str) -> tuple[str, ...]:
  """The step names of a comma-separated ``--steps`` value, checked."""
  names = tuple(n.strip() for n in spec.split(",") if n.strip())
  unknown = [n for n in names if n not in STEPS]
  if unknown or not names:
    raise ValueError(f"--steps: expected a comma-separated subset of {', '.join(STEPS)}, "
                     f"got {spec!r}")
  return names


def provenance() -> str:
  """jax version, commit and date for the summary's head.  The commit is
  ``FLASH_COMMIT`` where the caller sets it (a copied tree may carry no
  ``.git``, or a stale one), else what git says here."""
  import datetime
  import subprocess
  try:
    import jax
    jax_version = jax.__version__
  except ImportError:
    jax_version = "not installed"
  commit = os.environ.get("FLASH_COMMIT")
  if not commit:
    try:
      commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      commit = ""
  return (f"jax {jax_version}, commit {commit or 'unknown'}, "
          f"{datetime.date.today().isoformat()}")


def render(steps: list[StepResult], device: str, about: str | None = None) -> str:
  head = f"device: {device}" + (f"; {about}" if about else "")
  lines = [f"# Conformance gate\n\n{head}\n",
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
  parser.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                      help=f"comma-separated subset of {', '.join(STEPS)} "
                           f"(default: {', '.join(DEFAULT_STEPS)})")
  parser.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT,
                      help="seconds a step may run before it is stopped (FAIL)")
  parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                      help="seconds one pytest test may run (the watchdog names it)")
  parser.add_argument("--part", metavar="K/N", default=None,
                      help="run part K of N of gpu-properties (each test in one part)")
  parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest")
  args = parser.parse_args(argv)
  try:
    chosen = selected_steps(args.steps)
    if args.part is not None:
      parse_part(args.part)
  except ValueError as err:
    parser.error(str(err))
  results = (REPO / args.results).resolve()
  results.mkdir(parents=True, exist_ok=True)

  has_gpu, device = gpu_summary()
  limits = dict(step_timeout=args.step_timeout)
  tests = dict(limits, test_timeout=args.test_timeout)
  runners = {
      "cpu-properties": lambda: run_pytest("cpu-properties", "not gpu", results,
                                           args.pytest_args, **tests),
      "proofs": lambda: run_module_step("proofs", "harness.proofs.prove", [], results, **limits),
      "gpu-properties": lambda: run_pytest("gpu-properties", "gpu", results, args.pytest_args,
                                           part=args.part, **tests),
      "smoke": lambda: run_pytest("smoke", "gpu and smoke", results, args.pytest_args, **tests),
      "golden": lambda: run_module_step("golden", "harness.tools.golden", ["check"], results,
                                        **limits),
      "mutants": lambda: run_module_step(
          "mutants", "harness.tools.mutants",
          ["--out", str(results / "mutants"), "--test-timeout", str(min(args.test_timeout, 60))],
          results, **limits),
      "memcheck": lambda: run_memcheck(results, step_timeout=min(args.step_timeout, 300)),
  }
  needs_gpu = ("gpu-properties", "golden", "smoke", "mutants", "memcheck")
  steps = []
  for name in STEPS:
    if name not in chosen:
      if name in DEFAULT_STEPS:
        steps.append(StepResult(name, "SKIPPED", detail=NOT_SELECTED))
    elif name in needs_gpu and not has_gpu:
      steps.append(StepResult(name, "SKIPPED", detail=f"no sm90 GPU here ({device})"))
    else:
      steps.append(runners[name]())

  text = render(steps, device, provenance())
  for s in steps:
    ratios = results / f"{step_files(s.name)}-error-ratios.md"
    if s.status != "SKIPPED" and ratios.exists():
      text += "\n" + ratios.read_text().replace("# Worst", "## Worst", 1)
  table = results / "mutants" / "mutants.md"
  if "mutants" in chosen and table.exists():
    text += "\n" + table.read_text().replace("# Kernel mutants", "## Kernel mutants", 1)
  (results / "summary.md").write_text(text)
  print("\n" + text)
  return 1 if any(s.status == "FAIL" for s in steps) else 0
