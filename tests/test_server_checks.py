"""The start-up check of the weight-transfer backend, against replies shaped as vLLM's (no server).

A real server's refusal of the probe is exercised in tests/integration/test_multi_node.py (a gloo
server, an ``nccl`` trainer); here both directions and a server without a weight-transfer config.
"""

from __future__ import annotations

import httpx
import pytest

from grpo_core.server_checks import ServerConfigError, _check_weight_transfer_backend

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
