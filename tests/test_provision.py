"""The flow's training launch: the command each node runs (one process, one node under torchrun, several
nodes at a static rendezvous on node 0), and LocalProvisioner's training environment (CPU trainers beside a
local vLLM server take half the cores, and the cores the split gives the rollout worker)."""

from __future__ import annotations

import os

import pytest

from flows.provision import LocalProvisioner, TrainingLaunch


def launch(url: str, nproc: int = 1) -> TrainingLaunch:
    return TrainingLaunch(job_file="job.json", server_url=url, model_path="m", mlflow_run_id=None,
                          tracking_uri=None, result_file="r.json", nproc_per_node=nproc)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flows.provision._has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("url,nproc,threads", [
    ("http://127.0.0.1:8000", 1, "4"), ("http://localhost:8000", 2, "2"), ("http://[::1]:8000", 8, "1"),
])
def test_a_loopback_server_halves_the_trainer_threads(url: str, nproc: int, threads: str) -> None:
    assert LocalProvisioner().training_env(launch(url, nproc))["OMP_NUM_THREADS"] == threads


@pytest.mark.usefixtures("no_gpu")
def test_a_remote_server_leaves_threads_alone() -> None:
    assert "OMP_NUM_THREADS" not in LocalProvisioner().training_env(launch("http://vllm.cluster.local:8000"))


@pytest.mark.usefixtures("no_gpu")
def test_a_user_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert LocalProvisioner().training_env(launch("http://127.0.0.1:8000"))["OMP_NUM_THREADS"] == "3"


def test_gpus_leave_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flows.provision._has_cuda", lambda: True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS" not in LocalProvisioner().training_env(launch("http://127.0.0.1:8000"))


def node_command(nproc: int, nnodes: int, **topology: object) -> list[str]:
    return TrainingLaunch(job_file="job.json", server_url="http://s", model_path="m", mlflow_run_id=None,
                          tracking_uri=None, result_file="r.json", nproc_per_node=nproc, nnodes=nnodes,
                          **topology).command()


def test_one_process_runs_the_entry_point_alone() -> None:
    assert "torch.distributed.run" not in node_command(1, 1)


def test_one_node_rendezvouses_on_a_free_local_port() -> None:
    command = node_command(4, 1)
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in command and not any(a.startswith("--master-addr") for a in command)


@pytest.mark.parametrize("node_rank", [0, 2])
def test_every_node_of_several_dials_node_0_with_its_own_rank(node_rank: int) -> None:
    command = node_command(4, 3, node_rank=node_rank, rendezvous_address="10.0.0.7", rendezvous_port=29400)
    torchrun = command[command.index("torch.distributed.run") + 1 : command.index("grpo_core.launch") - 1]
    assert torchrun == ["--nnodes=3", "--nproc-per-node=4", f"--node-rank={node_rank}", "--master-addr=10.0.0.7",
                        "--master-port=29400"]
    # Every node runs the same entry point and arguments; only the node rank differs.
    assert command[command.index("grpo_core.launch") - 1 :] == node_command(1, 1)[1:]


def test_several_nodes_need_node_0s_address() -> None:
    with pytest.raises(ValueError, match="nnodes=2 needs rendezvous_address"):
        node_command(1, 2)


@pytest.mark.parametrize("topology", [dict(node_rank=2), dict(node_rank=-1), dict(rendezvous_port=0)])
def test_a_node_rank_outside_the_nodes_or_a_bad_port_is_refused(topology: dict) -> None:
    with pytest.raises(ValueError, match="node_rank|rendezvous_port"):
        node_command(1, 2, rendezvous_address="10.0.0.7", **topology)


def test_the_flow_runs_node_0_at_the_jobs_rendezvous(tmp_path) -> None:
    from flows.train_flow import training_launch
    from grpo_core.launch.job import JobConfig

    job = JobConfig(nproc_per_node=2, nnodes=2, rendezvous_address="10.0.0.7", rendezvous_port=29401)
    launch = training_launch(job, tmp_path / "job.json", "http://s", "m", None, None, tmp_path)
    assert (launch.node_rank, launch.nnodes, launch.nproc_per_node) == (0, 2, 2)
    assert (launch.rendezvous_address, launch.rendezvous_port) == ("10.0.0.7", 29401)
    command = launch.command()
    assert {"--node-rank=0", "--master-addr=10.0.0.7", "--master-port=29401"} <= set(command)
    # The command the flow logs for node 1: the same but for its rank.
    assert launch.for_node(1).command() == [a.replace("--node-rank=0", "--node-rank=1") for a in command]


@pytest.mark.usefixtures("no_gpu")
def test_a_server_started_placed_names_the_rollout_cores_and_the_trainer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_core.vllm_server.cpu_placement import embedded_placement

    prov = LocalProvisioner()
    server = type("Placed", (), {"placement": embedded_placement(range(8))})()
    prov.servers["http://127.0.0.1:8000"] = server
    env = prov.training_env(launch("http://127.0.0.1:8000", 2))
    assert (env["OMP_NUM_THREADS"], env["GRPO_ROLLOUT_CPUS"]) == ("2", "0-3")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert prov.training_env(launch("http://127.0.0.1:8000", 2))["OMP_NUM_THREADS"] == "3"  # the user's setting wins


@pytest.mark.usefixtures("no_gpu")
def test_a_server_started_unplaced_leaves_the_rollout_worker_alone() -> None:
    prov = LocalProvisioner()
    prov.servers["http://127.0.0.1:8000"] = type("Unplaced", (), {"placement": None})()
    assert "GRPO_ROLLOUT_CPUS" not in prov.training_env(launch("http://127.0.0.1:8000"))
