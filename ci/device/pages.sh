#!/usr/bin/env bash
# Regenerate the performance pages by the commands the pages name, each part
# one call of under 10 minutes (back to back while the machine is warm):
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR forward     (an H200)
#     OUTDIR/docs/performance.*: the forward grid, then its section of local
#     windows and packed documents (forward and forward + backward);
#     OUTDIR/gqa4/performance.*: the forward, causal, d128, GQA 4 (docs/gqa4);
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR backward    (an H200)
#     OUTDIR/backward/performance.*: the forward + backward grid, default and
#     deterministic=True;
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR h100        (an H100)
#     OUTDIR/h100/performance.*: the forward grid on the H100, config=None
#     beside the seed's heuristic (docs/h100);
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR h100-backward (an H100)
#     OUTDIR/h100-backward/performance.*: the backward page's grid on the H100
#     (docs/h100/backward).
#   FLASH_COMMIT=<commit> bash ci/device/pages.sh OUTDIR fp8        (an H200)
#     OUTDIR/fp8/performance.*: ours in FP8 beside ours in bfloat16 and
#     cuDNN's FP8 route (docs/fp8; ci/device/fp8.sh runs it after the FP8 tests);
#     OUTDIR/fp8/outliers.*: FlashAttention-3's outlier experiment
#     (harness/tools/fp8_outliers.py, docs/fp8/outliers.md).
# A part run on a GPU other than its page's times nothing and exits 3.
# Each starts from the committed page, so what a run does not time keeps its
# own provenance (bench --grid --out-dir).  Copy OUTDIR/docs/* over docs/,
# OUTDIR/gqa4/* over docs/gqa4/, OUTDIR/backward/* over docs/backward/ and
# OUTDIR/h100/* over docs/h100/, OUTDIR/h100-backward/* over docs/h100/backward/,
# OUTDIR/fp8/* over docs/fp8/, review, commit.  OUTDIR also gets steps.txt
# (the device, each step's exit and seconds) and log.txt; eight files at
# most, as a device call returns.  FLASH_COMMIT names the measured commit (a
# copied tree may carry no .git).  properties/tools/test_device_scripts.py checks
# that these are the commands the committed pages name.
set -uo pipefail
usage="usage: pages.sh OUTDIR forward|backward|h100|h100-backward|fp8"
out="${1:?$usage}"
part="${2:?$usage}"
case "$part" in
  forward|backward|fp8) gpu=H200 ;;
  h100|h100-backward) gpu=H100 ;;
  *) echo "pages.sh: part must be forward, backward, h100, h100-backward or fp8, got '$part'" >&2
     exit 2 ;;
esac
commit="${FLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
mkdir -p "$out"
{ nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'; echo "commit $commit"; } \
  >> "$out/steps.txt" 2>&1
# Each page is one GPU's: on another nothing is timed (bench --grid itself
# refuses to mix devices on a page, not to replace a whole one).
if ! nvidia-smi -L 2>/dev/null | grep -q "$gpu"; then
  echo "pages.sh: the $part pages are the $gpu's; this machine has:" \
    "$(nvidia-smi -L 2>&1 | head -1)" | tee -a "$out/steps.txt" >&2
  exit 3
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name" | tee -a "$out/log.txt"; local t=$SECONDS
  timeout "$limit" "$@" > >(tee -a "$out/log.txt") 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$out/steps.txt"; }

if [ "$part" = forward ]; then
  mkdir -p "$out/docs" && cp docs/performance.json docs/performance.md docs/performance.png "$out/docs/"
  # Its limit: docs/decisions/device-step-time-limits.md; the section with its backward after it.
  step forward-grid 300 "$py" -m harness bench --grid --no-example --out-dir "$out/docs" \
    --commit "$commit"
  step windows-segments 270 "$py" -m harness bench --grid --sections windows-segments --backward \
    --out-dir "$out/docs" --commit "$commit"
  mkdir -p "$out/gqa4" && cp docs/gqa4/performance.json docs/gqa4/performance.md \
    docs/gqa4/performance.png "$out/gqa4/"
  step gqa4 120 "$py" -m harness bench --grid --no-example --gqa 4 --head-dims 128 --causal-only \
    --commit "$commit" --out-dir "$out/gqa4"
elif [ "$part" = h100 ]; then
  mkdir -p "$out/h100" && cp docs/h100/performance.json docs/h100/performance.md \
    docs/h100/performance.png "$out/h100/"
  step h100-grid 400 "$py" -m harness bench --grid --no-example --variants "auto;heuristic" \
    --out-dir "$out/h100" --commit "$commit"
elif [ "$part" = h100-backward ]; then
  # A first run: no committed page to start from.
  mkdir -p "$out/h100-backward"
  if [ -f docs/h100/backward/performance.json ]; then
    cp docs/h100/backward/performance.json docs/h100/backward/performance.md \
      docs/h100/backward/performance.png "$out/h100-backward/"
  fi
  step h100-backward-grid 570 "$py" -m harness bench --grid --backward-only --no-example \
    --no-ragged --seqs 1024,4096,16384 --variants "auto;auto,det" --out-dir "$out/h100-backward" \
    --commit "$commit"
elif [ "$part" = fp8 ]; then
  mkdir -p "$out/fp8" && cp docs/fp8/performance.json docs/fp8/performance.md \
    docs/fp8/performance.png "$out/fp8/"
  step fp8-grid 300 "$py" -m harness bench --grid --dtype float8_e4m3fn --out-dir "$out/fp8" \
    --commit "$commit"
  step fp8-outliers 120 env FLASH_COMMIT="$commit" "$py" -m harness.tools.fp8_outliers \
    --out "$out/fp8"
else
  mkdir -p "$out/backward" && cp docs/backward/performance.json docs/backward/performance.md \
    docs/backward/performance.png "$out/backward/"
  step backward-grid 570 "$py" -m harness bench --grid --backward-only --no-example --no-ragged \
    --seqs 1024,4096,16384 --variants "auto;auto,det" --out-dir "$out/backward" --commit "$commit"
fi
