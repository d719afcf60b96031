#!/usr/bin/env bash
# The README's demo command: set up the venv, then synth -> compile -> serve -> query the demo model (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/setup_env.sh | tail -n 1)
exec "$VENV/bin/python" tools/demo.py "$@"
