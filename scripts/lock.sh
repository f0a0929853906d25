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
