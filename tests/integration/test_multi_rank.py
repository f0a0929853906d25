"""Two gloo ranks (torchrun, FSDP2 in fp32) against the real CPU vLLM server.

(a) **Same samples, same losses.** A 1-process run trains against the server while its rollout
stream (every sample and group report, in arrival order) is recorded; its per-step losses are the
reference (``rollout_worker=`` a ``RecordingSource`` around the run's worker). The recording is then replayed
into a 2-rank torchrun run (``rollout_worker=`` a ``ReplayRollouts``, read on rank 0 only): each step has the
same samples, planned as one row per rank.
Every step's loss and gradient norm must equal the 1-process run's within fp32 rounding; the 2-rank
run's weight syncs go to the same real server (only rank 0 talks to it), and afterwards the server's
log-probs equal those of the 2-rank run's final weights.

(b) **The flow's launch.** ``TrainingLaunch.command()`` with ``nproc_per_node=2`` runs the real
entry point (``python -m torch.distributed.run --standalone ... -m grpo_core.launch``) with live
rollouts for 2 steps; rank 0 writes the result.

The replay half is also this module's ``__main__`` (what torchrun starts on each rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward, format_reward
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.sources import RecordingSource, ReplayRollouts
from grpo_core.training.trainer import AsyncGRPOTrainer
from tests.tolerances import gamma

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
SAMPLES_PER_STEP = 16
# A step's loss sums its trained tokens (at most SAMPLES_PER_STEP x max_completion_length 16), each
# term |A·r| <= 2·√3 (r <= 2 by the importance-sampling mask; |A| <= √(G − 1) for the std-scaled
# advantages of G = 4 rollouts): two orders of that sum differ by at most 2·γ_256·2√3 ≈ 1e-4
# (tests/tolerances.py). Not in it: the log-probs' own fp32 differences and, from the second step on,
# the drift of the weights (see the weight check), which need per-token and per-element magnitudes
# that stay inside the trainers (tests/test_fsdp.py derives one step per element).
LOSS_GAP = 2 * gamma(SAMPLES_PER_STEP * 16) * 2.0 * math.sqrt(4 - 1)


def run_config(server_url: str, out: Path, ranks: int) -> dict[str, Any]:
    # The step is bounded by its sample count (budget ample), so both layouts train the same 16 samples.
    return dict(
        output_dir=str(out), vllm_server_base_url=server_url, report_to="none", max_steps=STEPS,
        learning_rate=1e-4, num_generations=4, per_device_train_batch_size=SAMPLES_PER_STEP // ranks,
        max_completion_length=16, save_strategy="no", num_sampler_logprobs=4, worker_heartbeat_timeout_s=60.0,
        token_budget=4096, max_staleness=4, seed=0,
    )


# ------------------------------------------------------------------------------------------ sources
class CountedReplay(ReplayRollouts):
    """The recorded stream, counting how often the trainer started it (rank 0 only should)."""

    starts = 0

    def start(self) -> None:
        self.starts += 1


# ------------------------------------------------------------------------------------------ rank program
def replay_main(argv: list[str] | None = None) -> None:
    """One torchrun rank: train on the recorded stream, then gather the final weights onto rank 0."""
    from grpo_core.models.fsdp import full_state_dict
    from grpo_core.ranks import DistInfo, init_distributed, shutdown_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    info = DistInfo.from_env()
    # The group is ours, not the trainer's, so it outlives train() for the weight gather below.
    init_distributed(info, torch.device("cpu"), timeout_s=600)
    replay = CountedReplay(pickle.loads(Path(args.stream).read_bytes()))
    config = AsyncGRPOConfig(**json.loads(Path(args.config).read_text()))
    # The recorded stream in place of the rollout worker; pushes still go to the server (rank 0's last one is checked).
    trainer = AsyncGRPOTrainer(args.model, [accuracy_reward, format_reward], train_dataset=arithmetic_dataset()["train"],
                               args=config, rollout_worker=replay)
    history = trainer.train()
    sharded = all(hasattr(p, "full_tensor") for p in trainer.model.parameters())
    state = full_state_dict(trainer.model)
    out = Path(args.out)
    if state is not None:
        torch.save(state, out / "final_weights.pt")
    (out / f"rank{info.rank}.json").write_text(json.dumps(
        {"history": history, "worker_starts": replay.starts, "sharded": sharded, "world_size": info.world_size}
    ))
    shutdown_distributed()


def torchrun(args: list[str], log: Path, timeout_s: float) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as f:
        # Its own process group: on a timeout the ranks go down with torchrun, by group id.
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"torchrun ran past {timeout_s:.0f} s:\n{log.read_text()[-4000:]}") from None
    assert code == 0, f"torchrun failed ({code}):\n{log.read_text()[-4000:]}"


# ------------------------------------------------------------------------------------------ tests
def test_two_ranks_train_like_one_on_the_same_samples(vllm_server, tiny_model_path, tmp_path):
    from tests.integration.test_async_loop import server_logprobs, trainer_logprobs

    start = time.monotonic()
    data = arithmetic_dataset()
    recordings: list[RecordingSource] = []
    reference = AsyncGRPOTrainer(
        tiny_model_path, [accuracy_reward, format_reward], train_dataset=data["train"],
        args=AsyncGRPOConfig(**run_config(vllm_server.base_url, tmp_path / "one", ranks=1)),
        rollout_worker=lambda worker: recordings.append(RecordingSource(worker)) or recordings[-1],
    )
    one = reference.train()
    assert len(one) == STEPS
    assert all(h["batch/samples_per_step"] == SAMPLES_PER_STEP for h in one), "steps must be full for the comparison"
    stream = tmp_path / "stream.pkl"
    stream.write_bytes(pickle.dumps(recordings[0].items))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(run_config(vllm_server.base_url, tmp_path / "two", ranks=2)))
    out = tmp_path / "replay"
    out.mkdir()
    recorded_s = time.monotonic() - start

    torchrun(["-m", "tests.integration.test_multi_rank", "--model", tiny_model_path, "--stream", str(stream),
              "--config", str(config), "--out", str(out)], tmp_path / "replay.log", timeout_s=600)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"recorded in {recorded_s:.0f} s, replayed on 2 ranks in {time.monotonic() - start - recorded_s:.0f} s")

    # Rank roles: only rank 0 took the sample stream; both ranks trained sharded weights.
    assert [r["worker_starts"] for r in ranks] == [1, 0]
    assert all(r["sharded"] and r["world_size"] == 2 for r in ranks)
    for r in ranks:
        two = r["history"]
        assert len(two) == STEPS
        for a, b in zip(one, two):
            # Two rows per micro-batch instead of one: the planner really split the step over the ranks.
            assert b["batch/samples_per_step"] == a["batch/samples_per_step"]
            assert b["batch/samples_per_step"] / b["batch/samples_per_row"] == 2.0
            assert abs(b["loss"] - a["loss"]) <= LOSS_GAP, (a["loss"], b["loss"])
            # Empirical (not derivable here: the per-element gradient magnitudes stay in the trainers;
            # tests/test_fsdp.py bounds one step's gradients per element by 2·γ_k·Σ|terms|). 1e-5 is
            # 170 fp32 units u = 2^-24 of the norm: a reordered sum's random roundings grow like √k·u
            # (≈ 30 u for the ~10^3 tokens of a step), its worst case k·u needs adversarial orders.
            assert abs(b["grad_norm"] - a["grad_norm"]) <= 1e-5 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
            # Throughput is logged on the CPU; MFU is not (no known peak), and training went on.
            assert b["perf/tokens_per_s_fwd_bwd"] > 0 and "perf/mfu_fwd_bwd" not in b
    assert any(abs(h["loss"]) > 10 * LOSS_GAP for h in one), "losses within the bound of 0 would make the comparison empty"
    loss_gap = max(abs(b["loss"] - a["loss"]) for r in ranks for a, b in zip(one, r["history"]))
    norm_gap = max(abs(b["grad_norm"] / a["grad_norm"] - 1) for r in ranks for a, b in zip(one, r["history"]))

    # The 2-rank weights match the 1-process weights, and the server serves them (rank 0's last sync).
    final = torch.load(out / "final_weights.pt", weights_only=True)
    ref_weights = dict(reference.model.named_parameters())
    assert final.keys() == ref_weights.keys()
    worst = max(float((final[k] - ref_weights[k].detach()).norm() / ref_weights[k].detach().norm()) for k in final)
    # Empirical: after 3 AdamW steps the runs differ by rounding (~u·|w| per element and step, 1e-7 of
    # a tensor's norm) and, where |g| <~ Adam's eps, by lr·|Δg|/eps from rounding-size gradient
    # differences (tests/test_fsdp.py derives that per element for one step; here the per-element
    # gradients stay in the trainers). At lr 1e-4 that is 100x smaller than test_fsdp's step; 1e-5 (170 u)
    # leaves room for it on other CPUs while a missed or doubled step (lr per element) stays far above.
    assert worst < 1e-5, f"final weights differ by {worst:.2e} (relative, worst tensor)"
    print(f"losses {[round(h['loss'], 6) for h in one]}: max |2-rank - 1-rank| {loss_gap:.1e}; grad norm "
          f"max relative gap {norm_gap:.1e}; final weights worst relative gap {worst:.1e}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(final, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the tied LM head follows the embedding
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 5?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ids = prompt + tok("The answer is \\boxed{7}.", add_special_tokens=False)["input_ids"]
    served = server_logprobs(vllm_server.base_url, ids, len(prompt))
    diff = (served - trainer_logprobs(model, ids, len(prompt))).abs().max().item()
    # Empirical, as in test_async_loop.test_sync_makes_server_logprobs_equal_trainer (same model, same bound).
    assert diff < 1e-4, f"the server's log-probs differ from the 2-rank weights by {diff}"


def test_flow_launch_runs_two_ranks(vllm_server, tiny_model_path, tmp_path):
    from flows.provision import LocalProvisioner, TrainingLaunch
    from grpo_core.launch.job import JobConfig

    trainer = run_config(vllm_server.base_url, tmp_path / "run", ranks=2)
    trainer.pop("vllm_server_base_url")
    trainer["max_steps"] = 2
    job = JobConfig(model="tiny:arithmetic", dataset="grpo_core.tiny:arithmetic_dataset", nproc_per_node=2,
                    nnodes=1, trainer={**trainer, "do_eval": False})
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    launch = TrainingLaunch(
        job_file=str(job_file), server_url=vllm_server.base_url, model_path=tiny_model_path, mlflow_run_id=None,
        tracking_uri=None, result_file=str(tmp_path / "result.json"), nproc_per_node=job.nproc_per_node,
        nnodes=job.nnodes, log_file=str(tmp_path / "train.log"),
    )
    command = launch.command()
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    code = LocalProvisioner().run_training(launch)
    assert code == 0, (tmp_path / "train.log").read_text()[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 2
    for step in result["history"]:
        assert step["batch/samples_per_step"] / step["batch/samples_per_row"] == 2.0  # one row per rank
        assert "loss" in step and step["perf/fwd_bwd_s"] > 0


if __name__ == "__main__":
    replay_main()
