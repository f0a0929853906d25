"""A restarted server's samples are never trained, and the trainer notices the restart (no server).

The pieces, each on scripted inputs: the rollout worker's generate client resends to a server that
does not answer, with backoff, for ``server_unavailable_timeout_s``; a weight version the trainer
never pushed maps to ``UNKNOWN_VERSION`` and the collector drops such samples; a collection cut
short by a restart keeps what it gathered; ``ServerWatch`` tells a restart (another weight version,
another process) from a pause. The real restart is ``tests/integration/test_server_restart.py``.

    .venv/bin/python -m pytest -q tests/test_server_watch.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import numpy as np
import pytest

from grpo_core.checkpoint.ledger import server_restarts
from grpo_core.rollout import generation as generation_module
from grpo_core.rollout.generation import VLLMGenerateClient
from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.rollout.stages import UNKNOWN_VERSION, version_number
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.training.collector import (
    COLLECTION_INTERRUPTED,
    StepCollector,
    TrainingFrontier,
    WatchedSource,
    WeightVersions,
)
from grpo_core.fleet.servers import RunServers
from grpo_core.ranks import DistInfo
from grpo_core.vllm_server.watch import ServerUnavailableError, ServerWatch

REPLY = {"choices": [{"token_ids": [7], "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "stop",
                      "weight_versions": [{"version": "3", "start": 0, "end": 1}]}]}


def generate_with(failures: int, window_s: float, monkeypatch) -> tuple[list, int]:
    """Generate through a transport that refuses ``failures`` connections first."""
    monkeypatch.setattr(generation_module, "RESEND", dataclasses.replace(generation_module.RESEND, first_s=0.01, max_s=0.01))
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return httpx.Response(200, json=REPLY)

    async def go():
        client = VLLMGenerateClient("http://unused", unavailable_timeout_s=window_s)
        client._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(handler))
        try:
            return await client.generate([1, 2], {"max_tokens": 1})
        finally:
            await client.aclose()

    return asyncio.run(go()), len(calls)


def test_generate_waits_for_a_server_that_is_down_within_the_window(monkeypatch):
    (choice,), calls = generate_with(failures=40, window_s=30.0, monkeypatch=monkeypatch)
    assert calls == 41 and choice.weight_versions == [("3", 0, 1)]


def test_generate_gives_up_after_the_window(monkeypatch):
    with pytest.raises(httpx.ConnectError):
        generate_with(failures=10_000, window_s=0.3, monkeypatch=monkeypatch)
    # Without a window only the immediate resends for a closing keep-alive connection remain.
    with pytest.raises(httpx.ConnectError):
        generate_with(failures=3, window_s=0.0, monkeypatch=monkeypatch)


def test_versions_the_trainer_never_set_are_unknown():
    assert version_number("default") == UNKNOWN_VERSION == -1
    assert version_number("12") == 12
    versions = WeightVersions([0, 2, 4])
    assert [versions.was_pushed(v) for v in (UNKNOWN_VERSION, 0, 1, 2, 4, 5)] == [False, True, False, True, True, False]


# ------------------------------------------------------------------------------------------ collector
def sample(position: int, version: int) -> RolloutSample:
    tokens = np.array([1, 2, 3, 4], dtype=np.int32)
    return RolloutSample(token_ids=tokens, completion_mask=np.array([False, False, True, True]),
                         sampler_logprobs=np.zeros(4, dtype=np.float32), advantage=1.0, reward=1.0, group_id=position,
                         row_index=position, epoch=0, rollout_id=f"r{position}-{version}-{np.random.rand()}",
                         policy_version=version, position=position)


def report(position: int, n: int) -> GroupReport:
    return GroupReport(position=position, row_index=position, epoch=0, rewards=np.ones(n), rewards_per_func={},
                       num_samples=n, dropped=False)


class ListSource:
    def __init__(self, items):
        self.items = list(items)

    def get(self, timeout_s: float):
        return self.items.pop(0)


def collector(items, max_samples: int = 4) -> StepCollector:
    return StepCollector(source=ListSource(items), world_size=1, gradient_accumulation_steps=1, token_budget=1000,
                         max_samples_per_step=max_samples, max_staleness=1000, flat=False, frontier=TrainingFrontier(),
                         timeout_s=1.0)


def test_samples_of_versions_never_pushed_are_dropped_and_counted():
    # However lax max_staleness is, a sample from the restarted server's disk weights never trains.
    items = [report(0, 4), sample(0, 3), sample(0, UNKNOWN_VERSION), sample(0, 5), sample(0, 3), END_OF_DATA]
    c = collector(items)
    batch = c.collect(WeightVersions([0, 3]))
    assert [s.policy_version for s in batch.samples] == [3, 3]
    assert batch.foreign_dropped == 2 and c.foreign_dropped_total == 2
    assert c.frontier.position == 0  # the group's two trained samples are not marked trained yet
    c.mark_trained(batch)
    assert c.frontier.position == 1  # dropped ones count as consumed, as stale ones do


def test_an_interrupted_collection_keeps_what_it_gathered():
    items = [report(0, 3), sample(0, 0), COLLECTION_INTERRUPTED, sample(0, 0), sample(0, 0), END_OF_DATA]
    c = collector(items, max_samples=3)
    versions = WeightVersions([0])
    assert c.collect(versions) == COLLECTION_INTERRUPTED
    batch = c.collect(versions)
    assert len(batch.samples) == 3 and [r.position for r in batch.reports] == [0]
    assert len(batch.plan.rows) == 1 and len(batch.plan.rows[0].samples) == 3


# ------------------------------------------------------------------------------------------ the watch
class FakeServer:
    """The control routes the watch reads; ``down`` refuses connections, ``restart`` is a new process."""

    base_url = "http://fake"

    def __init__(self):
        self.version = "default"
        self.started = 1000.0
        self.down_for = 0  # calls refused before it answers again

    def _refuse(self) -> None:
        if self.down_for > 0:
            self.down_for -= 1
            raise httpx.ConnectError("[Errno 111] Connection refused")

    def weight_version(self, timeout: float | None = None) -> str:
        self._refuse()
        return self.version

    def models(self) -> list[dict]:
        self._refuse()
        return [{"root": "/models/tiny"}]

    def metrics_text(self) -> str | None:
        return f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {self.started}\n"


@pytest.fixture
def fast_backoff(monkeypatch):
    import grpo_core.vllm_server.watch as watch_module

    monkeypatch.setattr(watch_module, "ANSWER", dataclasses.replace(watch_module.ANSWER, first_s=0.01, max_s=0.01))


def test_watch_notices_a_version_it_did_not_push(fast_backoff):
    server = FakeServer()
    watch = ServerWatch(server, unavailable_timeout_s=5.0)
    assert watch.restarted() is None  # nothing pushed yet
    server.version = "4"
    watch.after_push([0, 4])
    assert watch.restarted() is None
    server.version = "default"  # restarted on its disk weights
    assert "'default'" in watch.restarted()


def test_watch_waits_for_the_server_and_compares_its_identity(fast_backoff):
    server = FakeServer()
    server.version = "4"
    watch = ServerWatch(server, unavailable_timeout_s=5.0)
    watch.after_push([4])
    server.down_for = 5  # a pause: the same process answers again
    assert watch.restarted() is None
    server.down_for, server.started = 5, 2000.0  # a new process that was given the same label
    assert "another process" in watch.restarted()


def test_watch_gives_up_naming_the_server(fast_backoff):
    server = FakeServer()
    server.version = "1"
    watch = ServerWatch(server, unavailable_timeout_s=0.2)
    watch.after_push([1])
    server.down_for = 10**9
    with pytest.raises(ServerUnavailableError, match=r"http://fake did not answer .*server_unavailable_timeout_s=0.2"):
        watch.restarted()


def test_a_restart_right_after_a_push_is_noticed(fast_backoff):
    server = FakeServer()
    watch = ServerWatch(server, unavailable_timeout_s=5.0)
    watch.after_push([7])  # the server reads "default": it restarted between the push and the read-back
    assert "right after a push" in watch.restarted()
    assert watch.restarted() is None  # told once: the trainer pushes again, and the read-back starts over


def test_watched_source_interrupts_the_wait_when_the_server_restarted(fast_backoff):
    class SilentWorker:
        def get(self, timeout_s):
            time.sleep(timeout_s)
            raise TimeoutError("nothing")

    server = FakeServer()
    server.version = "2"
    watch = ServerWatch(server, unavailable_timeout_s=5.0)
    watch.after_push([2])
    fleet = RunServers(["http://fake"], DistInfo(), make_pusher=lambda url, control, watch: None,
                        make_control=lambda url: server, make_watch=lambda control: watch)
    source = WatchedSource(SilentWorker(), fleet, check_every_s=0.05)
    with pytest.raises(TimeoutError):
        source.get(0.2)  # the same server: the worker's silence is the worker's
    server.version = "default"
    assert source.get(10.0) == COLLECTION_INTERRUPTED
    assert "'default'" in watch.restarted()  # kept for the trainer's check before it collects again


def test_ledger_counts_restarts_per_attempt():
    steps = [{"attempt": 1, "step": 1, "server_restarts": 0}, {"attempt": 1, "step": 2, "server_restarts": 1},
             {"attempt": 1, "step": 3, "server_restarts": 1}, {"attempt": 2, "step": 3},
             {"attempt": 2, "step": 4, "server_restarts": 2}]
    assert server_restarts(steps) == 3
