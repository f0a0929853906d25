"""How a mixture-of-experts policy's experts run, and how many of their weights a token uses.

transformers (5.x) stores a sparse block's experts as two 3-D parameters, ``gate_up_proj``
``[experts, 2 * width, hidden]`` and ``down_proj`` ``[experts, hidden, width]``, and dispatches their
forward through its experts interface (``config._experts_implementation``):

* ``eager``: a Python loop over the experts that received tokens, each found with ``nonzero`` (a
  host sync per layer) and run as its own small matmuls;
* ``batched_mm``: every (token, slot) pair gathers its expert's full weight matrix (``[T * k, 2 * width,
  hidden]``), fine for a few tokens, memory-bound for a training row;
* ``grouped_mm``: the (token, slot) pairs sorted by expert (``torch.sort``), counted per expert
  (``histc``, ``cumsum``) and run as one grouped GEMM per projection (``torch.nn.functional.grouped_mm``)
  with those offsets: no host sync, no per-expert launch, no weight copies. PyTorch runs it on CUDA
  GPUs of compute capability 8.0 and later in bf16, and on the CPU (torch >= 2.9) in fp32 and bf16; for
  other dtypes, and under ``torch.compile`` with weights other than bf16, transformers falls back to a
  loop of matmuls over offsets read to the host once per call.

``use_grouped_experts`` selects ``grouped_mm`` (the trainer calls it for every MoE policy). With FSDP2
the experts are parameters of their decoder layer, so they are gathered with the layer, one layer
ahead of compute, like the attention weights.

``active_expert_params`` counts the weights one token runs through (``k`` of the experts, the router,
a shared expert), which is what MFU of a sparse model is measured on (``grpo_core.training.perf``).
"""

from __future__ import annotations

import torch

GROUPED_MM = "grouped_mm"


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding a sparse block's experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    found = []
    for name, module in model.named_modules():
        up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3:
            found.append((name, module))
    return found


def use_grouped_experts(model: torch.nn.Module) -> str | None:
    """Run the model's experts as grouped GEMMs (module docstring); returns the implementation now in
    use, or None for a model without such experts. A model class that cannot switch keeps its own and
    says so in the returned name."""
    if not expert_modules(model):
        return None
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter(GROUPED_MM)
    config = model.config
    return str(getattr(config, "_experts_implementation", None) or "eager")


def active_expert_params(layers: torch.nn.Module) -> tuple[int, int]:
    """``(active, total)`` weights of the sparse blocks under ``layers``: per block, ``top_k`` of its
    experts plus its router (every token runs the router), and all of them."""
    active = total = 0
    for _, experts in expert_modules(layers):
        per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
        count = experts.gate_up_proj.shape[0]
        total += per_expert * count
        active += per_expert * _top_k(layers, experts, count)
    for module in layers.modules():
        weight = getattr(module, "weight", None)
        if isinstance(getattr(module, "top_k", None), int) and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and not isinstance(module, torch.nn.Linear):
            active += weight.numel()  # a router (transformers' routers are not nn.Linear)
            total += weight.numel()
    return active, total


def _top_k(layers: torch.nn.Module, experts: torch.nn.Module, count: int) -> int:
    for module in layers.modules():
        if getattr(module, "experts", None) is experts:
            gate = getattr(module, "gate", None)
            k = getattr(gate, "top_k", None) or getattr(module, "top_k", None)
            if isinstance(k, int):
                return k
    raise ValueError(f"experts module with {count} experts: no router with a top_k beside it")
