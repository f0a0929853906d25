#!/usr/bin/env bash
# Set up (first time only) and run the embedded default: tiny model, CPU vLLM server, Prefect flow,
# MLflow store and checkpoints under the output folder (default outputs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/grpo demo --output-dir "${1:-outputs/demo}" "${@:2}"
