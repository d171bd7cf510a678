#!/usr/bin/env bash
# Try a backward variant (a kernel.experiments.BACKWARDS name) on an H200 in one call,
# before it ships: the GPU gradient properties on it, then forward + backward
# timed against the shipped backward and cuDNN in one process (the headline
# shape, non-causal and causal), then ptxas's
# register and spill report for its kernels.
#   bash ci/device/compare-backward.sh OUTDIR VARIANT [TESTS]
# TESTS: a pytest -k expression of the variant's own tests in
# properties/gpu/test_gradients_gpu.py, run with the named cases.  The
# backward's copies through untiled views, at lengths no multiple of 8
# (docs/decisions/backward-untiled-copies.md):
#   bash ci/device/compare-backward.sh OUTDIR pallas-untiled untiled
# Every step has its own time limit, so a variant that hangs on the GPU ends
# the step (exit 124 in steps.txt) instead of the device call.
set -uo pipefail
usage="usage: compare-backward.sh OUTDIR VARIANT [TESTS]"
dest="${1:?$usage}"
variant="${2:?$usage}"
tests="${3:+ or ($3)}"
out="$(mktemp -d)/compare"
mkdir -p "$out" "$dest"
source "$(dirname "$0")/steps.sh"

record_device
# A hang shows first on the small named cases; the drawn cases follow only
# when those pass.
if GRADIENT_BACKWARD="$variant" step gradients-named 240 "$py" -m pytest -m gpu -rs \
     properties/gpu/test_gradients_gpu.py -k "named or reproducible$tests" --junitxml "$out/named.xml"; then
  GRADIENT_BACKWARD="$variant" step gradients-drawn 240 "$py" -m pytest -n 4 -m gpu -rs \
    properties/gpu/test_gradients_gpu.py -k "float64" --junitxml "$out/drawn.xml"
  step bench 150 "$py" -m harness.tools.bench --shapes headline-both --backward --configs auto \
    --backward-impl "pallas,$variant" --out "$out/bench-backward.json"
fi
# ptxas's report for the variant's kernels, compiled once on the headline shape.
dump="$out/ptxas"
mkdir -p "$dump"
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dump" step ptxas 90 "$py" -c "
import jax, jax.numpy as jnp
from kernel import experiments
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(s, (2, 4096, 16, 128), jnp.bfloat16) for s in ks)
f = lambda q, k, v: experiments.dot_product_attention(q, k, v, backward='$variant').astype(jnp.float32).sum()
jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
print('compiled and ran')"
grep -rh -i "spill\|registers" "$dump" 2>/dev/null | sort | uniq -c > "$out/ptxas-summary.txt"
cp "$out/steps.txt" "$out/ptxas-summary.txt" "$dest/" 2>/dev/null
tar -czf "$dest/compare.tgz" -C "$(dirname "$out")" compare
