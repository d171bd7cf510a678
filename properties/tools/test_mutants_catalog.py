"""The mutant catalogue stays applicable, and its runner's verdicts mean what
they say (CPU; the kills themselves need the GPU: ``python -m harness mutants``).

A patch whose anchor no longer finds exactly one place in the current source
fails here (and, mutant by mutant with the reason, in
properties/tools/test_mutant_anchors.py), so the catalogue cannot rot silently as
the kernel changes.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from harness.numerics import strategies as hs
from harness.tools import anchors, mutants, watchdog

REPO = Path(__file__).resolve().parents[2]


def test_every_patch_applies_exactly_once_and_compiles():
  assert mutants.check() == []


def test_the_catalogue_has_25_runnable_mutants_forward_and_backward():
  names = [m.name for m in mutants.CATALOG]
  assert len(names) == len(set(names))
  runnable = [m for m in mutants.CATALOG if not m.equivalent]
  assert len(runnable) >= 25
  assert {m.probe.partition("-")[0] for m in runnable} == {"fwd", "grad"}
  for m in mutants.CATALOG:
    assert m.bug_class and m.edits
    assert all(e.anchor.pattern and e.anchor.pattern != e.new for e in m.edits), m.name
    # A runnable mutant names its killers; an equivalent one its argument, no killers.
    assert bool(m.tests) != bool(m.equivalent), m.name


def test_every_killer_is_a_test_that_exists():
  """Each node id a mutant names is collected by pytest (a renamed test or
  case would otherwise turn a kill into an error on the GPU)."""
  ids = sorted({t for m in mutants.CATALOG for t in m.tests})
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                         "-p", "no:cacheprovider", *ids], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_patch_that_does_not_find_one_place_is_refused(tmp_path):
  (tmp_path / "kernel").mkdir()
  (tmp_path / "kernel" / "k.py").write_text(
      '@seam("k.mask")\ndef mask(s, keep):\n  s = where(keep, s)\n  s = where(keep, s)\n'
      '  return s\n')
  gone = mutants.Mutant("gone", "test", (anchors.edit("k.mask", "no_such_call()", "x"),), ("t",))
  with pytest.raises(mutants.MutantError, match=r"^gone: edit 0: seam k.mask \(kernel.k.mask, "
                                                r"kernel/k.py:2\): the pattern matched 0 times"):
    mutants.patched_files(gone, tmp_path)
  twice = dataclasses.replace(gone, edits=(anchors.edit("k.mask", "s = where(keep, s)", "s = s"),))
  with pytest.raises(mutants.MutantError, match="matched 2 times"):
    mutants.patched_files(twice, tmp_path)
  assert mutants.check(tmp_path, mutants=(gone,))[0].startswith("gone: edit 0: seam k.mask")
  lost = dataclasses.replace(gone, edits=(anchors.edit("k.masks", "s = where(keep, s)", "s"),))
  with pytest.raises(mutants.MutantError, match=r"seam k.masks: no def or class under kernel/ "
                                                r"declares it \(nearest seams: k.mask\)"):
    mutants.patched_files(lost, tmp_path)


def test_the_shipped_kernel_holds_no_mutant_branch():
  hits = [f"{p.name}:{i + 1}" for p in sorted((REPO / "kernel").rglob("*.py"))
          for i, line in enumerate(p.read_text().splitlines()) if "mutant" in line.lower()]
  assert hits == []


def test_shard_and_select_pick_mutants_by_name_and_stride():
  shards = [mutants.select(None, f"{i}/3") for i in range(3)]
  assert sum(map(len, shards)) == len(mutants.CATALOG)
  assert [m.name for m in mutants.select("lse-base-e,dk-missing-scale", None)] == [
      "lse-base-e", "dk-missing-scale"]
  with pytest.raises(mutants.MutantError, match="unknown mutant"):
    mutants.select("no-such", None)
  with pytest.raises(mutants.MutantError, match="--shard"):
    mutants.select(None, "3/3")


def test_a_cpu_killable_mutant_is_killed_and_the_control_passes(tmp_path):
  """End to end through the runner: the backward's diagonal predicate off by
  one breaks its CPU property in the patched copy; the unpatched copy passes."""
  cpu_test = "properties/kernel/test_causal_skip.py::test_the_predicate_sees_the_corners"
  mutant = dataclasses.replace(mutants.by_name("meets-diagonal-off-by-one"), tests=(cpu_test,))
  result = mutants.run_mutant(mutant, timeout=240, test_timeout=None, workdir=tmp_path)
  assert result.verdict == "killed", result
  assert result.killed_by == ["test_the_predicate_sees_the_corners"]
  control = mutants.run_control([mutant], timeout=240, test_timeout=None, workdir=tmp_path)
  assert control.verdict == "passed", control


def test_a_hang_is_stopped_and_the_test_named(tmp_path):
  """A test that never returns is stopped by the watchdog at the per-test
  limit and reported as a hang naming the test (a source patch of the test
  file stands in for a kernel that hangs)."""
  name = "properties/kernel/test_causal_skip.py::test_the_predicate_sees_the_corners"
  first = "assert not selects.meets_diagonal(0, 64, 63)"
  sleeper = mutants.Mutant("sleeper", "hang", (anchors.edit(
      "tests.predicate_corners", first, f"import time\ntime.sleep(120)\n{first}"),),
      (name,), within="properties/kernel/test_causal_skip.py")
  result = mutants.run_mutant(sleeper, timeout=100, test_timeout=3, workdir=tmp_path)
  assert result.verdict == "hang" and result.killed_by == [name], result
  assert result.seconds < 60


def test_a_child_keeps_its_hangs_and_ratios_out_of_the_gates_records(tmp_path, monkeypatch):
  """The gate's cpu-properties step sets the hang folder and the ratio log
  for the suite; a mutant's child (the deliberate hang above among them)
  must not write into either, or the step fails on a hang no shipped test
  had."""
  from harness.numerics.conformance import RATIO_LOG_ENV
  monkeypatch.setenv(watchdog.HANG_DIR_ENV, str(tmp_path / "gate-hangs"))
  monkeypatch.setenv(RATIO_LOG_ENV, str(tmp_path / "gate-ratios"))
  env = mutants.child_env(tmp_path, 3)
  assert watchdog.HANG_DIR_ENV not in env and RATIO_LOG_ENV not in env
  assert env[watchdog.TEST_TIMEOUT_ENV] == "3"


def test_the_watchdog_names_the_hung_test_under_xdist(tmp_path):
  """Under xdist the worker ends and the controller names the test; the
  hang record names it too (what the gate's summary reads)."""
  root = mutants.copy_tree(tmp_path / "tree")
  test = root / "properties" / "test_sleeps.py"
  test.write_text("def test_sleeps():\n  import time\n  time.sleep(120)\n")
  env = mutants.child_env(root, 3)
  env[watchdog.HANG_DIR_ENV] = str(tmp_path / "hangs")
  proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-q", "-p",
                         "no:cacheprovider", "properties/test_sleeps.py"], cwd=root, env=env,
                        capture_output=True, text=True, timeout=200)
  assert proc.returncode != 0
  assert "test_sleeps" in proc.stdout + proc.stderr
  assert watchdog.hung_tests(folder=tmp_path / "hangs") == [
      "properties/test_sleeps.py::test_sleeps"]


def _lowering_chunks(size: int = 16) -> list[tuple[str, ...]]:
  """The catalogue cut into chunks of at most ``size`` mutants, so that
  xdist spreads the check over its workers: each probe's mutants in pieces
  of at most ``size`` (a chunk lowers each of its probes' shipped programs
  once), the pieces packed largest first into as few chunks as fit (each
  chunk is one child process, about 3 s before its first lowering)."""
  by_probe: dict[str, list[str]] = {}
  for m in mutants.CATALOG:
    by_probe.setdefault(m.probe, []).append(m.name)
  pieces = sorted((names[i:i + size] for names in by_probe.values()
                   for i in range(0, len(names), size)), key=len, reverse=True)
  chunks: list[list[str]] = []
  for piece in pieces:
    home = next((c for c in chunks if len(c) + len(piece) <= size), None)
    if home is None:
      chunks.append(list(piece))
    else:
      home.extend(piece)
  return [tuple(c) for c in chunks]


def test_the_lowering_chunks_cover_the_catalogue_once():
  flat = [name for chunk in _lowering_chunks() for name in chunk]
  assert sorted(flat) == sorted(m.name for m in mutants.CATALOG)


# Outside the thorough profile every third mutant of a chunk is lowered for
# CUDA (about a second each on 2 cores), every one traced and compared: the
# suite under CI's 8 minutes (docs/decisions/cpu-suite-time.md).
# `python -m harness mutants --lower` lowers all.
THOROUGH = hs.thorough()
LOWER_EVERY = 6


@pytest.mark.parametrize("chunk", _lowering_chunks(), ids=lambda c: f"{c[0]}+{len(c) - 1}")
def test_every_mutant_lowers_for_cuda_and_changes_its_probe(chunk):
  """The CPU half of the kill score: each patched kernel traces and lowers
  for CUDA (a mutant that no longer builds would be 'killed' on the GPU for
  the wrong reason; outside the thorough profile every LOWER_EVERY-th is
  lowered, the others traced) and its probe's traced program differs from
  the shipped one (a patch the probe never reaches would survive for no reason).  One
  child process a chunk: the patched packages replace each other in
  sys.modules.  ``python -m harness mutants --lower`` checks them all."""
  every = 1 if THOROUGH else LOWER_EVERY
  proc = subprocess.run([sys.executable, "-m", "harness.tools.mutant_lowering", ",".join(chunk),
                         "--lower-every", str(every)],
                        cwd=REPO, capture_output=True, text=True, timeout=900)
  n = len(chunk)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  if every == 1:
    assert f"{n}/{n} mutants apply, lower for CUDA and change their probe's program" in proc.stdout
  else:
    lowered = len(range(0, n, every))
    assert (f"{n}/{n} mutants apply and change their probe's program, {lowered} of them "
            f"lowered for CUDA") in proc.stdout, proc.stdout


_LOWERING_DEFECTS = """
import ast, dataclasses
from harness.tools import anchors, mutants, mutant_lowering
# The docstring of a function a catalogued mutant edits: dead code to every probe.
carry = mutants.by_name("no-prev-iters-carry").edits[0].anchor.seam
doc = ast.get_docstring(anchors.Tree(mutants.REPO).find(carry).node, clean=False)
dead = mutants.Mutant("dead", "test", (anchors.edit(carry, repr(doc), repr("edited")),), ("t",))
broken = mutants.Mutant("broken", "test", (anchors.edit(
    "mainloop.tile_start", "rows = pl.ds(q_base, c.block_q)",
    "rows = pl.ds(q_base, c.block_q + 8)"),),
    ("t",))
equivalent = dataclasses.replace(dead, name="argued", equivalent="a docstring")
for p in mutant_lowering.check_lowering([dead, broken, equivalent], out=lambda s: None):
  print("PROBLEM", p)
"""


def test_the_lowering_check_fails_a_dead_patch_and_one_that_does_not_lower():
  proc = subprocess.run([sys.executable, "-c", _LOWERING_DEFECTS], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  problems = [l for l in proc.stdout.splitlines() if l.startswith("PROBLEM")]
  assert len(problems) == 2, proc.stdout
  assert problems[0].startswith("PROBLEM dead: the lowered program of probe 'fwd' is unchanged")
  assert problems[1].startswith("PROBLEM broken: ")


def test_a_run_past_its_budget_reports_mutants_not_run(tmp_path):
  """No child outlives the budget; what could not start is listed, and the
  score leaves it out (a partial run cannot read as complete)."""
  results, control = mutants.run_all(mutants.CATALOG[:3], budget=0.0, timeout=60,
                                     test_timeout=None, jobs=2, control_workers=0,
                                     with_control=False)
  assert [r.verdict for r in results] == [mutants.NOT_STARTED] * 3 and control is None
  assert "not started 3" in mutants.score_line(results)
  assert "mutation score: 0/0" in mutants.score_line(results)


def test_a_child_stopped_by_the_budget_is_not_counted_as_a_hang(monkeypatch):
  """A child cut short by the budget's end (its own limit not reached) says
  nothing about the mutant: "not run", not a kill."""
  seen = []

  def cut(m, *, timeout, test_timeout, workdir):
    seen.append(timeout)
    return mutants.Result(m.name, m.bug_class, "hang", [], timeout, "killed")

  monkeypatch.setattr(mutants, "run_mutant", cut)
  monkeypatch.setattr(mutants, "MIN_START", 0.0)
  (r,), _ = mutants.run_all(mutants.CATALOG[:1], budget=30.0, timeout=120, test_timeout=None,
                            jobs=1, control_workers=0, with_control=False)
  assert seen and seen[0] <= 30.0 and r.verdict == mutants.NOT_STARTED, r
  (r,), _ = mutants.run_all(mutants.CATALOG[:1], budget=300.0, timeout=120, test_timeout=None,
                            jobs=1, control_workers=0, with_control=False)
  assert r.verdict == "hang", r


def test_the_empty_tile_carry_case_has_empty_tiles_before_others_on_one_sm():
  """The persistent carry case "key-ranges-with-empty-tiles" must hold tiles
  that visit no key block (lb == ub) and that are followed by another tile
  of the same block on the H200's 132 SMs: otherwise the empty tile's query
  release and token pass run nowhere and their mutants cannot be killed."""
  from harness.tools.mutant_run import carry_cases
  from kernel.masks import Mask
  ((_, fc, cfg),) = [c for c in carry_cases() if c[0] == "key-ranges-with-empty-tiles"]
  assert cfg.persistent
  batch, seq_q, heads = fc.query.shape[:3]
  tile = 2 * cfg.block_q
  grid = [(b, h, qi) for b in range(batch) for h in range(heads)
          for qi in range(-(-seq_q // tile))]   # dealt in turn, query tiles fastest

  def empty(b, h, qi):
    rows = slice(qi * tile, (qi + 1) * tile)
    lb, ub = Mask(seq_q, fc.key.shape[1], causal=fc.is_causal).key_blocks(
        qi, tile_q=cfg.tile_q, block_kv=cfg.block_kv,
        k_start_min=int(fc.k_start[b, h, rows].min()),
        k_end_max=int(fc.k_end[b, h, rows].max()))
    return ub == lb

  sms = 132
  followed = [g for g in range(len(grid) - sms) if empty(*grid[g])]
  assert len(followed) >= 10, followed


def test_the_record_names_its_device_jax_commit_date_and_command(monkeypatch):
  """mutants.md carries its own provenance, as the gate's summary does: a
  record read away from its file name still says what made it."""
  import datetime
  import jax
  monkeypatch.setenv("FLASH_COMMIT", "abc1234")
  head = mutants.heading("NVIDIA H200 sm90", ["--select", "a,b", "--out", "x y"])
  assert head.startswith("device: NVIDIA H200 sm90; ")
  assert f"jax {jax.__version__}" in head and "commit abc1234" in head
  assert datetime.date.today().isoformat() in head
  assert head.endswith("command: `python -m harness mutants --select a,b --out 'x y'`")
