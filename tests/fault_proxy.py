"""A small HTTP proxy that puts faults between a client and a real server (tests only).

    proxy = FaultProxy("http://127.0.0.1:5000").start()   # clients use proxy.url
    proxy.set_mode("error")     # every request answered 503 (S3: ``SlowDown``) without reaching the server
    proxy.set_mode("drop")      # forwarded, but the reply is lost: the connection closes without one
    proxy.set_mode("down")      # connections refused, as by a stopped server (open ones are closed)
    proxy.set_mode("pass")      # forwarded as they are

It forwards whole requests and replies (bodies are buffered), keeps the client's ``Host`` header
(request signatures stay valid), and counts what it did per mode (``proxy.counts``) and the bytes of each forwarded
request and reply (``proxy.traffic``: method, path, request body bytes, reply body bytes).
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream: str, port: int = 0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.mode = "pass"
        self.counts: Counter[str] = Counter()
        self.traffic: list[tuple[str, str, int, int]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = port or _free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        self._listen()
        return self

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "error", "drop", "down"), mode
        with self._lock:
            previous, self.mode = self.mode, mode
        if mode == "down" and previous != "down":
            self._close_listener()
        elif mode != "down" and previous == "down":
            self._listen()

    def stop(self) -> None:
        self._close_listener()

    # ---- internals ------------------------------------------------------------------------------------
    def _listen(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                mode = proxy.mode
                proxy.counts[mode] += 1
                if mode == "down":
                    self.close_connection = True  # a connection opened before the stop: cut it
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "error":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.send_header("Retry-After", "1")
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                status, reason, headers, reply = proxy._forward(self.command, self.path, self.headers, body)
                with proxy._lock:
                    proxy.traffic.append((self.command, self.path, len(body), len(reply)))
                if mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(status, reason)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(reply)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        thread.start()
        self._server, self._thread = server, thread

    def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def _forward(self, method: str, path: str, headers, body: bytes):
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            conn.request(method, path, body=body or None,
                         headers={k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP})
            response = conn.getresponse()
            return response.status, response.reason, response.getheaders(), response.read()
        finally:
            conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
