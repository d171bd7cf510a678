"""Every emitted config at its own sizes against the representative its case is proved at.

``python -m harness prove`` traces each forward protocol at representative
configs (:class:`harness.proofs.cases.Representatives`): block sizes,
stages, head dims and the 16-bit dtype are taken not to change its program
beyond what the case keeps, and a representative's block and tile are at
least those of every config it stands for, so that its traces take every
ragged remainder theirs can have.  After proving, ``prove`` checks the
first part on every emitted config (:func:`check`): each, traced at its own
sizes and learned from its probes, must have its representative's program,
up to the names of buffers and barriers (the shape the search checks); a
config that does not is named and fails the run.  ``prove --every-config``
proves each config's own program instead.
"""

from __future__ import annotations

import time

from harness.proofs import cases


def pairs(problems, representatives, *, differing_only: bool = False) -> list:
  """(exact case, its representative) for every config emitted for
  ``problems`` (``representatives``: the listing's cases, whose
  :class:`~harness.proofs.cases.Representatives` pick each config's);
  ``differing_only``: those whose block sizes, stages or head dims differ
  from their representative's."""
  sizes = lambda c: (c.block_q, c.block_kv, c.config_stages, c.layout_head_dim,
                     c.layout_head_dim_out)
  exact = [case for case, _ in cases.forward_cases(problems, every_config=True)]
  return [(case, rep) for case, rep in matched(exact, representatives)
          if not differing_only or sizes(case) != sizes(rep)]


def matched(exact_cases, representatives) -> list:
  """(exact case, the case of ``representatives`` it is proved at) for each."""
  reps = cases.Representatives(representatives)
  return [(case, reps.of(case)) for case in exact_cases]


def shape(case: cases.ForwardCase) -> str:
  """The digest of ``case``'s program learned from its probes."""
  from harness.proofs import forward_probes, memos
  memos.forget()   # the previous config's kernels: a worker traces thousands
  return forward_probes.forward_program(case, premise=False).shape_digest()


def timed_shape(case: cases.ForwardCase) -> tuple[str, float, int]:
  """(:func:`shape` of ``case``, the CPU seconds it took, the JAX traces it
  made): a worker's share of the check, for ``prove``'s phase count."""
  from harness.proofs import tracing
  start, traces = time.process_time(), tracing.SPENT["tracing count"]
  digest = shape(case)
  return digest, time.process_time() - start, tracing.SPENT["tracing count"] - traces


def same_trace(case: cases.ForwardCase, rep: cases.ForwardCase) -> bool:
  """Whether the config ``case`` is traced as its representative ``rep``
  is: the same protocol, sizes and reach (what tells exact cases apart,
  :meth:`harness.proofs.cases.ForwardCase.key`), so the same program."""
  whole = lambda c: (c.protocol_key(), c.reach, *(getattr(c, f) for f in cases.REPRESENTED))
  return whole(case) == whole(rep)


def compare(work, *, pool=None, known=None, spent=None) -> tuple[list, int]:
  """(the pairs of ``work`` whose config learns another program than its
  representative, how many program shapes the representatives have);
  ``pool``: an executor to learn them on; ``known``: {case: shape} already
  learned (the representatives' own, by the proof, as their probes learned
  them: LaunchProgram.probes_digest, like for like with :func:`shape`); a
  config traced as its representative is (:func:`same_trace`) is not
  learned again.  ``spent``: a Counter that gets the CPU seconds and JAX
  traces of the learning (the phase ``configs`` of
  :data:`harness.proofs.tracing.PHASES`)."""
  from harness.proofs import tracing
  shapes = dict(known or {})
  traced = [(case, rep) for case, rep in work if not same_trace(case, rep)]
  todo = list(dict.fromkeys([rep for _, rep in work] + [case for case, _ in traced]))
  todo = [case for case in todo if case not in shapes]
  timed = (map(timed_shape, todo) if pool is None
           else pool.map(timed_shape, todo, chunksize=16))
  for case, (digest, seconds, traces) in zip(todo, timed):
    shapes[case] = digest
    if spent is not None:
      spent["configs"] += seconds
      spent[tracing.TRACES] += traces
  differ = [(case, rep) for case, rep in traced if shapes[case] != shapes[rep]]
  return differ, len({shapes[rep] for _, rep in work})


def check(work, *, pool=None, cache=None, key: str = "",
          known=None, spent=None) -> tuple[list[str], str]:
  """``prove``'s check of ``work()`` (pairs as :func:`pairs` makes them): (a
  line per config that learns another program than its representative, the
  summary line).  ``cache`` keeps a run where every config agreed, under
  ``key`` (the selection) and the listing's sources; a warm run does not
  list the configs again; ``known`` and ``spent`` as :func:`compare` takes them."""
  start = time.perf_counter()
  entry = repr(("representatives", key))
  hit = cache.get("listed", entry) if cache is not None else None
  if hit is not None:
    differ, (configs, shapes) = [], hit
  else:
    work = work()
    differ, shapes = compare(work, pool=pool, known=known, spent=spent)
    configs = len(work)
    if cache is not None and not differ:
      cache.put("listed", entry, (configs, shapes))
  lines = [f"{case.describe()} learns another program than its representative, "
           f"{rep.describe()}" for case, rep in differ]
  summary = (f"every config at its own sizes: {configs - len(differ)} of {configs} emitted "
             f"configs, each traced at its own block sizes, stages, head dims and dtype, "
             f"learn the program of the representative their protocol is proved at "
             f"({shapes} program shapes; {time.perf_counter() - start:.1f} s"
             f"{', from the cache' if hit is not None else ''})")
  return lines, summary
