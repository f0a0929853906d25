"""notebooks/compare_experiments.ipynb executed headless (nbclient) against the session's MLflow server.

Three runs with known metric histories are logged to a fresh experiment; the notebook must run
without error, draw every run in every panel of its figure (checked on the rendered PNG, by the
runs' line colours in each quadrant) and report each run's final reward in its summary table.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from pathlib import Path

import nbformat
import numpy as np
import pytest
from matplotlib.colors import to_rgb
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.integration

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "compare_experiments.ipynb"
STEPS = 20


def log_runs(tracking_uri: str, experiment: str) -> dict[str, float]:
    """Three runs whose curves differ; returns each run's expected "reward last" (mean of the last 2 steps)."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient(tracking_uri)
    experiment_id = client.create_experiment(experiment)
    expected = {}
    now = int(time.time() * 1000)
    for i, lr in enumerate(["1e-4", "2e-4", "4e-4"]):
        run = client.create_run(experiment_id, run_name=f"lr-{lr}", tags={"config_hash": f"{i:012d}"})
        rewards = [0.2 + (0.02 + 0.01 * i) * s for s in range(1, STEPS + 1)]
        metrics = []
        for s, reward in enumerate(rewards, start=1):
            metrics += [
                Metric("reward", reward, now + s, s),
                Metric("sample/staleness_mean", 0.5 + 0.1 * i, now + s, s),
                Metric("rollout/generated_tok_s", 800.0 + 100 * i + s, now + s, s),
                Metric("batch/packing_ratio", 1.5 + 0.2 * i, now + s, s),
            ]
        client.log_batch(run.info.run_id, metrics=metrics)
        client.set_terminated(run.info.run_id)
        expected[f"lr-{lr}"] = sum(rewards[-2:]) / 2
    return expected


def execute(tmp_path: Path, monkeypatch, tracking_uri: str, experiment: str) -> nbformat.NotebookNode:
    # The kernel inherits this environment: the notebook reads its parameters from it.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("GRPO_EXPERIMENT", experiment)
    monkeypatch.setenv("GRPO_FIGURE_PATH", str(tmp_path / "figure.png"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return notebook


def outputs(notebook: nbformat.NotebookNode, mime: str) -> list[str]:
    return [out["data"][mime] for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if mime in out.get("data", {})]


def colour_pixels(image: np.ndarray, colour: str, tolerance: float = 0.06) -> int:
    return int((np.abs(image[..., :3] - np.asarray(to_rgb(colour))).max(axis=-1) < tolerance).sum())


@pytest.mark.timeout(600)
def test_notebook_plots_and_summarises_every_run(mlflow_server, tmp_path, monkeypatch):
    import matplotlib.image

    experiment = f"notebook-{uuid.uuid4().hex[:6]}"
    expected = log_runs(mlflow_server, experiment)
    notebook = execute(tmp_path, monkeypatch, mlflow_server, experiment)

    pngs = outputs(notebook, "image/png")
    assert len(pngs) == 1
    image = matplotlib.image.imread(io.BytesIO(base64.b64decode(pngs[0])), format="png")
    height, width = image.shape[:2]
    assert width > 1000 and height > 700  # 12 x 8 in at 100 dpi, trimmed to the drawing by the inline backend
    # Runs are drawn newest first as C0, C1, C2; each panel (a quadrant, above the legend's strip at
    # the bottom) must show all three lines.
    panels = image[: int(height * 0.9)]
    half_h = panels.shape[0] // 2
    for top in (0, half_h):
        for left in (0, width // 2):
            quadrant = panels[top : top + half_h, left : left + width // 2]
            for colour in ("C0", "C1", "C2"):
                assert colour_pixels(quadrant, colour) > 100, (top, left, colour)
    assert colour_pixels(image, "C3") < 50  # and no fourth run
    assert (tmp_path / "figure.png").stat().st_size > 10_000

    table = outputs(notebook, "text/html")[-1]
    for name, reward_last in expected.items():
        assert name in table
        assert f"{reward_last:.3f}" in table, (name, reward_last)


@pytest.mark.timeout(300)
def test_notebook_names_a_missing_experiment(mlflow_server, tmp_path, monkeypatch):
    with pytest.raises(CellExecutionError, match="no experiment 'no-such-experiment'"):
        execute(tmp_path, monkeypatch, mlflow_server, "no-such-experiment")
