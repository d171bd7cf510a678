"""Local windows and packed segments, timed beside the routes a user could
take instead: ``python -m harness bench --grid --sections windows-segments``
(the section ``windows_and_segments`` of ``performance.json`` / ``.md`` /
``.png``; harness/tools/bench_grid.py writes it).

Problems (bf16, 16k tokens per batch as in the grid, 16 / 32 heads at head
dim 128 / 64; ``--section-head-dims``):

* **window**: ``local_window_size=WINDOW`` (1024, i.e. (1024, 1024)) at seq
  8k (B = 2) and 16k (B = 1), causal (then (1024, 0) in effect) and not;
* **packed**: ``PACKED_DOCUMENTS`` (seven documents of 1100-4000 tokens,
  boundaries off the block grid) packed into one 16k row, causal;
* **chunk**: ``attention_chunk=CHUNK`` (FlashAttention-3's chunked
  attention, 2048 positions) at 16k, causal inside each chunk.

Routes, timed interleaved in one process per problem by the grid's method
(``bench_grid.time_interleaved``: random normal inputs rotated over sets,
warm-up excluded, medians of interleaved trials), ``config=None``:

* ``ours``: this kernel with the variant itself (``local_window_size``,
  ``attention_chunk``, or ``q_segment_ids`` / ``kv_segment_ids``): per-row key ranges, so the key
  blocks no row of a tile sees are skipped (kernel/key_ranges.py);
* ``ours, dense mask``: the same problem as a boolean mask, (1, 1, T, S) for
  the window and the chunks, (B, 1, T, S) for the documents, with ``is_causal`` as the
  problem has it: every key block is read (above the diagonal still skipped
  under causal), one mask read per logit;
* ``ours, any layout`` (packed): ``segment_layout="any"``, the fallback for
  ids in no order: the dense equality mask built in the call, plus the hull
  of each row's keys as its key range;
* ``ours, sort-free bounds`` or ``ours, searched bounds`` (packed): ``ours``
  with the documents' key ranges found by the method the API does not ship
  (:data:`OTHER_BOUNDS`; kernel/experiments.py's ``segment_bounds``:
  "runs", without a sort where the queries' ids are the keys' and every id
  is one run, or "searched", a sort and binary searches), the A/B of
  ``kernel.key_ranges.SHIPPED_SEGMENT_BOUNDS``;
* ``ours, key ranges`` (packed): ``ours`` given the documents as each
  row's ``k_start`` / ``k_end`` (the document's first key and one past its
  last, built with the inputs as cuDNN's lengths and offsets are), so no
  bounds are searched in the call: the route of a user who holds the
  documents' offsets, and the comparison with ``cudnn packed`` on equal
  terms (both handed the layout);
* ``ours, no window`` (window): the same shape without the window, a
  different problem, timed for the block-skipping ratio of issue 20;
* ``cudnn (jax.nn)``: ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` with the same keyword arguments, where jax.nn hands the variant
  to cuDNN (:func:`jax_nn_cudnn_refusal`): the window under causal only,
  never packed segments or chunks;
* ``cudnn packed (jax._src)``: cuDNN's own packed layout (per-document
  lengths and offsets) through ``jax._src.cudnn.fused_attention_stablehlo.
  dot_product_attention``, which jax.nn does not expose.

FLOPs: 4·D for every (query, key) pair that takes part, summed over rows,
heads and batch, counted exactly from the window, the documents and the
causal mask (:func:`visible_pairs`), ×3.5 for forward + backward.  Every
route of one problem is credited the same FLOPs, so their TFLOP/s are in the
ratio of their speeds; ``ours, no window`` is credited its own problem's
pairs (T·S, or T(T+1)/2 under causal, where the grid counts T·S/2).  The
speed-ups in the table are time ratios: a route's ms ÷ ``ours``' ms.
On the forward pass each route's output is compared with ``ours``' on the
first input set (max |Δ|), so a route that computes another problem shows.
"""

from __future__ import annotations

import dataclasses
import math

from harness.tools import bench_grid as bg
from kernel import key_ranges as variants

KEY = "windows_and_segments"          # performance.json: record["sections"][KEY]
NAME = "windows-segments"             # --sections
TITLE = "Local windows, packed segments and chunked attention"
WINDOW = 1024
WINDOW_SEQS = (8192, 16384)
PACKED_SEQ = 16384
PACKED_DOCUMENTS = (1100, 3000, 2200, 4000, 1500, 2584, 2000)
CHUNK = 2048
CHUNK_SEQ = 16384
HEAD_DIMS = (128,)

OURS = "ours"
NO_WINDOW = "ours, no window"
DENSE_MASK = "ours, dense mask"
ANY_LAYOUT = "ours, any layout"
# The segment-bounds method the API does not ship, timed beside it.
BOUNDS_ROUTES = {"runs": "ours, sort-free bounds", "searched": "ours, searched bounds"}
OTHER_BOUNDS_METHOD = next(m for m in BOUNDS_ROUTES if m != variants.SHIPPED_SEGMENT_BOUNDS)
OTHER_BOUNDS = BOUNDS_ROUTES[OTHER_BOUNDS_METHOD]
KEY_RANGES = "ours, key ranges"
CUDNN = "cudnn (jax.nn)"
CUDNN_PACKED = "cudnn packed (jax._src)"
ROUTES = (OURS, OTHER_BOUNDS, KEY_RANGES, NO_WINDOW, DENSE_MASK, ANY_LAYOUT, CUDNN,
          CUDNN_PACKED)

# The section's problems, in its order.
KINDS = ("window", "packed", "chunk")

# Why jax.nn (0.11.2) cannot hand chunked attention to cuDNN.
NO_CHUNKS_IN_JAX_NN = ("jax.nn.dot_product_attention has no attention_chunk; its "
                       "chunks reach cuDNN only as a dense mask")

# Why jax.nn (0.11.2) cannot hand packed segments to cuDNN.
NO_SEGMENTS_IN_JAX_NN = ("jax.nn.dot_product_attention has no segment ids; its "
                         "key_value_seq_lengths pads one sequence per batch row and "
                         "cannot pack several")


@dataclasses.dataclass(frozen=True)
class MaskedShape:
  """One problem of the section (a row of its table): a grid point's shapes
  (heads from the head dim, B = 16k tokens / seq, unless overridden) and
  the mask of its ``kind``, a window, packed documents or chunks."""
  kind: str                              # one of KINDS
  head_dim: int
  seq: int
  causal: bool
  window: int | None = None              # local_window_size (w, w)
  documents: tuple[int, ...] | None = None
  chunk: int | None = None               # attention_chunk
  batch_override: int | None = None      # small shapes for the CPU tests
  heads_override: int | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
    if self.kind == "packed" and sum(self.documents or ()) != self.seq:
      raise ValueError(f"documents: must sum to seq {self.seq}, got {self.documents}")

  @property
  def heads(self) -> int:
    return self.heads_override or bg.heads_for(self.head_dim)

  @property
  def batch(self) -> int:
    return self.batch_override or max(1, bg.TOKENS // self.seq)

  @property
  def kv_heads(self) -> int:
    return self.heads

  def label(self) -> str:
    what = {"window": lambda: f"window {self.window}",
            "packed": lambda: f"{len(self.documents)} documents",
            "chunk": lambda: f"chunks of {self.chunk}"}[self.kind]()
    return f"d{self.head_dim} {what} seq {self.seq}{' causal' if self.causal else ''}"


def masked_shapes(head_dims=HEAD_DIMS) -> list[MaskedShape]:
  out = [MaskedShape("window", d, s, c, window=WINDOW)
         for d in head_dims for c in (False, True) for s in WINDOW_SEQS]
  out += [MaskedShape("packed", d, PACKED_SEQ, True, documents=PACKED_DOCUMENTS)
          for d in head_dims]
  out += [MaskedShape("chunk", d, CHUNK_SEQ, True, chunk=CHUNK) for d in head_dims]
  return out


# ---------------------------------------------------------------------------
# What each problem computes: the pairs that take part.


def row_key_bounds(shape: MaskedShape, *, variant: bool = True):
  """Per query row i (NumPy, (T,)), the first and last key it sees (the
  keys in between all take part: a window, a document and the causal mask
  are each an interval); ``variant=False``: the problem without its window
  or documents."""
  import numpy as np
  t = shape.seq
  i = np.arange(t)
  first, last = np.zeros(t, np.int64), np.full(t, t - 1, np.int64)
  if variant and shape.kind == "window":
    first, last = np.maximum(first, i - shape.window), np.minimum(last, i + shape.window)
  if variant and shape.kind == "chunk":
    start = i // shape.chunk * shape.chunk
    first, last = np.maximum(first, start), np.minimum(last, start + shape.chunk - 1)
  if variant and shape.kind == "packed":
    edges = np.concatenate([[0], np.cumsum(shape.documents)])
    doc = np.repeat(np.arange(len(shape.documents)), shape.documents)
    first, last = edges[doc], edges[doc + 1] - 1
  if shape.causal:
    last = np.minimum(last, i)
  return first, last


def visible_pairs(shape: MaskedShape, *, variant: bool = True) -> int:
  """(query, key) pairs that take part, over batch and heads."""
  import numpy as np
  first, last = row_key_bounds(shape, variant=variant)
  return shape.batch * shape.heads * int(np.maximum(last - first + 1, 0).sum())


def flops(shape: MaskedShape, *, backward: bool, variant: bool = True) -> float:
  f = 4.0 * shape.head_dim * visible_pairs(shape, variant=variant)
  return f * (bg.BACKWARD_FLOP_FACTOR if backward else 1.0)


# ---------------------------------------------------------------------------
# The routes.


def aux_arrays(shape: MaskedShape) -> dict:
  """The arrays the routes read besides q, k, v, built on the default device
  (jit-fused, so the (T, S) masks are the only large buffers): the dense
  mask; for packed documents also the segment ids, each row's document as
  ``k_start`` / ``k_end`` (B, 1, T), and cuDNN's per-document lengths and
  offsets."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  t = shape.seq
  if shape.kind in ("window", "chunk"):
    w, size = shape.window, shape.chunk

    @jax.jit
    def dense_mask():   # (1, 1, T, S): row i, key j
      i = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, t), 2)
      j = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, t), 3)
      return (j >= i - w) & (j <= i + w) if size is None else i // size == j // size
    return {"mask": dense_mask()}
  docs = shape.documents
  ids = np.repeat(np.arange(len(docs), dtype=np.int32), docs)
  ids = jnp.asarray(np.broadcast_to(ids, (shape.batch, t)))
  starts = np.concatenate([[0], np.cumsum(docs)[:-1]]).astype(np.int32)
  row = lambda x: jnp.asarray(np.broadcast_to(x, (shape.batch, len(x))).astype(np.int32))
  mask = jax.jit(lambda ids: ids[:, None, :, None] == ids[:, None, None, :])(ids)
  # cuDNN's packed layout: per batch row the length of each document and its
  # offset, the offsets padded with -1 to one more entry than documents
  # (jax._src.cudnn.fused_attention_stablehlo.dot_product_attention).
  # Each row's document as its key range: the problem's own bounds, without
  # the causal mask (the route passes is_causal itself).
  first, last = row_key_bounds(dataclasses.replace(shape, causal=False))
  per_row = lambda x: jnp.asarray(np.broadcast_to(x.astype(np.int32), (shape.batch, 1, t)))
  return {"mask": mask, "ids": ids, "seqlen": row(np.asarray(docs)),
          "offsets": row(np.concatenate([starts, [-1]])),
          "k_start": per_row(first), "k_end": per_row(last + 1)}


def jax_nn_cudnn_refusal(shape: MaskedShape) -> str | None:
  """Why jax.nn.dot_product_attention (jax 0.11.2) cannot hand this problem
  to cuDNN, or None when it can: it has no segment ids, and it gives cuDNN a
  window only under causal or with a right size of 0 (cuDNN's sliding window
  looks left only); properties/tools/test_bench_windows_segments.py holds jax.nn
  to both."""
  if shape.kind == "packed":
    return NO_SEGMENTS_IN_JAX_NN
  if shape.kind == "chunk":
    return NO_CHUNKS_IN_JAX_NN
  if not shape.causal:
    return (f"jax.nn gives cuDNN a window only under causal or with right size 0; "
            f"({shape.window}, {shape.window}) without causal it refuses")
  return None


def route_functions(shape: MaskedShape) -> tuple[dict, dict]:
  """({route: f(q, k, v, aux) -> out}, {route: why it is not timed}) for
  ``shape``."""
  import jax
  from kernel import api, experiments
  c, w = shape.causal, shape.window
  fns, unavailable = {}, {}
  if shape.kind == "chunk":
    fns[OURS] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, is_causal=c, attention_chunk=shape.chunk)
    fns[DENSE_MASK] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, mask=aux["mask"], is_causal=c)
  elif shape.kind == "window":
    fns[OURS] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, is_causal=c, local_window_size=w)
    fns[NO_WINDOW] = lambda q, k, v, aux: api.dot_product_attention(q, k, v, is_causal=c)
    fns[DENSE_MASK] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, mask=aux["mask"], is_causal=c)
  else:
    fns[OURS] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, is_causal=c, q_segment_ids=aux["ids"], kv_segment_ids=aux["ids"])
    fns[DENSE_MASK] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, mask=aux["mask"], is_causal=c)
    fns[ANY_LAYOUT] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, is_causal=c, q_segment_ids=aux["ids"], kv_segment_ids=aux["ids"],
        segment_layout="any")
    fns[KEY_RANGES] = lambda q, k, v, aux: api.dot_product_attention(
        q, k, v, is_causal=c, k_start=aux["k_start"], k_end=aux["k_end"])
    fns[OTHER_BOUNDS] = lambda q, k, v, aux: experiments.dot_product_attention(
        q, k, v, is_causal=c, q_segment_ids=aux["ids"], kv_segment_ids=aux["ids"],
        segment_bounds=OTHER_BOUNDS_METHOD)
  refusal = jax_nn_cudnn_refusal(shape)
  if refusal is None:
    fns[CUDNN] = lambda q, k, v, aux: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, local_window_size=w, implementation="cudnn")
  else:
    unavailable[CUDNN] = refusal
  if shape.kind == "packed":
    fns[CUDNN_PACKED] = cudnn_packed_route(shape)
  return fns, unavailable


def cudnn_packed_route(shape: MaskedShape):
  """cuDNN's packed-document attention (private jax API), causal inside each
  document as the problem has it."""
  scale = 1.0 / math.sqrt(shape.head_dim)

  def packed(q, k, v, aux):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    mask_type = cudnn.MaskType.CAUSAL if shape.causal else cudnn.MaskType.NO_MASK
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=aux["seqlen"], kv_seqlen=aux["seqlen"], q_offsets=aux["offsets"],
        kv_offsets=aux["offsets"], scale=scale, mask_type=mask_type)
  return packed


def implementations(shape: MaskedShape, *, backward: bool) -> tuple[dict, dict]:
  """({route: jitted f(q, k, v[, d_out], aux)}, {route: why not timed}): the
  forward's output, or with ``backward`` (dq, dk, dv) of sum(out * d_out)
  through jax.vjp."""
  import jax
  routes, unavailable = route_functions(shape)

  def with_grad(route):
    if not backward:
      return route

    def grads(q, k, v, d_out, aux):
      _, pullback = jax.vjp(lambda q, k, v: route(q, k, v, aux), q, k, v)
      return pullback(d_out)
    return grads

  return {name: jax.jit(with_grad(f)) for name, f in routes.items()}, unavailable


# ---------------------------------------------------------------------------
# Timing.


def _agreement(fns: dict, inputs: tuple, timed) -> dict:
  """Max |out - ours' out| (float32) per timed route, on one input set."""
  import jax.numpy as jnp
  if OURS not in timed:
    return {}
  ours = fns[OURS](*inputs).astype(jnp.float32)
  out = {}
  for name in timed:
    if name in (OURS, NO_WINDOW):
      continue
    other = fns[name](*inputs).astype(jnp.float32)
    out[name] = float(jnp.max(jnp.abs(other - ours)))
  return out


def time_shape(shape: MaskedShape, *, backward: bool, dtype="bfloat16", sets: int = 3) -> dict:
  """One row: every route of ``shape`` timed interleaved."""
  import jax.numpy as jnp
  fns, unavailable = implementations(shape, backward=backward)
  aux = aux_arrays(shape)
  inputs = [x + (aux,) for x in bg._inputs(shape, jnp.dtype(dtype), sets, backward)]
  times, errors = bg.time_interleaved(fns, inputs)
  results = {}
  for name in ROUTES:
    if name in times:
      f = flops(shape, backward=backward, variant=name != NO_WINDOW)
      results[name] = dict(ms=times[name] * 1e3, tflops=f / times[name] / 1e12)
    elif name in errors:
      results[name] = dict(error=errors[name])
    elif name in unavailable:
      results[name] = dict(unavailable=unavailable[name])
  return dict(problem=shape.kind, head_dim=shape.head_dim, seq=shape.seq,
              causal=shape.causal, window=shape.window, documents=shape.documents,
              chunk=shape.chunk,
              batch=shape.batch, heads=shape.heads, dtype=dtype,
              pass_=bg.pass_name(backward),
              pairs=visible_pairs(shape), results=results,
              max_abs_diff_to_ours={} if backward else _agreement(fns, inputs[0], times))


def run(args, *, passes, log=print) -> list[dict]:
  """The section's rows, forward and/or forward + backward (``passes``:
  bench_grid.main's, from --backward / --backward-only), at the head dims of
  ``args.section_head_dims`` (None: HEAD_DIMS)."""
  head_dims = HEAD_DIMS if args.section_head_dims is None else tuple(
      int(d) for d in args.section_head_dims.split(","))
  rows = []
  for backward in passes:
    for shape in masked_shapes(head_dims):
      rows.append(time_shape(shape, backward=backward))
      new_kind = len(rows) == 1 or rows[-2]["problem"] != shape.kind
      log(render_table(rows[-1:], header=new_kind), flush=True)
  return rows


# ---------------------------------------------------------------------------
# Reporting.

# (route, target) pairs of issue 20: ours at least this many times faster.
TARGETS = {"window": ((NO_WINDOW, 4.0), (CUDNN, 1.0)),
           "packed": ((DENSE_MASK, 3.0), (CUDNN_PACKED, 1.0)),
           "chunk": ((DENSE_MASK, 3.0),)}


# Beside the targets: cuDNN's packed route against ours handed the same
# layout (both given the documents' offsets; ``ours`` finds them in the ids).
EQUAL_TERMS = {"packed": ((CUDNN_PACKED, KEY_RANGES),)}


def speedup(row: dict, route: str, base: str = OURS) -> float | None:
  """``route``'s ms ÷ ``base``'s ms, or None if either was not timed."""
  ours, other = row["results"].get(base, {}), row["results"].get(route, {})
  if "ms" in ours and "ms" in other:
    return other["ms"] / ours["ms"]
  return None


def _problem_cell(r: dict) -> str:
  if r["problem"] == "window":
    return f"window {r['window']}"
  if r["problem"] == "chunk":
    return f"chunks of {r['chunk']}"
  return f"{len(r['documents'])} documents"


def _cell(result: dict | None) -> str:
  if not result:
    return "-"
  if "ms" in result:
    return f"{result['ms']:.3f} ({result['tflops']:.0f})"
  return "n/a" if "unavailable" in result else "error"


def render_table(rows: list[dict], header: bool = True) -> str:
  """Markdown: one line per problem and pass; ms (TFLOP/s) per route, then
  each route's speed-up (its ms ÷ ours')."""
  names = [n for n in ROUTES if any(n in r["results"] for r in rows)]
  others = [n for n in names if n != OURS]
  lines = []
  if header:
    lines += bg.markdown_header(("pass", "D", "problem", "seq", "causal", "B", "N"),
                                names + [f"{n} ÷ ours" for n in others])
  for r in rows:
    ratios = []
    for n in others:
      x = speedup(r, n)
      ratios.append("-" if x is None else f"{x:.2f}")
    lines.append(bg.markdown_row(
        (r["pass_"], r["head_dim"], _problem_cell(r), r["seq"], "yes" if r["causal"] else "no",
         r["batch"], r["heads"]), [_cell(r["results"].get(n)) for n in names], ratios))
  return "\n".join(lines)


def render(section: dict) -> list[str]:
  """The section's Markdown (after its heading and provenance line)."""
  rows = section["rows"]
  lines = ["ms per call (TFLOP/s in brackets: 4·D per (query, key) pair that takes part, "
           "×3.5 for forward + backward, the same for every route of a problem; "
           "'ours, no window' is credited its own, window-free problem).  "
           "'X ÷ ours': X's ms over ours', the speed-up of ours.", ""]
  for r in rows:
    if r["seq"] != max(WINDOW_SEQS + (PACKED_SEQ, CHUNK_SEQ)):
      continue
    where = (f"- {r['pass_']}, d{r['head_dim']} {_problem_cell(r)}"
             f"{' causal' if r['causal'] else ''} at {r['seq']}: ")
    for route, target in TARGETS[r["problem"]]:
      x = speedup(r, route)
      if x is not None:
        lines.append(f"{where}{route} ÷ ours {x:.2f} "
                     f"(target ≥ {target:g}: {'met' if x >= target else 'NOT met'}).")
    for route, base in EQUAL_TERMS.get(r["problem"], ()):
      x = speedup(r, route, base)
      if x is not None:
        lines.append(f"{where}{route} ÷ {base} {x:.2f} (both handed the documents' "
                     f"offsets).")
  for kind in KINDS:  # a table each: their routes differ
    of_kind = [r for r in rows if r["problem"] == kind]
    if of_kind:
      lines += ["", render_table(of_kind)]
  lines.append("")
  notes = sorted({f"{n}: {res['unavailable']}" for r in rows for n, res in r["results"].items()
                  if "unavailable" in res})
  notes += sorted({f"{n} ({r['pass_']}, {_problem_cell(r)}, {r['seq']}): {res['error']}"
                   for r in rows for n, res in r["results"].items() if "error" in res})
  if notes:
    lines += ["Not timed:", ""] + [f"- {n}" for n in notes] + [""]
  diffs = [f"{_problem_cell(r)} {r['seq']}{' causal' if r['causal'] else ''} "
           f"d{r['head_dim']}: " + ", ".join(f"{n} {d:.3g}" for n, d in
                                            r["max_abs_diff_to_ours"].items())
           for r in rows if r.get("max_abs_diff_to_ours")]
  if diffs:
    lines += ["Forward output, max |route − ours| on the first input set (bf16):", ""]
    lines += [f"- {d}" for d in diffs] + [""]
  return lines


def panels(section: dict) -> list[bg.Panel]:
  """One panel per (pass, head dim, problem kind): a group per problem, a bar
  per route, ms per call."""
  rows = section["rows"]
  out = []
  for key in sorted({(r["pass_"], r["head_dim"], r["problem"]) for r in rows},
                    key=lambda k: (k[0], k[1], KINDS.index(k[2]))):
    sub = sorted((r for r in rows if (r["pass_"], r["head_dim"], r["problem"]) == key),
                 key=lambda r: (r["causal"], r["seq"]))
    names = [n for n in ROUTES if any("ms" in r["results"].get(n, {}) for r in sub)]
    groups = [f"{r['seq']}{' causal' if r['causal'] else ''}" for r in sub]
    series = {n: [r["results"].get(n, {}).get("ms", 0.0) for r in sub] for n in names}
    what = {"window": f"window {WINDOW}", "packed": "packed documents",
            "chunk": f"chunks of {CHUNK}"}[key[2]]
    out.append(bg.Panel(f"{key[0]}, head dim {key[1]}, {what}", groups, series,
                        "ms per call (lower is faster)", "{:.2f}"))
  return out
