"""vLLM general plugin: registers the gloo weight-transfer backend in every vLLM process.

Declared in pyproject.toml under the ``vllm.general_plugins`` entry-point group, so vLLM calls
``register()`` once in the API server, the engine core, each worker and the subprocess that
inspects model classes. It must stay cheap and must not import torch-heavy modules of this
package: the engine class is registered lazily.

It also lets vLLM import its Qwen3-VL / Qwen3.5 model modules without torchvision (see
``_text_only_vision_imports``): this environment has none, and text-only serving never runs an
image processor.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from grpo_core.vllm_lines import installed_line

GLOO_BACKEND = "gloo"


def register() -> None:
    """Register the worker-side and trainer-side gloo engines with vLLM's factories (idempotent)."""
    _text_only_vision_imports()
    from vllm.distributed.weight_transfer import factory

    # Registering a name twice raises, and vLLM may call plugins more than once per process.
    if GLOO_BACKEND not in factory.WeightTransferEngineFactory._registry:
        factory.WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "grpo_core.vllm_plugin.gloo_engine", "GlooWeightTransferEngine"
        )
    line = installed_line()
    if line.trainer_engine_api and GLOO_BACKEND not in factory.WeightTransferTrainerFactory._registry:
        factory.WeightTransferTrainerFactory.register_engine(
            GLOO_BACKEND, "grpo_core.sync.send.gloo_trainer", "GlooTrainerWeightTransferEngine"
        )
    if not line.weight_version_routes:
        add_weight_version_routes()


INITIAL_WEIGHT_VERSION = "default"
"""What a server reports before its first push (vLLM's own name for the weights it loaded from disk)."""


def add_weight_version_routes(router: Any = None) -> None:
    """Give a server whose vLLM line lacks them (0.25) the two weight-version routes the trainer reads and writes:
    ``GET /weight_info`` and ``POST /update_weight_version``, on vLLM's dev-mode weight-transfer router (so they
    exist only where the other weight-transfer routes do). The version lives in the API server process; a server
    that restarts reports ``INITIAL_WEIGHT_VERSION`` again, which is how the trainer's restart watch tells.

    Runs in every vLLM process (plugins load before the API server builds its app, which then takes these routes
    with the rest of the router); in the others the router is imported and never served."""
    if router is None:
        try:
            from vllm.entrypoints.serve.dev.rlhf import api_router
        except ImportError:
            return
        router = api_router.router
    if any(getattr(route, "path", None) == "/weight_info" for route in router.routes):
        return
    from fastapi import Body
    from fastapi.responses import JSONResponse

    served = {"version": INITIAL_WEIGHT_VERSION}

    @router.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse(content={"weight_version": served["version"]})

    @router.post("/update_weight_version")
    async def update_weight_version(new_version: str = Body(embed=True)) -> JSONResponse:
        served["version"] = str(new_version)
        return JSONResponse(content={"success": True, "new_version": served["version"]})


# vLLM's qwen3_vl module (imported by qwen3_5 too) imports ``smart_resize`` from transformers'
# torchvision-backed Qwen2-VL image processor; transformers ships the same function in a PIL-backed
# module. Only image preprocessing differs between the two, and a server started language-model-only
# (``ServerOptions.language_model_only``) never preprocesses an image.
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilProcessorAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the torchvision-backed module name to the PIL-backed module, when it is imported."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name == _TORCHVISION_MODULE else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_PIL_MODULE)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its own name


def _text_only_vision_imports() -> None:
    """Without torchvision, let the torchvision-backed Qwen2-VL image-processor module resolve to
    transformers' PIL-backed one. Lazy (nothing is imported until vLLM asks for that module) and
    idempotent; does nothing when torchvision is installed."""
    if any(isinstance(f, _PilProcessorAlias) for f in sys.meta_path):
        return
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _PilProcessorAlias())
