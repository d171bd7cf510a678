#!/usr/bin/env bash
# FP8 on an H200 in one call of under 10 minutes, each step under its own
# time limit (steps.sh): the FP8 GPU properties against float64
# (properties/gpu/test_fp8_gpu.py), the corpus's FP8 goldens updated against
# the committed ones (harness/tools/golden.py: a regression is reported,
# not written), then the FP8
# page, ours in FP8 beside ours in bfloat16 and cuDNN's FP8 route in one
# process with the V^T transpose timed alone (harness/tools/bench_fp8.py).
#   FLASH_COMMIT=<commit> bash ci/device/fp8.sh OUTDIR
# OUTDIR gets steps.txt, device.txt, the page (performance.md/.json/.png:
# copy them over docs/fp8/; pages.sh's fp8 part runs the same command),
# golden.tgz (golden/fp8-*.npz and golden/manifest.json, for golden/ where
# a change is meant) and fp8.tgz (every log).
set -uo pipefail
dest="${1:?usage: fp8.sh OUTDIR}"
out="$(mktemp -d)/fp8"
mkdir -p "$out" "$dest"
source "$(dirname "$0")/steps.sh"
commit="${FLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

record_device
step fp8-tests 200 "$py" -m pytest -m gpu -rs -n 8 -p no:cacheprovider properties/gpu/test_fp8_gpu.py \
  --junitxml "$out/fp8-tests.xml"
fp8_goldens="$("$py" -c 'from harness.tools import golden; print(",".join(s.name for s in golden.CORPUS if s.fp8))')"
step fp8-golden 60 "$py" -m harness golden update --select "$fp8_goldens"
step fp8-page 300 "$py" -m harness bench --grid --dtype float8_e4m3fn --out-dir "$out/page" \
  --commit "$commit"
tar -czf "$dest/golden.tgz" golden/manifest.json golden/fp8-*.npz 2>/dev/null
cp "$out/steps.txt" "$out/device.txt" "$dest/" 2>/dev/null
cp "$out"/page/performance.* "$dest/" 2>/dev/null
tar -czf "$dest/fp8.tgz" -C "$(dirname "$out")" fp8
