#!/usr/bin/env bash
# Verify HEAD on an H200 in one call: the whole gate, then the headline
# benchmarks (forward, forward + backward, and a 2-D bias unstaged/staged),
# each side by side with cuDNN in the same process.
#   bash ci/device/verify.sh OUTDIR [all|gate|gpu-gate|bench]
# "gpu-gate" runs only the gate's GPU steps (gpu-properties, golden; ~4.5 of
# the gate's 8 minutes): for when the CPU steps passed on the same commit
# elsewhere (`bash ci/tox.sh -e gate` here) and device time is short.
# "all" takes the gate's 6.5 to 8 minutes (H200, 2026-11-30) plus the
# benchmarks; where one command may run only 10 minutes, run "gate" and
# "bench" as two commands, back to back while the machine is still warm.
# FLASH_COMMIT=<commit> names the measured commit in the summary (a copied
# tree may carry no .git).
# Wheels in .whl/, when that folder is present, are installed first (for a
# dependency the machine lacks).  Each step has its own time limit.
set -uo pipefail
dest="${1:?usage: verify.sh OUTDIR [all|gate|gpu-gate|bench]}"
part="${2:-all}"
case "$part" in all|gate|gpu-gate|bench) ;;
  *) echo "verify.sh: part must be all, gate, gpu-gate or bench, got '$part'" >&2; exit 2 ;;
esac
# Everything goes to a work folder, packed into OUTDIR/verify.tgz at the end
# (the device returns only a few files), with the summaries beside it.
out="$(mktemp -d)/verify"
mkdir -p "$out" "$dest"
if ls .whl/*.whl >/dev/null 2>&1; then
  site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
py="${PYTHON:-python3}"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t=$SECONDS
  timeout "$limit" "$@" > >(tee "$out/$name.log") 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$out/steps.txt"; }

{ nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'; } > "$out/device.txt" 2>&1
if [ "$part" = all ] || [ "$part" = gate ]; then
  # The gate took 386 to 480 s on the H200 (2026-11-30; the GPU properties
  # vary most): 570 s leaves room for that spread inside a 600 s command.
  step gate 570 "$py" -m harness gate --results "$out/gate" -- -rs
fi
if [ "$part" = gpu-gate ]; then
  step gate 400 "$py" -m harness gate --results "$out/gate" --steps gpu-properties,golden -- -rs
fi
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
