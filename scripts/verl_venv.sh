#!/usr/bin/env bash
# An environment with verl 0.9.1 (and its Ray) for `benchmarks/dispatch.py --verl-python`, apart from the project's
# own (verl pins its own dependencies). Idempotent. Usage: scripts/verl_venv.sh  →  prints the interpreter's path.
set -euo pipefail
VENV=${VERL_VENV:-/tmp/verl-venv}
PY=${PYTHON:-python3.11}
if ! "$VENV/bin/python" -c "import verl, ray" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q verl==0.9.1
fi
echo "$VENV/bin/python"
