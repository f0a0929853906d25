"""``Outbox``: tracking calls delivered in order by a thread, retried while the server is down (no server).

The real MLflow outage is in ``tests/integration/test_flaky_services.py``.

    .venv/bin/python -m pytest -q tests/test_outbox.py
"""

from __future__ import annotations

import threading
import time

import pytest

from grpo_core.tracking import outbox as outbox_module
from grpo_core.tracking.outbox import Outbox


class Server:
    """Stores calls; ``down`` makes them fail like a refused connection."""

    def __init__(self):
        self.down = threading.Event()
        self.stored: list[int] = []

    def call(self, value: int) -> None:
        if self.down.is_set():
            raise ConnectionError("refused")
        self.stored.append(value)


class Refused(Exception):
    error_code = "INVALID_PARAMETER_VALUE"


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(outbox_module, "_BACKOFF_FIRST_S", 0.01)
    monkeypatch.setattr(outbox_module, "_BACKOFF_MAX_S", 0.05)


def test_calls_wait_out_an_outage_and_arrive_in_order_once():
    server = Server()
    box = Outbox("test")
    server.down.set()
    started = time.monotonic()
    for i in range(20):
        box.put(f"call {i}", lambda i=i: server.call(i))
    assert time.monotonic() - started < 0.5  # put never waits for the server
    time.sleep(0.3)
    assert server.stored == [] and len(box.undelivered()) == 20
    server.down.clear()
    assert box.flush(10.0) == []
    assert server.stored == list(range(20))
    box.close(1.0)


def test_a_refused_call_is_dropped_and_named_and_the_rest_goes_on(caplog):
    server = Server()
    box = Outbox("test")

    def bad() -> None:
        raise Refused("metric value is not finite")

    box.put("call 0", lambda: server.call(0))
    box.put("bad metric", bad)
    box.put("call 2", lambda: server.call(2))
    assert box.flush(5.0) == []
    assert server.stored == [0, 2] and box.refused == ["bad metric"]
    assert any("refused bad metric for good" in r.getMessage() for r in caplog.records)
    box.close(1.0)


def test_flush_names_what_a_server_that_stays_down_did_not_take():
    server = Server()
    server.down.set()
    box = Outbox("test")
    box.put("metrics of step 7", lambda: server.call(7))
    assert box.close(0.2) == ["metrics of step 7"]
    with pytest.raises(RuntimeError, match="closed"):
        box.put("late", lambda: None)
