#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root from requirements.lock. Idempotent: a second run
# with an unchanged lock file and pyproject.toml returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

want=$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
stamp=.venv/.installed-from
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

if ! command -v uv >/dev/null 2>&1; then
  echo "installing uv (the resolver/installer used for the lock file)" >&2
  python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
  export PATH="$HOME/.local/bin:$PATH"
fi

# torch==2.13.0+cpu comes from a local wheel folder when pip is configured with one, otherwise
# from the PyTorch CPU index. uv reads neither pip's config nor that index by default.
extra=()
links=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n1)
if [ -n "${links}" ] && ls "${links}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  extra+=(--find-links "${links}")
else
  extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

uv venv .venv --python 3.11 --allow-existing --quiet
# `sync` installs exactly the lock: vLLM's torchvision/torchaudio/torchcodec stay out on purpose
# (their PyPI builds break `import transformers` beside CPU torch).
uv pip sync requirements.lock --python .venv/bin/python --index-strategy unsafe-best-match "${extra[@]}"
uv pip install --python .venv/bin/python --no-deps -e . --quiet
echo "$want" > "$stamp"
echo "environment ready: $(pwd)/.venv" >&2
