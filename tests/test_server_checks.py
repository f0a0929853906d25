"""The start-up check of the weight-transfer backend, against replies shaped as vLLM's (no server).

A real server's refusal of the probe is exercised in tests/integration/test_multi_node.py (a gloo
server, an ``nccl`` trainer); here both directions and a server without a weight-transfer config.
"""

from __future__ import annotations

import httpx
import pytest

from grpo_core.vllm_server.checks import ServerConfigError, _check_weight_transfer_backend

COMMAND = "python -m vllm.entrypoints.openai.api_server <the matching flags>"


class ProbeReply:
    """A control client whose probe of ``/init_weight_transfer_engine`` gets ``text``."""

    def __init__(self, text: str):
        self.text = text
        self.routes: list[str] = []

    def probe(self, method: str, route: str, **kwargs: object) -> httpx.Response:
        self.routes.append(route)
        return httpx.Response(500, text=self.text)


def refusal(engine: str) -> str:
    # vLLM's WeightTransferEngine.parse_init_info, on the probe's unknown field.
    reason = "__init__() got an unexpected keyword argument 'grpo_core_probe'"
    return f'{{"error": "Invalid init_info for {engine}: {reason}"}}'


@pytest.mark.parametrize("engine,served,trainer", [
    ("GlooWeightTransferEngine", "gloo", "nccl"),
    ("NCCLWeightTransferEngine", "nccl", "gloo"),
])
def test_a_mismatch_names_both_backends_and_the_command(engine: str, served: str, trainer: str) -> None:
    control = ProbeReply(refusal(engine))
    with pytest.raises(ServerConfigError) as refused:
        _check_weight_transfer_backend(control, trainer, COMMAND)
    message = str(refused.value)
    assert f"backend {served!r}" in message and f"weight_transfer_backend={trainer!r}" in message
    assert f"set weight_transfer_backend={served!r}" in message and COMMAND in message
    assert control.routes == ["/init_weight_transfer_engine"]


@pytest.mark.parametrize("engine,backend", [("GlooWeightTransferEngine", "gloo"), ("NCCLWeightTransferEngine", "nccl")])
def test_a_matching_backend_passes(engine: str, backend: str) -> None:
    _check_weight_transfer_backend(ProbeReply(refusal(engine)), backend, COMMAND)


def test_a_server_without_weight_transfer_is_refused_with_the_command() -> None:
    # vLLM's worker, when the server was started without a weight-transfer configuration.
    control = ProbeReply('{"error": "Weight transfer not configured. '
                         'Please set weight_transfer_config to enable weight transfer."}')
    with pytest.raises(ServerConfigError, match="started without --weight-transfer-config") as refused:
        _check_weight_transfer_backend(control, "gloo", COMMAND)
    assert "weight_transfer_backend='gloo'" in str(refused.value) and COMMAND in str(refused.value)


# ---- truncated sampling: which flag each feature needs ---------------------------------------------------
class MaskProbe:
    """A prober whose server returns a candidate-set mask, or not, through one endpoint."""

    def __init__(self, tokens_endpoint: bool, mask: object):
        self.tokens_endpoint, self.mask = tokens_endpoint, mask
        self.asked: list[dict] = []

    def sampling_mask(self, params: dict) -> object:
        self.asked.append(params)
        return self.mask


def test_top_p_without_top_k_is_refused_naming_both_fields() -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.checks import _check_candidate_sets

    probe = MaskProbe(tokens_endpoint=True, mask=[1])
    with pytest.raises(ServerConfigError, match=r"top_p=0.9 needs top_k > 0"):
        _check_candidate_sets(probe, AsyncGRPOConfig(top_p=0.9), COMMAND)
    assert probe.asked == [], "refused before asking the server"


@pytest.mark.parametrize("tokens_endpoint,needed", [
    (False, "--enable-scale-out and --return-sampling-mask"),
    (True, "needs --return-sampling-mask ("),
])
def test_a_server_without_candidate_sets_is_told_which_flags_and_runner(tokens_endpoint: bool, needed: str, caplog) -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.checks import _check_candidate_sets

    with caplog.at_level("WARNING"):
        assert _check_candidate_sets(MaskProbe(tokens_endpoint, None), AsyncGRPOConfig(top_k=20, top_p=0.95), COMMAND) is False
    message = caplog.records[-1].getMessage()
    assert needed in message and "VLLM_USE_V2_MODEL_RUNNER=1" in message and COMMAND in message


def test_a_server_with_candidate_sets_passes_quietly(caplog) -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.checks import _check_candidate_sets

    probe = MaskProbe(tokens_endpoint=True, mask=[0, 1])
    with caplog.at_level("WARNING"):
        assert _check_candidate_sets(probe, AsyncGRPOConfig(top_k=20, top_p=0.95), COMMAND) is True
    assert not caplog.records and probe.asked[0]["top_k"] == 20 and probe.asked[0]["top_p"] == 0.95
    assert _check_candidate_sets(probe, AsyncGRPOConfig(), COMMAND) is False and len(probe.asked) == 1
