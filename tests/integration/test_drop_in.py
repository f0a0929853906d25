"""A TRL user switches with one import: the quick start as printed, the server command as printed, and a
named error for every bad input, before anything is spawned where the check can be made there.

The quick start runs as a script with everything at module level (no ``if __name__ == "__main__"``),
with a reward function and a lambda defined in the script itself, as ``python script.py``, under
``torchrun`` and under ``accelerate launch``. A second CPU server is started exactly with the seed's flags (plus what the CPU build
needs: the gloo backend and fp32): no ``--enable-scale-out``, so generation goes through
``/v1/completions``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.data.inputs import InputError
from grpo_core.rewards import accuracy_reward
from grpo_core.rollout.worker import RolloutWorkerError
from grpo_core.tiny import arithmetic_dataset
from grpo_core.training.trainer import AsyncGRPOTrainer
from grpo_core.vllm_server.checks import ServerConfigError
from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec
from tests.integration.worker_rewards import raises_on_row, returns_inf, returns_nan, returns_one, returns_text

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

QUICK_START = '''
# train_async_grpo.py, as the seed prints it; only the trainer import changed.
from datasets import load_dataset
from grpo_core import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_core.rewards import accuracy_reward

dataset = load_dataset("json", data_files={data!r}, split="train")


def short_answer(completions, **kwargs):
    return [1.0 if len(c[0]["content"]) < 40 else 0.0 for c in completions]


trainer = AsyncGRPOTrainer(
    model={model!r},
    reward_funcs=[accuracy_reward, short_answer, lambda completions, **kw: [0.0] * len(completions)],
    train_dataset=dataset,
    args=AsyncGRPOConfig(output_dir={out!r}, vllm_server_base_url={url!r}, max_steps=3, report_to="none",
                         num_generations=4, per_device_train_batch_size=8, max_completion_length=16),
)
trainer.train()
print("TRAINED", trainer.state.global_step)
'''


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = arithmetic_dataset(num_train=64, num_eval=4)["train"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def run_script(script: Path, launcher: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=script.parent)


LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_the_quick_start_as_printed_trains(vllm_server, tiny_model_path, data_file, tmp_path, launcher):
    out = tmp_path / "run"
    script = tmp_path / "train_async_grpo.py"
    script.write_text(QUICK_START.format(data=data_file, model=tiny_model_path, out=str(out), url=vllm_server.base_url))
    command = LAUNCHERS[launcher]
    done = run_script(script, command)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "TRAINED 3" in done.stdout
    assert (out / "checkpoint-3" / "model.safetensors").is_file()
    # The script ran once: a second trainer (the script re-run by the spawned worker) would have
    # failed multiprocessing's bootstrap check or trained twice.
    assert done.stdout.count("TRAINED") == 1


SCRIPT_OBJECTS = '''
# Everything the worker needs is defined in this script's __main__: a tool, an environment class, a
# rollout loop subclass (set on a trainer subclass) and a config dataclass subclass.
import json
import os
from dataclasses import dataclass

from datasets import load_dataset
from grpo_core import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop

dataset = load_dataset("json", data_files={data!r}, split="train")


def lookup(key: str) -> str:
    """Look a key up in the script's table.

    Args:
        key: The key to look up.
    """
    return {{"seven": "7"}}.get(key, "unknown")


def longer_is_better(completions, **kwargs):
    # Varies within a group, so groups are not dropped for equal rewards (the environment's are all 0.5).
    return [len(c[0]["content"]) / 100 for c in completions]


class HalfCreditEnv:
    def reset(self, **columns):
        return None

    def get_reward(self, completion):
        return 0.5


@dataclass
class ScriptConfig(AsyncGRPOConfig):
    marker: str = "set-in-the-script"


class RecordingLoop(AsyncRolloutLoop):
    async def setup(self):
        seen = dict(pid=os.getpid(), config=type(self.config).__name__, marker=self.config.marker,
                    tools=[t.__name__ for t in self.tools], environment=self.environment_factory.__name__)
        with open({seen!r}, "w") as f:
            json.dump(seen, f)


class ScriptTrainer(AsyncGRPOTrainer):
    loop_cls = RecordingLoop


trainer = ScriptTrainer(
    model={model!r},
    reward_funcs=[longer_is_better],
    train_dataset=dataset,
    tools=[lookup],
    environment_factory=HalfCreditEnv,
    args=ScriptConfig(output_dir={out!r}, vllm_server_base_url={url!r}, max_steps=2, report_to="none", save_strategy="no",
                      num_generations=4, per_device_train_batch_size=8, max_completion_length=16, marker="changed-by-the-script"),
)
history = trainer.train()
print("SCRIPT PID", os.getpid())
print("ENV REWARD", [h["rewards/rollout_reward/mean"] for h in history])
'''


def test_tools_environments_loops_and_configs_from_the_script_reach_the_worker(vllm_server, tiny_model_path, data_file, tmp_path):
    seen = tmp_path / "seen.json"
    script = tmp_path / "script_objects.py"
    script.write_text(SCRIPT_OBJECTS.format(data=data_file, model=tiny_model_path, out=str(tmp_path / "run"),
                                            url=vllm_server.base_url, seen=str(seen)))
    done = run_script(script, LAUNCHERS["python"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    recorded = json.loads(seen.read_text())
    script_pid = int(done.stdout.split("SCRIPT PID ")[1].split()[0])
    assert recorded["pid"] != script_pid, "the loop ran in the script's process, not the rollout worker"
    assert recorded == dict(pid=recorded["pid"], config="ScriptConfig", marker="changed-by-the-script", tools=["lookup"],
                            environment="HalfCreditEnv")
    # The environment class ran in the worker: every rollout got its reward of 0.5.
    rewards = json.loads(done.stdout.split("ENV REWARD ")[1].splitlines()[0])
    assert rewards == [0.5, 0.5], rewards


# ---- the seed's server command -------------------------------------------------------------------------
SEED_FLAGS = ["--logprobs-mode", "processed_logprobs", "--api-server-count", "8"]


@pytest.fixture(scope="module")
def seed_server(tiny_model_path, tmp_path_factory):
    """A server started by hand with the seed's flags: no --enable-scale-out, no --max-logprobs."""
    logs = tmp_path_factory.mktemp("seed-server")
    port = 0
    # vLLM's own process layout too (its worker in a process of its own), as a user's command gets it.
    spec = VLLMServerSpec(model=tiny_model_path, port=port, max_model_len=512, cpu_worker_in_engine=False)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_path,
               "--max-model-len", "512", *SEED_FLAGS, "--weight-transfer-config", '{"backend":"gloo"}', "--dtype", "float32"]

    class HandStarted(VLLMServer):
        def start(self, timeout_s: float = 600.0) -> VLLMServer:
            self.spec.command = lambda port: [*command, "--host", self.spec.host, "--port", str(port)]  # type: ignore[method-assign]
            return super().start(timeout_s)

    server = HandStarted(spec, logs).start(timeout_s=1800)
    yield server
    server.stop()


def test_a_server_started_with_the_seed_flags_trains(seed_server, tiny_model_path, tmp_path, caplog):
    data = arithmetic_dataset(num_train=64, num_eval=4)
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=seed_server.base_url, report_to="none",
                             max_steps=3, num_generations=4, per_device_train_batch_size=8, max_completion_length=16,
                             save_strategy="no")
    trainer = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, config, data["train"])
    with caplog.at_level("WARNING"):
        history = trainer.train()
    assert len(history) == 3 and trainer.run.server.tokens_endpoint is False
    assert all(h["sample/staleness_max"] <= config.max_staleness for h in history)
    assert any("--enable-scale-out" in r.getMessage() and "per-token" in r.getMessage() for r in caplog.records)


# ---- bad input, named ------------------------------------------------------------------------------------
def quick(url: str, tmp_path: Path, **overrides: Any) -> AsyncGRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), vllm_server_base_url=url, report_to="none", max_steps=2,
                  num_generations=4, per_device_train_batch_size=8, max_completion_length=16, save_strategy="no",
                  vllm_server_timeout=3.0)
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def rows(**columns: list[Any]):
    from datasets import Dataset

    return Dataset.from_dict(columns)


def needs_id(prompts, completions, id, **kwargs):  # noqa: A002 - a dataset column named like a builtin
    return [0.0] * len(completions)


BEFORE_SPAWN = {
    "no prompt column": (dict(question=["1+1"], solution=["2"]), accuracy_reward, "no 'prompt' column"),
    "prompt of the wrong type": (dict(prompt=[3], solution=["3"]), accuracy_reward, r"column 'prompt' must hold.*row 0 holds int"),
    "empty dataset": (dict(prompt=[], solution=[]), accuracy_reward, "train_dataset is empty"),
    "reward column missing": (dict(prompt=["1+1"], solution=["2"]), needs_id, r"reward function 'needs_id' needs the column\(s\) \['id'\]"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_SPAWN))
def test_bad_dataset_is_named_before_anything_loads(tiny_model_path, tmp_path, case):
    columns, reward, message = BEFORE_SPAWN[case]
    start = time.monotonic()
    with pytest.raises(InputError, match=message):
        trainer = AsyncGRPOTrainer(tiny_model_path, reward, quick("http://127.0.0.1:9", tmp_path), rows(**columns))
        trainer.train()
    assert time.monotonic() - start < 10


def test_a_model_that_is_not_there_is_named(tmp_path):
    data = arithmetic_dataset(num_train=8, num_eval=2)["train"]
    start = time.monotonic()
    for model in (str(tmp_path / "no-such-model"), "nobody-here/no-such-model-xyz"):
        with pytest.raises(InputError, match=f"no model at '{model}'"):
            AsyncGRPOTrainer(model, accuracy_reward, quick("http://127.0.0.1:9", tmp_path), data)
    assert time.monotonic() - start < 20


class _TimedStream(io.StringIO):
    """stderr that remembers when each line was written."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.extend((time.monotonic(), line) for line in text.splitlines() if line.strip())
        return super().write(text)


def test_no_server_at_the_url_is_named_with_the_command_to_start_one(tiny_model_path, tmp_path, monkeypatch):
    data = arithmetic_dataset(num_train=8, num_eval=2)["train"]
    trainer = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, quick("http://127.0.0.1:9", tmp_path), data)
    stderr = _TimedStream()
    monkeypatch.setattr(sys, "stderr", stderr)
    start = time.monotonic()
    with pytest.raises(ServerConfigError, match=r"no vLLM server answers at http://127.0.0.1:9") as info:
        trainer.train()
    assert time.monotonic() - start < 10
    assert "vllm.entrypoints.openai.api_server" in str(info.value) and tiny_model_path in str(info.value)
    # The wait is no silent one: within 2 s of train() it names the URL, how long it waits at most and what to do.
    told = [(at, line) for at, line in stderr.lines if "http://127.0.0.1:9" in line]
    assert told, stderr.getvalue()
    at, line = told[0]
    assert at - start < 2.0, (at - start, line)
    assert "at most 3 s" in line and "vllm_server_base_url" in line and "vllm.entrypoints.openai.api_server" in line


def test_a_server_serving_another_model_is_refused_naming_both(vllm_server, tiny_model_path, tmp_path):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    other = tmp_path / "other-model"
    config = Qwen3Config(vocab_size=AutoTokenizer.from_pretrained(tiny_model_path).vocab_size + 64, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(other)
    data = arithmetic_dataset(num_train=8, num_eval=2)["train"]
    trainer = AsyncGRPOTrainer(str(other), accuracy_reward, quick(vllm_server.base_url, tmp_path), data)
    start = time.monotonic()
    with pytest.raises(ServerConfigError, match="serves another model") as info:
        trainer.train()
    assert time.monotonic() - start < 10
    assert str(other) in str(info.value) and tiny_model_path in str(info.value) and "vocab_size" in str(info.value)


RUNTIME = {
    "raises": (raises_on_row, r"reward function 'raises_on_row' raised on dataset row \d+: KeyError: 'answer'"),
    "wrong count": (returns_one, r"reward function 'returns_one' returned 1 values for the 4 completions of dataset row \d+"),
    "not numbers": (returns_text, r"reward function 'returns_text' returned 'good' \(str\) for completion 0 of dataset row \d+"),
    "nan": (returns_nan, r"reward function 'returns_nan' returned nan for completion 0 of dataset row \d+"),
    "inf": (returns_inf, r"reward function 'returns_inf' returned -inf for completion 3 of dataset row \d+"),
}


@pytest.mark.parametrize("case", sorted(RUNTIME))
def test_a_broken_reward_function_ends_the_run_naming_function_row_and_value(vllm_server, tiny_model_path, tmp_path, case):
    # Only a call can show this, so it is checked in the rollout process, on the first group scored.
    reward, message = RUNTIME[case]
    data = arithmetic_dataset(num_train=16, num_eval=2)["train"]
    trainer = AsyncGRPOTrainer(tiny_model_path, reward, quick(vllm_server.base_url, tmp_path, max_steps=5), data)
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=message) as info:
        trainer.train()
    assert "rollout worker traceback" in str(info.value) and "Traceback" in str(info.value)
    print(f"{case}: the error arrived {time.monotonic() - start:.1f} s after train()")
    assert time.monotonic() - start < 60


# ---- TRL's surface: periodic evaluation, save_model, precision ----------------------------------------------
def test_periodic_evaluation_and_save_model(vllm_server, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = arithmetic_dataset(num_train=64, num_eval=8)
    config = quick(vllm_server.base_url, tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2)
    trainer = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, config, data["train"], eval_dataset=data["eval"])
    history = trainer.train()
    assert [h["step"] for h in history if "eval/reward" in h] == [2.0, 4.0]
    for h in history:
        if "eval/reward" in h:
            # accuracy_reward is 0 or 1 per completion; the mean over 8 prompts x 4 completions.
            assert 0.0 <= h["eval/reward"] <= 1.0 and h["eval/rewards/accuracy_reward"] == h["eval/reward"]
            assert h["eval/completion_length"] > 0
    assert trainer.state.global_step == 4 and trainer.state.log_history == history
    again = trainer.evaluate()  # the server still serves step 4's weights
    assert set(again) >= {"eval/reward", "eval/completion_length", "eval/rewards/accuracy_reward"}

    folder = trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    trained = trainer.model.state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k].detach()) for k in saved)
    assert not all(torch.equal(saved[k], v) for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict().items())
    assert AutoTokenizer.from_pretrained(folder).vocab_size == AutoTokenizer.from_pretrained(tiny_model_path).vocab_size


def test_fp16_on_a_cpu_is_refused_naming_the_field(tiny_model_path, tmp_path):
    data = arithmetic_dataset(num_train=8, num_eval=2)["train"]
    with pytest.raises(ValueError, match=r"AsyncGRPOConfig.fp16=True needs a CUDA device"):
        AsyncGRPOTrainer(tiny_model_path, accuracy_reward, quick("http://127.0.0.1:9", tmp_path, fp16=True), data)


# ---- streaming data and staleness in weight updates -------------------------------------------------------
def test_a_streaming_dataset_trains_and_resumes_past_a_failed_attempt(vllm_server, tiny_model_path, tmp_path):
    from grpo_core.checkpoint import read_ledger

    stream = arithmetic_dataset(num_train=64, num_eval=2)["train"].to_iterable_dataset()
    # One group's rollouts in flight (4): groups finish in order, so the training frontier is past the first group
    # once a step has trained it. (With two groups in flight the first one finished last in one CI run, and the
    # checkpoint's position rightly stayed 0: the frontier is covered out of order in tests/test_collector.py.)
    settings = dict(save_strategy="steps", save_steps=3, max_concurrent_rollouts=4)
    first = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, quick(vllm_server.base_url, tmp_path, max_steps=3, **settings), stream)
    assert len(first.train()) == 3
    checkpoint = tmp_path / "run" / "checkpoint-3"
    saved = json.loads((checkpoint / "rollout_state.json").read_text())
    assert saved["position"] > 0 and saved["num_prompts"] is None
    written = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    # A resumed attempt that ends on a broken reward function loses nothing already written.
    broken = AsyncGRPOTrainer(tiny_model_path, raises_on_row, quick(vllm_server.base_url, tmp_path, max_steps=5, **settings), stream)
    with pytest.raises(RolloutWorkerError, match="raises_on_row"):
        broken.train(resume_from_checkpoint=True)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()} == written
    second = AsyncGRPOTrainer(tiny_model_path, accuracy_reward, quick(vllm_server.base_url, tmp_path, max_steps=5, **settings), stream)
    history = second.train(resume_from_checkpoint=True)
    assert [h["step"] for h in history] == [4.0, 5.0]
    _, steps = read_ledger(str(tmp_path / "run"))
    resumed = [entry for entry in steps if entry["attempt"] == max(e["attempt"] for e in steps)]
    assert [entry["step"] for entry in resumed] == [4, 5]
    trained = sorted(p for entry in resumed for p in entry["trained"])
    assert trained and min(trained) >= saved["position"], "the resumed stream started before the saved position"


class VersionRecordingTrainer(AsyncGRPOTrainer):
    """Keeps, per step, the sample versions the collector saw and the versions pushed by then."""

    def training_step(self, batch):
        self.__dict__.setdefault("steps", []).append(
            {"trained": [s.policy_version for s in batch.samples], "dropped": batch.stale_dropped,
             "pushed": list(self.versions.pushed)}
        )
        return super().training_step(batch)


def test_weight_sync_steps_2_counts_staleness_in_weight_updates(vllm_server, tiny_model_path, tmp_path):
    data = arithmetic_dataset(num_train=64, num_eval=2)["train"]
    config = quick(vllm_server.base_url, tmp_path, max_steps=6, weight_sync_steps=2, max_staleness=1,
                   max_concurrent_rollouts=32, stale_samples="drop")  # a late sample would be trained under "keep"
    trainer = VersionRecordingTrainer(tiny_model_path, accuracy_reward, config, data)
    history = trainer.train()
    assert [v for v in trainer.versions.pushed] == [0, 2, 4, 6]
    for step, record in enumerate(trainer.steps, start=1):
        pushed = record["pushed"]
        # Staleness counts pushes after the sample's version, not optimizer steps.
        lags = [sum(1 for v in pushed if v > version) for version in record["trained"]]
        assert max(lags, default=0) <= 1, (step, record)
        assert history[step - 1]["sample/staleness_max"] == max(lags, default=0)
    # Some sample trained at a lag of more than one optimizer step (allowed: one update behind),
    # which step-counted staleness would have dropped.
    assert any(trainer.steps[i]["pushed"][-1] - v > 1 for i in range(len(trainer.steps)) for v in trainer.steps[i]["trained"])
    assert sum(h["sample/stale_dropped"] for h in history) == history[-1]["sample/stale_dropped_total"]
