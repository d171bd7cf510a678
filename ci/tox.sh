#!/usr/bin/env bash
# Run tox with a Python 3.12 found on this machine, from nothing.
#   bash ci/tox.sh -e tests      the property suite (pytest -n auto properties/)
#   bash ci/tox.sh -e gate       the conformance gate (python -m harness gate)
# Looks for Python 3.12 in $PYTHON, then python3.12 / python3 on PATH, then
# pyenv's installed versions, then uv's managed Pythons.  No machine path is
# written anywhere: everything is discovered here.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

is_312() { "$@" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local cand v
  for cand in "${PYTHON:-}" python3.12 python3 python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && is_312 "$cand" && { command -v "$cand"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -rV); do
      cand="$(PYENV_VERSION="$v" pyenv which python3.12 2>/dev/null || true)"
      [ -n "$cand" ] && is_312 "$cand" && { echo "$cand"; return; }
    done
  fi
  if command -v uv >/dev/null 2>&1; then
    cand="$(uv python find 3.12 2>/dev/null || true)"
    [ -n "$cand" ] && is_312 "$cand" && { echo "$cand"; return; }
  fi
  return 1
}

py="$(find_python)" || { echo "ci/tox.sh: no Python 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 2; }
venv="$here/.venv-tox"
if [ ! -x "$venv/bin/tox" ] || ! is_312 "$venv/bin/python"; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "tox>=4.11,<5"
fi
# tox's interpreter discovery tries the interpreter running tox first, which
# is our 3.12, so base_python = python3.12 resolves without PATH tricks.
exec "$venv/bin/tox" "$@"
