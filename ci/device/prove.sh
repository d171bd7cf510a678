#!/usr/bin/env bash
# The cold protocol proof on a GPU gate host, in one call: `python -m
# harness prove` with an empty cache, one worker per CPU, timed (the
# budget: docs/decisions/prove-cold-time.md).  The proof runs on the CPU;
# it needs z3-solver, which a runner without it takes from Z3_SITE (a
# folder holding the z3 package, added to PYTHONPATH) or from wheels in
# .whl/ (installed first, as verify.sh does).
#   FLASH_COMMIT=<commit> [Z3_SITE=DIR] bash ci/device/prove.sh OUTDIR
# OUTDIR gets steps.txt, device.txt (with the CPU count) and prove.txt.
set -uo pipefail
dest="${1:?usage: prove.sh OUTDIR}"
out="$(mktemp -d)/prove"
mkdir -p "$out" "$dest"
source "$(dirname "$0")/steps.sh"
if [ -n "${Z3_SITE:-}" ]; then
  export PYTHONPATH="$(cd "$Z3_SITE" && pwd):$PYTHONPATH"
else
  use_wheels
fi
record_device
echo "cpus $(nproc)" >> "$out/device.txt"
# an empty cache of its own: the cold run a fresh clone makes
export HARNESS_PROVE_CACHE="$(mktemp -d)"
step prove 580 "$py" -m harness prove
cp "$out/steps.txt" "$out/device.txt" "$dest/"
cp "$out/prove.log" "$dest/prove.txt"
