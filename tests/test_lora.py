"""Unit tests of LoRA support: merging, adapter files, the version window, mode choice and start-up checks.

A random 2-layer Qwen3 stands in for the policy (built in memory, no server); the server-facing
parts are covered against the real vLLM CPU server in ``tests/integration/test_lora_sync.py``.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing as mp

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel

from grpo_core.config import AsyncGRPOConfig, ConfigError
from grpo_core.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraConfigError,
    adapter_state,
    apply_lora,
    base_name,
    base_named_tensors,
    max_rank,
    merged_named_tensors,
    warn_if_not_saved,
    write_adapter,
)
from grpo_core.sync.factory import SyncSetup, make_weight_sync, resolve_lora_mode
from grpo_core.sync.lora import AdapterPointer, AdapterWindow, serving_path
from grpo_core.vllm_server.checks import (
    LoraServing,
    ServerChecks,
    ServerConfigError,
    check_lora_limits,
    lora_command,
    smallest_lora_rank,
)
from tests import child_processes
from tests.tolerances import gamma


def _tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


def _trained_lora(r: int = 4, seed: int = 0) -> torch.nn.Module:
    """A LoRA policy whose B matrices are non-zero (peft starts them at zero, which would hide bugs)."""
    model = apply_lora(_tiny_qwen3(seed), LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


# ---- merged weights --------------------------------------------------------------------------------------
def test_merged_weights_equal_peft_merge_and_leave_the_adapter_untouched() -> None:
    model = _trained_lora()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {n: t.detach().clone() for n, t in merged_named_tensors(model)}

    reference = copy.deepcopy(model).merge_and_unload()
    expected = dict(reference.named_parameters())
    assert list(merged) == list(expected)  # plain checkpoint names, same order as the unwrapped model
    # Two implementations of W + s·B@A (ours, PEFT's), fp32: a rank-r dot, the scaling and the sum,
    # each within γ_{r+2}·(|W| + s·|B|·|A|) of exact. Weights without an adapter are the same tensor.
    magnitude = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            lora_a, lora_b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
            magnitude[base_name(f"{module_name}.base_layer.weight")] = (
                module.base_layer.weight.detach().abs() + module.scaling["default"] * lora_b.abs() @ lora_a.abs())
    assert magnitude, "no adapted layer found"
    for name, tensor in expected.items():
        bound = 2 * gamma(4 + 2) * magnitude[name] if name in magnitude else torch.zeros_like(tensor)
        assert ((merged[name] - tensor).abs() <= bound).all(), name
    # The merge changed every adapted layer (so the comparison above is not trivially base == base).
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed while merging"


def test_merged_model_gives_the_peft_models_logits() -> None:
    model = _trained_lora()
    plain = _tiny_qwen3()
    plain.load_state_dict(dict(merged_named_tensors(model)), strict=False)
    ids = torch.tensor([[3, 14, 15, 92, 6, 5]])
    hidden = []
    plain.lm_head.register_forward_hook(lambda m, inp, out: hidden.append(inp[0]))
    with torch.no_grad():
        merged_logits, peft_logits = plain(input_ids=ids).logits, model(input_ids=ids).logits
    # fp32, merged (W + sBA)·x against W·x + s·B·(A·x): each logit within γ_k of its dot's magnitude
    # |h|·|W_head| (first order), k the longest sum: the MLP's 96 inputs plus the rank-4 path and scaling.
    k = plain.config.intermediate_size + 4 + 2
    bound = 2 * gamma(k) * (hidden[0].abs() @ plain.lm_head.weight.detach().abs().T)
    assert ((merged_logits - peft_logits).abs() <= bound).all()


def test_base_tensors_are_the_original_weights_under_checkpoint_names() -> None:
    original = {n: p.detach().clone() for n, p in _tiny_qwen3().named_parameters()}
    base = dict(base_named_tensors(_trained_lora()))
    assert list(base) == list(original)
    for name, tensor in original.items():
        assert torch.equal(base[name], tensor), name


@pytest.mark.parametrize(
    ("peft_name", "expected"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("base_model.model.model.layers.1.mlp", "model.layers.1.mlp"),
    ],
)
def test_base_name(peft_name: str, expected: str) -> None:
    assert base_name(peft_name) == expected


# ---- apply_lora ------------------------------------------------------------------------------------------
def test_apply_lora_trains_only_the_adapter() -> None:
    model = _trained_lora()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (LoraConfig(r=4, target_modules="all-linear", use_dora=True), "use_dora"),
        (LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"]), "modules_to_save"),
        (LoraConfig(r=4, target_modules="all-linear", bias="all"), "bias"),
        (LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), "non-linear"),
        (LoraConfig(r=1024, target_modules="all-linear"), "512"),
    ],
)
def test_apply_lora_refuses_what_cannot_be_synced(config: LoraConfig, needle: str) -> None:
    with pytest.raises(LoraConfigError, match=needle):
        apply_lora(_tiny_qwen3(), config)


def test_apply_lora_wants_a_lora_config() -> None:
    with pytest.raises(LoraConfigError, match="LoraConfig"):
        apply_lora(_tiny_qwen3(), {"r": 8})


def test_max_rank_includes_the_rank_pattern() -> None:
    assert max_rank(LoraConfig(r=8)) == 8
    assert max_rank(LoraConfig(r=8, rank_pattern={"q_proj": 32})) == 32


# ---- adapter files ---------------------------------------------------------------------------------------
def test_written_adapter_loads_back_in_peft_with_the_same_logits(tmp_path) -> None:
    model = _trained_lora()
    url = f"file://{tmp_path}/v3"
    nbytes = write_adapter(model, url, base_model_name_or_path="/models/base")
    assert {p.name for p in (tmp_path / "v3").iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert nbytes == (tmp_path / "v3" / ADAPTER_WEIGHTS).stat().st_size
    # Only the adapter travels: its fp32 tensors plus the safetensors header (names and offsets).
    state = adapter_state(model)
    tensor_bytes = sum(t.numel() * 4 for t in state.values())
    assert tensor_bytes < nbytes < tensor_bytes + 256 * len(state)

    loaded = PeftModel.from_pretrained(_tiny_qwen3(), str(tmp_path / "v3")).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():  # exact: the same fp32 tensors (safetensors round-trips them bit for bit), the same PEFT forward
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    import json

    config = json.loads((tmp_path / "v3" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == "/models/base"
    assert isinstance(config["target_modules"], list) and "model.layers.0.mlp.down_proj" in config["target_modules"]


def test_serving_path_is_a_plain_path_for_local_files(tmp_path) -> None:
    assert serving_path(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert serving_path(f"{tmp_path}/x") == f"{tmp_path}/x"
    assert serving_path("memory://bucket/x") == "memory://bucket/x"


def test_save_strategy_no_warns_that_nothing_survives(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="grpo_core.models.lora"):
        warn_if_not_saved(AsyncGRPOConfig(save_strategy="steps"))
        assert not caplog.records
        warn_if_not_saved(AsyncGRPOConfig(save_strategy="no", output_dir="/runs/a"))
    assert len(caplog.records) == 1
    assert "/runs/a/.vllm_lora/" in caplog.text and "nothing of this run will survive" in caplog.text


# ---- the version window ----------------------------------------------------------------------------------
def test_window_keeps_max_staleness_plus_one_versions_and_unloads_oldest_first() -> None:
    window = AdapterWindow(size=3, delete_grace_s=0.0)
    unloaded = []
    for version in range(7):
        step = window.push(version, now=float(version))
        assert step.load == version
        unloaded += step.unload
        assert list(window.registered) == list(range(max(0, version - 2), version + 1))
        assert step.delete == step.unload  # no grace: a retired folder goes at once
    assert unloaded == [0, 1, 2, 3]


def test_window_deletes_retired_folders_only_after_the_grace_period() -> None:
    window = AdapterWindow(size=1, delete_grace_s=10.0)
    assert window.push(0, now=0.0).delete == []
    assert window.push(1, now=1.0).unload == [0]
    assert window.push(2, now=5.0).delete == []  # 0 retired at 1.0, only 4 s ago
    step = window.push(3, now=15.5)  # 0 retired at 1.0 and 1 at 5.0: both past 10 s
    assert step.delete == [0, 1] and step.unload == [2]
    assert [v for v, _ in window.retired] == [2]


def test_window_refuses_versions_that_go_backwards() -> None:
    window = AdapterWindow(size=2, delete_grace_s=0.0)
    window.push(4, now=0.0)
    with pytest.raises(ValueError, match="not newer"):
        window.push(4, now=1.0)


def _read_pointer(pointer: AdapterPointer, out: mp.Queue) -> None:
    out.put(pointer.get())


def test_pointer_is_seen_by_a_spawned_process() -> None:
    pointer = AdapterPointer()
    assert pointer.get() is None
    pointer.set("grpo-abc-v7", 7)
    ctx = child_processes.context()  # pickled across, as to the spawned rollout worker
    out = ctx.Queue()
    child = ctx.Process(target=_read_pointer, args=(pointer, out))
    child.start()
    try:
        assert out.get(timeout=60) == ("grpo-abc-v7", 7)
    finally:
        child.join(timeout=30)
    pointer.set("grpo-abc-v8", 8)
    assert pointer.get() == ("grpo-abc-v8", 8)


# ---- mode choice and start-up checks ---------------------------------------------------------------------
SERVES = LoraServing(runtime_updates=True, enabled=True, max_loras=6, max_lora_rank=16)
NO_ROUTES = LoraServing(runtime_updates=False, enabled=True, max_loras=6, max_lora_rank=16)
NO_LORA = LoraServing(runtime_updates=True, enabled=False)


@pytest.mark.parametrize(
    ("requested", "serving", "expected"),
    [
        ("auto", SERVES, "adapter"),
        ("auto", NO_ROUTES, "merged"),
        ("auto", NO_LORA, "merged"),
        ("merged", SERVES, "merged"),
        ("adapter", NO_LORA, "adapter"),  # then check_lora_limits fails with the command
    ],
)
def test_resolve_lora_mode(requested: str, serving: LoraServing, expected: str) -> None:
    assert resolve_lora_mode(requested, serving) == expected


@pytest.mark.parametrize(("rank", "expected"), [(1, 1), (4, 8), (8, 8), (9, 16), (33, 64), (300, 320), (512, 512)])
def test_smallest_lora_rank(rank: int, expected: int) -> None:
    assert smallest_lora_rank(rank) == expected


def test_lora_command_carries_the_flags_adapter_sync_needs() -> None:
    command = lora_command(AsyncGRPOConfig(max_staleness=4), adapter_rank=20, model="Qwen/Qwen3-4B")
    assert command.startswith("VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ")
    for flag in ("--model Qwen/Qwen3-4B", "--enable-lora", "--max-lora-rank 32", "--max-loras 6", "--weight-transfer-config"):
        assert flag in command


def test_the_runs_checks_write_the_lora_command_for_the_servers_device() -> None:
    """The orchestrator writes a LoRA run's command with its server checks: the run's model, its device."""
    config = AsyncGRPOConfig(max_staleness=4)
    for cuda in (False, True):
        checks = ServerChecks(config, "Qwen/Qwen3-4B", cuda=cuda)
        assert checks.lora_command(20) == lora_command(config, 20, "Qwen/Qwen3-4B", cuda=cuda)


def test_limits_pass_when_big_enough() -> None:
    check_lora_limits(SERVES, 4, 16, lora_command(AsyncGRPOConfig(max_staleness=4), 16))


def test_limits_name_a_too_small_rank() -> None:
    with pytest.raises(ServerConfigError) as err:
        check_lora_limits(SERVES, 4, 17, lora_command(AsyncGRPOConfig(max_staleness=4), 17))
    assert "--max-lora-rank 16 is below the adapter's rank 17" in str(err.value)
    assert "--max-loras" not in str(err.value).split("Restart")[0]
    assert "--max-lora-rank 32" in str(err.value)


def test_limits_name_too_few_loras() -> None:
    with pytest.raises(ServerConfigError) as err:
        check_lora_limits(SERVES, 5, 8, lora_command(AsyncGRPOConfig(max_staleness=5), 8))
    assert "--max-loras 6 is below max_staleness + 2 = 7" in str(err.value)
    assert "--max-loras 7" in str(err.value)


def test_limits_name_what_the_server_lacks() -> None:
    with pytest.raises(ServerConfigError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        check_lora_limits(NO_ROUTES, 4, 8, lora_command(AsyncGRPOConfig(), 8))
    with pytest.raises(ServerConfigError, match="lacks --enable-lora"):
        check_lora_limits(NO_LORA, 4, 8, lora_command(AsyncGRPOConfig(), 8))


class _ServerWithoutLora:
    """A control client of a server started without LoRA serving (what ``probe_lora_serving`` asks)."""

    base_url = "http://server:8000"

    def probe(self, method: str, path: str, **_: object) -> httpx.Response:
        return httpx.Response(404) if path == "/v1/load_lora_adapter" else httpx.Response(200, json={"vllm_config": {}})


def test_the_sync_shows_the_server_command_it_was_given() -> None:
    """The weight sync reads only its own settings; the restart command, which spells fields of every part, is
    written by the orchestrator and shown as given."""
    config = AsyncGRPOConfig(lora_sync_mode="adapter")
    setup = SyncSetup(config=config.sync, model=None, rank=0, backend="gloo", wire_dtype=None, model_path="m",
                      peft_config=LoraConfig(r=8, target_modules="all-linear"), lora_command="COMMAND FROM THE RUN")
    with pytest.raises(ServerConfigError, match="lacks --enable-lora.*\nCOMMAND FROM THE RUN$"):
        make_weight_sync(setup, _ServerWithoutLora())


def test_config_rejects_an_unknown_lora_sync_mode() -> None:
    with pytest.raises(ConfigError, match="lora_sync_mode"):
        AsyncGRPOConfig(lora_sync_mode="adapters")


# ---- the loop's generation call (a scripted client stands in for the server) ----------------------------
class _ScriptedClient:
    """Replies to ``generate`` from a list: an exception is raised, anything else returned."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.models: list[str | None] = []

    async def generate(self, token_ids, params, num_top=0, model=None):
        self.models.append(model)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return [reply]


def _loop_with(client: _ScriptedClient, pointer: AdapterPointer | None):
    from grpo_core.rollout.stages import AsyncRolloutLoop

    loop = AsyncRolloutLoop(AsyncGRPOConfig(), tokenizer=None, dataset=[], reward_funcs=[], base_url="http://unused",
                            emit=None, adapter=pointer)
    loop.client = client
    return loop


def _choice():
    from grpo_core.vllm_server.replies import GeneratedChoice

    return GeneratedChoice(token_ids=[1], logprobs=[-0.5], finish_reason="stop")


def test_generate_turn_moves_to_the_newest_adapter_when_its_own_was_unloaded() -> None:
    import asyncio

    from grpo_core.vllm_server.control import VLLMRequestError

    pointer = AdapterPointer()
    pointer.set("run-v5", 5)
    client = _ScriptedClient([VLLMRequestError("/inference/v1/generate -> HTTP 404: model run-v3 not found"), _choice()])
    choice, pinned = asyncio.run(_loop_with(client, pointer).generate_turn([1, 2], {"max_tokens": 1}, ("run-v3", 3)))
    assert pinned == ("run-v5", 5) and client.models == ["run-v3", "run-v5"]
    assert _loop_with(client, pointer).turn_record([1, 2], choice, pinned).policy_version == 5


def test_generate_turn_raises_real_errors() -> None:
    import asyncio

    from grpo_core.vllm_server.control import VLLMRequestError

    pointer = AdapterPointer()
    pointer.set("run-v5", 5)
    failing = _ScriptedClient([VLLMRequestError("/inference/v1/generate -> HTTP 400: bad request")])
    with pytest.raises(VLLMRequestError, match="HTTP 400"):
        asyncio.run(_loop_with(failing, pointer).generate_turn([1], {"max_tokens": 1}, ("run-v3", 3)))
    # Unloaded, and no newer adapter to move to: the 404 is the answer.
    gone = _ScriptedClient([VLLMRequestError("/inference/v1/generate -> HTTP 404: model run-v5 not found")])
    with pytest.raises(VLLMRequestError, match="HTTP 404"):
        asyncio.run(_loop_with(gone, pointer).generate_turn([1], {"max_tokens": 1}, ("run-v5", 5)))


def test_generate_client_resends_on_a_dropped_connection_and_gives_up_after_three() -> None:
    import asyncio

    import httpx

    from grpo_core.rollout.generation import VLLMGenerateClient

    reply = {"choices": [{"token_ids": [7], "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "stop"}]}

    def run(drops: int) -> tuple[list, int]:
        calls = []

        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            if len(calls) <= drops:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return httpx.Response(200, json=reply)

        async def go():
            client = VLLMGenerateClient("http://unused")
            client._http = httpx.AsyncClient(base_url="http://unused", transport=httpx.MockTransport(handler))
            try:
                return await client.generate([1, 2], {"max_tokens": 1})
            finally:
                await client.aclose()

        return asyncio.run(go()), len(calls)

    (choice,), calls = run(drops=2)
    assert choice.token_ids == [7] and choice.logprobs == [-0.25] and calls == 3
    with pytest.raises(httpx.RemoteProtocolError):
        run(drops=3)
