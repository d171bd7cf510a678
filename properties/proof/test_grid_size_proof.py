"""The proof at every size of a persistent grid: the probes' traces have
PROBE_SMS blocks; the symbolic traces Z3 holds to the same tables have a
grid of any number of blocks from 1 (harness/proofs/symbolic_dims.py's
PERSISTENT_GRID), the walk's stride and ``lax.axis_size("sm")`` terms of
it.  A defect only on a grid whose size is no multiple of 4 (an H100
PCIe's 114 SMs, or 6 blocks of a short launch) proves on the probes'
trace and is refuted there, naming the grid's size."""

import re

import pytest

from harness.proofs import cases
from harness.proofs import forward_probes as fwd
from harness.proofs import forward_traces as ft
from harness.proofs import premise_rounds as rounds
from harness.proofs import probes as pb
from harness.proofs import protocol_mutants as pmut
from harness.proofs import role_programs as rp
from harness.proofs import symbolic as sy
from harness.proofs import symbolic_dims as sd
from harness.proofs import term_walks as tw
from properties.proof.counterexamples import assert_value_slot_overwritten

ROUND_ROBIN = cases.ForwardCase(2, True, "round-robin", False, False, False, 64, 128, 2)
SPLIT_TAIL = cases.ForwardCase(2, True, "split-tail", False, False, False, 64, 128, 2)
MUTANT = "values_unacquired_on_a_grid_of_no_multiple_of_4"


def _refuted_blocks(err) -> int:
  """The persistent grid's size a refutation of MUTANT names."""
  text = str(err)
  found = re.search(r"persistent blocks (\d+)", text)
  assert found, text
  assert "wait values.consumed[" in text   # the table's wait, missing from the kernel's
  assert f"kernel/forward/producer.mutant_{MUTANT}.py:" in text
  return int(found.group(1))


@pytest.mark.parametrize("case", [ROUND_ROBIN, SPLIT_TAIL], ids=["round-robin", "split tail"])
def test_the_persistent_grid_has_any_number_of_blocks(case):
  """Both persistent launches are traced on a grid whose size is a symbol
  from 1; the round-robin walk's stride is that symbol."""
  (kernel,), dims = ft._every_length(case, ragged=False, key_ranges=True, modules=None)
  assert "sms" in dims
  launch = sy.extract_symbolic(kernel, dims)
  _, blocks = launch.grid["sm"]
  # a dimension variable counts from 0 past its lower bound, 1
  assert tw.evaluate(blocks, {"dim.sms": 0}) == 1
  assert tw.evaluate(blocks, {"dim.sms": 113}) == 114


def test_a_defect_on_a_grid_of_no_multiple_of_4_passes_the_probes_and_fails_z3():
  """The producer waits for a value slot's release only on a grid of a
  multiple of 4 blocks: the probes' trace (16 blocks) shows the shipped
  program, and Z3 over every grid size refutes it, naming a size that is
  no multiple of 4, the value buffer and the mutated line."""
  modules = pmut.modules(MUTANT)
  prober = fwd._ForwardProber(ROUND_ROBIN, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  assert prog.z3 and prog.z3[0] > 0   # the probes' trace proves
  with pytest.raises(rp.PremiseError, match="reads key ranges, at every length") as err:
    fwd.forward_program(ROUND_ROBIN, modules=modules)
  assert _refuted_blocks(err.value) % 4 != 0


def test_the_split_tail_is_refuted_on_its_rows_too():
  with pytest.raises(rp.PremiseError) as err:
    fwd.forward_program(SPLIT_TAIL, modules=pmut.modules(MUTANT))
  assert _refuted_blocks(err.value) % 4 != 0


def test_with_the_grid_size_traced_at_16_the_defect_would_prove(monkeypatch):
  """What the symbol buys: a grid of PROBE_SMS blocks, as before, proves it."""
  monkeypatch.setattr(sd, "PERSISTENT_GRID", {})
  prog = fwd.forward_program(ROUND_ROBIN, modules=pmut.modules(MUTANT))
  assert prog.plain == tuple(rounds.PLAIN_KERNELS)


def test_the_counterexamples_grid_overwrites_a_value_slot(monkeypatch):
  """Z3's counterexample is real: probed on a grid of the size it names,
  the extractor's events and the checker show a value copy over a slot
  its readers have not released."""
  modules = pmut.modules(MUTANT)
  with pytest.raises(rp.PremiseError) as err:
    fwd.forward_program(ROUND_ROBIN, modules=modules)
  monkeypatch.setattr(pb, "PROBE_SMS", _refuted_blocks(err.value))
  assert_value_slot_overwritten(ROUND_ROBIN, modules, "on the counterexample's grid")


def test_the_shipped_kernel_proves_on_every_grid():
  prog = fwd.forward_program(ROUND_ROBIN)
  assert prog.lengths == tuple(rounds.RANGED_LENGTHS) and prog.plain == tuple(rounds.PLAIN_KERNELS)
