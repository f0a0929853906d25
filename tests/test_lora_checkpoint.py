"""LoRA checkpoints: the adapter is saved in PEFT's layout (what vLLM and peft load) and a resume restores it.

A real ``AsyncGRPOTrainer`` with ``peft_config`` on the offline tiny model; optimizer steps use a
seeded synthetic loss, so no server is needed. Loading a checkpoint's adapter into vLLM is covered
in ``tests/integration/test_lora_sync.py``.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from grpo_core.config import AsyncGRPOConfig
from grpo_core.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_files_state
from grpo_core.rewards import accuracy_reward
from grpo_core.training.trainer import AsyncGRPOTrainer

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear")


def make_trainer(model_path: str, out, **overrides) -> AsyncGRPOTrainer:
    values = dict(output_dir=str(out), report_to="none", learning_rate=1e-2, max_steps=10, save_steps=1)
    values.update(overrides)
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "solution": "2"}]
    return AsyncGRPOTrainer(model=model_path, reward_funcs=accuracy_reward, train_dataset=rows,
                            args=AsyncGRPOConfig(**values), peft_config=LoraConfig(**LORA))


def start(trainer: AsyncGRPOTrainer) -> None:
    """The checkpoint part of the trainer's set-up (no server)."""
    trainer.checkpointer.resume(trainer.args.resume_from_checkpoint)


def step(trainer: AsyncGRPOTrainer, seed: int) -> None:
    """One optimizer step on a seeded loss; only the adapter is trainable, so only it moves."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in trainer.model.parameters() if p.requires_grad)
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1


def state(trainer: AsyncGRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_checkpoint_holds_a_servable_adapter_and_resume_restores_it(tiny_model_path, tmp_path):
    first = make_trainer(tiny_model_path, tmp_path / "run")
    start(first)
    initial = state(first)
    for i in range(2):
        step(first, i)
    first.checkpointer.save()
    saved = state(first)
    folder = tmp_path / "run" / "checkpoint-2"

    # The adapter moved and the base did not (the comparison below would pass for an untrained adapter too).
    moved = [k for k in saved if "lora_B" in k and not torch.equal(saved[k], initial[k])]
    assert moved and all(torch.equal(saved[k], initial[k]) for k in saved if ".lora_" not in k)

    # What serving needs: the adapter files, pointing at the base model they apply to.
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == tiny_model_path and config["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(folder)))
    trained = get_peft_model_state_dict(first.model)
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    # The serving cache is not part of a checkpoint.
    assert not (folder / ".vllm_lora").exists()

    step(first, 99)  # moves on past the checkpoint; a resume must undo this
    second = make_trainer(tiny_model_path, tmp_path / "run", resume_from_checkpoint=True)
    start(second)
    assert second.global_step == 2
    restored = state(second)
    assert restored.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name


def test_adapter_files_state_matches_peft(tiny_model_path, tmp_path):
    trainer = make_trainer(tiny_model_path, tmp_path / "run")
    step(trainer, 0)
    expected = get_peft_model_state_dict(trainer.model)
    ours = adapter_files_state(trainer.model.state_dict())
    assert ours.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name


def test_lora_with_save_strategy_no_warns(tiny_model_path, tmp_path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="grpo_core.models.lora"):
        make_trainer(tiny_model_path, tmp_path / "run", save_strategy="no")
    assert "nothing of this run will survive" in caplog.text
