"""Weight sync behind one interface: the trainer's weights to the vLLM server after an optimizer step.

vLLM's weight-transfer protocol over gloo (CPU; ``gloo_engine``, registered in every vLLM process by
``vllm_plugin``) or NCCL (``nccl_trainer``), bucketed (``buckets``, ``bucket_stream``, ``packed_send``);
LoRA adapters through storage (``lora``); ``factory`` picks one for a run, ``source`` names the weights
as the server's checkpoint does.
"""
