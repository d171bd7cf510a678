#!/usr/bin/env bash
# Regenerate the performance pages on an H200, by the commands the pages
# name, in two calls of under 10 minutes each (back to back while the machine
# is warm):
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR forward
#     OUTDIR/docs/performance.*: the forward grid, then its section of local
#     windows and packed documents (forward and forward + backward);
#     OUTDIR/gqa4/performance.*: the forward, causal, d128, GQA 4 (docs/gqa4);
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR backward
#     OUTDIR/backward/performance.*: the forward + backward grid, default and
#     deterministic=True.
# Each starts from the committed page, so what a run does not time keeps its
# own provenance (bench --grid --out-dir).  Copy OUTDIR/docs/* over docs/,
# OUTDIR/gqa4/* over docs/gqa4/ and OUTDIR/backward/* over docs/backward/,
# review, commit.  OUTDIR also gets steps.txt (the device, each step's exit
# and seconds) and log.txt; eight files at most, as a device call returns.  FLASH_COMMIT names the measured
# commit (a copied tree may carry no .git).  properties/test_device_scripts.py
# checks that these are the commands the committed pages name.
set -uo pipefail
out="${1:?usage: pages.sh OUTDIR forward|backward}"
part="${2:?usage: pages.sh OUTDIR forward|backward}"
case "$part" in forward|backward) ;;
  *) echo "pages.sh: part must be forward or backward, got '$part'" >&2; exit 2 ;;
esac
commit="${FLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
mkdir -p "$out"
{ nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'; echo "commit $commit"; } \
  >> "$out/steps.txt" 2>&1
# The committed pages are the H200's: on another GPU nothing is timed (bench
# --grid itself refuses to mix devices on a page, not to replace a whole one).
if ! nvidia-smi -L 2>/dev/null | grep -q "H200"; then
  echo "pages.sh: the pages are the H200's; this machine has: $(nvidia-smi -L 2>&1 | head -1)" \
    | tee -a "$out/steps.txt" >&2
  exit 3
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name" | tee -a "$out/log.txt"; local t=$SECONDS
  timeout "$limit" "$@" > >(tee -a "$out/log.txt") 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$out/steps.txt"; }

if [ "$part" = forward ]; then
  mkdir -p "$out/docs" && cp docs/performance.json docs/performance.md docs/performance.png "$out/docs/"
  # 116 s on the H200 (2026-12-05); the section with its backward after it.
  step forward-grid 300 "$py" -m harness bench --grid --no-example --out-dir "$out/docs" \
    --commit "$commit"
  step windows-segments 270 "$py" -m harness bench --grid --sections windows-segments --backward \
    --out-dir "$out/docs" --commit "$commit"
  mkdir -p "$out/gqa4" && cp docs/gqa4/performance.json docs/gqa4/performance.md \
    docs/gqa4/performance.png "$out/gqa4/"
  step gqa4 120 "$py" -m harness bench --grid --no-example --gqa 4 --head-dims 128 --causal-only \
    --commit "$commit" --out-dir "$out/gqa4"
else
  mkdir -p "$out/backward" && cp docs/backward/performance.json docs/backward/performance.md \
    docs/backward/performance.png "$out/backward/"
  step backward-grid 570 "$py" -m harness bench --grid --backward-only --no-example --no-ragged \
    --seqs 1024,4096,16384 --variants "auto;auto,det" --out-dir "$out/backward" --commit "$commit"
fi
