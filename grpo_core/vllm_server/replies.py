"""Generation replies of the vLLM server as arrays: ``/inference/v1/generate`` and ``/v1/completions``.

Pure functions of one reply's ``choices[i]`` (tested on recorded replies); the rollout's generation
client (``grpo_core.rollout.generation``) and the start-up checks (``checks.py``, which read a probe's
reply) share them.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_core.vllm_server.control import VLLMRequestError


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
    # [prompt + output - 1, layers, k] experts each forwarded token was routed to (mixture-of-experts models,
    # servers that return routes: ServerOptions.return_routed_experts), else None.
    routed_experts: np.ndarray | None = None


def top_token_id(item: dict[str, Any]) -> int:
    """The token id of one ``top_logprobs`` entry of a generate reply: its ``token_id`` (the 0.32 line), else its
    ``token`` written as ``token_id:N`` (the 0.25 line, which names tokens that way when the request sets
    ``return_tokens_as_token_ids``, as every request here does)."""
    if "token_id" in item:
        return int(item["token_id"])
    token = str(item.get("token", ""))
    if token.startswith("token_id:"):
        return int(token.removeprefix("token_id:"))
    raise VLLMRequestError(f"a top_logprobs entry names no token id ({sorted(item)}); the request must set "
                           "return_tokens_as_token_ids")


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
                seen.setdefault(top_token_id(item), float(item["logprob"]))
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
        routed_experts=decode_routed_experts(choice.get("routed_experts")),
    )


class RoutesFormatError(ValueError):
    """A reply's ``routed_experts`` is not a base64 ``.npy`` array of the expected shape."""


def decode_routed_experts(value: object, num_tokens: int | None = None) -> np.ndarray | None:
    """A reply's ``routed_experts`` as the ``[num_tokens - 1, layers, k]`` integer array the server sent
    (None stays None): the experts every forwarded token (prompt and output, all but the last output
    token, which nothing forwards) was routed to, uint8 up to 256 experts. ``num_tokens`` is the choice's
    prompt plus output tokens (None: not checked here)."""
    if value is None:
        return None
    try:
        routes = np.load(io.BytesIO(base64.b64decode(str(value), validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise RoutesFormatError(f"routed_experts is not a base64 .npy array: {exc}") from exc
    check_routes(routes, num_tokens)
    return routes


def check_routes(routes: np.ndarray, num_tokens: int | None) -> None:
    """Refuse routes that are not ``[num_tokens - 1, layers, k]`` integers."""
    if routes.ndim != 3 or routes.dtype.kind not in "ui" or (num_tokens is not None and len(routes) != num_tokens - 1):
        want = "tokens - 1" if num_tokens is None else num_tokens - 1
        raise RoutesFormatError(f"routed_experts has shape {list(routes.shape)} ({routes.dtype}); expected "
                                f"[{want}, layers, experts per token] of integers")


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
