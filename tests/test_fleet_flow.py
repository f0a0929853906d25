"""The flow's side of a fleet: cores per replica, the trainers' environment, starting the replicas, the keeper that
starts a dead server again, and the job's server section."""

from __future__ import annotations

import os
from typing import Any

import pytest

from flows import train_flow
from flows.fleet_keeper import FleetKeeper
from flows.provision import LocalProvisioner, TrainingLaunch
from grpo_core.config import ConfigError
from grpo_core.launch.job import JobConfig, ServerParams
from grpo_core.vllm_server.cpu_placement import joined, replica_placement
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec


def test_two_servers_on_two_cores_share_core_0_and_leave_the_trainer_core_1():
    a, b = (replica_placement([0, 1], i, 2) for i in range(2))
    assert (a.trainer, a.generation, a.engine) == ((1,), (0,), (0,))
    assert (b.trainer, b.generation, b.engine) == ((1,), (0,), (0,))


@pytest.mark.parametrize("cores,replicas,generation", [
    (8, 2, [(0, 1), (2, 3)]),
    (8, 3, [(0, 1), (2,), (3,)]),
    (16, 4, [(0, 1), (2, 3), (4, 5), (6, 7)]),
])
def test_more_cores_give_each_server_its_own_run_of_them(cores: int, replicas: int, generation: list):
    placements = [replica_placement(range(cores), i, replicas) for i in range(replicas)]
    assert [p.generation for p in placements] == generation
    assert all(p.trainer == tuple(range(cores // 2, cores)) for p in placements)
    assert all(p.engine == (p.generation[:-1] or p.generation) for p in placements)
    both = joined(placements)
    assert both.generation == tuple(c for g in generation for c in g) and both.trainer == placements[0].trainer


@pytest.mark.parametrize("cores,replicas,threads", [(2, 2, [1, 1]), (8, 2, [1, 1]), (12, 2, [2, 2]), (16, 3, [2, 2, 1])])
def test_each_replicas_in_engine_worker_runs_a_thread_per_core_of_its_own(cores: int, replicas: int, threads: list):
    """A CPU server's worker runs in its engine process (``cpu_worker_in_engine``) with ``OMP_NUM_THREADS`` threads:
    a replica's count comes from its own engine cores, so servers side by side do not oversubscribe the machine."""
    spec = VLLMServerSpec(model="m")
    servers = [VLLMServer(spec.for_replica(i), "/tmp/unused", placement=replica_placement(range(cores), i, replicas))
               for i in range(replicas)]
    assert all(s.spec.runs_worker_in_engine for s in servers)
    assert [s.engine_threads() for s in servers] == threads
    assert [s.engine_threads() for s in servers] == [len(s.placement.engine) for s in servers]


def test_a_replica_outside_the_fleet_is_refused():
    with pytest.raises(ValueError, match="replica 2 of 2"):
        replica_placement(range(4), 2, 2)


def test_the_trainers_of_a_fleet_get_every_servers_generation_cores(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("flows.provision._has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    prov = LocalProvisioner()
    for i, url in enumerate(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]):
        prov.servers[url] = type("Placed", (), {"placement": replica_placement(range(8), i, 2)})()
    launch = TrainingLaunch(job_file="j", server_url="http://127.0.0.1:8001,http://127.0.0.1:8002", model_path="m",
                            mlflow_run_id=None, tracking_uri=None, result_file="r")
    env = prov.training_env(launch)
    assert env["GRPO_ROLLOUT_CPUS"] == "0-3" and env["OMP_NUM_THREADS"] == "4"


class FakeProvisioner:
    def __init__(self, fail_replica: int | None = None) -> None:
        self.started: list[tuple[int, int]] = []
        self.stopped: list[str] = []
        self.alive: dict[str, bool] = {}
        self.restarts: list[str] = []
        self.fail_restart = 0
        self.fail_replica = fail_replica

    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float, replica: int = 0,
                     replicas: int = 1) -> str:
        if replica == self.fail_replica:
            raise RuntimeError(f"replica {replica} did not start")
        self.started.append((replica, spec.seed))
        url = f"http://127.0.0.1:{8000 + replica}"
        self.alive[url] = True
        return url

    def stop_server(self, url: str) -> None:
        self.stopped.append(url)

    def server_alive(self, url: str) -> bool:
        return self.alive[url]

    def restart_server(self, url: str, timeout_s: float) -> None:
        if self.fail_restart:
            self.fail_restart -= 1
            raise RuntimeError("no room for it")
        self.restarts.append(url)
        self.alive[url] = True

    def trains_on_gpu(self) -> bool:
        return False


def job(**server: Any) -> JobConfig:
    return JobConfig(server={"replicas": 2, **server})


def test_the_flow_starts_every_replica_with_its_own_seed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(train_flow, "server_spec", lambda job, path, prov: VLLMServerSpec(model="m", seed=7))
    prov = FakeProvisioner()
    urls = train_flow.start_servers.fn(prov, job(), "m", "/tmp")
    assert urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert sorted(prov.started) == [(0, 7), (1, 8)]


def test_a_replica_that_fails_to_start_stops_the_others(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(train_flow, "server_spec", lambda job, path, prov: VLLMServerSpec(model="m"))
    prov = FakeProvisioner(fail_replica=1)
    with pytest.raises(RuntimeError, match="replica 1 did not start"):
        train_flow.start_servers.fn(prov, job(), "m", "/tmp")
    assert prov.stopped == ["http://127.0.0.1:8000"]


def test_the_keeper_starts_a_dead_server_again_and_reports_it():
    prov = FakeProvisioner()
    urls = [prov.start_server(VLLMServerSpec(model="m"), "/tmp", 1, i, 2) for i in range(2)]
    events: list[tuple[str, str]] = []
    keeper = FleetKeeper(prov, urls, startup_timeout_s=5, on_event=lambda url, what, s: events.append((url, what)))
    keeper.look_at(urls[0])
    assert events == [] and prov.restarts == []
    prov.alive[urls[1]] = False
    prov.fail_restart = 1
    keeper.look_at(urls[1])  # the first restart fails: reported, tried again at the next look
    keeper.look_at(urls[1])
    assert events == [(urls[1], "left"), (urls[1], "failed"), (urls[1], "left"), (urls[1], "back")]
    assert prov.restarts == [urls[1]] and keeper.restarts[urls[1]] == 1


def test_the_keeper_thread_runs_while_the_block_does():
    prov = FakeProvisioner()
    url = prov.start_server(VLLMServerSpec(model="m"), "/tmp", 1)
    prov.alive[url] = False
    with FleetKeeper(prov, [url], startup_timeout_s=5, poll_s=0.01):
        for _ in range(500):
            if prov.restarts:
                break
            os.sched_yield()
            import time

            time.sleep(0.01)
    assert prov.restarts == [url]


def test_the_server_section_takes_replicas_or_an_external_fleets_urls():
    assert JobConfig().server.replicas == 1
    external = ServerParams(managed=False, base_url=["http://a:8000", "http://b:8000"])
    assert external.urls() == ["http://a:8000", "http://b:8000"]
    assert ServerParams(managed=False, base_url="http://a:8000").urls() == ["http://a:8000"]
    with pytest.raises(ConfigError, match="replicas counts the servers the flow starts"):
        ServerParams(managed=False, base_url="http://a:8000", replicas=2)
    with pytest.raises(Exception, match="replicas"):
        JobConfig(server={"replicas": 0})


def test_the_trainer_takes_a_fleet_from_the_launchs_comma_joined_urls(tmp_path):
    from grpo_core.launch.__main__ import parse_args

    args = parse_args(["job.json", "--server-url", "http://a:1,http://b:2"])
    urls = [u for u in args.server_url.split(",") if u]
    config = JobConfig().trainer_config(vllm_server_base_url=urls)
    assert config.server_urls() == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="lora_sync_mode"):
        config.replace(lora_sync_mode="adapter")
