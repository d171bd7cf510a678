# Sourced by the device scripts that run steps under time limits
# (compare-backward.sh, compare-forward.sh, fp8.sh, prove.sh, verify.sh),
# after they set $out:
# the environment every step runs in, $py, and `step NAME LIMIT CMD...`,
# which runs CMD for at most LIMIT seconds with its output in $out/NAME.log,
# appends its exit code and seconds to $out/steps.txt, and returns the code
# (124: the limit ended it); `record_device`, the GPU, jax and the commit in
# $out/device.txt; `use_wheels`, .whl/'s wheels on PYTHONPATH.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}"
py="${PYTHON:-python3}"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t=$SECONDS
  timeout "$limit" "$@" > >(tee "$out/$name.log") 2>&1; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t))s" | tee -a "$out/steps.txt"; return $rc; }
# Wheels in .whl/, when that folder is present, installed into a folder of
# their own on PYTHONPATH (for a dependency the machine lacks).
use_wheels() {
  ls .whl/*.whl >/dev/null 2>&1 || return 0
  local site; site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"; }
record_device() {
  { nvidia-smi -L; "$py" -c 'import jax; print("jax", jax.__version__)'
    echo "commit ${FLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; } \
    > "$out/device.txt" 2>&1; }
