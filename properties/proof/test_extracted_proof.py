"""The protocol read out of the traced kernels (harness/proofs/extract.py), learned
as role programs (harness/proofs/role_programs.py) and proved for every environment
(harness/proofs/search.py): the shipped kernels prove, each protocol defect
written into a copy of the kernel's source makes ``python -m harness prove``
fail with a trace naming the mutated file's lines, safe reorderings still
prove, an unknown primitive is refused, a kernel whose events depend on more
than the proof's contexts is caught, and the search's reductions lose none of
the defects an unreduced search finds."""

import collections
import contextlib
import dataclasses
import functools
import io
import os
import pickle
import re

import ml_dtypes
import numpy as np
import pytest

from harness.numerics import strategies as hs
from harness.proofs import cases, extract, jaxprs
from harness.proofs import search
from harness.proofs import prove as prove_cli
from harness.proofs import backward_probes as bwd
from harness.proofs import forward_traces as ft
from harness.proofs import forward_probes as fwd
from harness.proofs import probes as pb
from harness.proofs import prove_pool
from harness.proofs import premise_rounds as rounds
from harness.proofs import tracing
from harness.proofs import protocol_mutants as pmut
from harness.proofs import representatives
from harness.proofs import role_programs as rp
from harness.proofs.events import Event, ExtractionError, UnknownPrimitive
from kernel.tiling.config import Config

ONE_TILE = cases.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
PERSISTENT = cases.ForwardCase(2, True, "round-robin", False, False, False, 64, 128, 2)
FUSED = cases.BackwardCase(64, False, False, True)


def _run_prove(*argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = prove_cli.main(list(argv))
  return rc, out.getvalue()


@functools.lru_cache(maxsize=None)
def _mutant_failing_fast(name: str) -> tuple[int, str]:
  """``prove --mutant NAME --fail-fast``, run once per process: the
  catalogue's test and a test of what one mutant's report says read one run."""
  return _run_prove("--mutant", name, "--fail-fast")


@pytest.fixture(scope="module")
def shipped_programs():
  return {case: fwd.forward_program(case) for case in (ONE_TILE, PERSISTENT)}


def test_shipped_kernel_proves_for_every_environment(shipped_programs):
  for case, prog in shipped_programs.items():
    r = search.check(prog)
    assert r.ok, r.violation.format()
    assert r.states > 1000  # the ring really turned


def test_shipped_backward_proves():
  for prog in bwd.backward_programs(FUSED):
    r = search.check(prog)
    assert r.ok, r.violation.format()
    assert r.states > 1000


@pytest.mark.parametrize("mutant", pmut.MUTANTS + pmut.BACKWARD_MUTANTS, ids=lambda m: m.name)
def test_kernel_mutant_fails_prove(mutant):
  """``python -m harness prove --mutant NAME`` (its smallest cases first,
  stopping at the first failure) fails with a trace of the mutated file."""
  rc, out = _mutant_failing_fast(mutant.name)
  assert rc == 1, out
  # The trace names the pass's kernel lines (the mutated file's where its
  # own lines issue the events: an edit of a helper shows at its callers).
  assert f"kernel/{mutant.kernel}/" in out, out


def test_a_deadlock_that_needs_three_tiles_is_found():
  """Before 0b8ad79 the token was not passed on a tile without key blocks:
  two such tiles in a row deadlock, which no check of two tiles shows.
  The search chooses the number of tiles itself."""
  rc, out = _mutant_failing_fast("empty_tile_skips_token")
  assert rc == 1 and "deadlock" in out and "tiles of 0, 0, 0 key blocks" in out, out
  # --fail-fast says so as soon as it knows, as a pooled run does
  assert re.search(r"^FAILED after [0-9.]+ s .*deadlock", out, re.M), out


def test_a_kernel_that_does_not_trace_is_named_by_its_line(monkeypatch):
  """An edit that makes the kernel fail to trace is a kernel the proof
  cannot read, said with the kernel line that raised, by --fail-fast as by
  the workers (whose message must cross a process boundary whole), never
  a raw traceback."""
  from harness.proofs.events import KernelTraceError
  from kernel import call as call_lib

  def broken(case, **kw):
    call_lib.normalize_chunk(0)   # raises inside kernel/call.py

  monkeypatch.setattr(fwd, "forward_program", broken)
  with pytest.raises(KernelTraceError) as err:
    prove_pool._learn_programs("forward", ONE_TILE, None, True)
  text = str(err.value)
  assert re.search(r"the kernel failed to trace at kernel/call\.py:\d+ \(raise ValueError", text), text
  assert "ValueError: attention_chunk" in text and ONE_TILE.describe() in text
  assert str(pickle.loads(pickle.dumps(err.value))) == text
  rc, out = _run_prove("--mutant", "empty_tile_skips_token", "--fail-fast")
  assert rc == 1 and "the proof cannot read the kernel: KernelTraceError" in out, out
  assert "kernel/call.py:" in out and "Traceback" not in out, out


def _failures(results) -> list[str]:
  return [r.violation.format() if r.violation else r.premise for r in results if not r.ok]


@pytest.mark.parametrize("safe", pmut.SAFE, ids=lambda m: m.name)
def test_safe_reordering_proves(safe):
  results = prove_pool.prove([("forward", ONE_TILE, 1), ("forward", PERSISTENT, 1)],
                             mutant=safe.name, fail_fast=True)
  assert results and all(r.ok for r in results), _failures(results)


def test_events_equal_but_for_their_lines_are_one_event():
  """Every comparison of the proof takes an event for what it does (kind,
  role, buffer, slot, barrier, reads, counts), never for the line that
  makes it: equality and hashing, Z3's matching of a unit against its
  table, a cond's branches (symbolic and on data), two probes of one
  context.  The line stays, a label for traces."""
  from harness.proofs import premise, symbolic as sy, terms as tm
  a = Event("wait", "wg0", "kernel/x.py:1", "keys.produced", 0)
  b = dataclasses.replace(a, src="kernel/x.py:2")
  c = dataclasses.replace(a, src="kernel/x.py:3", slot=1)
  assert a == b and hash(a) == hash(b) and a != c and b.src == "kernel/x.py:2"
  assert premise._static(a) == premise._static(b)
  assert premise.seq_eq([sy.Ev(True, b)], (a,)) is True
  assert premise.seq_eq([sy.Ev(True, c)], (a,)) is False
  x = tm.ge(tm.var("x"), 0)
  assert sy._join([(x, [sy.Ev(True, a)]), (tm.not_(x), [sy.Ev(True, b)])], True) == \
      [sy.Ev(True, a)]
  assert len(sy._join([(x, [sy.Ev(True, a)]), (tm.not_(x), [sy.Ev(True, c)])], True)) == 2
  words = lambda e: f"{e.src} {e.describe()}"
  extract.branches_alike("kernel/x.py:0", [[a], [b]], words)
  with pytest.raises(ExtractionError, match="kernel/x.py:1 wait .* against kernel/x.py:3"):
    extract.branches_alike("kernel/x.py:0", [[a], [c]], words)
  learner = rp.Learner("x", rp.Ring(2), persistent=False)
  for probe, e in enumerate((a, b)):
    learner._one("wg0", "iter", {"cls": 0, "ahead": 1}, (e,), f"probe {probe}")
  assert not learner.conflicts
  learner._one("wg0", "iter", {"cls": 0, "ahead": 1}, (c,), "probe 2")
  assert learner.conflicts


# protocol_mutants.SAFE's rewrites that make one wait on two lines, on different paths.
MOVED_LINES = ("same_acquire_in_both_branches", "cond_of_two_equal_lambdas")


def _lines_compared(monkeypatch):
  """Events compared with their source lines, as the proof once did."""
  from harness.proofs import premise
  fields = [f.name for f in dataclasses.fields(Event)]
  key = lambda e: tuple(getattr(e, f) for f in fields)
  monkeypatch.setattr(Event, "__eq__",
                      lambda a, b: type(b) is Event and key(a) == key(b))
  monkeypatch.setattr(Event, "__hash__", lambda e: hash(key(e)))
  static = premise._static
  monkeypatch.setattr(premise, "_static", lambda e: (e.src, *static(e)))


@pytest.mark.parametrize("name", MOVED_LINES)
def test_an_event_written_on_two_lines_is_refuted_only_with_lines_compared(name, monkeypatch):
  """Each rewrite that makes one wait on another line on some paths (the
  same waits, arrivals, copies and releases in the same order on every
  path) proves (test_safe_reordering_proves, on a one-tile and a
  persistent block: Z3's matching and the probes'); with lines compared,
  as the proof once did, it is refuted, naming the rewritten lines.  So
  the rewrite does move the wait, and its proof would fail were lines
  compared again."""
  assert pmut.BY_NAME[name] in pmut.SAFE
  _lines_compared(monkeypatch)
  refuted = _failures(prove_pool.prove([("forward", ONE_TILE, 1)], mutant=name, fail_fast=True))
  assert refuted and f".mutant_{name}.py:" in refuted[0], refuted


def test_unknown_primitive_refused(monkeypatch):
  # commit_smem stands in for a synchronisation the extractor was never taught.
  monkeypatch.setattr(extract, "HANDLED", extract.HANDLED - {"commit_smem"})
  with pytest.raises(UnknownPrimitive, match="commit_smem"):
    fwd.forward_program(ONE_TILE)


def test_a_premise_the_kernel_breaks_fails_loudly():
  """The producer that skips its first wait for a release (> for >=) fills
  position S unlike S + M: its units depend on more than the ring class.
  The learner refuses the program, and the probes that disagree are
  checked as they are, which shows the overwrite."""
  mutant = pmut.BY_NAME["producer_first_reuse_wait_skipped"]
  with pytest.raises(rp.PremiseError, match="wg2.warp0") as err:
    fwd.forward_program(ONE_TILE, modules=pmut.modules(mutant))
  assert len(err.value.probes) == 2
  rc, out = _run_prove("--mutant", mutant.name, "--fail-fast")
  assert rc == 1 and "the events depend on more than the proof's contexts" in out, out
  assert "overwrite before release" in out, out


def test_learned_tables_are_the_coarsest_the_probes_allow(shipped_programs):
  """A consumer's units depend on the slot (not on the whole ring class),
  the producer's fill on whether it must wait for a release, and the
  query prefetch on nothing but whether a tile is the first."""
  prog = shipped_programs[PERSISTENT]
  roles = {r.name: r for r in prog.roles}
  assert "slot" in roles["wg0"].iter.features and "cls" not in roles["wg0"].iter.features
  assert roles["wg2.warp0"].reads == "blocks"
  assert roles["wg2.warp1"].reads == "tiles"
  assert roles["wg2.warp1"].head.features == ("later",)


def test_a_context_no_probe_showed_is_a_coverage_error(shipped_programs):
  prog = shipped_programs[PERSISTENT]
  wg0 = next(r for r in prog.roles if r.name == "wg0")
  thin = rp.Table(wg0.head.features, wg0.head.units[:1])
  roles = tuple(dataclasses.replace(r, head=thin) if r.name == "wg0" else r
                for r in prog.roles)
  r = search.check(dataclasses.replace(prog, roles=roles))
  assert not r.ok and r.violation.kind == "coverage", r.violation


def test_segments_follow_the_loops():
  # n, not the line, tells them apart: lines are labels
  ev = lambda i: Event("store_wait", "r", f"kernel/x.py:{i}", n=i)
  events = [ev(i) for i in range(7)]
  loops = [(), (("t", 0),), (("t", 0), ("k", 0)), (("t", 0), ("k", 1)), (("t", 0),),
           (("t", 1),), ()]
  seg = rp.segment(events, loops, persistent=True, num_tiles=2, role="r")
  assert seg.pre == (events[0],) and seg.post == (events[6],)
  (h0, i0, t0), (h1, i1, t1) = seg.tiles
  assert h0 == (events[1],) and i0 == [(events[2],), (events[3],)] and t0 == (events[4],)
  assert h1 == (events[5],) and i1 == [] and t1 == ()
  with pytest.raises(rp.PremiseError, match="between two key-loop"):
    rp.segment([ev(0), ev(1), ev(2)], [(("k", 0),), (), (("k", 1),)], persistent=False,
               num_tiles=1, role="r")


@pytest.mark.parametrize("name", ["key_released_before_qk", "value_released_before_pv",
                                  "pingpong_token_to_wrong_warpgroup",
                                  "missing_commit_smem_before_store", None])
def test_the_reductions_lose_no_violation(name):
  """On one-tile blocks every reduction of the search (steps taken alone,
  lazy copy completion, the ring's rotation) off and on give the same
  verdict and the same kind of violation."""
  prog = fwd.forward_program(ONE_TILE, modules=pmut.modules(name) if name else None)
  full, reduced = search.check(prog, reduce=False), search.check(prog)
  assert full.ok == reduced.ok
  if not full.ok:
    assert full.violation.kind == reduced.violation.kind
  assert full.states > reduced.states


def test_the_search_runs_every_unit(shipped_programs):
  """Not vacuous: every event of every unit the probes showed is taken in
  some explored state."""
  for prog in shipped_programs.values():
    r = search.check(prog, record=True)
    assert r.ok
    missed = [(role, e.src, e.describe()) for role, e in r.unexecuted]
    assert not missed, missed[:5]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_proofs_slot_is_the_kernels(stages):
  """The ring class the proof folds positions into keeps the kernel's slot
  (PipelineState, kernel/sync/pipeline.py).  The phase is not part of it: the
  search counts each role's waits and each barrier's phases (relative to
  each other), as Mosaic GPU's per-thread phase bit does."""
  from kernel.sync.pipeline import PipelineState
  ring = rp.Ring(stages)
  for x in range(6 * stages + 3):
    c = ring.cls(x)
    assert ring.features(c)["slot"] == PipelineState.at(stages, x).index
    assert ring.advance(c) == ring.cls(x + 1)
    if x >= stages:  # warm positions one period apart share a class
      assert ring.cls(x + ring.period) == c


def test_named_barriers_past_the_budget_are_refused():
  """kernel/sync/barriers.py refuses a plan past the hardware's 16 named barriers,
  and the proof refuses an id that is Mosaic GPU's or past 16."""
  from kernel.sync import barriers
  first_free = max(b.id for b in barriers.NAMED_BARRIERS) + 1
  extra = tuple(barriers.NamedBarrier(f"extra{i}", first_free + i, 256, "")
                for i in range(16 - first_free + 1))
  with pytest.raises(ValueError, match="16"):
    barriers.check_budget(barriers.NAMED_BARRIERS + extra)
  with pytest.raises(ValueError, match="overlap"):
    barriers.check_budget(barriers.NAMED_BARRIERS + (barriers.NamedBarrier("clash", 1, 256, ""),))
  ev = Event("bar_arrive", "wg0", "kernel/x.py:1", bar_id=16, threads=256, family="x")
  empty = rp.Table((), (((), ()),))
  roles = tuple(rp.RoleProgram(name, 128, None, (ev,) if name == "wg0" else (), empty,
                               rp.Table((), ()), empty, empty, "tiles") for name in ("wg0", "wg1"))
  prog = rp.LaunchProgram("x", rp.Ring(1), False, 0, None, roles, (), ())
  r = search.check(prog)
  assert not r.ok and r.violation.kind == "named barrier id", r.violation


def _renamed(prog, rename):
  """``prog`` with its buffers and barriers renamed and every line moved."""
  n = lambda b: rename.get(b, b)

  def event(e):
    return dataclasses.replace(e, buf=n(e.buf), bar=n(e.bar), src=e.src + "0",
                               reads=tuple((n(b), s) for b, s in e.reads))

  def table(t):
    return rp.Table(t.features, tuple((k, tuple(event(e) for e in evs)) for k, evs in t.units))

  roles = tuple(dataclasses.replace(r, pre=tuple(event(e) for e in r.pre), head=table(r.head),
                                    iter=table(r.iter), tail=table(r.tail), post=table(r.post))
                for r in prog.roles)
  return dataclasses.replace(
      prog, roles=roles, barriers=tuple((n(b), a, s) for b, a, s in prog.barriers),
      overlaps=tuple((n(a), tuple(n(x) for x in bs)) for a, bs in prog.overlaps))


def test_programs_equal_up_to_names_share_one_check(shipped_programs):
  """A launch whose buffers and barriers are named otherwise (the staged
  bias's ring against the staged mask's) and whose lines moved has the
  shape of the original and the same search; one that merges two buffers
  into one name is another program."""
  prog = shipped_programs[PERSISTENT]
  bufs = sorted(({e.buf for r in prog.roles for e in r.pre} |
                 {e.buf for r in prog.roles for t in (r.head, r.iter, r.tail, r.post)
                  for _, evs in t.units for e in evs}) - {""})
  renamed = _renamed(prog, {b: f"other.{b}" for b in bufs})
  assert renamed.key() != prog.key() and renamed.shape() == prog.shape()
  # the digest the runs group by follows the shape, through a pickle too
  assert renamed.shape_digest() == pickle.loads(pickle.dumps(prog)).shape_digest()
  a, b = search.check(prog), search.check(renamed)
  assert a.ok and b.ok and a.states == b.states
  merged = _renamed(prog, {bufs[1]: bufs[0]})
  assert merged.shape() != prog.shape() and merged.shape_digest() != prog.shape_digest()


def test_the_cache_keeps_what_passed_and_only_that(tmp_path):
  """A second run takes the learned programs and the passed checks from the
  cache and reports the same; a violation is not kept (every run finds it
  anew, from the current sources)."""
  from harness.proofs import prove_cache
  cache = prove_cache.Cache(tmp_path)
  items = [("forward", ONE_TILE, 1)]
  spent, spent_again = collections.Counter(), collections.Counter()
  first = prove_pool.prove(items, jobs=1, cache=cache, spent=spent)
  assert all(r.ok for r in first) and cache.hits == {"learned": 0, "listed": 0, "checked": 0}
  # the cold run's work by phase; every phase took time, none is negative; and
  # its traces: the probes' and the ranged and plain kernels' at every length
  # (the configs' check is prove's, after the pool: test_prove_holds_every_config_...)
  learning = [p for p in tracing.PHASES if p != "configs"]
  assert set(spent) == {*learning, tracing.TRACES}, spent
  assert all(spent[p] > 0 for p in learning), spent
  assert spent[tracing.TRACES] >= 1 + len(rounds.RANGED_LENGTHS) + len(rounds.PLAIN_KERNELS), spent
  again = prove_cache.Cache(tmp_path)
  second = prove_pool.prove(items, jobs=1, cache=again, spent=spent_again)
  assert again.hits["learned"] == 1 and again.hits["checked"] == len(first)
  assert [(r.name, r.ok, r.states) for r in second] == [(r.name, r.ok, r.states) for r in first]
  assert not spent_again   # what the cache gave cost nothing
  # A failing check is recomputed, not kept.
  prog = fwd.forward_program(ONE_TILE, modules=pmut.modules("key_released_before_qk"))
  failed = prove_pool._checked(prog.shape_digest(), prog, prove_pool.Result(prog.name, []), again,
                               collections.Counter())
  assert not failed.ok
  assert again.get("checked", repr(prog.shape_digest())) is None
  # Another checker source is another digest: nothing of the first is found.
  other = prove_cache.Cache(tmp_path)
  other.digests = {k: v + "x" for k, v in other.digests.items()}
  assert other.get("learned", prove_pool._learn_key(("forward", ONE_TILE), None)) is None


def test_the_pool_reports_what_one_process_does(tmp_path):
  """On a pool, with cases handed out before the rest are listed and a
  cache, the results are those of one process, in the listing's order."""
  from harness.proofs import prove_cache
  items = [("forward", ONE_TILE, 1), ("backward", FUSED, 0)]
  alone = prove_pool.prove(items, jobs=1)
  pooled = prove_pool.prove(lambda: items, jobs=2, cache=prove_cache.Cache(tmp_path),
                            early=[("backward", FUSED)])
  assert [(r.name, r.cases, r.ok, r.states) for r in pooled] == \
      [(r.name, r.cases, r.ok, r.states) for r in alone]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failure_is_reported_when_found(jobs):
  """``on_failure`` hears of a violation as soon as its check ends (on a
  pool too), once, naming the launch program and the violation, while the
  results still list it: ``python -m harness prove`` prints the first one
  before the run ends."""
  heard = []
  results = prove_pool.prove([("forward", ONE_TILE, 1)], jobs=jobs, mutant="key_released_before_qk",
                             on_failure=heard.append)
  failed = [r for r in results if not r.ok]
  assert failed and len(heard) == len(failed), (heard, failed)
  assert heard[0].startswith(f"{failed[0].name}: {failed[0].violation.kind}: "), heard


def test_only_the_mask_selects_count_as_register_only():
  """kernel/masks/register_selects.py's selects (causal, key limit) run
  under data-dependent conds (the diagonal and edge steps): the extractor
  lets them pass as register-only by their seam, while any other
  inline_mgpu, even one of the same name, still counts as synchronisation."""
  import jax
  import jax.numpy as jnp
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from kernel.masks import register_selects

  x = jnp.zeros((64, 128), jnp.float32)
  select = jax.make_jaxpr(lambda x: register_selects.causal_select(
      x, key_base=0, query_base=3, key_dim=1, fill=0.0))(x)
  assert not jaxprs.has_sync(select.jaxpr)
  limit = jax.make_jaxpr(lambda x: register_selects.key_limit_select(
      x, key_base=0, limit=100, key_dim=1, fill=0.0))(x)
  assert not jaxprs.has_sync(limit.jaxpr)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def select(_ctx, a):  # same name, no seam
    return a

  assert jaxprs.has_sync(jax.make_jaxpr(select)(x).jaxpr)


def test_the_split_tail_case_probes_blocks_that_end_in_pieces():
  """The traced split tail has half a wave more than whole waves, so the
  probed blocks (0 and 1) run whole tiles and then pieces (slot >= 0) over
  part of their tiles' key blocks: the proof sees pieces, not only tiles."""
  case = cases.ForwardCase(2, True, "split-tail", False, False, False, 64, 128, 2)
  closed, kernel, _ = ft.trace_case(case)
  table = fwd._split_tail_table(pb.const_values(closed, kernel), case)
  for block in range(pb.PROBED_BLOCKS):
    slots, lo, hi = table[block, 3], table[block, 1], table[block, 2]
    assert (slots == -1).any() and (slots >= 0).any(), table[block]
    assert ((hi - lo)[slots >= 0] < hi.max()).all()


def test_the_split_tail_proves_with_its_pieces():
  """The split tail, its probed blocks ending in pieces, proves whole: a
  piece's stores (to its slot) must read as the same events as a tile's
  (to the output), and its cut trip counts as any tile's."""
  case = cases.ForwardCase(2, True, "split-tail", False, False, False, 64, 128, 2)
  results = prove_pool.prove([("forward", case, 1)], jobs=1)
  assert results and all(r.ok for r in results), [
      r.premise or r.violation.format() for r in results if not r.ok]


UNTILED = dataclasses.replace(ONE_TILE, untiled_copies=True)
# Untiled copies in column parts (kernel.tiling.plan.copy_parts): 128 in two,
# persistent, one wgmma per part in each product.
UNTILED_PARTS = dataclasses.replace(PERSISTENT, untiled_copies=True, layout_head_dim=128,
                                    layout_head_dim_out=128)


# FP8: one-byte queries and keys in one part of 128 bytes at head dim 128,
# V^T whole, the 16-bit output in two parts (each its columns of V^T).
UNTILED_FP8 = dataclasses.replace(UNTILED_PARTS, dtype="float8_e4m3fn")


@pytest.mark.parametrize("case", [UNTILED, UNTILED_PARTS, UNTILED_FP8],
                         ids=["d64", "d128-parts", "fp8-d128-parts"])
def test_untiled_copies_prove_as_copies_into_the_buffers_read(case):
  """Copies through untiled views (kernel.common.untiled_smem): the TMA
  writes one group of a union and wgmma reads the other, the same bytes,
  which the extraction reads as one buffer.  Read as views that share
  bytes, a read of the tiled buffers after a copy into the untiled views
  is an overlay the proof refuses: the rule that merges them is what
  proves it."""
  assert case.parts == {UNTILED: (1, 1), UNTILED_PARTS: (2, 2), UNTILED_FP8: (1, 2)}[case]
  results = prove_pool.prove([("forward", case, 1)], jobs=1)
  assert results and all(r.ok for r in results), [
      r.premise or r.violation.format() for r in results if not r.ok]
  kept = extract.mirror_groups
  try:
    extract.mirror_groups = lambda groups: {}
    r = search.check(fwd.forward_program(case))
  finally:
    extract.mirror_groups = kept
  assert not r.ok and r.violation.kind == "overlay", r.violation and r.violation.format()


def test_only_groups_of_identical_layouts_are_mirrors():
  """A union's groups mirror an earlier one only where they hold refs of
  the same shapes and dtypes in the same order: the non-persistent overlay
  of q and k with o, m and l keeps its groups apart; with untiled copies
  its four groups pair up."""
  import jax
  import jax.numpy as jnp
  aval = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  qk = (aval((2, 64, 64)), aval((2, 128, 64)))
  out = (aval((2, 64, 64)), aval((2, 64), jnp.float32), aval((2, 64), jnp.float32))
  assert jaxprs.mirror_groups((qk, out)) == {}
  assert jaxprs.mirror_groups((qk, out, qk, out)) == {2: 0, 3: 1}
  assert jaxprs.mirror_groups((aval((2, 64, 64)), aval((2, 64, 64)))) == {1: 0}
  assert jaxprs.mirror_groups((aval((2, 64, 64)), aval((2, 64, 64), jnp.float16))) == {}
  assert jaxprs.mirror_groups(None) == {}


def test_the_word_ends_with_every_block_the_producer_copied():
  """The producer reads only the blocks; once it has found its last one,
  the blocks it found stay owed to the word, which places them all before
  it ends.  Before, the search let the compute warpgroups see a tile of
  two key blocks after the producer had copied three, and refused the
  output overlay that reaches the keys (head dims 64 and 256,
  non-persistent) over a copy the kernel never issues; a kernel traced for
  one tile of two blocks issues two."""
  case = cases.ForwardCase(4, False, "round-robin", False, False, True, 64, 64, 4,
                           layout_head_dim=64, layout_head_dim_out=256, output_over_keys=True)
  results = prove_pool.prove([("forward", case, 1)], jobs=1)
  assert results and all(r.ok for r in results), [
      r.premise or r.violation.format() for r in results if not r.ok]


@pytest.fixture(scope="module")
def shipped_cases():
  """The forward's cases of ``python -m harness prove`` (listed once: about
  five seconds)."""
  return list(prove_cli.forward_listing())


def test_an_output_overlay_over_the_keys_is_a_case_of_its_own(shipped_cases):
  """Where the value head dim is wider than the queries' (or m and l
  follow an output as long as the queries, or FP8's two-byte output
  follows its one-byte queries), the non-persistent block's output overlay
  reaches the keys: the proof's cases keep such layouts apart and trace
  them at their own head dims, residuals and dtype."""
  from kernel.tiling import plan as plan_lib
  found = [c for c, _ in shipped_cases if c.output_over_keys]
  assert found and all(not c.persistent for c in found)
  assert all(c.head_dim_out > c.head_dim or c.residuals or c.dtype == "float8_e4m3fn"
             for c in found)
  assert any(c.head_dim_out > c.head_dim for c in found)
  assert any(c.head_dim_out == c.head_dim and not c.residuals for c in found
             if c.dtype == "float8_e4m3fn")
  problem = plan_lib.problem_for(np.dtype(ml_dtypes.bfloat16), 64, 256, 1000, 1000)
  assert plan_lib.scratch_layout(problem, Config(64, 64, 2)).output_reaches_keys
  assert not plan_lib.scratch_layout(problem.replace(head_dim_out=64),
                                     Config(64, 64, 2)).output_reaches_keys


def test_the_shipped_untiled_copies_are_proved_and_the_other_way_on_request(shipped_cases):
  """``python -m harness prove`` proves the configs the shipped API can
  run: at lengths no multiple of 8 the copies through untiled views, in
  each head dim's column parts (kernel.tiling.plan.untiled_copies_pay),
  never in FP8; ``--experiments`` adds every problem once more copied the
  other way."""
  shipped = {c for c, _ in shipped_cases}
  untiled = [c for c in shipped if c.untiled_copies]
  assert {c.parts for c in untiled} >= {(1, 1), (2, 2), (3, 3), (4, 4), (1, 4), (2, 1)}
  assert not any(c.dtype == "float8_e4m3fn" for c in untiled)
  assert any(not c.untiled_copies and c.dtype != "float8_e4m3fn" for c in shipped)
  grid, both = prove_cli.problem_grid(), prove_cli.problem_grid(experiments=True)
  assert both[::2] == grid
  assert all(o == p.replace(untiled_copies=not p.untiled_copies)
             for p, o in zip(both[::2], both[1::2]))
  # the other way's protocols (a spread of them): FP8 untiled among them
  other = [c for c, _ in cases.forward_cases(both[1::2][::7])]
  assert {c.protocol_key() for c in other} - {c.protocol_key() for c in shipped}
  assert any(c.untiled_copies and c.dtype == "float8_e4m3fn" for c in other)


@pytest.mark.parametrize("pair,twin", [((1000, 1000), (1001, 1001)), ((100, 64), (104, 64)),
                                       ((1, 1), (8, 8)), ((128, 200), (129, 201))])
def test_every_length_of_the_proof_grid_is_listed_with_its_twin(pair, twin):
  """Each length pair of the grid comes with lengths of the same blocks
  copied the other way, so each config the heuristics emit there is proved
  both ways the API may copy (kernel.tiling.plan.untiled_copies_pay)."""
  assert prove_cli.length_twin(*pair) == twin
  lengths = {(p.seq_q, p.seq_kv) for p in prove_cli.problem_grid()}
  assert {pair, twin} <= lengths


def test_the_output_overlays_slots_part_the_cases(shipped_cases):
  """Block sizes, head dims and residuals move the non-persistent output
  overlay over other query and key slots (kernel.tiling.plan.ScratchLayout's
  output_overlaps), and with it the slots the epilogue's stores clobber: the
  cases keep each placement apart and trace it where it lies.  Two cases
  alike but for m and l stored over the second warpgroup's query slot learn
  different programs."""
  plain = [c for c, _ in shipped_cases if c.output_slots and not c.residuals
           and not c.output_over_keys and c.num_stages == 2 and c.compute_warpgroups == 2
           and not (c.bias or c.mask) and c.dtype == "bfloat16"]
  assert plain, "no non-persistent overlay without residuals among the cases"
  case = plain[0]
  with_ml = [c for c, _ in shipped_cases if c.residuals and not c.output_over_keys
             and len(c.output_slots) == 3 and dataclasses.replace(
                 c, output_slots=case.output_slots, overlay_residuals=False,
                 block_q=case.block_q, block_kv=case.block_kv, config_stages=case.config_stages,
                 layout_head_dim=case.layout_head_dim,
                 layout_head_dim_out=case.layout_head_dim_out) == case]
  assert with_ml, f"no case like {case.describe()} with m and l in the overlay"
  other = with_ml[0]
  assert {name for name, _ in other.output_slots} == {"o", "m", "l"}
  a, b = fwd.forward_program(case), fwd.forward_program(other)
  assert a.shape() != b.shape()


def test_an_edit_of_the_command_keeps_the_learned_programs(tmp_path, monkeypatch):
  """The learned programs' digest reads the kernel and the learning code,
  not the command's module: an edit there lists the cases again but learns
  nothing again; a kernel edit does both."""
  import shutil
  from harness.proofs import prove_cache
  fake = tmp_path / "repo"
  for rel in set(prove_cache.LIST_SOURCES + prove_cache.CHECK_SOURCES):
    src, dst = prove_cache.REPO / rel, fake / rel
    if src.is_dir():
      shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    else:
      dst.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src, dst)
  monkeypatch.setattr(prove_cache, "REPO", fake)
  digests = lambda: prove_cache.Cache(tmp_path / "cache").digests
  before = digests()
  with open(fake / "harness/proofs/prove.py", "a") as f:
    f.write("# printed otherwise\n")
  command = digests()
  assert command["learned"] == before["learned"] and command["listed"] != before["listed"]
  assert command["checked"] == before["checked"]
  with open(fake / "kernel/forward/mainloop.py", "a") as f:
    f.write("# edited\n")
  kernel = digests()
  assert kernel["learned"] != command["learned"] and kernel["listed"] != command["listed"]


def _proof_modules(*roots: str) -> set[str]:
  """The files of harness/proofs/ that ``roots`` (paths from the repository)
  import, inside functions too, transitively, themselves included."""
  import ast
  from harness.proofs import prove_cache
  seen, todo = set(), list(roots)
  while todo:
    path = todo.pop()
    if path in seen:
      continue
    seen.add(path)
    for node in ast.walk(ast.parse((prove_cache.REPO / path).read_text())):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module == "harness.proofs":
        names = [f"harness.proofs.{a.name}" for a in node.names]
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.proofs."):
        names = [node.module]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.startswith("harness.proofs.")]
      todo += [name.replace(".", "/") + ".py" for name in names]
  return seen


def test_the_cache_keys_every_proof_module_it_runs():
  """A check's digest reads every module the search imports; the learned
  programs' digest every module learning imports, but the search's (keyed
  with the checks) and the mutants' (whose runs skip the cache): a module
  split off one of them is listed, or an edit of it would be served stale."""
  import inspect
  from harness.proofs import prove_cache
  repo = prove_cache.REPO
  listed = lambda sources: {str(f.relative_to(repo)) for f in prove_cache._files(sources)}
  rel = lambda module: str(__import__("pathlib").Path(inspect.getfile(module)).relative_to(repo))
  checked = _proof_modules(rel(search))
  assert len(checked) > 3 and not checked - listed(prove_cache.CHECK_SOURCES), \
      sorted(checked - listed(prove_cache.CHECK_SOURCES))
  learning = _proof_modules(rel(inspect.getmodule(prove_pool._programs_of))) - checked - {
      rel(pmut)}
  assert len(learning) > 3 and not learning - listed(prove_cache.LEARN_SOURCES), \
      sorted(learning - listed(prove_cache.LEARN_SOURCES))


def test_jobs_default_to_the_usable_cpus_and_refuse_fewer_than_one(monkeypatch, capsys, tmp_path):
  """Without --jobs the proof runs a worker per CPU this process may use (a
  bigger runner proves sooner), within a container's CPU quota; --jobs 0 is
  refused by name."""
  with pytest.raises(SystemExit) as refused:
    prove_cli.main(["--jobs", "0"])
  assert refused.value.code == 2 and "--jobs: 0" in capsys.readouterr().err
  assert 1 <= prove_cli.usable_cpus() <= (os.cpu_count() or 1)
  # a container's CPU quota caps them: cgroup v2, then v1, rounded up
  v2 = tmp_path / "v2"
  v2.mkdir()
  (v2 / "cpu.max").write_text("150000 100000\n")
  assert prove_cli.usable_cpus(str(v2)) == min(2, len(os.sched_getaffinity(0)))
  (v2 / "cpu.max").write_text("max 100000\n")
  assert prove_cli.usable_cpus(str(v2)) == len(os.sched_getaffinity(0))
  v1 = tmp_path / "v1" / "cpu"
  v1.mkdir(parents=True)
  (v1 / "cpu.cfs_quota_us").write_text("100000\n")
  (v1 / "cpu.cfs_period_us").write_text("100000\n")
  assert prove_cli.usable_cpus(str(v1.parent)) == 1
  (v1 / "cpu.cfs_quota_us").write_text("-1\n")
  assert prove_cli.usable_cpus(str(v1.parent)) == len(os.sched_getaffinity(0))

  class Started(Exception):
    pass

  def workers(jobs, fork=False):
    asked.append(jobs)
    raise Started

  asked = []
  monkeypatch.setattr(prove_cli, "usable_cpus", lambda: 3)
  monkeypatch.setattr(prove_pool, "workers", workers)
  with pytest.raises(Started):
    prove_cli.main(["--no-cache"])
  assert asked == [3]


def test_select_proves_only_what_it_names_and_says_so(capsys):
  """``prove --select``: the protocols whose description has every word, and
  a line saying how many of all were selected; a selection that names none
  is refused before any work; a mutant among the selected still fails."""
  rc, out = _run_prove("--select", "backward d=64 bias,dQ", "--no-cache", "--jobs", "1")
  assert rc == 0, out
  assert "0 forward protocols" in out and "2 backward launch kinds" in out, out
  assert re.search(r"--select 'backward d=64 bias,dQ': 0 of \d+ forward protocols and 2 of "
                   r"\d+ backward launch kinds; the others are not proved", out), out
  with pytest.raises(SystemExit) as refused:
    prove_cli.main(["--select", "backward d=48"])
  assert refused.value.code == 2 and "--select: no forward protocol" in capsys.readouterr().err
  rc, out = _run_prove("--select", "backward d=64 dQ kernel", "--mutant", "dq_slot_without_lb",
                       "--jobs", "1")
  # refuted by the search or by Z3's (P), which of the two depends on what
  # the process proved before; either names the mutated file's lines
  assert rc == 1 and ("VIOLATION" in out or "PREMISE" in out), out
  assert "dq.mutant_dq_slot_without_lb.py" in out, out


def test_every_case_field_is_keyed_or_represented(monkeypatch):
  """A case's key tells apart what its fields (or the properties read from
  them) decide, and nothing a representative stands for; a field added to
  ForwardCase without saying which it is stops the import."""
  base = cases.ForwardCase(2, True, "round-robin", False, False, False)
  wider = dataclasses.replace(base, block_q=128, layout_head_dim=128)
  assert wider.protocol_key() == base.protocol_key()
  assert wider.key() != base.key() and wider.covers(base) and not base.covers(wider)
  assert dataclasses.replace(base, config_stages=3).key() != base.key()   # a ring cut
  assert dataclasses.replace(base, dtype="float8_e4m3fn").key() != base.key()
  grown = dataclasses.make_dataclass("Grown", [("softcap", bool, False)],
                                     bases=(cases.ForwardCase,), frozen=True)
  monkeypatch.setattr(cases, "ForwardCase", grown)
  with pytest.raises(TypeError, match=r"classify \['softcap'\]"):
    cases._every_field_classified()


def test_every_config_lists_each_config_at_its_own_sizes():
  """``prove --every-config``'s cases: one per emitted config's block sizes,
  stages, head dims and dtype, each of them a refinement of a default case
  (the same key, and more), and traced at its own sizes (its description
  names them)."""
  grid = prove_cli.problem_grid()[::47]
  listed = cases.forward_cases(grid)
  default = {c.key() for c, _ in listed}
  exact = cases.forward_cases(grid, every_config=True)
  assert len(exact) > len(default)
  assert sum(n for _, n in exact) == sum(n for _, n in listed)
  reps = cases.Representatives(c for c, _ in listed)
  for c, _ in exact:
    assert c.exact and f"blocks {c.block_q}x{c.block_kv}" in c.describe()
    assert reps.of(c).key() in default, c.describe()


def test_a_chunked_or_windowed_calls_protocols_are_among_the_proved(shipped_cases):
  """attention_chunk and local windows reach the kernels only as key ranges
  (read from memory: free values in every proof) and as the longest-first
  order's weights (tables the proof reads as free values): the configs and
  protocols of such a call are its unmasked twin's, each one prove lists."""
  reps = cases.Representatives(c for c, _ in shipped_cases)
  listed = {c.key() for c, _ in shipped_cases}
  for p in prove_cli.problem_grid()[::195]:
    plain = list(cases.emitted([p]))
    for static in (dict(chunk=64), dict(window=(100, 0)), dict(chunk=300, window=(50, 50))):
      masked = list(cases.emitted([p.replace(static_ranges=True, **static)]))
      assert masked == plain, (p, static)
      assert all(reps.of(c).key() in listed for c in masked)


def test_a_representative_shows_every_remainder_of_the_configs_it_stands_for(shipped_cases):
  """A trace takes every ragged remainder below its case's block of keys and
  tile of queries: each emitted config is proved at a representative whose
  block and tile are at least its own (so a defect past 128 keys of a
  config at block_kv 256 is traced at 256), and a protocol whose configs'
  largest block and largest tile are not one config's is traced at more
  than one."""
  grid = prove_cli.problem_grid()[::15]
  reps = cases.Representatives(c for c, _ in shipped_cases)
  for c, _ in cases.forward_cases(grid, every_config=True):
    rep = reps.of(c)
    assert rep.block_kv >= c.block_kv and rep.tile_q >= c.tile_q, (c.describe(), rep.describe())
  by_protocol = collections.Counter(c.protocol_key() for c, _ in shipped_cases)
  assert max(by_protocol.values()) > 1
  assert any(c.block_kv == 256 for c, _ in shipped_cases)
  narrow = dataclasses.replace(shipped_cases[0][0], block_kv=64)
  with pytest.raises(KeyError, match="no representative covers"):
    cases.Representatives([narrow]).of(dataclasses.replace(narrow, block_kv=256))


# Configs at their own sizes held to their representative's program: a
# dozen under the ci profile, more under thorough (each pair learns two
# programs from probes, about 0.3 s); `python -m harness.proofs.representatives`
# tests them all, `prove --every-config` proves them all.
EXACT_SAMPLE = hs.examples(12)


def test_configs_at_their_own_sizes_learn_their_representatives_programs(shipped_cases):
  """What docs/proof.md assumes ("What is assumed"), tested on a spread of
  emitted configs whose block sizes, stages or head dims differ from the
  representative their case is traced at: each, traced at its own sizes and
  16-bit dtype, learns the same program as the representative, up to the
  names of its buffers and barriers (the shape the search checks).
  ``python -m harness prove`` tests every emitted config."""
  pairs = representatives.pairs(prove_cli.problem_grid()[::11],
                                [c for c, _ in shipped_cases], differing_only=True)
  sample = pairs[::max(1, len(pairs) // EXACT_SAMPLE)]
  assert len(sample) >= EXACT_SAMPLE, len(pairs)
  learned: dict = {}
  shape = lambda case: learned.setdefault(case, representatives.shape(case))
  differ = [f"{c.describe()} against {rep.describe()}" for c, rep in sample
            if shape(c) != shape(rep)]
  assert not differ, differ
  # the sample spans protocols whose programs differ: the comparison can fail
  assert len({shape(rep) for _, rep in sample}) > 1


def test_prove_holds_every_config_to_its_representatives_program(shipped_cases, monkeypatch):
  """``prove`` compares every emitted config of the protocols it proves,
  traced at its own sizes, with its representative
  (harness.proofs.representatives.check): all agree over a few problems;
  where one would not, it is named and the run fails, even when every
  launch program proves."""
  grid = prove_cli.problem_grid()[::801]
  work = representatives.pairs(grid, [c for c, _ in shipped_cases])
  real, learned = representatives.shape, {}

  def once(case):   # each program learned once over both checks
    if case not in learned:
      learned[case] = real(case)
    return learned[case]
  monkeypatch.setattr(representatives, "shape", once)
  spent = collections.Counter()
  lines, summary = representatives.check(lambda: work, spent=spent)
  assert not lines and f"{len(work)} of {len(work)} emitted configs" in summary, summary
  # its learning counted in prove's phases, traces and all
  assert spent["configs"] > 0 and spent[tracing.TRACES] > 0, spent
  monkeypatch.setattr(representatives, "shape",
                      lambda c: "other" if c.exact and c.block_kv == 64 else once(c))
  lines, _ = representatives.check(lambda: work)
  assert lines and all("block" in line for line in lines), lines
  # the command: nothing to prove (the search is stood in for), one config that differs
  # (of the listing's own cases: the emitted configs' listing is not the point here)
  monkeypatch.setattr(prove_pool, "prove", lambda *a, **k: [])
  monkeypatch.setattr(representatives, "compare",
                      lambda work, pool=None, known=None, spent=None: (work[:1], 1))
  listing = prove_cli.forward_listing
  monkeypatch.setattr(prove_cli, "forward_listing",
                      lambda experiments=False, every_config=False: listing(experiments))
  assert listing() is listing(False, False)   # one listing, however it is asked for
  rc, out = _run_prove("--select", "stages=2,one tile", "--jobs", "1", "--no-cache")
  assert rc == 1 and "DIFFERS: " in out and "learns another program" in out, out


def test_the_configs_check_reads_the_shapes_the_proof_learned(shipped_cases):
  """``prove`` hands the configs' check the program shapes it learned for
  the representatives (prove_pool.prove's ``shapes``): each is the shape
  the check would learn from the probes alone, and a config traced as its
  representative is (representatives.same_trace) is not traced again."""
  reps = [c for c, _ in shipped_cases if c.num_stages == 2 and not c.persistent][:3]
  shapes: dict = {}
  results = prove_pool.prove([("forward", c, 1) for c in reps], jobs=1, shapes=shapes)
  assert all(r.ok for r in results)
  assert set(shapes) == set(reps)
  assert all(shapes[c] == representatives.shape(c) for c in reps)
  twin = dataclasses.replace(reps[0], exact=True)
  assert representatives.same_trace(twin, reps[0])
  assert not representatives.same_trace(dataclasses.replace(twin, block_kv=2 * twin.block_kv),
                                        reps[0])
  traced = []
  real = representatives.shape
  learn = lambda c: traced.append(c) or real(c)
  import unittest.mock as mock
  with mock.patch.object(representatives, "shape", learn):
    differ, _ = representatives.compare([(twin, reps[0])], known=shapes)
  assert differ == [] and traced == []


def test_a_mutants_words_describe_cases_that_show_it(shipped_cases):
  """``prove --mutant`` puts the forward cases a mutant's words describe
  (Mutant.shows) first: words that describe none would leave it to prove
  every smaller case before the one that shows it."""
  described = [c.describe() for c, _ in shipped_cases]
  worded = [m for m in pmut.MUTANTS if m.shows]
  assert worded, "no mutant names the cases that show it"
  for m in worded:
    assert any(m.shows in d for d in described), (m.name, m.shows)


def test_the_configs_check_compares_programs_learned_alike(shipped_cases):
  """The configs' check holds a config's program, learned from its probes,
  to its representative's as the proof's probes learned it
  (LaunchProgram.probes_digest), not as Z3's rounds refined it: at four
  stages the refined program has more to it, and comparing the two kinds
  named 1,152 configs of main at b4a2565 as differing that learn the very
  same program."""
  case = next(c for c, _ in shipped_cases if c.num_stages == 4 and not c.persistent
              and c.untiled_copies and c.parts == (3, 3))
  proved = fwd.forward_program(case)
  probed = fwd.forward_program(case, premise=False)
  assert proved.probes_digest() == probed.shape_digest() == representatives.shape(case)
  assert proved.shape_digest() != probed.shape_digest()
  shapes: dict = {}
  prove_pool._collect([("forward", case)], [([(case.describe(), proved)], None, 0.0, {})],
                      {id(case): 1}, {}, shapes)
  assert shapes == {case: probed.shape_digest()}
