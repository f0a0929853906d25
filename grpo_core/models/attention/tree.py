"""Tree attention: causal attention over a packed prefix trie, registered as a transformers backend.

A packed row (``grpo_core.packing.collator``) is a list of segments laid out depth-first. Segment
``g`` owns the queries ``cu_seq_q[g]:cu_seq_q[g+1]`` and attends to the keys of its root-to-segment
path, listed in ``kv_index[cu_seq_k[g]:cu_seq_k[g+1]]``. The path ends with the segment itself, so a
causal mask aligned bottom-right (query ``i`` of ``q`` sees key ``j`` of ``k`` iff ``j <= i + k - q``)
shows each query its ancestors and its own causal past, and nothing else.

Backends (one is picked at load time by ``register_tree_attention``):

- ``reference``: plain PyTorch, one dense ``[U, U]`` mask and ``scaled_dot_product_attention``.
  Runs anywhere; the oracle of the tests. Memory grows with ``U**2``.
- fused varlen kernels (``kernels``, ``flash_attn_cute``, ``torch_varlen``, ``aten_flash``; how each
  is loaded, and which ``auto`` prefers on which GPU, is ``grpo_core.models.attention.backends``), in
  one of two plans:

  - ``split`` (where the kernel exposes its log-sum-exp: ``flash_attn_cute``, ``torch_varlen``,
    ``aten_flash``): one call for every segment's own tokens and one per ancestor depth, merged by
    log-sum-exp; nothing of the paths' length is copied (``grpo_core.models.attention.split``);
  - ``gather`` (any varlen kernel): K/V gathered along each root-to-segment path, then one varlen
    call, causal bottom-right.
  In the gather plan the gathered K/V is not kept for backward: saved-tensor hooks keep the row's own
  K/V and the paths instead, and backward gathers again (``set_kv_regather``; exact, see "re-gathering
  K/V in backward"; compiled layers only with ``set_kv_regather_compiled``).
- ``varlen_emulated`` / ``split_emulated``: the gather / split plan with PyTorch loops in place of the
  fused kernel (``split.EmulatedLSEKernel`` for the split one), so that CPU tests cover what a GPU
  kernel receives and saves.

Use::

    enable_tree_attention(model)                      # checks the architecture, registers, switches
    out = model(**row.model_inputs(), logits_to_keep=row.logit_index)

Gated DeltaNet layers of hybrids (Qwen3.5/3.6, Qwen3-Next) get trie-aware replacements of their
token-mixing functions from ``grpo_core.models.attention.hybrid`` (``enable_tree_attention`` installs them).

Transformers (5.x) passes extra keyword arguments of ``model(...)`` down to the attention function,
so ``tree_attention=<TreeAttentionMetadata>`` reaches every layer; stock Qwen3 and Llama code runs
unchanged. The attention implementation is not in transformers' mask registry, so no ``[U, U]``
mask is built by the model.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from grpo_core.models.attention.backends import (
    BackendUnavailable,
    VarlenKernel,
    device_family,
    load_kernel,
    load_lse_kernel,
    pick_backend,
    short_reason,
)
from grpo_core.models.attention.gather import (
    _emulated_kernel,
    _repeat_kv,
    gather_plan,
    set_kv_regather,
    set_kv_regather_compiled,
)
from grpo_core.models.attention.hybrid import install_gated_delta, is_gated_delta_net
from grpo_core.models.attention.metadata import TreeAttentionMetadata
from grpo_core.models.attention.split import EmulatedLSEKernel, LSEKernel, split_tree_attention

log = logging.getLogger(__name__)

TREE_ATTENTION = "grpo_tree"  # the attn_implementation name registered in transformers


# ---- backends ------------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TreeAttentionMetadata, float], torch.Tensor]
    needs_cuda: bool


def _reference(q, k, v, meta: TreeAttentionMetadata, scale: float) -> torch.Tensor:
    heads = q.shape[1]
    mask = meta.dense_mask(q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), _repeat_kv(k, heads).transpose(0, 1), _repeat_kv(v, heads).transpose(0, 1),
        attn_mask=mask, scale=scale,
    )
    return out.transpose(0, 1)


def _gather_backend(name: str, kernel: VarlenKernel, repeat_kv: bool, needs_cuda: bool) -> Backend:
    return Backend(name, gather_plan(kernel, repeat_kv), needs_cuda)


def _split_backend(name: str, kernel: LSEKernel, needs_cuda: bool) -> Backend:
    def run(q, k, v, meta: TreeAttentionMetadata, scale: float) -> torch.Tensor:
        levels = meta.ancestor_levels(q.device)
        return split_tree_attention(q, k, v, kernel, meta.cu_seq_q, meta.max_q, levels, scale)

    # A fused kernel's entry points are called from Python with a loop over the row's levels; compiled
    # layers break their graph around it, as they do around any kernel from outside PyTorch.
    return Backend(name, torch.compiler.disable(run, recursive=True) if needs_cuda else run, needs_cuda)


SPLIT_MIN_PATHS_PER_TOKEN = 3.0
"""``auto`` plan: a row runs split where its root-to-segment paths hold at least this many keys per token of
the row (``kv_index`` length / ``U``), else gather: where paths are short, split's extra launches, query gathers
and merge outweigh the copy it saves. Where the line falls was measured (benchmarks/README.md, "Tree attention
split by ancestor level")."""


def _per_row_backend(name: str, split: Backend, gather: Backend) -> Backend:
    def run(q, k, v, meta: TreeAttentionMetadata, scale: float) -> torch.Tensor:
        # Shapes only (no device read): the paths' length is kv_index's size.
        if meta.kv_index is not None and meta.kv_index.shape[0] >= SPLIT_MIN_PATHS_PER_TOKEN * q.shape[0]:
            return split.run(q, k, v, meta, scale)
        return gather.run(q, k, v, meta, scale)

    return Backend(name, run, split.needs_cuda or gather.needs_cuda)


def _probe(backend: Backend, device: torch.device, heads: tuple[int, int] = (4, 2), dim: int = 128) -> float:
    """Largest relative error of output and input gradients against ``reference`` on a small tree."""
    gen = torch.Generator().manual_seed(0)
    # Root segment of 40 nodes, children of 24 and 33, a grandchild of 9 under the first child.
    q_lens, starts, parents = [40, 24, 9, 33], [0, 40, 64, 40], [None, 0, 1, 0]
    offsets = [0, 40, 64, 73]
    paths: list[list[int]] = []
    for g, (ql, p) in enumerate(zip(q_lens, parents)):
        own = list(range(offsets[g], offsets[g] + ql))
        paths.append((paths[p] if p is not None else []) + own)
    k_lens = [s + ql for s, ql in zip(starts, q_lens)]
    cu = lambda xs: torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32)  # noqa: E731
    meta = TreeAttentionMetadata(cu(q_lens), cu(k_lens), max(q_lens), max(k_lens),
                                 torch.tensor(sum(paths, []), dtype=torch.int64)).to(device)
    u = sum(q_lens)
    q, k, v = (torch.randn(u, h, dim, generator=gen).to(device) for h in (heads[0], heads[1], heads[1]))
    grad = torch.randn(u, heads[0], dim, generator=gen).to(device)
    results = []
    for be, dtype in ((backend, torch.bfloat16), (BACKENDS["reference"], torch.float32)):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = be.run(*xs, meta, dim**-0.5)
        out.backward(grad.to(dtype))
        results.append([out.detach().float()] + [x.grad.float() for x in xs])
    return max(float((a - b).norm() / b.norm()) for a, b in zip(*results))


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", _reference, needs_cuda=False),
    "varlen_emulated": _gather_backend("varlen_emulated", _emulated_kernel, repeat_kv=False, needs_cuda=False),
    "split_emulated": _split_backend("split_emulated", EmulatedLSEKernel(), needs_cuda=False),
    # The split plan as kernels without windows run it (each level's queries and keys gathered).
    "split_gathered_emulated": _split_backend("split_gathered_emulated", EmulatedLSEKernel(in_place=False),
                                              needs_cuda=False),
}
BACKENDS["split_or_gather_emulated"] = _per_row_backend(
    "split_or_gather_emulated", BACKENDS["split_emulated"], BACKENDS["varlen_emulated"])

TREE_PLANS = ("auto", "split", "gather")


def _check_plan(plan: str) -> None:
    if plan not in TREE_PLANS:
        raise ValueError(f"tree attention plan {plan!r}: expected one of {list(TREE_PLANS)}")


def select_backend(name: str = "auto", device: torch.device | str | None = None, kernel: str | None = None,
                   plan: str = "auto") -> Backend:
    """The backend to use: ``name``, or with ``"auto"`` the device's first fused kernel that passes a probe.

    ``plan``: ``split`` or ``gather`` for every row (a kernel that cannot run the plan is then unavailable), or
    ``auto``: per row, ``split`` where its paths are at least ``SPLIT_MIN_PATHS_PER_TOKEN`` times its length
    and the kernel has LSE entry points that pass the probe, else ``gather``.

    ``reference`` and ``varlen_emulated`` (the CPU test double of a fused kernel) are returned as
    they are. A fused kernel (``backends.FUSED_KERNELS``; ``kernel`` is the ``kernels``
    backend's Hub id or folder) is accepted only if, on a small tree with grouped-query heads and
    segments below ancestors, its output and gradients agree with ``reference`` (bf16 against fp32)
    to 2%; a kernel that fails with grouped K/V heads is retried with the K/V heads repeated. The
    order of ``auto`` per GPU type and the errors are ``backends.pick_backend``'s.
    """
    _check_plan(plan)
    if name in BACKENDS:
        return BACKENDS[name]
    device = torch.device(device) if device is not None else None
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    family = device_family(device)

    def attempt(kernel_name: str) -> Backend:
        failures: list[str] = []
        split = None
        if plan in ("auto", "split"):
            try:
                split = _split_backend(kernel_name + "+split", load_lse_kernel(kernel_name), True)
                err = _probe(split, device)
                if err >= 2e-2:
                    failures.append(f"{split.name}: probe error {err:.2e}")
                    split = None
            except Exception as exc:  # noqa: BLE001 - no LSE entry points, or a kernel refusing the probe
                failures.append(f"{kernel_name}+split: {short_reason(exc)}")
                split = None
            if plan == "split":
                if split is None:
                    raise BackendUnavailable("; ".join(failures))
                log.info("tree attention backend %s on a %s device", split.name, family)
                return split
            if split is None:
                log.info("tree attention: the split plan is unavailable (%s); every row gathers", "; ".join(failures))
        gather = attempt_gather(kernel_name, failures)
        if split is None:
            return gather
        return _per_row_backend(f"{gather.name}+split/gather", split, gather)

    def attempt_gather(kernel_name: str, failures: list[str]) -> Backend:
        varlen = load_kernel(kernel_name, family, kernel)
        for repeat_kv in (False, True):
            backend = _gather_backend(kernel_name + ("+repeat_kv" if repeat_kv else ""), varlen, repeat_kv, True)
            try:
                err = _probe(backend, device)
            except Exception as exc:  # noqa: BLE001 - a kernel that refuses the probe's shapes or device
                failures.append(f"{backend.name}: {short_reason(exc)}")
                continue
            if err < 2e-2:
                log.info("tree attention backend %s on a %s device (probe error %.2e)", backend.name, family, err)
                return backend
            failures.append(f"{backend.name}: probe error {err:.2e}")
        raise BackendUnavailable("; ".join(failures))

    choice = pick_backend(name, family, attempt)
    return choice.value if choice.value is not None else BACKENDS["reference"]


_active: Backend = BACKENDS["reference"]


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    tree_attention: TreeAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls: query ``[1, H, U, D]``, key/value ``[1, Hk, U, D]``."""
    if tree_attention is None:
        raise ValueError(
            f"attn_implementation={TREE_ATTENTION!r} needs the row's segments: call "
            "model(**packed_row.model_inputs()) (it passes tree_attention=...)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed row per forward (batch 1), got batch {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("tree attention takes no attention_mask: the row's segments are the mask")
    if sliding_window is not None and tree_attention.max_k > sliding_window:
        raise ValueError(f"sliding-window attention ({sliding_window}) is not supported by tree packing")
    if dropout:
        raise ValueError("tree attention does not implement attention dropout")
    backend = _active
    if backend.needs_cuda and not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"tree-attention backend {backend.name} needs CUDA bf16/fp16 inputs, got "
                         f"{query.device} {query.dtype}: register backend='reference' for this")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [U, heads, D]
    out = backend.run(q, k, v, tree_attention, scale)
    return out.unsqueeze(0), None


def register_tree_attention(backend: str = "auto", device: torch.device | str | None = None,
                            kernel: str | None = None, plan: str = "auto") -> str:
    """Register ``grpo_tree`` in transformers' attention interface; returns the backend's name.

    ``backend``, ``kernel`` and ``plan`` are ``select_backend``'s (``AsyncGRPOConfig.attention_backend``,
    ``attention_kernel`` and ``tree_attention_plan``)."""
    from transformers import AttentionInterface

    global _active
    _active = select_backend(backend, device, kernel, plan)
    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    return _active.name


def active_backend() -> str:
    return _active.name


class UnsupportedArchitectureError(ValueError):
    """The model has layers that tree packing cannot run exactly."""


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return module
    return None


SUPPORTED_LAYER_TYPES = ("full_attention", "linear_attention")  # linear = Gated DeltaNet, checked per layer


def check_supported_architecture(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedArchitectureError`` unless every decoder layer can run a packed row exactly.

    A layer may mix tokens through attention that calls transformers' attention interface, or
    through a transformers Gated DeltaNet (``linear_attention``) whose module functions
    ``grpo_core.models.attention.hybrid`` patches; plus an MLP (dense or mixture of experts) and norms.
    Any other token mixer (Mamba, sliding windows, other linear attentions) would read the previous
    *row* position instead of the token's parent in the trie, so it is refused, by name.

    M-RoPE (Qwen3.5, Qwen3-VL) is accepted: a text-only row gives all three position axes the
    token's depth, which is ordinary RoPE; images are refused before they become tokens
    (``grpo_core.models.vision.refuse_images``).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(model).__name__
    other = sorted({t for t in (getattr(text, "layer_types", None) or []) if t not in SUPPORTED_LAYER_TYPES})
    if other:
        raise UnsupportedArchitectureError(
            f"{name}: tree packing supports full-attention and Gated DeltaNet (linear_attention) layers, this "
            f"model also has {other} layers"
        )
    layers = _decoder_layers(model)
    if layers is None or len(layers) == 0:
        raise UnsupportedArchitectureError(f"{name}: no decoder `layers` list found; cannot check it for tree packing")
    for i, layer in enumerate(layers):
        mixers = 0
        for child_name, child in layer.named_children():
            if child_name == "self_attn":
                mixers += 1
                source = inspect.getsource(type(child).forward)
                if "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source:
                    raise UnsupportedArchitectureError(
                        f"{name}: layer {i} attention {type(child).__name__} does not call transformers' "
                        "attention interface, so tree attention cannot be plugged in"
                    )
            elif child_name == "linear_attn" and is_gated_delta_net(child):
                mixers += 1
            elif child_name != "mlp" and "norm" not in child_name.lower() and "dropout" not in child_name.lower():
                raise UnsupportedArchitectureError(
                    f"{name}: layer {i} has `{child_name}` ({type(child).__name__}); tree packing supports decoder "
                    "layers made of self-attention or a transformers Gated DeltaNet, an MLP and norms"
                )
        if mixers != 1:
            raise UnsupportedArchitectureError(
                f"{name}: layer {i} has {mixers} token mixers (`self_attn` / Gated DeltaNet `linear_attn`), expected one"
            )


def backend_for_precision(backend: str, device_type: str, compute_dtype: torch.dtype) -> str:
    """``backend`` as it can run at ``compute_dtype``: the fused kernels take bf16/fp16 only, so an fp32
    run on a GPU gets ``reference`` under ``auto``, and a fused kernel named for it is refused."""
    if device_type != "cuda" or compute_dtype in (torch.bfloat16, torch.float16) or backend == "reference":
        return backend
    if backend == "auto":
        log.info("tree attention: training in %s, which the fused kernels do not take; using 'reference'",
                 compute_dtype)
        return "reference"
    raise ValueError(
        f"AsyncGRPOConfig.attention_backend={backend!r} runs in bf16 or fp16 only, and this run trains in "
        f"{compute_dtype} (bf16=False): set bf16=True (or fp16=True), or attention_backend='auto' or 'reference'"
    )


def enable_tree_attention(model: torch.nn.Module, backend: str = "auto", linear_backend: str = "auto",
                          kernel: str | None = None, compute_dtype: torch.dtype | None = None,
                          kv_regather: str = "eager", plan: str = "auto") -> str:
    """Check the model, register ``grpo_tree``, patch its Gated DeltaNet layers and switch it over.

    ``backend`` picks the attention kernel (``select_backend``; ``kernel`` is the ``kernels`` backend's
    Hub id or folder; ``compute_dtype``, the training's, rules out fused kernels for fp32), ``linear_backend``
    the delta-rule kernel of GDN layers (``grpo_core.models.attention.gated_delta.select_gdn_backend``), ``kv_regather``
    whether the gather plan's backward gathers K/V again (``AsyncGRPOConfig.tree_kv_regather``), ``plan`` split or
    gather (``AsyncGRPOConfig.tree_attention_plan``). Returns the attention backend's name.
    """
    check_supported_architecture(model)
    device = next(model.parameters()).device
    if compute_dtype is not None:
        backend = backend_for_precision(backend, device.type, compute_dtype)
    name = register_tree_attention(backend, device, kernel, plan)
    if kv_regather not in ("eager", "always", "never"):
        raise ValueError(f"kv_regather={kv_regather!r}: expected 'eager', 'always' or 'never'")
    set_kv_regather(kv_regather != "never")  # AsyncGRPOConfig.tree_kv_regather
    set_kv_regather_compiled(kv_regather == "always")
    install_gated_delta(model, linear_backend)
    model.set_attn_implementation(TREE_ATTENTION)
    return name
