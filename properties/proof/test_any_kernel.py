"""``python -m harness prove --kernel``: kernels of another author, JAX's
own sm90 attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``),
read by the same extractor and checked by the same search at the shapes
given; defects written into a temporary copy of their file are refused with
the violation they make, and rewrites that keep the protocol prove."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

from harness.proofs import any_kernel
from harness.proofs import prove as prove_cli
from harness.tools import jax_kernel_cases as jc

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _verdicts(cases=jc.attention, module=None) -> list:
  """Every verdict of ``cases`` (a jax_kernel_cases function) on ``module``."""
  return [r for label, fn, args in cases(module)
          for r in any_kernel.prove_call(fn, *args, label=label)]


def test_jax_attention_forward_proves_at_the_shapes_given():
  results = _verdicts()
  assert len(results) == 16 and all(r.ok for r in results), [r.line() for r in results]
  # the search turned the ring: more states where more key blocks run
  assert max(r.states for r in results) > 2 * min(r.states for r in results)


# Every catalogued defect: in the attention forward, and inside the matmul's
# emit_pipeline use (the body's wait dropped leaves the pipeline releasing a
# slot a wgmma still reads) and epilogue (a buffer rewritten under its store).
DEFECTS = ([(jc.attention, jc.ATTENTION, name, *jc.ATTENTION_MUTANTS[name])
            for name in sorted(jc.ATTENTION_MUTANTS)]
           + [(jc.hopper_matmul, jc.MATMUL, name, *jc.MATMUL_MUTANTS[name])
              for name in sorted(jc.MATMUL_MUTANTS)])


@pytest.mark.parametrize("cases,module,name,edits,violation", DEFECTS,
                         ids=[d[2] for d in DEFECTS])
def test_a_defect_written_into_their_code_is_refuted(cases, module, name, edits, violation):
  failed = [r for r in _verdicts(cases, jc.patched(module, edits)) if not r.ok]
  assert failed, f"{name} proves"
  assert all(r.states > 0 for r in failed), failed[0].violation   # read, then refuted
  assert violation in failed[0].violation, failed[0].violation
  # the trace names their file's lines
  stem = module.rpartition(".")[2]
  assert re.search(rf"{stem}_copy\d+\.py:\d+", failed[0].violation), failed[0].violation


@pytest.mark.parametrize("name", sorted(jc.ATTENTION_REWRITES))
def test_a_rewrite_that_keeps_their_protocol_proves(name):
  results = _verdicts(module=jc.patched(jc.ATTENTION, jc.ATTENTION_REWRITES[name]))
  assert all(r.ok for r in results), [r.violation for r in results if not r.ok][:1]


def test_an_anchor_the_installed_jax_lacks_is_refused_by_name():
  with pytest.raises(ValueError, match="occurs 0 times"):
    jc.patched(jc.ATTENTION, [("no such line\n", "")])


def test_the_proof_knows_no_kernel_of_theirs():
  """harness/proofs/ names no module, function or buffer of JAX's kernels:
  what it reads it learns from Mosaic GPU's primitives."""
  words = ("attention_mgpu", "hopper_matmul", "ragged_dot", "k_consumed", "TuningConfig",
           "jax_kernel_cases")
  found = [f"{path.name}: {w}" for path in sorted((ROOT / "harness/proofs").glob("*.py"))
           for w in words if w in path.read_text()]
  assert not found, found


@pytest.mark.parametrize("cases", [jc.attention_backward, jc.hopper_matmul, jc.mixed_type_matmul],
                         ids=["attention-backward", "hopper-matmul", "mixed-type-matmul"])
def test_their_backward_and_matmul_prove_at_the_shapes_given(cases):
  """attention_mgpu's three backward kernels, and hopper_matmul_mgpu's
  persistent blocks with their TMA stores in bulk groups and an output
  buffer indexed [warpgroup, slot]."""
  results = _verdicts(cases)
  assert results and all(r.ok for r in results), [r.violation for r in results if not r.ok][:1]
  assert max(r.states for r in results) > 50   # not a block with nothing to do


def test_a_primitive_the_proof_cannot_read_is_a_row_not_a_crash(monkeypatch):
  """A kernel using a primitive the extractor does not model is reported
  unreadable, naming the primitive and its line (here scan, made unknown)."""
  from harness.proofs import extract
  monkeypatch.setattr(extract, "HANDLED", extract.HANDLED - {"scan"})
  label, fn, args = jc.attention()[0]
  results = any_kernel.prove_call(fn, *args, label=label)
  assert results and all(not r.ok and r.states == 0 for r in results)
  assert "primitive 'scan' is not understood" in results[0].violation, results[0].violation
  assert "UNREADABLE" in results[0].line()


def test_a_kernel_with_nothing_to_check_is_not_called_proven(monkeypatch):
  """Where no role synchronises (its work read from memory, taken as 0), the
  row says there was nothing to check, and it does not count as proven."""
  import dataclasses
  from harness.proofs import extract
  real = extract.extract_kernel
  monkeypatch.setattr(extract, "extract_kernel",
                      lambda *a, **kw: dataclasses.replace(real(*a, **kw), roles={}))
  label, fn, args = jc.attention()[0]
  results = any_kernel.prove_call(fn, *args, label=label)
  assert results and all(not r.ok and "nothing to check" in r.violation for r in results)
  assert "NOTHING" in results[0].line()


def test_a_call_that_fails_to_trace_is_named_by_its_line():
  def broken(x):
    raise RuntimeError("no kernel here")
  import jax.numpy as jnp
  import jax
  with pytest.raises(ValueError, match=r"failed to trace at .*test_any_kernel\.py:\d+"):
    any_kernel.prove_call(broken, jax.ShapeDtypeStruct((8,), jnp.float32), label="broken")


def _prove(*argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = prove_cli.main(list(argv))
  return rc, out.getvalue()


def test_prove_kernel_proves_their_forward_and_says_how_far():
  rc, out = _prove("--kernel", "harness.tools.jax_kernel_cases:attention")
  assert rc == 0, out
  assert "16/16 proven" in out and "at the shapes given" in out, out


def test_prove_kernel_refuses_a_bad_name_by_argument(capsys):
  with pytest.raises(SystemExit) as refused:
    prove_cli.main(["--kernel", "harness.tools.jax_kernel_cases"])
  assert refused.value.code == 2 and "--kernel" in capsys.readouterr().err
