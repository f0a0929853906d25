"""The trainer's replaceable parts (``grpo_core.training.sources``): the sources themselves, the checks on what a
caller passes, and a real ``AsyncGRPOTrainer`` training on a replayed stream with a transfer of the test's own,
talking to no server (the path the benchmarks take).

    .venv/bin/python -m pytest -q tests/test_sources.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward
from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.rollout.types import GroupReport, RolloutSample
from grpo_core.sync.base import SyncStats
from grpo_core.tracking.tracker import NullTracker
from grpo_core.training.sources import (
    RecordingSource, ReplayRollouts, RolloutSource, WeightTransfer, check_replacements, is_source)
from grpo_core.training.trainer import AsyncGRPOTrainer
from tests.test_checkpoint import model_path  # noqa: F401 - the small random Qwen3 fixture

GROUP = 4


class ListSource:
    """A source of the test's own: hands out its items, then the end of the data, and notes its hooks."""

    def __init__(self, items):
        self.items = list(items)
        self.calls: list[str] = []

    def get(self, timeout_s: float):
        return self.items.pop(0) if self.items else END_OF_DATA

    def queue_size(self) -> int:
        return len(self.items)

    def publish_version(self, version: int, consumed: int | None = None) -> None:
        self.calls.append(f"version {version}")

    def stop(self) -> None:
        self.calls.append("stop")


class CountingTransfer:
    """A weight transfer of the test's own: counts pushes and copies the first weight it was attached to."""

    mode = "full"

    def __init__(self):
        self.pushed: list[int] = []
        self.model = None
        self.closed = False

    def attach(self, model: torch.nn.Module) -> None:
        self.model = model

    def push(self, version: int) -> SyncStats:
        first = next(self.model.parameters())
        self.pushed.append(version)
        return SyncStats(mode="full", bytes=first.numel() * first.element_size(), seconds=0.0)

    def close(self) -> None:
        self.closed = True


def group(position: int, vocab: int, rng: np.random.Generator) -> list:
    """A group's report and its samples: one prompt, GROUP completions, rewards with a spread."""
    prompt = rng.integers(3, vocab, 6)
    rewards = np.arange(GROUP, dtype=float)
    advantages = (rewards - rewards.mean()) / rewards.std()
    samples = []
    for r in range(GROUP):
        tokens = np.concatenate([prompt, rng.integers(3, vocab, 5)]).astype(np.int32)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[6:] = True
        logprobs = np.where(mask, -math.log(vocab), 0.0).astype(np.float32)
        samples.append(RolloutSample(token_ids=tokens, completion_mask=mask, sampler_logprobs=logprobs,
                                     advantage=float(advantages[r]), reward=float(rewards[r]), group_id=position,
                                     row_index=position, epoch=0, rollout_id=f"g{position}-{r}", policy_version=0,
                                     position=position))
    report = GroupReport(position=position, row_index=position, epoch=0, rewards=rewards,
                         rewards_per_func={"accuracy_reward": rewards}, num_samples=GROUP, dropped=False)
    return [report, *samples]


# ---- the sources ------------------------------------------------------------------------------------------
def test_replay_hands_out_in_order_then_the_end_of_the_data():
    replay = ReplayRollouts(["a", "b", END_OF_DATA])
    assert isinstance(replay, RolloutSource) and is_source(replay)
    assert replay.queue_size() == 2
    assert [replay.get(1.0) for _ in range(4)] == ["a", "b", END_OF_DATA, END_OF_DATA]
    assert replay.queue_size() == 0


def test_recording_keeps_what_it_hands_on_and_forwards_the_rest():
    inner = ListSource(["x", "y"])
    recording = RecordingSource(inner)
    assert [recording.get(1.0) for _ in range(3)] == ["x", "y", END_OF_DATA]
    assert recording.items == ["x", "y"]  # the end of the data is not part of a stream
    recording.publish_version(3, consumed=2)  # not a source method: passed on to the wrapped worker
    recording.stop()
    assert inner.calls == ["version 3", "stop"]


def test_what_a_caller_passes_is_checked_with_the_argument_named():
    with pytest.raises(TypeError, match="rollout_worker="):
        check_replacements(object(), None, ["http://a:1"])
    with pytest.raises(TypeError, match=r"weight_transfer=.*push\(version\)"):
        check_replacements(None, object(), ["http://a:1"])
    with pytest.raises(ValueError, match="vllm_server_base_url lists 2"):
        check_replacements(None, CountingTransfer(), ["http://a:1", "http://b:2"])
    check_replacements(ListSource([]), CountingTransfer(), ["http://a:1", "http://b:2"])  # no server is used
    check_replacements(lambda worker: worker, None, ["http://a:1"])  # a wrapper of the run's worker
    assert isinstance(CountingTransfer(), WeightTransfer)
    assert not is_source(lambda worker: worker)


# ---- a real trainer on them ---------------------------------------------------------------------------------
def test_trainer_trains_on_a_replayed_stream_and_pushes_through_the_callers_transfer(model_path, tmp_path):  # noqa: F811
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    rng = np.random.default_rng(0)
    items = [item for position in range(4) for item in group(position, vocab, rng)]
    source, transfer = ListSource(items), CountingTransfer()

    class StepEnds(NullTracker):
        steps: list[int] = []

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.steps.append(step)

    sink = StepEnds()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="no", max_steps=3,
                           num_generations=GROUP, per_device_train_batch_size=GROUP, learning_rate=1e-3,
                           vllm_server_base_url="http://127.0.0.1:9")  # nothing listens there: it must not be asked
    trainer = AsyncGRPOTrainer(model=model_path, reward_funcs=accuracy_reward, train_dataset=[{"prompt": "p", "solution": "1"}],
                               args=args, rollout_worker=source, weight_transfer=transfer, tracker=sink)
    assert not trainer.run.talks_to_servers
    before = next(trainer.model.parameters()).detach().clone()
    history = trainer.train()

    assert [int(h["step"]) for h in history] == [1, 2, 3]
    assert list(dict.fromkeys(sink.steps)) == [1, 2, 3]  # each step's metrics (the last one's checkpoint entry again)
    assert all(h["batch/samples_per_step"] == GROUP and math.isfinite(h["loss"]) for h in history)
    assert transfer.model is not None and transfer.pushed == [0, 1, 2, 3]  # the start, then every step
    assert [c for c in source.calls if c.startswith("version")] == ["version 0", "version 1", "version 2", "version 3"]
    assert source.calls[-1] == "stop" and transfer.closed
    assert not torch.equal(before, next(trainer.model.parameters()).detach())  # it trained
    assert not any(k.startswith("rollout/server/") for h in history for k in h)  # no fleet of servers to report
