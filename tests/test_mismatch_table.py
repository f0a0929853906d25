"""scripts/mismatch_table.py reads the correction-mode table from an MLflow store as mismatch_runs.py leaves it.

Two runs are logged to a SQLite MLflow store (a real store, no server) with the tags and metrics the trainer and
the flow write; the table's numbers are checked against values computed by hand.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")


def load_script():
    path = Path(__file__).parents[1] / "scripts" / "mismatch_table.py"
    spec = importlib.util.spec_from_file_location("mismatch_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log_run(client, experiment_id: str, mode: str, replay: bool, rewards: list[float], k3: list[float],
            heldout: tuple[float, float] | None, finished: bool = True, routes: bool = False,
            failure: str = "", superseded: bool = False) -> None:
    run = client.create_run(experiment_id, run_name=f"arithmetic-hybrid-moe-{mode}-harsh",
                            tags={"mismatch.mode": mode, "mismatch.setting": "harsh",
                                  "mismatch.routing_replay": str(replay), "mismatch.variant": "arithmetic-hybrid-moe"})
    rid = run.info.run_id
    client.log_param(rid, "seed", "0")
    client.log_param(rid, "grpo.server.return_routed_experts", str(routes))
    for step, (reward, kl) in enumerate(zip(rewards, k3), start=1):
        client.log_metric(rid, "reward", reward, step=step)
        client.log_metric(rid, "mismatch/k3_token", kl, step=step)
        client.log_metric(rid, "mismatch/masked_token_share", 0.01 * step, step=step)
        client.log_metric(rid, "mismatch/max_token_gap", float(step), step=step)
    if heldout is not None:
        client.log_metric(rid, "heldout_accuracy", heldout[0], step=0)
        client.log_metric(rid, "heldout_accuracy", heldout[1], step=len(rewards))
    if failure:
        client.set_tag(rid, "failure", failure)
    if superseded:
        client.set_tag(rid, "superseded_by", "another run")
    client.set_terminated(rid, "FINISHED" if finished else "KILLED" if failure.startswith("stopped by hand") else "FAILED")


def test_the_table_is_read_from_the_experiment(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment_id = client.create_experiment("mismatch-corrections", artifact_location=str(tmp_path / "artifacts"))
    rewards = [float(i) for i in range(1, 21)]  # 20 steps: the first and last 10% are two steps each
    log_run(client, experiment_id, "token_mask", True, rewards, [0.1] * 10 + [0.3] * 10, (0.25, 0.75), routes=True)
    log_run(client, experiment_id, "none", False, [1.0] * 10, [0.2] * 10, None)
    log_run(client, experiment_id, "sequence_mask", True, [1.0] * 10, [0.2] * 10, None, finished=False,
            failure="training failed with exit code 1 after 3 resumes")
    log_run(client, experiment_id, "sequence_truncate", True, [1.0, 0.1, 0.0], [0.2] * 3, None, finished=False,
            failure="training stopped at step 3: NoLearningSignalError: the last 160 groups ...")
    log_run(client, experiment_id, "token_truncate", True, [1.0, 0.5], [0.2] * 2, None, finished=False,
            failure="stopped by hand at step 2: a collapse that crawled on")
    log_run(client, experiment_id, "none", True, [1.0] * 5, [0.2] * 5, None, finished=False,
            failure="training failed after 3 resumes; the last attempt: training stopped at step 27: "
                    "ServedWeightsMismatch: the vLLM server at http://x does not serve ... (see train.log)")
    log_run(client, experiment_id, "none", True, [1.0] * 4, [0.2] * 4, None, finished=False,
            failure="training failed after 3 resumes; the last attempt: training stopped at step 9: "
                    "ServedWeightsMismatch: ...", superseded=True)
    script = load_script()
    out = tmp_path / "table.json"

    assert script.main(["--tracking-uri", uri, "--json", str(out), "--commands"]) == 0
    printed = capsys.readouterr().out
    import json

    rows = json.loads(out.read_text())
    # a run that failed without naming the trainer's error is left out, and so is one run again; those the trainer
    # stopped for want of signal (a collapse) or on the push check are rows
    assert [(r["mode"], r["routing_replay"]) for r in rows] == [("none", True), ("token_mask", True),
                                                                 ("token_truncate", True), ("sequence_truncate", True),
                                                                 ("none", False)]
    assert rows[0]["ended"] == "stopped at step 27: the server's log-probs left the push check's tolerance"
    rows = rows[1:]
    assert rows[1]["ended"] == "stopped by hand at step 2"
    assert rows[2]["ended"] == "stopped at step 3: no learning signal" and rows[0]["ended"] == "finished"
    mask = rows[0]
    assert (mask["reward_first"], mask["reward_last"], mask["reward_gain"]) == (1.5, 19.5, 18.0)
    assert (mask["heldout_before"], mask["heldout_after"], mask["heldout_gain"]) == (0.25, 0.75, 0.5)
    assert mask["k3"] == pytest.approx(0.2) and mask["max gap"] == 20.0
    assert mask["masked"] == pytest.approx(0.01 * sum(range(1, 21)) / 20)
    assert mask["route diff"] is None and rows[3]["heldout_gain"] is None
    assert "python scripts/mismatch_runs.py --model tiny:arithmetic-hybrid-moe --mode none --setting harsh " \
           "--no-routing-replay" in printed
    assert printed.splitlines()[0].startswith("| variant | replay | setting | mode |")
    assert "| arithmetic-hybrid-moe | on | harsh | token_mask | 20 | 1.500 → 19.500 (+18.000) | 0.250 → 0.750 (+0.500) |" \
        in printed
    assert "| arithmetic-hybrid-moe | off | harsh | none | 10 |" in printed


def test_a_missing_experiment_names_the_ones_there(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).create_experiment("other", artifact_location=str(tmp_path / "artifacts"))
    assert load_script().main(["--tracking-uri", uri]) == 2
    assert "experiments there: ['Default', 'other']" in capsys.readouterr().err


def test_replay_without_routes_says_so():
    """A CPU server returns no routes: replay was asked for but the trainer routed every token itself."""
    replay_text = load_script().replay_text
    moe = {"variant": "arithmetic-hybrid-moe"}
    assert replay_text({**moe, "routing_replay": True, "routes_returned": False}) == "on, no routes"
    assert replay_text({**moe, "routing_replay": True, "routes_returned": True}) == "on"
    assert replay_text({**moe, "routing_replay": False, "routes_returned": False}) == "off"
    assert replay_text({"variant": "arithmetic-hybrid", "routing_replay": True, "routes_returned": False}) == "–"
