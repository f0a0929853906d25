"""``unfinished_run``: which run in an output folder a new ``grpo train`` continues (the flow's ``continued_run``).

    .venv/bin/python -m pytest -q tests/test_unfinished_run.py
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_core.checkpoint import MANIFEST, RunLedger, Storage, unfinished_run
from grpo_core.checkpoint.folders import TRAINER_STATE, build_manifest


def checkpoint(out: Path, step: int, lineage: str, run_id: str, torn: bool = False) -> None:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / TRAINER_STATE).write_text(json.dumps({"global_step": step, "mlflow_run_id": run_id}))
    (folder / "model.safetensors").write_bytes(b"w" * step)
    if not torn:
        (folder / MANIFEST).write_text(json.dumps(build_manifest(folder, step, lineage)))


def test_the_newest_good_checkpoint_of_the_folders_run_before_max_steps(tmp_path):
    RunLedger(Storage(str(tmp_path))).set_lineage("ours")
    checkpoint(tmp_path, 2, "ours", "run-a")
    checkpoint(tmp_path, 4, "ours", "run-a")
    checkpoint(tmp_path, 6, "ours", "run-a", torn=True)  # killed while writing it
    checkpoint(tmp_path, 8, "earlier", "run-b")  # an earlier run's, left in the folder
    found = unfinished_run(str(tmp_path), max_steps=10)
    assert found is not None
    assert (found.step, found.mlflow_run_id) == (4, "run-a")
    assert found.checkpoint.endswith("checkpoint-4")


def test_a_finished_run_or_an_empty_folder_is_nothing_to_continue(tmp_path):
    assert unfinished_run(str(tmp_path / "none"), max_steps=10) is None
    assert unfinished_run(str(tmp_path), max_steps=10) is None
    RunLedger(Storage(str(tmp_path))).set_lineage("ours")
    assert unfinished_run(str(tmp_path), max_steps=10) is None  # a run with no good checkpoint yet
    checkpoint(tmp_path, 10, "ours", "run-a")
    assert unfinished_run(str(tmp_path), max_steps=10) is None  # it reached max_steps
    assert unfinished_run(str(tmp_path), max_steps=20).step == 10  # a longer job would continue it
