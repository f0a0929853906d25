"""What TRL's ``AsyncGRPOTrainer`` does on an offline GPU machine as shipped: each attempt's exact error.

Run by ``peer_trl_gpu.py`` in a process of its own, before the measured runs:

1. its tree attention's kernel lookup as shipped (``packing._flash_attn``: ``kernels.get_kernel`` of
   ``kernels-community/flash-attn3`` from the Hugging Face Hub), without the ``kernels`` package;
2. the same with ``kernels`` 0.12.1 on the path (``KERNELS_SITE``: a folder it was installed into);
3. another attention through TRL's config (``model_init_kwargs={"attn_implementation": "sdpa"}``);
4. TRL's default weight transfer (``weight_transfer=None``), which needs vLLM.

Attempts 3 and 4 construct the trainer on a tiny model of the same family (the errors do not depend on
the size). The fifth, sdpa switched on the constructed model, runs but computes another function; the
CPU smoke run measures that (``trl_sdpa_swapped`` in its JSON).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.peers.peer_gpu_runs import NoWeightTransfer, StreamWorker, constant_reward, error_record, trl_samples
from benchmarks.peers.peer_gpu_stream import Stream, write_model_folder


def _attempt(what: str, fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        fn()
        result: dict[str, Any] = {"error": None, "outcome": "ran"}
    except BaseException as exc:  # noqa: BLE001 - SystemExit from a library is an outcome too
        result = error_record(exc)
    return {"attempt": what, **result, "seconds": round(time.perf_counter() - start, 2)}


def _construct(model_dir: str, stream: Stream, smoke: bool, **kwargs: Any) -> Any:
    import datasets
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLConfig, AsyncGRPOTrainer as TRLTrainer

    init = kwargs.pop("model_init_kwargs", None)
    with tempfile.TemporaryDirectory() as out:
        config = TRLConfig(output_dir=out, max_steps=1, report_to="none", save_strategy="no",
                           token_budget=stream.token_budget, bf16=not smoke, use_cpu=smoke, model_init_kwargs=init)
        return TRLTrainer(model=model_dir, reward_funcs=[constant_reward], args=config,
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["p"]}),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          rollout_worker=StreamWorker(trl_samples(stream)), **kwargs)


def probe_attempts(stream: Stream, smoke: bool, kernel: str) -> list[dict[str, Any]]:
    from trl.experimental.async_grpo import packing

    if smoke:  # a CPU build of torch: TRL reads the GPU's name for its MFU at construction (smoke runs only)
        import trl.experimental.async_grpo.async_grpo_trainer as trl_trainer

        trl_trainer.get_peak_flops_per_device = lambda *a, **k: None
    attempts = [_attempt("TRL's tree attention kernel as shipped: packing._flash_attn() -> kernels.get_kernel("
                         "'kernels-community/flash-attn3', version=1), no `kernels` package", packing._flash_attn)]
    site = os.environ.get("KERNELS_SITE")
    if site:
        sys.path.insert(0, site)
        packing._flash_attn.cache_clear()
        attempts.append(_attempt("the same with `kernels` 0.12.1 installed (pure Python; the machine has no "
                                 "network)", packing._flash_attn))
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_model_folder("tiny", Path(tmp) / "tiny", device))
        attempts.append(_attempt("another attention through TRL's config: AsyncGRPOConfig(model_init_kwargs="
                                 "{'attn_implementation': 'sdpa'})",
                                 lambda: _construct(tiny, stream, smoke, weight_transfer=NoWeightTransfer(),
                                                    model_init_kwargs={"attn_implementation": "sdpa"})))
        attempts.append(_attempt("TRL's default weight transfer (weight_transfer=None: NCCL into vLLM)",
                                 lambda: _construct(tiny, stream, smoke)))
    attempts.append({"attempt": f"TRL's tree attention with its kernel lookup pointed at an installed kernel "
                                f"({kernel}; TreeKernel in peer_gpu_runs.py)", "error": None,
                     "outcome": "used for the measured TRL runs (runs below)"})
    return attempts
