#!/usr/bin/env bash
# Produce the artifacts that only an H200 can: the autotune cache, the golden
# files, the named-case self-check and the headline benchmark.
#   bash ci/device/produce.sh OUTDIR [AUTOTUNE_SHAPES]
# Each step has its own time limit, so one hang cannot eat the whole run; the
# outputs land in OUTDIR for review before they are committed.
set -uo pipefail
out="${1:?usage: produce.sh OUTDIR [AUTOTUNE_SHAPES]}"
shapes="${2:-0,1,2,3}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t=$SECONDS
  timeout "$limit" "$@" > >(tee "$out/$name.log") 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$out/steps.txt"; }

{ nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'; git rev-parse HEAD 2>/dev/null; } > "$out/device.txt" 2>&1
step autotune 270 "$py" -m harness autotune --shapes "$shapes" --report "$out/autotune-report.json"
cp kernel/tiling/autotune_cache.json "$out/" 2>/dev/null
step golden-update 160 "$py" -m harness golden update
tar -cf "$out/golden.tar" golden
step device-check 130 "$py" -m harness.tools.device_check --variants persistent,non-persistent --out "$out/check.json"
step bench 80 "$py" -m harness.tools.bench --shapes headline --configs "auto;64,128,2,p;64,128,2" --out "$out/bench.json"
