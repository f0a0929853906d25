"""Tree attention's gather plan: K/V copied along every root-to-segment path, one causal varlen call.

Segment ``g`` of a row owns the queries ``cu_seq_q[g]:cu_seq_q[g+1]`` and attends to the keys of its
root-to-segment path, ``kv_index[cu_seq_k[g]:cu_seq_k[g+1]]``; the path ends with the segment itself, so a
causal mask aligned bottom-right shows each query its ancestors and its own causal past. The copy is as
long as all paths together (a prompt shared by 16 completions is in it 16 times); its gradient copies are
summed in fp32 (``gather_rows``). Backward can gather it again instead of keeping it (``set_kv_regather``).
The other plan, which copies nothing, is ``grpo_core.models.attention.split``; ``tree`` picks per row.

Also here: ``varlen_emulated``'s kernel (``_emulated_kernel``), a fused varlen kernel in plain PyTorch for
the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from grpo_core.models.attention.metadata import TreeAttentionMetadata


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _emulated_attention(q, k, v, cu_q, cu_k, scale) -> torch.Tensor:
    """What a fused varlen kernel computes, one sequence at a time, in plain PyTorch."""
    heads, outs = q.shape[1], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for g in range(len(cq) - 1):
        qq, kk, vv = q[cq[g] : cq[g + 1]], k[ck[g] : ck[g + 1]], v[ck[g] : ck[g + 1]]
        ql, kl = qq.shape[0], kk.shape[0]
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
        o = F.scaled_dot_product_attention(
            qq.transpose(0, 1), _repeat_kv(kk, heads).transpose(0, 1), _repeat_kv(vv, heads).transpose(0, 1),
            attn_mask=mask, scale=scale,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class _EmulatedVarlen(torch.autograd.Function):
    """A fused varlen kernel as autograd sees one: a single node that saves its q/k/v inputs whole.

    Traced op by op, the loop above would save per-segment copies of the K/V heads instead, and the
    CPU tests could not see what the gather path's saved-tensor hooks (``_KVRegather``) meet on a GPU.
    Backward recomputes the loop with autograd on; the arithmetic is the loop's own.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.scale = scale
        return _emulated_attention(q, k, v, cu_q, cu_k, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        with torch.enable_grad():
            xs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _emulated_attention(*xs, cu_q, cu_k, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, xs, grad)
        return dq, dk, dv, None, None, None


def _emulated_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> torch.Tensor:
    """The ``varlen_emulated`` backend's kernel (CPU tests)."""
    return _EmulatedVarlen.apply(q, k, v, cu_q, cu_k, scale)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward sums the copies of a shared row in fp32 (or wider).

    A prompt shared by 16 samples gets 16 gradient contributions for its K/V; adding them in bf16
    (what the stock backward does) would round 15 times more than training without packing.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.dtype = x.shape[0], x.dtype
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)  # fp64 stays fp64 (the exactness tests run in it)
        acc = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=wide)
        acc.index_add_(0, index, grad.to(wide))
        return acc.to(ctx.dtype), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)``; the gradient of a row gathered several times is summed in fp32 (fp64 for fp64)."""
    return _GatherRows.apply(x, index)


# ---- re-gathering K/V in backward -------------------------------------------------------------------
#
# A fused kernel saves the K/V it was given for its backward. On a tree row that is the gathered K/V,
# one copy of a prompt's keys per path through it (K rows, several times the row's U at high packing
# ratios), kept for every layer until its backward. Saved-tensor hooks around the kernel call keep,
# in its place, the row's own K/V (U rows) and the paths, and gather again when backward asks for it:
# the copy is exact (index_select), so outputs and gradients are bitwise those of the saving path.

_kv_regather = True


def set_kv_regather(enabled: bool) -> bool:
    """Re-gather tree rows' K/V in backward (``True``, the default) or save the gathered copy; returns the
    previous setting. Both give bitwise-identical results; re-gathering lowers a tree row's peak memory for a
    small share of the step (benchmarks/README.md, "Re-gathering K/V in backward"; ``benchmarks/packing/tree_packing.py
    --kv-regather off,on``). Compiled layers: ``set_kv_regather_compiled``."""
    global _kv_regather
    previous, _kv_regather = _kv_regather, bool(enabled)
    return previous


def kv_regather_enabled() -> bool:
    return _kv_regather


_kv_regather_compiled = False


def set_kv_regather_compiled(enabled: bool) -> bool:
    """With ``set_kv_regather`` on, also re-gather where decoder layers are compiled (``compile_mode=
    "layers"``); returns the previous setting. Off by default, for its cost in speed.

    Saved-tensor hooks are not traced, and the compiled graph's partitioner keeps the gathered K/V by
    itself (putting the gather in a checkpoint region did not change that with inductor and
    ``torch_varlen`` on an H200), so this breaks the graph around a tree row's attention and runs it
    eagerly, under the hooks: less memory for a few percent of the step (benchmarks/README.md, "Re-gathering K/V
    in backward")."""
    global _kv_regather_compiled
    previous, _kv_regather_compiled = _kv_regather_compiled, bool(enabled)
    return previous


def _outer_saved_tensor_hooks() -> tuple[Callable, Callable] | None | bool:
    """The saved-tensor hooks in force around this call (activation checkpointing, ``save_on_cpu``, a
    test's counter), None if there are none, False if they cannot be read or pushed here."""
    autograd_c = torch._C._autograd
    top = getattr(autograd_c, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(autograd_c, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None or not enabled():
        return False  # a PyTorch without these (private) entry points, or hooks disabled by a transform
    return top(True)  # True: the hooks themselves, even while a compiler traces (excluded earlier anyway)


@dataclass(frozen=True)
class _Kept:
    """A saved tensor as the outer hooks (or none: the tensor itself, detached) keep it."""

    packed: object


@dataclass(frozen=True)
class _Recipe:
    """A saved tensor that is (a view of) a gathered K/V: how to build it again."""

    source: _Kept  # the row's own K or V, [U, Hk, D]
    index: _Kept  # the paths, int64 [K]
    repeat: int  # K/V heads repeated for the kernel (1: not)
    view: tuple[torch.Size, tuple[int, ...], int] | None  # (size, stride, offset) when a view was saved


class _KVRegather:
    """Pack/unpack hooks for one kernel call: the gathered K/V (and views of it) become ``_Recipe``s,
    everything else goes to the outer hooks as it would have without these.

    Passing the row's own K/V and the index through the outer hooks keeps them composable: under
    activation checkpointing they are recomputed like any saved tensor, under ``save_on_cpu`` offloaded.
    """

    def __init__(self, outer: tuple[Callable, Callable] | None, index: torch.Tensor,
                 gathered: list[tuple[torch.Tensor, torch.Tensor]], repeat: int):
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)
        self.index = index
        self.repeat = repeat
        # (tensor given to the kernel, its source), only while the kernel runs: the unpack hook lives
        # in the graph until backward, and must not keep the gathered tensors alive through ``self``.
        self.gathered = gathered

    def close(self) -> None:
        self.gathered = []

    def keep(self, t: torch.Tensor) -> _Kept:
        # detach: a hook's package must not hold the tensor's autograd node (a reference cycle when
        # the saved tensor is the kernel's own output); autograd restores it on unpack.
        return _Kept(self.outer_pack(t) if self.outer_pack is not None else t.detach())

    def restore(self, kept: _Kept) -> torch.Tensor:
        return self.outer_unpack(kept.packed) if self.outer_unpack is not None else kept.packed

    def pack(self, t: torch.Tensor) -> _Kept | _Recipe:
        for given, source in self.gathered:
            if _shares_storage(t, given):
                geometry = (t.size(), t.stride(), t.storage_offset())
                view = None if geometry == (given.size(), given.stride(), 0) else geometry
                return _Recipe(self.keep(source), self.keep(self.index), self.repeat, view)
        return self.keep(t)

    def unpack(self, packed: _Kept | _Recipe) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return self.restore(packed)
        x = _gather_for_kernel(self.restore(packed.source), self.restore(packed.index), packed.repeat)
        return x if packed.view is None else x.as_strided(*packed.view)


def _shares_storage(t: torch.Tensor, base: torch.Tensor) -> bool:
    return (t.device == base.device and t.dtype == base.dtype
            and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())


def _gather_for_kernel(source: torch.Tensor, index: torch.Tensor | None, repeat: int,
                       differentiable: bool = False) -> torch.Tensor:
    """K or V as the kernel takes it: gathered along the paths, heads repeated ``repeat`` times, contiguous.

    ``differentiable``: through ``_GatherRows`` (the forward; its backward sums a shared row's copies
    in fp32); else a plain ``index_select`` (the re-gather in backward, whose result is only read).
    """
    x = source
    if index is not None:
        x = _GatherRows.apply(x, index) if differentiable else x.index_select(0, index)
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=1)
    return x.contiguous()


def _regather_hooks(k: torch.Tensor, v: torch.Tensor, k_given: torch.Tensor, v_given: torch.Tensor,
                    index: torch.Tensor, repeat: int) -> _KVRegather | None:
    """Hooks that keep ``k_given``/``v_given`` (built from ``k``/``v``) out of the kernel's saved tensors,
    or None where they cannot apply and the kernel saves them as it would."""
    if not (_kv_regather and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
        return None  # switched off, or nothing will be saved
    if torch.compiler.is_compiling():
        return None  # hooks are not traced: compiled code saves what its partitioner picks
    outer = _outer_saved_tensor_hooks()
    if outer is False:
        return None
    for given in (k_given, v_given):
        # The rebuilt tensor must have the layout of the one saved, views of it included.
        if given.storage_offset() != 0 or given.untyped_storage().nbytes() != given.numel() * given.element_size():
            return None
    return _KVRegather(outer, index, [(k_given, k), (v_given, v)], repeat)


def gather_plan(kernel: Callable[..., torch.Tensor], repeat_kv: bool) -> Callable[..., torch.Tensor]:
    """The gather plan's ``run(q, k, v, meta, scale)`` on varlen ``kernel`` (``repeat_kv``: K/V heads repeated
    for a kernel without grouped-query heads)."""
    def run(q, k, v, meta: TreeAttentionMetadata, scale: float) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1] if repeat_kv else 1
        # K/V along every root-to-segment path, one copy per path (a flat row has nothing to gather)
        k_given, v_given = (_gather_for_kernel(x, meta.kv_index, repeat, differentiable=True) for x in (k, v))
        q = q.contiguous()
        args = (meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale)
        hooks = None if meta.kv_index is None else _regather_hooks(k, v, k_given, v_given, meta.kv_index, repeat)
        if hooks is None:
            return kernel(q, k_given, v_given, *args)
        try:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                return kernel(q, k_given, v_given, *args)
        finally:
            hooks.close()

    eager_run = torch.compiler.disable(run, recursive=True)

    def run_or_break_graph(q, k, v, meta: TreeAttentionMetadata, scale: float) -> torch.Tensor:
        if (_kv_regather and _kv_regather_compiled and meta.kv_index is not None and torch.compiler.is_compiling()
                and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
            return eager_run(q, k, v, meta, scale)  # see set_kv_regather_compiled
        return run(q, k, v, meta, scale)

    return run_or_break_graph
