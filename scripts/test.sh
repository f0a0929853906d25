#!/usr/bin/env bash
# Set up (first time only) and run the test suite: unit tests, then integration tests against real
# vLLM, MLflow, Prefect and S3-protocol servers that the suite starts on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
