"""Probing the backward's launches: the streams of each launch's traces,
the probes that choose their trip counts (the dQ kernel's key range, the
dK/dV kernel's band of query blocks), each launch's program learned from
them, and (P) proved by Z3 for it at the traced lengths, at every length
and for the launches of a call without key ranges
(:func:`backward_programs`)."""

from __future__ import annotations

from harness.proofs import backward_traces as bt
from harness.proofs import extract as ex
from harness.proofs import premise_rounds as rounds
from harness.proofs import probes
from harness.proofs import role_programs as rp
from harness.proofs import tracing
from harness.proofs.cases import BackwardCase
from harness.proofs.events import ExtractionError
from kernel.masks import Mask

# The grid point every probe of a backward launch runs (its tile and key
# tile set where a probe chooses them).
_GRID = {"batch": 0, "heads": 0, "q_tiles": 0, "kv_tiles": 0, "kv_heads": 0}


def _stream_length(launch, role="wg2.warp0") -> int:
  """A stream's length as its producer runs it: the iterations of its loop."""
  return len({lp[0] for lp in launch.loops.get(role, ()) if lp})


def _tables_of(kernel, consts):
  """(the four k_range_tiles tables, tiles) of a kernel that reads them, else None."""
  for v in kernel.invars:
    shape = tuple(v.aval.shape)
    if len(shape) == 3 and shape[:2] == (1, 1) and "int" in str(v.aval.dtype):
      try:
        return probes.range_tables(kernel, consts, shape[2]), shape[2]
      except ExtractionError:
        continue
  return None


def _last_tile_point(kernel, tables, consts, blocks, grid, num_tiles) -> int:
  """The dQ kernel's grid point whose block reads the last query tile's
  range (the one whose causal bound leaves room for the longest stream): the
  grid's last point, or its first where the kernel walks its tiles heaviest
  first (under causal: kernel.backward.dq._dq_kernel)."""
  for at in (num_tiles - 1, 0):
    env = probes.Env(tables, consts, blocks.dq_stream_kv, lambda qi: (0, 0))
    ex.extract_kernel(kernel, env=env, grid={**grid, "q_tiles": at}, name="dq")
    if env.order == [num_tiles - 1]:
      return at
  raise ExtractionError(f"no dQ grid point of {num_tiles} reads the last tile's key range")


def backward_programs(case: BackwardCase, *, modules=None,
                      premise: bool = True) -> list[rp.LaunchProgram]:
  """The role programs of every launch of one backward, learned from probes.

  The dK/dV kernels stream the query blocks (``blocks.dkv_stream_q`` rows,
  as kernel.tiling.backward_plan.blocks_for chooses them) of the band their
  key tile reads from its tables, under causal from key tile j's first key
  on: with the whole length as band, one causal trace shows streams of
  every even length from its longest down to 0 (non-causal: a long trace
  and the shortest, one block of queries); then key tile 0 of the
  long trace is probed with bands of n = 0, 1, 2, 3 and S + M + 3 blocks,
  and each context the learned tables still lack.  The dQ kernel's tile
  reads its key range from the tables: probed at the long trace's last tile
  for the same n, then for each missing context likewise.  With
  ``premise``, (P) is then proved by Z3 on every traced kernel of each
  launch (:func:`harness.proofs.premise_rounds.proved`)."""
  modules = modules or tracing.shipped_modules()
  blocks = modules.backward_plan.blocks_for(case.head_dim, case.head_dim, causal=case.causal)
  rings = [rp.Ring(s) for s in bt.backward_stages(case, modules=modules)]
  long = max(probes.probe_trips(r) for r in rings)
  tile = blocks.dq_tile
  # the dQ kernel's last tile bounds its causal range at 2 * (tiles) blocks
  seq_long = tile * max(-(-long * blocks.dkv_stream_q // tile), -(-long // 2) + 1)
  seq_kv = -(-(long + 2) * blocks.dq_stream_kv // blocks.dkv_tile) * blocks.dkv_tile
  shapes = (seq_long,) if case.causal else (seq_long, blocks.dkv_stream_q)
  learners: list = []
  probe_of: dict = {}   # id(learner) -> probe(n), for launches that read their range
  traced: dict = {}     # id(learner) -> its kernel at every traced length
  for seq_q in shapes:
    closed, kernels = bt.trace_backward(case.head_dim, causal=case.causal, bias=case.bias,
                                        fuse_dq=case.fuse_dq, seq_q=seq_q, seq_kv=seq_kv,
                                        modules=modules, fixed_point=case.fixed_point,
                                        unpadded=case.unpadded, untiled=case.untiled)
    learners = _learners(case, learners, rings, kernels)
    for learner, kernel in zip(learners, kernels):
      traced.setdefault(id(learner), []).append(kernel)
      consts = probes.const_values(closed, kernel)
      found = _tables_of(kernel, consts)
      if found is not None:
        if seq_q != seq_long:
          continue  # the dQ kernel's stream is its table's: probed at one length
        probe = _dq_probe(case, learner, kernel, found, consts, blocks, seq_q, seq_kv)
      else:
        bands = _dkv_streams(case, learner, kernel, consts, blocks, seq_q, seq_kv)
        if seq_q != seq_long:
          continue
        probe = _band_probe(learner, kernel, *bands)
      probe_of[id(learner)] = probe
      for n in sorted({0, 1, 2, 3, long}):
        probe(n)
  programs = [_program(learner, probe_of.get(id(learner)), traced[id(learner)], premise)
              for learner in learners]
  if not premise:
    return programs
  lengths = bt.backward_pairings(case, modules=modules)
  programs = rounds.lengths_proved(
      programs, lambda v: bt.trace_backward_at(case, *v, modules=modules, ranges=True), lengths)
  return rounds.plain_proved(programs, lambda v: bt.trace_backward_at(case, *v, modules=modules),
                             lengths)


def _learners(case, learners, rings, kernels) -> list:
  """One learner per launch, made at the first traced length; the launches
  of every later length held to as many."""
  if not learners:
    if len(rings) != len(kernels):
      raise ExtractionError(f"{case.describe()}: {len(kernels)} launches traced, "
                            f"kernel.backward.launches names {len(rings)}")
    return [rp.Learner(f"{case.describe()}, launch {i + 1} of {len(kernels)}", ring,
                       persistent=False) for i, ring in enumerate(rings)]
  if len(learners) != len(kernels):
    raise ExtractionError(f"{case.describe()}: {len(kernels)} launches at one length, "
                          f"{len(learners)} at another")
  return learners


def _dq_probe(case, learner, kernel, found, consts, blocks, seq_q, seq_kv):
  """probe(n): the dQ kernel's last tile run with a key range of n blocks."""
  tables, num_tiles = found
  learner.name = learner.name.replace("launch", "dQ kernel, launch")
  at = _last_tile_point(kernel, tables, consts, blocks, _GRID, num_tiles)

  def probe(n):
    lb = n % 2
    env = probes.Env(tables, consts, blocks.dq_stream_kv, lambda qi: (lb, n))
    launch = ex.extract_kernel(kernel, env=env, grid={**_GRID, "q_tiles": at}, name="dq")
    (qi,) = env.order
    lo, hi = Mask(seq_q, seq_kv, causal=case.causal).key_blocks(
        qi, tile_q=blocks.dq_tile, block_kv=blocks.dq_stream_kv,
        k_start_min=lb * blocks.dq_stream_kv, k_end_max=(lb + n) * blocks.dq_stream_kv)
    learner.observe(launch, [hi - lo], where=f"the dQ tile's key blocks [{lo}, {hi})")
  return probe


def _dkv_streams(case, learner, kernel, consts, blocks, seq_q, seq_kv) -> tuple:
  """The dK/dV kernel's streams at this length observed (every key tile's,
  under causal), each key tile given the whole length as its band; (its
  band tables, the query blocks, its inner-run tables)."""
  kv_tiles = -(-seq_kv // blocks.dkv_tile)
  nq = seq_q // blocks.dkv_stream_q
  bands = probes.band_tables(kernel, consts, kv_tiles)
  inner = probes.inner_tables(kernel, consts, kv_tiles)
  for j in range(kv_tiles) if case.causal else (0,):
    launch = ex.extract_kernel(kernel, env=probes.BandEnv(bands, lambda j: (0, nq), inner),
                               grid={**_GRID, "kv_tiles": j}, name="dkv")
    n = _stream_length(launch)
    learner.observe(launch, [n], where=f"key tile {j} of {seq_q} queries ({n} blocks)")
  return bands, nq, inner


def _band_probe(learner, kernel, bands, nq, inner):
  """probe(n): the dK/dV kernel's key tile 0 run with a band of n query blocks."""

  def probe(n):
    lb = n % 2 if n + 1 <= nq else 0
    launch = ex.extract_kernel(kernel, env=probes.BandEnv(bands, lambda j: (lb, lb + n), inner),
                               grid={**_GRID, "kv_tiles": 0}, name="dkv")
    got = _stream_length(launch)
    if got != n:
      raise ExtractionError(f"{learner.name}: key tile 0 given the query blocks "
                            f"[{lb}, {lb + n}) streams {got}")
    learner.observe(launch, [n], where=f"key tile 0, query blocks [{lb}, {lb + n})")
  return probe


def _program(learner, probe, kernels, premise: bool) -> rp.LaunchProgram:
  """The launch's program, learned with a probe of each context the tables
  lack (where a probe chooses the trip count), then (with ``premise``)
  (P) proved by Z3 on each of its traced ``kernels``."""
  lengths = [t for _, trips, _ in learner.seen for t in trips]
  learner.min_blocks = min(lengths)   # no shorter stream exists

  def learn():
    prog = learner.program()
    for _ in range(4):
      missing = learner.missing(prog) if probe else []
      if not missing:
        break
      for n in sorted({probes.trips_showing(learner.ring, kind, ctx, persistent=False)[0]
                       for _, kind, ctx in missing}):
        probe(n)
      prog = learner.program()
    return prog

  def realise(ctx):
    if probe is None:
      raise ExtractionError("this launch streams as many blocks as its traced shapes "
                            "make it, so no probe chooses its trip count")
    probe(ctx["n"])

  return rounds.proved(learner, kernels, learn, realise) if premise else learn()
