#!/usr/bin/env bash
# The device check, one call bounded to 8 minutes (scripts/gpu_check.py says what it runs):
#   bash scripts/gpu_check.sh [--dry-run] [--out DIR]
# Uses $PYTHON, else .venv312/bin/python or .venv/bin/python when present, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in .venv312/bin/python .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
    done
fi
exec timeout --signal=TERM --kill-after=20 480 "$PY" scripts/gpu_check.py "$@"
