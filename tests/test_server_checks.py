"""Start-up checks (weight-transfer backend, sampling flags, dtype) against replies shaped as vLLM's (no server).

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


# ---- precision: the server runs the model in the dtype the trainer computes in -----------------------------
class ServerInfo:
    """A control client whose ``/server_info`` reports ``dtype`` as vLLM's JSON config dump writes it."""

    base_url = "http://server"

    def __init__(self, dtype: str | None, status: int = 200):
        self.dtype, self.status = dtype, status

    def probe(self, method: str, route: str, **kwargs: object) -> httpx.Response:
        assert (method, route) == ("GET", "/server_info")
        model_config = {"dtype": self.dtype, "max_model_len": 512} if self.dtype else {}
        return httpx.Response(self.status, json={"vllm_config": {"model_config": model_config}})


@pytest.mark.parametrize("cuda,bf16,fp16,want", [
    (True, None, False, "bfloat16"), (False, None, False, "float32"), (True, False, False, "float32"),
    (True, None, True, "float16"), (False, True, False, "bfloat16"),
])
def test_the_served_dtype_follows_the_training_dtype(cuda: bool, bf16: bool | None, fp16: bool, want: str) -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.process import ServerOptions, VLLMServerSpec

    spec = VLLMServerSpec.for_run("m", AsyncGRPOConfig(bf16=bf16, fp16=fp16), ServerOptions(), cuda=cuda)
    assert spec.dtype == want
    assert spec.flags()[spec.flags().index("--dtype") + 1] == want
    # A dtype the user chose is kept (the start-up check then compares it with the trainer's).
    assert VLLMServerSpec.for_run("m", AsyncGRPOConfig(), ServerOptions(dtype="float32"), cuda=True).dtype == "float32"


def test_a_dtype_mismatch_names_both_and_the_command() -> None:
    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.vllm_server.checks import _check_dtype, served_dtype

    assert served_dtype(ServerInfo("torch.float32")) == "float32"
    with pytest.raises(ServerConfigError) as refused:
        _check_dtype(ServerInfo("torch.float32"), "bfloat16", "bfloat16", AsyncGRPOConfig(), "m", True)
    message = str(refused.value)
    assert "server runs the model in float32" in message and "trainer computes in bfloat16" in message
    assert "--dtype bfloat16" in message and "python -m vllm.entrypoints.openai.api_server" in message
    _check_dtype(ServerInfo("torch.bfloat16"), "bfloat16", "bfloat16", AsyncGRPOConfig(), "m", True)
    # A server that cannot report it is not refused for it (the other checks still run).
    _check_dtype(ServerInfo(None, status=500), "bfloat16", "bfloat16", AsyncGRPOConfig(), "m", True)


def test_a_model_that_needs_a_bf16_cpu_server_may_train_in_fp32() -> None:
    from transformers import PretrainedConfig

    from grpo_core.vllm_server.checks import expected_server_dtype

    hybrid = PretrainedConfig(layer_types=["linear_attention", "full_attention"])
    assert expected_server_dtype("float32", hybrid, cuda=False) == "bfloat16"
    assert expected_server_dtype("float32", hybrid, cuda=True) == "float32"
    assert expected_server_dtype("bfloat16", PretrainedConfig(), cuda=True) == "bfloat16"
