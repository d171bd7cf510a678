"""The CPU half of the mutant catalogue: every patched kernel lowers for CUDA,
and the patch changes the lowered program.

``python -m harness.tools.mutant_lowering [NAMES]`` (also ``python -m harness
mutants --lower``) prints one line per mutant and exits non-zero when any
patch fails to apply, fails to lower, or leaves the lowered program of its
probe unchanged.  The last is what makes a GPU kill meaningful: a patch the
probe's trace never reaches (dead code for that configuration, or an edit
the tracer folds away) would "survive" for a reason that says nothing about
the harness.  Equivalent mutants must lower; they may leave the program as
it was.

One process serves every mutant: for each, the package is copied to one
temporary folder, patched, and imported in place of the previous one
(``kernel`` and its submodules dropped from ``sys.modules``); jax itself is
imported once.  Each probe is traced and lowered for CUDA under
``kernel.api.lowering_only()`` (no GPU needed), and its jaxpr, which holds
the kernels' bodies, is compared with the unpatched one.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness.tools import mutants as catalogue

def _probe_specs() -> dict[str, tuple[dict, dict, dict, bool]]:
  """name: (shapes, API kwargs, operand shapes, with gradients).  Each one
  reaches the code of the mutants that name it (Mutant.probe)."""
  from kernel.tiling.config import Config
  base = dict(B=2, T=300, N=4, H=64, S=500, K=2, Hv=64)
  return {
      # Persistent, causal, GQA, threshold below 1, residuals, soft cap, key
      # ranges: most of the forward at once.
      "fwd": (base, dict(config=Config(64, 128, 2, True), is_causal=True,
                         rescale_threshold=0.5, return_residuals=True,
                         logits_soft_cap=20.0), dict(k_range_shape=(2, 4, 300)), False),
      # q read unpadded (a length of whole 8-row groups, not of whole tiles).
      "fwd-unpadded": (dict(base, T=296), dict(config=Config(64, 128, 2, True),
                                               return_residuals=True), {}, False),
      # A 2-D bias and mask staged through the ring with the keys.
      "fwd-staged": (base, dict(config=Config(64, 128, 2, False)),
                     dict(bias_shape=(1, 4, 300, 500), mask_shape=(2, 1, 300, 500)), False),
      "fwd-unnormalised": (base, dict(config=Config(64, 128, 2, False), rescale_threshold=0.5,
                                      normalize_output=False), {}, False),
      "fwd-threshold-1": (base, dict(config=Config(64, 128, 2, True), return_residuals=True),
                          {}, False),
      "fwd-f16": (base, dict(config=Config(64, 128, 2, False), rescale_threshold=0.0,
                             dtype="float16"), {}, False),
      "fwd-d72": (dict(base, H=72, Hv=96), dict(config=Config(64, 128, 2, False)), {}, False),
      # FP8: per-tensor descales, persistent, causal, residuals.
      "fwd-fp8": (base, dict(config=Config(64, 128, 2, True), is_causal=True,
                             return_residuals=True, dtype="float8_e4m3fn", q_descale=0.5,
                             k_descale=2.0, v_descale=0.25), {}, False),
      # A bias broadcast over the batch with its gradient (the dQ kernel,
      # which writes dS), a soft cap, GQA.
      "grad": (base, dict(logits_soft_cap=10.0), dict(bias_shape=(1, 4, 300, 500)), True),
      # Non-causal without a bias: dQ accumulated in the dK/dV kernel.
      "grad-fused": (base, {}, {}, True),
      # Causal at head dim 128 (the dQ kernel: kernel.tiling.backward_plan.blocks_for), GQA.
      "grad-causal": (dict(base, H=128, Hv=128), dict(is_causal=True), {}, True),
      # Head dim 256, causal, GQA: the head split of both backward kernels.
      "grad-d256": (dict(base, H=256, Hv=256), dict(is_causal=True), {}, True),
  }


def probe_text(name: str, *, lower: bool = True) -> str:
  """Probe ``name`` lowered for CUDA with the ``kernel`` package importable
  now (``lower``: False, traced only); returns its jaxpr as text (the
  kernels' bodies included).  The lowered MLIR itself cannot be compared:
  the serialised Mosaic GPU module differs between two lowerings of the
  same source."""
  import jax
  import jax.numpy as jnp
  from harness.tools import lowering
  from kernel import api
  shapes, kwargs, operands, gradients = _probe_specs()[name]
  kwargs = dict(kwargs)
  dt = jnp.dtype(kwargs.pop("dtype", "bfloat16"))
  target, args = lowering.abstract_call(
      api.dot_product_attention, shapes, dt,
      (("bias", operands.get("bias_shape"), dt), ("mask", operands.get("mask_shape"), jnp.bool_),
       ("k_start", operands.get("k_range_shape"), jnp.int32),
       ("k_end", operands.get("k_range_shape"), jnp.int32)),
      kwargs, gradients)
  with api.lowering_only():
    traced = jax.jit(target).trace(*args)
    if not lower:
      return str(traced.jaxpr)
    lowered = traced.lower(lowering_platforms=("cuda",)).as_text()
  if "mosaic_gpu" not in lowered:
    raise RuntimeError(f"probe {name}: no Mosaic GPU kernel in the lowered program")
  return str(traced.jaxpr)


def _use_package(root: Path) -> None:
  """Make ``root/kernel`` the package ``import kernel`` finds from now on
  (the modules already imported are dropped; no bytecode is written, so a
  patched file of the same size and second cannot be shadowed by a stale
  one)."""
  sys.dont_write_bytecode = True
  for mod in [m for m in sys.modules if m == "kernel" or m.startswith("kernel.")]:
    del sys.modules[mod]
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  importlib.invalidate_caches()


def check_lowering(chosen, *, out=print, lower_every: int = 1) -> list[str]:
  """Problems (empty when every mutant in ``chosen`` applies, lowers, and
  changes its probe's program, equivalent ones excepted from the last).

  Every variant, the shipped one too, is imported from the same path, so
  that nothing but the patch tells them apart.  ``lower_every``: only every
  that many-th mutant (the first, then on) is lowered; the others are
  traced, their programs compared all the same."""
  problems = []
  workdir = Path(tempfile.mkdtemp(prefix="mutant-lowering-"))
  pkg = workdir / "pkg"
  saved_path = list(sys.path)

  def install(mutant):
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(catalogue.REPO / "kernel", pkg / "kernel",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if mutant is not None:
      catalogue.apply(mutant, pkg)
    _use_package(pkg)

  try:
    control = {}
    install(None)
    for m in chosen:
      if m.probe not in control:
        # the shipped kernel's lowering is the lowering tests' (properties/kernel/test_lowering.py)
        control[m.probe] = probe_text(m.probe, lower=False)
    for i, m in enumerate(chosen):
      start = time.time()
      lower = i % lower_every == 0
      try:
        install(m)
        text = probe_text(m.probe, lower=lower)
      except Exception as err:  # noqa: BLE001 -- every failure is reported by name
        problems.append(f"{m.name}: {type(err).__name__}: {str(err)[:300]}")
        out(f"FAIL         {time.time() - start:5.1f}s {m.name} ({m.probe}): {problems[-1]}")
        continue
      changed = text != control[m.probe]
      if not changed and not m.equivalent:
        problems.append(f"{m.name}: the lowered program of probe {m.probe!r} is unchanged "
                        "(the patch is dead code there)")
      verdict = "changed" if changed else ("same (equiv)" if m.equivalent else "UNCHANGED")
      out(f"{verdict:12s} {time.time() - start:5.1f}s {m.name} ({m.probe})"
          + ("" if lower else ", traced, not lowered"))
  finally:
    for mod in [m for m in sys.modules if m == "kernel" or m.startswith("kernel.")]:
      del sys.modules[mod]
    sys.path[:] = saved_path
    shutil.rmtree(workdir, ignore_errors=True)
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m harness.tools.mutant_lowering")
  parser.add_argument("select", nargs="?", help="comma-separated mutant names (default: all)")
  parser.add_argument("--lower-every", type=int, default=1, metavar="N",
                      help="lower only every N-th mutant for CUDA, the first on (the others "
                           "are traced and compared all the same)")
  args = parser.parse_args(argv)
  if args.lower_every < 1:
    parser.error(f"--lower-every: expected a count of at least 1, got {args.lower_every}")
  chosen = catalogue.select(args.select, None)
  start = time.time()
  problems = check_lowering(chosen, lower_every=args.lower_every)
  ok, n = len(chosen) - len(problems), len(chosen)
  if args.lower_every == 1:
    print(f"{ok}/{n} mutants apply, lower for CUDA and change their probe's program "
          f"({time.time() - start:.0f} s)")
  else:
    print(f"{ok}/{n} mutants apply and change their probe's program, "
          f"{len(range(0, n, args.lower_every))} of them lowered for CUDA (one in "
          f"{args.lower_every}) ({time.time() - start:.0f} s)")
  for p in problems:
    print("  " + p)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
