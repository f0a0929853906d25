"""Re-pack a CPU vLLM server's mixture-of-experts weights after a weight update.

vLLM's CPU experts kernel does not read the expert weights in the checkpoint's order: when the model is first
loaded, the experts' ``process_weights_after_loading`` re-lays ``w13_weight`` and ``w2_weight`` out for its
grouped GEMM. A layer-wise reload (what every pushed update goes through) writes checkpoint-order weights back into
those parameters, and vLLM 0.32 runs the kernel's packing on the first load only, so the kernel would then read the
new weights as if they were packed. Measured on the tiny Qwen3-MoE: a push of the very weights the server had loaded
moved its log-probs by 8.96 nats on average. ``repack_cpu_experts`` runs the kernel's packing again on every MoE
layer, which is what a fresh load would have done.

GPU kernels need nothing of this: their layout step runs on each update inside vLLM.
"""

from __future__ import annotations

import torch


def cpu_expert_kernels(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """``(layer, experts kernel)`` for each MoE layer whose experts run on vLLM's CPU kernel."""
    out = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # The CPU kernels' classes (x86, Arm, Power; unquantized and quantized) all carry "CPU" in their names and
        # pack in ``process_weights_after_loading``; matching by name keeps this free of vLLM's private modules.
        if experts is not None and "CPU" in type(experts).__name__ and hasattr(experts, "process_weights_after_loading"):
            out.append((module, experts))
    return out


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack every CPU MoE layer's freshly reloaded expert weights for its kernel; returns the layers packed."""
    layers = cpu_expert_kernels(model)
    for layer, experts in layers:
        experts.process_weights_after_loading(layer)
    return len(layers)
