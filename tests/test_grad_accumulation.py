"""One rank's fp32 gradient accumulation kernels (``grpo_core.models.grad_accumulation``):

* ``add_into`` and ``upcast`` equal PyTorch's mixed-dtype add and cast bit for bit, for bf16 and fp16 gradients of
  sizes that are and are not a multiple of the block, spanning one program or several, and empty ones;
* a single-rank FSDP2 model in bf16 mixed precision, three micro-batches accumulated unsharded as the trainer's step
  does (``fsdp.before_micro_batch``), ends with the same fp32 gradients with the kernels installed as without, and
  the kernels did the accumulating;
* this PyTorch's FSDP2 still has the two methods ``install`` replaces, reading the attributes it reads; where the
  kernels cannot run, the installed methods hand the gradient to FSDP2's own and nothing changes.

The kernels run on a GPU, or on the CPU under Triton's interpreter (``tests/interpreted_kernels.py``): without either
in this process, ``test_the_accumulation_kernels_run_under_the_interpreter`` runs them in a child process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from grpo_core.models import grad_accumulation
from tests.interpreted_kernels import in_a_child_where_no_kernels, kernel_device, needs_kernels, run_under_interpreter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_BLOCK = 64


@in_a_child_where_no_kernels
def test_the_accumulation_kernels_run_under_the_interpreter():
    """This file's kernel tests in a child process under Triton's CPU interpreter: all run, none skipped."""
    run_under_interpreter(__file__, min_passed=8)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [0, 1, SMALL_BLOCK, 3 * SMALL_BLOCK + 5])
def test_add_into_and_upcast_equal_pytorch_bit_for_bit(dtype, count):
    gen = torch.Generator().manual_seed(count)
    device = kernel_device()
    grad = (torch.randn(count, generator=gen) * 3).to(dtype).to(device)
    accumulated = torch.randn(count, generator=gen).to(device)
    expected = accumulated.clone()
    expected += grad  # PyTorch's mixed-dtype add, as FSDP2 runs it
    grad_accumulation.add_into(accumulated, grad, block=SMALL_BLOCK)
    assert torch.equal(accumulated, expected)
    widened = grad_accumulation.upcast(grad, block=SMALL_BLOCK)
    assert widened.dtype == torch.float32 and torch.equal(widened, grad.to(torch.float32))


@needs_kernels
def test_add_into_refuses_an_accumulator_of_another_shape():
    device = kernel_device()
    with pytest.raises(ValueError, match="shaped like the gradient"):
        grad_accumulation.add_into(torch.zeros(4, device=device), torch.zeros(5, dtype=torch.bfloat16, device=device))


def test_this_pytorch_has_the_fsdp2_methods_install_replaces():
    """Fails when a PyTorch upgrade renames what the installed methods rely on: ``install`` would then replace
    nothing, and the step would run FSDP2's slower accumulation without a word."""
    assert grad_accumulation.fsdp_params_understood()


def tiny_layers(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 1))


def accumulated_grads(install: bool, calls: dict[str, int]) -> dict[str, torch.Tensor]:
    """Three micro-batches of one single-rank bf16 FSDP2 step, the first two without gradient sync; the sharded
    fp32 gradients after the last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_layers(seed=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index in (0, 2):
        fully_shard(model[index], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if install:
        assert grad_accumulation.install(model) == 6  # three weights and three biases
    assert grad_accumulation.installed_on(model) == (6 if install else 0)
    add_into, upcast = grad_accumulation.add_into, grad_accumulation.upcast

    def counted_add_into(*args, **kwargs):
        calls["add_into"] += 1
        return add_into(*args, **kwargs)

    def counted_upcast(*args, **kwargs):
        calls["upcast"] += 1
        return upcast(*args, **kwargs)

    grad_accumulation.add_into, grad_accumulation.upcast = counted_add_into, counted_upcast
    try:
        gen = torch.Generator().manual_seed(1)
        for micro_batch in range(3):
            model.set_requires_gradient_sync(micro_batch == 2)
            inputs = torch.randn(7, 24, generator=gen)
            model(inputs).float().square().sum().backward()
    finally:
        grad_accumulation.add_into, grad_accumulation.upcast = add_into, upcast
    return {name: param.grad.full_tensor().clone() for name, param in model.named_parameters()}


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from grpo_core.vllm_server.process import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_installed_methods_leave_gradients_fsdp2_s_where_the_kernels_cannot_run(one_rank_group, monkeypatch):
    """Where the kernels do not take a gradient, the installed methods hand it to FSDP2's own methods."""
    monkeypatch.setattr(grad_accumulation, "kernels_take", lambda grad, accumulated_dtype: False)
    calls = {"add_into": 0, "upcast": 0}
    reference = accumulated_grads(install=False, calls=calls)
    installed = accumulated_grads(install=True, calls=calls)
    assert calls == {"add_into": 0, "upcast": 0}
    for name, grad in reference.items():
        assert torch.equal(installed[name], grad), name


@needs_kernels
def test_one_rank_accumulation_through_the_kernels_equals_fsdp2_s(one_rank_group):
    if kernel_device() == "cuda":
        pytest.skip("the CPU model of this test needs the interpreter; on CUDA the kernel tests above cover the "
                    "arithmetic")
    calls = {"add_into": 0, "upcast": 0}
    reference = accumulated_grads(install=False, calls=calls)
    assert calls == {"add_into": 0, "upcast": 0}
    installed = accumulated_grads(install=True, calls=calls)
    # six parameters: cast after the first micro-batch, added after each of the two later ones
    assert calls == {"upcast": 6, "add_into": 12}
    for name, grad in reference.items():
        assert grad.dtype == torch.float32 and torch.equal(installed[name], grad), name
