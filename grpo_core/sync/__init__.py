"""Weight sync behind one interface: the trainer's weights to the vLLM server after an optimizer step.

The trainer's side. vLLM's weight-transfer protocol over gloo (CPU; ``gloo_trainer`` sends to the engine
``grpo_core.vllm_plugin`` registers in every vLLM process) or NCCL (``nccl_trainer``), bucketed
(``bucket_stream``, ``packed_send``); storage patches (``storage_sync``); LoRA adapters through storage
(``lora``); ``factory`` picks one for a run, ``source`` names the weights as the server's checkpoint does.
What both sides agree on (bucket plans, delta encoding, digests, patch files, the rendezvous, the gloo
messages) is in ``wire``.
"""
