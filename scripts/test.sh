#!/usr/bin/env bash
# Set up (first time only) and run the test suite: unit tests, then integration tests against real
# vLLM, MLflow, Prefect and S3-protocol servers that the suite starts on loopback.
#
#     bash scripts/test.sh              # everything CI runs
#     bash scripts/test.sh --fast       # the tests that need no server and no built tiny model (minutes)
#     bash scripts/test.sh -k packing   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests of grpo_core.environments need the ecosystems' packages: the suite runs on the environments set
# (requirements-environments.lock: the base set plus verifiers, reasoning-gym and openenv-core), and on a verifiers
# taskset package written for the tests (tests/environments/vf_tiny_sums). GRPO_CORE_EXTRAS= (empty) runs on the
# base set, where those tests are skipped.
export GRPO_CORE_EXTRAS=${GRPO_CORE_EXTRAS-environments}
bash scripts/setup.sh
bash scripts/triton_interpreter.sh  # Triton beside the environment, for the kernel tests under its interpreter
if [ "$GRPO_CORE_EXTRAS" = environments ] && ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vf_tiny_sums') is None)"; then
  # built with the setuptools of the lock: no build environment fetched from an index
  .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps --no-build-isolation -e tests/environments/vf_tiny_sums
fi
# tests/test_mlflow_browser.py drives Debian's Chromium through playwright (from the lock), which downloads no
# browser: installed here from Debian's packages when missing and this runs as root (CI does); elsewhere the test
# fails naming the install. The fast tier does not run it.
if [ "${1:-}" != "--fast" ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
fi
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not startup and not pending and not soak and not long" "$@"
fi
exec .venv/bin/python -m pytest "$@"
