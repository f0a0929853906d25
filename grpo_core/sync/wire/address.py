"""Where a vLLM server connects back to for the weight-transfer rendezvous: address and port.

The trainer's rank 0 hosts the rendezvous store; every server worker dials it. The address must be
the trainer's as seen *from the server*: on one host a loopback address works, but a server on
another host or pod needs the interface that routes there. ``local_address_towards(url)`` asks the
kernel which local address it would use to reach the server URL's host (a UDP ``connect`` sends no
packet, it only picks a route); ``rendezvous_address`` lets an explicit setting win.

Firewalled clusters open only a range of ports between pods: ``choose_port`` picks a free one inside
``port_range`` (e.g. parsed from ``"40000-40100"`` by ``parse_port_range``) and names the range when
none is free. Without a range the kernel picks any free port.
"""

from __future__ import annotations

import random
import socket
from urllib.parse import urlsplit

PortRange = tuple[int, int]


def local_address_towards(url: str) -> str:
    """The IP of the local interface that routes to ``url``'s host (a loopback host gives loopback).

    ``url`` may be a full URL (``http://10.0.0.7:8000``) or a bare host. Host names are resolved;
    IPv4 and IPv6 hosts both work. A loopback host gives the loopback interface's address (Linux
    answers 127.0.0.1 for any of 127/8, which every loopback server reaches). Raises ``OSError``
    when no route exists.
    """
    host = _host_of(url)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # UDP: picks the route and source address, sends nothing
        return probe.getsockname()[0]


def rendezvous_address(server_url: str, override: str | None = None) -> str:
    """The address the server should dial: ``override`` when set, else ``local_address_towards``."""
    if override:
        return override
    try:
        return local_address_towards(server_url)
    except OSError as err:
        raise OSError(
            f"cannot find the local address that routes to the vLLM server at {server_url!r} ({err}); "
            "set the weight-transfer master address explicitly"
        ) from err


def parse_port_range(text: str) -> PortRange:
    """``"40000-40100"`` → ``(40000, 40100)``, both ends included; a single ``"40000"`` is one port."""
    lo_text, sep, hi_text = text.strip().partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise ValueError(f"port range {text!r}: expected 'LOW-HIGH', e.g. '40000-40100'") from None
    return check_port_range((lo, hi))


def check_port_range(port_range: PortRange) -> PortRange:
    """``port_range`` itself, after checking 1 ≤ low ≤ high ≤ 65535."""
    lo, hi = port_range
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"port range {lo}-{hi}: need 1 <= low <= high <= 65535")
    return lo, hi


def choose_port(address: str, port_range: PortRange | None = None) -> int:
    """A TCP port on ``address`` that is free right now: any (kernel's pick), or one in ``port_range``.

    Ports in the range are tried in random order, so trainers starting together on one host rarely
    collide. The port is free when returned, not reserved: bind it soon.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    if port_range is None:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            return s.getsockname()[1]
    lo, hi = check_port_range(port_range)
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)
    for port in candidates:
        if _can_bind(family, address, port):
            return port
    raise OSError(
        f"no free TCP port on {address} in the weight-transfer port range {lo}-{hi} "
        f"({len(candidates)} ports tried); widen the range or free a port"
    )


def _can_bind(family: int, address: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _host_of(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"//{url}")
    if not parts.hostname:
        raise ValueError(f"no host in server URL {url!r}")
    return parts.hostname
