"""Which varlen attention kernel runs tree attention on this device, and how each one is loaded.

Tree attention (``grpo_core.models.attention.tree``) gathers every segment's root-to-segment keys
and hands the row to one *varlen* kernel: per sequence, causal attention aligned bottom-right
(query ``i`` of ``q`` sees key ``j`` of ``k`` iff ``j <= i + k - q``). Every kernel below is
called that way and nothing else, so the tree mask is the same on all of them; a start-up probe on
a small tree (``tree._probe``) checks it before a kernel is accepted.

Kernels, by the name ``AsyncGRPOConfig.attention_backend`` uses:

- ``kernels``: a FlashAttention build loaded through Hugging Face's ``kernels`` package (the
  ``kernels`` extra), from the Hub (``owner/name@<version or revision>``) or a local kernel folder,
  given by ``attention_kernel``, else the device's default in ``DEFAULT_HUB_KERNELS``;
- ``flash_attn_cute``: FlashAttention-4 (``pip install flash-attn-4``: CuTe DSL, compiled at first
  use), ``flash_attn.cute.flash_attn_varlen_func``; Hopper and Blackwell;
- ``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside
  PyTorch; no extra package);
- ``aten_flash``: the same kernel through ``torch.ops.aten._flash_attention_forward`` (older PyTorch);
- ``reference``: dense PyTorch attention with the tree mask; any device, memory grows with ``U**2``.

``auto`` tries ``BACKEND_ORDER[device_family(device)]`` in order and takes the first kernel that
loads and passes the probe, else ``reference``. The order is written once, here, per GPU type.
``pick_backend`` is that walk, pure (the loading and probing come in as a function), so its
choices are unit-tested on a CPU: ``.venv/bin/python -m pytest tests/test_attention_backends.py``.
"""

from __future__ import annotations

import inspect
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from grpo_core.config import AttentionBackendName
from grpo_core.config_checks import KernelRef, parse_kernel_ref

log = logging.getLogger(__name__)

FUSED_KERNELS = tuple(n for n in typing.get_args(AttentionBackendName) if n not in ("auto", "reference"))
"""Backends that run a varlen kernel on gathered K/V (CUDA, bf16/fp16), in the config's order."""

DeviceFamily = Literal["cpu", "older_cuda", "ampere", "hopper", "blackwell", "rocm"]

BACKEND_ORDER: dict[DeviceFamily, tuple[str, ...]] = {
    # Hopper and Blackwell: a Hub FlashAttention build (FA3 on Hopper), else pip FlashAttention-4,
    # else PyTorch's FlashAttention-2, which runs on both but without their tensor-core paths.
    "hopper": ("kernels", "flash_attn_cute", "torch_varlen", "aten_flash"),
    "blackwell": ("kernels", "flash_attn_cute", "torch_varlen", "aten_flash"),
    # Ampere and Ada (sm80-89): FlashAttention-4 has no varlen backward there.
    "ampere": ("kernels", "torch_varlen", "aten_flash"),
    # ROCm: aiter through kernels, else PyTorch's own flash attention where the build has it.
    "rocm": ("kernels", "torch_varlen", "aten_flash"),
    # Before sm80 no FlashAttention runs; the probes say so and the reference takes over.
    "older_cuda": ("torch_varlen", "aten_flash"),
    "cpu": (),
}
"""``auto``'s order of fused kernels per GPU type; ``reference`` closes every list."""

DEFAULT_HUB_KERNELS: dict[DeviceFamily, str] = {
    "hopper": "kernels-community/flash-attn3@1",
    "rocm": "kernels-community/aiter-flash-attn@2",
}
"""The ``kernels`` backend's kernel where ``attention_kernel`` is None (fetched into the Hugging
Face cache on first use; ``HF_HUB_OFFLINE=1`` takes cached ones only). Other GPU types have none."""

INSTALL_HINTS: dict[str, str] = {
    "kernels": "pip install 'grpo-core[kernels]' and set attention_kernel to a Hub kernel "
    "('kernels-community/flash-attn3@1') or a local kernel folder ('/path/to/flash-attn3')",
    "flash_attn_cute": "pip install flash-attn-4 (FlashAttention-4 for Hopper and Blackwell GPUs)",
    "torch_varlen": "use a CUDA build of PyTorch that has torch.nn.attention.varlen.varlen_attn",
    "aten_flash": "use a CUDA build of PyTorch with FlashAttention (torch.ops.aten._flash_attention_forward)",
}

# A varlen kernel: (q [Tq, H, D], k [Tk, Hk, D], v, cu_q, cu_k, max_q, max_k, scale) -> [Tq, H, D],
# causal aligned bottom-right within each sequence.
VarlenKernel = Callable[..., torch.Tensor]


class BackendUnavailable(Exception):
    """A backend cannot run here; the message says why (not installed, no kernel for this GPU, probe)."""


class AttentionBackendError(ValueError):
    """An attention backend that the config asks for by name cannot run here."""


def short_reason(exc: BaseException) -> str:
    """An exception in one line (PyTorch's dispatcher errors run to pages)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:240]}"


# ---- device families --------------------------------------------------------------------------------
def family_of(capability: tuple[int, int] | None, rocm: bool = False) -> DeviceFamily:
    """The GPU type of a CUDA compute capability (None: not a GPU)."""
    if capability is None:
        return "cpu"
    if rocm:
        return "rocm"
    major = capability[0]
    if major >= 10:
        return "blackwell"  # sm100/sm103 data-centre parts, sm120 workstation parts
    if major == 9:
        return "hopper"
    if major == 8:
        return "ampere"
    return "older_cuda"


def device_family(device: torch.device) -> DeviceFamily:
    if device.type != "cuda":
        return "cpu"
    return family_of(torch.cuda.get_device_capability(device), rocm=torch.version.hip is not None)


# ---- the choice -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """The backend picked, what ``attempt`` returned for it, and why each earlier one was passed over."""

    name: str
    value: object
    skipped: tuple[str, ...]


def backend_order(requested: str, family: DeviceFamily) -> tuple[str, ...]:
    """The backends to try for ``requested``: ``auto`` follows ``BACKEND_ORDER``; a name is tried alone."""
    if requested == "auto":
        return BACKEND_ORDER[family]
    if requested not in (*FUSED_KERNELS, "reference"):
        raise AttentionBackendError(
            f"unknown attention backend {requested!r}; use one of {['auto', *FUSED_KERNELS, 'reference']}"
        )
    return (requested,)


def pick_backend(requested: str, family: DeviceFamily, attempt: Callable[[str], object]) -> Choice:
    """Walk ``backend_order(requested, family)``; the first ``attempt(name)`` that returns wins.

    ``attempt`` loads and checks one backend and raises ``BackendUnavailable`` when it cannot run
    here. Under ``auto`` each such backend is skipped with its reason logged, and ``reference``
    closes the list; a backend asked for by name that cannot run is an ``AttentionBackendError``
    that names the config field and the fix. ``reference`` itself is never attempted: it runs anywhere.
    """
    skipped: list[str] = []
    for name in backend_order(requested, family):
        if name == "reference":
            break
        try:
            value = attempt(name)
        except BackendUnavailable as exc:
            skipped.append(f"{name}: {exc}")
            log.info("tree attention: %s skipped (%s)", name, exc)
            continue
        return Choice(name, value, tuple(skipped))
    if requested not in ("auto", "reference"):
        raise AttentionBackendError(
            f"AsyncGRPOConfig.attention_backend={requested!r} cannot run on this device ({family}): "
            f"{skipped[-1].split(': ', 1)[1]}. Fix: {INSTALL_HINTS[requested]}; or set attention_backend='auto'"
        )
    if family != "cpu" and requested == "auto":
        log.warning("tree attention: no fused varlen kernel runs on this %s GPU (%s); using the dense "
                    "reference, whose memory grows with the square of the row", family, "; ".join(skipped))
    return Choice("reference", None, tuple(skipped))


# ---- loaders ----------------------------------------------------------------------------------------
def _opaque_to_compile(kernel: VarlenKernel) -> VarlenKernel:
    # Kernels from outside PyTorch launch through their own autograd Functions and JIT launchers,
    # which torch.compile cannot trace; a graph break around the call keeps compile_mode="layers"
    # working (the rest of each layer stays compiled).
    return torch.compiler.disable(kernel, recursive=True)


def load_torch_varlen() -> VarlenKernel:
    from torch.nn.attention.varlen import varlen_attn  # ImportError where PyTorch has none

    params = inspect.signature(varlen_attn).parameters

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        kwargs = {}
        # Newer PyTorch spells causal as window_size=(-1, 0); older ones as is_causal=True.
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        if "scale" in params:
            kwargs["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            q = q * (scale * q.shape[-1] ** 0.5)
        if "enable_gqa" in params and k.shape[1] != q.shape[1]:
            kwargs["enable_gqa"] = True
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return kernel


def load_aten_flash() -> VarlenKernel:
    op = torch.ops.aten._flash_attention_forward

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]

    return kernel


def load_flash_attn_cute() -> VarlenKernel:
    from flash_attn.cute import flash_attn_varlen_func  # the flash-attn-4 package

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # Grouped K/V heads are native (no repeat); causal is bottom-right for seqlen_k > seqlen_q.
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                     max_seqlen_k=max_k, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, lse)

    return _opaque_to_compile(kernel)


def load_hub_kernel(ref: KernelRef) -> VarlenKernel:
    import kernels  # the optional `kernels` extra

    if ref.path is not None:
        folder = Path(ref.path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"no kernel folder at {folder}")
        module = kernels.get_local_kernel(folder)
    else:
        module = kernels.get_kernel(ref.repo_id, version=ref.version, revision=ref.revision)
    fn = module.flash_attn_varlen_func

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out  # FA3 builds return (out, lse)

    return _opaque_to_compile(kernel)


# ---- kernels with their log-sum-exp (the split plan, ``grpo_core.models.attention.split``) ----------------
class AtenFlashLSE:
    """PyTorch's FlashAttention-2 through its aten entry points, which return the LSE (forward) and take
    output and LSE (backward): ``torch_varlen`` and ``aten_flash`` run this kernel."""

    name = "aten_flash"
    in_place = False  # no per-sequence used lengths: the split plan gathers each level's queries and keys

    def __init__(self) -> None:
        self._fwd = torch.ops.aten._flash_attention_forward
        self._bwd = torch.ops.aten._flash_attention_backward

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        _no_windows(used_q, used_k)
        out, lse = self._fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[:2]
        if lse.dim() != 2 or lse.shape[1] != q.shape[0]:
            raise BackendUnavailable(f"this PyTorch's varlen FlashAttention returns its LSE as {tuple(lse.shape)}, "
                                     f"not [heads, tokens] = [{q.shape[1]}, {q.shape[0]}]")
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        _no_windows(used_q, used_k)
        # No dropout: the random-number state the backward takes is not read.
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, dtype=torch.uint64, device=q.device)
        return self._bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)


def _no_windows(used_q, used_k) -> None:
    if used_q is not None or used_k is not None:
        raise TypeError("PyTorch's varlen FlashAttention takes no used lengths (in_place=False)")


class FlashAttnCuteLSE:
    """FlashAttention-4's forward (``return_lse=True``) and backward entry points. Its ``seqused_q/k`` make a
    sequence a window of the tensors, so the split plan's level calls read the row in place."""

    name = "flash_attn_cute"
    in_place = True

    def __init__(self) -> None:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # the flash-attn-4 package

        self._fwd, self._bwd = _flash_attn_fwd, _flash_attn_bwd

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        out, lse = self._fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                             max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=causal,
                             return_lse=True)[:2]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, used_q=None, used_k=None):
        return tuple(self._bwd(q, k, v, out, dout, lse, scale, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               seqused_q=used_q, seqused_k=used_k, max_seqlen_q=max_q, max_seqlen_k=max_k)[:3])


LSE_KERNELS: dict[str, Callable[[], object]] = {
    "torch_varlen": AtenFlashLSE, "aten_flash": AtenFlashLSE, "flash_attn_cute": FlashAttnCuteLSE,
}
"""Backends whose kernel has LSE entry points, hence the split plan; ``kernels`` builds do not expose them."""


def load_lse_kernel(name: str):
    """The LSE entry points of backend ``name``; ``BackendUnavailable`` where it has none or they do not load."""
    if name not in LSE_KERNELS:
        raise BackendUnavailable(f"{name} exposes no forward-with-LSE / backward-from-LSE entry points")
    try:
        return LSE_KERNELS[name]()
    except Exception as exc:  # noqa: BLE001 - not installed, or an op missing from this build
        raise BackendUnavailable(short_reason(exc)) from exc


def kernel_spec_for(family: DeviceFamily, attention_kernel: str | None) -> str:
    """What the ``kernels`` backend loads: ``attention_kernel``, else the device's default Hub kernel."""
    if attention_kernel is not None:
        return attention_kernel
    if family not in DEFAULT_HUB_KERNELS:
        raise BackendUnavailable(f"no default kernel for a {family} device; set attention_kernel")
    return DEFAULT_HUB_KERNELS[family]


def load_kernel(name: str, family: DeviceFamily, attention_kernel: str | None = None) -> VarlenKernel:
    """Load fused kernel ``name``; ``BackendUnavailable`` says why it cannot be loaded here."""
    try:
        if name == "kernels":
            return load_hub_kernel(parse_kernel_ref(kernel_spec_for(family, attention_kernel)))
        loaders = {"flash_attn_cute": load_flash_attn_cute, "torch_varlen": load_torch_varlen,
                   "aten_flash": load_aten_flash}
        return loaders[name]()
    except BackendUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - not installed, no build for this torch, no network: not available
        raise BackendUnavailable(short_reason(exc)) from exc
