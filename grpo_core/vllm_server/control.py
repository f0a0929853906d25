"""The synchronous control client of the vLLM server (trainer side), and how its failures are named.

``VLLMControlClient``: pause/resume, the weight-transfer protocol routes (it satisfies vLLM's
``VLLMWeightSyncClient`` protocol), weight versions, LoRA adapters, ``/metrics`` and model info. The
trainer, the start-up checks, the restart watch, weight sync and the flows speak to the server through it.
``VLLMRequestError`` (a route answered with an error), ``DROPPED_CONNECTION`` and ``SERVER_UNREACHABLE``
(the request never reached a server) are shared with the rollout's generation client
(``grpo_core.rollout.generation``).
"""

from __future__ import annotations

from typing import Any

import httpx

from grpo_core.vllm_lines import LineFeatures, line_of


# Failures of a connection the server had already closed: the request never reached it.
DROPPED_CONNECTION = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# ... and of a server that is not there at all (stopped, or restarting on the same port).
SERVER_UNREACHABLE = (*DROPPED_CONNECTION, httpx.ConnectError, httpx.ConnectTimeout)
class VLLMRequestError(RuntimeError):
    """A vLLM route answered with an error; the message names the route and the server's reply."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        """The HTTP status of the reply (None where there was none)."""


def raise_for(route: str, response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise VLLMRequestError(f"{route} -> HTTP {response.status_code}: {response.text[:2000]}", status=response.status_code)


class VLLMControlClient:
    """Synchronous client for the server's control and dev-mode routes."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._line: LineFeatures | None = None

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, route: str, retry: bool, timeout: float | None = None, **kwargs: Any) -> httpx.Response:
        # The server closes a connection after answering an error, and idle keep-alive ones after a
        # few seconds; a request sent on such a connection fails before the server sees it, so it is
        # sent once more on a new one. Not for calls that block in a transfer (a retry would wait for
        # data the trainer sent only once). ``timeout``: this call's, in place of the client's.
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = self._http.request(method, route, **kwargs)
        except DROPPED_CONNECTION:
            if not retry:
                raise
            response = self._http.request(method, route, **kwargs)
        if response.status_code >= 500:
            # The server drops the connection after an internal error; start the next call afresh.
            self._http.close()
            self._http = httpx.Client(base_url=self.base_url, timeout=self._timeout)
        raise_for(route, response)
        return response

    def _post(self, route: str, json: Any = None, params: dict[str, Any] | None = None, retry: bool = True,
              timeout: float | None = None) -> httpx.Response:
        return self._send("POST", route, retry, timeout, json=json, params=params)

    def _get(self, route: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> httpx.Response:
        return self._send("GET", route, True, timeout, params=params)

    def probe(self, method: str, route: str, **kwargs: Any) -> httpx.Response:
        """Send a request and return the reply whatever its status (start-up checks read refusals)."""
        try:
            response = self._http.request(method, route, **kwargs)
        except DROPPED_CONNECTION:
            response = self._http.request(method, route, **kwargs)
        if response.status_code >= 500:
            self._http.close()
            self._http = httpx.Client(base_url=self.base_url, timeout=self._timeout)
        return response

    def answers(self, route: str = "/v1/models", timeout: float = 2.0) -> bool:
        """Whether ``GET route`` answers 200 within ``timeout``: False for a server still starting, gone,
        or up without a working engine (``/health``), never an exception."""
        try:
            return self._http.get(route, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    # -- model and server information -------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        return self._get("/v1/models").json()["data"]

    def max_model_len(self) -> int:
        return int(self.models()[0]["max_model_len"])

    def metrics_text(self) -> str | None:
        """Raw Prometheus text of ``/metrics``, or None when the server does not expose it."""
        try:
            response = self._http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    def server_info(self) -> dict[str, Any]:
        return self._get("/server_info").json()

    def server_config(self) -> dict[str, Any]:
        """The server's engine configuration as ``/server_info`` reports it (``vllm_config``); empty when it
        does not answer with one."""
        try:
            info = self._get("/server_info", params={"config_format": "json"}).json()
        except (httpx.HTTPError, VLLMRequestError, ValueError):
            return {}
        return info.get("vllm_config") or {}

    def world_size(self) -> int:
        return int(self._get("/get_world_size").json()["world_size"])

    def weight_version(self, timeout: float | None = None) -> str:
        return str(self._get("/weight_info", timeout=timeout).json()["weight_version"])

    def prompt_logprobs(self, token_ids: list[int], model: str | None = None, timeout: float | None = None) -> list[float]:
        """The served log-prob of each token of ``token_ids`` after the first, given the tokens before it
        (temperature 1; ``/inference/v1/generate`` with ``prompt_logprobs``)."""
        body: dict[str, Any] = {"token_ids": list(token_ids),
                                "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}}
        if model is not None:
            body["model"] = model
        entries = self._post("/inference/v1/generate", json=body, timeout=timeout).json()["prompt_logprobs"]
        return [float(entries[t][str(token_ids[t])]["logprob"]) for t in range(1, len(token_ids))]

    def update_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", json={"new_version": version})

    # -- pausing around a weight swap ---------------------------------------------------------------
    def pause(self, mode: str = "keep", clear_cache: bool = True, timeout: float | None = None) -> None:
        self._post("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()}, timeout=timeout)

    def resume(self, timeout: float | None = None) -> None:
        self._post("/resume", timeout=timeout)

    def is_paused(self) -> bool:
        return bool(self._get("/is_paused").json()["is_paused"])

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    # -- vLLM's weight-transfer protocol (VLLMWeightSyncClient) -------------------------------------
    # ``timeout``: the call's deadline (``grpo_core.sync.timing.timed_control`` passes each phase's); None: the client's.
    def init_weight_transfer_engine(self, init_info: dict[str, Any], timeout: float | None = None) -> None:
        self._post("/init_weight_transfer_engine", json={"init_info": init_info}, retry=False, timeout=timeout)

    def start_weight_update(self, timeout: float | None = None) -> None:
        self._post("/start_weight_update", timeout=timeout)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]], timeout: float | None = None) -> None:
        self._post("/update_weights", json={"update_info": update_info}, retry=False, timeout=timeout)

    def finish_weight_update(self, weight_version: str | None = None, timeout: float | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post("/finish_weight_update", json=body, timeout=timeout)
        if weight_version is not None and not self.line().weight_version_routes:
            # A 0.25 server's finish takes no version: record it through the plugin's route (vllm_lines).
            self._post("/update_weight_version", json={"new_version": weight_version}, timeout=timeout)

    def line(self) -> LineFeatures:
        """What the server's vLLM line offers (``GET /version``, asked once)."""
        if self._line is None:
            self._line = line_of(str(self._get("/version").json()["version"]))
        return self._line

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return self._post("/collective_rpc", json={"method": method, "kwargs": kwargs or {}}).json()

    # -- runtime LoRA -------------------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", json={"lora_name": name})
