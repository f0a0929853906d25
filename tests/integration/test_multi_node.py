"""The multi-host settings, shown on one machine with loopback addresses as hosts.

The session's CPU vLLM server of the tiny model is bound to 127.0.0.2 (``SESSION_SERVER_HOST`` in
tests/conftest.py), not the 127.0.0.1 the trainers use, and every test here uses it:

(a) **Default rendezvous address.** A trainer given no ``weight_transfer_address`` builds its weight
sync the trainer's way (``make_weight_sync``): the address the server dials back is the one the
kernel routes towards the server's URL, asserted equal to the source address of a real TCP
connection to the server, and a push over gloo lands there: the server's weight version is the
pushed one and its log-probs are the pushed weights' (not the ones it served before). On one host
the loopback route's source is 127.0.0.1 whatever the 127/8 destination, so this proves the
resolution and the dial-back path, not a route between machines.

(b) **Two "nodes".** The flow's own launch (``train_flow.training_launch``: ``nnodes=2``, one process
per node, torchrun's static rendezvous at 127.0.0.1) is run as two process groups, node ranks 0
and 1, each through ``LocalProvisioner.run_training``; node 1 runs exactly the command node 0 logs
for it. Both exit 0 after the steps; rank 0's result has every step's loss with each step split
into one row per rank; the checkpoint holds the RNG state of both ranks and matches its manifest;
the ledger has every step; the server serves the last step's weight version. torchrun's static
rendezvous (the one with fixed node ranks) takes no local address (``--local-addr`` is read by the
dynamic c10d/etcd rendezvous only), so node 1 does not advertise 127.0.0.2: the nodes differ by
rank and process group, and rank 0's weight sync dials the server on 127.0.0.2.

(c) **Backend mismatch.** A trainer set to ``weight_transfer_backend="nccl"`` is refused at start-up by
this gloo server, before any weight moves, with a message naming both backends and the command
that starts a matching server.

Cost on the 2-core machine: no server start of its own (the session's); (a) ~25 s, (b) ~90 s (two
torchrun nodes, 2 steps, a checkpoint), (c) ~3 s.

    .venv/bin/python -m pytest -m integration tests/integration/test_multi_node.py
"""

from __future__ import annotations

import json
import logging
import shlex
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.process import free_port
from tests.conftest import SESSION_SERVER_HOST
from tests.integration.test_async_loop import server_logprobs, trainer_logprobs

pytestmark = pytest.mark.integration

SECOND_HOST = SESSION_SERVER_HOST
STEPS = 2
NODE_TIMEOUT_S = 600.0
TOKENS = list(range(5, 37))
# Empirical, as in test_async_loop.test_sync_makes_server_logprobs_equal_trainer (the same model and
# sync): the server's fp32 log-probs against the trainer's differ by a few u·λ ≈ 4e-6; 1e-4 is the
# √k·u·λ bound of random-order roundings there. The perturbation below moves them by > 1e-2.
SAME_WEIGHTS = 1e-4


@pytest.fixture(scope="module")
def second_host_server(vllm_server):
    """The session server, which listens on a loopback address other than the trainers' 127.0.0.1."""
    assert vllm_server.spec.host == SECOND_HOST
    return vllm_server


def routed_source_address(host: str, port: int) -> str:
    """The local address a TCP connection to ``host:port`` leaves from: the trainer as the server sees it."""
    with socket.create_connection((host, port), timeout=10) as conn:
        return conn.getsockname()[0]


# ------------------------------------------------------------------------------------------ (a)
def test_a_sync_reaches_a_server_on_another_address_at_the_routed_address(second_host_server, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_core.sync.factory import SyncSetup, make_weight_sync

    url = second_host_server.base_url
    assert url.startswith(f"http://{SECOND_HOST}:")
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=url, report_to="none")
    assert config.weight_transfer_address is None and config.weight_transfer_port_range is None
    backend = config.resolved_weight_transfer_backend(cuda=False)
    assert backend == "gloo"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(15)
    with torch.no_grad():  # other weights than the server's, so a landed push shows
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    control = VLLMControlClient(url)
    before = server_logprobs(url, TOKENS, 1)
    version_before = control.weight_version()
    sync = make_weight_sync(SyncSetup(config=config.sync, model=model, rank=0, backend=backend, wire_dtype=None,
                                      model_path=tiny_model_path), control)
    try:
        expected = routed_source_address(SECOND_HOST, second_host_server.port)
        assert sync.master_address == expected, (sync.master_address, expected)
        assert sync.engine.gate.address == expected  # the rendezvous listens there, and only there
        sync.push(15)
    finally:
        sync.close()
    assert version_before != "15" and control.weight_version() == "15"
    after = server_logprobs(url, TOKENS, 1)
    ours = trainer_logprobs(model, TOKENS, 1)
    assert (after - ours).abs().max().item() < SAME_WEIGHTS
    assert (after - before).abs().max().item() > 100 * SAME_WEIGHTS  # the server's weights changed
    control.close()


# ------------------------------------------------------------------------------------------ (b)
def run_nodes(provisioner, launches, timeout_s: float) -> list[int | None]:
    """Run each node's launch on its own thread; past ``timeout_s`` kill the process groups they started."""
    from flows.provision import _kill_group

    codes: list[int | None] = [None] * len(launches)
    pids: list[int] = []

    def run(i: int) -> None:
        codes[i] = provisioner.run_training(launches[i], on_start=pids.append)

    threads = [threading.Thread(target=run, args=(i,), name=f"node-{i}", daemon=True) for i in range(len(launches))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for pid in pids:
            _kill_group(pid)
        for t in threads:
            t.join(30)
        raise AssertionError(f"the nodes ran past {timeout_s:.0f} s (exit codes so far {codes})")
    return codes


class KeptLines(logging.Handler):
    """The messages of one logger, kept (caplog's root handler is gone once Prefect sets up its logging)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_two_nodes_train_through_the_flows_launch(second_host_server, tiny_model_path, tmp_path):
    from flows.provision import LocalProvisioner
    from flows.train_flow import training_launch
    from grpo_core.checkpoint.folders import verify_local
    from grpo_core.checkpoint.ledger import read_ledger
    from grpo_core.launch.job import JobConfig

    run_dir = tmp_path / "run"
    trainer = dict(
        output_dir=str(run_dir), report_to="none", max_steps=STEPS, learning_rate=1e-4, num_generations=4,
        per_device_train_batch_size=4, max_completion_length=16, save_strategy="steps", save_steps=STEPS,
        num_sampler_logprobs=4, worker_heartbeat_timeout_s=60.0, token_budget=4096, max_staleness=4, seed=0,
    )
    job = JobConfig(model="tiny:arithmetic", dataset="grpo_core.tiny:arithmetic_dataset", nproc_per_node=1, nnodes=2,
                    rendezvous_address="127.0.0.1", rendezvous_port=free_port("127.0.0.1"), trainer={**trainer, "do_eval": False})
    assert job.trainer.weight_transfer_address is None
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    node0 = training_launch(job, job_file, second_host_server.base_url, tiny_model_path, None, None, tmp_path)
    node1 = node0.for_node(1)
    node1.log_file = str(tmp_path / "node1.log")
    command = node0.command()
    assert {"--nnodes=2", "--nproc-per-node=1", "--node-rank=0", "--master-addr=127.0.0.1"} <= set(command)

    start = time.monotonic()
    provision_log, kept = logging.getLogger("flows.provision"), KeptLines()
    level = provision_log.level
    provision_log.setLevel(logging.INFO)
    provision_log.addHandler(kept)
    try:
        codes = run_nodes(LocalProvisioner(), [node0, node1], NODE_TIMEOUT_S)
    finally:
        provision_log.removeHandler(kept)
        provision_log.setLevel(level)
    elapsed = time.monotonic() - start
    logs = [Path(node0.log_file).read_text(errors="replace"), Path(node1.log_file).read_text(errors="replace")]
    assert codes == [0, 0], f"exit codes {codes}\nnode 0:\n{logs[0][-3000:]}\nnode 1:\n{logs[1][-3000:]}"
    # Node 0 told the operator what node 1 runs, and that is what ran as node 1.
    assert f"training node_rank 1 of 2 runs: {shlex.join(node1.command())}" in kept.lines
    assert "--node-rank=1" in node1.command()

    result = json.loads((tmp_path / "result.json").read_text())  # rank 0 alone writes it
    assert result["global_step"] == STEPS and len(result["history"]) == STEPS
    for step in result["history"]:
        assert torch.isfinite(torch.tensor(step["loss"])) and step["perf/fwd_bwd_s"] > 0
        # The planner gave each of the two ranks one row of every micro-batch.
        assert step["batch/samples_per_step"] / step["batch/samples_per_row"] == 2.0

    checkpoint = run_dir / f"checkpoint-{STEPS}"
    assert verify_local(checkpoint) is None
    rng = torch.load(checkpoint / "rng_state.pt", weights_only=True)["ranks"]
    assert len(rng) == 2  # gathered from both ranks, one per node
    attempts, steps = read_ledger(str(run_dir))
    assert len(attempts) == 1 and [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # Rank 0's last push landed on the server on 127.0.0.2 (the address resolved as in (a)).
    control = VLLMControlClient(second_host_server.base_url)
    assert control.weight_version() == str(STEPS)
    control.close()
    losses = [round(h["loss"], 6) for h in result["history"]]
    print(f"two nodes trained {STEPS} steps in {elapsed:.0f} s; losses {losses}")


# ------------------------------------------------------------------------------------------ (c)
def test_a_backend_mismatch_is_refused_at_start_up_naming_both(second_host_server, tiny_model_path, tmp_path):
    from grpo_core.rewards import accuracy_reward
    from grpo_core.tiny import arithmetic_dataset
    from grpo_core.training.trainer import AsyncGRPOTrainer
    from grpo_core.vllm_server.checks import ServerConfigError

    url = second_host_server.base_url
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=url, report_to="none", max_steps=1,
                             num_generations=4, per_device_train_batch_size=4, max_completion_length=16,
                             weight_transfer_backend="nccl")
    data = arithmetic_dataset(num_train=8, num_eval=2)["train"]
    trainer = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, config, data)
    control = VLLMControlClient(url)
    version = control.weight_version()
    with pytest.raises(ServerConfigError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "backend 'gloo'" in message and "weight_transfer_backend='nccl'" in message, message
    assert "--weight-transfer-config" in message and '{"backend": "nccl"}' in message  # a server that would match
    assert control.weight_version() == version and trainer.global_step == 0  # refused before any push or step
    control.close()
