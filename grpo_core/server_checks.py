"""Start-up checks of the vLLM server's configuration, run before the first request.

Each check probes behaviour rather than reading flags (``/server_info`` does not expose them), and a
failure names the missing flag and prints the server command to restart with.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import httpx

from grpo_core.config import AsyncGRPOConfig, lora_rank_ok

log = logging.getLogger(__name__)


class ServerConfigError(RuntimeError):
    """The server lacks a setting the trainer needs; the message shows the flag and the command."""


@dataclass
class ServerCapabilities:
    max_model_len: int
    max_logprobs: int | None
    candidate_sets: bool  # the server returns each token's top-k/top-p candidate set


def recommended_command(config: AsyncGRPOConfig, model: str = "<model>") -> str:
    backend = config.weight_transfer_backend
    flags = [
        "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server",
        f"--model {model}",
        "--logprobs-mode processed_logprobs",
        f"--max-logprobs {max(20, config.num_sampler_logprobs + 1)}",
        f"--weight-transfer-config '{{\"backend\":\"{backend}\"}}'",
        "--enable-scale-out",
    ]
    if config.needs_candidate_sets():
        flags.append("--return-sampling-mask")
    return " \\\n    ".join(flags)


def check_server(base_url: str, config: AsyncGRPOConfig, model: str = "<model>") -> ServerCapabilities:
    """Probe the server; raise ``ServerConfigError`` naming the first missing setting."""
    command = recommended_command(config, model)
    http = httpx.Client(base_url=base_url.rstrip("/"), timeout=config.request_timeout)
    try:
        models = http.get("/v1/models")
        if models.status_code != 200:
            raise ServerConfigError(f"{base_url}/v1/models answered HTTP {models.status_code}; is this a vLLM server?")
        max_model_len = int(models.json()["data"][0]["max_model_len"])

        if http.get("/is_paused").status_code == 404:
            raise ServerConfigError(
                "the server runs without dev mode, so it has no pause/resume or weight-transfer routes: "
                f"set VLLM_SERVER_DEV_MODE=1 and restart it:\n{command}"
            )

        def generate(params: dict) -> httpx.Response:
            return http.post("/inference/v1/generate", json={"token_ids": _PROBE_IDS, "sampling_params": params})

        probe = generate({"max_tokens": 1, "temperature": 1.0, "logprobs": 1, "seed": 0})
        if probe.status_code in (403, 404):
            raise ServerConfigError(
                "the tokens-in/tokens-out endpoint /inference/v1/generate is disabled: add --enable-scale-out "
                f"and restart the server:\n{command}"
            )
        if probe.status_code != 200:
            raise ServerConfigError(f"/inference/v1/generate failed: HTTP {probe.status_code} {probe.text[:500]}")

        _check_processed_logprobs(generate, command)
        max_logprobs = _check_max_logprobs(generate, config, command)
        candidate_sets = _check_candidate_sets(generate, config)
        return ServerCapabilities(max_model_len=max_model_len, max_logprobs=max_logprobs, candidate_sets=candidate_sets)
    finally:
        http.close()


_PROBE_IDS = list(range(5, 13))  # any ordinary tokens; a one-token prompt can give a flat distribution


def _top_two(response: httpx.Response) -> list[float]:
    content = response.json()["choices"][0]["logprobs"]["content"][0]
    return sorted((float(item["logprob"]) for item in content["top_logprobs"]), reverse=True)[:2]


def _check_processed_logprobs(generate, command: str) -> None:
    # Raw log-probs ignore the temperature; processed ones are computed after it. The same prompt's
    # most likely next token at two temperatures tells them apart.
    cold = _top_two(generate({"max_tokens": 1, "temperature": 0.5, "logprobs": 2, "seed": 0}))
    warm = _top_two(generate({"max_tokens": 1, "temperature": 1.0, "logprobs": 2, "seed": 0}))
    if len(warm) == 2 and abs(warm[0] - warm[1]) < 1e-9:
        log.warning("could not verify --logprobs-mode: the probe prompt gives a flat distribution")
        return
    if abs(cold[0] - warm[0]) < 1e-6:
        raise ServerConfigError(
            "the server reports raw log-probs, which ignore temperature and top-k/top-p, so importance ratios "
            f"would be wrong: add --logprobs-mode processed_logprobs and restart it:\n{command}"
        )


def _check_max_logprobs(generate, config: AsyncGRPOConfig, command: str) -> int | None:
    if config.num_sampler_logprobs == 0:
        return None
    wanted = config.num_sampler_logprobs + 1
    response = generate({"max_tokens": 1, "temperature": 1.0, "logprobs": wanted})
    if response.status_code == 400 and "max allowed" in response.text:
        found = re.search(r"max allowed:\s*(-?\d+)", response.text)
        allowed = found.group(1) if found else "?"
        raise ServerConfigError(
            f"num_sampler_logprobs={config.num_sampler_logprobs} needs {wanted} log-probs per token but the "
            f"server allows {allowed}: raise --max-logprobs to at least {wanted} (or lower num_sampler_logprobs) "
            f"and restart it:\n{command}"
        )
    if response.status_code != 200:
        raise ServerConfigError(f"log-prob probe failed: HTTP {response.status_code} {response.text[:500]}")
    return None


def _check_candidate_sets(generate, config: AsyncGRPOConfig) -> bool:
    if not config.needs_candidate_sets():
        return False
    params = {"max_tokens": 1, "temperature": 1.0, "logprobs": 1, "seed": 0}
    if config.top_k > 0:
        params["top_k"] = config.top_k
    if config.top_p < 1.0:
        params["top_p"] = config.top_p
    response = generate(params)
    mask = response.json()["choices"][0].get("sampling_mask") if response.status_code == 200 else None
    if mask:
        return True
    log.warning(
        "top_k=%s / top_p=%s: this server does not return each token's candidate set (it needs "
        "--return-sampling-mask, which requires vLLM's V2 model runner), so the trainer renormalises over "
        "the whole vocabulary and the importance ratios are biased",
        config.top_k,
        config.top_p,
    )
    return False


# ---- runtime LoRA (adapter sync) -------------------------------------------------------------------
@dataclass
class LoraServing:
    """What the server offers for serving LoRA adapters that the trainer loads at run time."""

    runtime_updates: bool  # /v1/load_lora_adapter exists (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)
    enabled: bool  # started with --enable-lora
    max_loras: int | None = None
    max_lora_rank: int | None = None

    @property
    def can_serve_adapters(self) -> bool:
        return self.runtime_updates and self.enabled


def smallest_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` value vLLM accepts that still serves an adapter of ``rank``."""
    for candidate in range(max(rank, 1), 513):
        if lora_rank_ok(candidate):
            return candidate
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank (512)")


def lora_command(config: AsyncGRPOConfig, adapter_rank: int, model: str = "<model>") -> str:
    """``recommended_command`` plus what adapter sync needs: runtime LoRA routes and big enough limits."""
    base = recommended_command(config, model).replace(
        "VLLM_SERVER_DEV_MODE=1 ", "VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ", 1
    )
    flags = [
        "--enable-lora",
        f"--max-lora-rank {smallest_lora_rank(adapter_rank)}",
        f"--max-loras {config.max_staleness + 2}",
    ]
    return " \\\n    ".join([base, *flags])


def probe_lora_serving(base_url: str, timeout: float = 30.0) -> LoraServing:
    """Read the server's LoRA settings from ``/server_info`` and probe the runtime load route."""
    http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)
    try:
        # Empty fields make the route answer 400 without touching the engine; a missing route is 404.
        probe = http.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": ""})
        runtime_updates = probe.status_code != 404
        info = http.get("/server_info", params={"config_format": "json"})
        if info.status_code != 200:
            raise ServerConfigError(_server_info_failure(base_url, info))
        lora = (info.json().get("vllm_config") or {}).get("lora_config")
        if not lora:
            return LoraServing(runtime_updates=runtime_updates, enabled=False)
        return LoraServing(
            runtime_updates=runtime_updates,
            enabled=True,
            max_loras=int(lora["max_loras"]),
            max_lora_rank=int(lora["max_lora_rank"]),
        )
    finally:
        http.close()


def _server_info_failure(base_url: str, response: httpx.Response) -> str:
    """Why ``/server_info`` (the only place vLLM reports its LoRA limits) failed, and what fixes it."""
    text = response.text[:300]
    if response.status_code == 500 and "splitlines" in text:
        # vLLM builds the report with a package listing: `python -m pip list` when pip is importable
        # in the server's environment, else `uv pip list`, which fails when uv is not on its PATH.
        return (
            f"{base_url}/server_info failed while the server listed its installed packages (HTTP 500: {text}). "
            "The LoRA limits were not read; the server itself is fine. vLLM lists packages with pip, or with uv in a "
            "uv-made environment without pip: install pip into the server's environment (or put `uv` on the "
            "server's PATH) and restart the server"
        )
    return f"{base_url}/server_info answered HTTP {response.status_code} ({text}); it is needed to read the LoRA limits"


def check_lora_limits(serving: LoraServing, config: AsyncGRPOConfig, adapter_rank: int, model: str = "<model>") -> None:
    """Raise ``ServerConfigError`` when the server cannot hold the adapter window or the adapter's rank."""
    command = lora_command(config, adapter_rank, model)
    if not serving.can_serve_adapters:
        missing = []
        if not serving.enabled:
            missing.append("--enable-lora")
        if not serving.runtime_updates:
            missing.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        raise ServerConfigError(
            f"adapter sync needs a server that loads LoRA adapters at run time; it lacks {' and '.join(missing)}. "
            f"Restart it with:\n{command}"
        )
    problems = []
    if serving.max_lora_rank is not None and serving.max_lora_rank < adapter_rank:
        problems.append(
            f"--max-lora-rank {serving.max_lora_rank} is below the adapter's rank {adapter_rank} "
            f"(use {smallest_lora_rank(adapter_rank)}: one of 1, 8, 16, 32, 64, 128, 256, 320, 512)"
        )
    needed = config.max_staleness + 2
    if serving.max_loras is not None and serving.max_loras < needed:
        problems.append(
            f"--max-loras {serving.max_loras} is below max_staleness + 2 = {needed} (max_staleness + 1 versions stay "
            "registered so old rollouts finish under their policy, plus the next one loaded before the oldest goes)"
        )
    if problems:
        raise ServerConfigError("the server's LoRA limits are too small: " + "; ".join(problems) + f". Restart it with:\n{command}")
