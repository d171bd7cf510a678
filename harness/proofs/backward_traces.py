"""Tracing the backward's launches on the CPU for the proof: at concrete
lengths for the probes (:func:`trace_backward`), and at every length of its
queries and keys, each a symbolic dimension cut at every tile and block the
launches divide it by (:func:`remainders`), with key ranges and without
(:func:`trace_backward_at`, at the lengths :func:`backward_pairings`
names)."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from harness.proofs import symbolic_dims as sd
from harness.proofs import tracing
from harness.proofs.cases import BackwardCase
from harness.proofs.jaxprs import find_kernels

def trace_backward(head_dim, *, causal, bias, fuse_dq, seq_q, seq_kv, ranges=True,
                   modules=None, fixed_point=False, unpadded=False, untiled=False, batch=1,
                   heads=1, kv_heads=1):
  """The closed jaxpr of ``kernel.backward.attention_backward`` traced on the
  CPU, and its Mosaic GPU kernels in launch order (``unpadded``: q, k, v
  and dO read unpadded where the forward reads them so; ``untiled``: read
  unpadded at every length, copied through untiled views; ``batch``,
  ``heads``, ``kv_heads``: its grid, :data:`GQA_GRID` in the symbolic
  traces)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  from kernel.tiling import backward_plan, plan as plan_lib
  from kernel.tiling.heuristics import get_backward_config
  modules = modules or tracing.shipped_modules()
  sds = jax.ShapeDtypeStruct
  q = sds((batch, seq_q, heads, head_dim), jnp.bfloat16)
  k = sds((batch, seq_kv, kv_heads, head_dim), jnp.bfloat16)
  rows = sds((batch, heads, seq_q), jnp.float32)
  b = sds((batch, heads, seq_q, seq_kv), jnp.bfloat16) if bias else None
  kr = sds((batch, heads, seq_q), jnp.int32) if ranges else None

  problem = plan_lib.problem_for(np.dtype("bfloat16"), head_dim, head_dim, seq_q, seq_kv,
                                 is_causal=causal, scale=0.125, deterministic=fixed_point)
  dims = backward_plan.computed_head_dims(head_dim, head_dim)
  backward = backward_plan.Backward("pallas", dims, get_backward_config(
      *dims, causal=causal, fuse_dq=fuse_dq, whole_tiles=not (unpadded or untiled),
      untiled_copies=untiled))

  def fn(q, k, v, b, ks, ke, o, m, l, do):
    return modules.backward.attention_backward(problem, backward, q, k, v, b, None, ks, ke, o,
                                               m, l, do)

  with api.lowering_only(), tracing.spending("tracing"):
    closed = jax.make_jaxpr(fn)(q, k, k, b, kr, kr, q, rows, rows, q)
  return closed, find_kernels(closed.jaxpr)


def backward_stages(case: BackwardCase, *, modules=None) -> list[int]:
  """The ring depth of each launch of one backward, in launch order, from
  the mbarrier plans kernel.tiling.backward_plan.launches gives (its "consumed"
  barriers, one per slot): the launches of one backward may differ."""
  modules = modules or tracing.shipped_modules()
  plans = modules.backward_plan.launches(case.head_dim, case.head_dim, with_bias=case.bias,
                          causal=case.causal, fuse_dq=case.fuse_dq)
  return [next(b.num_barriers for b in plan if b.name == "consumed") for _, plan in plans]


def backward_pairings(case: BackwardCase, *, modules=None) -> dict:
  """The lengths at which each case's proof traces the backward's launches,
  with key ranges and without, by name: (queries' remainder, keys'
  remainder, sectioned) for :func:`trace_backward_at`, every pair of the
  queries' and the keys' :func:`remainders` (whole lengths, and every
  ragged one), causal head by head and in L2 sections."""
  modules = modules or tracing.shipped_modules()
  (whole_q, in_q), (whole_k, in_k) = _backward_lengths(case, modules)
  queries, keys = remainders(whole_q, in_q), remainders(whole_k, in_k)
  pairs = [(rq, rk) for rq in queries for rk in keys]
  if case.unpadded:
    # Read unpadded, a length that is a multiple of 8 is copied by neither
    # pass, any other as shipped: each length is one past whole tiles in
    # eights (Eights) or one of the ragged ones, which no trace's range
    # then mixes; the pairs of two ragged ones are the shipped backward's.
    pieces = lambda whole, by: [Eights(r, tail) for tail in (False, True)
                                for r in remainders(whole // 8, [d // 8 for d in by])]
    pairs = [(rq, rk) for rq in pieces(whole_q, in_q) for rk in pieces(whole_k, in_k)
             if not (rq.tail and rk.tail)]
  out = {}
  for sectioned in (False, True) if case.causal else (False,):
    for rq, rk in pairs:
      name = f"queries {_past(rq)}, keys {_past(rk)}"
      out[name + (", in L2 sections" if sectioned else "")] = (rq, rk, sectioned)
  return out


@dataclasses.dataclass(frozen=True)
class Eights:
  """A length past whole tiles, for a backward read unpadded: 8 times
  ``units`` (0, a number, or (lo, hi): a symbol for each number from lo
  to hi), and with ``tail`` 1 to 7 more (a symbol), a length no multiple
  of 8."""
  units: int | tuple
  tail: bool = False


def _backward_lengths(case: BackwardCase, modules) -> tuple:
  """((whole, divisors) of the queries, of the keys): the tiles and blocks
  the backward's launches divide each length by, and their least common
  multiple, the whole lengths its plain traces take."""
  import math
  b = modules.backward_plan.blocks_for(case.head_dim, case.head_dim, causal=case.causal)
  return tuple((math.lcm(*by), by) for by in ((b.dq_tile, b.dkv_stream_q),
                                              (b.dkv_tile, b.dq_stream_kv)))


def remainders(whole: int, divisors) -> list:
  """The lengths past a whole multiple of ``whole`` a plain trace takes,
  together every one from 0 to whole - 1: 0; each multiple of a divisor
  below ``whole``; and between them each range (lo, hi), over which every
  divisor divides the length to the same quotient
  (:func:`harness.proofs.symbolic_dims.exact_divisions`), so that one trace
  stands for every length of the range."""
  cuts = sorted({k for d in divisors for k in range(d, whole, d)})
  out, lo = [0], 1
  for cut in cuts + [whole]:
    if lo < cut:
      out.append((lo, cut - 1) if lo < cut - 1 else lo)
    if cut < whole:
      out.append(cut)
    lo = cut + 1
  return out


def _past(rem) -> str:
  if isinstance(rem, Eights):
    u = rem.units
    eights = (f"{8 * u}" if isinstance(u, int) else f"{8 * u[0]} to {8 * u[1]}")
    return (f"{eights} and 1 to 7 past whole" if rem.tail else
            "whole" if u == 0 else f"{eights} past whole (multiples of 8)")
  if rem == 0:
    return "whole"
  return f"{rem} past whole" if isinstance(rem, int) else f"{rem[0]} to {rem[1]} past whole"


def trace_backward_at(case: BackwardCase, rem_q=0, rem_k=0, sectioned: bool = False, *,
                      modules=None, ranges: bool = False):
  """(kernels, their dimension variables' bounds) of the backward a call
  without key ranges launches (each launch's trip counts compiled in;
  ``ranges``: the one a call with them launches), traced with the queries' and
  the keys' lengths symbolic dimensions: whole multiples of every tile
  and block of the launches (``mq``, ``mk`` >= 1) and ``rem_q``, ``rem_k``
  more (:func:`remainders`: 0, a number, or (lo, hi), a symbol, ``rq`` or
  ``rk``, for every number from lo to hi).  A causal launch
  order is built on the host from the lengths: the trace takes it head by
  head or, ``sectioned``, in L2 sections (:func:`_launch_orders`)."""
  from jax.experimental import pallas as pl
  modules = modules or tracing.shipped_modules()
  (whole_q, _), (whole_k, _) = _backward_lengths(case, modules)
  # each remainder as (rows per unit, units, a tail of 1 to 7 rows)
  rems = {n: (8, r.units, r.tail) if isinstance(r, Eights) else (1, r, False)
          for n, r in (("rq", rem_q), ("rk", rem_k))}
  dims = {"mq": 1, "mk": 1, **sd.GRID_COUNTS}
  dims.update({n: units for n, (_, units, _) in rems.items() if isinstance(units, tuple)})
  dims.update({"t" + n[1]: (1, 7) for n, (_, _, tail) in rems.items() if tail})
  symbols, variables = sd.dimensions(dims)
  for n, (step, units, _) in rems.items():
    symbols[n] = step * symbols.get(n, units) + symbols.get("t" + n[1], 0)
  with sd.exact_divisions(), pl.pallas_export_experimental(dynamic_shapes=True), \
          _launch_orders(modules, sectioned), sd.decided_lengths(case.describe()):
    _, kernels = trace_backward(
        case.head_dim, causal=case.causal, bias=case.bias, fuse_dq=case.fuse_dq,
        seq_q=whole_q * symbols["mq"] + symbols["rq"],
        seq_kv=whole_k * symbols["mk"] + symbols["rk"], ranges=ranges,
        modules=modules, fixed_point=case.fixed_point, unpadded=case.unpadded,
        untiled=case.untiled, **sd.grid_counts(symbols))
  return kernels, variables


@contextlib.contextmanager
def _launch_orders(modules, sectioned: bool):
  """The backward's causal launch orders (kernel/backward/dkv.py's
  ``dkv_launch_order``, dq.py's ``dq_launch_order``: L2 sections the host
  sizes from the lengths, or head by head where sections do not repay)
  while a plain backward is traced with symbolic lengths: head by head
  (None), or ``sectioned``, the traced batch's and heads' units in one
  section of the symbolic tiles (the only sections one unit has); not
  causal, head by head, as on the host."""
  from kernel.tiling import schedule as schedule_lib
  scope = modules.backward.attention_backward.__globals__
  dkv_scope, dq_scope = scope["dkv_call"].__globals__, scope["dq_call"].__globals__
  hosts = dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"]

  def order(problem, units, tiles):
    if not (problem.mask.causal and sectioned):
      return None
    return schedule_lib.LaunchOrder(units, tiles, (units,))

  def dkv(problem, blocks, *, batch, num_kv_heads, s_pad, **_):
    return order(problem, num_kv_heads * batch, s_pad // blocks.dkv_tile)

  def dq(problem, blocks, *, batch, num_heads, t_pad, **_):
    return order(problem, batch * num_heads, t_pad // blocks.dq_tile)

  dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"] = dkv, dq
  try:
    yield
  finally:
    dkv_scope["dkv_launch_order"], dq_scope["dq_launch_order"] = hosts
