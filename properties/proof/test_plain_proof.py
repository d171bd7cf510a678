"""The kernels a call without key ranges launches (their key-block count
compiled in), proved by Z3 to run the launch programs of the kernels that
read ranges (harness/proofs/forward_traces.py's trace_plain and
premise_rounds.py's plain_proved): traced with the keys' length a symbolic dimension, read
with its trip count a variable, and held against the ranged program's
tables at every trip count and ring position."""

import dataclasses
import re

import numpy as np
import pytest
from jax import export

from harness.proofs import cases
from harness.proofs import backward_traces as bt
from harness.proofs import backward_probes as bwd
from harness.proofs import forward_traces as ft
from harness.proofs import forward_probes as fwd
from harness.proofs import premise_rounds as rounds
from harness.proofs import symbolic_dims as sd
from harness.proofs import tracing
from harness.proofs import protocol_mutants as pmut
from harness.proofs import role_programs as rp
from harness.proofs import symbolic as sy
from harness.proofs import term_walks as tw
from harness.proofs import terms as tm
from harness.proofs.events import ExtractionError
from harness.tools.anchors import edit

ONE_TILE = cases.ForwardCase(2, False, "round-robin", False, False, False, 64, 128, 2)
PERSISTENT = cases.ForwardCase(2, True, "round-robin", False, False, False, 64, 128, 2)
CAUSAL = cases.ForwardCase(2, False, "round-robin", False, False, True, 64, 128, 2)
SPLIT = cases.ForwardCase(2, True, "split-tail", False, False, False, 64, 128, 2)
LONGEST = cases.ForwardCase(2, True, "longest-first", False, False, True, 64, 128, 2)
SLIP = "plain_key_loop_one_block_short"


@pytest.mark.parametrize("case", [ONE_TILE, PERSISTENT, CAUSAL, SPLIT, LONGEST],
                         ids=["one tile", "persistent", "causal", "split tail", "longest-first"])
def test_a_plain_kernel_is_proved_to_run_the_ranged_program(case):
  prog = fwd.forward_program(case)
  assert prog.plain == tuple(rounds.PLAIN_KERNELS)
  assert prog.z3 and prog.z3[0] > 0


def _producer_loop(kernel, dims):
  units = sy.units("wg2.warp0", sy.extract_symbolic(kernel, dims).roles["wg2.warp0"],
                   persistent=False)
  (loop,) = units.loops
  return loop.hi


# The grid's counts' variables (symbolic_dims.GRID_COUNTS), in every trace's dims.
COUNTS = {"batches": 1, "kv_heads": 1, "group": 1}
# Every dimension variable at its least (symbolic.dim_term: lo + max(0, v)).
LEAST = {f"dim.{n}": 0 for n in ("m", "mq", "sq", "r")}


def test_the_keys_length_is_a_variable_from_the_ring_up():
  """The producer's key loop runs to the symbolic key-block count: a
  variable of the terms, from the ring's stages up (one fewer whole
  block when the keys are ragged); causal, cut at the queries' end, whose
  length (whole tiles and the rows short of the last) is a variable too."""
  for ragged in (False, True):
    (kernel,), dims = ft.trace_plain(ONE_TILE, ragged=ragged)
    assert dims == {"m": 1, "mq": 1, "sq": (1, 128), **COUNTS,
                    **({"r": (1, 127)} if ragged else {})}
    hi = _producer_loop(kernel, dims)
    assert "dim.m" in tm.serialise(hi) and "dim.mq" not in tm.serialise(hi), hi
    assert tw.evaluate(hi, LEAST) == 2   # the ring's stages, the ragged block counted
  (kernel,), dims = ft.trace_plain(CAUSAL, ragged=True)
  hi = _producer_loop(kernel, dims)
  assert all(f"dim.{n}" in tm.serialise(hi) for n in ("m", "mq", "sq")), hi
  # one tile of 128 queries: the causal bound's one block
  assert tw.evaluate(hi, {**LEAST, "axis.q_tiles": 0}) == 1
  # 192 queries (64 short of two tiles): the second tile's rows end in key block 1
  assert tw.evaluate(hi, {**LEAST, "dim.mq": 1, "dim.sq": 65, "dim.m": 5,
                          "axis.q_tiles": 1}) == 2
  with pytest.raises(ExtractionError, match="no lower bound for m"):
    sy.extract_symbolic(ft.trace_plain(ONE_TILE, ragged=False)[0][0], {})


def test_a_persistent_block_walks_a_variable_count_of_tiles():
  """Not causal, the query tiles are a variable too: a persistent block's
  walk over the tiles the grid deals it runs to a count of that variable,
  not to a traced constant, on a grid of any number of blocks (as the
  ranged traces have).  The split tail's too: its tile ids unpack by that variable, its
  entry table a stand-in of the host's, read as free values."""
  (kernel,), dims = ft.trace_plain(PERSISTENT, ragged=False)
  assert dims == {"m": 1, "mq": 1, "sms": 1, "sq": (1, 128), **COUNTS}
  units = sy.units("wg2.warp0", sy.extract_symbolic(kernel, dims).roles["wg2.warp0"],
                   persistent=True)
  walk = tm.serialise(units.tile.hi)
  # the tiles: batches * heads * mq, a product of counts (symbolic.dim_term)
  assert re.search(r"dim\.\([^)]*mq", walk) and "axis.sm" in walk, walk
  assert ft.trace_plain(SPLIT, ragged=False)[1] == {"m": 1, "mq": 1, "sms": 1, "sq": (1, 128),
                                                     **COUNTS}


def test_the_ranged_kernel_is_proved_at_every_length():
  """The kernel that reads key ranges, probed at one length, is traced
  again at every length of its queries and keys, whole and ragged, and Z3
  holds it to the probes' tables: a persistent round-robin block's walk
  runs to a variable count of tiles, not the probes' compiled one, and a
  ragged key length bounds the unmasked blocks by a variable."""
  for ragged in (False, True):
    (kernel,), dims = ft.trace_ranged(PERSISTENT, ragged=ragged)
    assert dims == {"m": 1, "mq": 1, "sms": 1, "sq": (1, 128), **COUNTS,
                    **({"r": (1, 127)} if ragged else {})}
    units = sy.units("wg2.warp0", sy.extract_symbolic(kernel, dims).roles["wg2.warp0"],
                     persistent=True)
    assert re.search(r"dim\.\([^)]*mq", tm.serialise(units.tile.hi))
  traced = []
  real = ft.trace_ranged
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ft, "trace_ranged", lambda case, **kw: traced.append(kw["ragged"]) or
               real(case, **kw))
    prog = fwd.forward_program(PERSISTENT)
  assert traced == [False, True, False, True] and prog.lengths == tuple(rounds.RANGED_LENGTHS)
  assert prog.plain == tuple(rounds.PLAIN_KERNELS)
  # the split tail's tile ids, unpacked by the symbolic count of tiles
  (kernel,), dims = ft.trace_ranged(SPLIT, ragged=True)
  assert dims == {"m": 1, "mq": 1, "r": (1, 127), "sms": 1, "sq": (1, 128), **COUNTS}
  units = sy.units("wg2.warp0", sy.extract_symbolic(kernel, dims).roles["wg2.warp0"],
                   persistent=True)
  (loop,) = units.loops
  assert "dim.mq" in tm.serialise(loop.hi), loop.hi


# A wait the producer skips for a ragged last block of under 16 keys, in a
# call with key ranges only: its probes (whole key blocks) and every plain
# kernel run the shipped program.
RANGED_SHORT_TAIL = pmut.Mutant(
    "ranged_short_tail_values_unacquired",
    "with key ranges, the values of a last key block of under 16 keys copied without "
    "waiting for their slot",
    (edit("producer.fill", "values.producer_acquire(st)",
          "tail = jnp.int32(c.problem.seq_kv % c.block_kv); "
          "pl.when((ki != ub - 1) | (tail == 0) | (tail >= 16) | (not c.key_ranges))("
          "lambda: values.producer_acquire(st))"),))


def test_a_slip_in_a_ranged_call_at_ragged_lengths_only_is_refuted():
  """A defect only where a call with lengths, a window or segments has a
  ragged key length: the probes' trace (whole key blocks) and the plain
  kernels prove as the shipped ones do; Z3, given the ranged kernel at
  every ragged length, refutes it, naming the mutated line."""
  modules = pmut.modules(RANGED_SHORT_TAIL)
  prober = fwd._ForwardProber(ONE_TILE, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  (plain,) = rounds.plain_proved([prog], lambda ragged: ft.trace_plain(ONE_TILE, ragged=ragged,
                                                                       modules=modules))
  assert plain.z3[0] > prog.z3[0]   # the plain kernels' claims held
  with pytest.raises(rp.PremiseError, match="reads key ranges, at every ragged length") as err:
    fwd.forward_program(ONE_TILE, modules=modules)
  assert "kernel/forward/producer.mutant_ranged_short_tail_values_unacquired.py:" in \
      str(err.value), err.value


@pytest.mark.parametrize("asks, named", [("== 1", "mq == 1"), ("> 1", "'mq' > '1'")],
                         ids=["an equality JAX answers false", "an order JAX refuses"])
def test_a_branch_on_a_length_the_symbols_do_not_decide_is_refused(asks, named):
  """JAX answers an equality of symbolic lengths it cannot decide False, so
  a kernel that special-cases a one-tile grid would be traced for every
  grid but that one.  The kernel's own comparisons must be decided for
  every length the symbols stand for; one that is not is refused, naming
  its line, as is an order JAX refuses itself.  JAX's own comparisons
  (broadcasting's ``d == 1``) are not the kernel's."""
  name = "tile_count_special"
  m = pmut.Mutant(name, f"a grid whose tile count is {asks} taken as ragged",
                  (edit("context.ragged_kv",
                        "return self.problem.seq_kv % self.config.block_kv != 0",
                        "return self.problem.seq_kv % self.config.block_kv != 0 or "
                        f"self.num_tiles {asks}"),))
  with pytest.raises(ExtractionError, match="compares its symbolic lengths") as err:
    ft.trace_plain(ONE_TILE, ragged=False, modules=pmut.modules(m))
  assert f": kernel/forward/context.mutant_{name}.py:" in str(err.value), err.value
  assert named in str(err.value), err.value
  ft.trace_plain(ONE_TILE, ragged=False)   # the shipped kernel's are all decided


def test_a_length_from_zero_is_traced_from_zero():
  """JAX takes every dimension variable to be at least 1: a length whose
  least is 0 (no whole key block, no query row short) is a variable less
  1, so that JAX decides nothing for it that fails at 0, and dim_term
  reads each length back within its bounds."""
  from jax._src.export.shape_poly import InconclusiveDimensionOperation
  values, bounds = sd.dimensions({"m": 0, "r": (1, 127), "sq": (0, 127)})
  assert bounds == {"m": 1, "r": (1, 127), "sq": (1, 128)}
  assert values["m"] >= 0
  with pytest.raises(InconclusiveDimensionOperation):
    bool(values["m"] >= 1)
  for name, least, most in (("m", 0, None), ("r", 1, 127), ("sq", 0, 127)):
    term = sy.dim_term(values[name], bounds)
    assert tw.evaluate(term, {f"dim.{name}": -5}) == least
    assert tw.evaluate(term, {f"dim.{name}": 1000}) == (most or 1000)


def test_the_ragged_keys_are_every_remainder():
  """The ragged plain trace's keys past the whole blocks are a symbol
  between 1 and block_kv - 1, not one representative count: the kernel's
  divisions of the length by the block are exact over that range
  (block_kv * m + r split into m whole blocks and r keys), and the key
  mask reads r."""
  (kernel,), dims = ft.trace_plain(ONE_TILE, ragged=True)
  terms = []
  real = sy.dim_term
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(sy, "dim_term", lambda *a, **k: terms.append(real(*a, **k)) or terms[-1])
    sy.extract_symbolic(kernel, dims)
  assert any("dim.r" in tm.serialise(t) for t in terms if tm.is_term(t)), terms
  a, b = export.symbolic_shape("a, b", constraints=("a >= 1", "b >= 1", "b <= 127"))
  with sd.exact_divisions():
    assert (128 * a + b) // 128 == a and (128 * a + b) % 128 == b
    assert -(-(128 * a + b) // 128) == a + 1
    assert str((128 * a + b) // 64).startswith("floordiv")   # b // 64 is not fixed
  assert str((128 * a + b) // 128).startswith("floordiv")    # JAX's own, outside


# A wait the producer skips for a ragged last block of under 16 keys: a
# remainder the representative count of keys (37) never takes.
SHORT_TAIL = pmut.Mutant(
    "short_tail_values_unacquired",
    "the values of a last key block of under 16 keys copied without waiting for their slot",
    (edit("producer.fill", "values.producer_acquire(st)",
          "tail = jnp.int32(c.problem.seq_kv % c.block_kv); "
          "pl.when((ki != ub - 1) | (tail == 0) | (tail >= 16))("
          "lambda: values.producer_acquire(st))"),))


def test_a_slip_at_short_remainders_only_is_refuted():
  """A defect only where the keys' last block holds fewer than 16 keys:
  the ranged kernel (whole blocks) and the plain one at 37 keys past the
  whole blocks run the shipped program; Z3, given every remainder, finds
  one under 16 and refutes the plain kernel, naming the mutated line."""
  modules = pmut.modules(SHORT_TAIL)
  prober = fwd._ForwardProber(ONE_TILE, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  at_37 = lambda _: ft._trace_symbolic(ONE_TILE, {"m": 1, "r": (37, 37), "mq": 1}, 1,
                                       key_ranges=False, modules=modules)
  (at_37_proved,) = rounds.also_proved([prog], at_37, {"37 keys past": None}, "{name}")
  assert at_37_proved.z3 and at_37_proved.z3[0] > prog.z3[0]   # its claims held too
  with pytest.raises(rp.PremiseError, match=r"without key ranges \(ragged lengths\)") as err:
    rounds.plain_proved([prog], lambda ragged: ft.trace_plain(ONE_TILE, ragged=ragged,
                                                              modules=modules))
  assert "kernel/forward/producer.mutant_short_tail_values_unacquired.py:" in str(err.value)


@pytest.mark.parametrize("ragged, named", [
    ("self.problem.seq_kv % self.config.block_kv > 16", "'r' > '16'"),
    ("self.problem.seq_q % self.tile_q != 0 or self.problem.seq_kv % self.config.block_kv != 0",
     "mod(- sq + 128*mq + 1, 128) == 0")],
    ids=["keys past 16", "ragged queries"])
def test_a_branch_on_the_remainder_is_refused(ragged, named):
  """A Python branch on a length's remainder (ragged only past 16 keys; a
  ragged query tile taken as ragged keys) takes one side at a
  representative length; over every length JAX cannot decide it, and the
  trace is refused, naming the line."""
  name = "ragged_otherwise"
  m = pmut.Mutant(name, "raggedness decided otherwise",
                  (edit("context.ragged_kv",
                        "return self.problem.seq_kv % self.config.block_kv != 0",
                        f"return {ragged}"),))
  with pytest.raises(ExtractionError, match="compares its symbolic lengths") as err:
    ft.trace_plain(ONE_TILE, ragged=True, modules=pmut.modules(m))
  assert f": kernel/forward/context.mutant_{name}.py:" in str(err.value), err.value
  assert named in str(err.value), err.value


@pytest.mark.parametrize("case", [ONE_TILE, SPLIT], ids=["one tile", "split tail"])
def test_only_the_plain_proof_refutes_a_slip_in_the_plain_loop(case):
  """The unmasked loop of a call without key ranges (no causal bound, whole
  blocks) run one block short: the kernel that reads ranges never runs that
  loop, so its program is learned and (P) proved as the shipped one's; Z3
  refutes the plain kernel, naming the mutated loop's line."""
  modules = pmut.modules(pmut.BY_NAME[SLIP])
  prober = fwd._ForwardProber(case, modules, None)
  prog = rounds.proved(prober.learner, [prober.kernel], prober.learn, prober.realise)
  assert prog.z3 and not prog.plain
  with pytest.raises(rp.PremiseError, match=r"without key ranges \(whole blocks\)") as err:
    rounds.plain_proved([prog], lambda ragged: ft.trace_plain(case, ragged=ragged,
                                                              modules=modules))
  assert f"kernel/forward/mainloop.mutant_{SLIP}.py:" in str(err.value), err.value


@pytest.mark.parametrize("persistent", [False, True], ids=["one tile", "persistent"])
def test_the_traced_order_tables_have_the_hosts_shapes(persistent):
  """The longest-first order's tables the plain trace stands in (the host
  builds them from the lengths) have the ranks, the blocks and at least the
  entries of the host's, and the order's kind and tile count."""
  from kernel.forward import order as order_lib
  from kernel.tiling import config as config_lib, plan as plan_lib
  config = config_lib.Config(64, 128, num_stages=2, persistent=persistent,
                             schedule="longest-first")
  problem = plan_lib.problem_for(np.dtype("bfloat16"), 64, 64, 40 * 128, 40 * 128, is_causal=True,
                                 scale=0.125)
  kw = dict(batch=2, num_heads=2, num_kv_heads=1, num_tiles=40 * 128 // config.tile_q,
            s_pad=40 * 128, head_dim=64, head_dim_out=64, itemsize=2, k_range_tiles=None,
            num_sms=16)
  host_order, host_tables = order_lib._schedule(problem, config, **kw)
  modules = tracing.shipped_modules()
  with ft._symbolic_schedule(modules, 8 * 128, 16):
    order, tables = modules.forward.flash_attention_forward.__globals__["_schedule"](
        problem, config, **kw)
  _like_the_hosts(order, tables, host_order, host_tables)


def _like_the_hosts(order, tables, host_order, host_tables):
  assert type(order) is type(host_order)
  assert (order.num_tiles, order.total) == (host_order.num_tiles, host_order.total)
  for mine, host in zip(tables, host_tables, strict=True):
    assert (mine is None) == (host is None)
    if host is not None:
      assert mine.ndim == host.ndim and mine.shape[0] == host.shape[0], (mine.shape, host.shape)
      assert mine.shape[1:] >= host.shape[1:] and mine.dtype == host.dtype


def test_the_split_tails_stand_in_is_the_hosts_at_the_traced_tiles():
  """The split tail's entry table the symbolic traces stand in is the
  host's for the representative tiles and keys, its tile ids unpacked by
  the traced count of tiles, without the merge of pieces after the kernel."""
  from kernel.forward import order as order_lib
  from kernel.tiling import config as config_lib, plan as plan_lib
  config = config_lib.Config(64, 128, num_stages=2, persistent=True, schedule="split-tail")
  problem = plan_lib.problem_for(np.dtype("bfloat16"), 64, 64, 20 * 128, 8 * 128, scale=0.125)
  kw = dict(batch=1, num_heads=2, num_kv_heads=1, num_tiles=20, s_pad=8 * 128, head_dim=64,
            head_dim_out=64, itemsize=2, k_range_tiles=None, num_sms=16)
  host_order, host_tables = order_lib._schedule(problem, config, **kw)
  assert host_order.split.size   # the host merges pieces of these tiles
  modules = tracing.shipped_modules()
  with ft._symbolic_schedule(modules, 8 * 128, 20):
    order, tables = modules.forward.flash_attention_forward.__globals__["_schedule"](
        problem, config, **kw)
  _like_the_hosts(order, tables, host_order, host_tables)
  assert order.split.size == 0 and np.array_equal(order.slot, host_order.slot)


def test_a_symbolic_dimension_is_a_term_only_while_it_is_linear():
  a, b = export.symbolic_shape("a, b")
  t = sy.dim_term(3 * a + 2 * b + 5, {"a": 2, "b": 0})
  # each symbol is its floor plus a variable's positive part
  assert tw.evaluate(t, {"dim.a": 4, "dim.b": -3}) == 3 * (2 + 4) + 2 * 0 + 5
  assert sy.dim_term(7, {}) == 7
  for bad in (a * b, a // 2, a % 3):
    with pytest.raises(ExtractionError, match="not linear"):
      sy.dim_term(bad, {"a": 0, "b": 0})
  # a product of counts, each at least 1 (a persistent walk's batch * heads
  # * tiles): any value from 1, a variable named by it; not past a division
  product = sy.dim_term(a * b + a, {"a": 1, "b": 2})
  assert tw.evaluate(product, {"dim.(a*b + a)": -5}) == 1
  assert tw.evaluate(product, {"dim.(a*b + a)": 6}) == 7
  with pytest.raises(ExtractionError, match="not linear"):
    sy.dim_term((a * b) // 2, {"a": 1, "b": 1})


def test_a_ring_cut_to_the_key_blocks_runs_one_length_everywhere():
  """A config with more stages than key blocks runs as many stages as
  blocks: its plain kernel is traced at that length; a persistent block's
  tiles then each take that many blocks, so tile t starts at that many
  times t (premise's fixed ring), which the proof holds it to."""
  cut = dataclasses.replace(PERSISTENT, num_stages=1, config_stages=2)
  assert cut.ring_cut
  _, dims = ft.trace_plain(cut, ragged=False)
  assert dims == {"mq": 1, "sms": 1, "sq": (1, 128), **COUNTS}   # no key-length symbol
  prog = fwd.forward_program(cut)
  assert prog.plain == tuple(rounds.PLAIN_KERNELS)
  # a plain kernel whose producer keeps no ring position across tiles (so
  # never waits for a release after the first tile), held to the shipped
  # program
  m = pmut.Mutant("producer_forgets_the_ring", "the producer's position restarts each tile",
                  (edit("producer.fill", "st = ring_state(keys, prev_iters, lb, ki)",
                        "st = ring_state(keys, 0 * prev_iters, lb, ki)"),))
  modules = pmut.modules(m)
  with pytest.raises(rp.PremiseError, match="without key ranges"):
    rounds.plain_proved([prog], lambda ragged: ft.trace_plain(cut, ragged=ragged, modules=modules))


# causal, fused dQ, the head split: 64-row tiles, 8 pairings of remainders
BACKWARD = cases.BackwardCase(256, True, False, True)


def _order_scopes(modules):
  """The module scopes the backward launch calls its launch orders from
  (as _launch_orders patches them): the dK/dV call's and the dQ call's."""
  scope = modules.backward.attention_backward.__globals__
  return scope["dkv_call"].__globals__, scope["dq_call"].__globals__


def test_the_plain_backward_is_proved_to_run_the_ranged_launches():
  """The backward's launches, with key ranges and without, at every
  pairing of the queries' and the keys' remainders.  Causal: head by head
  and in L2 sections, the two orders the host may build from the lengths
  (put back after the trace)."""
  progs = bwd.backward_programs(BACKWARD)
  plain = tuple(bt.backward_pairings(BACKWARD))
  assert progs and all(p.plain == plain and p.lengths == plain for p in progs)
  assert all(any("L2 sections" in name for name in p.plain) for p in progs)
  dkv_scope, dq_scope = _order_scopes(tracing.shipped_modules())
  hosts = dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"]
  for sectioned in (False, True):
    kernels, dims = bt.trace_backward_at(BACKWARD, (1, 63), 0, sectioned)
    assert dims == {"mq": 1, "mk": 1, "rq": (1, 63), **COUNTS} and len(kernels) == len(progs)
    assert (dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"]) == hosts
  flat_case = cases.BackwardCase(64, False, False, True)
  (flat,) = bwd.backward_programs(flat_case)
  assert flat.plain == tuple(bt.backward_pairings(flat_case))
  assert not any("L2 sections" in name for name in flat.plain)


def test_the_unpadded_backward_is_proved_at_lengths_in_eights(monkeypatch):
  """kernel.experiments' "pallas-unpadded" (``prove --experiments``): proved
  at every pairing of lengths past whole tiles in multiples of 8, which it
  reads unpadded, and of ragged ones, which it copies padded as shipped
  (the pairs of two ragged ones are the shipped backward's); its traces
  hand the kernels each length's arrays as the API does."""
  from kernel import padding
  case = dataclasses.replace(cases.BackwardCase(64, False, False, True), unpadded=True)
  assert case in cases.backward_cases(experiments=True)
  assert case not in cases.backward_cases()
  pairings = bt.backward_pairings(case)
  assert all(not (rq.tail and rk.tail) for rq, rk, _ in pairings.values())
  assert any(not rq.tail and not rk.tail and rq.units and rk.units
             for rq, rk, _ in pairings.values())
  progs = bwd.backward_programs(case)
  # z3: (claims, sent to Z3, seconds); a process that proved the same
  # claims before answers them from its cache, sending none
  assert progs and all(p.plain == tuple(pairings) and p.z3[0] > 0 for p in progs)
  copies = []
  original = padding.pad_to_multiple
  monkeypatch.setattr(padding, "pad_to_multiple",
                      lambda x, *a, **k: copies.append(x.shape) or original(x, *a, **k))
  for rq, rk, want in ((bt.Eights(1), bt.Eights((2, 7)), 0), (bt.Eights(1, True), bt.Eights(0), 2)):
    copies.clear()
    bt.trace_backward_at(case, rq, rk)
    assert len(copies) == want, (rq, rk, copies)   # q and dO, the ragged queries


UNTILED_CASES = [cases.BackwardCase(64, False, False, True, untiled=True),
                 cases.BackwardCase(128, False, False, False, untiled=True),
                 cases.BackwardCase(256, False, False, False, untiled=True)]


@pytest.mark.parametrize("case", UNTILED_CASES, ids=["d64-fused-dq", "d128-dq-kernel",
                                                      "d256-head-split"])
def test_the_untiled_backward_is_proved_at_every_length(monkeypatch, case):
  """kernel.experiments' "pallas-untiled" (``prove --experiments``): the
  fused dQ, the dQ kernel and the head split with q, k, v and dO copied
  through untiled views, proved at every pairing of the queries' and the
  keys' remainders past whole tiles, ragged ones included, none of them
  copied padded; its traces hand the kernels each length's arrays as the
  API does.  Read as views that share bytes, a read of the buffers after
  a copy into their untiled views is an overlay the proof refuses: the rule
  that merges them (harness.proofs.jaxprs.mirror_groups) is what proves it."""
  from harness.proofs import extract, search
  from kernel import padding
  assert case in cases.backward_cases(experiments=True)
  assert case not in cases.backward_cases()
  pairings = bt.backward_pairings(case)
  assert pairings == bt.backward_pairings(dataclasses.replace(case, untiled=False))
  progs = bwd.backward_programs(case)
  assert progs and all(p.plain == tuple(pairings) and p.z3[0] > 0 for p in progs)
  for prog in progs:
    r = search.check(prog)
    assert r.ok and r.states > 1000, r.violation and r.violation.format()
  monkeypatch.setattr(extract, "mirror_groups", lambda groups: {})
  r = search.check(bwd.backward_programs(case, premise=False)[0])
  assert not r.ok and r.violation.kind == "overlay", r.violation and r.violation.format()
  monkeypatch.undo()
  copies = []
  original = padding.pad_to_multiple
  monkeypatch.setattr(padding, "pad_to_multiple",
                      lambda x, *a, **k: copies.append(x.shape) or original(x, *a, **k))
  for traced in (case, dataclasses.replace(case, untiled=False)):
    copies.clear()
    bt.trace_backward_at(traced, (1, 63), (1, 63))
    # q, k, v and dO: none copied untiled, all four padded as shipped
    assert len(copies) == (0 if traced.untiled else 4), (traced, copies)


@pytest.mark.parametrize("whole, divisors", [(64, (64,)), (128, (128, 64)), (128, (64, 128)),
                                              (192, (64, 96))])
def test_the_remainders_cover_every_length_once_each_at_fixed_quotients(whole, divisors):
  """The plain backward's remainders past whole multiples: every length
  from 0 to whole - 1 in exactly one, and within a range each divisor's
  quotient the same (so that the trace's divisions are exact)."""
  pieces = bt.remainders(whole, divisors)
  covered = [r for p in pieces for r in (range(p[0], p[1] + 1) if isinstance(p, tuple) else [p])]
  assert sorted(covered) == list(range(whole))
  for p in pieces:
    if isinstance(p, tuple):
      assert p[0] < p[1]
      assert all(p[0] // d == p[1] // d for d in divisors), (p, divisors)
  assert bt.remainders(128, (128, 64)) == [0, (1, 63), 64, (65, 127)]


def test_loads_under_a_branch_on_data_are_events():
  """The dK/dV step reads its rows (lse, delta) from the stream's slot under
  the range test, a cond on data the protocol must not depend on: the
  loads are events of the learned program (each branch makes the same)."""
  (prog,) = [p for p in bwd.backward_programs(cases.BackwardCase(64, False, False, True))]
  (wg0,) = [r for r in prog.roles if r.name == "wg0"]
  loads = {e.buf for _, events in wg0.iter.units for e in events if e.kind == "smem_load"}
  assert any("rows" in prog_label for prog_label in
             (dict(prog.labels).get(b, b) for b in loads)), loads


def test_a_branch_on_data_that_reads_shared_memory_otherwise_fails():
  """The range test's two branches must read the rows alike: one that reads
  them twice is refused, naming the cond's line."""
  m = pmut.Mutant("edge_step_reads_its_rows_twice", "the edge branch computes its terms twice",
                  (edit("masks.masked_terms", "terms(keep_of(causal, True))",
                        "(terms(keep_of(causal, True)), terms(keep_of(causal, True)))[0]"),),
                  kernel="backward")
  modules = pmut.modules(m)
  with pytest.raises(ExtractionError, match="touch shared memory differently") as err:
    bwd.backward_programs(cases.BackwardCase(64, False, False, True), modules=modules)
  assert "kernel/masks/selects." in str(err.value), err.value
  # the symbolic run refuses it alike, naming the first access that differs
  _, kernels = bt.trace_backward(64, causal=False, bias=False, fuse_dq=True, seq_q=256,
                                 seq_kv=256, modules=modules)
  with pytest.raises(ExtractionError, match="touch shared memory differently") as err:
    for kernel in kernels:
      sy.extract_symbolic(kernel)
  assert "against" in str(err.value) and "kernel/masks/selects." in str(err.value), err.value


def test_the_traced_backward_orders_have_the_hosts_units_and_tiles():
  """The L2-sectioned launch orders the plain backward's trace stands in
  (in one section) count the host's units and tiles."""
  import jax.numpy as jnp
  from kernel.tiling import backward_plan, plan as plan_lib
  blocks = backward_plan.blocks_for(64, 64, causal=True)
  problem = plan_lib.problem_for(np.dtype("bfloat16"), 64, 64, 8192, 8192, is_causal=True,
                                 scale=0.125)
  shared = dict(batch=4, group=1, t_pad=8192, s_pad=8192, head_dims=(64, 64),
                dtype=jnp.bfloat16, num_sms=132)
  modules = tracing.shipped_modules()
  dkv_scope, dq_scope = _order_scopes(modules)

  def orders():
    return (dkv_scope["dkv_launch_order"](problem, blocks, num_kv_heads=8, fused=False, **shared),
            dq_scope["dq_launch_order"](problem, blocks, num_heads=8, **shared))
  host = orders()
  with bt._launch_orders(modules, sectioned=True):
    traced = orders()
  for mine, theirs in zip(traced, host, strict=True):
    assert theirs is not None and (mine.units, mine.tiles) == (theirs.units, theirs.tiles)
    assert mine.sizes == (mine.units,)
