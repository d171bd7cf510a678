#!/usr/bin/env bash
# Session 6, device call 5, on the commit where causal takes the dQ kernel:
# forward + backward headline non-causal and causal against the two-kernel
# variant and cuDNN, then the gate's GPU steps.  bash run5.sh OUTDIR
set -uo pipefail
dest="${1:?usage: run5.sh OUTDIR}"
mkdir -p "$dest"
PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 -m harness.bench \
  --shapes headline-both --backward --configs auto --backward-impl pallas,pallas-two-kernel \
  --out "$dest/bench-backward.json" > "$dest/bench-backward.log" 2>&1
echo "== bench: exit $?" >> "$dest/steps5.txt"
bash ci/device/verify.sh "$dest" gpu-gate
