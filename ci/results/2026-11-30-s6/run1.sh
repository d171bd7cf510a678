#!/usr/bin/env bash
# Session 6, device call 1: the private backward variants against the shipped
# (The tile-group and fold-scale variants it names exist at a00c7ef only.)
# one in one process (headline shape, non-causal and causal, with cuDNN), the
# backward's parts at the headline shape, then the gradient properties on
# pallas-diagonal-mask (named, reproducibility, drawn); every variant's
# (agreement on larger shapes).  bash ci/results/2026-11-30-s6/run1.sh OUTDIR
set -uo pipefail
dest="${1:?usage: run1.sh OUTDIR}"
mkdir -p "$dest"
export PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 \
  HYPOTHESIS_PROFILE=gpu
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout "$limit" "$@" > "$dest/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$dest/steps.txt"; }
{ nvidia-smi -L; python3 -c 'import jax; print("jax", jax.__version__)'; } > "$dest/device.txt" 2>&1
step bench 200 python3 -m harness.bench --shapes headline-both --backward --configs auto \
  --backward-impl pallas,pallas-diagonal-mask,pallas-tile-group-4,pallas-tile-group-8,pallas-fold-scale \
  --out "$dest/bench.json"
step parts 120 python3 -m harness.bench --shapes headline --backward-parts --out "$dest/parts.json"
step agreement 150 python3 ci/results/2026-11-30-s6/variant_agreement.py \
  pallas-tile-group-4 pallas-tile-group-8 pallas-fold-scale pallas-diagonal-mask
GRADIENT_BACKWARD=pallas-diagonal-mask step diag-named 150 python3 -m pytest -m gpu -rs \
  properties/test_gradients_gpu.py -k "named or reproducible"
GRADIENT_BACKWARD=pallas-diagonal-mask step diag-drawn 200 python3 -m pytest -n 4 -m gpu -rs \
  properties/test_gradients_gpu.py -k "float64"
