"""One rank's fp32 gradient accumulation under FSDP2 mixed precision, in two Triton kernels.

On one rank the trainer lets FSDP2 keep a step's gradients unsharded until the last micro-batch
(``fsdp.before_micro_batch``), and FSDP2 accumulates them in its reduce dtype, fp32: after the first micro-batch's
backward it casts each bf16 gradient to a new fp32 tensor, and after each later one it adds the bf16 gradient into
that fp32 tensor. Between a 16-bit and a 32-bit tensor PyTorch runs both as element-wise kernels that convert
element by element without vector loads, and so below the memory's bandwidth. For a mixture-of-experts model,
whose weights are many per trained token, these two passes were a large part of the step (benchmarks/README.md,
"One rank's gradient accumulation").

``install(model)`` gives each FSDP2 parameter of ``model`` two methods of its own in place of the class's (the
class and every other model are left as they are): the same two steps, through ``upcast`` and ``add_into``. The
arithmetic is FSDP2's: the 16-bit value widened exactly to fp32, then one fp32 addition, so the accumulated
gradients are bit-equal (``tests/test_grad_accumulation.py``). A gradient the kernels do not take (not CUDA, not
contiguous, another dtype) goes through the class's own method.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

BLOCK = 4096
"""Elements one program handles (16-byte loads of either dtype)."""

_kernels: tuple[Any, Any] | None = None

_LOW_PRECISION = (torch.bfloat16, torch.float16)

# The FSDPParam attributes the two methods below read and write, as FSDP2's own methods do (checked at install).
_FSDP_PARAM_NAMES = {
    "to_accumulated_grad_if_needed": ("reduce_dtype", "_unsharded_param", "unsharded_accumulated_grad"),
    "accumulate_unsharded_grad_if_needed": ("unsharded_accumulated_grad", "unsharded_param"),
}


def _build() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_into_kernel(acc, grad, count, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr spelling
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        total = tl.load(acc + offsets, mask=inside) + tl.load(grad + offsets, mask=inside).to(tl.float32)
        tl.store(acc + offsets, total, mask=inside)

    @triton.jit
    def upcast_kernel(out, grad, count, BLOCK: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < count
        tl.store(out + offsets, tl.load(grad + offsets, mask=inside).to(tl.float32), mask=inside)

    return add_into_kernel, upcast_kernel


def _launch(kernel: Any, first: Tensor, second: Tensor, block: int, num_warps: int) -> None:
    count = second.numel()
    if count:
        kernel[(-(-count // block),)](first, second, count, BLOCK=block, num_warps=num_warps)


def kernels_take(grad: Tensor, accumulated_dtype: torch.dtype) -> bool:
    """Whether ``add_into``/``upcast`` take this gradient: a contiguous bf16 or fp16 tensor accumulated in fp32, on
    CUDA (or on the CPU under Triton's interpreter, where the tests run them), with Triton."""
    if accumulated_dtype != torch.float32 or grad.dtype not in _LOW_PRECISION or not grad.is_contiguous():
        return False
    if grad.device.type != "cuda" and not _interpreted():
        return False
    from torch.utils._triton import has_triton

    return grad.device.type != "cuda" or has_triton()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _get_kernels() -> tuple[Any, Any]:
    global _kernels
    if _kernels is None:
        _kernels = _build()
    return _kernels


def add_into(accumulated: Tensor, grad: Tensor, block: int = BLOCK, num_warps: int = 8) -> None:
    """``accumulated += grad`` in place: ``accumulated`` fp32, ``grad`` bf16 or fp16 of the same shape, both
    contiguous. The launch (``block``, a power of two, and ``num_warps``) is the benchmark's to vary."""
    if accumulated.shape != grad.shape or not accumulated.is_contiguous() or accumulated.dtype != torch.float32:
        raise ValueError(f"add_into needs a contiguous fp32 accumulator shaped like the gradient; got "
                         f"{accumulated.dtype} {tuple(accumulated.shape)} for {tuple(grad.shape)}")
    _launch(_get_kernels()[0], accumulated, grad, block, num_warps)


def upcast(grad: Tensor, block: int = BLOCK, num_warps: int = 8) -> Tensor:
    """A new contiguous fp32 copy of ``grad`` (bf16 or fp16, contiguous)."""
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    _launch(_get_kernels()[1], out, grad, block, num_warps)
    return out


def _to_accumulated_grad(self: Any) -> None:
    grad = self._unsharded_param.grad
    if self.reduce_dtype is None or grad is None or grad.dtype == self.reduce_dtype:
        return
    if not kernels_take(grad, self.reduce_dtype):
        type(self).to_accumulated_grad_if_needed(self)
        return
    self._unsharded_param.grad = None
    self.unsharded_accumulated_grad = upcast(grad)


def _accumulate_unsharded_grad(self: Any) -> None:
    accumulated = self.unsharded_accumulated_grad
    if accumulated is None:
        return
    grad = self.unsharded_param.grad
    if grad is None:
        return
    if not kernels_take(grad, accumulated.dtype) or not accumulated.is_contiguous() or grad.shape != accumulated.shape:
        type(self).accumulate_unsharded_grad_if_needed(self)
        return
    add_into(accumulated, grad)
    self.unsharded_param.grad = None


def fsdp_params_understood() -> bool:
    """Whether this PyTorch's FSDP2 parameter class has the two methods ``install`` replaces, reading the attributes
    the replacements read (FSDP2's internals are not a public interface: where they changed, nothing is replaced)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return False
    for method, names in _FSDP_PARAM_NAMES.items():
        code = getattr(getattr(FSDPParam, method, None), "__code__", None)
        if code is None or not set(names) <= set(code.co_names):
            return False
    return True


def _fsdp_params(model: torch.nn.Module) -> Iterator[Any]:
    """The FSDP2 parameters (``FSDPParam``) of ``model``'s FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        yield from group.fsdp_params if group is not None else ()


def install(model: torch.nn.Module) -> int:
    """Route the fp32 accumulation of ``model``'s FSDP2 parameters through ``upcast`` and ``add_into``; returns how
    many parameters now take them (0 where ``fsdp_params_understood`` is False). Idempotent."""
    if not fsdp_params_understood():
        return 0
    installed = 0
    for param in _fsdp_params(model):
        param.to_accumulated_grad_if_needed = types.MethodType(_to_accumulated_grad, param)
        param.accumulate_unsharded_grad_if_needed = types.MethodType(_accumulate_unsharded_grad, param)
        installed += 1
    return installed


def installed_on(model: torch.nn.Module) -> int:
    """How many of ``model``'s FSDP2 parameters accumulate through ``install``'s methods (what a benchmark records)."""
    return sum(getattr(param.__dict__.get("accumulate_unsharded_grad_if_needed"), "__func__", None)
               is _accumulate_unsharded_grad for param in _fsdp_params(model))
