#!/usr/bin/env bash
# A local MLflow tracking server, the same shape as the cluster one: SQLite store, proxied artifacts.
#   bash infra/mlflow/serve-local.sh [DIR] [PORT]     UI on http://127.0.0.1:PORT (default 5050; any free port); open the links a run prints
#   (grpo demo/train, the Prefect summary artifact): they carry workflowType=machine_learning, without which
#   MLflow 3.17 opens an experiment on its GenAI views
# Point a job at it with  tracking: {tracking_uri: http://127.0.0.1:PORT}
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="$(realpath -m "${1:-outputs/mlflow}")"
port="${2:-5050}"
mkdir -p "$dir/artifacts"
exec .venv/bin/mlflow server --host 127.0.0.1 --port "$port" \
  --backend-store-uri "sqlite:///$dir/mlflow.db" --artifacts-destination "$dir/artifacts" --workers 1
