"""The proof at every grid point: the probes' traces have one batch and one
query head, always the first of its group; the symbolic traces Z3 holds to
the same tables have a grid of any number of batches, key/value heads and
query heads per group (the forward's: harness/proofs/symbolic_dims.py's
GRID_COUNTS, symbolic dimensions) or of several of each (the backward's:
GQA_GRID), each grid index a variable from 0 up
(harness/proofs/symbolic.py's grid_index).  A defect only at a query head
past the first of its group proves on the probes' trace and is refuted
there, naming the head, its group, the buffer and the barrier."""

import re

import pytest

from harness.proofs import backward_traces as bt
from harness.proofs import backward_probes as bwd
from harness.proofs import cases
from harness.proofs import forward_traces as ft
from harness.proofs import forward_probes as fwd
from harness.proofs import probes as pb
from harness.proofs import premise_rounds as rounds
from harness.proofs import symbolic_dims as sd
from harness.proofs import protocol_mutants as pmut
from harness.proofs import role_programs as rp
from harness.proofs import symbolic as sy
from harness.proofs import term_walks as tw
from harness.tools.anchors import edit
from properties.proof.counterexamples import assert_value_slot_overwritten

ONE_TILE = cases.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
PERSISTENT = cases.ForwardCase(2, True, "round-robin", False, False, False, 64, 128, 2)
GQA = "values_unacquired_past_a_groups_first_head"


def test_the_symbolic_traces_have_groups_of_any_size_in_any_batch():
  """The forward's counts are symbolic: any group of query heads (from 1),
  any number of key/value heads and batches (from 2: a count of 1 is read
  at index 0, its only index); its head and batch indices every value
  from 0."""
  assert sd.GRID_COUNTS == {"batches": 2, "kv_heads": 2, "group": 1}
  for key_ranges in (True, False):
    (kernel,), dims = ft._every_length(ONE_TILE, ragged=False, key_ranges=key_ranges,
                                       modules=None)
    assert set(sd.GRID_COUNTS) <= set(dims)
    launch = sy.extract_symbolic(kernel, dims)
    (head, heads), (batch, batches) = launch.grid["heads"], launch.grid["batch"]
    assert heads is None   # group * kv_heads: a product of counts, any number
    assert tw.evaluate(batches, {"dim.batches": 5}) == 7   # 2 and up
    assert tw.evaluate(launch.counts["group"], {"dim.group": 0}) == 1
    # every index from 0 up, past the traced grid too (a launch's may be larger)
    assert tw.evaluate(head, {"axis.heads": 100}) == 100
    assert tw.evaluate(head, {"axis.heads": -3}) == 0
    assert tw.evaluate(batch, {"axis.batch": 1}) == 1


def test_the_backward_is_traced_at_the_same_counts():
  """The dK/dV kernel's grid walks key/value heads and sums over each
  group's query heads; the dQ kernel's walks query heads: both traced
  with the symbolic counts."""
  kernels, dims = bt.trace_backward_at(cases.BackwardCase(64, False, False, False))
  assert set(sd.GRID_COUNTS) <= set(dims)
  grids = [dict(zip(k.params["meshes"][0].grid_names, map(str, k.params["meshes"][0].grid)))
           for k in kernels]
  assert grids[0]["kv_heads"] == "kv_heads + 1" and grids[0]["batch"] == "batches + 1", grids
  assert "group" in grids[1]["heads"] and grids[1]["batch"] == "batches + 1", grids


def _refuted_head(err) -> tuple[int, int]:
  """(head, group) of a refutation of GQA's defect."""
  text = str(err)
  found = re.search(r"at grid point heads (\d+) \(group (\d+)\)", text)
  assert found, text
  assert "wait values.consumed[" in text   # the table's wait, missing from the kernel's
  assert "TMA load -> values[" in text
  assert f"kernel/forward/producer.mutant_{GQA}.py:" in text
  return int(found.group(1)), int(found.group(2))


def test_a_defect_past_a_groups_first_head_passes_the_probes_and_fails_z3():
  """The producer skips the wait for a value slot's release at a query
  head past the first of its group: the probes' trace (one head, the
  first) shows the shipped program, and Z3 at every grid point refutes
  it, naming a head past the first of its group, the value buffer and the
  consumed barrier."""
  modules = pmut.modules(GQA)
  prober = fwd._ForwardProber(ONE_TILE, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  assert prog.z3 and prog.z3[0] > 0   # the probes' trace proves
  with pytest.raises(rp.PremiseError, match="reads key ranges, at every length") as err:
    fwd.forward_program(ONE_TILE, modules=modules)
  head, group = _refuted_head(err.value)
  assert head % group != 0


def test_with_one_head_traced_the_defect_would_prove(monkeypatch):
  """What the grid buys: traced with one batch and one head, as the probes
  are, the same defect proves."""
  monkeypatch.setattr(sd, "GRID_COUNTS", {})
  monkeypatch.setattr(sd, "GQA_GRID", {"batch": 1, "heads": 1, "kv_heads": 1})
  prog = fwd.forward_program(ONE_TILE, modules=pmut.modules(GQA))
  assert prog.plain == tuple(rounds.PLAIN_KERNELS)


def test_a_persistent_block_is_refuted_too():
  """A persistent block walks tiles of every head: its tile's head is a
  term of the block and the tile, and Z3 finds one past a group's first."""
  with pytest.raises(rp.PremiseError, match=r"at grid point sm \d+ of \d+") as err:
    fwd.forward_program(PERSISTENT, modules=pmut.modules(GQA))
  assert "wait values.consumed[" in str(err.value)


@pytest.mark.parametrize("case", [ONE_TILE, PERSISTENT], ids=["one tile", "persistent"])
def test_the_shipped_kernel_proves_at_every_grid_point(case):
  prog = fwd.forward_program(case)
  assert prog.lengths == tuple(rounds.RANGED_LENGTHS) and prog.plain == tuple(rounds.PLAIN_KERNELS)


# The dQ kernel copies a query head's keys twice into the slot past the
# first head of its group: a second arrival on the produced barrier.
DQ_GQA = pmut.Mutant(
    "dq_keys_twice_past_a_groups_first_head",
    "the dQ kernel's producer copies the keys twice when the query head is not the first "
    "of its group",
    (edit("dq.fill", 'stream.producer_copy(c.k_ref.at[c.b, keys, c.hk], st, "k")',
          'stream.producer_copy(c.k_ref.at[c.b, keys, c.hk], st, "k"); '
          'pl.when(lax.rem(c.h, jnp.int32(c.group)) != 0)(lambda: stream.producer_copy('
          'c.k_ref.at[c.b, keys, c.hk], st, "k"))'),),
    kernel="backward", backward=(64, False, False, False))


def test_a_backward_defect_past_a_groups_first_head_is_refuted():
  """The backward's dQ kernel, traced at the symbolic counts, held to the
  tables its one-head probes learned: a defect past a group's first head
  fails, naming the head."""
  with pytest.raises(rp.PremiseError, match=r"at grid point heads (\d+)") as err:
    bwd.backward_programs(cases.BackwardCase(64, False, False, False),
                          modules=pmut.modules(DQ_GQA))
  found = re.search(r"at grid point heads (\d+).*\(group (\d+)", str(err.value))
  assert found, str(err.value)
  assert int(found.group(1)) % int(found.group(2)) != 0
  assert "TMA load -> " in str(err.value)


def test_the_counterexamples_head_overwrites_a_value_slot(monkeypatch):
  """Z3's counterexample is real: probed at that head of a group of its
  size (the probes' trace widened to one such group, the probes' range
  tables read per head), the extractor's events and the checker show a
  value copy over a slot its readers have not released."""
  from harness.proofs import extract
  modules = pmut.modules(GQA)
  with pytest.raises(rp.PremiseError) as err:
    fwd.forward_program(ONE_TILE, modules=modules)
  head, group = _refuted_head(err.value)
  head %= group   # the same place in a group of one kv head
  trace, extract_kernel, operands = ft.trace_forward, extract.extract_kernel, pb.int_operands
  monkeypatch.setattr(ft, "trace_forward",
                      lambda *a, **k: trace(*a, **{**k, "heads": group, "kv_heads": 1}))
  monkeypatch.setattr(extract, "extract_kernel", lambda kernel, *, grid, **k: extract_kernel(
      kernel, grid={**grid, "heads": head}, **k))
  monkeypatch.setattr(pb, "int_operands",
                      lambda kernel, consts, shape: operands(kernel, consts,
                                                             (1, group, shape[-1])))
  assert_value_slot_overwritten(ONE_TILE, modules, "at the counterexample's head")


def test_a_grid_point_past_the_traced_count_says_so():
  """A counterexample's index is never printed past the count it names:
  inside the traced grid as "i of n", past it as a launch with i + 1 or
  more (grid indices take every value, premise._grid_axis)."""
  from harness.proofs import premise
  assert premise._grid_axis("batch", 1, 2) == "batch 1 of 2"
  assert premise._grid_axis("sm", 3, None) == "sm 3"
  said = premise._grid_axis("batch", 7, 1)
  assert "of 1" not in said and "8 or more" in said and "the trace's 1" in said
