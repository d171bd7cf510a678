#!/usr/bin/env bash
# Verify HEAD on an H200: the gate, then the headline benchmarks (forward,
# forward + backward, and a 2-D bias unstaged/staged), each side by side
# with cuDNN in the same process.
#   bash ci/device/verify.sh OUTDIR [all|gate|gpu-gate|gpu-properties|golden|smoke|bench] [K/N]
# Where one command may run only 10 minutes, run the GPU steps as separate
# commands, back to back while the machine is still warm:
#   "gpu-properties 1/2", "gpu-properties 2/2" (part K of N of the GPU
#   properties, the gate's --part), then "golden" (their times:
#   docs/decisions/device-step-time-limits.md); "gpu-gate" (both steps in
#   one command, some 15 minutes) and "gate"/"all" fit no such command.
# "smoke" runs the gate's smoke step alone (one call of every shipped path
# against float64, properties/gpu/test_smoke_gpu.py): first, where the GPU
# time may not reach the whole gate.
# FLASH_COMMIT=<commit> names the measured commit in the summary (a copied
# tree may carry no .git).
# Wheels in .whl/, when that folder is present, are installed first (for a
# dependency the machine lacks).  Each step has its own time limit.
set -uo pipefail
dest="${1:?usage: verify.sh OUTDIR [all|gate|gpu-gate|gpu-properties|golden|smoke|bench] [K/N]}"
part="${2:-all}"
slice="${3:-}"
case "$part" in all|gate|gpu-gate|gpu-properties|golden|smoke|bench) ;;
  *) echo "verify.sh: part must be all, gate, gpu-gate, gpu-properties, golden, smoke or" \
       "bench, got '$part'" >&2; exit 2 ;;
esac
# Everything goes to a work folder, packed into OUTDIR/verify.tgz at the end
# (the device returns only a few files), with the summaries beside it.
out="$(mktemp -d)/verify"
mkdir -p "$out" "$dest"
source "$(dirname "$0")/steps.sh"
use_wheels

record_device
if [ "$part" = all ] || [ "$part" = gate ]; then
  # Outgrown (see the head): this limit fits a 600 s command, so a run
  # that outgrows it fails by name (docs/decisions/device-step-time-limits.md).
  step gate 570 "$py" -m harness gate --results "$out/gate" -- -rs
fi
case "$part" in
  gpu-gate) step gate 570 "$py" -m harness gate --results "$out/gate" \
              --steps gpu-properties,golden -- -rs ;;
  gpu-properties|golden|smoke) step gate 570 "$py" -m harness gate --results "$out/gate" \
                                 --steps "$part" ${slice:+--part "$slice"} -- -rs ;;
esac
if [ "$part" = all ] || [ "$part" = bench ]; then
  step bench-forward 50 "$py" -m harness.tools.bench --shapes headline --configs "auto;64,128,2,p;64,128,2" \
    --out "$out/bench-forward.json"
  # The shipped backward (fused dQ) against the two-kernel one, in one process,
  # non-causal and causal.
  step bench-backward 150 "$py" -m harness.tools.bench --shapes headline-both --backward --configs auto \
    --backward-impl pallas,pallas-two-kernel --out "$out/bench-backward.json"
  # A 2-D bias staged through the ring (the default) against read from
  # global memory (kernel.experiments' stage_2d=False), in one process.
  step bench-bias-staging 70 "$py" -m harness.tools.bench --shapes headline --bias-2d \
    --configs "auto;auto,u" --out "$out/bench-bias-staging.json"
fi
cp "$out/steps.txt" "$dest/" 2>/dev/null
cp "$out/gate/summary.md" "$dest/gate-summary.md" 2>/dev/null
tar -czf "$dest/verify.tgz" -C "$(dirname "$out")" verify
