"""Weight sync you can trust, against a CPU vLLM server of this module: storage patches, deadlines, verification.

(a) a run whose server is fed only through weight patches on storage ends with the server holding
    the trainer's weights exactly and serving its log-probs within the dense push's tolerance;
(b) a push whose receiver stops mid-transfer ends in an error naming the phase, the server and the
    version within its deadline, and the run finishes once the server is back;
(c) a server left on old weights under a new version number is caught by the check and named.

The module starts its own server, without LoRA support: the probe that checks a push asks the server for
prompt log-probs while rollouts decode, which vLLM's CPU LoRA kernels cannot batch (``fleet/verify.py``), so
the session's LoRA-enabled server gets no probe. Each test leaves the server as it found it (serving,
unpaused); the next test pushes its own weights at start-up anyway.

    .venv/bin/python -m pytest -q tests/integration/test_weight_sync_trust.py
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time

import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.storage.store import Storage
from grpo_core.sync.errors import ServedVersionMismatch, ServedWeightsMismatch, WeightSyncTimeout
from grpo_core.sync.source import checkpoint_name
from grpo_core.sync.wire.digest import tensor_digest
from grpo_core.sync.wire.patch_store import PatchReader, apply_patch, plan_chain
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec
from tests.integration.test_async_loop import fast_config

pytestmark = pytest.mark.integration

# The bound the dense push meets on this server (tests/integration/test_async_loop.py explains it).
DENSE_LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def plain_server(tiny_model_path, server_logs):
    """The tiny model served as the session's server is, but without LoRA support (module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the server's worker shares the cores (conftest)
    server = VLLMServer(VLLMServerSpec(model=tiny_model_path, max_model_len=512, max_logprobs=20),
                        server_logs / "sync-trust").start(timeout_s=900)
    yield server
    server.stop()
    torch.set_num_threads(threads)


def config(url: str, tmp_path, **overrides) -> AsyncGRPOConfig:
    return fast_config(url, tmp_path, **{"per_device_train_batch_size": 8, "worker_heartbeat_timeout_s": 60.0, **overrides})


def trainer_weights(trainer: AsyncGRPOTrainer) -> dict[str, torch.Tensor]:
    """The policy's weights under checkpoint names, as the trainer pushes them (fp32 on the CPU)."""
    return {checkpoint_name(n): p.detach().clone() for n, p in trainer.model.named_parameters()}


def served_and_own_logprobs(url: str, model_path: str, weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's and a fresh Hugging Face copy of ``weights``' log-probs of an answered prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.vllm_server.control import VLLMControlClient

    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text + "The answer is \\boxed{7}.", add_special_tokens=False)["input_ids"]
    control = VLLMControlClient(url)
    try:
        served = torch.tensor(control.prompt_logprobs(ids), dtype=torch.float64)
    finally:
        control.close()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)
    own = torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids))])
    return served, own


# ---------------------------------------------------------------------------------------------- (a)
def test_a_server_fed_only_through_storage_patches_holds_the_trainers_weights(plain_server, tiny_model_path, tmp_path):
    steps = 20
    args = config(plain_server.base_url, tmp_path, max_steps=steps, weight_sync_transport="storage",
                  weight_patch_keyframe_every=8, weight_sync_verify_every=5)
    trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward, format_reward], train_dataset=arithmetic_dataset()["train"],
                               args=args)
    history = trainer.train()
    assert len(history) == steps
    weights = trainer_weights(trainer)
    storage = Storage(f"{args.output_dir}/weight_patches")
    reader = PatchReader(storage)
    manifests = reader.manifests()
    assert max(manifests) == steps

    # The server applied the chain to version 20 and wrote what it holds: every tensor's digest is the
    # digest of the trainer's tensor.
    (folder,) = storage.ls(storage.path("receipts"))  # one server, one folder of receipts
    receipt = storage.read_json(storage.path_in(folder["name"], f"v{steps:010d}-w0.json"))
    assert receipt["digests"] == {n: tensor_digest(t) for n, t in weights.items()}
    # The patches alone rebuild the trainer's weights bit for bit (a server that held nothing would).
    rebuilt: dict[str, torch.Tensor] = {}
    for version in plan_chain(manifests.get, None, steps):
        apply_patch(manifests[version], reader.read(manifests[version]), rebuilt)
    for name, tensor in weights.items():
        assert torch.equal(rebuilt[name], tensor.reshape(-1)), name

    served, own = served_and_own_logprobs(plain_server.base_url, tiny_model_path, weights)
    diff = (served - own).abs().max().item()
    shares = [h["sync/changed_share"] for h in history if "sync/changed_share" in h]
    deltas = [m for m in manifests.values() if m.base_version is not None]
    print(f"storage-fed server: log-prob diff {diff:.2e}; changed share of delta pushes {min(shares):.3f}-{max(shares):.3f}; "
          f"patch bytes delta {sum(m.nbytes for m in deltas) / len(deltas):.0f} vs keyframe "
          f"{max(m.nbytes for m in manifests.values() if m.base_version is None):.0f}; "
          f"sync/seconds mean {sum(h['sync/seconds'] for h in history) / steps:.3f}")
    assert diff < DENSE_LOGPROB_ATOL, diff
    assert deltas and history[-1]["weight_version"] == steps


# ---------------------------------------------------------------------------------------------- (b)
def engine_processes(server) -> list:
    """The server's processes below its API server (the engine core, which runs the CPU worker)."""
    import psutil

    return psutil.Process(server.process.pid).children(recursive=True)


def test_a_push_whose_receiver_stops_ends_in_a_named_error_within_its_deadline_and_the_run_finishes(
        plain_server, tiny_model_path, tmp_path, monkeypatch, caplog):
    from grpo_core.sync.send import gloo_trainer

    floor_s, stopped_for_s, stop_at = 4.0, 12.0, 3
    args = config(plain_server.base_url, tmp_path, max_steps=6, weight_sync_deadline_floor_s=floor_s,
                  weight_sync_bucket_mb=1, weight_sync_verify_every=0, server_unavailable_timeout_s=120.0)
    trainer = AsyncGRPOTrainer(tiny_model_path, [accuracy_reward], train_dataset=arithmetic_dataset()["train"], args=args)
    stopped: dict[str, float] = {}
    send = gloo_trainer._BucketSender.__call__

    def stop_after_first_bucket(self, buffer):
        send(self, buffer)
        if self.index == 1 and self.clock.version == stop_at and not stopped:
            processes = engine_processes(plain_server)
            for p in processes:
                p.send_signal(signal.SIGSTOP)
            stopped["at"] = time.time()

            def resume() -> None:
                for p in processes:
                    p.send_signal(signal.SIGCONT)
                stopped["resumed"] = time.time()

            threading.Timer(stopped_for_s, resume).start()

    monkeypatch.setattr(gloo_trainer._BucketSender, "__call__", stop_after_first_bucket)
    caplog.set_level(logging.WARNING, logger="grpo_core")
    try:
        history = trainer.train()
    finally:
        for p in engine_processes(plain_server):
            p.send_signal(signal.SIGCONT)
    assert "at" in stopped, "the server was never stopped"
    failures = [r for r in caplog.records if "the push of weight version" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    message = failures[0].getMessage()
    named = re.search(rf"WeightSyncTimeout: weight sync to {re.escape(plain_server.base_url)}: phase '(\w+)' of the push "
                      rf"of version {stop_at} passed its deadline of ([\d.]+) s = max\(floor {floor_s:g} s", message)
    assert named, message
    phase, deadline_s = named.group(1), float(named.group(2))
    noticed = failures[0].created - stopped["at"]
    print(f"stopped after the first bucket of version {stop_at}; phase '{phase}' named {noticed:.1f} s later "
          f"(deadline {deadline_s:.1f} s); the server was stopped {stopped_for_s:g} s; run finished")
    assert phase in ("transfer", "update") and noticed <= deadline_s + 1.0, (phase, noticed, deadline_s)
    assert len(history) == 6 and trainer.run.pusher is None  # finished and torn down
    assert history[-1]["sync/recoveries"] == 1.0 and history[-1]["weight_version"] == 6.0


# ---------------------------------------------------------------------------------------------- (c)
def test_a_server_left_on_old_weights_is_caught_and_named(plain_server, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from grpo_core.fleet.verify import PushVerifier, VerifyConfig, check_version
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource
    from grpo_core.vllm_server.control import VLLMControlClient

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    control = VLLMControlClient(plain_server.base_url)
    sync = ProtocolWeightSync(control, ModelWeightSource(model), backend="gloo")
    verifier = PushVerifier(VerifyConfig(), model.config.vocab_size)

    def own(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logp = model(torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)
        return torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids))])

    try:
        sync.push(200)
        check_version(control, 200)
        report = verifier.check_logprobs(control, 200, own(verifier.token_ids))
        # One step of training, pushed only as a version number: the server keeps the old weights.
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        control.update_weight_version("201")
        check_version(control, 201)  # the number alone says nothing
        with pytest.raises(ServedWeightsMismatch, match=rf"the vLLM server at {plain_server.base_url} does not serve the "
                                                        r"trainer's weights of version 201: its log-probs of the probe differ"):
            verifier.check_logprobs(control, 201, own(verifier.token_ids))
        with pytest.raises(ServedVersionMismatch, match=rf"at {plain_server.base_url} reports weight version '201' right "
                                                        r"after the push of version 202"):
            check_version(control, 202)
        print(f"probe log-prob diff on the right weights {report.max_diff:.2e} (tolerance {verifier.atol:g})")
        sync.push(202)  # leave the server on pushed weights
    finally:
        sync.close()
        control.close()
