"""``python -m harness schedule``: how evenly the forward's longest-first order
deals its tiles to the SMs, per shape, on this machine's CPU (no GPU).

For each point (head dim x sequence length x query heads per kv head, causal
or not, 16k tokens per batch as in ``bench --grid``) the report takes the
config ``config=None`` runs on an H200 (the shipped autotune cache, else the
heuristic) and, where that config runs the longest-first schedule, deals its
order as the kernel does (kernel/tiling/schedule.py's ``Schedule.assign``: each tile
to the block with the least work so far, a tile costing its key blocks plus
``TILE_OVERHEAD_BLOCKS``).  ``tail`` is the largest block's load over the
mean: 1.00 is a perfect deal, 1.10 an SM finishing 10 % after the average.
Both orders are shown, the shipped one (L2 sections evened where that pays)
and the one with sections filled to their byte bound (``bench --grid``'s
``,fs`` variant), each marked "light last" where its light tiles run after
every section's heavy ones (``schedule.light_last_gain``), so that a change
to the schedule is predicted here before it is timed on the GPU.  The
model knows key blocks, not their cost: a masked diagonal block or a slow
head is not in it.

``--backward`` reports the backward's causal grids instead: the dK/dV
kernel's launch order and, where dQ is not fused, the dQ kernel's
(kernel.backward.dkv.dkv_launch_order and dq_launch_order), each dealt by
``kernel.tiling.schedule.predicted_makespan`` beside the head-by-head order.
"""

from __future__ import annotations

import argparse

import numpy as np

from harness.tools import bench_grid as bg

DEVICE_KIND = "NVIDIA H200"
SEQS = bg.FORWARD_SEQS + bg.RAGGED_SEQS


def order_of(config, *, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
             seq: int, causal: bool, **choices):
  """The longest-first order the forward runs for ``config`` at T = S =
  ``seq`` in bf16 on :data:`kernel.tiling.schedule.DEFAULT_NUM_SMS` SMs
  (kernel.forward.order.tile_schedule); ``choices``: its ``even_sections`` and
  ``light_last``."""
  from kernel.forward import order as fwd_order
  from kernel.forward import launch as fwd_launch
  from kernel.masks import Mask
  from kernel.tiling import schedule
  num_tiles, s_pad = fwd_launch.launch_extent(config, seq, seq)
  return fwd_order.tile_schedule(
      mask=Mask(seq_q=seq, seq_kv=seq, causal=causal), batch=batch, num_heads=num_heads,
      num_kv_heads=num_kv_heads, num_tiles=num_tiles, s_pad=s_pad, head_dim=head_dim,
      head_dim_out=head_dim, itemsize=2, tile_q=config.tile_q, block_kv=config.block_kv,
      num_sms=schedule.DEFAULT_NUM_SMS, **choices)


def row(head_dim: int, seq: int, causal: bool, gqa: int = 1, *,
        device_kind: str = DEVICE_KIND) -> dict:
  """One point: the config, and for a longest-first one the sections and
  tail of the shipped order and of the filled one (else None)."""
  import jax
  import jax.numpy as jnp
  from kernel import api
  from kernel.tiling import schedule

  point = bg.Point(head_dim, seq, causal, gqa)
  q = jax.ShapeDtypeStruct((point.batch, seq, point.heads, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((point.batch, seq, point.kv_heads, head_dim), jnp.bfloat16)
  with api.lowering_only():
    config = api.chosen_config(q, k, k, is_causal=causal, device_kind=device_kind)
  out = dict(head_dim=head_dim, seq=seq, causal=causal, gqa=gqa, batch=point.batch,
             heads=point.heads, config=config, shipped=None, filled=None)
  if config.schedule != "longest-first":
    return out
  args = dict(batch=point.batch, num_heads=point.heads, num_kv_heads=point.kv_heads,
              head_dim=head_dim, seq=seq, causal=causal)
  for name, even in (("shipped", True), ("filled", False)):
    order = order_of(config, **args, even_sections=even)
    in_order = order_of(config, **args, even_sections=even, light_last=False)
    blocks = min(schedule.DEFAULT_NUM_SMS, order.total)
    mean = (int(order.weight.sum()) + schedule.TILE_OVERHEAD_BLOCKS * order.total) / blocks
    out[name] = dict(sections=order.sections, makespan=order.makespan(blocks), mean=mean,
                     tail=order.makespan(blocks) / mean,
                     light_last=not np.array_equal(order.order, in_order.order))
  return out


def backward_row(head_dim: int, seq: int, gqa: int = 1) -> dict:
  """One causal point of the backward (``bench --grid --backward``'s
  shapes): per kernel that runs (the dK/dV grid, and the dQ grid where dQ
  is not fused), its launch order's sections (None: head by head) and the
  tail kernel.tiling.schedule.predicted_makespan deals it, beside head by head's."""
  import jax.numpy as jnp
  from kernel.tiling import backward_plan
  from kernel.backward import dkv as bwd_dkv
  from kernel.backward import dq as bwd_dq
  from kernel.tiling import plan, schedule

  point = bg.Point(head_dim, seq, True, gqa)
  d = plan.backward_head_dims(head_dim, head_dim)[0]
  blocks = backward_plan.blocks_for(d, d, causal=True)
  problem = plan.problem_for(np.dtype("bfloat16"), head_dim, head_dim, seq, seq, is_causal=True)
  t_pad = -(-seq // blocks.query_multiple) * blocks.query_multiple
  s_pad = -(-seq // blocks.key_multiple) * blocks.key_multiple
  fused = backward_plan.fuses_dq(blocks, with_bias=False, causal=True)
  common = dict(batch=point.batch, group=gqa, t_pad=t_pad, s_pad=s_pad, head_dims=(d, d),
                dtype=jnp.bfloat16, num_sms=schedule.DEFAULT_NUM_SMS)
  grids = {"dkv": (bwd_dkv.dkv_launch_order(problem, blocks, num_kv_heads=point.kv_heads,
                                            fused=fused, **common),
                   point.batch * point.kv_heads, s_pad // blocks.dkv_tile,
                   bwd_dkv.key_tile_weights(problem, blocks, group=gqa, t_pad=t_pad, s_pad=s_pad))}
  if not fused:
    grids["dq"] = (bwd_dq.dq_launch_order(problem, blocks, num_heads=point.heads, **common),
                   point.batch * point.heads, t_pad // blocks.dq_tile,
                   bwd_dq.query_tile_weights(problem, blocks, t_pad=t_pad))
  out = dict(head_dim=head_dim, seq=seq, gqa=gqa, batch=point.batch, heads=point.heads,
             fused=fused)
  for name, (order, units, tiles, weights) in grids.items():
    head_by_head = schedule.LaunchOrder(units, tiles, (1,) * units)
    out[name] = dict(
        sections=None if order is None else order.sizes,
        tail=schedule.predicted_makespan(order or head_by_head, weights,
                                         schedule.DEFAULT_NUM_SMS),
        head_by_head=schedule.predicted_makespan(head_by_head, weights,
                                                 schedule.DEFAULT_NUM_SMS))
  return out


def render_backward(rows: list[dict]) -> str:
  """Markdown, the worst tail of either grid first."""
  def cells(d):
    if d is None:
      return ["-"] * 3
    sections = "head by head" if d["sections"] is None else ",".join(map(str, d["sections"]))
    return [sections, f"{d['tail']:.3f}", f"{d['head_by_head']:.3f}"]
  worst = lambda r: max(r[k]["tail"] for k in ("dkv", "dq") if r.get(k))
  lines = ["| D | seq | causal | B | N/K | dQ | dK/dV order | tail | head by head | "
           "dQ order | tail | head by head |", "|---|---|---|---|---|---|" + "---|" * 6]
  for r in sorted(rows, key=lambda r: -worst(r)):
    lines.append(f"| {r['head_dim']} | {r['seq']} | yes | {r['batch']} | "
                 f"{r['heads']}/{r['heads'] // r['gqa']} | "
                 f"{'fused' if r['fused'] else 'own kernel'} | "
                 + " | ".join(cells(r["dkv"]) + cells(r.get("dq"))) + " |")
  return "\n".join(lines)


def render(rows: list[dict]) -> str:
  """Markdown, the worst shipped tail first."""
  def cell(d):
    if d is None:
      return "-", "-"
    light = " light last" if d["light_last"] else ""
    return ",".join(map(str, d["sections"])) + light, f"{d['tail']:.3f}"
  rows = sorted(rows, key=lambda r: -(r["shipped"] or {"tail": 0})["tail"])
  lines = ["| D | seq | causal | B | N/K | config | sections | tail | filled sections | "
           "filled tail |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    c = r["config"]
    config = (f"{c.block_q},{c.block_kv},{c.num_stages}{',p' if c.persistent else ''}"
              f" {c.schedule}{' w3' if c.compute_warpgroups == 3 else ''}")
    lines.append(f"| {r['head_dim']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | "
                 f"{r['batch']} | {r['heads']}/{r['heads'] // r['gqa']} | {config} | "
                 f"{' | '.join(cell(r['shipped']))} | {' | '.join(cell(r['filled']))} |")
  return "\n".join(lines)


# The report's options: flag -> (default, or None for an on/off switch; help).
OPTIONS = {
    "--head-dims": ("64,128,256", "comma-separated head dims"),
    "--seqs": ("", "comma-separated sequence lengths (default: bench --grid's forward lengths "
                   "and its ragged ones; with --backward its backward lengths)"),
    "--gqa": ("1,4", "comma-separated query heads per kv head"),
    "--device-kind": (DEVICE_KIND, "the autotune cache's device whose configs are dealt"),
    "--non-causal": (None, "also the points without a causal mask"),
    "--backward": (None, "the backward's causal launch orders instead (the dK/dV grid, and the "
                         "dQ grid where dQ is not fused)"),
}


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m harness schedule", description=__doc__.split(
      "\n\n")[0])
  for flag, (default, text) in OPTIONS.items():
    if default is None:
      p.add_argument(flag, action="store_true", help=text)
    else:
      p.add_argument(flag, default=default or None, help=text)
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  ints = lambda text: [int(x) for x in text.split(",") if x.strip()]
  seqs = (ints(args.seqs) if args.seqs is not None
          else bg.BACKWARD_SEQS if args.backward else SEQS)
  if args.backward:
    print(render_backward([backward_row(d, s, g) for d in ints(args.head_dims)
                           for s in seqs for g in ints(args.gqa)]))
    return 0
  rows = [row(d, s, causal, g, device_kind=args.device_kind)
          for d in ints(args.head_dims) for s in seqs for g in ints(args.gqa)
          for causal in ((True, False) if args.non_causal else (True,))]
  print(render(rows))
  return 0
