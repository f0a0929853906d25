"""The serving recipe of ``docs/tracking.md`` and ``infra/mlflow/README.md`` (the same two lines), end to end and as
written: the final model registered on a real MLflow server is downloaded with the first line, the second starts a
CPU vLLM server on the folder it names with the CPU settings written in it, from a new shell, and it answers one
completion.

Cost: logging the tiny model to the session's MLflow server, and one CPU vLLM server start (1-3 min on two cores).

    .venv/bin/python -m pytest -q tests/integration/test_serving_recipe.py
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import mlflow

from grpo_core.tracking.tracker import log_transformers_model, training_experiment

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900  # a start on two busy cores has taken over ten minutes


def recipe_lines(page: Path) -> list[str]:
    """The commands of a page's serving recipe (the block after its marker)."""
    block = page.read_text().split("<!-- serving recipe -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_registered_model_serves_as_the_readme_says(mlflow_server, tiny_model_path, tmp_path):
    client = mlflow.MlflowClient(mlflow_server)
    run_id = client.create_run(training_experiment(client, "serving-recipe")).info.run_id
    name = f"tiny-serve-{uuid.uuid4().hex[:8]}"
    log_transformers_model(mlflow_server, run_id, tiny_model_path, name, artifact_path=name, step=1)
    version = client.get_run(run_id).data.tags["final_model"].rsplit("/", 1)[-1]

    lines = recipe_lines(ROOT / "docs" / "tracking.md")
    assert recipe_lines(ROOT / "infra" / "mlflow" / "README.md") == lines  # one recipe, written twice
    download, serve = lines
    command = download.replace("<registered model>", name).replace("<version>", version)
    assert "<" not in command and "<" not in serve, (command, serve)
    # The recipe runs from the repository's root (.venv/bin/...): here, a folder with the same .venv.
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server})
    assert done.returncode == 0, done.stderr[-3000:]

    # The folder the recipe serves is the Hugging Face model, as logged.
    words = shlex.split(serve)
    folder = tmp_path / words[words.index("--model") + 1]
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), sorted(tmp_path.rglob("*"))
    assert (folder / "model.safetensors").read_bytes() == (Path(tiny_model_path) / "model.safetensors").read_bytes()
    # The serving line as written, in a new shell: no variable of this process's environment, none added.
    url = f"http://{words[words.index('--host') + 1]}:{words[words.index('--port') + 1]}"
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(["bash", "-c", serve], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(2)
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": words[words.index("--model") + 1],
            "prompt": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 8, "temperature": 0.0})
        reply.raise_for_status()
        assert reply.json()["usage"]["completion_tokens"] > 0 and reply.json()["choices"][0]["text"], reply.json()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
