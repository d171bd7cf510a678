"""Session-4 A/B on the H200, one process per part (python ab.py PART OUTDIR):

  check   the new variants against the shipped ones: forward with the
          FlashAttention-3 softmax overlap must be bitwise equal to the
          shipped forward (out, m, l) over a grid of features; the deferred
          fused dQ against the eager one and the two-kernel backward
          (dk, dv bitwise; dq within harness.tolerance.run_to_run_bound).
  time    interleaved timings at the headline shape (bf16 B4 S4096 N16 D128),
          cuDNN in the same process: forward variants, the JAX example
          kernel's forward, the backward kernels alone, the pieces of the
          backward outside the kernels, forward + backward variants.
"""
import dataclasses, json, math, sys, time, traceback

import jax
import jax.numpy as jnp
import numpy as np

from harness import bench, tolerance
from kernel import api, backward as bwd, plan as plan_lib
from kernel.config import Config

part, out_dir = sys.argv[1], sys.argv[2]
report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "part": part}


def save():
  with open(f"{out_dir}/ab-{part}.json", "w") as fh:
    json.dump(report, fh, indent=1, default=str)


def rnd(key, shape, dtype=jnp.bfloat16, scale=1.0):
  return (scale * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)).astype(dtype)


def check_forward():
  rows = []
  cases = [
      dict(B=2, T=1024, S=1024, N=4, K=4, H=128, kw=dict()),
      dict(B=2, T=1024, S=1024, N=4, K=4, H=128, kw=dict(is_causal=True)),
      dict(B=1, T=777, S=1501, N=4, K=2, H=128, kw=dict(is_causal=True, rescale_threshold=0.5)),
      dict(B=1, T=300, S=1000, N=2, K=1, H=64, kw=dict(logits_soft_cap=5.0)),
      dict(B=1, T=512, S=640, N=2, K=2, H=256, kw=dict()),
      dict(B=1, T=512, S=2048, N=4, K=4, H=128, kw=dict(config=Config(64, 128, 2, persistent=True))),
      dict(B=1, T=1024, S=1024, N=4, K=4, H=128,
           kw=dict(is_causal=True, config=Config(64, 128, 2, persistent=True),
                   rescale_threshold=0.25)),
      dict(B=1, T=640, S=896, N=2, K=2, H=128, kw=dict(bias="2d", mask="2d")),
      dict(B=1, T=640, S=896, N=2, K=2, H=128, kw=dict(k_range=True, normalize_output=False)),
  ]
  for i, c in enumerate(cases):
    kw = dict(c["kw"])
    q = rnd(10 * i, (c["B"], c["T"], c["N"], c["H"]), scale=2.0)
    k = rnd(10 * i + 1, (c["B"], c["S"], c["K"], c["H"]), scale=2.0)
    v = rnd(10 * i + 2, (c["B"], c["S"], c["K"], c["H"]))
    bias = mask = None
    if kw.pop("bias", None):
      bias = rnd(10 * i + 3, (c["B"], c["N"], c["T"], c["S"]))
    if kw.pop("mask", None):
      mask = jax.random.bernoulli(jax.random.PRNGKey(10 * i + 4), 0.8, (c["B"], c["N"], c["T"], c["S"]))
    if kw.pop("k_range", None):
      ks = jax.random.randint(jax.random.PRNGKey(10 * i + 5), (c["B"], c["N"], c["T"]), 0, 300)
      kw["k_start"], kw["k_end"] = ks, ks + 400
    res = {}
    for ov in (False, True):
      f = jax.jit(lambda q, k, v, b, m, ov=ov: api.dot_product_attention(
          q, k, v, b, m, return_residuals=True, _softmax_overlap=ov, **kw))
      out, (mm, ll) = f(q, k, v, bias, mask)
      res[ov] = [np.asarray(x.astype(jnp.float32)) for x in (out, mm, ll)]
    same = [bool(np.array_equal(a, b, equal_nan=True)) for a, b in zip(res[False], res[True])]
    diff = [float(np.nanmax(np.abs(a - b))) if a.size else 0.0 for a, b in zip(res[False], res[True])]
    rows.append(dict(case=i, desc={k_: str(v_) for k_, v_ in c.items() if k_ != "kw"} | {"kw": str(c["kw"])},
                     bitwise_out_m_l=same, max_abs_diff=diff,
                     finite=bool(np.isfinite(res[True][0]).all())))
    print("fwd", i, same, diff, flush=True)
  report["forward_overlap_vs_shipped"] = rows


def check_backward():
  rows = []
  cases = [
      dict(B=2, T=1024, S=1024, N=4, K=4, H=128, causal=False),
      dict(B=1, T=1024, S=1024, N=4, K=2, H=128, causal=True),
      dict(B=1, T=333, S=777, N=4, K=1, H=64, causal=False),
      dict(B=1, T=1000, S=300, N=2, K=2, H=128, causal=True),
      dict(B=1, T=64, S=64, N=1, K=1, H=128, causal=False),
  ]
  for i, c in enumerate(cases):
    q = rnd(100 + i, (c["B"], c["T"], c["N"], c["H"]))
    k = rnd(200 + i, (c["B"], c["S"], c["K"], c["H"]))
    v = rnd(300 + i, (c["B"], c["S"], c["K"], c["H"]))
    do = rnd(400 + i, (c["B"], c["T"], c["N"], c["H"]), jnp.float32)
    g = {}
    for impl in ("pallas", "pallas-eager", "pallas-two-kernel"):
      fn = jax.jit(bench._with_backward(lambda q, k, v, b, impl=impl: api.dot_product_attention(
          q, k, v, b, is_causal=c["causal"], _backward=impl)))
      g[impl] = [np.asarray(x.astype(jnp.float32)) for x in fn(q, k, v, None, do)]
      g[impl + "#2"] = [np.asarray(x.astype(jnp.float32)) for x in fn(q, k, v, None, do)] \
          if impl == "pallas" else None
    ref = g["pallas-two-kernel"]
    row = dict(case=i, desc=str(c))
    for impl in ("pallas", "pallas-eager", "pallas#2"):
      dq, dk, dv = g[impl]
      row[impl] = dict(dk_bitwise=bool(np.array_equal(dk, ref[1])),
                       dv_bitwise=bool(np.array_equal(dv, ref[2])),
                       dq_vs_two_kernel=tolerance.run_to_run_bound(dq, ref[0], jnp.bfloat16),
                       dq_max_abs=float(np.max(np.abs(dq - ref[0]))),
                       finite=bool(np.isfinite(dq).all()))
    rows.append(row)
    print("bwd", i, json.dumps(row), flush=True)
  report["backward_deferred"] = rows


def compiled(fns, inputs):
  ok = {}
  for n, fn in fns.items():
    t = time.time()
    try:
      jax.block_until_ready(fn(*inputs[0])); ok[n] = fn
      print(f"  ran {n} in {time.time() - t:.1f}s", flush=True)
    except Exception as e:
      report.setdefault("errors", {})[n] = repr(e)[:300]
  return ok


def time_all():
  shape = bench.DEFAULT_SHAPES[0]
  inputs = bench._inputs(shape, 3)
  flops = shape.flops
  scale = 1 / math.sqrt(shape.head_dim)
  if part == "time-bwd":
    return time_backward(shape, inputs, flops, scale)
  # 1. forward variants + JAX example kernel + cuDNN
  from jax.experimental.pallas.ops.gpu import attention_mgpu as ex
  fns = {"cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))}
  for name, cfg in (("auto", None), ("64,128,2,p", Config(64, 128, 2, persistent=True))):
    for ov in (False, True):
      fns[f"ours {name} overlap={ov}"] = jax.jit(
          lambda q, k, v, cfg=cfg, ov=ov: api.dot_product_attention(q, k, v, config=cfg, _softmax_overlap=ov))
  scale = 1 / math.sqrt(shape.head_dim)
  fns["jax example 64,128,2 (q pre-scaled)"] = jax.jit(lambda q, k, v: ex.attention(
      q, k, v, ex.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)))
  ok = {}
  for n, fn in fns.items():
    try:
      jax.block_until_ready(fn(*inputs[0])); ok[n] = fn
    except Exception as e:
      report.setdefault("errors", {})[n] = repr(e)[:300]
  t = bench.time_fns(ok, inputs)
  report["forward_tflops"] = {n: flops / s / 1e12 for n, s in t.items()}
  report["forward_ms"] = {n: s * 1e3 for n, s in t.items()}
  print(json.dumps(report["forward_tflops"], indent=1), flush=True); save()


def time_backward(shape, inputs, flops, scale):
  # 2. backward kernels alone and the pieces outside them
  f = bwd.BackwardFeatures(scale=scale, is_causal=False, logits_soft_cap=None,
                           seq_q=shape.seq, seq_kv=shape.seq)
  blocks = bwd.blocks_for(128, 128)
  binputs = []
  for i, (q, k, v) in enumerate(inputs):
    do = jax.random.normal(jax.random.PRNGKey(100 + i), q.shape, jnp.float32).astype(q.dtype)
    out, (m, l) = api.dot_product_attention(q, k, v, return_residuals=True)
    binputs.append((q, k, v, do, out, m, l, bwd.residual_rows(m, l, out, do, shape.seq)))

  def fused(sched):
    def fn(q, k, v, do, out, m, l, rows):
      acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
      r = bwd.dkv_call(q, k, v, do, rows, None, None, None, None, f=f, blocks=blocks,
                       outputs=("dk", "dv"), dq_accum=acc, dq_schedule=sched)
      return r, acc[...]
    return jax.jit(fn)

  fns = {
      "forward+residuals": jax.jit(lambda q, k, v, do, out, m, l, rows: api.dot_product_attention(
          q, k, v, return_residuals=True)),
      "forward+residuals overlap": jax.jit(lambda q, k, v, do, out, m, l, rows: api.dot_product_attention(
          q, k, v, return_residuals=True, _softmax_overlap=True)),
      "dkv": jax.jit(lambda q, k, v, do, out, m, l, rows: bwd.dkv_call(
          q, k, v, do, rows, None, None, None, None, f=f, blocks=blocks, outputs=("dk", "dv"))),
      "dkv+fused-dq eager": fused("eager"),
      "dkv+fused-dq deferred": fused("deferred"),
      "residual_rows": jax.jit(lambda q, k, v, do, out, m, l, rows: bwd.residual_rows(m, l, out, do, shape.seq)),
      "zeros f32 dq": jax.jit(lambda q, k, v, do, out, m, l, rows: jnp.zeros(q.shape, jnp.float32) + 0 * rows[0, 0, 0, 0]),
      "dq finish cast": jax.jit(lambda q, k, v, do, out, m, l, rows: (q.astype(jnp.float32) * scale).astype(q.dtype)),
      "backward (api, deferred)": jax.jit(lambda q, k, v, do, out, m, l, rows: bwd.attention_backward(
          q, k, v, None, None, None, None, out, m, l, do, scale=scale)),
      "backward (api, eager)": jax.jit(lambda q, k, v, do, out, m, l, rows: bwd.attention_backward(
          q, k, v, None, None, None, None, out, m, l, do, scale=scale, dq_schedule="eager")),
  }
  t = bench.time_fns(compiled(fns, binputs), binputs, trials=8, burst=20)
  report["backward_parts_ms"] = {n: s * 1e3 for n, s in t.items()}
  print(json.dumps(report["backward_parts_ms"], indent=1), flush=True); save()

  # 3. forward + backward
  ins = [(q, k, v, None, jax.random.normal(jax.random.PRNGKey(100 + i), q.shape, jnp.float32))
         for i, (q, k, v) in enumerate(inputs)]
  fns = {"cudnn": jax.jit(bench._with_backward(lambda q, k, v, b: jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn")))}
  for impl in ("pallas", "pallas-eager"):
    for ov in (False, True):
      fns[f"{impl} overlap={ov}"] = jax.jit(bench._with_backward(
          lambda q, k, v, b, impl=impl, ov=ov: api.dot_product_attention(
              q, k, v, b, _backward=impl, _softmax_overlap=ov)))
  t = bench.time_fns(compiled(fns, ins), ins, trials=8, burst=20)
  report["fwd_bwd_tflops"] = {n: 3.5 * flops / s / 1e12 for n, s in t.items()}
  report["fwd_bwd_ms"] = {n: s * 1e3 for n, s in t.items()}
  print(json.dumps(report["fwd_bwd_tflops"], indent=1), flush=True)


try:
  if part == "check":
    check_backward(); save(); check_forward()
  else:
    time_all()
except Exception:
  report["exception"] = traceback.format_exc()
  print(report["exception"], flush=True)
save()
