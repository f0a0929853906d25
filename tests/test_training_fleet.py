"""The trainer's fleet: pushes to every serving server, drains on a failed push or a worker's report, checks and
catches up a returning server, names a server that differs; a fleet of one keeps the single server's behaviour."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from grpo_core.fleet.probe import VersionProbe
from grpo_core.fleet.servers import RunServers
from grpo_core.fleet.weight_push import PushOutcome
from grpo_core.ranks import DistInfo
from grpo_core.sync.base import SyncStats
from grpo_core.sync.errors import WeightSyncError
from grpo_core.fleet import servers as fleet_module
from grpo_core.vllm_server.checks import ServerCapabilities, ServerConfigError
from grpo_core.vllm_server.watch import ServerWatch

CAPS = ServerCapabilities(max_model_len=512, served_model="m", tokens_endpoint=True, candidate_sets=False)


class FakeControl:
    def __init__(self, url: str):
        self.base_url = url
        self.up = True
        self.version = "default"
        self.paused = False
        self.config = {"model_config": {"dtype": "float32", "max_model_len": 512, "max_logprobs": 20,
                                        "logprobs_mode": "processed_logprobs"},
                       "weight_transfer_config": {"backend": "gloo"}}

    def answers(self, route: str = "/v1/models", timeout: float = 2.0) -> bool:
        return self.up

    def weight_version(self, timeout: float | None = None) -> str:
        if not self.up:
            import httpx

            raise httpx.ConnectError("refused")
        return self.version

    def is_paused(self) -> bool:
        return self.paused

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        from grpo_core.vllm_server.control import VLLMRequestError

        raise VLLMRequestError("/finish_weight_update -> HTTP 500: without a matching start", status=500)

    def server_config(self) -> dict[str, Any]:
        return self.config

    def models(self) -> list[dict[str, Any]]:
        return [{"id": "m", "root": "/models/m"}]

    def metrics_text(self) -> str | None:
        return "process_start_time_seconds 1000.0\n"

    def close(self) -> None:
        pass


class FakePusher:
    def __init__(self, control: FakeControl, adapter_base: int | None = None):
        self.control = control
        self.adapter_base = adapter_base  # adapter-only LoRA sync: the server keeps serving these base weights
        self.fail = False
        self.pushed: list[tuple[int, int | None]] = []
        self.reopened = 0
        self.recoveries = 0

    def push(self, version: int, attempts: int | None = None) -> PushOutcome:
        self.pushed.append((version, attempts))
        if self.fail or not self.control.up:
            raise WeightSyncError("transfer broke", server=self.control.base_url, version=version, phase="transfer")
        self.control.version = str(self.served_version(version))
        return PushOutcome(stats=SyncStats(mode="full", bytes=100, seconds=0.5), report=None, attempts=1, check_s=0.1)

    def served_version(self, pushed: int) -> int:
        return pushed if self.adapter_base is None else self.adapter_base

    def reopen(self) -> None:
        self.reopened += 1

    def close(self) -> None:
        pass


class FakeWatch:
    def __init__(self, control: FakeControl):
        self.control = control
        self.expected_version: str | None = None
        self.noted: str | None = None
        self.waited_s = 0.0

    def after_push(self, pushed: list[int]) -> None:
        self.expected_version = self.control.version

    def restarted(self) -> str | None:
        reason, self.noted = self.noted, None
        if reason is None and self.expected_version is not None and self.control.version != self.expected_version:
            reason = f"it serves weight version {self.control.version!r}"
        return reason

    def note_restart(self, reason: str) -> None:
        self.noted = reason


class FakeChecks:
    """Start-up checks: every server answers at once, and ``check(control)`` gives its capabilities."""

    def __init__(self, check: Any = lambda control: CAPS):
        self.check = check

    def wait(self, control: FakeControl) -> None:
        pass


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def make_fleet(n: int = 2, make_pusher: Any = None, make_watch: Any = FakeWatch
               ) -> tuple[RunServers, dict[str, FakeControl], list]:
    controls: dict[str, FakeControl] = {}
    views: list = []

    def control(url: str) -> FakeControl:
        controls[url] = FakeControl(url)
        return controls[url]

    fleet = RunServers([f"http://s{i}:8000" for i in range(n)], DistInfo(),
                        make_pusher=make_pusher or (lambda url, c, w: FakePusher(c)), make_control=control,
                        make_watch=make_watch, clock=Clock(), checks=FakeChecks())
    fleet.connect()
    fleet.check()
    fleet.publish = views.append
    return fleet, controls, views


def test_a_push_reaches_every_server_and_reports_each():
    fleet, _, views = make_fleet()
    metrics = fleet.push(3)
    assert [m.state for m in fleet.members.values()] == ["serving", "serving"]
    assert metrics["sync/servers"] == 2.0 and metrics["sync/seconds"] == 1.0 and metrics["sync/bytes"] == 200.0
    assert metrics["sync/server/s0-8000/seconds"] == 0.5 and metrics["weight_version"] == 3.0
    assert views[-1] == {"s0-8000": ("http://s0:8000", 1), "s1-8000": ("http://s1:8000", 1)}
    # While the other holds the version, a server gets one attempt (a failure drains it rather than waiting).
    assert [p.pusher.pushed[-1][1] for p in fleet.members.values()] == [1, 1]


@pytest.mark.parametrize("n", [1, 2])
def test_adapter_only_lora_pushes_leave_the_base_version_served_and_are_no_restart(n):
    """Adapter-only LoRA sync registers each version as an adapter; the server keeps reporting the version of the
    session's first push. The watch reads that back after each push, and no server is taken for restarted."""
    fleet, controls, _ = make_fleet(n, make_pusher=lambda url, c, w: FakePusher(c, adapter_base=0),
                                    make_watch=lambda c: ServerWatch(c, unavailable_timeout_s=5.0))
    for version in range(4):
        fleet.push(version)
        assert fleet.tend() == [], version
    assert {c.version for c in controls.values()} == {"0"}
    assert [m.state for m in fleet.members.values()] == ["serving"] * n
    controls["http://s0:8000"].version = "default"  # a restart: the base weights of the model folder again
    assert fleet.tend() == ["s0-8000"]


def test_a_failed_push_drains_that_server_and_the_push_is_done_on_the_others(caplog):
    fleet, controls, views = make_fleet()
    fleet.push(1)
    fleet.members["s1-8000"].pusher.fail = True
    with caplog.at_level(logging.WARNING):
        metrics = fleet.push(2)
    assert metrics["sync/servers"] == 1.0
    assert fleet.members["s1-8000"].state == "lost" and views[-1]["s1-8000"] == ("http://s1:8000", 0)
    assert "s1-8000 (http://s1:8000) drained: its push of weight version 2 failed" in caplog.text


class SlowControl(FakeControl):
    """Answers its weight version, or times out (``slow``) like a busy or frozen server."""

    slow = False

    def weight_version(self, timeout: float | None = None) -> str:
        if self.slow:
            import httpx

            raise httpx.ReadTimeout("timed out")
        return super().weight_version(timeout)


def test_a_slow_look_is_no_drain_until_the_silence_lasts_the_window(caplog):
    fleet, controls, _ = make_fleet()
    fleet.drain_after_s = 10.0
    for name in fleet.members:
        fleet.members[name].health.drain_after_s = 10.0
    fleet.push(1)
    member = fleet.members["s1-8000"]
    slow = SlowControl(member.url)
    slow.version = member.control.version
    member.control = slow
    slow.slow = True
    with caplog.at_level(logging.WARNING):
        for now in (1.0, 5.0, 10.9):  # time-outs for 9.9 s since the first unanswered look (at 1 s)
            fleet.clock.now = now
            assert fleet.tend() == [] and member.state == "serving"
        assert caplog.text.count("is slow to answer") == 1  # said once, with when it would be drained
        assert "drained in 10 s unless it answers (server_drain_after_s=10)" in caplog.text
        slow.slow = False
        fleet.clock.now = 12.0
        fleet.tend()  # it answered: the count starts again
        assert "answers again after 11 s; it kept serving" in caplog.text
        slow.slow = True
        for now in (13.0, 22.9):
            fleet.clock.now = now
            fleet.tend()
            assert member.state == "serving"
        fleet.clock.now = 23.0
        fleet.tend()
    assert member.state == "lost" and "has not answered for 10 s" in caplog.text
    metrics = fleet.serving_metrics()
    assert metrics["fleet/drains"] == 1.0 and metrics["fleet/s1-8000/out_s"] == 0.0
    fleet.clock.now = 53.0
    assert fleet.serving_metrics()["fleet/s1-8000/out_s"] == 30.0  # out since 23 s
    slow.slow = False
    member.next_probe = 0.0
    assert fleet.tend() == ["s1-8000"]
    fleet.clock.now = 60.0
    fleet.push(2, only=["s1-8000"])  # admitted again with the current weights
    fleet.clock.now = 100.0
    metrics = fleet.serving_metrics()
    assert member.state == "serving" and metrics["fleet/s1-8000/out_s"] == 37.0 and metrics["fleet/drains"] == 1.0


def test_a_refused_look_drains_at_once():
    fleet, controls, _ = make_fleet()
    fleet.push(1)
    controls["http://s1:8000"].up = False  # ConnectError: nothing listens there
    fleet.tend()
    assert fleet.members["s1-8000"].state == "lost" and fleet.serving_metrics()["fleet/drains"] == 1.0


def test_a_server_drained_by_the_worker_leaves_only_for_the_epoch_it_was_admitted_at():
    fleet, _, _ = make_fleet()
    fleet.push(1)
    fleet.drained_by_worker = lambda: [("s0-8000", 0, "stale report"), ("s1-8000", 1, "refused")]
    assert fleet.tend() == []
    assert fleet.members["s0-8000"].state == "serving" and fleet.members["s1-8000"].state == "lost"


def test_a_lost_server_that_answers_again_is_checked_and_caught_up_before_it_serves():
    fleet, controls, views = make_fleet()
    clock = fleet.clock
    fleet.push(1)
    lost = fleet.members["s1-8000"]
    controls["http://s1:8000"].up = False
    assert fleet.tend() == [] and lost.state == "lost"  # it stopped answering: drained, the other serves on
    controls["http://s1:8000"].up = True
    controls["http://s1:8000"].version = "default"  # restarted on its disk weights
    assert fleet.tend() == []  # not probed again before PROBE_LOST_EVERY_S
    clock.now += fleet_module.PROBE_LOST_EVERY_S
    assert fleet.needs_tending()
    assert fleet.tend() == ["s1-8000"] and lost.state == "joining" and lost.pusher.reopened == 1
    assert views[-1]["s1-8000"][1] == 0  # not before it holds the weights
    fleet.push(1, only=["s1-8000"])
    assert lost.state == "serving" and lost.epoch == 2 and views[-1]["s1-8000"] == ("http://s1:8000", 2)
    assert fleet.rejoins == 1 and controls["http://s1:8000"].version == "1"


def test_a_returning_server_that_differs_stays_out_naming_why(caplog):
    fleet, controls, _ = make_fleet()
    fleet.push(1)
    controls["http://s1:8000"].up = False
    fleet.tend()
    controls["http://s1:8000"].up = True
    controls["http://s1:8000"].config["model_config"]["max_model_len"] = 256
    fleet.clock.now += fleet_module.PROBE_LOST_EVERY_S
    with caplog.at_level(logging.ERROR):
        assert fleet.tend() == []
    assert "does not pass the start-up checks" in caplog.text and "max_model_len: 512 there, 256 here" in caplog.text


def test_the_start_up_check_names_the_server_that_differs():
    fleet, controls, _ = make_fleet(3)
    controls["http://s2:8000"].config["weight_transfer_config"]["backend"] = "nccl"
    with pytest.raises(ServerConfigError, match=r"http://s2:8000 against http://s0:8000 .*weight_transfer_backend"):
        fleet.check()
    other = ServerCapabilities(max_model_len=512, served_model="m", tokens_endpoint=False, candidate_sets=False)
    with pytest.raises(ServerConfigError, match=r"http://s1:8000 against http://s0:8000 \(tokens_endpoint"):
        fleet.checks = FakeChecks(lambda c: other if c.base_url.endswith("s1:8000") else CAPS)
        fleet.check()


def test_a_check_failure_names_the_fleet_server():
    fleet, _, _ = make_fleet()

    def check(control: FakeControl) -> ServerCapabilities:
        if control.base_url.endswith("s1:8000"):
            raise ServerConfigError("the server runs the model in bfloat16")
        return CAPS

    with pytest.raises(ServerConfigError, match=r"fleet server s1-8000 \(http://s1:8000\): the server runs"):
        fleet.checks = FakeChecks(check)
        fleet.check()


def test_a_fleet_of_one_is_never_drained_and_keeps_its_retries():
    fleet, controls, _ = make_fleet(1)
    member = fleet.members["s0-8000"]
    fleet.push(1)
    assert member.pusher.pushed[-1] == (1, None)  # the run's weight_sync_attempts, with waiting recovery
    member.pusher.fail = True
    with pytest.raises(WeightSyncError):
        fleet.push(2)
    assert member.state == "serving"
    member.pusher.fail = False
    controls["http://s0:8000"].version = "default"
    assert fleet.needs_tending() and fleet.tend() == ["s0-8000"]


def test_with_no_server_left_a_push_waits_for_the_first_to_come_back(monkeypatch):
    fleet, controls, _ = make_fleet()
    fleet.push(1)
    for c in controls.values():
        c.up = False
    # Both servers refused the worker's requests (the trainer alone would wait for the last one instead).
    fleet.drained_by_worker = lambda: [("s0-8000", 1, "refused"), ("s1-8000", 1, "refused")]
    fleet.tend()
    fleet.drained_by_worker = lambda: []
    assert fleet.serving() == []
    sleeps = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        fleet.clock.now += s
        if len(sleeps) == 3:
            controls["http://s0:8000"].up = True

    monkeypatch.setattr(fleet_module.time, "sleep", sleep)
    metrics = fleet.push(2)
    assert metrics["sync/servers"] == 1.0 and fleet.members["s0-8000"].state == "serving"
    fleet.unavailable_timeout_s = 5.0
    for c in controls.values():
        c.up = False
    fleet.drained_by_worker = lambda: [("s0-8000", 2, "refused")]
    with pytest.raises(fleet_module.ServerUnavailableError, match="no server of the fleet served for 5 s"):
        fleet.push(3)


def test_the_probe_runs_once_per_version_for_all_servers():
    calls = []
    probe = VersionProbe(lambda ids: calls.append(list(ids)) or len(calls))
    probe.version = 4
    assert probe([1, 2]) == probe([1, 2]) == 1
    probe.version = 5
    assert probe([1, 2]) == 2 and len(calls) == 2


def test_a_server_listed_in_the_fleet_file_joins_once_checked_and_caught_up(tmp_path):
    from grpo_core.fleet.servers import read_fleet_file

    listing = tmp_path / "fleet.txt"
    listing.write_text("# the run's servers\nhttp://s0:8000\n\n")
    fleet, controls, views = make_fleet()
    fleet.listing = lambda: read_fleet_file(str(listing))
    fleet.push(1)
    listing.write_text("http://s0:8000\nhttp://s2:8000/  # added while the run goes on\n")
    fleet.clock.now += fleet_module.PROBE_LOST_EVERY_S
    assert fleet.tend() == ["s2-8000"]  # added, answered, checked: ready for the current weights
    added = fleet.members["s2-8000"]
    assert views[-1].get("s2-8000", ("", 0))[1] == 0  # not routed to before it has them
    fleet.push(1, only=["s2-8000"])
    assert added.state == "serving" and added.epoch == 1 and views[-1]["s2-8000"] == ("http://s2:8000", 1)
    assert fleet.rejoins == 0 and controls["http://s2:8000"].version == "1"


def test_a_push_that_waits_on_its_server_is_counted_as_waited_for_that_server():
    fleet, _, _ = make_fleet()
    slow = fleet.members["s1-8000"].pusher
    push = slow.push

    def frozen_push(version: int, attempts: int | None = None) -> PushOutcome:
        fleet.clock.now += 60.0  # the server thawed a minute later
        return push(version, attempts)

    slow.push = frozen_push
    fleet.members["s0-8000"].pusher.push = lambda v, attempts=None: (
        setattr(fleet.clock, "now", fleet.clock.now + 1.0), FakePusher.push(fleet.members["s0-8000"].pusher, v, attempts)
    )[1]
    fleet.push(1)
    metrics = fleet.serving_metrics()
    assert metrics["fleet/s1-8000/waited_s"] == 60.0 and metrics["fleet/s0-8000/waited_s"] == 0.0  # 1 s: no wait


def test_a_lone_server_that_a_push_waited_for_counts_as_back_once(caplog):
    """A fleet of one waits for its server inside the push (the pusher recovers on a new session): when that push
    gets through, the server came back holding the weights, as one tend() lets back in; later pushes count nothing."""
    fleet, _, _ = make_fleet(1)
    member = fleet.members["s0-8000"]
    fleet.push(1)
    assert fleet.rejoins == 0
    real_push = member.pusher.push

    def push_after_a_recovery(version: int, attempts: int | None = None) -> PushOutcome:
        member.pusher.recoveries += 1  # what WeightPusher._recover counts once the server answers again
        return real_push(version, attempts)

    member.pusher.push = push_after_a_recovery
    with caplog.at_level(logging.WARNING, logger=fleet_module.__name__):
        fleet.push(2)
    assert fleet.rejoins == 1 and member.state == "serving"
    assert "re-pushed weight version 2 to the restarted server" in caplog.text
    member.pusher.push = real_push
    fleet.push(3)
    assert fleet.rejoins == 1
