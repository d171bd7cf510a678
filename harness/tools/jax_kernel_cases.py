"""JAX's own sm90 Pallas kernels (``jax.experimental.pallas.ops.gpu``) as
cases for ``python -m harness prove --kernel`` (harness/proofs/any_kernel.py),
at the configurations their own tests and benchmarks use.  The proof knows
none of them: these functions only call them, on abstract arguments.

``python -m harness prove --kernel harness.tools.jax_kernel_cases:attention``
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import pathlib
import sys
import tempfile

_COPIES = itertools.count()


def patched(module_name: str, edits) -> object:
  """A copy of the installed ``module_name`` with ``edits`` applied,
  imported from a temporary file: a defect or a rewrite written into their
  code, none of it stored here.  An edit is (anchor, replacement), the
  anchor found exactly once, or (anchor, replacement, n): found exactly n
  times, the first replaced (a block the file repeats)."""
  source = pathlib.Path(importlib.import_module(module_name).__file__).read_text()
  for anchor, replacement, *times in edits:
    expected = times[0] if times else 1
    found = source.count(anchor)
    if found != expected:
      raise ValueError(f"{module_name}: the anchor {anchor.strip()!r} occurs {found} times, "
                       f"not {expected} (the installed JAX changed?)")
    source = source.replace(anchor, replacement, 1)
  name = f"{module_name.rpartition('.')[2]}_copy{next(_COPIES)}"
  path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
  path.write_text(source)
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module   # where the tracing finds it (any_kernel.cpu_tracing)
  spec.loader.exec_module(module)
  return module


def _sds(shape, dtype):
  import jax
  return jax.ShapeDtypeStruct(shape, dtype)


ATTENTION = "jax.experimental.pallas.ops.gpu.attention_mgpu"


def attention(am=None) -> list:
  """attention_mgpu's forward (``am``: the module, or a patched copy of
  it), non-causal and causal, at two ring depths, with grouped kv heads."""
  import jax.numpy as jnp
  am = am or importlib.import_module(ATTENTION)
  out = []
  for causal in (False, True):
    for seq, steps in ((256, 2), (512, 3)):
      config = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=steps,
                               causal=causal)
      q, kv = _sds((1, seq, 2, 64), jnp.float16), _sds((1, seq, 1, 64), jnp.float16)
      out.append((f"attention_mgpu forward seq {seq} steps {steps}{' causal' if causal else ''}",
                  functools.partial(am.attention, config=config), (q, kv, kv)))
  return out


def attention_backward(am=None) -> list:
  """attention_mgpu's backward (its dK/dV and dQ kernels) through jax.grad
  (``am``: the module, or a patched copy of it)."""
  import jax
  import jax.numpy as jnp
  am = am or importlib.import_module(ATTENTION)
  config = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                           block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  q, kv = _sds((1, 256, 2, 64), jnp.float16), _sds((1, 256, 1, 64), jnp.float16)
  loss = lambda q, k, v: am.attention(q, k, v, config).astype(jnp.float32).sum()
  return [("attention_mgpu backward seq 256", jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv))]


# The H200's SMs: the persistent matmuls size their grid by the device's
# SM count, which a CPU device has none of.
H200_SMS = 132


def _on_sms(module, fn):
  """``fn`` with ``module``'s SM count read as the H200's while it traces
  (its ``get_num_sms``, or the device its ``backend`` gives)."""
  import types
  if hasattr(module, "get_num_sms"):
    name, stand_in = "get_num_sms", lambda: H200_SMS
  else:
    device = types.SimpleNamespace(core_count=H200_SMS)
    name, stand_in = "backend", types.SimpleNamespace(get_default_device=lambda: device)

  def call(*args):
    was = getattr(module, name)
    setattr(module, name, stand_in)
    try:
      return fn(*args)
    finally:
      setattr(module, name, was)
  return call


MATMUL = "jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu"


def hopper_matmul(hm=None) -> list:
  """hopper_matmul_mgpu (``hm``: the module, or a patched copy of it) at its
  benchmark's tile sizes, on small problems, on the H200's grid."""
  import jax.numpy as jnp
  hm = hm or importlib.import_module(MATMUL)
  out = []
  for tile_m, tile_n in ((128, 128), (256, 64)):
    config = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4)
    # K of 8 steps of tile_k on a ring of 4: every slot is refilled
    a, b = _sds((512, 512), jnp.float16), _sds((512, 512), jnp.float16)
    out.append((f"hopper_matmul_mgpu 512x512x512 tiles {tile_m}x{tile_n}",
                _on_sms(hm, lambda a, b, config=config: hm.matmul(a, b, None, config)), (a, b)))
  return out


# Defects written into attention_mgpu's forward: (edits, the violation the
# proof must report).
_K_LOADS = ("        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[i], k_barriers.at[i])\n"
            "        plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[i], v_barriers.at[i])\n")
# The forward's wait for its queries (the pipeline-emitter variant has its own).
_Q_WAIT = "      plgpu.barrier_wait(q_barriers.at[wg_idx])\n\n      m_i = plgpu.layout_cast(\n"
_REFILL = ("        plgpu.barrier_wait(k_consumed_barriers.at[tma_slot])\n"
           "        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[tma_slot], k_barriers.at[tma_slot])\n"
           "        plgpu.barrier_wait(v_consumed_barriers.at[tma_slot])\n")
ATTENTION_MUTANTS = {
    "value-wait-dropped": (
        [("          plgpu.barrier_wait(v_barriers.at[slot])\n", "          pass\n")],
        "read before copy completed"),
    "query-wait-dropped": (
        [(_Q_WAIT, "\n      m_i = plgpu.layout_cast(\n")],
        "read before copy completed"),
    "key-refill-without-release": (
        [("        plgpu.barrier_wait(k_consumed_barriers.at[tma_slot])\n", "")],
        "overwrite before release"),
    "value-refill-without-release": (
        [("        plgpu.barrier_wait(v_consumed_barriers.at[tma_slot])\n", "")],
        "overwrite before release"),
    "value-released-before-pv": (
        [("        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))\n"
          "        plgpu.barrier_arrive(v_consumed_barriers.at[slot])\n",
          "        plgpu.barrier_arrive(v_consumed_barriers.at[slot])\n"
          "        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))\n")],
        "overwrite before release"),
    "key-released-before-qk": (
        [("        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))\n"
          "        plgpu.barrier_arrive(k_consumed_barriers.at[slot])\n",
          "        plgpu.barrier_arrive(k_consumed_barriers.at[slot])\n"
          "        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))\n")],
        "overwrite before release"),
    "next-key-wait-on-this-slot": (
        [("            plgpu.barrier_wait(k_barriers.at[wait_slot])\n",
          "            plgpu.barrier_wait(k_barriers.at[slot])\n")],
        "parity alias"),
    "fence-before-store-dropped": (
        # the forward's, first of the two the file holds
        [("      plgpu.commit_smem()\n      plgpu.copy_smem_to_gmem(\n          qo_smem,",
          "      plgpu.copy_smem_to_gmem(\n          qo_smem,", 2)],
        "async-proxy ordering"),
}
# Rewrites of it that keep the protocol: each must prove.
ATTENTION_REWRITES = {
    "values-loaded-before-keys": [(_K_LOADS, _K_LOADS.split("\n", 1)[1] + _K_LOADS.split("\n", 1)[0] + "\n")],
    "both-releases-before-both-refills": [(_REFILL, (
        "        plgpu.barrier_wait(k_consumed_barriers.at[tma_slot])\n"
        "        plgpu.barrier_wait(v_consumed_barriers.at[tma_slot])\n"
        "        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[tma_slot], k_barriers.at[tma_slot])\n"))],
    "query-wait-after-the-registers-start": [
        (_Q_WAIT, "\n      m_i = plgpu.layout_cast(\n"),
        ("      @pl.when(kv_steps > 0)\n",
         "      plgpu.barrier_wait(q_barriers.at[wg_idx])\n\n      @pl.when(kv_steps > 0)\n")],
}


MIXED_MATMUL = "jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu"


def mixed_type_matmul(mm=None) -> list:
  """hopper_mixed_type_matmul_mgpu (``mm``: the module, or a patched copy of
  it): int8 by bfloat16, at its benchmark's tile sizes, on a small problem,
  on the H200's grid."""
  import jax.numpy as jnp
  mm = mm or importlib.import_module(MIXED_MATMUL)
  config = mm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
  a, b = _sds((512, 256), jnp.int8), _sds((256, 512), jnp.bfloat16)
  return [("hopper_mixed_type_matmul_mgpu 512x256x512 int8 x bfloat16",
           _on_sms(mm, lambda a, b: mm.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16,
                                                           config=config)), (a, b))]


# Defects written into hopper_matmul_mgpu, inside its use of emit_pipeline
# (the body's wgmma and the pipeline's release of its slots) and in its
# double-buffered epilogue: (edits, the violation the proof must report).
MATMUL_MUTANTS = {
    "pipeline-body-without-wgmma-wait": (
        [("        plgpu.wgmma_wait(delay_release)\n", "")],
        "overwrite before release"),
    "epilogue-slot-rewritten-under-its-store": (
        [("              plgpu.wait_smem_to_gmem(1, wait_read_only=True)\n", "")],
        "still reads"),
}
