"""bench --grid's variant syntax (harness/tools/bench_grid.py), checked on the CPU:
each variant names the call it times, and the deterministic one lowers to
the fused dQ summed in int32 (deterministic=True's backward)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools import bench_grid as bg
from kernel import api
from kernel.tiling.config import Config


@pytest.mark.parametrize("text,config,det", [
    ("auto", None, False),
    ("auto,det", None, True),
    ("64,128,2", Config(64, 128, 2, False), False),
    ("64,128,2,p,lf,det", Config(64, 128, 2, True, "longest-first"), True),
    ("64,128,2,p,w3", Config(64, 128, 2, True, compute_warpgroups=3), False),
    ("64,128,2,p,st", Config(64, 128, 2, True, "split-tail"), False),
    ("auto,st", None, False),
    ("auto,st,det", None, True),
    ("auto,fs", None, False),
    ("64,128,2,p,lf,fs,det", Config(64, 128, 2, True, "longest-first"), True),
    ("auto,lt", None, False),
    ("64,64,2,lf,lo", Config(64, 64, 2, False, "longest-first"), False),
    ("auto,ut", None, False),
    ("auto,pc", None, False),
    ("auto,up", None, False),
])
def test_variants_parse(text, config, det):
  assert bg.parse_variant(text) == config
  assert bg.is_deterministic(text) is det
  assert bg.filled_sections(text) is (text in ("auto,fs", "64,128,2,p,lf,fs,det"))
  assert bg.deferred_light(text) is {"auto,lt": True, "64,64,2,lf,lo": False}.get(text)
  assert bg.untiled_copies(text) is {"auto,ut": True, "auto,pc": False}.get(text)
  assert bg.unpadded_backward(text) is (text == "auto,up")


@pytest.mark.parametrize("head_dim,causal", [(64, True), (256, False)])
def test_the_untiled_and_padded_variants_time_the_call_with_and_without_padded_copies(
    head_dim, causal):
  """At the grid's 12017 point, ``ut`` pads nothing and ``pc`` pads q, k and
  v (kernel.experiments' untiled_copies); ``auto`` does as
  kernel.tiling.plan.untiled_copies_pay says: untiled at head dim 64
  causal, padded at head dim 256 without causal."""
  point = bg.Point(head_dim, 12017, causal)
  texts = ("auto", "auto,ut", "auto,pc")
  fns = bg.implementations(point, texts, backward=False, example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  with api.lowering_only():
    pads = {text: str(jax.make_jaxpr(fns[f"ours {text}"])(q, q, q)).count("name=_pad")
            for text in texts}
  assert pads["auto,ut"] == 0 < pads["auto,pc"], pads
  assert pads["auto"] == (pads["auto,pc"] if head_dim > 128 else 0), pads


def test_the_unpadded_variant_times_the_backward_without_padded_copies():
  """``up`` with the backward at the grid's 1000 point (a multiple of 8 but
  of no tile): its forward + backward pads none of q, k, v and dO, where
  the shipped backward copies them padded (kernel.experiments'
  "pallas-unpadded")."""
  point = bg.Point(128, 1000, True)
  fns = bg.implementations(point, ["auto", "auto,up"], backward=True, example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  with api.lowering_only():
    # pads of 16-bit rank-4 arrays: q, k, v or dO (the residual rows' lse
    # and delta, padded to whole tiles by both, are float32 and rank 3)
    pads = {text: re.findall(r"bf16\[\d+,\d+,\d+,\d+\] = pad\[",
                             str(jax.make_jaxpr(fns[f"ours {text}"])(q, q, q, q)))
            for text in ("auto", "auto,up")}
  assert pads["auto"] and not pads["auto,up"], pads


def test_the_filled_sections_variant_times_the_order_before_the_evening(monkeypatch):
  """A variant ending in ``fs`` traces the longest-first order without the
  SMs, so its L2 sections stay filled (kernel/tiling/schedule.py's longest_first
  evens them only when it is told the SMs, as the variant without ``fs``
  does: properties/kernel/test_schedule.py checks the evening at causal 12017
  tokens, d128)."""
  from kernel.tiling import schedule
  told = []
  real = schedule.longest_first

  def recording(**kwargs):
    told.append(kwargs["num_sms"])
    return real(**kwargs)
  monkeypatch.setattr(schedule, "longest_first", recording)
  point = bg.Point(128, 12017, True)
  variants = ["64,128,2,p,lf", "64,128,2,p,lf,fs"]
  fns = bg.implementations(point, variants, backward=False, example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  for text, num_sms in zip(variants, (132, None)):
    name = f"ours {text}"
    told.clear()
    with api.lowering_only():
      jax.make_jaxpr(fns[name])(q, q, q)
    assert told == [num_sms], name


@pytest.mark.parametrize("seq,shipped_defers", [(9522, True), (1024, False)])
def test_the_light_last_variants_force_the_order_the_model_chooses(monkeypatch, seq,
                                                                   shipped_defers):
  """``lt`` runs the longest-first order's light tiles last and ``lo`` in
  order; without either the order is the one kernel.tiling.schedule.light_last_gain
  picks: deferred at d256 causal 9522 tokens (B1: a shorter tail), in order
  at 1024 (B16: re-reading 128 heads' K/V costs more than the tail saves)."""
  from kernel.forward import order as fwd_order
  from kernel.tiling import schedule
  made = []
  real = fwd_order.tile_schedule

  def recording(**kwargs):
    order = real(**kwargs)
    in_order = real(**{**kwargs, "light_last": False})
    made.append(not np.array_equal(order.order, in_order.order))
    assert sorted(order.order.tolist()) == sorted(in_order.order.tolist())
    if made[-1]:
      assert order.order.tolist() == schedule.deferred_light(in_order).order.tolist()
    return order
  monkeypatch.setattr(fwd_order, "tile_schedule", recording)
  point = bg.Point(256, seq, True)
  variants = {"64,64,2,lf,lo": False, "64,64,2,lf": shipped_defers, "64,64,2,lf,lt": True}
  fns = bg.implementations(point, list(variants), backward=False, example=False)
  q = jax.ShapeDtypeStruct((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  for text, defers in variants.items():
    made.clear()
    with api.lowering_only():
      jax.make_jaxpr(fns[f"ours {text}"])(q, q, q)
    assert made == [defers], text


def test_light_last_and_in_order_together_are_refused():
  with pytest.raises(ValueError, match="--variants: both lt and lo"):
    bg.deferred_light("auto,lt,lo")


@pytest.mark.parametrize("text", ["x", "64,128", "64,128,2,q", "auto,p", "64,128,2,p,lf,st",
                                  "auto,lf"])
def test_bad_variants_are_refused_by_text(text):
  with pytest.raises(ValueError, match="--variants"):
    bg.parse_variant(text)


def test_the_deterministic_variant_times_the_fixed_point_backward():
  point = bg.Point(64, 1024, False)
  fns = bg.implementations(point, ["auto", "auto,det"], backward=True, example=False)
  sds = jax.ShapeDtypeStruct
  q = sds((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  accumulator = f"tensor<{point.batch}x{point.seq}x{point.heads}x{point.head_dim}xi32>"
  for name, det in (("ours auto", False), ("ours auto,det", True)):
    with api.lowering_only():
      text = jax.export.export(fns[name], platforms=["cuda"])(q, q, q, q).mlir_module()
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 2, name
    assert (accumulator in text) is det, name


@pytest.mark.parametrize("causal", [False, True])
def test_auto_st_times_the_chosen_config_with_the_split_tail_where_it_runs(causal):
  """``auto,st``: the config ``auto`` picks, its schedule the split tail
  where that runs (persistent, not causal); elsewhere ``auto``'s own."""
  assert bg.splits_auto("auto,st") and bg.splits_auto("auto,st,det")
  assert not bg.splits_auto("auto") and not bg.splits_auto("64,128,2,p,st")
  point = bg.Point(128, 4096, causal)
  sds = jax.ShapeDtypeStruct
  q = sds((point.batch, point.seq, point.heads, point.head_dim), jnp.bfloat16)
  with api.lowering_only():
    auto = api.chosen_config(q, q, q, is_causal=causal)
    got = bg.split_tail_of(q, q, q, is_causal=causal)
  if auto.persistent and not causal:
    assert got == Config(**{**auto.__dict__, "schedule": "split-tail"})
  else:
    assert got == auto
  fns = bg.implementations(point, ["auto,st"], backward=False, example=False)
  with api.lowering_only():
    text = jax.export.export(fns["ours auto,st"], platforms=["cuda"])(q, q, q).mlir_module()
  assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 1


def test_each_timed_point_reaches_the_partial_file_before_the_next(tmp_path, monkeypatch):
  """A grid stopped by a time limit leaves the rows it timed: run_grid
  appends each row to OUT_DIR/performance.partial.jsonl (after the run's
  meta) before it starts the next point."""
  import json
  seen_lines = []
  monkeypatch.setattr(bg, "implementations", lambda point, variants, **kw: {"ours auto": None})
  monkeypatch.setattr(bg, "_inputs", lambda *a: [()])

  def timed(fns, inputs):
    path = tmp_path / bg.PARTIAL
    seen_lines.append(len(path.read_text().splitlines()))
    return {"ours auto": 1e-3 * (len(seen_lines))}, {}
  monkeypatch.setattr(bg, "time_interleaved", timed)
  points = [bg.Point(64, 1024, False), bg.Point(128, 4096, True)]
  on_row = bg.partial_writer(tmp_path, dict(commit="abc"))
  rows = bg.run_grid(points, ["auto"], backward=False, on_row=on_row, log=lambda *a, **k: None)
  lines = [json.loads(x) for x in (tmp_path / bg.PARTIAL).read_text().splitlines()]
  assert seen_lines == [1, 2]          # the meta, then the first row before the second point
  assert lines[0] == {"meta": {"commit": "abc"}}
  assert lines[1:] == rows
  assert [r["results"]["ours auto"]["ms"] for r in lines[1:]] == [1.0, 2.0]
  assert bg.partial_writer(None, {}) is None


def test_seqs_replace_the_grids_lengths_with_any_lengths():
  """``--seqs`` times the lengths given, in their order, whether or not the
  grid holds them (9522 is neither a grid nor a ragged length)."""
  points = bg.grid_points(backward=False, head_dims=(256,), seqs=(9522, 1024))
  assert [(p.seq, p.causal) for p in points] == [(9522, False), (1024, False),
                                                 (9522, True), (1024, True)]
  assert {p.seq for p in bg.grid_points(backward=True)} == set(bg.BACKWARD_SEQS + bg.RAGGED_SEQS)
  assert {p.seq for p in bg.grid_points(backward=False, ragged=False)} == set(bg.FORWARD_SEQS)


def test_any_head_dim_gets_the_grids_width():
  """``--head-dims`` takes any head dim (192, 96: the ones the shipped cache
  reads from wider entries); every point has heads * head_dim = 2048, as
  the grid's own 32/16/8 heads at 64/128/256, and 16k tokens per batch."""
  heads = {d: bg.grid_points(backward=False, head_dims=(d,), seqs=(4096,))[0].heads
           for d in (64, 96, 128, 192, 256)}
  assert heads == {64: 32, 96: 21, 128: 16, 192: 10, 256: 8}
  point = bg.Point(192, 12017, True)
  assert (point.batch, point.kv_heads) == (1, 10)
  assert point.flops(False) == 4.0 * 10 * 12017 * 12017 * 192 / 2
