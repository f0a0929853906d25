#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root from requirements.lock. Idempotent: a second run
# with an unchanged lock file, pyproject.toml and set-up script returns at once.
#
# Works from a bare system Python (Debian/Ubuntu's, which refuses `pip install` under PEP 668):
# `uv` comes from PATH when it is there, otherwise it is installed into a virtual environment of its
# own under ~/.cache/grpo-core/bootstrap. The project environment then carries its own `uv` and
# `pip` (both are in the lock), so the processes started from it (a vLLM server listing its
# packages, the tests) never depend on what the caller's PATH holds.
set -euo pipefail
cd "$(dirname "$0")/.."

# `--cuda` (or GRPO_CORE_CUDA=1) installs requirements-cuda.lock: vLLM's CUDA build 0.25.0 with torch 2.11.0 for
# CUDA 13 on Python 3.12, the versions of the GPU machine the project's GPU runs are made on (docs/gpus.md).
cuda=${GRPO_CORE_CUDA:-0}
for arg in "$@"; do
  case "$arg" in
    --cuda) cuda=1 ;;
    *) echo "setup: unknown argument '$arg'; the only one is --cuda" >&2; exit 1 ;;
  esac
done
# GRPO_CORE_EXTRAS=environments installs requirements-environments.lock instead: the same set plus verifiers,
# reasoning-gym and openenv-core (pyproject.toml's `environments` extra), resolved together with it.
case "${GRPO_CORE_EXTRAS:-}" in
  "") lock=requirements.lock ;;
  environments) lock=requirements-environments.lock ;;
  *) echo "setup: GRPO_CORE_EXTRAS=${GRPO_CORE_EXTRAS} is not known; leave it unset or set it to 'environments'" >&2; exit 1 ;;
esac
python_minor=11
if [ "$cuda" = 1 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: --cuda needs an NVIDIA GPU and its driver (nvidia-smi is missing or finds no GPU); on this machine run 'bash scripts/setup.sh' for the CPU build" >&2
    exit 1
  fi
  if [ -n "${GRPO_CORE_EXTRAS:-}" ]; then
    echo "setup: GRPO_CORE_EXTRAS=${GRPO_CORE_EXTRAS} has no CUDA lock yet; unset it with --cuda" >&2; exit 1
  fi
  lock=requirements-cuda.lock
  python_minor=12
fi
want=$(cat "$lock" pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp=.venv/.installed-from
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

# ---- a Python 3.11 (3.12 with --cuda) to build from -------------------------------------------------
python=""
for candidate in ${GRPO_CORE_PYTHON:-} python3.$python_minor python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (3, $python_minor))" 2>/dev/null; then
    python=$(command -v "$candidate")
    break
  fi
done
if [ -z "$python" ]; then
  echo "setup: no Python 3.$python_minor found (tried \$GRPO_CORE_PYTHON, python3.$python_minor, python3); install Python 3.$python_minor" >&2
  exit 1
fi

# ---- uv: the installer the lock file is resolved with -----------------------------------------------
uv_version=0.13.9
uv=$(command -v uv || true)
if [ -z "$uv" ]; then
  bootstrap="${XDG_CACHE_HOME:-$HOME/.cache}/grpo-core/bootstrap"
  if [ ! -x "$bootstrap/bin/uv" ]; then
    echo "setup: installing uv $uv_version into $bootstrap" >&2
    if ! "$python" -m venv --clear "$bootstrap" >/dev/null; then
      echo "setup: '$python -m venv' failed; install your distribution's venv package (Debian/Ubuntu:" \
           "apt install python3.11-venv) or put uv on PATH" >&2
      exit 1
    fi
    "$bootstrap/bin/python" -m pip install --quiet "uv==$uv_version"
  fi
  uv="$bootstrap/bin/uv"
fi
# uv trusts its own certificate bundle by default; the platform's store is what pip and curl use, and
# it is the one that holds a site's proxy or mirror certificate.
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}

# ---- where torch==2.13.0+cpu comes from --------------------------------------------------------------
# A local wheel folder when there is one (GRPO_CORE_WHEELS, pip's configured find-links, or this
# fleet's /opt/wheels), otherwise the PyTorch CPU index. uv reads neither pip's configuration nor
# that index by default.
extra=()
links=""
if [ "$cuda" = 1 ]; then
  : # torch 2.11.0 for CUDA 13 is PyPI's own build: no other index
else
  for folder in "${GRPO_CORE_WHEELS:-}" "${PIP_FIND_LINKS:-}" \
                "$("$python" -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n1)" \
                /opt/wheels; do
    if [ -n "$folder" ] && ls "$folder"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
      links=$folder
      break
    fi
  done
  if [ -n "$links" ]; then
    extra+=(--find-links "$links")
  else
    extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
fi

"$uv" venv .venv --python "$python" --allow-existing --quiet
# `sync` installs exactly the lock: vLLM's torchvision/torchaudio/torchcodec stay out on purpose
# (their PyPI builds break `import transformers` beside CPU torch).
"$uv" pip sync "$lock" --python .venv/bin/python --index-strategy unsafe-best-match "${extra[@]}"
"$uv" pip install --python .venv/bin/python --no-deps -e . --quiet
# vLLM's oss-harmony and the environments' openai-harmony both install the module `openai_harmony`: a sync from the
# environments lock back to this one uninstalls openai-harmony and its files with it, leaving vLLM without the module.
harmony=$(grep -m1 '^oss-harmony==' "$lock" || true)
if [ -n "$harmony" ] && ! .venv/bin/python -c "import openai_harmony" >/dev/null 2>&1; then
  "$uv" pip install --python .venv/bin/python --no-deps --reinstall "$harmony" --quiet \
    --index-strategy unsafe-best-match "${extra[@]}"
fi
echo "$want" > "$stamp"
echo "environment ready: $(pwd)/.venv" >&2
