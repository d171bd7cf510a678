"""The proof of calls with a window or chunks, as the kernels receive them:
the problem carries the window's sides and the chunk's size, which the
kernels' own code could read, so each case's ranged kernel is traced once
more at every length with a window and chunks of every size (symbolic
dimensions, forward_traces.WINDOWS) and held to the same tables.  A defect
only under a narrow window, or only under chunks that fit the ring, proves
on every trace without them and is refuted there, naming the size."""

import re

import pytest

from harness.proofs import cases
from harness.proofs import forward_probes as fwd
from harness.proofs import forward_traces as ft
from harness.proofs import premise_rounds as rounds
from harness.proofs import protocol_mutants as pmut
from harness.proofs import role_programs as rp
from harness.proofs import symbolic as sy
from harness.proofs import symbolic_dims as sd
from harness.proofs import term_walks as tw
from properties.proof.counterexamples import assert_value_slot_overwritten

ONE_TILE = cases.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
CHUNKS = "values_unacquired_under_chunks_that_fit"
WINDOW = "values_unacquired_under_a_narrow_window"
WINDOWED = [name for name, (_, windows) in rounds.RANGED_LENGTHS.items() if windows]


def _refuted_size(err, mutant: str, words: str) -> int:
  """The size a refutation of ``mutant`` names after ``words``."""
  text = str(err)
  found = re.search(rf"with {words} (\d+)", text)
  assert found, text
  assert "wait values.consumed[" in text   # the table's wait, missing from the kernel's
  assert f"kernel/forward/producer.mutant_{mutant}.py:" in text
  return int(found.group(1))


def test_the_ranged_kernel_is_traced_with_a_window_and_chunks_of_every_size():
  """Whole and ragged keys, each once more with a window's sides (from 0)
  and a chunk's size (from 1) symbolic dimensions of the trace."""
  assert len(WINDOWED) == 2
  (kernel,), dims = ft.trace_ranged(ONE_TILE, ragged=True, windows=True)
  assert set(ft.WINDOWS) <= set(dims)
  launch = sy.extract_symbolic(kernel, dims)
  # each a variable from 1 (dim_term), the length less its lower bound less 1
  assert tw.evaluate(launch.counts["chunk"], {"dim.chunk": 0}) == 1
  assert sd.length("chunk", 1) == 1 and sd.length("window_left", 1) == 0


@pytest.mark.parametrize("mutant,words,trigger", [
    (CHUNKS, "chunks of", lambda size: size <= ONE_TILE.num_stages * ONE_TILE.block_kv),
    (WINDOW, "a window's left side", lambda size: size < ONE_TILE.block_kv)],
    ids=["chunks", "window"])
def test_a_defect_under_a_window_or_chunks_fails_z3_naming_the_size(mutant, words, trigger):
  """The probes' trace (no window, no chunk) and every trace without them
  show the shipped program; the traces with them refute the defect at a
  size that triggers it, naming the size, the value buffer and the
  mutated line."""
  modules = pmut.modules(mutant)
  prober = fwd._ForwardProber(ONE_TILE, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  assert prog.z3 and prog.z3[0] > 0   # the probes' trace proves
  with pytest.raises(rp.PremiseError, match="with a window and chunks of every size") as err:
    fwd.forward_program(ONE_TILE, modules=modules)
  assert trigger(_refuted_size(err.value, mutant, words))


def test_without_the_windowed_traces_the_defects_would_prove(monkeypatch):
  """What the windowed traces buy: without them, both defects prove."""
  unwindowed = {name: how for name, how in rounds.RANGED_LENGTHS.items() if not how[1]}
  monkeypatch.setattr(rounds, "RANGED_LENGTHS", unwindowed)
  for mutant in (CHUNKS, WINDOW):
    prog = fwd.forward_program(ONE_TILE, modules=pmut.modules(mutant))
    assert prog.plain == tuple(rounds.PLAIN_KERNELS)


def test_the_counterexamples_chunks_overwrite_a_value_slot(monkeypatch):
  """Z3's counterexample is real: probed with chunks of the size it names,
  the extractor's events and the checker show a value copy over a slot
  its readers have not released."""
  modules = pmut.modules(CHUNKS)
  with pytest.raises(rp.PremiseError) as err:
    fwd.forward_program(ONE_TILE, modules=modules)
  size = _refuted_size(err.value, CHUNKS, "chunks of")
  traced = ft._traced_problem
  monkeypatch.setattr(ft, "_traced_problem", lambda *a, **k: (
      lambda config, problem: (config, problem.replace(chunk=size)))(
          *traced(*a, **k)))
  assert_value_slot_overwritten(ONE_TILE, modules, "with the counterexample's chunks")


def test_the_shipped_kernel_proves_with_every_window_and_chunk():
  prog = fwd.forward_program(ONE_TILE)
  assert prog.lengths == tuple(rounds.RANGED_LENGTHS)
  assert set(WINDOWED) <= set(prog.lengths)
