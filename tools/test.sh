#!/usr/bin/env bash
# The README's test command: set up the venv, then run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/setup_env.sh | tail -n 1)
exec "$VENV/bin/python" -m pytest -q "$@"
