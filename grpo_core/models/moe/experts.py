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

* ``grpo_grouped_mm`` (``sorted_experts_forward``, registered here): the same sort and grouped GEMMs, with the
  two permutations written as gathers whose backwards are gathers too. Indexing ``hidden[perm // k]`` and
  ``out[inv_perm]`` makes autograd scatter-add the gradients back (an accumulating ``index_put`` over
  ``T * k`` rows); here a token's ``k`` gradient rows are gathered back into place and summed in fp32, and the
  unsorting's gradient is the sorting gather. Same values, no atomics. Sums over a token's slots are k-term sums
  of gathered rows (``_sum_slots``), which the compiler makes one elementwise kernel.

``use_grouped_experts`` selects ``grpo_grouped_mm`` where the experts allow it and ``grouped_mm`` where not
(``DEFAULT_EXPERTS``; the trainer calls it for every MoE policy). With FSDP2
the experts are parameters of their decoder layer, so they are gathered with the layer, one layer
ahead of compute, like the attention weights.

``active_expert_params`` counts the weights one token runs through (``k`` of the experts, the router,
a shared expert), which is what MFU of a sparse model is measured on (``grpo_core.training.perf``).
"""

from __future__ import annotations

import torch

GROUPED_MM = "grouped_mm"
SORTED_GROUPED_MM = "grpo_grouped_mm"
EXPERTS_IMPLEMENTATIONS = (GROUPED_MM, SORTED_GROUPED_MM)
DEFAULT_EXPERTS = SORTED_GROUPED_MM
"""What ``use_grouped_experts`` runs where the experts allow it (gated, no biases): faster than ``grouped_mm`` on
both MoE shapes, eager and compiled (benchmarks/README.md, "Mixture-of-experts training"), and its input gradient sums a
token's slots in fp32."""


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding a sparse block's experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    found = []
    for name, module in model.named_modules():
        up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3:
            found.append((name, module))
    return found


def sorted_experts_apply(model: torch.nn.Module) -> bool:
    """Whether ``grpo_grouped_mm`` can run every experts module of ``model``: gated, without biases, on one rank, with
    the members ``sorted_experts_forward`` reads (transformers' experts modules have them; a model's own may not)."""
    return all(not getattr(m, "has_bias", False) and getattr(m, "has_gate", True)
               and not getattr(m, "_is_expert_parallel", False) and callable(getattr(m, "_apply_gate", None))
               and hasattr(m, "num_experts") and hasattr(m, "is_transposed") for _, m in expert_modules(model))


def use_grouped_experts(model: torch.nn.Module, implementation: str | None = None) -> str | None:
    """Run the model's experts as grouped GEMMs (module docstring; ``implementation``: one of
    ``EXPERTS_IMPLEMENTATIONS``, or None for ``DEFAULT_EXPERTS`` where the experts allow it and ``grouped_mm``
    where not); returns the implementation now in use, or None for a model without such experts. A model class
    that cannot switch keeps its own and says so in the returned name."""
    if implementation is None:
        implementation = DEFAULT_EXPERTS if sorted_experts_apply(model) else GROUPED_MM
    if implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts implementation {implementation!r}: use one of {EXPERTS_IMPLEMENTATIONS}")
    if not expert_modules(model):
        return None
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        if implementation == SORTED_GROUPED_MM:
            register_sorted_experts()
        setter(implementation)
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


# ---- grouped GEMMs with gather-only permutations ---------------------------------------------------------
# A token's k slots sit at rows ``slot_rows[t]`` (``[T, k]``) of the expert-sorted rows. Every sum over a token's
# slots is written as k gathered rows added one after another, not as a reduction over the slot axis of a gathered
# ``[T, k, H]`` tensor: the compiler makes the k-term sum one elementwise kernel whose loads are whole contiguous
# rows, where its reduction over the slot axis (stride H) read each row in short pieces, far below a row gather's
# rate (benchmarks/results/moe_qwen3_30b_a3b_profile_h200.json; benchmarks/README.md, "The Qwen3.5 family").
def _sum_slots(rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``sum_j weights[t, j] * rows[slot_rows[t, j]]`` (weights 1 where None) in fp32 or wider: ``[T, H]``."""
    wide = torch.promote_types(rows.dtype, torch.float32)
    out = None
    for j in range(slot_rows.shape[1]):
        term = rows.index_select(0, slot_rows[:, j]).to(wide)
        if weights is not None:
            term = term * weights[:, j : j + 1].to(wide)
        out = term if out is None else out + term
    return out


class _ExpandToSlots(torch.autograd.Function):
    """``x[perm // k]``: every token's hidden state once per routed slot, in expert order. Backward: each token's
    ``k`` slot gradients gathered (``slot_rows``) and summed in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_rows)
        return x.index_select(0, perm // slot_rows.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot_rows,) = ctx.saved_tensors
        return _sum_slots(grad, slot_rows, None).to(grad.dtype), None, None


class _CombineSlots(torch.autograd.Function):
    """``sum_j weights[t, j] * rows[slot_rows[t, j]]``: the experts' sorted outputs back in token order, mixed by the
    router's weights, in fp32. Backward: each sorted row's gradient is its token's, times its weight (a gather by
    ``perm``); each weight's is the dot product of its token's gradient with its row."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor,
                slot_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, perm, slot_rows)
        return _sum_slots(rows, slot_rows, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, perm, slot_rows = ctx.saved_tensors
        k = slot_rows.shape[1]
        grad_rows = grad.index_select(0, perm // k) * weights.reshape(-1).index_select(0, perm).unsqueeze(-1)
        grad_weights = torch.stack([(grad * rows.index_select(0, slot_rows[:, j]).to(grad.dtype)).sum(-1)
                                    for j in range(k)], dim=1)
        return grad_rows.to(rows.dtype), grad_weights.to(weights.dtype), None, None


def sorted_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward (transformers' experts interface) as grouped GEMMs over the (token, slot) pairs
    sorted by expert; gated experts with ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (or
    transposed, ``self.is_transposed``), no biases. Returns ``[T, H]`` in ``hidden_states``' dtype."""
    from transformers.integrations.moe import _grouped_linear

    if getattr(self, "has_bias", False) or not getattr(self, "has_gate", True) or getattr(self, "_is_expert_parallel", False):
        raise ValueError(f"{type(self).__name__}: {SORTED_GROUPED_MM} runs gated experts without biases on one rank; "
                         f"use {GROUPED_MM}")
    tokens, k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    slot_rows = torch.empty_like(perm)  # the inverse permutation: where each (token, slot) pair sits once sorted
    slot_rows[perm] = torch.arange(perm.numel(), device=perm.device)
    slot_rows = slot_rows.view(tokens, k)
    counts = torch.histc(expert_ids.int() if expert_ids.is_cuda else expert_ids.float(), bins=self.num_experts,
                         min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    slots = _ExpandToSlots.apply(hidden_states, perm, slot_rows)  # [T * k, H], expert order
    up = _grouped_linear(slots, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    down = _grouped_linear(self._apply_gate(up), self.down_proj, offsets, is_transposed=self.is_transposed)
    # back in token order, weighted and summed in fp32 (transformers' grouped_mm sums in the weights' dtype)
    return _CombineSlots.apply(down, top_k_weights, perm, slot_rows).to(hidden_states.dtype)


def register_sorted_experts() -> None:
    """Make ``grpo_grouped_mm`` a name transformers' experts interface knows (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(SORTED_GROUPED_MM, sorted_experts_forward)
