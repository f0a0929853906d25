"""Top log-probs of a generate reply, as each supported vLLM line names their tokens."""

from __future__ import annotations

import pytest

from grpo_core.vllm_server.control import VLLMRequestError
from grpo_core.vllm_server.replies import parse_generate_choice, top_token_id


def reply(top: list[dict]) -> dict:
    return {"token_ids": [5], "logprobs": {"content": [{"logprob": -0.1, "top_logprobs": top}]}, "finish_reason": "stop"}


def test_the_032_line_names_top_tokens_by_id():
    parsed = parse_generate_choice(reply([{"token_id": 5, "logprob": -0.1, "rank": 1},
                                          {"token_id": 7, "logprob": -2.0, "rank": 2}]), num_top=2)
    assert parsed.top_ids.tolist() == [[5, 7]]


def test_the_025_line_writes_them_as_token_id_strings():
    # vLLM 0.25.0 on a GPU: no token_id field; the token is "token_id:N" under return_tokens_as_token_ids.
    parsed = parse_generate_choice(reply([{"token": "token_id:5", "logprob": -0.1, "bytes": [1]},
                                          {"token": "token_id:7", "logprob": -2.0, "bytes": [2]}]), num_top=2)
    assert parsed.top_ids.tolist() == [[5, 7]]
    assert parsed.top_logprobs[0].tolist() == pytest.approx([-0.1, -2.0])


def test_an_entry_without_an_id_names_the_request_field():
    with pytest.raises(VLLMRequestError, match="return_tokens_as_token_ids"):
        top_token_id({"token": "7", "logprob": -1.0})
