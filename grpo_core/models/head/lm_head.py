"""The model's LM head as the log-prob head: which head, how wide, and computing log-probs in its place.

``output_head`` finds the head (refusing models that change logits after it), ``vocab_size`` the width
of its logits, and ``head_computes_logprobs`` makes the head, for the length of one forward, hand back
log-probs of the hidden states it is given instead of projecting them: the chunked path of
``grpo_core.training.forward.row_logprobs``, where no ``[T, V]`` tensor may exist.

Why inside the forward, through hooks on the head: under FSDP2 the head's weight is gathered only
while the root unit (embeddings, final norm, head) runs, and is freed after it; its backward gathers
it again when the gradient reaches the root unit's output. Computed there and returned as that
output, the chunks use the gathered weight in forward and find it gathered again when backward
recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

LOGIT_RESCALING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose forward changes the logits after the head (Gemma 2/3, Cohere, Granite):
the chunked head projects hidden states itself and would miss that step."""


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's LM head; refused for ``logprob_chunk_size`` where the model is not head-then-logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size needs a linear LM head; {name}'s output embeddings are "
                         f"{type(head).__name__}: set logprob_chunk_size=None")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rescaled = [f for f in LOGIT_RESCALING if getattr(text, f, None) not in (None, 1, 1.0)]
    if rescaled:
        raise ValueError(f"AsyncGRPOConfig.logprob_chunk_size: {name} rescales its logits after the head "
                         f"(config.{rescaled[0]}), which the chunked head does not: set logprob_chunk_size=None")
    return head


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the model's logits: its head's outputs (the config's vocab_size can differ), else the config's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        return int(head.out_features)
    config = model.config
    return int((config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size)


@contextmanager
def head_computes_logprobs(head: torch.nn.Linear, logprobs_of: Callable[[Tensor, Tensor, Tensor | None], Tensor]
                            ) -> Iterator[list[Tensor]]:
    """While open, the head's output is ``logprobs_of(hidden, weight, bias)`` of the hidden states it is
    handed (it projects none itself); the outputs made are listed in the yielded list."""
    made: list[Tensor] = []
    handed: list[Tensor] = []

    def take_hidden(module: torch.nn.Module, args: tuple) -> tuple:
        handed.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def give_logprobs(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        made.append(logprobs_of(handed.pop(), module.weight, module.bias))
        return made[-1]

    handles = [head.register_forward_pre_hook(take_hidden), head.register_forward_hook(give_logprobs)]
    try:
        yield made
    finally:
        for handle in handles:
            handle.remove()
