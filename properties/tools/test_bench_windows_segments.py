"""The windows-and-segments section of ``bench --grid``
(harness/tools/bench_windows_segments.py), on the CPU, without timing anything on
a GPU: its problems are issue 20's, its FLOP count is the reference's count
of the pairs that take part, its masks are the variants', every route it
times lowers for CUDA forward and backward (cuDNN's with the version check
stubbed: this host has no cuDNN), what it calls unavailable in jax.nn is
what jax.nn refuses, and its rows land in performance.json / .md beside the
grid's, keeping the part a run did not time."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools import bench_grid as bg
from harness.tools import bench_windows_segments as ws
from harness.numerics import reference as ref_lib
from harness.numerics import strategies as hs
from kernel import api
from kernel.call import AttentionShapes, Call

SMALL = {
    "window": ws.MaskedShape("window", 128, 512, False, window=100, batch_override=1,
                         heads_override=2),
    "window-causal": ws.MaskedShape("window", 64, 512, True, window=100, batch_override=1,
                                heads_override=2),
    "packed-causal": ws.MaskedShape("packed", 128, 512, True, documents=(100, 1, 155, 256),
                                batch_override=1, heads_override=2),
    "packed": ws.MaskedShape("packed", 64, 384, False, documents=(129, 255), batch_override=2,
                         heads_override=1),
}


def _visibility(shape: ws.MaskedShape, *, variant=True) -> np.ndarray:
  """(B, N, T, S) from the float64 reference's own definitions."""
  p = shape
  shapes = AttentionShapes(B=p.batch, T=p.seq, N=p.heads, H=p.head_dim, S=p.seq, K=p.heads,
                           Hv=p.head_dim)
  kw = {}
  if variant and p.kind == "window":
    kw = dict(local_window_size=p.window)
  if variant and p.kind == "packed":
    ids = np.broadcast_to(np.repeat(np.arange(len(p.documents)), p.documents), (p.batch, p.seq))
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids)
  return ref_lib.key_visibility(Call.of_shapes(shapes, is_causal=p.causal, **kw))


def test_the_problems_are_issue_20s():
  """Windows of 1k at 8k and 16k, causal and not; documents of 1k-4k
  summing to 16k in one causal row; head dim 128 by default."""
  shapes = ws.masked_shapes()
  windows = {(p.seq, p.causal) for p in shapes if p.kind == "window"}
  assert windows == {(8192, False), (8192, True), (16384, False), (16384, True)}
  assert {p.window for p in shapes if p.kind == "window"} == {1024}
  packed = [p for p in shapes if p.kind == "packed"]
  assert len(packed) == 1 and packed[0].causal and packed[0].batch == 1
  docs = packed[0].documents
  assert sum(docs) == 16384 and all(1024 <= n <= 4096 for n in docs) and len(docs) >= 4
  assert any(n % 128 for n in docs)  # boundaries off the block grid
  assert {p.head_dim for p in shapes} == {128}
  assert {p.batch * p.seq for p in shapes} == {bg.TOKENS}
  assert {p.head_dim for p in ws.masked_shapes((64, 128))} == {64, 128}


@pytest.mark.parametrize("name", list(SMALL))
def test_flops_count_the_pairs_the_reference_sees(name):
  """visible_pairs is the number of (query, key) pairs of the reference's
  key_visibility, with the variant and without it."""
  p = SMALL[name]
  for variant in (True, False):
    assert ws.visible_pairs(p, variant=variant) == int(_visibility(p, variant=variant).sum())
  assert ws.flops(p, backward=True) == 3.5 * ws.flops(p, backward=False) \
      == 3.5 * 4 * p.head_dim * ws.visible_pairs(p)


def test_the_16k_window_needs_a_quarter_of_the_work_or_less():
  """The precondition of the >= 4x target: at 16k a 1k window keeps at most a
  quarter of the pairs, causal or not; the documents a sixth of causal's."""
  for p in ws.masked_shapes():
    ratio = ws.visible_pairs(p, variant=False) / ws.visible_pairs(p)
    if p.seq == 16384:
      assert ratio >= (6 if p.kind == "packed" else 4), (p.label(), ratio)


@pytest.mark.parametrize("name", list(SMALL))
def test_the_masks_and_ids_are_the_variants(name):
  """The dense mask (with causal, as the route passes it) sees exactly the
  reference's keys; the ids, cuDNN's lengths and offsets describe the
  documents."""
  p = SMALL[name]
  aux = ws.aux_arrays(p)
  want = _visibility(p)
  mask = np.broadcast_to(np.asarray(aux["mask"]), want.shape)
  if p.causal:
    mask = mask & np.tri(p.seq, dtype=bool)
  np.testing.assert_array_equal(mask, want)
  if p.kind == "packed":
    docs = p.documents
    ids = np.asarray(aux["ids"])
    assert ids.shape == (p.batch, p.seq) and ids.dtype == np.int32
    assert [int(n) for n in np.asarray(aux["seqlen"])[0]] == list(docs)
    offsets = np.asarray(aux["offsets"])[0].tolist()
    assert offsets == [0, *np.cumsum(docs)[:-1].tolist(), -1]
    assert np.asarray(aux["offsets"]).shape == (p.batch, len(docs) + 1)
    # each row's document as its key range, from the document lengths alone
    starts = np.concatenate([[0], np.cumsum(docs)[:-1]])
    first = np.repeat(starts, docs)
    for name, want_row in (("k_start", first), ("k_end", first + np.repeat(docs, docs))):
      got = np.asarray(aux[name])
      assert got.shape == (p.batch, 1, p.seq) and got.dtype == np.int32, name
      np.testing.assert_array_equal(got, np.broadcast_to(want_row, got.shape), err_msg=name)


@pytest.fixture
def cudnn_lowers_here(monkeypatch):
  """Let jax's cuDNN attention lower for CUDA on a host without cuDNN: its
  version and compute-capability checks answer as an H200 with cuDNN 9.10
  would.  Only the lowering runs; nothing is executed."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)


def _lowered(fn, shape: ws.MaskedShape, backward: bool) -> str:
  sds = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.heads, shape.head_dim),
                             jnp.bfloat16)
  aux = jax.eval_shape(lambda: ws.aux_arrays(shape))
  args = (sds,) * (4 if backward else 3) + (aux,)
  with api.lowering_only():
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Each problem in both directions under thorough; under the ci profile each in
# one, alternating, so both kinds and both directions still lower
# (docs/decisions/cpu-suite-time.md).
ROUTES_LOWERED = hs.ci_pairs(SMALL, (False, True))


@pytest.mark.parametrize("name,backward", ROUTES_LOWERED,
                         ids=[f"{n}-{'backward' if b else 'forward'}" for n, b in ROUTES_LOWERED])
def test_every_route_lowers_for_cuda(name, backward, cudnn_lowers_here):
  """Ours into Mosaic GPU kernels (the backward's too), cuDNN into its fused
  attention (with the window as cuDNN's left sliding window of w + 1, the
  documents as that many packed segments); the routes jax.nn cannot take
  are named, with the reason."""
  p = SMALL[name]
  fns, unavailable = ws.implementations(p, backward=backward)
  expected = ({ws.OURS, ws.NO_WINDOW, ws.DENSE_MASK} if p.kind == "window"
              else {ws.OURS, ws.OTHER_BOUNDS, ws.KEY_RANGES, ws.DENSE_MASK, ws.ANY_LAYOUT,
                    ws.CUDNN_PACKED})
  if p.kind == "window" and p.causal:
    expected.add(ws.CUDNN)
  assert set(fns) == expected
  assert set(unavailable) == {ws.CUDNN} - expected
  for route, fn in fns.items():
    text = _lowered(fn, p, backward)
    calls = set(re.findall(r"custom_call @([\w$]+)", text))
    if route.startswith("ours"):
      assert text.count("custom_call @mosaic_gpu") >= (2 if backward else 1), route
      assert not any("cudnn" in c for c in calls), route
    else:
      assert "__cudnn$fmhaSoftmax" in calls, (route, calls)
      assert ("__cudnn$fmhaSoftmaxBackward" in calls) == backward, (route, calls)
      config = re.findall(r"sliding_window_length\\22: (\d+)", text)
      segments = re.findall(r"max_seg_per_batch\\22: (\d+)", text)
      if route == ws.CUDNN:
        assert config[0] == str(p.window + 1) and segments[0] == "1"
      else:
        assert segments[0] == str(len(p.documents))


def test_what_is_unavailable_through_jax_nn_is_what_it_refuses(cudnn_lowers_here):
  """jax.nn refuses a two-sided window without causal for cuDNN (the route
  named unavailable), passes it with causal, and has no segment ids."""
  sds = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  call = lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, local_window_size=100, implementation="cudnn")
  with pytest.raises(ValueError, match="right window"):
    jax.jit(call(False)).trace(sds, sds, sds)
  assert ws.jax_nn_cudnn_refusal(SMALL["window"]) is not None
  jax.jit(call(True)).trace(sds, sds, sds).lower(lowering_platforms=("cuda",))
  assert ws.jax_nn_cudnn_refusal(SMALL["window-causal"]) is None
  import inspect
  params = inspect.signature(jax.nn.dot_product_attention).parameters
  assert not [n for n in params if "segment" in n or "offset" in n]
  assert ws.jax_nn_cudnn_refusal(SMALL["packed-causal"]) == ws.NO_SEGMENTS_IN_JAX_NN


def test_a_row_holds_times_errors_reasons_and_agreement(monkeypatch):
  """time_shape's row, with XLA stand-ins for the routes (run on the CPU):
  each timed route's ms and TFLOP/s on the problem's pairs (no window: its
  own), a failing route's error, an unavailable one's reason, and the
  dense mask's max |out - ours| (the same problem: equal up to rounding;
  the window-free baseline is not compared)."""
  p = SMALL["window-causal"]

  def stand_ins(shape, *, backward):
    nn = lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, is_causal=True, **kw)

    def fails(q, k, v, aux):
      raise RuntimeError("no such kernel")
    fns = {ws.OURS: lambda q, k, v, aux: nn(q, k, v, local_window_size=shape.window),
           ws.NO_WINDOW: lambda q, k, v, aux: nn(q, k, v),
           ws.DENSE_MASK: lambda q, k, v, aux: nn(q, k, v, mask=aux["mask"]),
           ws.CUDNN: fails}
    return {n: jax.jit(f) for n, f in fns.items()}, {ws.CUDNN_PACKED: "not for windows"}

  monkeypatch.setattr(ws, "implementations", stand_ins)
  row = ws.time_shape(p, backward=False, dtype="float32", sets=2)
  res = row["results"]
  for name in (ws.OURS, ws.NO_WINDOW, ws.DENSE_MASK):
    assert res[name]["ms"] > 0
  assert res[ws.OURS]["tflops"] / res[ws.DENSE_MASK]["tflops"] == pytest.approx(
      res[ws.DENSE_MASK]["ms"] / res[ws.OURS]["ms"])
  no_window_flops = res[ws.NO_WINDOW]["tflops"] * res[ws.NO_WINDOW]["ms"] * 1e9
  assert no_window_flops == pytest.approx(ws.flops(p, backward=False, variant=False))
  assert "no such kernel" in res[ws.CUDNN]["error"]
  assert res[ws.CUDNN_PACKED] == {"unavailable": "not for windows"}
  assert row["pairs"] == ws.visible_pairs(p) and row["pass_"] == "forward"
  diffs = row["max_abs_diff_to_ours"]
  assert set(diffs) == {ws.DENSE_MASK} and diffs[ws.DENSE_MASK] < 1e-5


def _fake_row(shape, ms: dict, pass_="forward"):
  results = {n: (dict(ms=t, tflops=ws.flops(shape, backward=False) / t / 1e9)
                 if isinstance(t, float) else t) for n, t in ms.items()}
  return dict(problem=shape.kind, head_dim=shape.head_dim, seq=shape.seq,
              causal=shape.causal, window=shape.window, documents=shape.documents,
              chunk=shape.chunk,
              batch=shape.batch, heads=shape.heads, dtype="bfloat16", pass_=pass_,
              pairs=ws.visible_pairs(shape), results=results,
              max_abs_diff_to_ours={ws.DENSE_MASK: 0.0078})


def _meta(command):
  return dict(device="NVIDIA H200", jax="0.11.2", commit="abc1234", date="2026-12-01",
              dtype="bfloat16", command=command)


def test_the_table_shows_speedups_and_reasons():
  window = ws.MaskedShape("window", 128, 16384, True, window=1024)
  packed = next(p for p in ws.masked_shapes() if p.kind == "packed")
  chunk = next(p for p in ws.masked_shapes() if p.kind == "chunk")
  rows = [_fake_row(window, {ws.OURS: 1.0, ws.NO_WINDOW: 5.0, ws.DENSE_MASK: 6.0,
                             ws.CUDNN: 1.25}),
          _fake_row(packed, {ws.OURS: 2.0, ws.DENSE_MASK: 5.0, ws.ANY_LAYOUT: 4.0,
                             ws.CUDNN: {"unavailable": ws.NO_SEGMENTS_IN_JAX_NN},
                             ws.CUDNN_PACKED: {"error": "XlaRuntimeError: boom"}}),
          _fake_row(packed, {ws.OURS: 2.0, ws.KEY_RANGES: 1.6, ws.CUDNN_PACKED: 1.8})]
  table = ws.render_table(rows).splitlines()
  assert table[0].startswith("| pass | D | problem | seq | causal | B | N | ours |")
  assert table[2].endswith("| 5.00 | 6.00 | - | 1.25 | - |")
  assert table[3].endswith("| - | 2.50 | 2.00 | - | - |")
  assert "| n/a | error |" in table[3]
  text = "\n".join(ws.render({"rows": rows}))
  assert "ours, no window ÷ ours 5.00 (target ≥ 4: met)" in text
  assert "ours, dense mask ÷ ours 2.50 (target ≥ 3: NOT met)" in text
  assert ws.NO_SEGMENTS_IN_JAX_NN in text and "XlaRuntimeError: boom" in text
  assert "ours, dense mask 0.0078" in text
  # cuDNN's packed route beside ours handed the same offsets, not beside ours
  assert ("cudnn packed (jax._src) ÷ ours, key ranges 1.12 (both handed the documents' "
          "offsets)") in text
  assert "cudnn packed (jax._src) ÷ ours 0.90 (target ≥ 1: NOT met)" in text
  chunked = ws.render({"rows": [_fake_row(chunk, {ws.OURS: 1.0, ws.DENSE_MASK: 7.0,
                                                  ws.CUDNN: {"unavailable":
                                                             ws.NO_CHUNKS_IN_JAX_NN}})]})
  assert "d128 chunks of 2048 causal at 16384: ours, dense mask ÷ ours 7.00 (target ≥ 3: met)" \
      in "\n".join(chunked), chunked


def test_a_section_run_keeps_the_grids_rows_and_writes_both(tmp_path, monkeypatch):
  """Timing only the section rewrites its part of performance.json/.md and
  keeps the grid's rows with their own provenance (the plot's title names
  both commits); timing only the grid later keeps the section."""
  titles = []
  monkeypatch.setattr(bg, "plot", lambda panels, path, title: titles.append(title) or False)
  dense_row = dict(head_dim=128, seq=4096, causal=False, kv_heads_ratio=1, heads=16,
                   kv_heads=16, batch=4, dtype="bfloat16", pass_="forward",
                   results={"ours auto": dict(ms=1.0, tflops=600.0),
                            "cudnn": dict(ms=1.05, tflops=571.4)})
  first = bg.merged_record({}, _meta("python -m harness bench --grid"), rows=[dense_row],
                           sections={})
  sections = {ws.NAME: ws}
  bg.write(first, tmp_path, sections)
  window = ws.MaskedShape("window", 128, 16384, True, window=1024)
  section_rows = [_fake_row(window, {ws.OURS: 1.0, ws.NO_WINDOW: 4.5})]
  existing = json.loads((tmp_path / "performance.json").read_text())
  second = bg.merged_record(existing, dict(_meta("python -m harness bench --grid --sections "
                                                 "windows-segments"), commit="def5678"),
                            rows=None, sections={ws.KEY: section_rows})
  bg.write(second, tmp_path, sections)
  record = json.loads((tmp_path / "performance.json").read_text())
  assert record["rows"] == [dense_row] and record["commit"] == "abc1234"
  assert record["sections"][ws.KEY]["commit"] == "def5678"
  assert record["sections"][ws.KEY]["rows"][0]["results"][ws.NO_WINDOW]["ms"] == 4.5
  md = (tmp_path / "performance.md").read_text()
  assert "| forward | 128 | 4096 | no | 4 | 16/16 | 600.0 | 571.4 | 1.05 |" in md
  assert f"## {ws.TITLE}" in md and "commit def5678" in md and "commit abc1234" in md
  assert "commit abc1234" in titles[0] and "def5678" not in titles[0]
  assert "commit abc1234" in titles[1] and f"{ws.TITLE.lower()}: " in titles[1]
  assert "commit def5678" in titles[1]
  third = bg.merged_record(record, _meta("python -m harness bench --grid"), rows=[dense_row],
                           sections={})
  assert third["sections"] == record["sections"]


def test_sections_are_checked_by_name():
  sections = {ws.NAME: ws}
  assert bg.chosen_sections("dense,windows-segments", sections) == ["dense", "windows-segments"]
  assert bg.chosen_sections("windows-segments,", sections) == ["windows-segments"]
  for bad in ("windows", "dense,segments", ""):
    with pytest.raises(ValueError, match="^--sections"):
      bg.chosen_sections(bad, sections)


def test_the_section_panels_plot_ms_per_route():
  window = ws.MaskedShape("window", 128, 16384, True, window=1024)
  plain = ws.MaskedShape("window", 128, 8192, False, window=1024)
  rows = [_fake_row(window, {ws.OURS: 1.0, ws.NO_WINDOW: 4.5}),
          _fake_row(plain, {ws.OURS: 0.5, ws.DENSE_MASK: 2.0})]
  (panel,) = ws.panels({"rows": rows})
  assert panel.groups == ["8192", "16384 causal"]
  assert panel.series == {ws.OURS: [0.5, 1.0], ws.NO_WINDOW: [0.0, 4.5],
                          ws.DENSE_MASK: [2.0, 0.0]}


def test_an_unknown_section_is_refused_before_anything_runs(capsys):
  from harness.tools import bench
  with pytest.raises(SystemExit) as stop:
    bench.main(["--grid", "--sections", "dense,window"])
  assert stop.value.code == 2 and "--sections: unknown ['window']" in capsys.readouterr().err


def test_a_backward_only_run_keeps_the_forward_rows_with_their_provenance(tmp_path):
  """The grid's passes are merged one by one: a --backward-only run replaces
  the forward + backward rows and keeps the forward rows, and the page names
  the command and commit of each pass; timing the forward again replaces
  only its rows."""
  def row(pass_, ms):
    return dict(head_dim=64, seq=4096, causal=False, kv_heads_ratio=1, heads=32, kv_heads=32,
                batch=4, dtype="bfloat16", pass_=pass_,
                results={"ours auto": dict(ms=ms, tflops=100.0 / ms),
                         "cudnn": dict(ms=1.0, tflops=100.0)})
  forward = bg.merged_record({}, _meta("python -m harness bench --grid"),
                             rows=[row("forward", 0.5)], sections={}, passes=("forward",))
  backward_meta = dict(_meta("python -m harness bench --grid --backward-only"), commit="fed9876")
  both = bg.merged_record(forward, backward_meta, rows=[row("forward+backward", 2.0)],
                          sections={}, passes=("forward+backward",))
  assert [r["pass_"] for r in both["rows"]] == ["forward", "forward+backward"]
  assert both["pass_meta"]["forward"]["commit"] == "abc1234"
  assert both["pass_meta"]["forward+backward"]["commit"] == "fed9876"
  bg.write(both, tmp_path, {})
  md = (tmp_path / "performance.md").read_text()
  assert "- forward: Generated by `python -m harness bench --grid` on" in md
  assert "- forward+backward: Generated by `python -m harness bench --grid --backward-only`" in md
  assert "commit fed9876" in md and "commit abc1234" in md
  again = bg.merged_record(both, dict(_meta("python -m harness bench --grid"), commit="0a0a0a0"),
                           rows=[row("forward", 0.4)], sections={}, passes=("forward",))
  assert [(r["pass_"], r["results"]["ours auto"]["ms"]) for r in again["rows"]] == [
      ("forward", 0.4), ("forward+backward", 2.0)]
  assert again["pass_meta"]["forward"]["commit"] == "0a0a0a0"
  assert again["pass_meta"]["forward+backward"]["commit"] == "fed9876"
  # a record written before pass_meta credits its rows to its top-level meta
  legacy = dict(_meta("python -m harness bench --grid"), rows=[row("forward", 0.5)])
  merged = bg.merged_record(legacy, backward_meta, rows=[row("forward+backward", 2.0)],
                            sections={}, passes=("forward+backward",))
  assert merged["pass_meta"]["forward"]["commit"] == "abc1234"


def test_a_page_keeps_no_part_from_another_device(tmp_path, monkeypatch, capsys):
  """A run on one device that would keep a part of the page measured on
  another (the grid timed on an H100 beside an H200's section) is refused,
  naming both devices and the part, before anything is timed; a run that
  times every part the page holds, or one on the page's own device, is
  not."""
  dense_row = dict(head_dim=128, seq=4096, causal=False, kv_heads_ratio=1, heads=16,
                   kv_heads=16, batch=4, dtype="bfloat16", pass_="forward",
                   results={"ours auto": dict(ms=1.0, tflops=600.0),
                            "cudnn": dict(ms=1.05, tflops=571.4)})
  window = ws.MaskedShape("window", 128, 16384, True, window=1024)
  section_rows = [_fake_row(window, {ws.OURS: 1.0, ws.NO_WINDOW: 4.5})]
  h200 = bg.merged_record({}, _meta("python -m harness bench --grid"), rows=[dense_row],
                          sections={ws.KEY: section_rows}, passes=("forward",))
  h100 = dict(_meta("python -m harness bench --grid"), device="NVIDIA H100 80GB HBM3")
  with pytest.raises(ValueError, match=r"on NVIDIA H100 80GB HBM3, and the page there keeps "
                                       rf"section {ws.KEY} \(NVIDIA H200\)"):
    bg.merged_record(h200, h100, rows=[dense_row], sections={}, passes=("forward",))
  with pytest.raises(ValueError, match=r"keeps forward \(NVIDIA H200\)"):
    bg.merged_record(h200, h100, rows=None, sections={ws.KEY: section_rows})
  everything = bg.merged_record(h200, h100, rows=[dense_row], sections={ws.KEY: section_rows},
                                passes=("forward",))
  assert everything["device"] == everything["sections"][ws.KEY]["device"] == h100["device"]
  same = bg.merged_record(h200, dict(_meta("python -m harness bench --grid"), commit="0a0a0a0"),
                          rows=[dense_row], sections={}, passes=("forward",))
  assert same["sections"][ws.KEY]["commit"] == "abc1234"
  # the command line refuses before it times: nothing here could time
  (tmp_path / "performance.json").write_text(json.dumps(h200))
  monkeypatch.setattr(bg, "run_grid", lambda *a, **k: pytest.fail("timed before refusing"))
  import jax
  monkeypatch.setattr(jax, "devices", lambda *a: [type("D", (), {"device_kind": h100["device"]})])
  from harness.tools import bench
  assert bench.main(["--grid", "--out-dir", str(tmp_path), "--no-example"]) == 2
  err = capsys.readouterr().err
  assert "harness bench --grid: --out-dir: this run is on NVIDIA H100 80GB HBM3" in err
  assert f"section {ws.KEY} (NVIDIA H200)" in err
