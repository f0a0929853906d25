"""The serving recipe of ``infra/mlflow/README.md``, end to end: the final model registered on a real MLflow server is
downloaded with the README's command as written, a CPU vLLM server starts on the folder the README names, and it
answers one completion.

Cost: logging the tiny model to the session's MLflow server, and one CPU vLLM server start (1-3 min on two cores).

    .venv/bin/python -m pytest -q tests/integration/test_serving_recipe.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from pathlib import Path

import httpx
import mlflow

from grpo_core.tracking.tracker import log_transformers_model, training_experiment
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900  # a start on two busy cores has taken over ten minutes


def recipe_lines() -> list[str]:
    """The commands of the README's serving recipe (the block after its marker)."""
    text = (ROOT / "infra" / "mlflow" / "README.md").read_text()
    block = text.split("<!-- serving recipe -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_registered_model_serves_as_the_readme_says(mlflow_server, tiny_model_path, tmp_path):
    client = mlflow.MlflowClient(mlflow_server)
    run_id = client.create_run(training_experiment(client, "serving-recipe")).info.run_id
    name = f"tiny-serve-{uuid.uuid4().hex[:8]}"
    log_transformers_model(mlflow_server, run_id, tiny_model_path, name, artifact_path=name, step=1)
    version = client.get_run(run_id).data.tags["final_model"].rsplit("/", 1)[-1]

    download, serve = recipe_lines()
    command = download.replace("<registered model>", name).replace("<version>", version)
    assert "<" not in command, command
    # The recipe runs from the repository's root (.venv/bin/...): here, a folder with the same .venv.
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server})
    assert done.returncode == 0, done.stderr[-3000:]

    # The folder the README serves is the Hugging Face model, as logged.
    folder = tmp_path / shlex.split(serve)[shlex.split(serve).index("--model") + 1]
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), sorted(tmp_path.rglob("*"))
    assert (folder / "model.safetensors").read_bytes() == (Path(tiny_model_path) / "model.safetensors").read_bytes()
    server = VLLMServer(VLLMServerSpec(model=str(folder), max_model_len=256), tmp_path / "server")
    try:
        server.start(timeout_s=START_TIMEOUT_S)
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": str(folder), "prompt": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 8, "temperature": 0.0})
        reply.raise_for_status()
        assert reply.json()["usage"]["completion_tokens"] > 0 and reply.json()["choices"][0]["text"], reply.json()
    finally:
        server.stop()
