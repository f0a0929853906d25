"""The weight-transfer rendezvous admits only a process that presents the run's secret (no vLLM server).

The trainer side runs here (``StoreGate`` + ``TCPStore`` + gloo rank 0, as ``GlooTrainerWeightTransferEngine``
builds them); the processes that dial it are spawned: one that connects as a plain ``TCPStore``
client (no secret), one that dials through ``StoreDialer`` with a wrong secret, and the one with the
right secret, which joins the gloo group and receives a broadcast. The full path through a real
vLLM server (its worker dials with the secret from the init info) is every weight push in the
integration tests, e.g. ``tests/integration/test_async_loop.py``.

A rendezvous port taken between its choice and its bind raises ``PortTaken`` before anything is sent to the server,
and the weight sync chooses another (``ProtocolWeightSync``, ``PORT_ATTEMPTS``).

    .venv/bin/python -m pytest -q tests/test_gated_store.py
"""

from __future__ import annotations

import json
import socket
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from grpo_core.sync.wire import gated_store
from grpo_core.sync.wire.gated_store import StoreDialer, StoreGate, gloo_group, member_store, new_secret, trainer_store
from tests import child_processes

TIMEOUT = timedelta(seconds=60)


def _plain_client(port: int, out: str) -> None:
    """Dial the rendezvous as torch does, with no secret."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=2))
        store.set("rank_1", "rogue")
        result = {"joined": True}
    except Exception as exc:  # noqa: BLE001 - what happened is the result
        result = {"joined": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    Path(out).write_text(json.dumps(result))


def _member(port: int, secret: str, out: str) -> None:
    """Dial through ``StoreDialer`` with ``secret``; with the right one, join as rank 1 and receive."""
    try:
        dialer = StoreDialer("127.0.0.1", port, secret)
        store = member_store(dialer, 2, timedelta(seconds=2) if secret.startswith("00") else TIMEOUT)
        group = gloo_group(store, 1, 2, TIMEOUT, bind_address="127.0.0.1")
        buffer = torch.zeros(4)
        group.broadcast(buffer, 0).wait()
        group.shutdown()
        result = {"joined": True, "received": buffer.tolist()}
    except Exception as exc:  # noqa: BLE001
        result = {"joined": False, "error": f"{type(exc).__name__}: {exc}"[:300], "trace": traceback.format_exc()[-800:]}
    Path(out).write_text(json.dumps(result))


def _run(target, *args) -> dict:
    proc = child_processes.context().Process(target=target, args=args)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"{target.__name__} exited with {proc.exitcode}"
    return json.loads(Path(args[-1]).read_text())


def test_rendezvous_refuses_a_process_without_the_secret(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(gated_store, "HANDSHAKE_TIMEOUT_S", 2.0)
    secret = new_secret()
    gate = StoreGate("127.0.0.1", 0, secret)
    # Listening on the chosen interface only; the store itself on loopback behind the gate.
    assert gate.listen_socket.getsockname()[0] == "127.0.0.1"
    assert gate.store_socket.getsockname()[0] == "127.0.0.1" and gate.store_port != gate.port
    rank0: dict = {}

    def host() -> None:
        try:
            store = trainer_store(gate, 2, TIMEOUT)
            group = gloo_group(store, 0, 2, TIMEOUT, bind_address="127.0.0.1")
            group.broadcast(torch.arange(4.0) + 1, 0).wait()
            rank0["store_keys"] = sorted(store.list_keys()) if hasattr(store, "list_keys") else []
            group.shutdown()
            rank0["ok"] = True
        except Exception as exc:  # noqa: BLE001
            rank0["error"] = repr(exc)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()

    plain = _run(_plain_client, gate.port, str(tmp_path / "plain.json"))
    assert plain["joined"] is False, plain
    wrong = _run(_member, gate.port, "00" * 32, str(tmp_path / "wrong.json"))
    assert wrong["joined"] is False, wrong
    # torch's store client redials until its timeout: every attempt was refused, and said once.
    assert len(gate.refused) >= 2, gate.refused
    assert sum("refused a connection from 127.0.0.1" in r.getMessage() for r in caplog.records) == 1
    assert thread.is_alive(), f"rank 0 gave up waiting: {rank0}"  # the store never saw the refused ones

    right = _run(_member, gate.port, secret, str(tmp_path / "right.json"))
    assert right == {"joined": True, "received": [1.0, 2.0, 3.0, 4.0]}, right
    thread.join(60)
    assert rank0.get("ok"), rank0
    gate.close()


def test_rendezvous_is_not_reachable_on_other_interfaces():
    from grpo_core.sync.wire.address import local_address_towards

    try:
        other = local_address_towards("192.0.2.1")  # the interface a route outward uses (nothing is sent)
    except OSError:
        other = "127.0.0.1"
    if other.startswith("127."):
        pytest.skip("this host has no interface besides loopback")
    others = {other}
    gate = StoreGate("127.0.0.1", 0, new_secret())
    try:
        for address in others:
            with pytest.raises(OSError):
                socket.create_connection((address, gate.port), timeout=2).close()
    finally:
        gate.close()


def test_a_gate_on_a_port_taken_since_its_choice_says_so_and_holds_no_socket():
    """``PortTaken`` (the caller may choose again), and no loopback socket left bound behind it."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        opened: list[socket.socket] = []
        real_create_server = socket.create_server

        def recording_create_server(*args, **kwargs):
            opened.append(real_create_server(*args, **kwargs))
            return opened[-1]

        gated_store.socket.create_server = recording_create_server
        try:
            with pytest.raises(gated_store.PortTaken, match=f"127.0.0.1:{port} was taken"):
                StoreGate("127.0.0.1", port, new_secret())
        finally:
            gated_store.socket.create_server = real_create_server
        assert opened == []  # the chosen port is bound first: nothing was opened before it failed


def test_the_weight_sync_chooses_another_port_when_its_first_is_taken(monkeypatch):
    """``ProtocolWeightSync`` tries ``PORT_ATTEMPTS`` ports, each chosen afresh, and gives up after the last."""
    from grpo_core.sync import protocol

    class Control:
        base_url = "http://127.0.0.1:9"

        def world_size(self) -> int:
            return 1

    class Source:
        def metadata(self):
            return []

    chosen, tried = iter([41001, 41002, 41003, 41004]), []
    monkeypatch.setattr(protocol, "choose_port", lambda address, port_range=None: next(chosen))

    def engine_on(taken: set[int]):
        def make(backend, control, source, rank, address, port, *rest):
            tried.append(port)
            if port in taken:
                raise gated_store.PortTaken(f"{address}:{port} was taken")
            return type("Engine", (), {})()
        return make

    monkeypatch.setattr(protocol, "_trainer_engine", engine_on({41001}))
    sync = protocol.ProtocolWeightSync(Control(), Source(), "gloo", master_address="127.0.0.1")
    assert tried == [41001, 41002] and sync.engine is not None
    tried.clear()
    monkeypatch.setattr(protocol, "_trainer_engine", engine_on({41003, 41004, 41005}))
    chosen = iter([41003, 41004, 41005, 41006])
    monkeypatch.setattr(protocol, "choose_port", lambda address, port_range=None: next(chosen))
    with pytest.raises(gated_store.PortTaken):
        protocol.ProtocolWeightSync(Control(), Source(), "gloo", master_address="127.0.0.1")
    assert tried == [41003, 41004, 41005] and protocol.PORT_ATTEMPTS == 3
