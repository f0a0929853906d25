"""The rollout's generation client: asynchronous, token ids in, token ids and log-probs out.

``VLLMGenerateClient`` sends token ids (the worker tokenizes with the chat template itself, so the
trainer sees exactly the token ids that were sampled): to the tokens-in/tokens-out endpoint
``/inference/v1/generate`` when the server offers it (its scale-out endpoints are on; its replies carry
per-token weight versions and candidate sets), else to ``/v1/completions`` with a token-id prompt.
Identical calls are coalesced into one request, and requests are resent while the server restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import httpx

from grpo_core.retry import RetryPolicy
from grpo_core.vllm_server.control import SERVER_UNREACHABLE, VLLMRequestError, raise_for
from grpo_core.vllm_server.replies import GeneratedChoice, parse_completion_choice, parse_generate_choice

log = logging.getLogger(__name__)

# A request whose connection failed before a reply: the first two resends go out at once (a keep-alive
# connection the server closed as the request went out), then with backoff for the client's
# ``unavailable_timeout_s``. Generation retries more often than the trainer polls a down server: connection
# refusals cost the server nothing, and samples resume within seconds of it coming back.
RESEND = RetryPolicy(passes=lambda err: isinstance(err, SERVER_UNREACHABLE), deadline_s=0.0, first_s=0.5, max_s=2.0,
                     immediate=2)
# Event-loop passes a coalesced generation call waits for more identical calls (it stops at the first
# pass that brings none).
_COALESCE_MAX_PASSES = 64
# vLLM's RequestOutputKind.FINAL_ONLY, by value (this process imports no vLLM): a reply only when every choice ends.
OUTPUT_FINAL_ONLY = 2


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
        self._fills: set[asyncio.Task[None]] = set()  # draws of a short reply, asked for one by one
        self.requests_sent = 0
        self.completions_received = 0
        self.refusal: str | None = None  # why the last /metrics scrape was refused (``scrape``)

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
        work on both sides is paid once: on two CPU cores with the tiny model, several completions per request
        generate several times the tokens/s of as many requests (benchmarks/README.md, "Rollout generation:
        request shape and core sharing"; ``benchmarks/rollout/rollout_throughput.py``).
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
            if not 1 <= len(choices) <= 1 + len(live):
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
        short = live[len(choices) - 1:]
        if short:
            # A server that returns fewer choices than n (the 0.25 line's route did under cumulative output) gets
            # each rollout as a request of its own from now on; the calls already waiting are sent that way here.
            if self.coalesce:
                log.warning("%s returned %d of the %d choices asked for in one request: sending each rollout as a "
                            "request of its own from now on", self._http.base_url, len(choices), 1 + len(live))
                self.coalesce = False
            for f in short:
                task = asyncio.ensure_future(self._fill(f, token_ids, sampling_params, num_top, model))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)
        return [choices[0]]

    async def _fill(self, future: asyncio.Future[GeneratedChoice], token_ids: list[int],
                    sampling_params: dict[str, Any], num_top: int, model: str | None) -> None:
        """One waiting call's draw, asked for on its own."""
        try:
            (choice,) = await self._generate(token_ids, sampling_params, num_top, model)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller that waits on it
            if not future.done():
                future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not future.done():
            future.set_result(choice)

    async def _generate(
        self, token_ids: list[int], sampling_params: dict[str, Any], num_top: int, model: str | None
    ) -> list[GeneratedChoice]:
        params = dict(sampling_params)
        # The reply's top list includes the sampled token, so N + 1 entries yield N others at worst.
        params["logprobs"] = num_top + 1 if num_top > 0 else 0
        if self.tokens_endpoint:
            # Every choice in one reply: the 0.25 line's route reads the last update of an n > 1 request, which
            # under its default (cumulative) output holds only the choices that changed in the engine's last
            # step; asked for the final output only, it holds all n (the 0.32 line sets this itself).
            params.setdefault("output_kind", OUTPUT_FINAL_ONLY)
            route, parse = "/inference/v1/generate", parse_generate_choice
            body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": params}
        else:
            route, parse = "/v1/completions", parse_completion_choice
            body = {"prompt": token_ids, "return_token_ids": True, "return_tokens_as_token_ids": True, **params}
        if model is not None:
            body["model"] = model
        response = await self._post_resending(route, body)
        raise_for(route, response)
        choices = [parse(c, num_top) for c in response.json()["choices"]]
        self.requests_sent += 1
        self.completions_received += len(choices)
        return choices

    async def _post_resending(self, route: str, body: dict[str, Any]) -> httpx.Response:
        """POST, sent again when the connection fails before a reply.

        The server closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) while
        httpx may still hold them, so a request sent on one as it closes fails without reaching the
        server: the first resends go out at once on a new connection. A server that is down (killed,
        restarting) is tried again with backoff for ``unavailable_timeout_s`` after the first failure (``RESEND``).
        A sample is a fresh draw, so a resend is harmless; one that lands on a restarted server carries
        its weight version, which the trainer never pushed, and is dropped there.
        """
        policy = dataclasses.replace(RESEND, deadline_s=self.unavailable_timeout_s)
        return await policy.attempts().acall(lambda: self._http.post(route, json=body))

    async def max_model_len(self) -> int:
        response = await self._http.get("/v1/models")
        raise_for("/v1/models", response)
        return int(response.json()["data"][0]["max_model_len"])

    async def metrics_text(self) -> str | None:
        return (await self.scrape())[1]

    async def scrape(self, timeout_s: float = 5.0) -> tuple[bool, str | None]:
        """Whether the server answered ``/metrics`` within ``timeout_s`` at all, and the text when it answered 200
        (a fleet drains a server that stops answering: ``rollout.routing_client``). ``refusal`` keeps why an unanswered
        scrape's connection was refused (None: it timed out, or it answered)."""
        self.refusal = None
        try:
            response = await self._http.get("/metrics", timeout=timeout_s)
        except httpx.ConnectError as err:
            self.refusal = f"{type(err).__name__}: {err}"
            return False, None
        except httpx.HTTPError:
            return False, None
        return True, (response.text if response.status_code == 200 else None)

    async def is_paused(self, timeout_s: float = 5.0) -> bool:
        """Whether the server is paused for a weight push (its running requests wait by design); False when it does
        not say."""
        try:
            response = await self._http.get("/is_paused", timeout=timeout_s)
            return response.status_code == 200 and bool(response.json().get("is_paused"))
        except (httpx.HTTPError, ValueError):
            return False
