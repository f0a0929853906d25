"""The generation client sends identical single-completion calls of one event-loop pass as one request with n."""

from __future__ import annotations

import asyncio
import json

import httpx

from grpo_core.rollout.generation import VLLMGenerateClient
from grpo_core.vllm_server.control import VLLMRequestError


def choice(token: int) -> dict:
    return {"token_ids": [token], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "stop",
            "weight_versions": [{"version": "2", "start": 0, "end": 1}]}


def client_with(bodies: list[dict], status: int = 200, coalesce: bool = True) -> VLLMGenerateClient:
    """A client whose server answers each request with ``n`` choices, the i-th carrying token 100 * request + i."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if status != 200:
            return httpx.Response(status, json={"error": "no"})
        n = body["sampling_params"].get("n", 1)
        return httpx.Response(200, json={"choices": [choice(100 * len(bodies) + i) for i in range(n)]})

    client = VLLMGenerateClient("http://unused", coalesce=coalesce)
    client._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(handler))
    return client


def run_group(client: VLLMGenerateClient, calls: list[tuple[list[int], dict]]) -> list:
    async def go():
        try:
            return await asyncio.gather(*(client.generate(ids, params) for ids, params in calls))
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_groups_calls_go_out_as_one_request_with_n():
    bodies: list[dict] = []
    client = client_with(bodies)
    results = run_group(client, [([1, 2, 3], {"max_tokens": 4, "temperature": 1.0})] * 8)
    assert len(bodies) == 1 and bodies[0]["sampling_params"]["n"] == 8
    assert sorted(r[0].token_ids[0] for r in results) == [100 + i for i in range(8)]  # each call one distinct choice
    assert all(r[0].weight_versions == [("2", 0, 1)] for r in results)
    assert (client.requests_sent, client.completions_received) == (1, 8)


def test_different_prompts_or_params_are_not_merged():
    bodies: list[dict] = []
    calls = [([1, 2], {"max_tokens": 4}), ([1, 2], {"max_tokens": 4}), ([1, 3], {"max_tokens": 4}),
             ([1, 2], {"max_tokens": 5})]
    results = run_group(client_with(bodies), calls)
    assert sorted(b["sampling_params"].get("n", 1) for b in bodies) == [1, 1, 2]
    assert all(len(r) == 1 for r in results)


def test_seeded_calls_and_calls_for_several_choices_go_out_as_they_are():
    bodies: list[dict] = []
    run_group(client_with(bodies), [([1], {"max_tokens": 2, "seed": 3})] * 3)
    assert [b["sampling_params"].get("n", 1) for b in bodies] == [1, 1, 1]
    bodies.clear()
    results = run_group(client_with(bodies), [([1], {"max_tokens": 2, "n": 2})] * 2)
    assert [b["sampling_params"]["n"] for b in bodies] == [2, 2] and [len(r) for r in results] == [2, 2]


def test_coalescing_off_sends_one_request_per_call():
    bodies: list[dict] = []
    run_group(client_with(bodies, coalesce=False), [([1], {"max_tokens": 2})] * 4)
    assert len(bodies) == 4 and all("n" not in b["sampling_params"] for b in bodies)


def test_calls_made_later_are_not_held_back():
    bodies: list[dict] = []
    client = client_with(bodies)

    async def go():
        first = await client.generate([1], {"max_tokens": 2})
        second = await client.generate([1], {"max_tokens": 2})
        await client.aclose()
        return first, second

    asyncio.run(go())
    assert len(bodies) == 2


def test_an_error_reaches_every_call_of_the_request():
    bodies: list[dict] = []
    client = client_with(bodies, status=404)

    async def go():
        try:
            return await asyncio.gather(*(client.generate([1], {"max_tokens": 2}) for _ in range(4)), return_exceptions=True)
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert len(bodies) == 1
    assert all(isinstance(r, VLLMRequestError) and "HTTP 404" in str(r) for r in results)


def test_a_cancelled_follower_leaves_the_others_their_choices():
    bodies: list[dict] = []
    client = client_with(bodies)

    async def go():
        tasks = [asyncio.create_task(client.generate([1], {"max_tokens": 2})) for _ in range(3)]
        await asyncio.sleep(0)  # all three have reached the client; the first waits for joiners
        tasks[2].cancel()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        return out

    first, second, third = asyncio.run(go())
    assert isinstance(third, asyncio.CancelledError)
    assert first[0].token_ids != second[0].token_ids and len(bodies) == 1


def capped_client(bodies: list[dict], cap: int) -> VLLMGenerateClient:
    """A client whose server returns at most ``cap`` choices a request, whatever ``n`` asks for (as the 0.25 line's
    generate route did on a GPU: 4 of 16)."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        n = min(body["sampling_params"].get("n", 1), cap)
        return httpx.Response(200, json={"choices": [choice(100 * len(bodies) + i) for i in range(n)]})

    client = VLLMGenerateClient("http://unused")
    client._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(handler))
    return client


def test_a_short_reply_serves_every_call_and_turns_coalescing_off(caplog):
    bodies: list[dict] = []
    client = capped_client(bodies, cap=3)
    results = run_group(client, [([1, 2], {"max_tokens": 4})] * 8)
    tokens = [r[0].token_ids[0] for r in results]
    assert len(set(tokens)) == 8, tokens  # every call got a draw of its own
    # one request asked for 8 and got 3; the 5 calls left went out one by one
    assert [b["sampling_params"].get("n", 1) for b in bodies] == [8, 1, 1, 1, 1, 1]
    assert client.coalesce is False and "returned 3 of the 8 choices" in caplog.text
    assert (client.requests_sent, client.completions_received) == (6, 8)


def test_a_reply_with_more_choices_than_asked_is_an_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [choice(i) for i in range(3)]})

    client = VLLMGenerateClient("http://unused")
    client._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(handler))

    async def go():
        try:
            return await asyncio.gather(*(client.generate([1], {"max_tokens": 2}) for _ in range(2)),
                                        return_exceptions=True)
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert all(isinstance(r, VLLMRequestError) and "asked for 2 choices, the server returned 3" in str(r)
               for r in results)


def test_the_tokens_route_is_asked_for_every_choice_in_one_final_reply():
    # The 0.25 line's route, asked for cumulative output, replies with the choices its last engine step changed.
    bodies: list[dict] = []
    run_group(client_with(bodies), [([1, 2, 3], {"max_tokens": 4})] * 4)
    assert [b["sampling_params"]["output_kind"] for b in bodies] == [2]
    completions = VLLMGenerateClient("http://unused", tokens_endpoint=False)
    completions._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(
        lambda request: bodies.append(json.loads(request.content)) or httpx.Response(200, json={"choices": []})))
    assert asyncio.run(completions._generate([1, 2], {"max_tokens": 4}, 0, None)) == []
    assert "output_kind" not in bodies[-1]
