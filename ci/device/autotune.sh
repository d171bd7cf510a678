#!/usr/bin/env bash
# Fill the shipped autotune cache on an H200, a budget at a time:
#   bash ci/device/autotune.sh OUTDIR [BUDGET_S] [CANDIDATES]
# Tunes `python -m harness autotune --coverage` (most-used signatures first,
# those already cached over the same candidates skipped) into a copy of
# kernel/tiling/autotune_cache.json under OUTDIR, written after every signature, so a
# command stopped by its time limit still leaves each finished signature
# there.  Copy OUTDIR/autotune_cache.json over kernel/tiling/autotune_cache.json,
# review, commit, and run again until the dry run (`--dry-run`, no GPU) says
# nothing is left.  BUDGET_S (default 480) leaves a 10-minute command room for
# start-up and the first signature, which has no estimate yet.  CANDIDATES
# (';'-separated, as `--candidates` takes them) times that short list beside
# the heuristic's pick and keeps every signature already cached
# (`--keep-cached`): the whole coverage set in about half an hour.
set -uo pipefail
out="${1:?usage: autotune.sh OUTDIR [BUDGET_S]}"
budget="${2:-480}"
short=()
if [ -n "${3:-}" ]; then short=(--candidates "$3" --keep-cached); fi
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
{ nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'; } > "$out/device.txt" 2>&1
cp kernel/tiling/autotune_cache.json "$out/autotune_cache.json"
"$py" -m harness autotune --coverage --budget-s "$budget" ${short[@]+"${short[@]}"} \
  --cache "$out/autotune_cache.json" \
  --report "$out/autotune-report.json" 2>&1 | tee "$out/autotune.log"
