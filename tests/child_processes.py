"""Child processes for the tests, forked from one process that has imported torch and the project once.

A spawned child starts a fresh interpreter and imports torch, transformers and the trainer again (about 11 s
on two cores, half of it torch's compiler stack), which made each multi-rank test mostly import time. The
forkserver imports them once per test session; each child is then a fork of it, and still receives its
function and arguments pickled, as a spawned child does (nothing of the test process is inherited). The
forkserver keeps the environment it started with: a child sets what it needs (MASTER_PORT, RANK, ...) itself.
The library's own processes (the rollout worker, the launcher's ranks) are not started this way.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

import torch.multiprocessing

# Imported in the forkserver before it forks anything; what the children import beyond these they import themselves.
PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "grpo_core.training.trainer",
           "grpo_core.sync.wire.gated_store", "grpo_core.checkpoint.checkpointer"]


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its preload set (the list only counts before the first child starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` children; raises (naming the rank) when any of them fails."""
    context()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
