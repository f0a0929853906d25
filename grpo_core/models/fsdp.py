"""FSDP2 for the policy: one ``fully_shard`` unit per decoder layer plus the root, bf16 compute.

``shard_policy(model, settings, device)`` prepares a loaded policy for training on every rank:

* activation checkpointing (transformers' own, per decoder layer) when asked: parameter names stay
  the checkpoint's, so weight sync and checkpoints need no renaming;
* FSDP2 over a 1-D mesh of all ranks (every node): each decoder layer is one unit, gathered just
  before it runs and freed after (``reshard_after_forward``); the embeddings, final norm and LM head
  form the root unit, so tied embeddings stay one parameter;
* mixed precision when ``bf16``: parameters are gathered in bf16 for compute while the sharded
  master weights, the gradient reduction and the optimizer state stay fp32;
* optional CPU offload of the sharded parameters, gradients and optimizer state.

On one rank, the gradients of a step's micro-batches accumulate unsharded (in fp32, through the kernels of
``grpo_core.models.grad_accumulation``) and are reduced once, after the last, and the gathered weights may stay
from one micro-batch to the next (``before_micro_batch``, which the trainer's step calls before each micro-batch);
several ranks reduce and free after every micro-batch.

Gradients are reduced as a *sum* over ranks, not FSDP's default mean: the GRPO loss of every rank is
already divided by the trained tokens of the whole step (``grpo_core.training.loss.grpo_loss``), so the sum is
the step's gradient and a 2-rank step equals a 1-rank step on the same samples.

``iter_full_layers`` and ``full_state_dict`` gather sharded weights back one decoder layer at a
time, for checkpoints and benchmarks; weight sync does the same through vLLM's ``WeightSource``.
Run its tests: ``.venv/bin/python -m pytest tests/test_fsdp.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo_core.models import grad_accumulation
from grpo_core.models.vision import vision_towers


COMPILE_MODES = ("none", "pointwise", "layers")


@dataclass(frozen=True)
class FSDPSettings:
    """How the policy is sharded and run (built from ``AsyncGRPOConfig`` by ``from_config``)."""

    bf16: bool = False
    """bf16 parameters in forward/backward; fp32 master weights, gradient reduction and optimizer state."""
    fp16: bool = False
    """fp16 parameters in forward/backward (with the trainer's loss scaling); fp32 everywhere else."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward."""
    reshard_after_forward: bool = True
    """Free a layer's gathered parameters after its forward (gather again in backward)."""
    keep_weights_between_micro_batches: bool = False
    """One rank: keep the gathered parameters from a micro-batch's backward into the next one's forward, freed
    after the step's last backward (``before_micro_batch`` switches it per micro-batch; see
    ``AsyncGRPOConfig.fsdp_keep_weights_between_micro_batches``)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CUDA only)."""
    compile: str = "none"
    """``torch.compile`` per decoder layer: ``none``; ``pointwise`` (the MLP and the norms, so
    element-wise ops fuse while attention and its per-row metadata stay eager); ``layers`` (the
    whole layer, tree attention traced too)."""
    nested_graph_breaks: bool = field(default_factory=lambda: nested_graph_breaks_supported())
    """With ``compile="layers"``: resume tracing inside the function that calls a kernel from outside PyTorch, rather
    than end the graph where the layer's own code calls that function (``AsyncGRPOConfig.compile_graph_breaks``; the
    default is its ``auto``: on where this PyTorch has nested graph breaks)."""

    def __post_init__(self) -> None:
        if self.keep_weights_between_micro_batches and self.cpu_offload:
            raise ValueError("FSDPSettings.keep_weights_between_micro_batches=True with cpu_offload: the kept weights "
                             "would stay on the GPU; set one of them False")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"FSDPSettings.compile={self.compile!r}: use one of {COMPILE_MODES}")
        if self.nested_graph_breaks and not nested_graph_breaks_supported():
            raise ValueError(f"FSDPSettings.nested_graph_breaks=True: PyTorch {torch.__version__} has no nested graph "
                             "breaks (2.9 and later have them); leave it False")

    def keeps_weights(self, world_size: int) -> bool:
        """Whether a run on ``world_size`` ranks keeps gathered weights between micro-batches: asked for, and the
        policy goes through FSDP2 (``needs_fsdp``; one rank in fp32 has no gathered weights to keep)."""
        return self.keep_weights_between_micro_batches and needs_fsdp(self, world_size)

    @classmethod
    def from_config(cls, args, bf16: bool, device_type: str = "cpu", world_size: int = 1) -> FSDPSettings:
        """From an ``AsyncGRPOConfig``; ``bf16`` is its resolved value for this device, ``world_size`` the ranks."""
        return cls(
            bf16=bf16,
            fp16=args.fp16,
            activation_checkpointing=args.gradient_checkpointing,
            reshard_after_forward=args.fsdp_reshard_after_forward,
            keep_weights_between_micro_batches=resolve_keep_weights(
                args.fsdp_keep_weights_between_micro_batches, world_size, args.fsdp_cpu_offload),
            cpu_offload=args.fsdp_cpu_offload,
            compile=resolve_compile_mode(args.compile_mode, device_type),
            nested_graph_breaks=resolve_graph_breaks(args.compile_graph_breaks) == "nested",
        )


def resolve_compile_mode(mode: str, device_type: str) -> str:
    """``auto`` → ``layers`` on CUDA (fastest, and within eager bf16's error against fp32: benchmarks/README.md,
    "Compile numerics: the rule for the default"), ``none`` elsewhere (the CPU path stays eager); any other
    mode is kept as asked."""
    if mode == "auto":
        return "layers" if device_type == "cuda" else "none"
    return mode


def resolve_keep_weights(setting: bool | str, world_size: int, cpu_offload: bool) -> bool:
    """``AsyncGRPOConfig.fsdp_keep_weights_between_micro_batches``: ``auto`` → on with one rank and no CPU offload;
    ``True`` on several ranks is refused, naming the field (every rank would hold the whole model)."""
    if setting == "auto":
        return world_size == 1 and not cpu_offload
    if setting and world_size > 1:
        raise ValueError(f"fsdp_keep_weights_between_micro_batches=True on {world_size} ranks: every rank would hold "
                         "the whole model's weights between micro-batches; leave it 'auto' (on for one rank only) "
                         "or set it False")
    return bool(setting)


def nested_graph_breaks_supported() -> bool:
    """Whether this PyTorch's compiler can resume tracing inside a called function at a graph break."""
    import torch._dynamo

    return hasattr(torch._dynamo.config, "nested_graph_breaks")


def resolve_graph_breaks(mode: str) -> str:
    """``AsyncGRPOConfig.compile_graph_breaks``: ``auto`` → ``nested`` where this PyTorch has nested graph breaks, else
    ``outer``; ``nested`` where it has none is refused, naming the field."""
    if mode == "auto":
        return "nested" if nested_graph_breaks_supported() else "outer"
    if mode == "nested" and not nested_graph_breaks_supported():
        raise ValueError(f"compile_graph_breaks='nested': PyTorch {torch.__version__} has no nested graph breaks (2.9 "
                         "and later have them); set compile_graph_breaks='outer' or 'auto', or upgrade torch")
    return mode


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (the first ``ModuleList`` named ``layers`` or ``h``)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("layers", "h") and isinstance(module, torch.nn.ModuleList) and len(module):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder layer list (`layers` or `h`) to shard per layer")


def needs_fsdp(settings: FSDPSettings, world_size: int) -> bool:
    """Several ranks shard; one rank still goes through FSDP2 when bf16 mixed precision is asked."""
    return world_size > 1 or settings.bf16 or settings.fp16 or settings.cpu_offload


def shard_policy(model: torch.nn.Module, settings: FSDPSettings, device: torch.device) -> torch.nn.Module:
    """Apply activation checkpointing and (where ``needs_fsdp``) FSDP2 in place; returns ``model``.

    Needs the default process group when FSDP2 applies (``grpo_core.ranks.init_distributed``).
    Call before the optimizer is built: FSDP2 replaces the parameters with sharded DTensors.
    """
    if settings.compile != "none":
        compile_layers(model, pointwise_only=settings.compile == "pointwise",
                       nested_graph_breaks=settings.nested_graph_breaks)
    if settings.activation_checkpointing:
        # Non-reentrant: the tree-attention metadata passes through as a keyword argument, and
        # FSDP2 re-gathers a layer's weights in its pre-backward hook, before the recompute.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if not needs_fsdp(settings, world_size):
        return model
    if device.type != "cuda" and (settings.bf16 or settings.cpu_offload):
        raise ValueError(
            "bf16 mixed precision and fsdp_cpu_offload run on CUDA devices; on CPU train in fp32 "
            "(bf16=False, fsdp_cpu_offload=False)"
        )
    if not dist.is_initialized():
        raise RuntimeError("FSDP2 needs the default process group: call grpo_core.ranks.init_distributed first")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    compute_dtype = torch.bfloat16 if settings.bf16 else torch.float16 if settings.fp16 else None
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's weights are needed first in backward: keeping them avoids one gather.
        reshard = settings.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    for _, tower in vision_towers(model):
        # A frozen vision tower never runs on text-only rows: as a unit of its own it stays sharded
        # and is never gathered, where inside the root unit it would be gathered every forward.
        fully_shard(tower, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=settings.reshard_after_forward)
    if world_size == 1 and compute_dtype is not None:
        # One rank accumulates a step's gradients unsharded in fp32 (before_micro_batch): the widening cast and
        # the mixed-dtype add run as Triton kernels where they can.
        grad_accumulation.install(model)
    for module in model.modules():
        if isinstance(module, FSDPModule) and world_size > 1:
            # A plain SUM over ranks (see the module docstring); forcing SUM also keeps gloo, which
            # has no pre-multiplied sum, working on CPU. One rank needs neither: its mean is the sum, and FSDP2
            # divides a single rank's whole fp32 gradient by any factor that is set, 1.0 included.
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # not in every torch >= 2.6
                module.set_force_sum_reduction_for_comms(True)
    return model


def compile_layers(model: torch.nn.Module, pointwise_only: bool, nested_graph_breaks: bool = False) -> None:
    """Compile, in place, every decoder layer, or only its MLP and norms (see ``FSDPSettings``).

    The row length changes every micro-batch, so shapes are dynamic from the start; layers of one
    class share their compiled graphs. Done before sharding, so FSDP2's hooks stay outside.
    ``nested_graph_breaks`` (whole layers only): see ``FSDPSettings.nested_graph_breaks``.
    """
    for layer in decoder_layers(model):
        if not pointwise_only:
            layer.compile(dynamic=True)
            if nested_graph_breaks:
                # ``Module.compile`` keeps the compiled call in ``_compiled_call_impl``; ``tests/test_compiled_layers.py``
                # fails if that ever stops working.
                layer._compiled_call_impl = with_nested_graph_breaks(layer._compiled_call_impl)
            continue
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "mlp" or (leaf.endswith("norm") and not list(module.children())):
                module.compile(dynamic=True)


NESTED_BREAKS_NOTE = ("this compiled layer ran with nested graph breaks (AsyncGRPOConfig.compile_graph_breaks, 'auto' "
                      "turns them on where PyTorch has them); if the run works with compile_graph_breaks='outer', they "
                      "are the cause")


def with_nested_graph_breaks(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a ``torch.compile``d callable) traced with nested graph breaks. The setting is read while the
    compiler traces, which happens inside the call, so it is set for these calls alone, not for the process. An error
    of the compiler's own is raised as it is, with a note that names the setting and the way to rule it out."""
    import torch._dynamo
    from torch._dynamo.exc import TorchDynamoException

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            # a patch made per call: one object entered again before it exits (a re-entrant call) fails in some
            # PyTorch versions
            with torch._dynamo.config.patch(nested_graph_breaks=True):
                return compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            exc.add_note(NESTED_BREAKS_NOTE)
            raise

    return call


def before_micro_batch(model: torch.nn.Module, last_micro_batch: bool, keep_weights: bool = False) -> None:
    """Call before each micro-batch of a step, on one rank (on several ranks it does nothing):

    * gradients: FSDP2 reduces them into the sharded fp32 ones only after the step's last micro-batch, and the
      backwards before it accumulate the unsharded gradients (FSDP2 accumulates those in its reduce dtype, fp32).
      One rank's unsharded gradients take the memory its sharded ones would, so this drops a copy of every
      gradient (the single-rank reduce) per micro-batch at no cost;
    * weights, with ``keep_weights`` (``FSDPSettings.keep_weights_between_micro_batches``): the gathered compute
      weights stay from this micro-batch's backward into the next one's forward, which then needs no gather, and
      are freed after the last backward, before the optimizer changes the master weights they were cast from.

    On several ranks every micro-batch is still reduced and every layer freed after its backward: either would
    hold the whole model's gradients or weights on every rank. Without FSDP2 (one rank in fp32) there is nothing
    to do."""
    if not hasattr(model, "set_requires_gradient_sync") or (dist.is_initialized() and dist.get_world_size() > 1):
        return
    model.set_requires_gradient_sync(last_micro_batch)
    if keep_weights:
        model.set_reshard_after_backward(last_micro_batch)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of a forward that no backward follows. FSDP2 keeps the root module's
    parameters gathered after its forward (a backward usually needs them at once); outside training that
    would leave the whole root unsharded, in full size, until the next step."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors (sharded parameters, a global grad norm) are gathered first."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names in runs of one decoder layer each (by the first ``.<index>.`` in the name), in order.

    Names without an index (embeddings, final norm, head) form their own runs where they appear.
    """
    groups: list[list[str]] = []
    last_key: object = None
    for name in names:
        match = _LAYER_INDEX.search(name)
        key = (name[: match.start()], match.group(1)) if match else "unindexed"
        if not groups or key != last_key:
            groups.append([])
        groups[-1].append(name)
        last_key = key
    return groups


def iter_full_layers(
    model: torch.nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full (gathered) parameters one decoder layer at a time, under their module names.

    A collective on every rank (all ranks must iterate to the end, in step); the previous layer's
    tensors are dropped by the caller before the next gather, so at most one layer is ever full.
    Tied parameters appear once (``named_parameters`` deduplicates). ``device="cpu"`` moves each
    layer to host memory as it is gathered.
    """
    params = dict(model.named_parameters())
    for names in layer_groups(list(params)):
        group = []
        for name in names:
            full = full_value(params[name].detach())
            if dtype is not None:
                full = full.to(dtype)
            if device is not None:
                full = full.to(device)
            group.append((name, full))
        yield group


def full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Every parameter gathered into host memory on rank 0 (None on the other ranks).

    For checkpoints: call on every rank. Gathers a layer at a time, so device memory holds at most
    one full layer beyond the shards; host memory of rank 0 receives the whole model.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for group in iter_full_layers(model, dtype=dtype):
        if out is not None:
            out.update({name: t.cpu() for name, t in group})
    return out
