"""The stage-ring protocol model (harness/protocol_model.py) and its proofs.

CPU only (z3).  The unbounded proofs cover every config the heuristics and
the autotuner emit; each mutant of the protocol is refuted with a trace; the
vacuity checks show the proof is about runs that exist.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import z3

from harness import protocol_model as pm
from harness import prove as prove_lib
from kernel import barriers, plan as plan_lib
from kernel.config import Config
from kernel.pipeline import PipelineState

KERNEL = pm.KERNEL_HANDSHAKE


def _plan(stages=2, persistent=False, bias=False, mask=False):
  # one stage only arises from a single key block (plan.effective_stages)
  seq_kv = 64 if stages == 1 else 4096
  problem = plan_lib.Problem(np.dtype(np.float16), 64, 64, 4096, seq_kv,
                             bias_2d=bias, mask_2d=mask)
  plan = plan_lib.pipeline_plan(problem, Config(64, 64, max(stages, 2), persistent))
  assert plan.num_stages == stages
  return plan


def _protocol(stages=2, persistent=False, *, handshake=KERNEL, mutation=None, **kw):
  return pm.Protocol.from_plan(_plan(stages, persistent, **kw), handshake=handshake,
                               mutation=mutation)


def _assert_trace(ce: pm.Counterexample, *kinds: str):
  text = ce.format()
  print(text)
  assert ce.kind in kinds, text
  assert ce.trace, text
  assert "step" in text and "actor" in text and "slot" in text and "phase" in text
  return text


# -- (d) barrier IDs, arrival counts, thread counts ------------------------


def test_every_emitted_plan_is_consistent():
  """Every plan the heuristics emit has arrival counts equal to the number of
  arriving actors, named-barrier thread counts equal to 128 per participant,
  and IDs within the hardware budget."""
  seen = 0
  for entry in prove_lib.emitted_protocols():
    for _, problem, config in entry.examples:
      assert pm.check_plan(plan_lib.pipeline_plan(problem, config)) == []
      seen += 1
  assert seen > 20


def test_stages_beyond_the_budget_are_rejected():
  with pytest.raises(ValueError, match="num_stages"):
    Config(num_stages=5)
  plan = dataclasses.replace(_plan(), num_stages=5)
  assert any("num_stages" in p for p in pm.check_plan(plan))


def test_named_barriers_beyond_the_budget_are_rejected():
  first_free = max(b.id for b in barriers.NAMED_BARRIERS) + 1
  extra = tuple(barriers.NamedBarrier(f"extra{i}", first_free + i, 256, "")
                for i in range(16 - first_free + 1))
  plan = dataclasses.replace(_plan(), named_barriers=barriers.NAMED_BARRIERS + extra)
  with pytest.raises(ValueError, match="16"):
    barriers.check_budget(plan.named_barriers)
  assert any("hardware has 16" in p for p in pm.check_plan(plan))
  clash = dataclasses.replace(_plan(), named_barriers=barriers.NAMED_BARRIERS + (
      barriers.NamedBarrier("clash", 1, 256, ""),))
  assert any("overlap" in p or "collide" in p for p in pm.check_plan(clash))


def test_consumed_barrier_with_one_arrival_is_rejected_and_breaks_the_ring():
  """One arrival per phase instead of one per compute warpgroup: the check
  rejects it, and the model finds the overwrite it allows."""
  plan = _plan(stages=2)
  bad = tuple(dataclasses.replace(b, num_arrivals=1) if b.name == "k_consumed" else b
              for b in plan.mbarriers)
  plan = dataclasses.replace(plan, mbarriers=bad)
  assert any("k_consumed" in p and "arrivals" in p for p in pm.check_plan(plan))
  ce = pm.explore(pm.Protocol.from_plan(plan), (3,))
  _assert_trace(ce, "overwrite")


def test_named_barrier_thread_count_mismatch_is_rejected_and_deadlocks():
  plan = _plan(stages=2)
  bad = tuple(dataclasses.replace(b, num_threads=384) if b.name == "schedule_wg1" else b
              for b in plan.named_barriers)
  plan = dataclasses.replace(plan, named_barriers=bad)
  assert any("schedule_wg1" in p and "384" in p for p in pm.check_plan(plan))
  ce = pm.explore(pm.Protocol.from_plan(plan), (1,))
  _assert_trace(ce, "deadlock")


# -- the model advances the ring like PipelineState ------------------------


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_ring_position_advances_like_pipeline_state(stages):
  m = pm.Model(_protocol(stages), "bmc")
  s = m.state("x")
  idx, ph, R = 0, 0, 0
  for n in range(1, 3 * stages + 2):
    upd = m._advance({**s, "memory.idx": z3.IntVal(idx), "memory.ph": z3.IntVal(ph),
                      "memory.R": z3.IntVal(R)}, "memory")
    idx, ph, R = (z3.simplify(upd[f"memory.{k}"]).as_long() for k in ("idx", "ph", "R"))
    want = PipelineState.at(stages, n)
    assert (idx, ph) == (want.index, want.phase)
    assert n == stages * R + idx  # the ghost wraps relate the slot to the count


# -- unbounded proofs --------------------------------------------------------


def test_every_emitted_config_is_proven():
  """The kernel's protocol is proven for every
  distinct plan the heuristics and the autotuner emit over the problem grid:
  no TMA overwrites a slot or query tile still read, no read sees a stale or
  future block, no deadlock, for any interleaving, tile count and trip counts."""
  rows = prove_lib.prove_all(jobs=2)
  print(prove_lib.format_table(rows))
  assert {(r.protocol.num_stages, r.protocol.persistent) for r in rows} == {
      (s, p) for s in (1, 2, 3, 4) for p in (False, True)}
  assert all(r.status == "proven" for r in rows), prove_lib.format_table(rows)


def test_the_kernels_handshake_is_the_fixed_one():
  """kernel/forward.py passes the token in tiles without key blocks (0b8ad79)."""
  assert pm.KERNEL_HANDSHAKE == pm.EMPTY_TILES_PASS_TOKEN


@pytest.mark.parametrize("stages", [1, 3])
def test_token_across_tiles_is_proven_when_no_tile_is_empty(stages):
  """Without k_start/k_end ranges every tile has a key block, and then the
  handshake before 0b8ad79 was already correct."""
  protocol = dataclasses.replace(_protocol(stages, True, handshake=pm.TOKEN_ACROSS_TILES),
                                 nonempty_tiles=True)
  result = pm.prove(protocol)
  assert result.proven, result.format()


def test_one_tile_blocks_are_unchanged_by_the_fix():
  """The empty-tile token only exists in persistent blocks (a one-tile
  block's warpgroup 0 passes once after its loop either way)."""
  def program(handshake):
    m = pm.Model(_protocol(2, False, handshake=handshake), "bmc")
    return [(a.actor, a.label, a.name, a.slot) for a in m.actions]
  assert program(pm.TOKEN_ACROSS_TILES) == program(pm.EMPTY_TILES_PASS_TOKEN)


def test_token_across_tiles_deadlocks_after_two_empty_tiles():
  """The handshake before 0b8ad79: warpgroup 1 waits for a pass that
  warpgroup 0 makes only after a query refill that waits for warpgroup 1."""
  protocol = _protocol(2, True, handshake=pm.TOKEN_ACROSS_TILES)
  assert not pm.prove(protocol).proven
  for trips in ((0, 0, 0), (1, 0, 0, 0)):
    text = _assert_trace(pm.explore(protocol, trips), "deadlock")
    assert "wg1 at pre_sync_wait" in text or "wg1 at sched_wait" in text
    assert "qload at qc1_wait" in text


def test_token_per_tile_deadlocks():
  """The earlier per-tile handshake: warpgroup 0 passes twice in a row."""
  text = _assert_trace(pm.explore(_protocol(2, True, handshake=pm.TOKEN_PER_TILE), (1, 1)),
                       "deadlock")
  assert "schedule_wg1" in text


# -- mutants: refuted with traces --------------------------------------------


def test_slot_without_prev_iters_is_refuted():
  """Bounded unrolling (symbolic trip counts): the next tile refills slot 0."""
  ce = pm.find_counterexample(_protocol(2, True, mutation="tile_local_slot"), max_steps=12)
  assert ce is not None
  text = _assert_trace(ce, "overwrite", "stale")
  assert "trip counts per tile" in text
  # and the shortest one, by explicit search: the second tile refills slot 0
  # while the first tile's block is still in it
  ce = pm.explore(_protocol(2, True, mutation="tile_local_slot"), (1, 1))
  _assert_trace(ce, "overwrite")
  assert "k[0]" in ce.what


@pytest.mark.parametrize("stages,trips", [(2, (1, 2))])
def test_parity_from_the_tile_local_step_is_refuted(stages, trips):
  """A consumer waits with the parity of its tile-local step: it passes on an
  older phase and reads the block of the previous round."""
  ce = pm.explore(_protocol(stages, True, mutation="tile_local_parity"), trips)
  _assert_trace(ce, "stale")
  assert ce.trace[-1].actor.startswith("wg") and "wait k_produced" in ce.trace[-1].action


def test_producer_waiting_one_round_early_deadlocks():
  ce = pm.find_counterexample(_protocol(2, mutation="producer_waits_early"), max_steps=14)
  assert ce is not None
  text = _assert_trace(ce, "deadlock")
  assert "memory at k_wait" in text or "memory at v_wait" in text


def test_producer_missing_one_wait_overwrites():
  ce = pm.find_counterexample(_protocol(2, mutation="producer_waits_late"), max_steps=16)
  assert ce is not None
  _assert_trace(ce, "overwrite", "stale")


def test_release_before_the_wgmma_completes_is_refuted():
  ce = pm.find_counterexample(_protocol(2, mutation="release_before_wgmma"), max_steps=16)
  assert ce is not None
  _assert_trace(ce, "overwrite")
  assert "TMA into k" in ce.what
  assert any(r.action == "consumer_release: arrive k_consumed (before the QK completed)"
             for r in ce.trace)


def test_warpgroup_with_fewer_blocks_that_keeps_its_slots_deadlocks_the_producer():
  """Warpgroup 0 leaves its causal loop early without releasing the slots
  the producer fills for warpgroup 1: the producer waits forever."""
  ce = pm.explore(_protocol(2, mutation="short_warpgroup"), (3,), short=(0,))
  text = _assert_trace(ce, "deadlock")
  assert "memory at k_wait" in text


# -- vacuity -----------------------------------------------------------------

FIRST_USE = ("no k_consumed wait", "no v_consumed wait", "no wait (first tile)",
             "before the tile loop", "bar.sync schedule_wg1 (wait)")


@pytest.mark.parametrize("stages,bias", [(2, True), (3, False)])
def test_persistent_invariant_is_not_vacuous(stages, bias):
  """Every action fires from some invariant state, all but the first-use ones
  from deep states (g >= 3S); the producer runs num_stages blocks ahead of
  both consumers and never further."""
  v = pm.vacuity(_protocol(stages, True, bias=bias))
  assert v.satisfiable
  assert v.dead == []
  assert all(any(f in a for f in FIRST_USE) for a in v.shallow), v.shallow
  assert v.producer_ahead and not v.producer_beyond


def test_one_tile_invariant_is_not_vacuous():
  """One tile starts at block 0, so its first block is always in slot 0."""
  v = pm.vacuity(_protocol(2, False))
  assert v.satisfiable and v.producer_ahead and not v.producer_beyond
  assert v.dead and all("(first block)' slot 1" in a for a in v.dead), v.dead


def test_every_action_fires_in_some_run():
  """Reachability, not just invariant states: the explicit search over a few
  tile lists takes every action and finds no counterexample."""
  protocol = _protocol(2, True)
  fired: set = set()
  for trips in ((3, 0, 2), (0, 1), (2, 2)):
    assert pm.explore(protocol, trips, fired=fired) is None
  everything = {(a.actor, a.name, a.slot)
                for a in pm.Model(protocol, "bmc", max_tiles=3).actions}
  assert everything - fired == set()


@pytest.mark.parametrize("conjunct", [
    "k_produced[0] vs wg0: at most one phase ahead",   # the window lemma
    "v_consumed[1] vs memory: parity bits",             # one parity bit suffices
    "k[0]: holds the latest block",                     # ghost block ids
    "empties:",                                         # token across empty tiles
    "tiles: same tile",                                 # trip counts agree
])
def test_dropping_a_lemma_breaks_the_proof(conjunct):
  assert not pm.prove(_protocol(2, True), drop=[conjunct], max_failures=1).proven
