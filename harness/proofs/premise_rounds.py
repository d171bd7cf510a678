"""(P) proved by Z3 for a learned launch program, in rounds: each
counterexample Z3 finds is probed and the program learned again, until Z3
proves it or the probes show the kernel's events disagree with themselves
(:func:`proved`); then the same tables held to the same launch at every
length of its queries and keys, and to the launches of a call without key
ranges (:func:`lengths_proved`, :func:`plain_proved`)."""

from __future__ import annotations

import dataclasses

from harness.proofs import role_programs as rp
from harness.proofs import tracing
from harness.proofs.events import ExtractionError

# The lengths at which each case's proof traces its ranged kernel again
# (forward_traces.trace_ranged's ``ragged`` and ``windows``: a call with
# lengths or segments only, and one with a window and chunks of every
# size, as the kernels receive them), as failures name them.
RANGED_LENGTHS = {
    "every length of whole key blocks": (False, False),
    "every ragged length": (True, False),
    "every length of whole key blocks, with a window and chunks of every size": (False, True),
    "every ragged length, with a window and chunks of every size": (True, True),
}

# The launches of a call without key ranges each case's proof traces
# (forward_traces.trace_plain's ``ragged``; the backward's are
# backward_traces.backward_pairings'), as failures name them.
PLAIN_KERNELS = {"whole blocks": False, "ragged lengths": True}


def plain_proved(programs: list, trace, variants=None) -> list:
  """``programs``, the launches that read key ranges, each (P) proved, once
  Z3 proves (P) of the launches a call without key ranges makes
  (``trace(v)`` for each name: v of ``variants``, by default
  :data:`PLAIN_KERNELS`' ``ragged``: their kernels, in the same order, and
  the symbolic dimensions' bounds) against the same tables:
  each unit of theirs, at every trip count and ring position, is the
  table's entry, so their launches are environments of those programs and
  the programs' checks cover them.  A plain launch that synchronises
  otherwise fails, with Z3's position and trip count and both event
  lists."""
  variants = PLAIN_KERNELS if variants is None else variants
  held = also_proved(programs, trace, variants, "the launch of a call without key ranges "
                     "({name}) does not synchronise as the one that reads them")
  return [dataclasses.replace(prog, plain=tuple(variants)) for prog in held]


def lengths_proved(programs: list, trace, variants: dict) -> list:
  """``programs``, the launches that read key ranges (probed at one length
  each), once Z3 proves (P) of the same launches at the lengths
  ``trace(v)`` gives for each ``variants`` name: v, against the same
  tables; their ``lengths`` name them."""
  held = also_proved(programs, trace, variants, "the launch that reads key ranges, at "
                     "{name}, does not synchronise as its probes showed")
  return [dataclasses.replace(prog, lengths=tuple(variants)) for prog in held]


def also_proved(programs: list, trace, variants: dict, what: str) -> list:
  """``programs`` with Z3's proof of (P) extended to the launches
  ``trace(v)`` gives for each ``variants`` name: v, held to the same
  tables (``what``: a failure's words, with the variant's {name})."""
  from harness.proofs import premise, symbolic
  stats = [premise.Stats.of(prog.z3) for prog in programs]
  for name, variant in variants.items():
    kernels, dims = trace(variant)
    if len(kernels) != len(programs):
      raise ExtractionError(f"{programs[0].name} ({name}): {len(kernels)} launches "
                            f"traced, {len(programs)} learned")
    for prog, kernel, st in zip(programs, kernels, stats):
      try:
        with tracing.spending("premise"):
          st.add(premise.prove(prog, symbolic.extract_symbolic(kernel, dims)))
      except premise.PremiseFailure as f:
        raise rp.PremiseError(f"{what.format(name=name)}: {f}") from None
  return [dataclasses.replace(prog, z3=st.summary()) for prog, st in zip(programs, stats)]


MAX_COUNTEREXAMPLES = 8   # probes of Z3's counterexamples before a failure is final


def proved(learner, kernels, learn, realise) -> rp.LaunchProgram:
  """The program ``learn()`` gives once Z3 proves (P) for it on each traced
  kernel (:mod:`harness.proofs.premise`).  Each counterexample Z3 finds is
  probed (``realise(context)``) and the program learned again: a table
  that generalised too far from its probes gets the probe it lacked, and a
  kernel whose events disagree with themselves fails with the probes that
  disagree (:class:`harness.proofs.role_programs.PremiseError`, which the
  caller checks one by one for a trace)."""
  from harness.proofs import premise, symbolic
  tried: set = set()
  found: list = []   # Z3's counterexamples so far, each probed in turn
  prog = learn()
  while True:
    stats = premise.Stats()
    try:
      with tracing.spending("premise"):
        for kernel in kernels:
          stats.add(premise.prove(prog, symbolic.extract_symbolic(kernel)))
      return dataclasses.replace(prog, z3=stats.summary())
    except premise.PremiseFailure as f:
      ctx = f.context
      found.append(str(f))
      so_far = "\n".join(found)
      key = tuple(ctx.get(k) for k in ("role", "kind", "t", "G", "n", "j", "GT"))
      if "n" not in ctx or key in tried or len(tried) >= MAX_COUNTEREXAMPLES:
        raise rp.PremiseError(so_far, learner.seen[-1:] if key in tried else []) from None
      tried.add(key)
      try:
        realise(ctx)
      except ExtractionError as err:
        raise rp.PremiseError(f"{so_far}\n  no probe could show that environment: {err}") from None
      try:
        prog = learn()
      except rp.PremiseError as err:
        raise rp.PremiseError(f"{so_far}\n  probed there: {err}", err.probes) from None
