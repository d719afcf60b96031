#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at $FT_VENV (default .venv) and install ft with test extras.
# On CPU machines torch==2.13.0 is installed first so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FT_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[test]"
echo "$VENV"
