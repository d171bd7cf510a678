"""The cases ``python -m harness prove`` proves: every distinct forward
protocol the heuristics and the autotuner emit (:func:`forward_cases`) and
every launch kind of ``kernel/backward/`` (:func:`backward_cases`).

Listing the forward's needs the kernel's heuristics and plans only, not
JAX (the backward's asks kernel/backward/, which imports it, where the
fused dQ applies): the command lists them while it imports JAX for the tracing
(:mod:`harness.proofs.prove`); :mod:`harness.proofs.prove_pool` traces
and learns each.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class ForwardCase:
  """What the forward's synchronisation depends on, and one emitted config."""

  num_stages: int
  persistent: bool
  schedule: str
  bias: bool      # staged 2-D bias (through the ring)
  mask: bool      # staged 2-D mask
  causal: bool
  block_q: int = 64
  block_kv: int = 128
  config_stages: int = 0   # Config.num_stages; more than num_stages when the keys are fewer
  # Persistent blocks that stage each warpgroup's output in its query slot
  # (plan.overlays_query_with_output: separate buffers would not fit).  The
  # case is traced at its problem's head dims and residuals, which decide
  # that layout.
  overlay_q: bool = False
  layout_head_dim: int = 64
  overlay_residuals: bool = False
  compute_warpgroups: int = 2   # Config.compute_warpgroups: consumers of the ring
  layout_head_dim_out: int = 64
  # Copies through untiled views (kernel.tiling.plan.Problem.untiled_copies): the
  # buffers mirrored by their untiled views, which the extraction reads as
  # the same buffers, in column parts, one wgmma per part.
  untiled_copies: bool = False
  # Non-persistent blocks whose output overlay runs past the queries into
  # the keys (plan.ScratchLayout.output_reaches_keys: a value head dim
  # wider than the queries'), traced at its problem's head dims and
  # residuals like overlay_q.  Before it was kept apart, the case was
  # traced at head dims 64 and 64 only, where the output lies over the
  # queries alone.
  output_over_keys: bool = False
  # The input dtype it is traced in: FP8's launch copies V^T and reads its
  # descales (kernel.forward.fp8); a launch whose program equals a 16-bit
  # one's up to names shares its check (prove_pool).
  dtype: str = "bfloat16"
  # Under the non-persistent overlay, the query and key slots each output
  # buffer shares bytes with (kernel.tiling.plan.ScratchLayout.output_overlaps):
  # block sizes and head dims move them, and with them the slots the
  # epilogue's stores clobber (docs/decisions/proof-cases-keep-output-slots.md).
  # None (a case written by hand): wherever its traced layout puts them.
  output_slots: tuple | None = None
  # Traced at its own config's block sizes and stages, its problem's head
  # dims and 16-bit dtype, which a case otherwise takes from a representative
  # (``python -m harness prove --every-config``).
  exact: bool = False

  @property
  def parts(self) -> tuple[int, int]:
    """(query/key, value) column parts (kernel.tiling.plan.copy_parts): a product's
    wgmma issues, where untiled copies cut rows into parts, else (1, 1)."""
    if not self.untiled_copies:
      return (1, 1)
    from kernel.tiling import plan as plan_lib
    # FP8's one-byte queries and keys; its output, like every other, 16-bit.
    itemsize = 1 if self.dtype == "float8_e4m3fn" else 2
    return (plan_lib.copy_parts(self.head_dim, itemsize)[0],
            plan_lib.copy_parts(self.head_dim_out, 2)[0])

  def protocol_key(self):
    """What tells protocols apart: :data:`KEYED`."""
    return tuple(getattr(self, name) for name in KEYED)

  def key(self):
    """What tells cases apart: the protocol (:data:`KEYED`) and the reach
    of its lengths (:attr:`reach`); with ``exact`` the :data:`REPRESENTED`
    fields too."""
    key = self.protocol_key() + self.reach
    if self.exact:
      key += tuple(getattr(self, name) for name in REPRESENTED)
    return key

  @property
  def reach(self) -> tuple[int, int]:
    """(block_kv, tile_q): the traces take every ragged remainder of the keys
    below the first and of the queries below the second, so a case stands
    only for configs whose block and tile are no larger (:class:`Representatives`)."""
    return (self.block_kv, self.tile_q)

  def covers(self, other: "ForwardCase") -> bool:
    """Whether every remainder of ``other``'s lengths is one of this case's."""
    return all(a >= b for a, b in zip(self.reach, other.reach))

  @property
  def ring_cut(self) -> bool:
    """A ring cut to the key blocks, fewer than the config's stages."""
    return (self.config_stages or self.num_stages) != self.num_stages

  @property
  def tile_q(self) -> int:
    """The config's query tile (kernel.tiling.config.Config.tile_q)."""
    return _tile_q(self.block_q, self.block_kv, self.compute_warpgroups)

  @property
  def head_dim(self) -> int:
    return self.layout_head_dim

  @property
  def head_dim_out(self) -> int:
    return self.layout_head_dim_out

  @property
  def residuals(self) -> bool:
    return (self.overlay_q or self.output_over_keys or bool(self.output_slots)) and \
        self.overlay_residuals

  def describe(self) -> str:
    words = [f"stages={self.num_stages}", "persistent" if self.persistent else "one tile",
             self.schedule]
    words += [n for n, on in (("staged bias", self.bias), ("staged mask", self.mask),
                              ("causal", self.causal),
                              ("output in the query slot", self.overlay_q),
                              ("output over the keys", self.output_over_keys),
                              ("with residuals", self.residuals)) if on]
    for name, hit in self.output_slots or ():
      words.append(f"{name} on " + " ".join(f"{buf}{slot}" for buf, slot in hit))
    if self.untiled_copies:
      words.append("untiled copies in %dx%d parts" % self.parts)
    if self.compute_warpgroups != 2:
      words.append(f"{self.compute_warpgroups} compute warpgroups")
    if self.dtype != "bfloat16":
      words.append(self.dtype)
    if self.exact:
      words.append(f"blocks {self.block_q}x{self.block_kv} of {self.config_stages} stages, "
                   f"head dims {self.layout_head_dim}/{self.layout_head_dim_out}")
    else:
      words.append(f"tiles {self.tile_q}x{self.block_kv}")
    return " ".join(words)


# What tells forward cases apart (ForwardCase.key), in the listing's order:
# fields, and the properties of _DERIVED.
@functools.cache
def _tile_q(block_q: int, block_kv: int, compute_warpgroups: int) -> int:
  """Config.tile_q of these sizes, by the config's own rule, once per sizes
  (the listing asks it of every emitted config several times)."""
  from kernel.tiling.config import Config
  return Config(block_q, block_kv, compute_warpgroups=compute_warpgroups).tile_q


KEYED = ("num_stages", "persistent", "schedule", "bias", "mask", "causal", "overlay_q",
         "residuals", "compute_warpgroups", "untiled_copies", "output_over_keys", "parts",
         "dtype", "output_slots", "ring_cut")
# Properties read from fields: residuals are staged only beside the output's
# overlay (overlay_residuals); parts are the untiled copies' column parts
# (the head dims); ring_cut: the learned tables see no longer streams
# (config_stages).
_DERIVED = ("residuals", "parts", "ring_cut")
# Fields a case takes from the first emitted config of its key and reach
# (represented), unless exact.
REPRESENTED = ("block_q", "block_kv", "config_stages", "layout_head_dim", "layout_head_dim_out")
# Fields read only through a derived property, and the switch.
_UNKEYED = ("overlay_residuals", "exact")


def _every_field_classified():
  """Each ForwardCase field keyed, represented or unkeyed, so that a new
  field cannot merge distinct protocols unseen."""
  named = {*KEYED, *REPRESENTED, *_UNKEYED} - set(_DERIVED)
  fields = {f.name for f in dataclasses.fields(ForwardCase)}
  if fields != named:
    raise TypeError(f"ForwardCase: classify {sorted(fields ^ named)} in harness/proofs/"
                    f"cases.py's KEYED, REPRESENTED or _UNKEYED")


_every_field_classified()


def forward_cases(problems, *, every_config: bool = False) -> list[tuple[ForwardCase, int]]:
  """Every distinct forward protocol of the configs the heuristics and the
  autotuner emit for ``problems`` (:func:`harness.proofs.prove.problem_grid`), with
  how many (problem, config) pairs it covers: the heuristic's, the one
  ``config=None`` takes with key ranges (kernel.tiling.autotune.choose), the one it
  takes from the shipped cache on the H200 (its entry, or the nearest
  entry, perhaps of a wider head dim), and every autotuning candidate.
  Each protocol is traced at as few representatives as cover the
  remainders of every config it stands for (:func:`representatives_of`).
  ``every_config``: one case per block sizes, stages, head dims and 16-bit
  dtype instead (:attr:`ForwardCase.exact`)."""
  found: dict = {}
  for case in emitted(problems):
    prev = found.get(case.key())
    found[case.key()] = (prev[0] if prev else case, (prev[1] if prev else 0) + 1)
  if every_config:
    return [found[k] for k in sorted(found)]
  reps = representatives_of([c for c, _ in found.values()])
  counts: dict = {}
  for case, n in found.values():
    rep = reps.of(case)
    counts[rep] = counts.get(rep, 0) + n
  return sorted(counts.items(), key=lambda item: item[0].key())


def emitted(problems):
  """One exact case (:attr:`ForwardCase.exact`) per (problem, config) that
  :func:`forward_cases` counts, in the order the problems emit them."""
  from kernel.tiling import autotune, heuristics, plan as plan_lib
  for p in problems:
    configs = []
    try:
      configs.append(heuristics.get_heuristics_config(p))
      configs.append(autotune.choose(p, None, has_key_ranges=True))
      configs.append(autotune.choose(p, autotune.REFERENCE_DEVICE_KIND))
    except ValueError:
      pass
    configs += list(heuristics.get_autotuning_configs(p))
    for c in configs:
      stages = plan_lib.pipeline_plan(p, c).num_stages
      layout = plan_lib.scratch_layout(p, c)
      overlay, reach = layout.overlay_q_with_output, layout.output_reaches_keys
      slots = plan_lib.output_slots(p, c)
      yield ForwardCase(stages, c.persistent, c.schedule, p.bias_2d, p.mask_2d, p.mask.causal,
                        c.block_q, c.block_kv, c.num_stages, overlay,
                        p.head_dim, (overlay or reach or bool(slots)) and p.return_residuals,
                        c.compute_warpgroups, p.head_dim_out, p.untiled_copies, reach,
                        str(p.dtype), slots, True)


def generalised(case: ForwardCase) -> ForwardCase:
  """An exact case as a representative: 16-bit dtypes as one."""
  dtype = case.dtype if case.dtype.startswith("float8") else "bfloat16"
  return dataclasses.replace(case, exact=False, dtype=dtype)


class Representatives:
  """The cases a protocol is traced at, by the configs they stand for.

  A trace takes every ragged remainder below its block of keys and its tile
  of queries (:attr:`ForwardCase.reach`), so a representative at block_kv
  64 cannot show a defect past 100 keys of a config at 256.  Per protocol
  the representatives are the emitted configs whose reach no other's
  exceeds (each the first emitted at its reach); a config is proved at the
  first of them, widest keys first, that covers it
  (docs/decisions/proof-representatives-cover-every-remainder.md)."""

  def __init__(self, cases):
    self.by_protocol: dict = {}
    for case in sorted(cases, key=lambda c: (-c.block_kv, -c.tile_q)):
      self.by_protocol.setdefault(case.protocol_key(), []).append(case)

  def of(self, case: ForwardCase) -> ForwardCase:
    """The representative ``case`` (exact or not) is proved at."""
    general = generalised(case)
    for rep in self.by_protocol.get(general.protocol_key(), ()):
      if rep.covers(general):
        return rep
    raise KeyError(f"no representative covers {case.describe()}")


def representatives_of(exact_cases) -> Representatives:
  """:class:`Representatives` of ``exact_cases`` (in their emitted order)."""
  by_protocol: dict = {}
  for case in map(generalised, exact_cases):
    # the first emitted at each reach
    by_protocol.setdefault(case.protocol_key(), {}).setdefault(case.reach, case)
  return Representatives(case for at in by_protocol.values() for case in at.values()
                         if not any(other != case.reach and all(map(int.__ge__, other, case.reach))
                                    for other in at))


# -- backward -------------------------------------------------------------------

def _backward_head_dims() -> tuple[int, ...]:
  """Every head dim the backward kernels compute with, of a call whose
  value head dim is its own: kernel.tiling.plan.backward_head_dims of every
  head dim the API takes (64: two stages, one dK/dV launch, the fused dQ
  where it fits; 128; 192, the head split's 96-column halves, for 129 to
  192; 256: one stage, dK and dV apart)."""
  from kernel.tiling import plan as plan_lib
  return tuple(sorted({plan_lib.backward_head_dims(d, d)[0]
                       for d in range(1, plan_lib.MAX_HEAD_DIM + 1)}))


BACKWARD_HEAD_DIMS = _backward_head_dims()


@dataclasses.dataclass(frozen=True)
class BackwardCase:
  head_dim: int
  causal: bool
  bias: bool
  fuse_dq: bool
  fixed_point: bool = False   # the fused dQ's sum in int32 (deterministic=True)
  # q, k, v and dO read unpadded where the forward reads them so
  # (kernel.experiments' "pallas-unpadded"): traced at lengths past whole
  # tiles in multiples of 8 as well (backward_traces.backward_pairings).
  unpadded: bool = False
  # q, k, v and dO copied through untiled views in column parts, read
  # unpadded at every length past whole tiles (kernel.experiments'
  # "pallas-untiled"): traced at the shipped backward's lengths.
  untiled: bool = False

  def describe(self) -> str:
    return (f"backward d={self.head_dim}{' causal' if self.causal else ''}"
            f"{' bias' if self.bias else ''} {'fused dQ' if self.fuse_dq else 'dQ kernel'}"
            f"{' in fixed point' if self.fixed_point else ''}"
            f"{' read unpadded' if self.unpadded else ''}"
            f"{' copied untiled' if self.untiled else ''}")


def backward_cases(*, experiments: bool = False) -> list[BackwardCase]:
  """Every launch kind kernel/backward/ makes: with and without the fused
  dQ, and where it applies (kernel.tiling.backward_plan.fuses_dq) its fixed-point sum
  as well; with ``experiments`` each once more read unpadded
  (:attr:`BackwardCase.unpadded`) and once copied untiled
  (:attr:`BackwardCase.untiled`)."""
  from kernel.tiling import backward_plan
  plain = [BackwardCase(d, c, b, f) for d in BACKWARD_HEAD_DIMS for c in (False, True)
           for b in (False, True) for f in (True, False)]
  fixed = [dataclasses.replace(case, fixed_point=True) for case in plain
           if case.fuse_dq and backward_plan.fuses_dq(
               backward_plan.blocks_for(case.head_dim, case.head_dim, causal=case.causal),
               with_bias=case.bias, causal=case.causal)]
  shipped = plain + fixed
  if not experiments:
    return shipped
  return (shipped + [dataclasses.replace(c, unpadded=True) for c in shipped]
          + [dataclasses.replace(c, untiled=True) for c in shipped])
