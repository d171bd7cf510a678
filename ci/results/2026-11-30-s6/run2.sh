#!/usr/bin/env bash
# Session 6, device call 2, on the commit that ships the diagonal-only causal
# mask: the gate's GPU steps (gpu-properties, golden), the goldens
# regenerated, then benchmarks while the call's 10 minutes last: forward +
# backward on every default shape, and the headline forward, all with cuDNN
# in the same process.   bash ci/results/2026-11-30-s6/run2.sh OUTDIR
set -uo pipefail
dest="${1:?usage: run2.sh OUTDIR}"
mkdir -p "$dest"
bash ci/device/verify.sh "$dest" gpu-gate
export PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
left() { echo $((560 - SECONDS)); }
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  if [ "$limit" -le 10 ]; then echo "== $name: not run (no time left)" | tee -a "$dest/steps2.txt"; return; fi
  timeout "$limit" "$@" > "$dest/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$dest/steps2.txt"; }
step golden-update 120 python3 -m harness golden update
tar -cf "$dest/golden.tar" golden
step bench-backward-default 150 python3 -m harness.bench --shapes default --backward \
  --configs auto --out "$dest/bench-backward-default.json"
step bench-forward 60 python3 -m harness.bench --shapes headline --configs auto \
  --out "$dest/bench-forward.json"
