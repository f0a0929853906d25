"""vLLM general plugin: registers the gloo weight-transfer backend in every vLLM process.

Declared in pyproject.toml under the ``vllm.general_plugins`` entry-point group, so vLLM calls
``register()`` once in the API server, the engine core and each worker. It must stay cheap and
must not import torch-heavy modules of this package: the engine class is registered lazily.
"""

from __future__ import annotations

GLOO_BACKEND = "gloo"


def register() -> None:
    """Register the worker-side and trainer-side gloo engines with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    # Registering a name twice raises, and vLLM may call plugins more than once per process.
    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "grpo_core.sync.gloo_engine", "GlooWeightTransferEngine"
        )
    if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            GLOO_BACKEND, "grpo_core.sync.gloo_engine", "GlooTrainerWeightTransferEngine"
        )
