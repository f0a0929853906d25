#!/usr/bin/env bash
# Set up (first time only) and run the test suite: unit tests, then integration tests against real
# vLLM, MLflow, Prefect and S3-protocol servers that the suite starts on loopback.
#
#     bash scripts/test.sh              # everything CI runs
#     bash scripts/test.sh --fast       # the tests that need no server and no built tiny model (minutes)
#     bash scripts/test.sh -k packing   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not startup and not pending and not soak and not long" "$@"
fi
exec .venv/bin/python -m pytest "$@"
