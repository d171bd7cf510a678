"""The premise (P) that makes the extracted proof cover every trip count,
proved by Z3 (harness/proofs/premise.py) from the kernels read with their
integers as terms (harness/proofs/symbolic.py): a defect past every probed
ring position passes the probes and fails Z3, with the position, the trip
counts and a trace; a table the probes generalised too far is corrected;
Z3 compares every unit with its table, coverage included; what linear
arithmetic cannot express fails, naming the primitive and its line."""

import dataclasses
import re

import pytest

from harness.proofs import premise as pr
from harness.proofs import prove as prove_cli
from harness.proofs import cases
from harness.proofs import forward_probes as fwd
from harness.proofs import prove_pool
from harness.proofs import protocol_mutants as pmut
from harness.proofs import symbolic as sy
from harness.proofs import term_walks as tw
from harness.proofs import terms as tm
from harness.proofs.events import ExtractionError
from harness.tools.anchors import edit

ONE_TILE = cases.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
ONE_TILE_4 = cases.ForwardCase(4, False, "round-robin", False, False, False, 64, 128, 4)
PERSISTENT = cases.ForwardCase(2, True, "round-robin", False, False, True, 64, 128, 2)
LONG_PERIOD = "refill_test_on_a_6_bit_position"


def _unit(prog, role, kind, **ctx):
  """The events the search takes for ``role``'s ``kind`` unit in context ``ctx``."""
  (r,) = [r for r in prog.roles if r.name == role]
  table = getattr(r, kind)
  full = {**ctx, **prog.ring.features(ctx["cls"])}
  return dict(table.units)[tuple(full[f] for f in table.features)]


def test_the_probes_alone_accept_a_defect_past_every_probed_position():
  """The producer's refill test on a 6-bit ring position skips its wait for
  a release at positions 64 and on: no probe reaches them, so with (P)
  only tested (the path before Z3) the launch is reported proven."""
  results = prove_pool.prove([("forward", ONE_TILE, 1)], mutant=LONG_PERIOD, fail_fast=True,
                             premise=False)
  assert results and all(r.ok for r in results)
  assert all(not z for r in results for z in r.z3)   # and nothing claims (P) proved


def test_z3_refutes_it_with_position_trip_counts_and_a_trace():
  """With Z3, the same launch fails: the counterexample names the unit, the
  ring position (64 or more) and the trip count; its environment probed
  shows the kernel's events disagree with the table's, and checked alone
  gives a trace of the mutated kernel's lines."""
  results = prove_pool.prove([("forward", ONE_TILE, 1)], mutant=LONG_PERIOD, fail_fast=True)
  failed = [r for r in results if not r.ok]
  assert failed
  text = "\n".join(r.premise or "" for r in failed)
  assert "found by Z3" in text and "wg2.warp0's key-loop iteration" in text, text
  positions = [int(x) for x in re.findall(r"ring position (\d+)", text)]
  assert positions and max(positions) >= 64, text
  assert re.search(r"one tile of \[(\d{2,})\] key blocks", " ".join(r.name for r in failed))
  (violation,) = [r.violation for r in failed if r.violation]
  assert violation.kind == "overwrite before release", violation.format()
  lines = violation.format()
  # The producer's copy, in the kernel executed over the mutated ring position.
  assert re.search(r"kernel/forward/producer\.py:\d+ TMA load", lines), lines[-3000:]


def test_a_table_the_probes_generalised_too_far_is_corrected():
  """One tile, 4 stages: the probes (0, 1, 2, 3 and 11 key blocks) show the
  compute warpgroups' tail at slot 0 and 1 only where it is empty, so the
  table learned from them keys the tail by slot and gives a tile of 4 or
  5 blocks no last PV and no epilogue.  Z3 finds the context, its probe
  refines the table."""
  probed = fwd.forward_program(ONE_TILE_4, premise=False)
  proved = fwd.forward_program(ONE_TILE_4)
  assert _unit(probed, "wg0", "tail", cls=4, n=2) == ()
  tail = _unit(proved, "wg0", "tail", cls=4, n=2)
  assert {e.kind for e in tail} >= {"wait", "wgmma", "tma_store"}, tail
  assert proved.z3 and not probed.z3


@pytest.fixture(scope="module")
def persistent():
  prober = fwd._ForwardProber(PERSISTENT, None, None)
  return prober.learn(), prober.kernel


def test_z3_checks_every_unit_against_its_table(persistent):
  """The shipped persistent launch proves; a table that drops an event of
  every iteration, or lacks a head context, is refused, naming the unit."""
  prog, kernel = persistent
  stats = pr.prove(prog, sy.extract_symbolic(kernel))
  assert stats.queries > 20

  def with_table(role, kind, table):
    return dataclasses.replace(prog, roles=tuple(
        dataclasses.replace(r, **{kind: table}) if r.name == role else r for r in prog.roles))

  wg0 = next(r for r in prog.roles if r.name == "wg0")
  shorter = dataclasses.replace(wg0.iter, units=tuple((k, evs[:-1]) for k, evs in wg0.iter.units))
  with pytest.raises(pr.PremiseFailure, match="wg0's key-loop iteration"):
    pr.prove(with_table("wg0", "iter", shorter), sy.extract_symbolic(kernel))
  thin = dataclasses.replace(wg0.head, units=wg0.head.units[1:])
  with pytest.raises(pr.PremiseFailure, match="has no entry") as err:
    pr.prove(with_table("wg0", "head", thin), sy.extract_symbolic(kernel))
  assert err.value.context["kind"] == "head"


def test_equal_claims_share_one_z3_call(persistent):
  """A launch proved again sends Z3 nothing new: its claims' canonical
  forms were decided."""
  prog, kernel = persistent
  pr._PROVED.clear()
  first = pr.prove(prog, sy.extract_symbolic(kernel))
  again = pr.prove(prog, sy.extract_symbolic(kernel))
  assert first.solved > 0 and again.solved == 0 and again.queries == first.queries


def test_what_linear_arithmetic_cannot_express_fails_naming_it():
  """A ring position through a product of two loop counters (harmless for
  every probe: the remainder by 1 is 0) is no linear term: the symbolic
  run refuses the slot it reaches, naming the primitive and both lines."""
  m = pmut.Mutant("slot_through_a_product", "a slot computed through ki * ki",
                  (edit("context.ring_state", "keys.position(prev_iters + (ki - lb))",
                        "keys.position(prev_iters + (ki - lb) + lax.rem(ki * ki, 1))"),))
  with pytest.raises(ExtractionError) as err:
    fwd.forward_program(ONE_TILE, modules=pmut.modules(m))
  msg = str(err.value)
  assert "primitive 'mul'" in msg and "slot" in msg, msg
  assert re.search(r"kernel/forward/context\.mutant_slot_through_a_product\.py:\d+", msg), msg


def test_terms_normalise_and_evaluate_as_the_kernel_computes():
  """Terms fold what they can and keep C division semantics (toward zero),
  as lax.div and lax.rem have them."""
  x = tm.var("x")
  assert tm.sub(tm.add(x, 3), x) == 3
  assert tm.max_(x, tm.add(x, 2)) is tm.add(x, 2)
  for v in (-7, -1, 0, 5, 13):
    for c in (3, 4):
      assert tw.evaluate(tm.div(x, c), {"x": v}) == int(v / c)
      assert tw.evaluate(tm.rem(x, c), {"x": v}) == v - c * int(v / c)
      assert tw.evaluate(tm.min_(x, c), {"x": v}) == min(v, c)
  assert tm.nonneg(tm.sub(tm.max_(x, 5), x)) and not tm.nonneg(tm.sub(x, tm.max_(x, 5)))


def test_the_command_shows_how_the_premise_stands_per_protocol():
  proved = prove_pool.Result("a", ["a"], z3=[(3, 1, 0.1), (2, 0, 0.0)])
  tested = prove_pool.Result("b", ["b"], z3=[()])
  assert prove_cli._premise_column(proved) == "Z3 2/2"
  assert prove_cli._premise_column(tested) == "probes"
  assert proved.premise_proved and not tested.premise_proved
