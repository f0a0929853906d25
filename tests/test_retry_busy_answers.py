"""The suite's HTTP client asks a busy server again (tests/conftest.py: RetryBusyAnswers)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.conftest import RetryBusyAnswers


@pytest.fixture
def server():
    """A server that answers 503 to its first ``busy_for`` requests, then 201 with the body it was sent."""
    seen: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(body)
            busy = len(seen) <= httpd.busy_for
            payload = b'{"exception_message":"Service Unavailable"}' if busy else body
            self.send_response(503 if busy else 201)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.busy_for = 0
    httpd.seen = seen
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_a_passing_503_is_asked_again_with_the_same_body(server):
    server.busy_for = 2
    client = httpx.Client(transport=RetryBusyAnswers(patience_s=10))
    reply = client.post(f"http://127.0.0.1:{server.server_port}/runs", json={"job": {"model": "m"}})
    assert reply.status_code == 201
    assert reply.json() == {"job": {"model": "m"}}
    assert len(server.seen) == 3 and len(set(server.seen)) == 1


def test_a_server_busy_past_the_patience_gets_its_503_through(server):
    server.busy_for = 10**6
    client = httpx.Client(transport=RetryBusyAnswers(patience_s=1))
    reply = client.post(f"http://127.0.0.1:{server.server_port}/runs", json={})
    assert reply.status_code == 503
    assert 2 <= len(server.seen) <= 3  # asked after 0.5 s, then gave up before waiting past its patience
