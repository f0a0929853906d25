"""A checkpoint written by N ranks resumes on M ranks (2 → 1 and 1 → 2, CPU, gloo FSDP2) exactly.

Checkpoints hold full (unsharded) tensors, so the rank count may change between attempts, e.g. a
job preempted on two nodes and resumed on one. Each direction runs a writer and a reader, each in
its own spawned process group (one process, or two ranks sharding the policy with FSDP2):

    writer: 2 optimizer steps → checkpoint-2 → dump its full state → 1 step more → dump again
    reader: resume from checkpoint-2 → dump its full state → the same step → dump again

Full state = model weights and the optimizer state (Adam's moments and step per parameter, as
``torch.distributed.checkpoint`` gathers them), plus the LR scheduler and the trainer's step. The
reader must equal the writer bitwise at both points: AdamW's update is elementwise, so a shard of a
parameter is updated by exactly the operations its full tensor is. The steps use a seeded gradient
per parameter (set on the full tensor, or on each rank's shard of it), so no forward pass or
data is involved.

    .venv/bin/python -m pytest -q tests/test_reshard_resume.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from grpo_core.vllm_server.process import free_port
from tests.child_processes import run_ranks
from tests.test_checkpoint import model_path, train_rows  # noqa: F401 - fixtures


def seeded_step(trainer, seed: int) -> None:
    """One optimizer step with a seeded gradient per parameter, the same whatever the sharding."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(trainer.model.named_parameters()):
        full = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        param.grad = distribute_tensor(full, param.device_mesh, param.placements) if isinstance(param, DTensor) else full
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.state.global_step += 1


def dump(trainer, path: Path) -> None:
    """The full state on rank 0 (a collective: every rank calls it)."""
    from grpo_core.checkpoint.state import full_state

    model_state, optim_state = full_state(trainer.model, trainer.optimizer)
    if trainer.dist.is_main:
        torch.save({"model": model_state, "optim": optim_state, "scheduler": trainer.lr_scheduler.state_dict(),
                    "step": trainer.global_step}, path)


def _role(rank: int, world_size: int, port: int, role: str, model: str, rows, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tests.test_checkpoint import make_trainer, start

    folder = Path(out)
    resume = str(folder / "checkpoint-2") if role == "reader" else None
    trainer = make_trainer(model, rows, folder if role == "writer" else folder / "reader-run", max_steps=3,
                           resume_from_checkpoint=resume)
    assert trainer.dist.world_size == world_size
    start(trainer)
    if role == "writer":
        seeded_step(trainer, 1)
        seeded_step(trainer, 2)
        trainer.checkpointer.save()
    dump(trainer, folder / f"{role}-at-2.pt")
    seeded_step(trainer, 3)
    dump(trainer, folder / f"{role}-at-3.pt")
    import torch.distributed as dist

    if dist.is_initialized():  # both ranks done with every collective before gloo goes
        dist.barrier()
        dist.destroy_process_group()


def run(role: str, world_size: int, model: str, rows, out: Path) -> None:
    run_ranks(_role, (world_size, free_port(), role, model, rows, str(out)), nprocs=world_size)


def assert_same(a: dict, b: dict, where: str) -> None:
    assert a["step"] == b["step"], where
    assert a["scheduler"] == b["scheduler"], where
    assert a["model"].keys() == b["model"].keys(), where
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{where}: weight {name} differs"
    state_a, state_b = a["optim"]["state"], b["optim"]["state"]
    assert state_a.keys() == state_b.keys() and len(state_a) >= len(a["model"]) - 1, where  # the tied head has no own state
    for name in state_a:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(state_a[name][key]), torch.as_tensor(state_b[name][key])), \
                f"{where}: optimizer {key} of {name} differs"
    # Hyperparameters and the LR the scheduler set; a restored group holds betas as a list, not a tuple.
    plain = lambda groups: [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]  # noqa: E731
    assert plain(a["optim"]["param_groups"]) == plain(b["optim"]["param_groups"]), where


@pytest.mark.parametrize("writers,readers", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_number_of_ranks(writers, readers, model_path, train_rows, tmp_path):
    run("writer", writers, model_path, train_rows, tmp_path)
    run("reader", readers, model_path, train_rows, tmp_path)
    load = lambda name: torch.load(tmp_path / name, weights_only=True)  # noqa: E731
    writer_2, writer_3 = load("writer-at-2.pt"), load("writer-at-3.pt")
    assert writer_2["step"] == 2 and writer_3["step"] == 3
    # The step moved every weight: equal states after it are not equal by doing nothing.
    assert all(not torch.equal(writer_2["model"][k], writer_3["model"][k]) for k in writer_2["model"])
    assert_same(writer_2, load("reader-at-2.pt"), f"{writers}->{readers} ranks, resumed at step 2")
    assert_same(writer_3, load("reader-at-3.pt"), f"{writers}->{readers} ranks, one step after the resume")
