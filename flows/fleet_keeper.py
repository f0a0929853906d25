"""Keep a fleet of managed vLLM servers up while a training attempt runs: a server that died is started again.

    with FleetKeeper(provisioner, urls, startup_timeout_s, on_event=...):
        provisioner.run_training(...)

A thread looks at every server every ``poll_s``: one whose process ended (killed, crashed, OOM) or, on a cluster,
whose job failed, is started again from its spec at the same URL (``Provisioner.restart_server``), one at a time.
The trainers drained it as lost (a dead process refuses connections: the fleet's rule,
``grpo_core.vllm_server.health``, takes that at once); they see it answer again, run the start-up checks on it
and push it the current weights before the rollout worker sends it anything (``grpo_core.fleet.servers``), so
nothing here talks to the trainers. ``on_event(url, what, seconds)`` reports ``"left"`` and ``"back"`` (the flow
tags the MLflow run with them). A server that cannot be started again is reported (``"failed"``) and tried again
at the next look: the run goes on on the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class FleetKeeper:
    """Restarts the dead servers of ``urls`` while the block runs (module docstring)."""

    def __init__(self, provisioner: Any, urls: list[str], startup_timeout_s: float, poll_s: float = 5.0,
                 on_event: Callable[[str, str, float], None] | None = None):
        self.provisioner = provisioner
        self.urls = list(urls)
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.on_event = on_event or (lambda url, what, seconds: None)
        self.restarts: dict[str, int] = {url: 0 for url in self.urls}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FleetKeeper:
        self._thread = threading.Thread(target=self._run, name="fleet-keeper", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            # A restart in progress finishes first: the flow then finds the server serving, not half started.
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for url in self.urls:
                if self._stop.is_set():
                    return
                self.look_at(url)

    def look_at(self, url: str) -> None:
        """Start the server at ``url`` again if it died."""
        try:
            alive = self.provisioner.server_alive(url)
        except Exception as err:  # noqa: BLE001 - a cluster API hiccup: look again next time
            log.warning("fleet keeper: could not read the state of %s: %s", url, err)
            return
        if alive:
            return
        left = time.monotonic()
        log.warning("fleet keeper: the vLLM server at %s died; starting it again at the same URL", url)
        self.on_event(url, "left", 0.0)
        try:
            self.provisioner.restart_server(url, self.startup_timeout_s)
        except Exception as err:  # noqa: BLE001 - the run goes on on the other servers
            log.error("fleet keeper: the vLLM server at %s did not start again (%s); trying at the next look", url, err)
            self.on_event(url, "failed", time.monotonic() - left)
            return
        self.restarts[url] += 1
        down_s = time.monotonic() - left
        log.warning("fleet keeper: the vLLM server at %s serves again after %.0f s; the trainers catch it up", url, down_s)
        self.on_event(url, "back", down_s)
