"""Tokens in, tokens out against the real CPU vLLM server: multi-turn tool episodes whose trained tokens differ
from the sampled ones, message path vs token path (``benchmarks/rollout/token_path_mismatch.py`` counts 100 of
each; this runs 16 on the template that re-serialises tool-call arguments).

The shared server holds the arithmetic model; the test pushes the tools model's weights first (same architecture
and tokenizer), as ``integration/test_tools.py`` does.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.rollout.token_path_mismatch import count, template_tokenizer
from tests.integration.test_tools import tools_model_path, tools_policy_on_server, tools_tokenizer  # noqa: F401

pytestmark = pytest.mark.integration


def test_token_path_trains_the_sampled_tokens_where_the_message_path_realigns(tools_policy_on_server, tools_tokenizer) -> None:  # noqa: ANN001, F811
    tokenizer = template_tokenizer(tools_tokenizer, "compact_args")
    messages = asyncio.run(count(tools_policy_on_server, tokenizer, "messages", episodes=16, seed=1, max_rollouts=2000))
    tokens = asyncio.run(count(tools_policy_on_server, tokenizer, "tokens", episodes=16, seed=1, max_rollouts=2000))
    print(f"differing episodes of 16: messages {messages['differing']:.0f}, tokens {tokens['differing']:.0f}")
    assert messages["episodes"] == tokens["episodes"] == 16
    # The template re-renders every call's arguments differently from how the model wrote them: the message path
    # realigns nearly every episode, the token path none, and never falls back to re-rendering.
    assert messages["differing"] >= 12 and messages["not_clean"] >= 12
    assert tokens["differing"] == 0 and tokens["not_clean"] == 0 and tokens["fallback_turns"] == 0
