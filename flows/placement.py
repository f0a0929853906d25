"""Where a job's managed server and trainers run on the machine the flow starts them on, and what follows from it.

``server_spec`` is the managed server's launch: the trainer's backend and dtype, what the model needs of its server
(``vllm_server.model_needs``), and on a CUDA machine its GPU (``vllm_server.gpu_placement``). ``place_on_machine``
resolves, once, the one setting the server's launch and the trainers must agree on and that depends on the
placement: the weight-transfer backend.
"""

from __future__ import annotations

import dataclasses
import logging

from flows.provision import Provisioner
from grpo_core.launch.job import JobConfig
from grpo_core.vllm_server.model_needs import model_server_options
from grpo_core.vllm_server.process import VLLMServerSpec

log = logging.getLogger(__name__)


def server_spec(job: JobConfig, model_path: str, provisioner: Provisioner) -> VLLMServerSpec:
    """The managed server the job's trainer needs (its backend matches where the trainer will run), with
    what the model needs of it (bf16 for Gated DeltaNet layers on CPU, no vision tower: ``vllm_server.model_needs``)."""
    cuda = provisioner.trains_on_gpu()
    options = model_server_options(model_path, job.server.options(), cuda)
    gpus = provisioner.gpu_placement(job.nproc_per_node) if cuda else None
    if gpus is None:
        return VLLMServerSpec.for_run(model_path, job.trainer, options, cuda=cuda)
    return VLLMServerSpec.for_run(model_path, job.trainer, options, cuda=cuda, shared_gpu=gpus.shared,
                                  gpus=gpus.server_devices())


def place_on_machine(job: JobConfig, provisioner: Provisioner) -> JobConfig:
    """The job with the weight-transfer backend its GPU placement needs, where the job leaves it to the run: a
    managed server on the trainer's own GPU takes pushes through CUDA IPC (``weight_transfer_backend``'s
    documentation), and the server's launch and the trainers must agree on it, so the flow resolves it once."""
    if not job.server.managed or not provisioner.trains_on_gpu():
        return job
    gpus = provisioner.gpu_placement(job.nproc_per_node)
    if gpus is None:
        return job
    log.info("GPU placement: %s", gpus.describe())
    backend = job.trainer.resolved_weight_transfer_backend(True, shared_gpu=gpus.shared)
    if job.trainer.weight_transfer_backend == backend:
        return job
    log.info("weight_transfer_backend: %s (%s)", backend, gpus.describe())
    return job.model_copy(update={"trainer": dataclasses.replace(job.trainer, weight_transfer_backend=backend)})
