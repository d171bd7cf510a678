#!/usr/bin/env bash
# Try a forward variant on a GPU in one call, before it ships: its GPU tests
# against float64, then `bench --grid` timing config=None with and without
# it, beside cuDNN in one process.  The variant is a trailing flag of bench
# --grid's variants (harness/tools/bench_grid.py's MODIFIERS), each the
# bench's name of a kernel.experiments switch.
#   bash ci/device/compare-forward.sh OUTDIR MODIFIER TESTS [HEAD_DIMS] [SEQS] [DTYPE]
# TESTS: a pytest -k expression that selects the variant's tests in
# properties/gpu/test_forward_gpu.py (DTYPE float8_e4m3fn: test_fp8_gpu.py,
# timed on the FP8 page's grid, which takes MODIFIER ut only).  The copies
# through untiled views (kernel.experiments' untiled_copies), at lengths no
# multiple of 8:
#   bash ci/device/compare-forward.sh OUTDIR ut untiled 64,128,256 1001,4001,12017
# and in FP8 (docs/decisions/fp8-untiled-copies.md):
#   bash ci/device/compare-forward.sh OUTDIR ut fp8_untiled 64,128,256 1001,3001,12017 float8_e4m3fn
# A call without key ranges run by the kernels that read them, the ones the
# proof traces (kernel.experiments' ranges_always; docs/proof.md):
#   bash ci/device/compare-forward.sh OUTDIR kr ranges_always 64,128,256 1000,3000,12017
# Every step has its own time limit, so a variant that hangs on the GPU ends
# the step (exit 124 in steps.txt) instead of the device call; the timing
# runs only once the tests pass.
set -uo pipefail
usage="usage: compare-forward.sh OUTDIR MODIFIER TESTS [HEAD_DIMS] [SEQS] [DTYPE]"
dest="${1:?$usage}"
modifier="${2:?$usage}"
tests="${3:?$usage}"
head_dims="${4:-64,128,256}"
seqs="${5:-1000,3000,12017}"
dtype="${6:-bfloat16}"
tests_file=properties/gpu/test_forward_gpu.py
[ "$dtype" = bfloat16 ] || tests_file=properties/gpu/test_fp8_gpu.py
out="$(mktemp -d)/compare"
mkdir -p "$out" "$dest"
source "$(dirname "$0")/steps.sh"

record_device
if step tests 300 "$py" -m pytest -m gpu -rs "$tests_file" -k "$tests" \
     --junitxml "$out/tests.xml"; then
  step bench 240 "$py" -m harness bench --grid --no-example --dtype "$dtype" \
    --head-dims "$head_dims" --seqs "$seqs" --variants "auto;auto,$modifier" --out-dir "$out/bench" \
    --commit "${FLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
fi
cp "$out/steps.txt" "$dest/" 2>/dev/null
cp "$out/bench/performance.md" "$dest/bench.md" 2>/dev/null
tar -czf "$dest/compare.tgz" -C "$(dirname "$out")" compare
