"""The probes: environments under which a traced kernel is run concretely,
so that each role's program can be learned from its events.

A forward block reads each tile's key range ``[lb, lb + n)`` from its
``k_range_tiles`` entry, so the probe chooses it (``lb`` alternating, which
the units must not depend on): a non-persistent block runs one tile,
probed for n = 0, 1, 2, 3 and S + M + 3 (M = lcm(S, 2)); a persistent block
(traced with :data:`PROBE_SMS` blocks, the probed ones those whose tiles'
causal bounds leave the most room) walks :func:`probe_tiles` tiles, each
tile's n chosen as the kernel asks for it so as to show head contexts not
yet seen (:mod:`harness.proofs.forward_probes`).  Then each context the
learned tables lack gets a probe of its own (:func:`trips_showing`).  The
backward's dQ kernel reads its tile's range the same way; the dK/dV
kernels' streams are as long as the traced shapes make them, so they are
traced at two query lengths (and, causal, every key tile of them, whose
streams start further in) (:mod:`harness.proofs.backward_probes`).
"""

from __future__ import annotations

import numpy as np
from jax.extend import core as jex_core

from harness.proofs import jaxprs
from harness.proofs import role_programs as rp
from harness.proofs.events import OPAQUE, ExtractionError

PROBE_SMS = 16        # blocks of the traced persistent grid
PROBED_BLOCKS = 2     # of which this many walk many contexts in a first round


def const_values(closed, kernel_eqn) -> dict:
  """gmem input index -> numpy value, for the kernel operands that are
  constants of the traced program (the longest-first schedule tables)."""
  known = {v: np.asarray(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}

  def walk(jaxpr, known):
    for eqn in jaxpr.eqns:
      if eqn is kernel_eqn:
        return {i: known[v] for i, v in enumerate(eqn.invars) if v in known}
      for sub in jaxprs.subjaxprs(eqn.params):
        if len(sub.invars) == len(eqn.invars):
          inner = {iv: known[ov] for iv, ov in zip(sub.invars, eqn.invars)
                   if not isinstance(ov, jex_core.Literal) and ov in known}
          inner.update({v: known[v] for v in sub.constvars if v in known})
        else:
          inner = {}
        found = walk(sub, inner)
        if found is not None:
          return found
    return None

  return walk(closed.jaxpr, known) or {}


def int_operands(kernel_eqn, consts, shape: tuple) -> list[int]:
  """The kernel's int operands of ``shape`` that are not traced constants."""
  return [i for i, v in enumerate(kernel_eqn.invars)
          if tuple(v.aval.shape) == shape and "int" in str(v.aval.dtype) and i not in consts]


def int_tables(kernel_eqn, consts, length: int, count: int, what: str) -> dict:
  """{buffer: k} of the ``count`` int (1, 1, ``length``) operands the kernel
  reads (not traced constants), k their order among the operands."""
  tables = int_operands(kernel_eqn, consts, (1, 1, length))
  if len(tables) != count:
    raise ExtractionError(f"expected the {count} {what} among the kernel's operands, "
                          f"found {len(tables)}")
  return {f"gmem_in{i}": k for k, i in enumerate(tables)}


def range_tables(kernel_eqn, consts, num_tiles) -> dict:
  """The forward's or the dQ kernel's four k_range_tiles tables."""
  return int_tables(kernel_eqn, consts, num_tiles, 4, "k_range_tiles tables")


class Env:
  """The integers a kernel reads from global memory: the schedule tables
  from the traced constants, and per tile ``qi`` its key range, which
  ``choose(qi)`` decides as the kernel first asks for it and returns as
  ``(lb, n)`` (lb, n in key blocks: the four k_range_tiles entries
  lb * block_kv, lb * block_kv, (lb + n) * block_kv, (lb + n) * block_kv)."""

  def __init__(self, tables: dict, consts: dict, block_kv: int, choose):
    self.tables, self.block_kv, self.choose = tables, block_kv, choose
    self.consts = {f"gmem_in{i}": v for i, v in consts.items()}
    self.ranges: dict = {}
    self.order: list = []   # tiles in the order first asked for

  def __call__(self, buf, idx):
    if buf in self.consts:
      return int(self.consts[buf][tuple(idx)])
    which = self.tables.get(buf)
    if which is None:
      raise ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which "
                            f"the prover gives no value")
    qi = idx[-1]
    if qi not in self.ranges:
      self.ranges[qi] = self.choose(qi)
      self.order.append(qi)
    lb, n = self.ranges[qi]
    return ((lb, lb, lb + n, lb + n)[which]) * self.block_kv


class BandEnv:
  """The integers a dK/dV kernel reads: per key tile ``j`` the band of query
  blocks ``[lo, hi)`` it streams (kernel.padding.query_block_ranges), which
  ``choose(j)`` decides; ``tables`` maps each table's buffer to 0 (lo) or
  1 (hi).  Reads of the ``opaque`` buffers (the run of blocks inside every
  row's range, kernel.padding.query_block_inner_bounds) give data the
  protocol must not depend on: the extractor refuses a branch on it that
  holds synchronisation."""

  def __init__(self, tables: dict, choose, opaque=frozenset()):
    self.tables, self.choose, self.opaque = tables, choose, opaque

  def __call__(self, buf, idx):
    if buf in self.opaque:
      return OPAQUE
    which = self.tables.get(buf)
    if which is None:
      raise ExtractionError(f"the kernel reads an integer from {buf}{list(idx)}, which "
                            f"the prover gives no value")
    return self.choose(idx[-1])[which]


def band_tables(kernel, consts, num_key_tiles) -> dict:
  """{buffer: 0 (lo) / 1 (hi)} of a dK/dV kernel's two query-block tables."""
  return int_tables(kernel, consts, num_key_tiles, 2, "query-block tables (lo, hi)")


def inner_tables(kernel, consts, num_key_tiles) -> frozenset:
  """The buffers of a dK/dV kernel's inner-run table ((1, 1, 2, key tiles) int)."""
  return frozenset(f"gmem_in{i}" for i in int_operands(kernel, consts, (1, 1, 2, num_key_tiles)))


def probe_trips(ring: rp.Ring) -> int:
  """The longest trip count a one-tile probe walks: every ring class, with
  every lookahead of a key-loop iteration."""
  return ring.classes + rp.AHEAD_CAP


def kv_blocks(ring: rp.Ring) -> int:
  """Key blocks of a probes' trace: room for every probe's trip count."""
  return max(probe_trips(ring), ring.classes + rp.AHEAD_CAP) + 2


def probe_tiles(ring: rp.Ring) -> int:
  """Tiles each probed persistent block walks in the first round."""
  return ring.classes + 2


def trips_showing(ring: rp.Ring, kind: str, ctx: dict, *, persistent: bool) -> tuple:
  """Trip counts of a block's tiles that show a unit of ``kind`` in ``ctx``."""
  c = ctx["cls"]
  if persistent:
    if kind == "head":
      return (ctx["n"],) if not ctx["later"] else (c, ctx["n"])
    if kind == "iter":
      return (c, ctx["ahead"])
    if kind == "tail":
      return (c - ctx["n"], ctx["n"])
    return (c,)
  if kind == "head":
    return (ctx["n"],)
  if kind == "iter":
    return (c + ctx["ahead"],)
  return (c,)
