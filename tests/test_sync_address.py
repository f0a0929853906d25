"""The weight-transfer rendezvous address and port (``grpo_core.sync.wire.address``), on loopback."""

from __future__ import annotations

import socket
import threading

import pytest

from grpo_core.sync.wire.address import choose_port, local_address_towards, parse_port_range, rendezvous_address


def _loopback_server(host: str) -> tuple[socket.socket, int]:
    server = socket.create_server((host, 0))
    return server, server.getsockname()[1]


def test_a_loopback_server_gets_an_address_it_can_dial_back():
    # A "server" listening on 127.0.0.2 (Linux routes all of 127/8 to lo) must reach a store bound
    # on the address the trainer resolves for it: bind there, dial from the server's address.
    server, port = _loopback_server("127.0.0.2")
    with server:
        address = local_address_towards(f"http://127.0.0.2:{port}/v1")
        assert address.startswith("127.")
        store = socket.create_server((address, 0))
        with store:
            accepted: list[str] = []
            thread = threading.Thread(target=lambda: accepted.append(store.accept()[1][0]))
            thread.start()
            with socket.create_connection(store.getsockname(), source_address=("127.0.0.2", 0)):
                thread.join(timeout=5)
            assert accepted == ["127.0.0.2"]


def test_a_bare_host_and_a_url_resolve_alike():
    assert local_address_towards("127.0.0.2") == local_address_towards("http://127.0.0.2:8000")


def test_an_explicit_address_wins_over_resolution():
    assert rendezvous_address("http://127.0.0.2:8000", override="10.9.8.7") == "10.9.8.7"
    assert rendezvous_address("http://127.0.0.2:8000") == local_address_towards("127.0.0.2")


def test_an_unroutable_server_names_the_setting():
    with pytest.raises(OSError, match="master address"):
        rendezvous_address("http://[::1%nosuchif]:8000")


def test_a_url_without_host_is_refused():
    with pytest.raises(ValueError, match="no host"):
        local_address_towards("http://:8000")


@pytest.mark.parametrize(
    ("text", "expected"), [("40000-40100", (40000, 40100)), (" 5000 ", (5000, 5000)), ("1-65535", (1, 65535))]
)
def test_port_ranges_parse(text, expected):
    assert parse_port_range(text) == expected


@pytest.mark.parametrize("text", ["40100-40000", "0-10", "70000", "a-b", "40000-"])
def test_bad_port_ranges_are_refused(text):
    with pytest.raises(ValueError, match="port range"):
        parse_port_range(text)


def test_a_port_is_chosen_inside_the_range_and_is_free():
    busy, busy_port = _loopback_server("127.0.0.1")
    with busy:
        # A range of two ports, one of them taken: the chooser must return the other, every time.
        lo, hi = (busy_port, busy_port + 1) if busy_port < 65535 else (busy_port - 1, busy_port)
        free = hi if lo == busy_port else lo
        for _ in range(5):
            assert choose_port("127.0.0.1", (lo, hi)) == free
        socket.create_server(("127.0.0.1", free)).close()


def test_a_full_range_names_the_range():
    busy, busy_port = _loopback_server("127.0.0.1")
    with busy, pytest.raises(OSError, match=f"port range {busy_port}-{busy_port}"):
        choose_port("127.0.0.1", (busy_port, busy_port))


def test_without_a_range_the_kernel_picks():
    port = choose_port("127.0.0.2")
    socket.create_server(("127.0.0.2", port)).close()
