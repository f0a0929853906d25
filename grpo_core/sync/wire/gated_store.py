"""A weight-transfer rendezvous that only the server given the run's secret can join (gloo backend).

The trainer's rank 0 hosts the rendezvous store that the vLLM workers dial. torch's ``TCPStore`` has
no authentication, and anyone who reaches it can list its keys, read the gloo addresses and join
the group in the server's place (and receive the weights) or break it. So the store listens on
loopback only, and the address the server dials is a gate in front of it:

    server worker                                  trainer rank 0
    TCPStore client → StoreDialer (loopback) ──TCP──→ StoreGate (chosen interface:port) → TCPStore (loopback)
                      sends MAGIC + secret             checks it, answers ACK, then relays bytes

``StoreGate`` reads ``MAGIC`` and the 32-byte secret first; a connection that does not send them
within ``HANDSHAKE_TIMEOUT_S`` is closed and logged (refused), so the store never sees it. The secret
is fresh per rendezvous (``new_secret``) and reaches the server inside the init info of
``/init_weight_transfer_engine``, i.e. over the server's dev-mode HTTP API, which the deployment
keeps in-cluster (README, ``infra/kubernetes/network-policy.yaml``).

Both sides also bind their gloo data-plane sockets to the interface of the rendezvous
(``gloo_group(bind_address=...)``), not to whatever the host name resolves to; their ports are
ephemeral and published only through the gated store.
"""

from __future__ import annotations

import errno
import hmac
import logging
import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"GRPO-WT1"
ACK = b"\x06"
SECRET_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
_CHUNK = 1 << 16


def new_secret() -> str:
    """A fresh secret for one rendezvous, as hex (it travels in JSON)."""
    return secrets.token_hex(SECRET_BYTES)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s sending side."""
    try:
        while chunk := src.recv(_CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for action in (lambda: dst.shutdown(socket.SHUT_WR), src.close):
            try:
                action()
            except OSError:
                pass


def _relay(a: socket.socket, b: socket.socket, name: str) -> None:
    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=_pipe, args=(src, dst), name=name, daemon=True).start()


class _Listener:
    """A listening socket whose connections go to ``_serve`` on a daemon thread until ``close``."""

    def __init__(self, listen_socket: socket.socket, name: str):
        self.listen_socket = listen_socket
        self._closed = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listen_socket.accept()
            except OSError:
                return  # closed
            self._serve(conn, peer)

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        try:
            self.listen_socket.close()
        except OSError:
            pass


class PortTaken(OSError):
    """The rendezvous port, free when it was chosen, was bound by something else before the gate bound it: nothing
    has been sent to the server yet, so the caller may choose another and try again."""


class StoreGate(_Listener):
    """Trainer side: the public listener that admits only connections carrying the secret.

    ``listen_socket`` is bound to the chosen interface and port (the server dials it); ``store_socket``
    is the loopback socket to hand to the ``TCPStore`` as its listening socket.
    """

    def __init__(self, address: str, port: int, secret: str):
        self.secret = bytes.fromhex(secret)
        self.address = address
        self.refused: list[str] = []
        # Bind the chosen port first: it was free when chosen but not reserved, and a loopback socket bound before
        # it to any port (the kernel's pick) could be handed that very port.
        try:
            listen_socket = socket.create_server((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortTaken(f"the weight-transfer rendezvous port {address}:{port} was taken after it was chosen "
                                "free") from exc
            raise
        self.port = listen_socket.getsockname()[1]
        try:
            self.store_socket = socket.create_server(("127.0.0.1", 0))
        except BaseException:
            listen_socket.close()
            raise
        self.store_port = self.store_socket.getsockname()[1]
        super().__init__(listen_socket, "rendezvous-gate")

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        # Each check on its own thread: a dialer that never sends its hello must not hold up the next.
        threading.Thread(target=self._admit, args=(conn, peer), name="rendezvous-gate-check", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            hello = _recv_exactly(conn, len(MAGIC) + SECRET_BYTES)
        except OSError:
            hello = b""
        if not (hello.startswith(MAGIC) and hmac.compare_digest(hello[len(MAGIC):], self.secret)):
            who = f"{peer[0]}:{peer[1]}"
            # torch's store clients redial until their timeout: one line per host, every refusal counted.
            if all(not r.startswith(f"{peer[0]}:") for r in self.refused):
                log.warning("weight-transfer rendezvous on %s:%d refused a connection from %s: it did not present "
                            "this run's secret (further refusals of this host are counted, not logged)",
                            self.address, self.port, who)
            self.refused.append(who)
            conn.close()
            return
        conn.settimeout(None)
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port))
            conn.sendall(ACK)
        except OSError as err:
            log.warning("rendezvous store unreachable behind the gate: %s", err)
            conn.close()
            return
        _relay(conn, store, "rendezvous-gate-relay")


class StoreDialer(_Listener):
    """Server side: a loopback port for the ``TCPStore`` client that dials the gate with the secret."""

    def __init__(self, address: str, port: int, secret: str):
        self.upstream = (address, port)
        self.secret = bytes.fromhex(secret)
        listen_socket = socket.create_server(("127.0.0.1", 0))
        self.port = listen_socket.getsockname()[1]
        super().__init__(listen_socket, "rendezvous-dialer")

    def _serve(self, local: socket.socket, peer: Any) -> None:
        try:
            remote = socket.create_connection(self.upstream, timeout=HANDSHAKE_TIMEOUT_S)
            remote.sendall(MAGIC + self.secret)
            if _recv_exactly(remote, len(ACK)) != ACK:
                raise ConnectionRefusedError(f"the trainer's rendezvous at {self.upstream[0]}:{self.upstream[1]} "
                                             "refused this server's secret")
            remote.settimeout(None)
        except OSError as err:
            log.error("weight-transfer rendezvous: %s", err)
            local.close()
            return
        _relay(local, remote, "rendezvous-dialer-relay")


def trainer_store(gate: StoreGate, world_size: int, timeout: timedelta) -> Any:
    """The rendezvous ``TCPStore`` of rank 0, listening on the gate's loopback socket only; it returns
    once the other ``world_size - 1`` members came through the gate."""
    from torch.distributed import TCPStore

    fd = gate.store_socket.detach()
    try:
        return TCPStore(host_name="127.0.0.1", port=gate.store_port, world_size=world_size, is_master=True,
                        timeout=timeout, master_listen_fd=fd, multi_tenant=True)
    except Exception:
        socket.close(fd)
        raise


def member_store(dialer: StoreDialer, world_size: int, timeout: timedelta) -> Any:
    """A member's ``TCPStore`` client, reaching rank 0's store through ``dialer``."""
    from torch.distributed import TCPStore

    return TCPStore(host_name="127.0.0.1", port=dialer.port, world_size=world_size, is_master=False, timeout=timeout)


def gloo_group(store: Any, rank: int, world_size: int, timeout: timedelta, bind_address: str) -> Any:
    """A gloo process group outside ``torch.distributed``'s global state, its sockets on ``bind_address``."""
    import torch
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    prefixed = PrefixStore("grpo-weight-transfer", store)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=bind_address)]
    backend = ProcessGroupGloo(prefixed, rank, world_size, options)
    group = ProcessGroup(prefixed, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group
