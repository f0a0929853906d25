"""Start-up checks of the vLLM server, run before the first request: is it there, is it the same model,
and does it offer what the run's settings need?

Each check probes behaviour through the control client (``/server_info`` does not expose the flags),
and a failure names what is missing, which feature needs it, and prints the command to restart the
server with (``VLLMServerSpec.shell_command``, the one place the flags are spelled). Features with a
fallback only warn: without the tokens-in/tokens-out endpoint generation goes through ``/v1/completions`` and
samples are dated by the weight version at request start instead of per token; without candidate
sets the trainer renormalises over the whole vocabulary.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from grpo_core.config import AsyncGRPOConfig
from grpo_core.staleness import resident_adapters
from grpo_core.vllm_server import process as flags
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.model_needs import is_mixture_of_experts, model_server_options, server_needs
from grpo_core.vllm_server.process import ServerOptions, VLLMServerSpec
from grpo_core.vllm_server.replies import parse_completion_choice, parse_generate_choice
from grpo_core.waiting import announced_wait

log = logging.getLogger(__name__)


class ServerConfigError(RuntimeError):
    """The server lacks a setting the trainer needs; the message shows the flag and the command."""


@dataclass
class ServerCapabilities:
    """What the server offers, as found by ``check_server``."""

    max_model_len: int
    served_model: str  # the ``model`` field requests name
    tokens_endpoint: bool  # /inference/v1/generate (per-token weight versions, candidate sets)
    candidate_sets: bool  # the server returns each token's top-k/top-p candidate set
    routed_experts: bool = False  # the server returns each token's routed experts (an MoE model)


def recommended_command(config: AsyncGRPOConfig, model: str = "<model>", cuda: bool = False, **options: Any) -> str:
    """The command that starts a server this run can use (``options``: ``ServerOptions`` fields, over what a model
    in a local folder needs of its server, e.g. bf16 for Gated DeltaNet layers on the CPU: a command a user copies
    must start)."""
    server_options = ServerOptions(**options)
    if os.path.isdir(model):
        server_options = model_server_options(model, server_options, cuda)
    return VLLMServerSpec.for_run(model, config, server_options, cuda=cuda).shell_command()


SERVER_WAIT_NOTICE_S = 1.0
"""A server that answers within this long is not announced; one that does not is, at once after it."""


def wait_for_server(control: VLLMControlClient, config: AsyncGRPOConfig, model: str, cuda: bool) -> None:
    """Wait up to ``vllm_server_timeout`` for the server to answer (it may still be starting), saying so after
    ``SERVER_WAIT_NOTICE_S`` and every few seconds after that (``grpo_core.waiting``)."""
    deadline = time.monotonic() + config.vllm_server_timeout
    hint = (f"if that URL is wrong, stop and fix vllm_server_base_url; if no server is running, start one with: "
            f"{recommended_command(config, model, cuda)}")
    with announced_wait(f"a vLLM server to answer at {control.base_url}", config.vllm_server_timeout, hint,
                        delay_s=SERVER_WAIT_NOTICE_S):
        while True:
            try:
                # A short probe: an address where nothing answers must not hold the loop past its deadline.
                if control.probe("GET", "/v1/models", timeout=min(5.0, max(0.5, deadline - time.monotonic()))).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise ServerConfigError(
                    f"no vLLM server answers at {control.base_url} (waited vllm_server_timeout="
                    f"{config.vllm_server_timeout:g} s). Start one for this model with:\n"
                    f"{recommended_command(config, model, cuda)}"
                )
            time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))


def check_server(
    control: VLLMControlClient,
    config: AsyncGRPOConfig,
    model: str = "<model>",
    model_config: Any = None,
    cuda: bool = False,
    *,
    train_dtype: str,
) -> ServerCapabilities:
    """Probe the server; raise ``ServerConfigError`` naming the first missing setting. ``train_dtype``: what the
    trainer computes in (``float32``, ``bfloat16``, ``float16``)."""
    command = recommended_command(config, model, cuda)
    models = control.probe("GET", "/v1/models")
    if models.status_code != 200:
        raise ServerConfigError(f"{control.base_url}/v1/models answered HTTP {models.status_code}; is this a vLLM server?")
    served = models.json()["data"][0]
    _check_same_model(served, model, model_config)

    if control.probe("GET", "/is_paused").status_code == 404:
        raise ServerConfigError(
            f"the server runs without dev mode, so it has no pause/resume or weight-transfer routes: set "
            f"{flags.DEV_MODE_ENV}=1 and restart it:\n{command}"
        )
    _check_weight_transfer_backend(control, config.resolved_weight_transfer_backend(cuda), command)
    _check_dtype(control, expected_server_dtype(train_dtype, model_config, cuda), train_dtype, config, model, cuda)

    probe = _Prober(control, list(range(5, 13)))  # ordinary tokens; a one-token prompt can give a flat distribution
    if model_config is not None:
        probe.check_vocabulary(int(_text_config(model_config)["vocab_size"]), model)
    if not probe.tokens_endpoint:
        log.warning(
            "the server runs without %s: generation goes through /v1/completions, which does not report per-token "
            "weight versions, so a sample is dated by the version it started under (a conservative staleness). "
            "Add the flag for exact versions.", flags.ENABLE_SCALE_OUT,
        )
    _check_processed_logprobs(probe, command)
    _check_max_logprobs(probe, config, command)
    candidate_sets = _check_candidate_sets(probe, config, command)
    routed = _check_routed_experts(probe, config, model_config,
                                   recommended_command(config, model, cuda, return_routed_experts=True))
    return ServerCapabilities(
        max_model_len=int(served["max_model_len"]),
        served_model=str(served["id"]),
        tokens_endpoint=probe.tokens_endpoint,
        candidate_sets=candidate_sets,
        routed_experts=routed,
    )


# ---- the precision ---------------------------------------------------------------------------------
def expected_server_dtype(train_dtype: str, model_config: Any, cuda: bool) -> str:
    """The dtype the server must run in: the trainer's, unless the model needs another of its server
    (Gated DeltaNet layers on a CPU server run in bf16 only: ``model_needs.server_needs``)."""
    needed = server_needs(model_config, cuda).get("dtype") if model_config is not None else None
    return str(needed[0]) if needed else train_dtype


@dataclass(frozen=True)
class ServerChecks:
    """A run's start-up checks of one server, as values: the run's config, the trainer's model (its name, its config)
    and the dtype the trainer computes in. Whatever keeps the run's servers runs them on each (``fleet.servers``)."""

    config: AsyncGRPOConfig
    model: str = "<model>"
    model_config: Any = None
    cuda: bool = False
    train_dtype: str = "float32"

    def wait(self, control: VLLMControlClient) -> None:
        wait_for_server(control, self.config, self.model, self.cuda)

    def check(self, control: VLLMControlClient) -> ServerCapabilities:
        return check_server(control, self.config, self.model, self.model_config, self.cuda, train_dtype=self.train_dtype)

    @property
    def server_dtype(self) -> str:
        """The dtype every server must compute in (``expected_server_dtype``)."""
        return expected_server_dtype(self.train_dtype, self.model_config, self.cuda)

    def lora_command(self, adapter_rank: int) -> str:
        """The server command adapter sync of an adapter of ``adapter_rank`` needs (``lora_command``)."""
        return lora_command(self.config, adapter_rank, self.model, self.cuda)


def served_dtype(control: VLLMControlClient) -> str | None:
    """The dtype the server loaded the model in (``/server_info``'s ``model_config.dtype``, ``torch.bfloat16``
    written as ``bfloat16``), or None when the server does not say."""
    info = control.probe("GET", "/server_info", params={"config_format": "json"})
    if info.status_code != 200:
        log.warning("could not compare the server's dtype with the trainer's: %s", _server_info_failure(control.base_url, info))
        return None
    dtype = ((info.json().get("vllm_config") or {}).get("model_config") or {}).get("dtype")
    return str(dtype).removeprefix("torch.") if dtype else None


def _check_dtype(control: VLLMControlClient, expected: str, train_dtype: str, config: AsyncGRPOConfig, model: str,
                 cuda: bool) -> None:
    served = served_dtype(control)
    if served is None or served == expected:
        return
    why = "" if expected == train_dtype else f" (this model needs {expected} of its server)"
    raise ServerConfigError(
        f"the server runs the model in {served} and the trainer computes in {train_dtype}{why}: sampler and trainer "
        f"log-probs must come from the same precision. Restart the server with {flags.DTYPE} {expected} "
        f"(ServerOptions.dtype / the job's server.dtype; leave it unset to follow the trainer):\n"
        f"{recommended_command(config, model, cuda, dtype=expected)}"
    )


# ---- the model -------------------------------------------------------------------------------------
_IDENTITY = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _text_config(config: Any) -> dict[str, Any]:
    data = config if isinstance(config, dict) else config.to_dict()
    text = data.get("text_config") or {}
    return {k: data.get(k, text.get(k)) for k in _IDENTITY}


def _check_same_model(served: dict[str, Any], model: str, model_config: Any) -> None:
    """Refuse a server whose model differs in architecture or shape from the trainer's (weight pushes
    would fail mid-run, or worse, land in the wrong places). Readable when the server's model is a
    folder this machine sees; otherwise the token-range probe below still catches a smaller vocabulary."""
    if model_config is None:
        return
    root = Path(str(served.get("root") or served.get("id")))
    if not (root / "config.json").is_file():
        return
    theirs = _text_config(json.loads((root / "config.json").read_text()))
    ours = _text_config(model_config)
    differs = {k: (ours[k], theirs[k]) for k in _IDENTITY if ours[k] is not None and theirs[k] is not None and ours[k] != theirs[k]}
    if differs:
        detail = ", ".join(f"{k}: trainer {a} vs server {b}" for k, (a, b) in differs.items())
        raise ServerConfigError(
            f"the server serves another model than the trainer's: trainer {model!r}, server {str(root)!r} ({detail}). "
            "Point the trainer at a server started on the same model."
        )


# ---- weight transfer --------------------------------------------------------------------------------
_ENGINE_BACKENDS = {"GlooWeightTransferEngine": "gloo", "NCCLWeightTransferEngine": "nccl", "IPCWeightTransferEngine": "ipc"}


def _check_weight_transfer_backend(control: VLLMControlClient, backend: str, command: str) -> None:
    # An init with an unknown field is refused before anything happens, naming the engine the server
    # built from its weight-transfer configuration (or saying it has none).
    reply = control.probe("POST", "/init_weight_transfer_engine", json={"init_info": {"grpo_core_probe": 0}})
    text = reply.text
    if "not configured" in text:
        raise ServerConfigError(
            f"the server was started without {flags.WEIGHT_TRANSFER_CONFIG}, so the trainer cannot push weights "
            f"(the run uses weight_transfer_backend={backend!r}). Restart it with:\n{command}"
        )
    found = re.search(r"Invalid init_info for (\w+)", text)
    served = _ENGINE_BACKENDS.get(found.group(1), found.group(1)) if found else None
    if served is not None and served != backend:
        raise ServerConfigError(
            f"the server's {flags.WEIGHT_TRANSFER_CONFIG} uses backend {served!r} but the trainer uses "
            f"weight_transfer_backend={backend!r}; set weight_transfer_backend={served!r} or restart the server with:\n{command}"
        )


# ---- generation probes -------------------------------------------------------------------------------
class _Prober:
    """One-token generations through whichever endpoint the server offers."""

    def __init__(self, control: VLLMControlClient, token_ids: list[int]):
        self.control = control
        self.token_ids = token_ids
        reply = self._generate_raw({"max_tokens": 1, "temperature": 1.0, "logprobs": 1}, tokens=True)
        self.tokens_endpoint = reply.status_code not in (403, 404)
        if self.tokens_endpoint and reply.status_code != 200:
            self._refuse(reply)

    def _generate_raw(self, params: dict[str, Any], tokens: bool) -> httpx.Response:
        if tokens:
            return self.control.probe("POST", "/inference/v1/generate", json={"token_ids": self.token_ids, "sampling_params": params})
        body = {"prompt": self.token_ids, "return_token_ids": True, "return_tokens_as_token_ids": True, **params}
        return self.control.probe("POST", "/v1/completions", json=body)

    def _refuse(self, reply: httpx.Response) -> None:
        raise ServerConfigError(f"generation probe failed: HTTP {reply.status_code} {reply.text[:500]}")

    def check_vocabulary(self, vocab_size: int, model: str) -> None:
        """A server whose model has a smaller vocabulary refuses the trainer's highest token id (the
        config comparison above cannot see a server's model on another machine)."""
        # Two tokens: vLLM's CPU build kills its engine on a one-token prefill of a Gated DeltaNet model
        # (its conv kernel refuses the single-column input: "causal_conv1d_fwd_cpu: expect x to be transposed").
        saved, self.token_ids = self.token_ids, [vocab_size - 1] * 2
        try:
            reply = self.generate({"max_tokens": 1, "temperature": 1.0})
        finally:
            self.token_ids = saved
        if reply.status_code == 400:
            raise ServerConfigError(
                f"the server serves another model than the trainer's {model!r}: it refuses the trainer's highest token id "
                f"{vocab_size - 1} ({reply.text[:300]}). Point the trainer at a server started on the same model."
            )

    def generate(self, params: dict[str, Any]) -> httpx.Response:
        return self._generate_raw(params, self.tokens_endpoint)

    def top_logprobs(self, params: dict[str, Any]) -> list[float]:
        """The sampled-or-top log-probs of the first generated token, best first."""
        reply = self.generate(params)
        if reply.status_code != 200:
            self._refuse(reply)
        choice = reply.json()["choices"][0]
        num_top = max(int(params.get("logprobs", 0)), 1)
        parsed = parse_generate_choice(choice, num_top) if self.tokens_endpoint else parse_completion_choice(choice, num_top)
        by_id = {parsed.token_ids[0]: parsed.logprobs[0]}  # the sampled token may also be among the top
        if parsed.top_ids is not None:
            by_id.update((int(i), float(v)) for i, v in zip(parsed.top_ids[0], parsed.top_logprobs[0]) if i >= 0)
        return sorted((v for v in by_id.values() if v > -1e30), reverse=True)

    def sampling_mask(self, params: dict[str, Any]) -> Any:
        if not self.tokens_endpoint:
            return None
        reply = self.generate(params)
        return reply.json()["choices"][0].get("sampling_mask") if reply.status_code == 200 else None


def _check_processed_logprobs(probe: _Prober, command: str) -> None:
    # Raw log-probs ignore the temperature; processed ones are computed after it. The same prompt's
    # most likely next token at two temperatures tells them apart.
    cold = probe.top_logprobs({"max_tokens": 1, "temperature": 0.5, "logprobs": 2})
    warm = probe.top_logprobs({"max_tokens": 1, "temperature": 1.0, "logprobs": 2})
    if len(warm) >= 2 and abs(warm[0] - warm[1]) < 1e-9:
        log.warning("could not verify %s: the probe prompt gives a flat distribution", flags.LOGPROBS_MODE)
        return
    if abs(cold[0] - warm[0]) < 1e-6:
        raise ServerConfigError(
            "the server reports raw log-probs, which ignore temperature and top-k/top-p, so importance ratios "
            f"would be wrong: add {flags.LOGPROBS_MODE} processed_logprobs and restart it:\n{command}"
        )


def _check_max_logprobs(probe: _Prober, config: AsyncGRPOConfig, command: str) -> None:
    if config.num_sampler_logprobs == 0:
        return
    wanted = config.num_sampler_logprobs + 1
    reply = probe.generate({"max_tokens": 1, "temperature": 1.0, "logprobs": wanted})
    if reply.status_code == 400 and "max allowed" in reply.text:
        found = re.search(r"max allowed:\s*(-?\d+)", reply.text)
        allowed = found.group(1) if found else "?"
        raise ServerConfigError(
            f"num_sampler_logprobs={config.num_sampler_logprobs} needs {wanted} log-probs per token but the "
            f"server allows {allowed}: raise {flags.MAX_LOGPROBS} to at least {wanted} (or lower num_sampler_logprobs) "
            f"and restart it:\n{command}"
        )
    if reply.status_code != 200:
        raise ServerConfigError(f"log-prob probe failed: HTTP {reply.status_code} {reply.text[:500]}")


def _check_candidate_sets(probe: _Prober, config: AsyncGRPOConfig, command: str) -> bool:
    if not config.needs_candidate_sets():
        return False
    if config.top_k == 0:
        raise ServerConfigError(
            f"top_p={config.top_p} needs top_k > 0 as well: vLLM bounds each token's candidate set by top_k, and the "
            "trainer must renormalise its log-probs over that set (e.g. top_k=512)"
        )
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 1.0, "logprobs": 1, "top_k": config.top_k}
    if config.top_p < 1.0:
        params["top_p"] = config.top_p
    if probe.sampling_mask(params):
        return True
    missing = flags.RETURN_SAMPLING_MASK if probe.tokens_endpoint else f"{flags.ENABLE_SCALE_OUT} and {flags.RETURN_SAMPLING_MASK}"
    log.warning(
        "top_k=%s / top_p=%s: this server does not return each token's candidate set, so the trainer renormalises "
        "over the whole vocabulary and the importance ratios are biased. It needs %s (which needs vLLM's V2 model "
        "runner: VLLM_USE_V2_MODEL_RUNNER=1 where the server refuses the flag, and Triton). Command:\n%s",
        config.top_k, config.top_p, missing, command,
    )
    return False


def _check_routed_experts(probe: _Prober, config: AsyncGRPOConfig, model_config: Any, command: str) -> bool:
    """Whether the server returns routes; for a mixture-of-experts policy without them, one warning."""
    if model_config is None or not is_mixture_of_experts(model_config):
        return False
    if probe.tokens_endpoint:
        reply = probe.generate({"max_tokens": 1, "temperature": 1.0, "logprobs": 0})
        if reply.status_code == 200 and reply.json()["choices"][0].get("routed_experts") is not None:
            return True
    missing = flags.RETURN_ROUTED_EXPERTS if probe.tokens_endpoint else f"{flags.ENABLE_SCALE_OUT} and {flags.RETURN_ROUTED_EXPERTS}"
    if config.routing_replay:
        log.warning(
            "routing_replay: this server does not return the experts it routed each token to, so the trainer routes "
            "every token itself (its top-k can differ from the sampler's; sampling/routing_mismatch is not logged). "
            "It needs %s, which vLLM serves from its V2 model runner only (a GPU build; the CPU build refuses the "
            "flag). Command:\n%s", missing, command,
        )
    return False


# ---- runtime LoRA (adapter sync) -------------------------------------------------------------------
@dataclass
class LoraServing:
    """What the server offers for serving LoRA adapters that the trainer loads at run time."""

    runtime_updates: bool  # /v1/load_lora_adapter exists (runtime LoRA updating on)
    enabled: bool  # started with LoRA serving on
    max_loras: int | None = None
    max_lora_rank: int | None = None

    @property
    def can_serve_adapters(self) -> bool:
        return self.runtime_updates and self.enabled


def smallest_lora_rank(rank: int) -> int:
    """The smallest largest-rank value vLLM accepts that still serves an adapter of ``rank``."""
    for candidate in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if candidate >= rank:
            return candidate
    raise ValueError(f"LoRA rank {rank} exceeds the largest {flags.MAX_LORA_RANK} vLLM accepts (512)")


def lora_command(config: AsyncGRPOConfig, adapter_rank: int, model: str = "<model>", cuda: bool = False) -> str:
    """The server command adapter sync needs: runtime LoRA routes and big enough limits."""
    return recommended_command(
        config, model, cuda, enable_lora=True, max_lora_rank=smallest_lora_rank(adapter_rank), max_loras=resident_adapters(config.max_staleness)
    )


def probe_lora_serving(control: VLLMControlClient) -> LoraServing:
    """Read the server's LoRA settings from ``/server_info`` and probe the runtime load route."""
    # Empty fields make the route answer 400 without touching the engine; a missing route is 404.
    runtime_updates = control.probe("POST", "/v1/load_lora_adapter", json={"lora_name": "", "lora_path": ""}).status_code != 404
    info = control.probe("GET", "/server_info", params={"config_format": "json"})
    if info.status_code != 200:
        raise ServerConfigError(_server_info_failure(control.base_url, info))
    lora = (info.json().get("vllm_config") or {}).get("lora_config")
    if not lora:
        return LoraServing(runtime_updates=runtime_updates, enabled=False)
    return LoraServing(
        runtime_updates=runtime_updates,
        enabled=True,
        max_loras=int(lora["max_loras"]),
        max_lora_rank=int(lora["max_lora_rank"]),
    )


def _server_info_failure(base_url: str, response: httpx.Response) -> str:
    """Why ``/server_info`` (the only place vLLM reports its LoRA limits and dtype) failed, and what fixes it."""
    text = response.text[:300]
    if response.status_code == 500 and "splitlines" in text:
        # vLLM builds the report with a package listing: `python -m pip list` when pip is importable
        # in the server's environment, else `uv pip list`, which fails when uv is not on its PATH.
        return (
            f"{base_url}/server_info failed while the server listed its installed packages (HTTP 500: {text}). "
            "The server's settings were not read; the server itself is fine. vLLM lists packages with pip, or with uv in a "
            "uv-made environment without pip: install pip into the server's environment (or put `uv` on the "
            "server's PATH) and restart the server"
        )
    return f"{base_url}/server_info answered HTTP {response.status_code} ({text}); it is needed to read the server's settings"


def check_lora_limits(serving: LoraServing, max_staleness: int, adapter_rank: int, command: str) -> None:
    """Raise ``ServerConfigError`` when the server cannot hold the adapter window or the adapter's rank; the message
    ends with ``command``, the server to restart with (``lora_command``)."""
    if not serving.can_serve_adapters:
        missing = []
        if not serving.enabled:
            missing.append(flags.ENABLE_LORA)
        if not serving.runtime_updates:
            missing.append(f"{flags.RUNTIME_LORA_ENV}=1")
        raise ServerConfigError(
            f"adapter sync needs a server that loads LoRA adapters at run time; it lacks {' and '.join(missing)}. "
            f"Restart it with:\n{command}"
        )
    problems = []
    if serving.max_lora_rank is not None and serving.max_lora_rank < adapter_rank:
        problems.append(
            f"{flags.MAX_LORA_RANK} {serving.max_lora_rank} is below the adapter's rank {adapter_rank} "
            f"(use {smallest_lora_rank(adapter_rank)}: one of 1, 8, 16, 32, 64, 128, 256, 320, 512)"
        )
    needed = resident_adapters(max_staleness)
    if serving.max_loras is not None and serving.max_loras < needed:
        problems.append(
            f"{flags.MAX_LORAS} {serving.max_loras} is below max_staleness + 2 = {needed} (max_staleness + 1 versions stay "
            "registered so old rollouts finish under their policy, plus the next one loaded before the oldest goes)"
        )
    if problems:
        raise ServerConfigError("the server's LoRA limits are too small: " + "; ".join(problems) + f". Restart it with:\n{command}")


# ---- a fleet of servers ------------------------------------------------------------------------------
FLEET_SETTINGS = {
    "dtype": ("model_config", "dtype"),
    "max_model_len": ("model_config", "max_model_len"),
    "max_logprobs": ("model_config", "max_logprobs"),
    "logprobs_mode": ("model_config", "logprobs_mode"),
    "weight_transfer_backend": ("weight_transfer_config", "backend"),
    "lora": ("lora_config", None),
}
"""Engine settings every server of a fleet must share (``/server_info``): what its samples and pushes depend on.
The model's architecture and shape are compared with the trainer's per server (``check_server``); the sampling
seed differs on purpose (``VLLMServerSpec.for_replica``)."""


def server_fingerprint(control: VLLMControlClient) -> dict[str, Any]:
    """The ``FLEET_SETTINGS`` of the server behind ``control`` (empty when ``/server_info`` does not answer)."""
    config = control.server_config()
    if not config:
        return {}
    out: dict[str, Any] = {}
    for name, (section, key) in FLEET_SETTINGS.items():
        part = config.get(section)
        if key is None:
            out[name] = {k: part.get(k) for k in ("max_lora_rank", "max_loras")} if part else None
        else:
            value = (part or {}).get(key)
            out[name] = value.removeprefix("torch.") if isinstance(value, str) else value
    return out


def check_fleet_alike(servers: dict[str, tuple[ServerCapabilities, dict[str, Any]]]) -> None:
    """Raise ``ServerConfigError`` naming the first server (by URL) whose capabilities or ``FLEET_SETTINGS`` differ
    from the first one's: ``servers`` maps each URL to ``(check_server's capabilities, server_fingerprint)``."""
    if len(servers) < 2:
        return
    (first_url, (first_caps, first_print)), *rest = servers.items()
    for url, (caps, fingerprint) in rest:
        differs = {k: (v, getattr(caps, k)) for k, v in vars(first_caps).items() if getattr(caps, k) != v}
        differs.update({k: (first_print[k], fingerprint[k]) for k in first_print.keys() & fingerprint.keys()
                        if first_print[k] != fingerprint[k]})
        if differs:
            detail = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in sorted(differs.items()))
            raise ServerConfigError(
                f"the fleet's servers differ: {url} against {first_url} ({detail}). Every server of a run serves the "
                f"same model with the same flags: restart {url} with those of {first_url} (a job's `server.replicas` "
                "starts every replica from one spec)"
            )
