"""Checkpoints on a local folder: layout, exact resume, torn checkpoints, rotation, bf16, safe loading.

A real ``AsyncGRPOTrainer`` supplies the model, optimizer, scheduler and frontier; the model is a
small random Qwen3 with tied embeddings and a character tokenizer, built here in seconds, and the
optimizer steps use a seeded synthetic loss (no server is needed to exercise the state a checkpoint
must carry). The S3 variant and the killed-trainer runs are in ``tests/integration/test_resume.py``.

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.checkpoint import (
    MANIFEST,
    CheckpointError,
    RunLedger,
    Storage,
    build_manifest,
    ledger_summary,
    read_ledger,
    surviving_steps,
)
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rewards import accuracy_reward
from grpo_core.training.trainer import AsyncGRPOTrainer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A random 2-layer Qwen3 (tied embeddings, as the tiny model) with a character tokenizer."""
    import string

    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    chars = ["<unk>", "<eos>", *(string.digits + string.ascii_letters + "+-=?. ")]
    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>", pad_token="<unk>")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-model")
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def train_rows():
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"{i}+{i}=?"}] for i in range(64)],
        "solution": [str(2 * i) for i in range(64)],
    })


def make_trainer(model_path: str, rows, out: Path, **overrides) -> AsyncGRPOTrainer:
    values = dict(output_dir=str(out), report_to="none", learning_rate=1e-3, lr_scheduler_type="cosine",
                  warmup_steps=2, max_steps=10, save_steps=1, save_total_limit=None)
    values.update(overrides)
    return AsyncGRPOTrainer(model=model_path, reward_funcs=accuracy_reward, train_dataset=rows,
                            args=AsyncGRPOConfig(**values))


def start(trainer: AsyncGRPOTrainer) -> None:
    """The checkpoint part of the trainer's set-up (no server)."""
    trainer.checkpointer.resume(trainer.args.resume_from_checkpoint)


def step(trainer: AsyncGRPOTrainer, seed: int) -> None:
    """One optimizer step on a seeded loss touching every parameter, plus a dropout-style RNG draw."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in trainer.model.parameters())
    loss = loss + 1e-3 * torch.rand(()) * loss.detach()  # uses the global RNG, which a resume must restore
    loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1
    trainer.frontier.position += 3


def params(trainer: AsyncGRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_layout_manifest_and_servable_folder(model_path, train_rows, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(model_path, train_rows, tmp_path / "run")
    start(trainer)
    for i in range(2):
        step(trainer, i)
    trainer.frontier.position = len(train_rows) + 5  # into the second epoch
    metrics = trainer.checkpointer.save()
    folder = tmp_path / "run" / "checkpoint-2"
    assert metrics["checkpoint/bytes"] > 0

    manifest = json.loads((folder / MANIFEST).read_text())
    listed = set(manifest["files"])
    on_disk = {p.name for p in folder.iterdir()} - {MANIFEST}
    assert listed == on_disk
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "scheduler.json",
            "rng_state.pt", "trainer_state.json", "rollout_state.json"} <= listed
    assert "master_weights.safetensors" not in listed  # fp32 training: the served file is the master
    assert manifest["files"] == build_manifest(folder, 2, manifest["lineage"])["files"]

    rollout = json.loads((folder / "rollout_state.json").read_text())
    assert rollout == {"position": len(train_rows) + 5, "done_ahead": [], "epoch": 1, "index_in_epoch": 5,
                       "num_prompts": len(train_rows), "seed": 0}
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 2

    # Tied embeddings are stored once, under the embedding's name, as transformers and vLLM expect.
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trainer.model.state_dict()[name]), name
    assert AutoTokenizer.from_pretrained(folder)("1+2")["input_ids"] == trainer.tokenizer("1+2")["input_ids"]


def test_resume_continues_exactly(model_path, train_rows, tmp_path):
    out = tmp_path / "run"
    first = make_trainer(model_path, train_rows, out)
    start(first)
    for i in range(3):
        step(first, i)
    first.checkpointer.save()
    step(first, 3)
    expected = params(first)
    expected_lr = first.lr_scheduler.get_last_lr()
    expected_draw = torch.rand(4)

    second = make_trainer(model_path, train_rows, out, resume_from_checkpoint=True, seed=1)
    start(second)
    assert second.global_step == 3 and second.frontier.position == 9
    assert second.checkpointer.attempt == 2
    step(second, 3)
    assert second.lr_scheduler.get_last_lr() == expected_lr
    for name, value in params(second).items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(torch.rand(4), expected_draw)


@pytest.mark.parametrize("damage", ["no manifest", "short file", "flipped byte", "missing file"])
def test_torn_checkpoint_is_skipped_with_a_warning(damage, model_path, train_rows, tmp_path, caplog):
    out = tmp_path / "run"
    trainer = make_trainer(model_path, train_rows, out)
    start(trainer)
    step(trainer, 0)
    trainer.checkpointer.save()
    good = params(trainer)
    step(trainer, 1)
    trainer.checkpointer.save()
    torn = out / "checkpoint-2"
    target = torn / "optimizer.pt"
    if damage == "no manifest":
        (torn / MANIFEST).unlink()
    elif damage == "short file":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flipped byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()

    resumed = make_trainer(model_path, train_rows, out, resume_from_checkpoint=True)
    with caplog.at_level(logging.WARNING, logger="grpo_core.checkpoint"):
        start(resumed)
    assert resumed.global_step == 1
    assert any("torn checkpoint" in r.message and "checkpoint-2" in r.message for r in caplog.records)
    for name, value in params(resumed).items():
        assert torch.equal(value, good[name]), name

    explicit = make_trainer(model_path, train_rows, out, resume_from_checkpoint=str(torn))
    with pytest.raises(CheckpointError, match="cannot be used"):
        explicit.checkpointer.find_resume_point(explicit.args.resume_from_checkpoint)


def test_rotation_keeps_newest_of_this_run_only(model_path, train_rows, tmp_path):
    out = tmp_path / "run"
    earlier = make_trainer(model_path, train_rows, out)
    start(earlier)
    for _ in range(7):
        earlier.state.global_step += 1
    earlier.checkpointer.save()  # checkpoint-7 of an earlier run in the same folder

    trainer = make_trainer(model_path, train_rows, out, save_total_limit=2)
    start(trainer)  # a fresh run: a new lineage
    (out / "checkpoint-1").mkdir()  # torn debris older than the newest good checkpoint
    for i in range(4):
        step(trainer, i)
        if trainer.global_step > 1:
            trainer.checkpointer.save()
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-3", "checkpoint-4", "checkpoint-7"]

    resumed = make_trainer(model_path, train_rows, out, resume_from_checkpoint=True)
    assert resumed.checkpointer.find_resume_point(resumed.args.resume_from_checkpoint) == str(out / "checkpoint-4")


def test_bf16_serves_bf16_and_resumes_from_fp32_master(model_path, train_rows, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(model_path, train_rows, out)
    # bf16 training itself needs CUDA (FSDP2 mixed precision); what a bf16 run writes is the same code,
    # told the serving dtype by the trainer.
    trainer.checkpointer.parts.serve_dtype = torch.bfloat16
    start(trainer)
    step(trainer, 0)
    trainer.checkpointer.save()
    folder = out / "checkpoint-1"
    served = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    master = load_file(str(folder / "master_weights.safetensors"))
    assert {t.dtype for t in master.values()} == {torch.float32}

    resumed = make_trainer(model_path, train_rows, out, resume_from_checkpoint=True)
    start(resumed)
    for name, value in params(resumed).items():
        assert torch.equal(value, trainer.model.state_dict()[name]), name


class _Payload:
    """Unpickling this would create a file: proof that resume executed code from a checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_never_unpickles_objects(model_path, train_rows, tmp_path):
    out = tmp_path / "run"
    trainer = make_trainer(model_path, train_rows, out)
    start(trainer)
    step(trainer, 0)
    trainer.checkpointer.save()
    folder = out / "checkpoint-1"
    marker = tmp_path / "executed"
    torch.save({"state": {}, "param_groups": [], "hook": _Payload(str(marker))}, folder / "optimizer.pt")
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps(build_manifest(folder, 1, manifest["lineage"])))  # looks good

    resumed = make_trainer(model_path, train_rows, out, resume_from_checkpoint=True)
    with pytest.raises(pickle.UnpicklingError):
        start(resumed)
    assert not marker.exists()


def test_iterable_dataset_resumes_at_the_saved_position(model_path, train_rows, tmp_path):
    # A stream cannot be indexed, but the position is kept: the resumed worker reads up to it
    # (grpo_core.data.prompts, tested in tests/test_prompts.py).
    out = tmp_path / "run"
    stream = train_rows.to_iterable_dataset()
    trainer = make_trainer(model_path, stream, out)
    start(trainer)
    step(trainer, 0)
    trainer.checkpointer.save()
    assert trainer.frontier.position == 3
    rollout = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    assert rollout["position"] == 3 and rollout["num_prompts"] is None

    resumed = make_trainer(model_path, stream, out, resume_from_checkpoint=True)
    start(resumed)
    assert resumed.global_step == 1 and resumed.frontier.position == 3


def test_ledger_lineage_and_summary(tmp_path):
    ledger = RunLedger(Storage(str(tmp_path)))

    def steps(attempt, first, last, positions_per_step=2):
        for s in range(first, last + 1):
            trained = [2 * (s - 1), 2 * (s - 1) + 1][:positions_per_step]
            ledger.record(attempt=attempt, step=s, trained=trained, dropped_groups=[], stale_dropped=0, frontier=2 * s)

    assert ledger.start_attempt(None, 0, 0) == 1
    steps(1, 1, 7)  # killed after step 7; checkpoint-5 holds position 10
    assert ledger.start_attempt("checkpoint-5", 5, 10) == 2
    steps(2, 6, 9)  # killed after 9; checkpoint-5 again (6..9 never saved)
    assert ledger.start_attempt("checkpoint-5", 5, 10) == 3
    steps(3, 6, 11)
    # A group split over two steps of one attempt (position 21 in steps 11 and 12) is trained once.
    ledger.record(attempt=3, step=12, trained=[21, 22, 23], dropped_groups=[], stale_dropped=0, frontier=24)

    attempts, records = read_ledger(str(tmp_path))
    kept = surviving_steps(attempts, records)
    assert [r["step"] for r in kept] == list(range(1, 13))
    assert [r["attempt"] for r in kept] == [1] * 5 + [3] * 7
    summary = ledger_summary(str(tmp_path))
    # positions 10..13 (steps 6, 7) were trained three times, 14..17 (steps 8, 9) twice
    assert summary == {"attempts": 3, "resumes": 2, "prompts_consumed": 24, "prompts_trained_twice": 8,
                       "stale_dropped": 0, "foreign_dropped": 0, "server_restarts": 0}
