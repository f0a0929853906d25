"""HTTP clients for the vLLM server: control routes (trainer side) and generation (rollout worker).

``VLLMControlClient`` is synchronous: pause/resume, the weight-transfer protocol routes (it satisfies
vLLM's ``VLLMWeightSyncClient`` protocol), weight versions, LoRA adapters, ``/metrics`` and model info.
``VLLMGenerateClient`` is asynchronous and sends token ids (the worker tokenizes with the chat template
itself, so the trainer sees exactly the token ids that were sampled): to the tokens-in/tokens-out
endpoint ``/inference/v1/generate`` when the server offers it (its scale-out endpoints are on; its replies carry
per-token weight versions and candidate sets), else to ``/v1/completions`` with a token-id prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


# Failures of a connection the server had already closed: the request never reached it.
DROPPED_CONNECTION = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# ... and of a server that is not there at all (stopped, or restarting on the same port).
SERVER_UNREACHABLE = (*DROPPED_CONNECTION, httpx.ConnectError, httpx.ConnectTimeout)
_GENERATE_ATTEMPTS = 3
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 10.0
# Generation retries more often than the trainer polls a down server: connection refusals cost the
# server nothing, and samples resume within seconds of it coming back.
_GENERATE_BACKOFF_MAX_S = 2.0
# Event-loop passes a coalesced generation call waits for more identical calls (it stops at the first
# pass that brings none).
_COALESCE_MAX_PASSES = 64


def backoff_delays(first_s: float = _BACKOFF_FIRST_S, max_s: float = _BACKOFF_MAX_S) -> Iterator[float]:
    """Waits between attempts at an unreachable server: doubling from ``first_s``, at most ``max_s``."""
    delay = first_s
    while True:
        yield delay
        delay = min(max_s, 2 * delay)


class VLLMRequestError(RuntimeError):
    """A vLLM route answered with an error; the message names the route and the server's reply."""


def _raise_for(route: str, response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise VLLMRequestError(f"{route} -> HTTP {response.status_code}: {response.text[:2000]}")


class VLLMControlClient:
    """Synchronous client for the server's control and dev-mode routes."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, route: str, retry: bool, **kwargs: Any) -> httpx.Response:
        # The server closes a connection after answering an error, and idle keep-alive ones after a
        # few seconds; a request sent on such a connection fails before the server sees it, so it is
        # sent once more on a new one. Not for calls that block in a transfer (a retry would wait for
        # data the trainer sent only once).
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
        _raise_for(route, response)
        return response

    def _post(self, route: str, json: Any = None, params: dict[str, Any] | None = None, retry: bool = True) -> httpx.Response:
        return self._send("POST", route, retry, json=json, params=params)

    def _get(self, route: str, params: dict[str, Any] | None = None) -> httpx.Response:
        return self._send("GET", route, True, params=params)

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

    def world_size(self) -> int:
        return int(self._get("/get_world_size").json()["world_size"])

    def weight_version(self) -> str:
        return str(self._get("/weight_info").json()["weight_version"])

    def update_weight_version(self, version: str) -> None:
        self._post("/update_weight_version", json={"new_version": version})

    # -- pausing around a weight swap ---------------------------------------------------------------
    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._post("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self._post("/resume")

    def is_paused(self) -> bool:
        return bool(self._get("/is_paused").json()["is_paused"])

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    # -- vLLM's weight-transfer protocol (VLLMWeightSyncClient) -------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", json={"init_info": init_info}, retry=False)

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/update_weights", json={"update_info": update_info}, retry=False)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post("/finish_weight_update", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return self._post("/collective_rpc", json={"method": method, "kwargs": kwargs or {}}).json()

    # -- runtime LoRA -------------------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        self._post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", json={"lora_name": name})


@dataclass
class GeneratedChoice:
    """One completion from ``/inference/v1/generate``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    # [n_out, N] sampler top-N ids and log-probs (sampled token excluded), or None when N == 0.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    sampling_masks: list[np.ndarray] | None = None
    # (version, start, end) spans over output-token indexes.
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)


def parse_generate_choice(choice: dict[str, Any], num_top: int) -> GeneratedChoice:
    """Turn one ``choices[i]`` of a generate reply into arrays (pure; tested on recorded replies).

    The server lists the sampled token first in ``top_logprobs``; we keep the N best *other*
    entries when the sampled token is among the top, so each row holds the sampler's top-N set.
    """
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(token_ids):
        raise VLLMRequestError(
            f"generate reply has {len(token_ids)} tokens but {len(logprobs)} log-probs; "
            "ask for logprobs >= 0 in sampling_params"
        )
    top_ids = top_lp = None
    if num_top > 0:
        top_ids = np.full((len(token_ids), num_top), -1, dtype=np.int32)
        top_lp = np.full((len(token_ids), num_top), -np.inf, dtype=np.float32)
        for t, entry in enumerate(content):
            # Rank order; the sampled token appears once with its true rank, so de-duplicate by id.
            seen: dict[int, float] = {}
            for item in sorted(entry.get("top_logprobs") or [], key=lambda x: x.get("rank", 0)):
                seen.setdefault(int(item["token_id"]), float(item["logprob"]))
            ranked = sorted(seen.items(), key=lambda kv: -kv[1])[:num_top]
            for j, (tid, lp) in enumerate(ranked):
                top_ids[t, j] = tid
                top_lp[t, j] = lp
    masks = choice.get("sampling_mask")
    sampling_masks = [np.asarray(m, dtype=np.int32) for m in masks] if masks else None
    versions = [(str(v["version"]), int(v["start"]), int(v["end"])) for v in choice.get("weight_versions") or []]
    return GeneratedChoice(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        top_ids=top_ids,
        top_logprobs=top_lp,
        sampling_masks=sampling_masks,
        weight_versions=versions,
    )


def parse_completion_choice(choice: dict[str, Any], num_top: int) -> GeneratedChoice:
    """The same arrays from one ``choices[i]`` of a ``/v1/completions`` reply (asked with
    ``return_token_ids`` and ``return_tokens_as_token_ids``, so top log-prob keys are ``token_id:N``).
    This endpoint reports neither weight versions nor candidate sets."""
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    block = choice.get("logprobs") or {}
    logprobs = [float(v) for v in block.get("token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise VLLMRequestError(
            f"completion reply has {len(token_ids)} tokens but {len(logprobs)} log-probs; ask for logprobs >= 0"
        )
    top_ids = top_lp = None
    if num_top > 0:
        top_ids = np.full((len(token_ids), num_top), -1, dtype=np.int32)
        top_lp = np.full((len(token_ids), num_top), -np.inf, dtype=np.float32)
        for t, entry in enumerate(block.get("top_logprobs") or []):
            ranked = sorted(((_token_id(k), float(v)) for k, v in (entry or {}).items()), key=lambda kv: -kv[1])[:num_top]
            for j, (tid, lp) in enumerate(ranked):
                top_ids[t, j] = tid
                top_lp[t, j] = lp
    return GeneratedChoice(
        token_ids=token_ids, logprobs=logprobs, finish_reason=choice.get("finish_reason"), top_ids=top_ids, top_logprobs=top_lp
    )


def _token_id(key: str) -> int:
    return int(key.rsplit(":", 1)[-1])


class VLLMGenerateClient:
    """Asynchronous generation from token ids: ``/inference/v1/generate`` when ``tokens_endpoint``, else
    ``/v1/completions`` (no per-token weight versions or candidate sets there)."""

    def __init__(self, base_url: str, timeout: float = 600.0, max_connections: int = 1024, tokens_endpoint: bool = True,
                 unavailable_timeout_s: float = 0.0, coalesce: bool = True):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits)
        self.tokens_endpoint = tokens_endpoint
        # How long a request keeps being resent, with backoff, to a server that does not answer (a
        # restart takes minutes); 0 keeps only the resends for the keep-alive race below.
        self.unavailable_timeout_s = unavailable_timeout_s
        # Identical single-completion calls made in the same event-loop pass go out as one request
        # with n = their count (see ``generate``).
        self.coalesce = coalesce
        self._open: dict[tuple[Any, ...], list[asyncio.Future[GeneratedChoice]]] = {}
        self.requests_sent = 0
        self.completions_received = 0

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(
        self,
        token_ids: list[int],
        sampling_params: dict[str, Any],
        num_top: int = 0,
        model: str | None = None,
    ) -> list[GeneratedChoice]:
        """The server's choices for one prompt (``sampling_params['n']`` of them, 1 by default).

        Calls for one completion each with the same prompt, parameters, top-N and model that arrive
        in the same few passes of the event loop (the rollouts of a group, started together, reach their
        first turn together) are sent as one request with ``n`` = their count, and each call gets one
        of its choices. The draws are the same independent samples from the same weights either way;
        the server prefills the prompt once and decodes them in lock-step, and the HTTP and per-request
        work on both sides is paid once: on two CPU cores with the tiny model, 8 completions per
        request generate 5-6x the tokens/s of 8 requests (``benchmarks/rollout_throughput.py``).
        Calls with a ``seed`` (identical seeds would repeat one draw) or ``n`` > 1 go out as they are.
        """
        n = int(sampling_params.get("n", 1) or 1)
        if not self.coalesce or n != 1 or sampling_params.get("seed") is not None:
            return await self._generate(token_ids, sampling_params, num_top, model)
        key = (tuple(token_ids), repr(sorted(sampling_params.items())), num_top, model)
        waiting = self._open.get(key)
        if waiting is not None:  # a call for the same draw is about to be sent: ride along
            future: asyncio.Future[GeneratedChoice] = asyncio.get_running_loop().create_future()
            waiting.append(future)
            return [await future]
        followers: list[asyncio.Future[GeneratedChoice]] = []
        self._open[key] = followers
        try:
            try:
                # The group's other rollouts join within a pass or a few (admission hands a lock on
                # from one to the next): wait while the last pass brought one more.
                for _ in range(_COALESCE_MAX_PASSES):
                    joined = len(followers)
                    await asyncio.sleep(0)
                    if len(followers) == joined:
                        break
            finally:
                del self._open[key]
            live = [f for f in followers if not f.done()]
            params = {**sampling_params, "n": 1 + len(live)} if live else sampling_params
            choices = await self._generate(token_ids, params, num_top, model)
            if len(choices) != 1 + len(live):
                raise VLLMRequestError(f"asked for {1 + len(live)} choices, the server returned {len(choices)}")
        except BaseException as exc:
            for f in followers:
                if not f.done():
                    if isinstance(exc, asyncio.CancelledError):
                        f.cancel()
                    else:
                        f.set_exception(exc)
            raise
        for f, choice in zip(live, choices[1:]):
            if not f.done():  # a follower cancelled meanwhile drops its draw
                f.set_result(choice)
        return [choices[0]]

    async def _generate(
        self, token_ids: list[int], sampling_params: dict[str, Any], num_top: int, model: str | None
    ) -> list[GeneratedChoice]:
        params = dict(sampling_params)
        # The reply's top list includes the sampled token, so N + 1 entries yield N others at worst.
        params["logprobs"] = num_top + 1 if num_top > 0 else 0
        if self.tokens_endpoint:
            route, parse = "/inference/v1/generate", parse_generate_choice
            body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": params}
        else:
            route, parse = "/v1/completions", parse_completion_choice
            body = {"prompt": token_ids, "return_token_ids": True, "return_tokens_as_token_ids": True, **params}
        if model is not None:
            body["model"] = model
        response = await self._post_resending(route, body)
        _raise_for(route, response)
        choices = [parse(c, num_top) for c in response.json()["choices"]]
        self.requests_sent += 1
        self.completions_received += len(choices)
        return choices

    async def _post_resending(self, route: str, body: dict[str, Any]) -> httpx.Response:
        """POST, sent again when the connection fails before a reply.

        The server closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) while
        httpx may still hold them, so a request sent on one as it closes fails without reaching the
        server: the first resends go out at once on a new connection. A server that is down (killed,
        restarting) is tried again with backoff for ``unavailable_timeout_s`` after the first failure.
        A sample is a fresh draw, so a resend is harmless; one that lands on a restarted server carries
        its weight version, which the trainer never pushed, and is dropped there.
        """
        first_failure: float | None = None
        delays = backoff_delays(max_s=_GENERATE_BACKOFF_MAX_S)
        attempts = 0
        while True:
            attempts += 1
            try:
                return await self._http.post(route, json=body)
            except SERVER_UNREACHABLE:
                first_failure = first_failure if first_failure is not None else time.monotonic()
                if attempts < _GENERATE_ATTEMPTS:
                    continue
                if time.monotonic() - first_failure >= self.unavailable_timeout_s:
                    raise
                await asyncio.sleep(next(delays))

    async def max_model_len(self) -> int:
        response = await self._http.get("/v1/models")
        _raise_for("/v1/models", response)
        return int(response.json()["data"][0]["max_model_len"])

    async def metrics_text(self) -> str | None:
        try:
            response = await self._http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None
